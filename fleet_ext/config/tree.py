"""The config tree: one section per concern, read from and written to a flat YAML.

``load_config`` refuses unknown keys (with a did-you-mean), renamed keys (with the new name) and
PaddleFleet options fleet_ext does not have; each section then checks its keys (types, domains, its
own rules) and the tree checks the rules that span sections. Everything that needs only the config
fails here; what needs the machine is checked once at start-up (``training.trainer.check_runtime``).
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import typing
from dataclasses import dataclass, field, fields
from typing import Any

import yaml

from fleet_ext.config.checkpoint import CheckpointConfig
from fleet_ext.config.fields import fail
from fleet_ext.config.fusion import FusionConfig
from fleet_ext.config.model import ModelConfig
from fleet_ext.config.moe import MoEConfig
from fleet_ext.config.names import PADDLEFLEET_ONLY_KEYS, RENAMED_KEYS, absent_key_message, renamed_key_message
from fleet_ext.config.parallel import ParallelConfig, check_context_parallel, check_expert_parallel
from fleet_ext.config.recompute import RecomputeConfig, recompute_plan
from fleet_ext.config.training import TrainingConfig

__all__ = ["KEY_TO_SECTION", "SECTIONS", "FleetExtConfig", "config_key_table", "load_config"]

SECTIONS: dict[str, type] = {
    "model": ModelConfig,
    "moe": MoEConfig,
    "parallel": ParallelConfig,
    "recompute": RecomputeConfig,
    "checkpoint": CheckpointConfig,
    "fusion": FusionConfig,
    "training": TrainingConfig,
}


def _key_to_section() -> dict[str, str]:
    out: dict[str, str] = {}
    for section, cls in SECTIONS.items():
        for f in fields(cls):
            if f.name in out:  # pragma: no cover - guarded by a test as well
                raise RuntimeError(f"config key {f.name} is declared in two sections")
            out[f.name] = section
    return out


KEY_TO_SECTION: dict[str, str] = _key_to_section()


def _check_key(key: Any) -> str:
    """The section of ``key``; ``ValueError`` for a renamed, PaddleFleet-only or unknown key."""
    if not isinstance(key, str):
        raise ValueError(f"config key {key!r} is not a name: config keys are strings such as `hidden_size`")
    if key in RENAMED_KEYS:
        raise ValueError(renamed_key_message(key))
    if key in PADDLEFLEET_ONLY_KEYS:
        raise ValueError(absent_key_message(key))
    if key not in KEY_TO_SECTION:
        close = difflib.get_close_matches(key, list(KEY_TO_SECTION), n=3, cutoff=0.6)
        hint = f" Did you mean {', '.join('`' + c + '`' for c in close)}?" if close else ""
        raise ValueError(f"unknown config key `{key}`.{hint} The keys are listed in the README's config table.")
    return KEY_TO_SECTION[key]


@dataclass
class FleetExtConfig:
    """The whole config: one section per concern, flat keys in the YAML."""

    model: ModelConfig = field(default_factory=ModelConfig)
    moe: MoEConfig = field(default_factory=MoEConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    recompute: RecomputeConfig = field(default_factory=RecomputeConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    fusion: FusionConfig = field(default_factory=FusionConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)

    def __post_init__(self) -> None:
        """Rules that span sections; then the registry's verdict on every fusion switch."""
        m, moe, t = self.model, self.moe, self.training
        for key in ("moe_n_hash_layers", "first_k_dense_replace"):
            if getattr(moe, key) > m.num_hidden_layers:
                what = "hash-routed" if key == "moe_n_hash_layers" else "dense"
                fail(key, getattr(moe, key), f"<= num_hidden_layers ({m.num_hidden_layers})",
                     f"lower the number of {what} layers")
        if moe.moe_n_hash_layers and moe.first_k_dense_replace:
            fail(
                "first_k_dense_replace",
                moe.first_k_dense_replace,
                "0 when moe_n_hash_layers > 0 (hash-routed layers are the first MoE layers, as in DSv4)",
                "use either dense first layers or hash-routed first layers",
            )
        if t.max_seq_len > m.max_position_embeddings:
            fail(
                "max_seq_len",
                t.max_seq_len,
                f"<= max_position_embeddings ({m.max_position_embeddings})",
                "shorten the sequences or raise max_position_embeddings",
            )

        check_context_parallel(m, t.max_seq_len, self.parallel.context_parallel_size)
        check_expert_parallel(moe, self.parallel.expert_model_parallel_size)
        recompute_plan(self)  # recompute against the model: layer counts, which layers have each module

        from fleet_ext.registry import config_errors  # no Paddle import; registry reads this config duck-typed

        for switch, value, reason, fix in config_errors(self):
            raise ValueError(f"config key `{switch}` = {value!r} can never run: {reason}. Fix: {fix}")

    # -- YAML / dict -------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """Flat ``{key: value}`` of every key, defaults included; ``load_config`` inverts it exactly."""
        out: dict[str, Any] = {}
        for name in SECTIONS:
            out.update(dataclasses.asdict(getattr(self, name)))
        return out

    def save_yaml(self, path: str | os.PathLike) -> None:
        """Write a flat YAML with one ``### section`` comment block per section."""
        lines = []
        for name, cls in SECTIONS.items():
            lines.append(f"### {name}: {cls.__doc__.strip().splitlines()[0]}")
            for key, value in dataclasses.asdict(getattr(self, name)).items():
                dumped = yaml.safe_dump({key: value}, default_flow_style=True, width=10_000).strip()
                lines.append(dumped[1:-1])  # drop the braces of the one-entry flow mapping
            lines.append("")
        with open(path, "w", encoding="utf-8") as fh:
            fh.write("\n".join(lines))

    def replace(self, **overrides: Any) -> FleetExtConfig:
        """A copy with some flat keys changed (validated like a YAML)."""
        flat = self.to_dict()
        for key in overrides:
            _check_key(key)
        flat.update(overrides)
        return load_config(flat)


