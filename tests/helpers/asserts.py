"""Comparisons every test uses: byte-for-byte equality, and closeness within a named tolerance.

Both take Paddle or torch tensors (any device; bf16 included), NumPy arrays or Python scalars and import
neither framework at module level (tests/gpu runs without Paddle; torch is imported only for torch tensors).
Failures say what differs and where: how many elements, the first (or worst) index with both values, and the
largest difference. Torch tensors are compared bit for bit where they live; only a failure goes to the host.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .tolerances import Tol, tolerance

_INT_OF_SIZE = {1: "uint8", 2: "int16", 4: "int32", 8: "int64"}


def _is_torch(t: Any) -> bool:
    return type(t).__module__.startswith("torch")


def _is_paddle(t: Any) -> bool:
    return type(t).__module__.startswith("paddle")


def _describe(t: Any) -> tuple[str, tuple[int, ...]]:
    """(dtype name, shape) of a tensor, array or scalar: 'float32', 'bfloat16', 'int64', ..."""
    if _is_torch(t) or _is_paddle(t):
        return str(t.dtype).rsplit(".", 1)[-1], tuple(int(n) for n in t.shape)
    a = np.asarray(t)
    return a.dtype.name, a.shape


def _torch_bits(t: Any) -> Any:
    """A torch tensor's raw bit patterns (an integer view of its bytes), where it lives."""
    import torch

    t = t.detach().contiguous()
    return t.view(getattr(torch, _INT_OF_SIZE[t.element_size()])) if t.is_floating_point() else t


def _host_bits(t: Any) -> np.ndarray:
    if _is_torch(t):
        return _torch_bits(t).cpu().numpy()
    a = np.asarray(t.numpy() if _is_paddle(t) else t)
    return a.view(f"u{a.itemsize}") if a.dtype.kind in "fVb" else a  # floats (bf16 too) and bools by bytes


def _host_values(t: Any) -> np.ndarray:
    """float64 values on the host (bf16 and fp16 widen exactly)."""
    if _is_torch(t):
        return t.detach().double().cpu().numpy()
    return np.asarray(t.numpy() if _is_paddle(t) else t).astype(np.float64)


def _as_torch_like(array: Any, like: Any) -> Any:
    """A NumPy ``want`` for a torch ``got``: cast to got's dtype, refusing any cast that is not exact."""
    import torch

    want = torch.from_numpy(np.ascontiguousarray(array)).to(like.device).to(like.dtype)
    back = want.double().cpu().numpy()
    if not np.array_equal(back, np.asarray(array, np.float64), equal_nan=True):
        raise AssertionError(f"the NumPy value is not exactly representable in {like.dtype}: compare it otherwise")
    return want


def _first(mask: np.ndarray) -> tuple[int, ...]:
    return tuple(int(i) for i in np.argwhere(mask)[0]) if mask.ndim else ()


def assert_bitwise(got: Any, want: Any, what: str = "") -> None:
    """``got`` and ``want`` have the same dtype, shape and bytes (signed zeros and NaN payloads included)."""
    if _is_torch(got) != _is_torch(want):  # a NumPy oracle for a torch result: exact casts only
        got, want = (got, _as_torch_like(want, got)) if _is_torch(got) else (_as_torch_like(got, want), want)
    label = f"{what}: " if what else ""
    (got_dtype, got_shape), (want_dtype, want_shape) = _describe(got), _describe(want)
    if got_dtype != want_dtype or got_shape != want_shape:
        raise AssertionError(f"{label}got {got_dtype}{list(got_shape)}, want {want_dtype}{list(want_shape)}")
    if _is_torch(got):  # compare where the tensors live; only a failure is brought to the host
        import torch

        if torch.equal(_torch_bits(got), _torch_bits(want)):
            return
    differ = _host_bits(got) != _host_bits(want)
    if not differ.any():
        return
    index = _first(differ)
    got_values, want_values = _host_values(got), _host_values(want)
    diff = np.abs(got_values - want_values)
    largest = np.nanmax(diff) if not np.isnan(diff).all() else float("nan")
    raise AssertionError(
        f"{label}{int(differ.sum())} of {differ.size} elements differ; first at {index}: got "
        f"{got_values[index]!r} want {want_values[index]!r}; max |diff| {largest:.3e}"
        + (" (only signs of zero or NaN payloads)" if largest == 0 else "")
    )


def assert_close(got: Any, want: Any, dtype: str, name: str, *, what: str = "", scale: Any = None) -> None:
    """``got`` within the tolerance ``name`` of the ``dtype`` table (tolerances.py) of ``want``.

    ``scale`` replaces the largest ``|want|`` in the entry's ``of_scale`` term (a scalar or an array that
    broadcasts). Shapes must match (a scalar ``want`` broadcasts); any NaN, and any infinity not matched
    exactly, fails.
    """
    tol = tolerance(dtype, name)
    g, w = _host_values(got), _host_values(want)
    scale = None if scale is None else _host_values(scale)
    label = f"{what}: " if what else ""
    if w.shape != g.shape:
        if w.ndim:
            raise AssertionError(f"{label}got shape {list(g.shape)}, want {list(w.shape)}")
        w = np.broadcast_to(w, g.shape)
    _check_non_finite(g, w, label)
    finite = np.isfinite(w)
    g, w = np.where(finite, g, 0.0), np.where(finite, w, 0.0)
    if tol.norm:
        err, bound = float(np.linalg.norm(g - w)), tol.rtol * float(np.linalg.norm(w)) + tol.atol
        if not err <= bound:
            raise AssertionError(f"{label}||got - want|| = {err:.3e} > {bound:.3e} ({dtype} {name!r}: {tol})")
        return
    _check_elements(g, w, tol, scale, f"{label}", f"{dtype} {name!r}")


def _check_non_finite(g: np.ndarray, w: np.ndarray, label: str) -> None:
    nan = np.isnan(g) | np.isnan(w)
    if nan.any():
        raise AssertionError(f"{label}NaN in {'got' if np.isnan(g).any() else 'want'} at {_first(nan)}")
    mismatch = (np.isinf(g) | np.isinf(w)) & (g != w)
    if mismatch.any():
        index = _first(mismatch)
        raise AssertionError(f"{label}non-finite mismatch at {index}: got {g[index]!r} want {w[index]!r}")


def _check_elements(g: np.ndarray, w: np.ndarray, tol: Tol, scale: Any, label: str, entry: str) -> None:
    diff = np.abs(g - w)
    if tol.of_scale:
        ref = (np.abs(w).max() if w.size else 0.0) if scale is None else np.asarray(scale, np.float64)
        bound = tol.atol + tol.rtol * np.abs(w) + tol.of_scale * ref
    else:
        bound = tol.atol + tol.rtol * np.abs(w)
    bound = np.broadcast_to(bound, diff.shape)
    over = ~(diff <= bound)
    if not over.any():
        return
    excess = np.where(over, diff - bound, -np.inf)
    index = np.unravel_index(int(np.argmax(excess)), diff.shape) if diff.ndim else ()
    raise AssertionError(
        f"{label}{int(over.sum())} of {over.size} elements outside {entry} {tol}; "
        f"worst at {tuple(int(i) for i in index)}: got {g[index]!r} want {w[index]!r} "
        f"|diff| {diff[index]:.3e} > bound {bound[index]:.3e}; max |diff| {diff.max():.3e}"
    )
