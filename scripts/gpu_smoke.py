"""The first thing to run on a Paddle GPU machine: every fusion and Triton backend against the unfused model.

    python scripts/gpu_smoke.py                  # GPU: bf16 autocast; CPU: fp32, Triton interpreter
    python scripts/gpu_smoke.py --seq 520 --batch 2

Builds the tiny model (``configs/dsv4_tiny_cpu.yaml`` with one layer of each attention family the kernels
serve: window, CSA, HCA and a ``-2`` latent-MQA layer; VHA postmix on, so the inverse-RoPE fusion has a path)
once per variant, from one seed: unfused twice, each fusion switch of ``fleet_ext.registry`` alone, the two
Triton sparse-attention backends alone, the bitwise fusions together and everything together. Each variant
runs one forward and backward; its loss, logits and parameter gradients are compared with the unfused run:

- byte for byte where the registry claims ``bitwise`` on this platform (CPU fp32: the Triton interpreter);
- else within a named entry of ``tests/helpers/tolerances.py``: on the CPU the fusion's documented fp32
  tolerance per tensor; on a Paddle GPU build (no claim is verified there yet) the bf16 ``model_smoke`` entry
  on the logits and on all gradients as one vector.

It also checks the launch counters (``fleet_ext.ops.launch``): the unfused runs launch no Triton kernel, each
variant launches a kernel of every op it switches on and none of any other op, and every launch took the
route ``fleet_ext.capability`` chose (``triton (paddle proxy, cuda:N)`` on a Paddle GPU build). It prints one
table and exits 1 on any mismatch (2 when the machine cannot run it). ``--plant VARIANT`` moves that
variant's logits by 10 % and one gradient element by 1e-3 of its tensor's largest entry: the negative
control (the CPU test requires it to fail). Unverified on a Paddle GPU build: nobody has run it there yet.
"""

from __future__ import annotations

import argparse
import importlib
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
for _path in (ROOT, ROOT / "tests"):  # a source checkout works without `pip install -e .`; tests/helpers
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

import numpy as np  # noqa: E402
import paddle  # noqa: E402
from helpers import assert_bitwise, assert_close, move_constant_inits  # noqa: E402

import fleet_ext.ops  # noqa: E402,F401  (selects Triton's interpreter on a machine without a GPU, before Triton)
from fleet_ext import capability  # noqa: E402
from fleet_ext.config import load_config  # noqa: E402
from fleet_ext.models import DSv4ForCausalLM  # noqa: E402
from fleet_ext.ops import launch  # noqa: E402
from fleet_ext.registry import BACKENDS, DERIVED_FUSIONS, FUSIONS, YES, config_errors  # noqa: E402

CONFIG = ROOT / "configs" / "dsv4_tiny_cpu.yaml"
# Window (0), CSA (4), HCA (128) and a -2 hybrid-MLA layer (latent MQA over all causal keys), VHA postmix on.
MODEL = {
    "csa_compress_ratios": [0, 4, 128, -2], "use_vha_attention": True, "hybrid_mla_attention": "mqa_full_causal",
    "hybrid_mla_q_lora_rank": 32, "hybrid_mla_kv_lora_rank": 32, "hybrid_mla_qk_nope_head_dim": 16,
    "hybrid_mla_qk_rope_head_dim": 16, "hybrid_mla_v_head_dim": 16, "hybrid_mla_num_attention_heads": 4,
}
# A switch whose gate needs another switch on (registry config gates) gets it in its variant.
PREREQUISITES: dict[str, dict[str, Any]] = {"fuse_inv_rope_into_vha_postmix": {"apply_rope_fusion": True}}
BACKEND_OP = "fleet_ext.ops.sparse_attn"  # the kernels of both `*_sparse_attn_backend: triton`
# CPU fp32 tolerance (tests/helpers/tolerances.py) of what is not bitwise there; every tensor is held to it.
CPU_TOLERANCES = {"dsa_sink_grad_fusion": "sink_grad_model", "csa_sparse_attn_backend": "model_triton_sparse_attn",
                  "mqa_sparse_attn_backend": "model_triton_sparse_attn",
                  "use_fused_mhc": "model_triton_sparse_attn",  # mHC's own model bound (1e-4) is tighter: one entry
                  "moe_expert_fusion": "model_triton_sparse_attn",  # the experts' own (5e-5) is tighter: one entry
                  "moe_router_logits_fusion": "model_triton_sparse_attn"}  # its own (5e-5) likewise
