"""The Gluon kernels compiled for sm90 on the CPU, without a GPU: the warp-specialised sparse-attention forward
(``sparse_attn/kernel_fwd_ws.py``) and backward dq step (``kernel_bwd_dq_ws.py``), the grouped gate+up GEMM
and expert weight gradient (``moe_experts/kernel_gate_up_ws.py``, ``kernel_d_weight_ws.py``) and the mHC
projection and streams' gradient (``mhc/kernel_proj_gluon.py``, ``kernel_dx_streams.py`` / ``kernel_dx_gluon.py``).

They run only on Hopper (their results are tested on the H200 by ``tests/gpu/test_sparse_attn_gpu.py``,
``tests/gpu/test_moe_experts_gpu.py`` and ``tests/gpu/test_mhc_gpu.py``), but two properties that decide their
speed are visible in the compiler's output and are checked here, in CI, at their launch defaults (attention:
``kernel_config``'s, sparse and dense causal, tail 64 and 0; gate+up: ``kernel.WS_GATE_UP``, ping-pong and
cooperative; ``kernel_bwd.WS_D_WEIGHT``; mHC: ``GPU_CONFIG["proj_gluon"]`` / ``["dx_gluon"]``):

- ptxas does not serialise the wgmma instructions (its performance warning C7515: a wait after every HGMMA). It
  does so when an async wgmma result is carried around a loop next to registers written by other instructions; a
  kernel with that pattern is planted here to show the check catches it;
- shared memory fits a Hopper block (232,448 bytes) and nothing spills, except the dense mode's few bytes of
  loop-invariant row addresses in the gather warpgroup (read once per block; dense forward at 492-535 TFLOP/s on
  the H200, ``benchmarks/RESULTS.md``) and the MoE GEMMs' few bytes before their partitions start.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

triton = pytest.importorskip("triton")
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.experimental import gluon  # noqa: E402
from triton.experimental.gluon import language as gl  # noqa: E402
from triton.experimental.gluon._runtime import GluonASTSource  # noqa: E402
from triton.experimental.gluon.language.nvidia.hopper import (  # noqa: E402
    fence_async_shared,
    warpgroup_mma,
    warpgroup_mma_init,
    warpgroup_mma_wait,
)

from fleet_ext import capability  # noqa: E402

if __name__ == "__main__":  # the compiling subprocess: kernels built for sm90, not for the interpreter
    capability.prepare_triton(interpreter=False)

from fleet_ext.ops.mhc import kernel as mhc_kernel  # noqa: E402
from fleet_ext.ops.mhc.kernel_dx_gluon import _mhc_dx_gluon  # noqa: E402
from fleet_ext.ops.mhc.kernel_dx_streams import _mhc_dx_streams  # noqa: E402
from fleet_ext.ops.mhc.kernel_proj_gluon import _mhc_proj_gluon  # noqa: E402
from fleet_ext.ops.moe_experts import kernel as moe_kernel  # noqa: E402
from fleet_ext.ops.moe_experts import kernel_bwd as moe_kernel_bwd  # noqa: E402
from fleet_ext.ops.moe_experts.kernel_d_weight_ws import _d_weight_ws_kernel  # noqa: E402
from fleet_ext.ops.moe_experts.kernel_gate_up_ws import _gate_up_ws_kernel  # noqa: E402
from fleet_ext.ops.sparse_attn import kernel_config  # noqa: E402
from fleet_ext.ops.sparse_attn.kernel_bwd_dq_ws import _bwd_dq_ws_kernel  # noqa: E402
from fleet_ext.ops.sparse_attn.kernel_fwd_ws import _sparse_attn_fwd_ws_kernel  # noqa: E402

PTXAS = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
SM90_SHARED_BYTES = 232448
pytestmark = pytest.mark.skipif(not os.access(PTXAS, os.X_OK),
                                reason=f"needs the ptxas that ships with Triton's wheel ({PTXAS})")


def compile_sm90(fn, signature: dict, constexprs: dict, aligned: tuple[str, ...], **options):
    """Compile a Gluon kernel for sm90 here (no GPU needed); ``aligned`` arguments are specialised as 16-divisible,
    as the JIT does for pointers and strides of real tensors."""
    names = list(signature)
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in aligned}
    src = GluonASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)


def compile_ws_forward(tail: int, dense: bool, **overrides):
    """The forward at ``kernel_config``'s launch defaults (``overrides`` replace some), as
    ``kernel.launch_ws_forward`` launches it."""
    pointers = {"Q": "*bf16", "KV": "*bf16", "IDX": "*bf16" if dense else "*i32", "TOPK_LEN": "*i32",
                "SINK": "*fp32", "OUT": "*bf16", "LSE": "*fp32"}
    scalars = {name: "i32" for name in ("H", "N", "K", "S", "q_offset")}
    strides = {name: "i32" for name in ("stride_qt", "stride_qh", "stride_kvn", "stride_it", "stride_ot", "stride_oh")}
    meta = {**kernel_config.WS_FWD_TILES[tail], **kernel_config.WS_FWD_META, "PROBE": kernel_config.WS_FWD_PROBE,
            **overrides}
    options = {k: meta.pop(k) for k in ("num_warps", "maxnreg")}
    constexprs = {"D_TAIL": tail, "BLOCK_H": 64, "HAS_TOPK_LEN": not dense, "DENSE": dense, "HEAD_BLOCKS": 2, **meta}
    signature = {**pointers, **scalars, "qk_scale": "fp32", **strides, **{k: "constexpr" for k in constexprs}}
    return compile_sm90(_sparse_attn_fwd_ws_kernel, signature, constexprs, (*pointers, *strides), **options)


def compile_ws_dq(tail: int, dense: bool = False):
    """The backward's dq kernel at ``kernel_config.WS_DQ_META``, as ``kernel._bwd_dq`` (sparse) or
    ``kernel.launch_ws_dq_dense`` (dense causal) launches it."""
    pointers = {"Q": "*bf16", "KV": "*bf16", "DOUT": "*bf16", "IDX": "*i32", "TOPK_LEN": "*i32", "LSE": "*fp32",
                "DELTA": "*fp32", "DQ": "*bf16", "P_BUF": "*bf16", "DS_BUF": "*bf16"}
    scalars = {"H": "i32", "N": "i32", "K": "i32", "t_begin": "i32", "qk_scale": "fp32", "scale": "fp32",
               "H_PAD": "i32"}
    strides = {n: "i32" for n in ("stride_qt", "stride_qh", "stride_kvn", "stride_it", "stride_dot", "stride_doh")}
    meta = dict(kernel_config.WS_DQ_DENSE_META if dense else kernel_config.WS_DQ_META)
    options = {k: meta.pop(k) for k in ("num_warps", "maxnreg")}
    constexprs = {"D_TAIL": tail, "BLOCK_H": 64, "HAS_TOPK_LEN": not dense, "HEAD_BLOCKS": 2, **meta, "DENSE": dense}
    signature = {**pointers, **scalars, **strides, **{k: "constexpr" for k in constexprs}, "S": "i32",
                 "q_offset": "i32"}
    return compile_sm90(_bwd_dq_ws_kernel, signature, constexprs, (*pointers, *strides), **options)


def compile_gate_up_ws(coop: bool):
    """The grouped gate+up at ``kernel.WS_GATE_UP`` (its tile rows doubled for the cooperative form), bf16."""
    cfg = {**moe_kernel.WS_GATE_UP, "COOP": coop}
    if coop:
        cfg["BM"] *= 2
    x_block, w_block = [cfg["BM"], cfg["BK"]], [cfg["BK"], cfg["BN"]]
    layouts = [gl.NVMMASharedLayout.get_default_for(b, gl.bfloat16) for b in (x_block, w_block)]
    descs = {name: f"tensordesc<bf16[{b[0]}, {b[1]}],{lay!r}>"
             for name, b, lay in zip(("x_desc", "w_desc"), (x_block, w_block), layouts)}
    pointers = {"counts_ptr": "*i64", "gu_ptr": "*bf16", "h_ptr": "*bf16"}
    scalars = {**{n: "i32" for n in ("N", "K", "INTER", "E")}, "limit": "fp32", "s_gu": "i32", "s_h": "i32"}
    constexprs = {"HAS_LIMIT": True, "E_PAD": 256, **cfg}
    signature = {**descs, **pointers, **scalars, **{k: "constexpr" for k in constexprs}}
    return compile_sm90(_gate_up_ws_kernel, signature, constexprs, (*pointers, "K", "INTER", "s_gu", "s_h"),
                        num_warps=4)


def compile_d_weight_ws():
    """The weight gradient at ``kernel_bwd.WS_D_WEIGHT``, bf16: ragged 4-D loads, a 2-D TMA store."""
    cfg = moe_kernel_bwd.WS_D_WEIGHT
    blocks = {"a_desc": [1, 1, cfg["BK"], cfg["BM"]], "b_desc": [1, 1, cfg["BK"], cfg["BN"]],
              "out_desc": [cfg["BM"], cfg["BN"] // 2]}
    descs = {name: f"tensordesc<bf16[{', '.join(map(str, b))}],"
                   f"{gl.NVMMASharedLayout.get_default_for(b, gl.bfloat16)!r}>" for name, b in blocks.items()}
    constexprs = {"E_PAD": 256, **cfg}
    signature = {**descs, "counts_ptr": "*i64", **{n: "i32" for n in ("N", "M", "NN", "E")},
                 **{k: "constexpr" for k in constexprs}}
    return compile_sm90(_d_weight_ws_kernel, signature, constexprs, ("counts_ptr", "M", "NN"), num_warps=4)


def compile_mhc_proj():
    """The mHC projection at ``kernel.GPU_CONFIG["proj_gluon"]``, V4-Flash's widths (K = 4 x 4096, bf16)."""
    cfg = {k: v for k, v in mhc_kernel.GPU_CONFIG["proj_gluon"].items() if k not in mhc_kernel.HOST_KEYS}
    options = {"num_warps": cfg.pop("num_warps")}
    pointers = {"x_ptr": "*bf16", "p_ptr": "*bf16", "part_ptr": "*fp32"}
    constexprs = {"N": 4, "D": 4096, "NOUT": 24, "NO": 32, **cfg}
    signature = {**pointers, "T": "i32", "KS": "i32", **{k: "constexpr" for k in constexprs}}
    return compile_sm90(_mhc_proj_gluon, signature, constexprs, (*pointers, "T", "KS"), **options)


