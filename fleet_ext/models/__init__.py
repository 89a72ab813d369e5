"""Models built from fleet_ext blocks. ``DSv4ForCausalLM`` is imported lazily (it needs Paddle)."""

__all__ = ["DSv4ForCausalLM"]


def __getattr__(name: str):
    if name == "DSv4ForCausalLM":
        from fleet_ext.models.dsv4 import DSv4ForCausalLM

        return DSv4ForCausalLM
    raise AttributeError(f"module 'fleet_ext.models' has no attribute {name!r}")