GPU_TOLERANCE = ("bf16", "model_smoke")
PLATFORM_NAMES = {"cpu_fp32": "CPU fp32 (Triton interpreter)", "paddle_gpu": "Paddle GPU, bf16 autocast"}


@dataclass
class Variant:
    """One model build: its switches, the op packages whose kernels it must launch, how it is compared."""

    name: str
    switches: dict[str, Any]
    ops: set[str] = field(default_factory=set)
    rule: str = "bitwise"  # or "tolerance <dtype> <entry>"
    result: dict[str, Any] = field(default_factory=dict)
    launches: dict[str, int] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)
    bitwise: bool | None = None
    max_diff: float = 0.0
    seconds: float = 0.0


def _op_of(switch: str) -> str:
    """The op package a switch's fused path lives in (``fleet_ext.ops.rope``)."""
    return FUSIONS[switch].fused.partition(":")[0].rsplit(".", 1)[0] if switch in FUSIONS else BACKEND_OP


def _derived_ops(switches: dict[str, Any]) -> set[str]:
    """The op packages of the fusions that several switches turn on together (registry ``DERIVED_FUSIONS``)."""
    on = [f for f in DERIVED_FUSIONS.values() if all(switches.get(s) is True for s in f.requires)]
    return {f.fused.partition(":")[0].rsplit(".", 1)[0] for f in on}


def kernels_of(op: str) -> set[str]:
    """Names of the Triton kernels (as the launch counters name them) defined in an op package's kernel modules."""
    names = set()
    for path in sorted((ROOT / op.replace(".", "/")).glob("kernel*.py")):
        module = importlib.import_module(f"{op}.{path.stem}")
        for obj in vars(module).values():
            if type(obj).__name__ in ("JITFunction", "InterpretedFunction"):
                names.add(getattr(obj, "__name__", None) or obj.fn.__name__)
    return names


def _rule(switches: dict[str, Any], platform: str) -> str:
    """Bitwise where the registry claims it for every switch on this platform, else the documented tolerance."""
    not_bitwise = [s for s in switches if s in BACKENDS or getattr(FUSIONS[s].bitwise, platform).verdict != YES]
    if not not_bitwise:
        return "bitwise"
    if platform != "cpu_fp32":
        return "tolerance {} {}".format(*GPU_TOLERANCE)
    names = {CPU_TOLERANCES.get(s) for s in not_bitwise}
    if None in names or len(names) != 1:
        raise SystemExit(f"gpu_smoke: no single CPU tolerance for {not_bitwise}: add one to CPU_TOLERANCES")
    return f"tolerance fp32 {names.pop()}"


def variants(platform: str) -> list[Variant]:
    """Unfused again, every landed fusion alone, each Triton backend alone, the bitwise ones together, all on."""
    landed = [s for s, f in FUSIONS.items() if f.landed]
    found = [Variant("unfused (repeat)", {})]
    found += [Variant(s, {s: True, **PREREQUISITES.get(s, {})}) for s in landed]
    found += [Variant(f"{s}=triton", {s: "triton"}) for s in BACKENDS]
    bitwise = {s: True for s in landed if getattr(FUSIONS[s].bitwise, platform).verdict == YES}
    if len(bitwise) > 1:
        found.append(Variant("bitwise fusions together", bitwise))
    # Everything that combines: the sink-gradient fusion serves the unfused backend only (registry).
    everything = {**{s: True for s in landed if s != "dsa_sink_grad_fusion"}, **{s: "triton" for s in BACKENDS}}
    found.append(Variant("all fusions + Triton backends", everything))
    gpu_rule = "tolerance {} {}".format(*GPU_TOLERANCE)
    for v in found:
        v.ops = {_op_of(s) for s in v.switches} | _derived_ops(v.switches)
        v.rule = _rule(v.switches, platform) if v.switches else ("bitwise" if platform == "cpu_fp32" else gpu_rule)
    return found


