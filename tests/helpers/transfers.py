"""Count the host round trips of a piece of Paddle code (issue 9: "no host round trips in the step").

On a GPU every device-to-host read stalls the stream until the device catches up. Paddle's CPU build has no
device, so the count is taken by patching the ways out of a tensor instead of timing them:

- explicit reads, methods of ``paddle.Tensor``: ``numpy``, ``tolist``, ``item``, ``__bool__`` (``if t:``),
  ``__nonzero__``, ``__int__``, ``__float__``, ``__complex__``, ``__index__`` (``range(t)``, slicing with a
  tensor), ``__array__`` (``np.asarray(t)``), ``__format__`` / ``__repr__`` / ``__str__`` (printing), ``cpu``,
  ``_md5sum``, ``__reduce_ex__`` (pickling);
- implicit reads: ops whose output shape depends on the values, so Paddle's GPU kernels copy a size to the host
  before allocating (``paddle.nonzero``, ``masked_select``, ``unique``, ``unique_consecutive``, ``bincount``,
  ``repeat_interleave`` with tensor repeats, one-argument ``paddle.where``, indexing with a boolean tensor).

Host-to-device copies are counted at ``paddle.to_tensor`` and ``paddle.assign`` of host data (NumPy arrays,
lists, Python scalars). Only the outermost call counts (``tolist`` calls ``numpy`` inside). Each event is keyed
by ``(what, site)``, the site being the innermost ``fleet_ext`` source line on the stack (``file:line``), so a
test can tell a layer's transfers from another's. Imports Paddle only when a counter is entered.

Not seen: a read made inside a C++ kernel other than the ops above (e.g. an op handed a tensor where it needs a
shape or a bound), and host data turned into a tensor other than by ``to_tensor`` / ``assign`` (the ``Tensor``
constructor).
"""

from __future__ import annotations

import collections
import threading
import traceback
from typing import Any

__all__ = ["TENSOR_EXITS", "HostTransfers"]

TENSOR_EXITS = (
    "numpy", "tolist", "item", "__bool__", "__nonzero__", "__int__", "__float__", "__complex__", "__index__",
    "__array__", "__format__", "__repr__", "__str__", "cpu", "_md5sum", "__reduce_ex__",
)
# Module functions whose output size depends on the values (an implicit device-to-host read on a GPU).
_SHAPE_FROM_VALUES = ("nonzero", "masked_select", "unique", "unique_consecutive", "bincount")


def _site() -> str:
    for frame in reversed(traceback.extract_stack()[:-3]):
        if "/fleet_ext/" in frame.filename:
            return f"{frame.filename.split('/fleet_ext/')[-1]}:{frame.lineno}"
    frame = traceback.extract_stack()[-4]
    return f"outside fleet_ext ({frame.filename.rsplit('/', 1)[-1]}:{frame.lineno})"


def _is_host_data(value: Any) -> bool:
    import numpy as np

    return isinstance(value, (np.ndarray, np.generic, list, tuple, int, float, bool))