def compile_mhc_dx():
    """The mHC streams' gradient at ``kernel.GPU_CONFIG["dx_gluon"]``, V4-Flash's widths (4 streams of 4096, bf16)."""
    spp = mhc_kernel.GPU_CONFIG["dx_gluon"]["SPP"]  # streams per program: kernel_dx_streams for 2 or 4
    cfg = {k: v for k, v in mhc_kernel.GPU_CONFIG["dx_gluon"].items() if k not in mhc_kernel.HOST_KEYS}
    options = {k: cfg.pop(k) for k in ("num_warps", "maxnreg") if k in cfg}
    pointers = {"x_ptr": "*bf16", "fn_ptr": "*fp32", "g_ptr": "*bf16", "pre_ptr": "*fp32", "coef_ptr": "*fp32",
                "dy_ptr": "*bf16", "dx_ptr": "*bf16", "part_ptr": "*fp32"}
    constexprs = {"N": 4, "P": 4, "D": 4096, "NOUT": 24, "NO": 32, **cfg, **({"SPP": spp} if spp > 1 else {})}
    signature = {**pointers, "T": "i32", "TS": "i32", **{k: "constexpr" for k in constexprs}}
    fn = _mhc_dx_streams if spp > 1 else _mhc_dx_gluon
    return compile_sm90(fn, signature, constexprs, (*pointers, "T", "TS"), **options)