def run(variant: Variant, ids: Any, amp: bool, seed: int) -> None:
    """Build the model with the variant's switches, one forward and backward; keep loss, logits, gradients."""
    config = load_config(CONFIG, **MODEL, **variant.switches)
    errors = config_errors(config)
    if errors:
        raise SystemExit(f"gpu_smoke: variant {variant.name!r} cannot be built: {errors}")
    paddle.seed(seed)
    model = DSv4ForCausalLM(config)
    model.train()
    move_constant_inits(model, np.random.default_rng(seed), 0.1)  # no gradient trivially 0 (sinks, VHA V, norms)
    before = dict(launch.LAUNCH_COUNTS)
    start = time.perf_counter()
    with paddle.amp.auto_cast(enable=amp, dtype="bfloat16", level="O1"):
        logits, loss = model(ids[:, :-1], labels=ids[:, 1:])
    loss.backward()
    variant.seconds = time.perf_counter() - start
    variant.launches = {k: n - before.get(k, 0) for k, n in launch.LAUNCH_COUNTS.items() if n > before.get(k, 0)}
    grads = {f"grad/{n}": p.grad.detach() for n, p in model.named_parameters() if p.grad is not None}
    variant.result = {"loss": loss.detach(), "logits": logits.detach(), **grads}


def plant(variant: Variant) -> None:
    """The negative control: logits 10 % off and one gradient element 1e-3 of its tensor's largest entry off."""
    result = variant.result
    result["logits"] = result["logits"] * 1.1
    name = sorted(k for k in result if k.startswith("grad/"))[0]
    grad = result[name].numpy().copy()
    grad.flat[0] += 1e-3 * float(np.abs(grad).max() or 1.0)
    result[name] = paddle.to_tensor(grad, place=result[name].place)


def _host(t: Any) -> np.ndarray:
    return t.astype("float32").numpy().astype(np.float64)


def _compared(result: dict[str, Any], per_tensor: bool) -> dict[str, Any]:
    """What is compared: every tensor on the CPU; on the GPU loss, logits and all gradients as one vector."""
    if per_tensor:
        return result
    grads = [result[k].astype("float32").flatten() for k in sorted(result) if k.startswith("grad/")]
    # bf16 logits widened to fp32 (exact), so bytes still compare and the helpers read values, not bf16 bits.
    return {"loss": result["loss"].astype("float32"), "logits": result["logits"].astype("float32"),
            "all gradients": paddle.concat(grads)}


def compare(variant: Variant, base: Variant, per_tensor: bool) -> None:
    """Fill ``variant``'s bitwise flag, largest difference and problems against the unfused run ``base``."""
    got, want = _compared(variant.result, per_tensor), _compared(base.result, per_tensor)
    if set(got) != set(want):
        variant.problems.append(f"tensors differ: {sorted(set(got) ^ set(want))}")
    variant.bitwise = True
    for name in sorted(set(got) & set(want)):
        try:
            assert_bitwise(got[name], want[name], name)
        except AssertionError as exc:
            variant.bitwise = False
            if variant.rule == "bitwise":
                variant.problems.append(str(exc))
        g, w = _host(got[name]), _host(want[name])
        if g.shape == w.shape and g.size:
            variant.max_diff = max(variant.max_diff, float(np.nan_to_num(np.abs(g - w), nan=np.inf).max()))
        if variant.rule.startswith("tolerance"):
            _, dtype, entry = variant.rule.split()
            try:
                assert_close(got[name], want[name], dtype, entry, what=name)
            except AssertionError as exc:
                variant.problems.append(str(exc))


def check_launches(variant: Variant) -> None:
    """Every switched-on op launched a kernel; no other op did (an unfused run launches nothing)."""
    allowed = set().union(*(kernels_of(op) for op in variant.ops)) if variant.ops else set()
    # A derived fusion's kernels also prove the ops it merges ran (on a GPU the q/kv prologue does the q norm's work).
    derived = set().union(*(kernels_of(op) for op in _derived_ops(variant.switches)))
    for op in sorted(variant.ops):
        if not (kernels_of(op) | derived) & set(variant.launches):
            variant.problems.append(f"no kernel of {op} launched: the fused path did not run")
    stray = sorted(set(variant.launches) - allowed)
    if stray:
        variant.problems.append(f"kernels of ops that are off were launched: {stray}")


