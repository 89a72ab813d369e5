"""What Triton 3.6's interpreter needs to run fleet_ext's kernels on the CPU (applied by ``launch.launch`` before an
interpreted launch)."""

from __future__ import annotations

from typing import Any


def fix_scalar_index() -> None:
    """Let run-time scalars bound loops in the Triton interpreter.

    Triton 3.6's interpreter holds a scalar as a shape-(1,) NumPy array and turns it into a ``range`` bound
    with ``int(array)``, which NumPy 2.4 rejects ("only 0-dimensional arrays can be converted"); compiled
    kernels are unaffected. Wrap its tensor patching so ``__index__`` reads the single element instead.
    The interpreter applies its patching at every run, so wrapping it before the first interpreted launch
    is enough; idempotent.
    """
    from triton.runtime import interpreter

    original = interpreter._patch_lang_tensor
    if getattr(original, "_scalar_index_fixed", False):
        return

    def patched(tensor: Any, scope: Any) -> None:
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    patched._scalar_index_fixed = True
    interpreter._patch_lang_tensor = patched
