"""Fused KV index remap (Triton, interpreter on CPU) vs the eager reference and an independent NumPy oracle.

Exact everywhere (integer arithmetic): every comparison is ``array_equal`` plus dtype and shape. The one
deliberate contract difference — an int32 table whose flat ids could leave int32 raises instead of
wrapping — is tested on both sides: the fused op raises, and the reference really does wrap there (so
the guard is not vacuous), while the largest table that fits is still exact. Every call of the fused op
counts the kernel's launches.
"""

from __future__ import annotations

import functools

import numpy as np
import paddle
import pytest
from helpers import assert_bitwise, expect_launches

from fleet_ext import capability

capability.prepare_triton()

from fleet_ext.ops.kv_idx_remap import function as fused  # noqa: E402
from fleet_ext.ops.kv_idx_remap import kernel  # noqa: E402
from fleet_ext.ops.kv_idx_remap import reference as ref  # noqa: E402
from fleet_ext.ops.launch import LAUNCH_COUNTS  # noqa: E402
from fleet_ext.registry import FUSIONS  # noqa: E402

KERNEL = "_kv_idx_remap_kernel"


def oracle(local_idx: np.ndarray, seqlen_kv: int) -> np.ndarray:
    """Loop form in Python ints (no wrap-around possible), then the table dtype."""
    batch, seq, width = local_idx.shape
    out = np.empty((batch * seq, width), dtype=object)
    for b in range(batch):
        for s in range(seq):
            for k in range(width):
                v = int(local_idx[b, s, k])
                out[b * seq + s, k] = v + b * seqlen_kv if v >= 0 else v
    return out


def as_dtype(values: np.ndarray, dtype: str) -> np.ndarray:
    info = np.iinfo(dtype)
    flat = [int(v) for v in values.ravel()]
    if any(v < info.min or v > info.max for v in flat):
        raise AssertionError("oracle value outside the table dtype")
    return np.array(flat, dtype=dtype).reshape(values.shape)


def make_idx(rng, shape, seqlen_kv, dtype, neg_frac=0.3):
    idx = rng.integers(0, max(seqlen_kv, 1), size=shape).astype(np.int64)
    neg = rng.random(shape) < neg_frac
    idx[neg] = rng.choice([-1, -2, -7, np.iinfo(dtype).min], size=int(neg.sum()))
    return idx.astype(dtype)


def run_counted(fn, *args):
    before = LAUNCH_COUNTS[KERNEL]
    out = fn(*args)
    return out, LAUNCH_COUNTS[KERNEL] - before


def test_first_single_entry_launch():
    """One row, one column: the smallest launch, so a stall at the first Triton call shows up here."""
    t = paddle.to_tensor(np.array([[[3]], [[4]]], dtype="int32"))
    out, launches = run_counted(fused.local_to_global_flat, t, 10)
    assert launches == 1
    assert_bitwise(out, np.array([[3], [14]], dtype="int32"))


# (B, S, K, seqlen_kv): odd widths, a width over one 128-column block, row counts over one row block
# (64 rows per program for int32, 32 for int64), B = 1 (a pure copy), empty tables.
SHAPES = [(1, 1, 1, 5), (3, 5, 7, 11), (2, 37, 130, 1000), (4, 20, 64, 66048), (1, 70, 3, 9), (5, 1, 129, 3)]


@pytest.mark.parametrize("dtype", ["int32", "int64"])
@pytest.mark.parametrize("shape", SHAPES)
def test_matches_reference_and_oracle(dtype, shape):
    batch, seq, width, seqlen_kv = shape
    rng = np.random.default_rng(sum(shape))
    idx = make_idx(rng, (batch, seq, width), seqlen_kv, dtype)
    t = paddle.to_tensor(idx)
    out, launches = run_counted(fused.local_to_global_flat, t, seqlen_kv)
    assert launches == 1
    assert_bitwise(out, ref.local_to_global_flat(t, seqlen_kv))
    assert_bitwise(out, as_dtype(oracle(idx, seqlen_kv), dtype))
    flat = idx.reshape(-1, width)
    if flat.size >= 8:
        assert (flat < 0).any() and (flat >= 0).any()  # both branches exercised
    np.testing.assert_array_equal(out.numpy()[flat < 0], flat[flat < 0])  # negatives come back unchanged