def table(rows: list[Variant]) -> str:
    """One line per variant: switches, launches, rule, bitwise, largest difference, time, result."""
    header = ("variant", "launches", "rule", "bitwise", "max |diff|", "s", "result")
    lines = [header] + [(
        v.name, f"{sum(v.launches.values())} ({len(v.launches)} kernels)", v.rule,
        "-" if v.bitwise is None else ("yes" if v.bitwise else "no"), f"{v.max_diff:.2e}", f"{v.seconds:.1f}",
        "OK" if not v.problems else "FAIL") for v in rows]
    widths = [max(len(row[i]) for row in lines) for i in range(len(header))]
    out = [" | ".join(c.ljust(w) for c, w in zip(row, widths)) for row in lines]
    out.insert(1, "-+-".join("-" * w for w in widths))
    return "\n".join(out)


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=None, help="tokens per sequence (default: 264 GPU, 24 CPU)")
    parser.add_argument("--batch", type=int, default=None, help="sequences (default: 2 GPU, 1 CPU)")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--only", action="append", default=[], metavar="VARIANT", help="run only these variants")
    parser.add_argument("--plant", action="append", default=[], metavar="VARIANT",
                        help="negative control: corrupt this variant's results (must then fail)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    cap = capability.detect()
    reason = cap.triton_unusable_reason()
    if reason:
        print(f"gpu_smoke: Triton cannot run here ({cap.describe()}): {reason}", file=sys.stderr)
        return 2
    platform = "cpu_fp32" if cap.interpreter else "paddle_gpu"
    gpu = platform == "paddle_gpu"
    seq, batch = args.seq or (264 if gpu else 24), args.batch or (2 if gpu else 1)
    route = capability.ROUTE_INTERPRETER if cap.interpreter else cap.triton_route
    import triton

    print(f"gpu_smoke: {PLATFORM_NAMES[platform]}; {cap.describe()}; {cap.route_name()}; paddle {paddle.__version__}, "
          f"triton {triton.__version__}; batch {batch} x {seq} tokens; model {CONFIG.relative_to(ROOT)} + {MODEL}")
    vocab = load_config(CONFIG).model.vocab_size
    ids = paddle.to_tensor(np.random.default_rng(args.seed).integers(1, vocab, size=(batch, seq + 1)).astype("int64"))
    rows = variants(platform)
    unknown = sorted(set(args.only + args.plant) - {v.name for v in rows})
    if unknown:
        print(f"gpu_smoke: unknown variant(s) {unknown}: expected some of {[v.name for v in rows]}", file=sys.stderr)
        return 2
    rows = [v for v in rows if not args.only or v.name in args.only]
    routes_before = dict(launch.ROUTE_COUNTS)
    base = Variant("unfused", {})
    run(base, ids, gpu, args.seed)
    check_launches(base)
    for variant in rows:
        run(variant, ids, gpu, args.seed)
        if variant.name in args.plant:
            plant(variant)
        compare(variant, base, per_tensor=not gpu)
        check_launches(variant)
    routes = {k: n - routes_before.get(k, 0) for k, n in launch.ROUTE_COUNTS.items() if n > routes_before.get(k, 0)}
    route_problem = [] if set(routes) == {route} else [f"launch routes {routes}, expected only {route!r}"]
    print(table([base, *rows]))
    print(f"launch routes: {routes}" + (" (OK)" if not route_problem else " (FAIL)"))
    failed = [v for v in [base, *rows] if v.problems]
    for v in failed:
        print(f"FAIL {v.name}:\n  " + "\n  ".join(p[:600] for p in v.problems[:8]))
    for problem in route_problem:
        print(f"FAIL {problem}")
    print("gpu_smoke: " + ("all variants match" if not failed and not route_problem else
                           f"{len(failed) + len(route_problem)} mismatch(es)"))
    return 1 if failed or route_problem else 0


if __name__ == "__main__":
    sys.exit(main())
