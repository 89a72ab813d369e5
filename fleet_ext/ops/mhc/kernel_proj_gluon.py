"""The mHC pre op's projection on Hopper (Gluon): ``kernel_fwd._mhc_proj_fwd``'s maths with warp-group MMAs.

``part[s] = x @ fn^T`` over the split ``s`` of K = n D, with ``sum(x^2)`` in column NOUT, for BT = 16 x num_warps
tokens per program. Why a second kernel: the Triton one splits ``fn``'s fp32 tile into bf16 pieces in every program
at every K step and reduces the squares across threads at every step (70 % of copy on the H200). Here ``fn``'s
pieces come once per call from ``kernel_fwd._mhc_fn_pieces`` and ride the same ``cp.async`` ring as the streams;
each step is three m64n32 warp-group MMAs (the pieces smallest first, in a fresh accumulator added to the running
sum in fp32, as ``split_dot._dot``) whose A operand, the streams' tile, is read from shared memory once into
registers and serves the three products and the squares (with A from shared memory they read it three times more:
ncu on the H200 161.5 us, 73 % of shared-memory wavefronts; from registers 149.5 us, 42 %). The squares accumulate
per thread and are reduced once at the end. Other MMA shapes and another order of the squares' sum than the Triton
kernel: equal to rounding, not bitwise; deterministic. Device code only, sm90; ``kernel.pre_forward`` chooses it
(``kernel.GLUON``).
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, warpgroup_mma, warpgroup_mma_wait


@gluon.jit
def _piece_rings(dtype: gl.constexpr, STAGES: gl.constexpr, ROWS: gl.constexpr, COLS: gl.constexpr):
    """Three rings of ``STAGES`` [ROWS, COLS] tiles (an operand's hi, mid and lo bf16 pieces), MMA-ready layout."""
    layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([ROWS, COLS], dtype)
    return (gl.allocate_shared_memory(dtype, [STAGES, ROWS, COLS], layout),
            gl.allocate_shared_memory(dtype, [STAGES, ROWS, COLS], layout),
            gl.allocate_shared_memory(dtype, [STAGES, ROWS, COLS], layout))


@gluon.jit
def _issue_step(x_ptr, p_ptr, bufs, slot, step, n_steps, k0, t, t_ok, K, NO: gl.constexpr, BK: gl.constexpr,
                x_l: gl.constexpr, p_l: gl.constexpr):
    """``cp.async`` of K step ``step``: the tokens' columns ``[k0 + step BK, + BK)`` and ``fn``'s three pieces of
    them (nothing read past the split's last step: zero-filled), into ring slot ``slot``; one commit group."""
    x_s, hi_s, mid_s, lo_s = bufs
    live = step < n_steps
    k = k0 + step * BK + gl.arange(0, BK, layout=gl.SliceLayout(0, x_l))
    async_copy.async_copy_global_to_shared(x_s.index(slot), x_ptr + t.to(gl.int64)[:, None] * K + k[None, :],
                                           mask=(t_ok & live)[:, None])
    c = gl.arange(0, NO, layout=gl.SliceLayout(1, p_l))
    kp = k0 + step * BK + gl.arange(0, BK, layout=gl.SliceLayout(0, p_l))
    rows = p_ptr + c.to(gl.int64)[:, None] * K + kp[None, :]
    mask = (c < NO)[:, None] & live
    async_copy.async_copy_global_to_shared(hi_s.index(slot), rows, mask=mask)
    async_copy.async_copy_global_to_shared(mid_s.index(slot), rows + NO * K, mask=mask)
    async_copy.async_copy_global_to_shared(lo_s.index(slot), rows + 2 * NO * K, mask=mask)
    async_copy.commit_group()


@gluon.jit
def _mhc_proj_gluon(x_ptr, p_ptr, part_ptr, T, KS, N: gl.constexpr, D: gl.constexpr, NOUT: gl.constexpr,
                    NO: gl.constexpr, BT: gl.constexpr, BK: gl.constexpr, STAGES: gl.constexpr):
    """Program (i, s): tokens ``[i BT, (i + 1) BT)``, columns ``[s KS, (s + 1) KS)`` of their flattened rows;
    ``p_ptr``: ``fn``'s bf16 pieces [3, NO, K] (hi, mid, lo; rows past NOUT zero). Stores ``part[s]`` [T, NO]."""
    K: gl.constexpr = N * D
    dtype: gl.constexpr = x_ptr.dtype.element_ty
    W: gl.constexpr = gl.num_warps()
    gl.static_assert(BT == 16 * W, "BT must be 16 x num_warps")
    split = gl.program_id(1)
    t0 = gl.program_id(0) * BT
    k0 = split * KS
    n_steps = gl.cdiv(gl.minimum(KS, K - k0), BK)

    acc_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[W, 1], instr_shape=[16, NO, 16])
    x_l: gl.constexpr = gl.BlockedLayout([1, 8], [32 * 8 // BK, BK // 8], [W, 1], [1, 0])  # 16 B per copy
    x_s = gl.allocate_shared_memory(dtype, [STAGES, BT, BK], gl.NVMMASharedLayout.get_default_for([BT, BK], dtype))
    hi_s, mid_s, lo_s = _piece_rings(dtype, STAGES, NO, BK)
    bufs = (x_s, hi_s, mid_s, lo_s)

    t = t0 + gl.arange(0, BT, layout=gl.SliceLayout(1, x_l))
    t_ok = t < T
    for p in gl.static_range(STAGES - 1):
        _issue_step(x_ptr, p_ptr, bufs, p, p, n_steps, k0, t, t_ok, K, NO, BK, x_l, x_l)
    a_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_l, k_width=2)
    squares = gl.zeros([BT, BK], gl.float32, a_l)  # per thread, summed over K once at the end
    acc = gl.zeros([BT, NO], gl.float32, acc_l)
    for i in range(n_steps):
        slot = i % STAGES
        async_copy.wait_group(STAGES - 2)  # this thread's copies of step i have landed
        fence_async_shared()
        gl.thread_barrier()  # everyone's, and everyone is done with step i - 1's slot
        _issue_step(x_ptr, p_ptr, bufs, (i + STAGES - 1) % STAGES, i + STAGES - 1, n_steps, k0, t, t_ok, K, NO,
                    BK, x_l, x_l)
        xs = x_s.index(slot).load(a_l)  # read from shared memory once: the A operand of the three products
        part = warpgroup_mma(xs, lo_s.index(slot).permute((1, 0)), gl.zeros([BT, NO], gl.float32, acc_l),
                             use_acc=False, is_async=True)
        part = warpgroup_mma(xs, mid_s.index(slot).permute((1, 0)), part, is_async=True)
        part = warpgroup_mma(xs, hi_s.index(slot).permute((1, 0)), part, is_async=True)
        xv = xs.to(gl.float32)
        squares += xv * xv
        part = warpgroup_mma_wait(num_outstanding=0, deps=(part,))
        acc += part
    async_copy.wait_group(0)
    ss = gl.convert_layout(gl.sum(gl.convert_layout(squares, x_l), axis=1), gl.SliceLayout(1, acc_l))
    c = gl.arange(0, NO, layout=gl.SliceLayout(0, acc_l))
    acc = gl.where(c[None, :] == NOUT, ss[:, None], acc)
    rows = t0 + gl.arange(0, BT, layout=gl.SliceLayout(1, acc_l))
    gl.store(part_ptr + (split.to(gl.int64) * T + rows)[:, None] * NO + c[None, :], acc, mask=(rows < T)[:, None])
