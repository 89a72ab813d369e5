"""The dtype a Paddle matmul computes in under autocast, for matmuls that Paddle's autocast cannot see.

Paddle's autocast (``paddle.amp.auto_cast``; the trainer's ``bf16: true`` is its O1 level) casts the inputs of the
ops on its white list (``matmul``, ``bmm``, ...) to bf16 or fp16. A layer whose matmuls run in a fused Triton op, or
in a PyLayer of its own, gets no such cast: under O1 its fp32 inputs (the residual stream) and fp32 master weights
would reach it as fp32, and a fused op would then run its slow fp32 kernels where the reference's matmuls would
have run in bf16. Such a layer asks :func:`autocast_matmul_dtype` and casts its own operands, so that the reference
and the fused op both compute where a Paddle matmul would. (Paddle's autocast is a no-op on the CPU: this returns
None there.)
"""

from __future__ import annotations

import paddle

__all__ = ["autocast_matmul_dtype"]

_LOW_PRECISION = {"bfloat16": paddle.bfloat16, "float16": paddle.float16}


def autocast_matmul_dtype(operand: paddle.Tensor) -> paddle.dtype | None:
    """The dtype Paddle's autocast would cast ``operand`` to for a matmul: bf16 / fp16 when autocast is on and
    ``operand`` is fp32, else None (autocast off, O2 weights already in low precision, or not fp32)."""
    if operand.dtype != paddle.float32 or not paddle.is_autocast_enabled():
        return None
    return _LOW_PRECISION.get(str(paddle.get_autocast_dtype()))