class HostTransfers:
    """``with HostTransfers() as t: ...`` then ``t.to_host`` / ``t.to_device``: Counters of ``(what, site)``.

    ``paused()`` stops counting for a block (e.g. a test's own reads). Not re-entrant across threads.
    """

    def __init__(self) -> None:
        self.to_host: collections.Counter = collections.Counter()
        self.to_device: collections.Counter = collections.Counter()
        self._depth = 0
        self._active = False
        self._saved: list[tuple[Any, str, Any]] = []
        self._lock = threading.Lock()

    # -- counting ------------------------------------------------------------------------------------
    def _record(self, counter: collections.Counter, what: str, fn: Any, *args: Any, **kwargs: Any) -> Any:
        if not self._active or self._depth:
            return fn(*args, **kwargs)
        counter[(what, _site())] += 1
        self._depth += 1
        try:
            return fn(*args, **kwargs)
        finally:
            self._depth -= 1

    def _wrap_exit(self, name: str, fn: Any) -> Any:
        def patched(*args: Any, **kwargs: Any) -> Any:
            return self._record(self.to_host, name, fn, *args, **kwargs)

        return patched

    def _wrap_getitem(self, fn: Any) -> Any:
        import paddle

        def patched(tensor: Any, index: Any) -> Any:
            parts = index if isinstance(index, tuple) else (index,)
            if any(isinstance(p, paddle.Tensor) and p.dtype == paddle.bool for p in parts):
                return self._record(self.to_host, "__getitem__[bool mask]", fn, tensor, index)
            return fn(tensor, index)

        return patched

    def _wrap_where(self, fn: Any) -> Any:
        def patched(condition: Any, x: Any = None, y: Any = None, name: Any = None) -> Any:
            if x is None and y is None:
                return self._record(self.to_host, "where(condition)", fn, condition)
            return fn(condition, x, y, name)

        return patched

    def _wrap_repeat_interleave(self, fn: Any) -> Any:
        import paddle

        def patched(x: Any, repeats: Any, *args: Any, **kwargs: Any) -> Any:
            if isinstance(repeats, paddle.Tensor):
                return self._record(self.to_host, "repeat_interleave(tensor repeats)", fn, x, repeats, *args, **kwargs)
            return fn(x, repeats, *args, **kwargs)

        return patched

    def _wrap_entry(self, name: str, fn: Any) -> Any:
        def patched(data: Any, *args: Any, **kwargs: Any) -> Any:
            if _is_host_data(data):
                return self._record(self.to_device, name, fn, data, *args, **kwargs)
            return fn(data, *args, **kwargs)

        return patched

    # -- patching ------------------------------------------------------------------------------------
    def _patch(self, owner: Any, name: str, make: Any) -> None:
        original = getattr(owner, name)
        self._saved.append((owner, name, original))
        setattr(owner, name, make(original))

    def __enter__(self) -> HostTransfers:
        import paddle

        self._lock.acquire()
        tensor = paddle.Tensor
        for name in TENSOR_EXITS:
            if hasattr(tensor, name):
                self._patch(tensor, name, lambda fn, name=name: self._wrap_exit(name, fn))
        self._patch(tensor, "__getitem__", self._wrap_getitem)
        for name in _SHAPE_FROM_VALUES:
            self._patch(paddle, name, lambda fn, name=name: self._wrap_exit(name, fn))
            if hasattr(tensor, name):
                self._patch(tensor, name, lambda fn, name=name: self._wrap_exit(f"Tensor.{name}", fn))
        self._patch(paddle, "where", self._wrap_where)
        self._patch(paddle, "repeat_interleave", self._wrap_repeat_interleave)
        for name in ("to_tensor", "assign"):
            self._patch(paddle, name, lambda fn, name=name: self._wrap_entry(name, fn))
        self._active = True
        return self

    def __exit__(self, *exc: Any) -> None:
        self._active = False
        for owner, name, original in reversed(self._saved):
            setattr(owner, name, original)
        self._saved.clear()
        self._lock.release()

    def paused(self) -> Any:
        """A context in which nothing is counted."""
        outer = self

        class _Paused:
            def __enter__(self) -> None:
                outer._depth += 1

            def __exit__(self, *exc: Any) -> None:
                outer._depth -= 1

        return _Paused()

    # -- reading -------------------------------------------------------------------------------------
    def clear(self) -> None:
        self.to_host.clear()
        self.to_device.clear()

    def to_host_where(self, keep: Any) -> collections.Counter:
        """The device-to-host events whose site satisfies ``keep(site)``."""
        return collections.Counter({k: v for k, v in self.to_host.items() if keep(k[1])})

    def report(self) -> str:
        """One line per event kind and site, for assertion messages and benchmark tables."""
        lines = [f"  to host   {n:4d}  {what:<34} {site}" for (what, site), n in sorted(self.to_host.items())]
        lines += [f"  to device {n:4d}  {what:<34} {site}" for (what, site), n in sorted(self.to_device.items())]
        return "\n".join(lines) or "  (none)"