def _read_yaml(source: str | os.PathLike) -> dict[str, Any]:
    path = os.fspath(source)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"config file {path!r} does not exist")
    with open(path, encoding="utf-8") as fh:
        try:
            loaded = yaml.safe_load(fh)
        except yaml.YAMLError as exc:
            raise ValueError(f"config file {path!r} is not valid YAML: {exc}") from exc
    if loaded is None:
        return {}
    if not isinstance(loaded, dict):
        raise ValueError(f"config file {path!r} must hold a mapping of keys to values, got {type(loaded).__name__}")
    return loaded


def _flatten(raw: dict[str, Any]) -> dict[str, Any]:
    """Flat keys, or keys nested under their section's name (each must belong to that section)."""
    flat: dict[str, Any] = {}
    for key, value in raw.items():
        if key in SECTIONS and isinstance(value, dict):
            for sub_key, sub_value in value.items():
                if _check_key(sub_key) != key:
                    raise ValueError(
                        f"config key `{sub_key}` belongs to section `{KEY_TO_SECTION[sub_key]}`, not `{key}`"
                    )
                flat[sub_key] = sub_value
        elif key in SECTIONS:
            raise ValueError(
                f"config section `{key}` = {value!r} is invalid: allowed a mapping of its keys. "
                f"Fix: write `{key}:` followed by indented `key: value` lines, or give the keys flat"
            )
        else:
            flat[key] = value
    return flat


def load_config(source: str | os.PathLike | dict | None = None, **overrides: Any) -> FleetExtConfig:
    """Build the config from a YAML path or a dict (flat keys, or nested by section name).

    Unknown keys raise with a did-you-mean, renamed keys raise with their new name, and values are
    type-checked and validated by each section and then by the tree, always as ``ValueError`` naming a key.
    """
    if source is None:
        raw: dict[str, Any] = {}
    elif isinstance(source, dict):
        raw = dict(source)
    else:
        raw = _read_yaml(source)
    flat = _flatten(raw)
    flat.update(overrides)
    per_section: dict[str, dict[str, Any]] = {name: {} for name in SECTIONS}
    for key, value in flat.items():
        per_section[_check_key(key)][key] = value
    return FleetExtConfig(**{name: SECTIONS[name](**values) for name, values in per_section.items()})


def _domain_note(f: dataclasses.Field, annotation: Any) -> str:
    domain = f.metadata.get("domain")
    if domain is None:
        return ""
    optional = type(None) in typing.get_args(annotation)
    integer = int in (annotation, *typing.get_args(annotation))
    return f" Allowed: {'null or ' if optional else ''}{domain.describe(integer)}."


def config_key_table() -> list[tuple[str, str, Any, str]]:
    """(section, key, default, help) for every key, in declaration order; feeds the README table."""
    rows = []
    for name, cls in SECTIONS.items():
        hints = typing.get_type_hints(cls)
        for f in fields(cls):
            default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
            help_text = f.metadata["help"]
            if "choices" in f.metadata:
                help_text += " One of: " + ", ".join(str(c) for c in f.metadata["choices"]) + "."
            help_text += _domain_note(f, hints[f.name])
            rows.append((name, f.name, default, help_text))
    return rows
