"""One training step of the tiny DSv4 causal LM, the same way in every model-level fusion test.

``model_step`` builds the model under ``paddle.seed(0)``, moves the constant initialisers off their constants
(``configs.move_constant_inits``: no gradient trivially 0 or 1), lets the caller plant a change, runs one forward and
backward on 2 x ``seq`` random token ids (``np.random.default_rng(3)``) and returns the model and what a comparison
needs: the loss, the logits and every parameter's gradient (``grad:<name>``). Paddle is imported on first use.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from .configs import move_constant_inits


def model_step(config: Any, seq: int, plant: Callable[[Any], None] | None = None) -> tuple[Any, dict[str, np.ndarray]]:
    """(model, {"loss", "logits", "grad:<name>"}) after one step of the model ``config`` (a dict or a loaded config)
    builds; ``plant(model)`` runs after the initialisers moved, before the step."""
    import paddle

    from fleet_ext.models import DSv4ForCausalLM

    paddle.seed(0)
    model = DSv4ForCausalLM(config)
    move_constant_inits(model, np.random.default_rng(0), 0.3)
    if plant is not None:
        plant(model)
    model.train()
    rng = np.random.default_rng(3)
    ids = paddle.to_tensor(rng.integers(0, 64, (2, seq)))
    logits, loss = model(ids, labels=paddle.to_tensor(rng.integers(0, 64, (2, seq))))
    loss.backward()
    result = {"loss": loss.numpy(), "logits": logits.numpy()}
    result.update({f"grad:{n}": p.grad.numpy() for n, p in model.named_parameters() if p.grad is not None})
    return model, result