def compiled_in_subprocess(case: str, tmp_path) -> tuple[dict, str]:
    """Compile ``case`` in a fresh process (this file run as a script) with the interpreter off and an empty Triton
    cache: the CPU suite sets ``TRITON_INTERPRET=1`` before Triton's own jitted helpers are made, and those cannot
    be compiled for a GPU. Returns (metadata, PTX)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "triton_cache")
    res = subprocess.run([sys.executable, os.path.abspath(__file__), case, str(tmp_path)], env=env,
                         capture_output=True, text=True)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-4000:]
    return json.loads(res.stdout.strip().splitlines()[-1]), (tmp_path / "kernel.ptx").read_text()


def ptxas_report(ptx: str, tmp_path) -> tuple[bool, int]:
    """(ptxas serialised the wgmma instructions: its C751x warnings, e.g. C7515 or C7512 (too few registers), bytes
    of spill stores) for sm_90a."""
    src = tmp_path / "kernel.ptx"
    src.write_text(ptx)
    out = subprocess.run([PTXAS, "-arch=sm_90a", "-v", str(src), "-o", str(tmp_path / "kernel.o")],
                         capture_output=True, text=True, check=True)
    spills = re.search(r"(\d+) bytes spill stores", out.stderr)
    assert spills, out.stderr
    return "wgmma.mma_async instructions are serialized" in out.stderr, int(spills.group(1))


def check_compiled(case: str, tmp_path, max_spill: int, marker: str = "wgmma.mma_async", min_markers: int = 1):
    """``case`` compiles for sm90 within a block's shared memory, with at least ``min_markers`` of ``marker`` in its
    PTX, no wgmma serialisation (C7515: an async result crosses the loop; C7512: too few registers) and at most
    ``max_spill`` bytes of spill stores."""
    meta, ptx = compiled_in_subprocess(case, tmp_path)
    assert meta["shared"] <= SM90_SHARED_BYTES
    assert ptx.count(marker) >= min_markers
    serialised, spilled = ptxas_report(ptx, tmp_path)
    assert not serialised, "ptxas serialises the wgmma instructions"
    assert spilled <= max_spill, f"{spilled} bytes spilled"


@pytest.mark.parametrize("tail", [64, 0], ids=["v32_tail64", "dsv4_tail0"])
@pytest.mark.parametrize("dense", [False, True], ids=["sparse", "dense_causal"])
def test_attention_defaults_compile_without_wgmma_serialisation_or_spills(tail, dense, tmp_path):
    check_compiled(f"{'dense' if dense else 'sparse'}-{tail}", tmp_path, max_spill=64 if dense else 0)


@pytest.mark.parametrize("tail", [64, 0], ids=["v32_tail64", "dsv4_tail0"])
@pytest.mark.parametrize("mode", ["dq", "dqdense"], ids=["sparse", "dense_causal"])
def test_dq_defaults_compile_without_wgmma_serialisation(mode, tail, tmp_path):
    """The backward's warp-specialised dq kernel (``kernel_bwd_dq_ws.py``) at its launch defaults, both modes."""
    check_compiled(f"{mode}-{tail}", tmp_path, max_spill=16)


