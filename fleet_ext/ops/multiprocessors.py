"""The GPU's multiprocessor (SM) count, read once, for the launch heuristics that size grids by it.

Persistent grids (one program per SM) and "too few programs to fill the GPU" thresholds depend on the device,
not on a constant (an H200 has 132 SMs; other GPUs have other counts). Triton's driver reports it for the current
device; this module imports no framework (kernel modules stay importable without Paddle or torch).
"""

from __future__ import annotations

from typing import Any

H200_SMS = 132  # what the norm and RoPE heuristics take in the interpreter: the GPU geometry they were tuned on
_COUNT: list[int] = []  # the active device's count, read on first use (one kind of GPU per process)


def multiprocessor_count(kernel: Any, interpreted: int) -> int:
    """The SMs of the current GPU, or ``interpreted`` when ``kernel`` was built for Triton's interpreter.

    In the interpreter there is no device to ask; each caller names the value its CPU tests' launch geometry
    assumes (the persistent GEMMs take 3 so that programs loop over tiles; the norm and RoPE thresholds take the
    H200's 132, so the interpreter plays the GPU geometry the benchmarks were tuned on).
    """
    if type(kernel).__name__ == "InterpretedFunction":
        return interpreted
    if not _COUNT:
        from triton.runtime import driver

        props = driver.active.utils.get_device_properties(driver.active.get_current_device())
        _COUNT.append(int(props["multiprocessor_count"]))
    return _COUNT[0]
