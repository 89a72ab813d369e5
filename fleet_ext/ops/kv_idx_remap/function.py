"""Fused per-batch-local -> flat-global KV index remap for Paddle (one Triton kernel).

``local_to_global_flat`` has the reference's contract (``reference.py``: same arguments, result shape and
dtype, same validation messages) and is bitwise equal to it, with one deliberate difference: an int32
table whose flat ids could leave int32 (``B * seqlen_kv > 2**31``) raises ``ValueError`` instead of
silently wrapping around as the eager int32 arithmetic does; pass int64 indices there. Integer indices
carry no gradient, so there is no PyLayer.
"""

from __future__ import annotations

import paddle

from fleet_ext import capability

capability.prepare_triton()  # interpreter mode on a CPU machine; must precede the kernel import

from fleet_ext.ops.kv_idx_remap import kernel  # noqa: E402


def local_to_global_flat(local_idx: paddle.Tensor, seqlen_kv: int) -> paddle.Tensor:
    """``[B, S, K]`` local ids into ``kv.reshape([B*N, d])`` ids: ``idx + b*seqlen_kv`` where ``idx >= 0``.

    Negative (invalid) entries are returned unchanged. The result is a new contiguous ``[B*S, K]`` tensor
    in the input's int dtype; ``local_idx`` may have any strides.
    """
    if not isinstance(local_idx, paddle.Tensor):
        raise ValueError(f"local_to_global_flat: `local_idx` must be a paddle.Tensor, got {type(local_idx).__name__}")
    return kernel.local_to_global_flat(local_idx, seqlen_kv)
