"""Programmatic dependent launch (sm90+) for a chain of kernels on one stream, in Triton and Gluon device code.

A kernel launched with ``launch_pdl=True`` may be scheduled before the kernel ahead of it on the stream has
finished: its programs start once every program of the one ahead has started (``griddepcontrol.launch_dependents``
at their start) and then wait (``griddepcontrol.wait``) until that kernel has completed and its writes are
visible. The next kernel's launch latency and its first programs' set-up overlap the previous kernel's last wave
instead of following it. Each program waits before its first load *and* its first store (the caching allocator
may give this kernel memory the previous one still reads), so the results are those of serial launches. The
wait covers the whole chain: the kernel ahead passed its own wait before it could complete.

Both instructions are no-ops where the launch did not ask for it; the interpreter never runs them (``PDL`` False).
"""

from __future__ import annotations

from typing import Any

import triton
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait


@triton.jit
def dependent_start(PDL: tl.constexpr):
    """At a program's start: (``PDL`` 1) let the next kernel be scheduled, then wait for the previous one; ``PDL`` 2
    waits only (the next kernel is scheduled as this one's programs exit)."""
    if PDL == 1:
        gdc_launch_dependents()
    if PDL:
        gdc_wait()


@gluon.jit
def dependent_start_gluon(PDL: gl.constexpr):
    """:func:`dependent_start` for Gluon kernels."""
    if PDL == 1:
        gl.inline_asm_elementwise("griddepcontrol.launch_dependents; // $0", "=r", [], dtype=gl.int32,
                                  is_pure=False, pack=1)
    if PDL:
        gl.inline_asm_elementwise("griddepcontrol.wait; // $0", "=r", [], dtype=gl.int32, is_pure=False, pack=1)


def pdl_supported(interpreted: bool) -> bool:
    """A compiled kernel on a CUDA GPU of sm90 or later."""
    if interpreted:
        return False
    target = triton.runtime.driver.active.get_current_target()
    return target.backend == "cuda" and int(target.arch) >= 90


def pdl_options(mode: int) -> dict[str, Any]:
    """The constexpr and the launch option of a kernel that starts with :func:`dependent_start` (mode 0: a plain
    launch)."""
    return {"PDL": int(mode), "launch_pdl": True} if mode else {"PDL": 0}
