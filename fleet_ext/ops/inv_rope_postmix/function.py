"""Fused inverse RoPE + ungrouped VHA postmix for Paddle (``fuse_inv_rope_into_vha_postmix``).

Same signature and result as ``reference.inv_rope_vha_postmix`` (``mix @ inv_rope(out)`` over the head
axis), bitwise equal forward and backward:

- forward (``kernel.inv_rope_postmix_forward``): a full-width ``paddle.matmul(mix, out)`` on the
  unrotated output, plus a narrow GEMM on the inverse-rotated trailing channels written into the
  trailing columns; no full-width rotated intermediate (where the GEMM column-slice split is not known
  to be exact it falls back to the unfused composition, logged once);
- backward: the rotated tensor is rebuilt out of place with the Triton RoPE kernel and both gradients
  come from ``paddle._C_ops.matmul_grad`` on it, the very op the unfused ``paddle.matmul(mix, rotated)``
  backward runs, so ``d_mix`` and ``d_rotated`` are bitwise equal by construction on every machine;
  ``d_out`` is the RoPE gradient kernel applied to ``d_rotated`` (bitwise equal to autograd's).

``out`` is saved (not copied, never written); the caller's attention output is unchanged after backward.

``inv_rope_vha_postmix_fast`` (``inv_rope_postmix_mode: fast``) is the same op through the one-pass kernels of
``kernel_fast`` (forward 2 N of traffic, backward 3 N with a deterministic split-K ``d_mix``): not bitwise
(Triton's GEMM order), within the registry's stated tolerance, byte-identical run to run.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import paddle
from paddle.autograd import PyLayer

from fleet_ext.ops.inv_rope_postmix import kernel, kernel_fast
from fleet_ext.ops.rope import function as rope_function
from fleet_ext.ops.rope import kernel as rope_kernel
from fleet_ext.ops.rope import reference as rope_reference

_LOG = logging.getLogger(__name__)
_FALLBACK_LOGGED: set[tuple[int, int]] = set()


class _InvRopePostmix(PyLayer):
    @staticmethod
    def forward(ctx, out, cos, sin, mix):
        ctx.save_for_backward(out, cos, sin, mix)
        ctx.need_out, ctx.need_mix = not out.stop_gradient, not mix.stop_gradient
        return kernel.inv_rope_postmix_forward(out, cos, sin, mix, paddle.matmul)

    @staticmethod
    def backward(ctx, grad):
        out, cos, sin, mix = ctx.saved_tensor()
        rotated = rope_kernel.rope(out, cos, sin, inverse=True)
        d_mix, d_rotated = paddle._C_ops.matmul_grad(mix, rotated, grad, False, False)
        del rotated
        d_out = rope_kernel.rope_grad(d_rotated, cos, sin, inverse=True) if ctx.need_out else None
        return d_out, None, None, d_mix if ctx.need_mix else None


def _log_fallback(d: int, rope_dim: int) -> None:
    if (d, rope_dim) in _FALLBACK_LOGGED:
        return
    _FALLBACK_LOGGED.add((d, rope_dim))
    if paddle.distributed.get_rank() == 0:
        _LOG.warning(
            "fuse_inv_rope_into_vha_postmix: head dim %d with rope width %d cannot use the split GEMM "
            "(needs d %% %d == 0 and a pass-through width >= %d); running the bitwise-equal unfused composition "
            "(fused RoPE + one GEMM) for this shape", d, rope_dim, kernel.SPLIT_ALIGN, kernel.SPLIT_ALIGN,
        )


class _InvRopePostmixFast(PyLayer):
    @staticmethod
    def forward(ctx, out, cos, sin, mix):
        ctx.save_for_backward(out, cos, sin, mix)
        ctx.need_out, ctx.need_mix = not out.stop_gradient, not mix.stop_gradient
        return kernel_fast.forward(out, cos, sin, mix)

    @staticmethod
    def backward(ctx, grad):
        out, cos, sin, mix = ctx.saved_tensor()
        d_out, d_mix = kernel_fast.backward(out, cos, sin, mix, grad, ctx.need_out, ctx.need_mix)
        return d_out, None, None, d_mix


def _check(out: paddle.Tensor, cos: paddle.Tensor, sin: paddle.Tensor, mix: paddle.Tensor, rope: Callable | None
           ) -> None:
    """The reference's validation (same messages), and the RoPE kernel's: both modes rotate with it."""
    if rope not in (None, rope_reference.apply_partial_rope, rope_function.apply_partial_rope):
        raise ValueError(f"inv_rope_vha_postmix: `rope` must be fleet_ext.ops.rope's apply_partial_rope (reference "
                         f"or fused), got {rope!r}; the fused op rotates with the Triton RoPE kernel")
    if out.ndim != 4 or mix.shape != [out.shape[2], out.shape[2]]:
        raise ValueError(f"inv_rope_vha_postmix: `out` [b, s, h, d] and `mix` [h, h] expected, got {out.shape}, "
                         f"{mix.shape}")
    rope_kernel.check_args(out, cos, sin)
    rope_function.check_tables(cos, sin, "inv_rope_vha_postmix")


def inv_rope_vha_postmix(
    out: paddle.Tensor, cos: paddle.Tensor, sin: paddle.Tensor, mix: paddle.Tensor, rope: Callable | None = None
) -> paddle.Tensor:
    """out [b, s, h, d], mix [h, h] -> ``mix @ inv_rope(out)`` [b, s, h, d], no full-width rotated intermediate.

    ``rope`` is accepted for signature compatibility with the reference: the fused op always rotates with
    the Triton RoPE kernel, so only fleet_ext's own RoPE (reference or fused, bitwise equal) is accepted.
    """
    _check(out, cos, sin, mix, rope)
    if kernel.split_start(out.shape[-1], 2 * cos.shape[-1]) is None:
        _log_fallback(out.shape[-1], 2 * cos.shape[-1])
    return _InvRopePostmix.apply(out, cos, sin, mix.astype(out.dtype))


def inv_rope_vha_postmix_fast(
    out: paddle.Tensor, cos: paddle.Tensor, sin: paddle.Tensor, mix: paddle.Tensor, rope: Callable | None = None
) -> paddle.Tensor:
    """``mix @ inv_rope(out)`` through the one-pass kernels (``inv_rope_postmix_mode: fast``; not bitwise).

    ``mix`` goes to the kernels in its own dtype (rounded to ``out``'s in registers, as the reference's cast
    does), so ``d_mix`` comes back in that dtype straight from the fp32 sums.
    """
    _check(out, cos, sin, mix, rope)
    kernel_fast.check_fast_args(out, cos, sin, mix)
    return _InvRopePostmixFast.apply(out, cos, sin, mix)
