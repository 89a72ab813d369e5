"""Attaching an auxiliary loss to the graph of the main loss (Megatron's auto-scaler trick)."""

from __future__ import annotations

from typing import Any

import paddle
from paddle.autograd import PyLayer

__all__ = ["AuxLossAutoScaler"]


class AuxLossAutoScaler(PyLayer):
    """Identity on ``output`` whose backward also feeds ``d(loss) = scale``.

    The main loss's backward then carries the (already coefficient-weighted) auxiliary loss's gradient too,
    while the forward value, and so the logged main loss, is unchanged. ``scale`` is the main loss's backward
    scale (loss scale / micro-batches), owned by whoever attaches the loss and set through the model
    (``DSv4ForCausalLM.set_aux_loss_backward_scale``), not a class-level global. A frozen ``output`` (indexer
    warm-up) comes back as a copy, so the main loss's backward still reaches the auxiliary loss; the frozen side
    gets no gradient (PaddleFleet returns ``output.clone()`` there too). Used for the MoE sequence aux loss, the
    indexers' KL losses and the MTP loss.
    """

    @staticmethod
    def forward(ctx: Any, output: paddle.Tensor, loss: paddle.Tensor, scale: float = 1.0) -> paddle.Tensor:
        ctx.save_for_backward(loss)
        ctx.scale = float(scale)
        ctx.output_needs_grad = not output.stop_gradient
        # Paddle refuses to hand back a leaf as a PyLayer output (in-place rule): copy leaves and frozen outputs.
        return output.clone() if output.is_leaf else output

    @staticmethod
    def backward(ctx: Any, grad_output: paddle.Tensor) -> tuple[paddle.Tensor | None, paddle.Tensor]:
        (loss,) = ctx.saved_tensor()
        return (grad_output if ctx.output_needs_grad else None), paddle.ones_like(loss) * ctx.scale