@pytest.mark.parametrize("case", ["mhc_proj", "mhc_dx"])
def test_mhc_kernels_compile_without_wgmma_serialisation_or_spills(case, tmp_path):
    """The mHC projection and streams' gradient (``mhc/kernel_proj_gluon.py``, ``kernel_dx_streams.py`` at the
    default ``SPP``): their MMAs all waited in the step or tile that issues them."""
    check_compiled(case, tmp_path, max_spill=0, min_markers=2)


@pytest.mark.parametrize("case", ["gate_up-0", "gate_up-1", "d_weight"],
                         ids=["gate_up_ping_pong", "gate_up_cooperative", "d_weight"])
def test_moe_gemm_defaults_compile_without_wgmma_serialisation(case, tmp_path):
    # the loader's TMA loads (and the weight gradient's stores); a few bytes of spill before the partitions start
    check_compiled(case, tmp_path, max_spill=32, marker="cp.async.bulk.tensor", min_markers=3)


@gluon.jit
def _planted_loop_carried_wgmma(X, Y, n):
    """The pattern that serialises: async S and PV results carried around the loop, PV's rescaled in between."""
    mma_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 64, 16])
    blk: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    smem_l: gl.constexpr = gl.NVMMASharedLayout.get_default_for([64, 64], gl.bfloat16)
    r = gl.arange(0, 64, layout=gl.SliceLayout(1, blk))
    c = gl.arange(0, 64, layout=gl.SliceLayout(0, blk))
    a = gl.allocate_shared_memory(gl.bfloat16, [64, 64], smem_l, gl.load(X + r[:, None] * 64 + c[None, :]))
    p = gl.allocate_shared_memory(gl.bfloat16, [64, 64], smem_l)
    fence_async_shared()
    s_tok = warpgroup_mma(a, a, warpgroup_mma_init(gl.zeros([64, 64], gl.float32, mma_l)), use_acc=False,
                          is_async=True)
    o_tok = warpgroup_mma_init(gl.zeros([64, 64], gl.float32, mma_l))
    for _ in range(n):
        s, o = warpgroup_mma_wait(num_outstanding=0, deps=(s_tok, o_tok))
        p.store(s.to(gl.bfloat16))
        fence_async_shared()
        o_tok = warpgroup_mma(p, a, o * 0.5, is_async=True)
        s_tok = warpgroup_mma(a, a, s_tok, use_acc=False, is_async=True)
    o, _ = warpgroup_mma_wait(num_outstanding=0, deps=(o_tok, s_tok))
    gl.store(Y + r[:, None] * 64 + c[None, :], gl.convert_layout(o, blk))


def test_the_serialisation_check_catches_a_planted_loop_carried_wgmma(tmp_path):
    _, ptx = compiled_in_subprocess("planted", tmp_path)
    serialised, _ = ptxas_report(ptx, tmp_path)
    assert serialised


if __name__ == "__main__":  # the subprocess of ``compiled_in_subprocess``: <case> <directory>
    case, where = sys.argv[1], sys.argv[2]
    if case == "planted":
        kernel = compile_sm90(_planted_loop_carried_wgmma, {"X": "*bf16", "Y": "*fp32", "n": "i32"}, {}, ("X", "Y"),
                              num_warps=4)
    elif case == "d_weight":
        kernel = compile_d_weight_ws()
    elif case == "mhc_dx":
        kernel = compile_mhc_dx()
    elif case == "mhc_proj":
        kernel = compile_mhc_proj()
    elif case.startswith("dq"):
        kernel = compile_ws_dq(int(case.split("-")[1]), dense=case.startswith("dqdense"))
    elif case.startswith("gate_up-"):
        kernel = compile_gate_up_ws(case.endswith("1"))
    else:
        kind, tail = case.split("-")
        kernel = compile_ws_forward(int(tail), kind == "dense")
    with open(os.path.join(where, "kernel.ptx"), "w") as f:
        f.write(kernel.asm["ptx"])
    print(json.dumps({"shared": kernel.metadata.shared}))