@pytest.mark.parametrize("dtype", ["int32", "int64"])
def test_non_contiguous_inputs(dtype):
    rng = np.random.default_rng(7)
    base = paddle.to_tensor(make_idx(rng, (6, 4, 18), 50, dtype))
    views = {
        "transposed": base.transpose([1, 0, 2]),  # [4, 6, 18], batch stride < row stride
        "strided_cols": base[:, :, ::3],  # column stride 3
        "offset_slice": base[1:5, 1:, 2:17],  # non-zero storage offset
        "all_permuted": base.transpose([2, 0, 1]),  # column stride = 72
    }
    for name, view in views.items():
        assert not view.is_contiguous(), name
        out, launches = run_counted(fused.local_to_global_flat, view, 50)
        assert launches == 1, name
        assert_bitwise(out, ref.local_to_global_flat(view, 50))
        assert_bitwise(out, as_dtype(oracle(view.numpy(), 50), dtype))


def test_int32_overflow_raises_where_the_reference_wraps():
    batch, seqlen_kv = 3, 2**30  # flat ids reach 3 * 2**30 - 1 > int32 max
    idx = np.array([[[seqlen_kv - 1, -1]]] * batch, dtype="int32")
    t = paddle.to_tensor(idx)
    with pytest.raises(ValueError, match=r"local_to_global_flat: `local_idx` is int32 .* wrap around; pass int64"):
        fused.local_to_global_flat(t, seqlen_kv)
    wrapped = ref.local_to_global_flat(t, seqlen_kv).numpy()
    exact = oracle(idx, seqlen_kv)
    assert int(exact.max()) > np.iinfo("int32").max
    assert not np.array_equal(wrapped.astype(np.int64), exact.astype(np.int64)), "the reference no longer wraps"
    # the same table in int64 is exact
    with expect_launches(KERNEL, exactly=1):
        out = fused.local_to_global_flat(paddle.to_tensor(idx.astype("int64")), seqlen_kv)
    assert_bitwise(out, as_dtype(exact, "int64"))


def test_int32_largest_table_that_fits_is_exact():
    seqlen_kv = 2**30  # B = 2: B * seqlen_kv == 2**31, the largest flat id is exactly int32 max
    idx = np.array([[[0, seqlen_kv - 1, -1, 5]], [[seqlen_kv - 1, 0, np.iinfo("int32").min, -1]]], dtype="int32")
    t = paddle.to_tensor(idx)
    with expect_launches(KERNEL, exactly=1):
        out = fused.local_to_global_flat(t, seqlen_kv)
    assert int(out.numpy().max()) == np.iinfo("int32").max
    assert_bitwise(out, as_dtype(oracle(idx, seqlen_kv), "int32"))
    assert_bitwise(out, ref.local_to_global_flat(t, seqlen_kv))


def test_int64_large_offsets_are_exact():
    seqlen_kv = 3 * 2**40 + 7
    idx = np.array([[[0, 5, -1]], [[seqlen_kv - 1, -3, 2**33]]], dtype="int64")
    t = paddle.to_tensor(idx)
    with expect_launches(KERNEL, exactly=1):
        out = fused.local_to_global_flat(t, seqlen_kv)
    assert_bitwise(out, as_dtype(oracle(idx, seqlen_kv), "int64"))
    assert_bitwise(out, ref.local_to_global_flat(t, seqlen_kv))


def test_empty_tables():
    for shape in [(2, 0, 4), (2, 3, 0), (0, 3, 4)]:
        t = paddle.to_tensor(np.zeros(shape, dtype="int32"))
        out, launches = run_counted(fused.local_to_global_flat, t, 9)
        assert launches == 0
        assert out.shape == [shape[0] * shape[1], shape[2]] and out.dtype == paddle.int32


def test_deterministic_and_fresh_output():
    rng = np.random.default_rng(3)
    t = paddle.to_tensor(make_idx(rng, (2, 9, 40), 77, "int32"))
    one = paddle.to_tensor(make_idx(rng, (1, 9, 40), 77, "int32"))
    with expect_launches(KERNEL, exactly=3):
        a = fused.local_to_global_flat(t, 77)
        b = fused.local_to_global_flat(t, 77)
        c = fused.local_to_global_flat(one, 77)
    assert_bitwise(a, b, "two runs")
    assert a.data_ptr() != t.data_ptr()  # a new table, even for B = 1 style copies
    assert c.data_ptr() != one.data_ptr()
    assert_bitwise(c, one.numpy().reshape(9, 40))


