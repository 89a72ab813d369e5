"""The ``checkpoint`` section: checkpoint formats (saved names are always the unfused, unsharded ones)."""

from __future__ import annotations

from dataclasses import dataclass

from fleet_ext.config.fields import Section, key_field

__all__ = ["CheckpointConfig"]

_key = key_field


@dataclass
class CheckpointConfig(Section):
    """Checkpoint format (the saved names are always the unfused, unsharded ones)."""

    save_checkpoint_format: str = _key("flex_checkpoint", "Format of saved checkpoints.", ("flex_checkpoint",))
    load_checkpoint_format: str = _key("flex_checkpoint", "Format of loaded checkpoints.", ("flex_checkpoint",))
