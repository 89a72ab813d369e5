"""The backend provider: reads the fusion switches once, at build time, and hands layers their ops.

Each op slot gets either the pure-Paddle reference (``fleet_ext/ops/<op>/reference.py``) or a fused
kernel. The choice, and the reason for it, is recorded so the start-up table can print it
(DESIGN.md rules 2 and 3). Switches that can never run are rejected earlier, by the config.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from fleet_ext.config import FleetExtConfig


@dataclass(frozen=True)
class AttentionOps:
    """The callables a DSv4 attention layer uses."""

    rope: Callable
    q_rms_norm: Callable
    sparse_attn: Callable


@dataclass(frozen=True)
class ResolvedSwitch:
    """One row of the start-up table: a switch, the backend it resolved to, and why."""

    switch: str
    value: object
    backend: str
    reason: str


class BackendProvider:
    """Resolves every op slot from the config; built once per model."""

    def __init__(self, config: FleetExtConfig) -> None:
        from fleet_ext.ops.q_rms_norm.reference import q_rms_norm
        from fleet_ext.ops.rope.reference import apply_partial_rope
        from fleet_ext.ops.sparse_attn.reference import sparse_attention_with_sink

        fusion = config.fusion
        self._rows: list[ResolvedSwitch] = []
        rope = self._resolve("apply_rope_fusion", fusion.apply_rope_fusion, apply_partial_rope)
        q_norm = self._resolve("dsv4_q_rms_norm_fusion", fusion.dsv4_q_rms_norm_fusion, q_rms_norm)
        sparse = self._resolve("csa_sparse_attn_backend", fusion.csa_sparse_attn_backend, sparse_attention_with_sink)
        for name in (
            "fuse_inv_rope_into_vha_postmix",
            "sparse_attn_global_kv_idx_remap_fusion",
            "dsa_sink_grad_fusion",
            "use_fused_mhc",
            "mqa_sparse_attn_backend",
        ):
            self._resolve(name, getattr(fusion, name), None)
        self.attention_ops = AttentionOps(rope=rope, q_rms_norm=q_norm, sparse_attn=sparse)

    def _resolve(self, switch: str, value: object, reference: Callable | None) -> Callable | None:
        # The config rejects every switch whose kernel has not landed, so only the reference path
        # reaches here; fused kernels register their gates in this method when they land.
        self._rows.append(ResolvedSwitch(switch, value, "reference (pure Paddle)", "switch off (default)"))
        return reference

    @property
    def resolved(self) -> list[ResolvedSwitch]:
        return list(self._rows)

    def format_table(self) -> str:
        """The start-up table: switch | value | backend | reason."""
        header = ("switch", "value", "backend", "reason")
        rows = [header] + [(r.switch, str(r.value), r.backend, r.reason) for r in self._rows]
        widths = [max(len(row[i]) for row in rows) for i in range(4)]
        lines = [" | ".join(cell.ljust(w) for cell, w in zip(row, widths)) for row in rows]
        lines.insert(1, "-+-".join("-" * w for w in widths))
        return "\n".join(lines)