@pytest.mark.parametrize(
    "make, seqlen_kv, match",
    [
        (lambda: paddle.zeros([3, 4], dtype="int32"), 4, r"`local_idx` must be \[B, S, K\]"),
        (lambda: paddle.zeros([2, 3, 4], dtype="float32"), 4, r"`local_idx` must be int32 or int64, got float32"),
        (lambda: paddle.zeros([2, 3, 4], dtype="int16"), 4, r"`local_idx` must be int32 or int64, got int16"),
        (lambda: paddle.zeros([2, 3, 4], dtype="int32"), -1, r"`seqlen_kv` must be >= 0"),
        (lambda: paddle.zeros([2, 3, 4], dtype="int32"), 2.5, r"`seqlen_kv` must be an int"),
        (lambda: paddle.zeros([2, 3, 4], dtype="int32"), True, r"`seqlen_kv` must be an int"),
        (lambda: np.zeros([2, 3, 4], dtype="int32"), 4, r"`local_idx` must be a paddle.Tensor"),
    ],
)
def test_bad_inputs_raise_naming_the_argument(make, seqlen_kv, match):
    with pytest.raises(ValueError, match="local_to_global_flat: " + match):
        fused.local_to_global_flat(make(), seqlen_kv)


def test_registry_names_this_function_and_it_drives_the_sparse_attention_bitwise():
    from fleet_ext.ops.sparse_attn.reference import sparse_attention_with_sink

    entry = FUSIONS["sparse_attn_global_kv_idx_remap_fusion"]
    assert entry.bitwise_equal and entry.load("fused") is fused.local_to_global_flat
    assert entry.load("reference") is ref.local_to_global_flat
    rng = np.random.default_rng(11)
    q = rng.standard_normal((2, 5, 3, 8)).astype("float32")
    kv = rng.standard_normal((2, 7, 8)).astype("float32")
    idx = make_idx(rng, (2, 5, 4), 7, "int32", neg_frac=0.4)
    idx[0, 0] = -1
    sink = rng.standard_normal(3).astype("float32")
    results = []
    for remap, launches in ((ref.local_to_global_flat, 0), (functools.partial(fused.local_to_global_flat), 1)):
        qt = paddle.to_tensor(q, stop_gradient=False)
        kvt = paddle.to_tensor(kv, stop_gradient=False)
        st = paddle.to_tensor(sink, stop_gradient=False)
        with expect_launches(KERNEL, exactly=launches):
            out, lse = sparse_attention_with_sink(qt, kvt, paddle.to_tensor(idx), st, 0.35, remap=remap)
        (out.square().sum() + lse.sum()).backward()
        results.append([out.numpy(), lse.numpy(), qt.grad.numpy(), kvt.grad.numpy(), st.grad.numpy()])
    for a, b, what in zip(*results, ("out", "lse", "dq", "dkv", "d_sink")):
        assert_bitwise(a, b, what)


@pytest.mark.parametrize("dtype", ["int32", "int64"])
@pytest.mark.parametrize("block_bytes", [64, 256])
def test_flat_path_batch_boundaries_inside_a_program(monkeypatch, dtype, block_bytes):
    """Contiguous tables take the flat 1-D path; with tiny programs the batch boundaries (multiples of
    S*K) fall inside programs, where the offset switches from b0 to b0 + 1 element by element."""
    monkeypatch.setitem(kernel.TUNE, "flat_block_bytes", block_bytes)
    rng = np.random.default_rng(block_bytes)
    for batch, seq, width, seqlen_kv in ((3, 5, 17, 11), (4, 9, 13, 66048), (1, 6, 5, 9), (5, 2, 33, 1000)):
        assert batch == 1 or seq * width >= kernel.flat_block(np.dtype(dtype).itemsize)  # the flat path's condition
        idx = make_idx(rng, (batch, seq, width), seqlen_kv, dtype)
        t = paddle.to_tensor(idx)
        out, launches = run_counted(fused.local_to_global_flat, t, seqlen_kv)
        assert launches == 1
        assert_bitwise(out, ref.local_to_global_flat(t, seqlen_kv))
        assert_bitwise(out, as_dtype(oracle(idx, seqlen_kv), dtype))


def test_tile_keeps_32k_per_program():
    assert kernel.tile(640, 4) == (64, 128)
    assert kernel.tile(2176, 4) == (64, 128)
    assert kernel.tile(640, 8) == (32, 128)
    assert kernel.tile(5, 4) == (1024, 8)


def test_kernel_modules_import_neither_paddle_nor_torch():
    """The GPU benchmark machine has no Paddle: kernel modules (fusions 1, 4, 5) must not import a framework."""
    import subprocess
    import sys

    code = (
        "import sys\n"
        "import fleet_ext.ops.kv_idx_remap.kernel, fleet_ext.ops.q_rms_norm.kernel, fleet_ext.ops.sink_grad.kernel\n"
        "print(sorted(m for m in ('paddle', 'torch') if m in sys.modules))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]", result.stdout + result.stderr
