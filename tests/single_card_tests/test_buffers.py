"""New tensors for launch plans (``fleet_ext.ops.buffers``, issue 16 §4): makers and carved scratch give the layout
an op's kernels assume (contiguous, 16-byte aligned, no two buffers overlapping), on torch and on Paddle; the mHC
plans key on the device, since they keep makers bound to one."""

from __future__ import annotations

import gc
import weakref

import paddle
import pytest
import torch

import fleet_ext.ops  # noqa: F401 - interpreter mode before the kernel imports
from fleet_ext.ops import buffers, launch
from fleet_ext.ops.mhc import kernel as mhc


@pytest.mark.parametrize("shape", [[4, 32], [3, 5, 7], [9], [0, 32]])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_torch_maker_gives_new_contiguous_tensors(shape, dtype):
    like = torch.zeros(2, 3, dtype=torch.float16)
    make = buffers.maker(like, shape, dtype)
    a, b = make(), make()
    assert list(a.shape) == shape and a.dtype == dtype and a.device == like.device
    assert a.stride() == torch.empty(shape).stride()  # new_empty's layout, zero sizes included
    if a.numel():
        assert a.data_ptr() != b.data_ptr()  # a new allocation per call, not the template
        b.fill_(0.0), a.fill_(1.0)
        assert bool((b == 0).all()) and bool((a == 1).all())  # no shared storage (the template expands one value)


def test_maker_keeps_no_reference_to_its_model_tensor():
    like = torch.zeros(1024)
    alive = weakref.ref(like)
    make = buffers.maker(like, [4, 4])
    del like
    gc.collect()
    assert alive() is None and make().shape == (4, 4)


def test_paddle_maker_and_scratch_allocate_each_buffer():
    like = paddle.zeros([2, 3], dtype="float32")
    out = buffers.maker(like, [4, 8], paddle.bfloat16)()
    assert isinstance(out, paddle.Tensor) and out.shape == [4, 8] and out.dtype == paddle.bfloat16
    parts = buffers.Scratch(like, [5, 0, 3], paddle.float32)()
    assert [p.shape for p in parts] == [[8], [4], [4]]  # each rounded up to 16 bytes, each its own tensor
    assert len({p.data_ptr() for p in parts}) == 3
    assert buffers.device_key(like) == str(like.place)


@pytest.mark.parametrize(("dtype", "step"), [(torch.float32, 4), (torch.bfloat16, 8)])
def test_scratch_views_are_aligned_and_disjoint(dtype, step):
    sizes = [3, 0, 17, 1, 64]
    scratch = buffers.Scratch(torch.zeros(1), sizes, dtype)
    parts = scratch()
    assert all(p.dtype == dtype and p.is_contiguous() for p in parts)
    assert len({p.untyped_storage().data_ptr() for p in parts}) == 1  # one allocation
    item = torch.empty(0, dtype=dtype).element_size()
    spans = sorted((p.data_ptr(), p.data_ptr() + p.numel() * item) for p in parts)
    assert all(end <= start for (_, end), (start, _) in zip(spans, spans[1:]))  # disjoint
    assert all(p.data_ptr() % buffers.ALIGN == 0 for p in parts)
    assert [p.numel() for p in parts] == [max(step, -(-n // step) * step) for n in sizes]
    # the check sees a misaligned carve: the same sizes unrounded start the third buffer 12 (bf16: 6) bytes off
    raw = torch.empty(sum(sizes), dtype=dtype).split_with_sizes(sizes)
    assert any(p.data_ptr() % buffers.ALIGN for p in raw)


def test_mhc_plans_key_on_the_device(monkeypatch):
    """The same layouts on another device build a new plan (its makers allocate on the first one's device)."""
    n, d, t = 4, 32, 5
    x = torch.randn(t, n, d)
    fn_w, base = 0.1 * torch.randn(24, n * d), torch.randn(24)
    scale = torch.tensor([0.5, 1.0, 1.5])
    launch.clear_plans()
    mhc.pre_forward(x, fn_w, base, scale, 3, 1e-6, 1e-6)
    built = launch.PLAN_CACHES["mhc pre"].builds
    mhc.pre_forward(x, fn_w, base, scale, 3, 1e-6, 1e-6)
    assert launch.PLAN_CACHES["mhc pre"].builds == built
    monkeypatch.setattr(buffers, "device_key", lambda tensor: 1)  # as if x were on GPU 1
    monkeypatch.setattr(mhc, "device_key", buffers.device_key)
    mhc.pre_forward(x, fn_w, base, scale, 3, 1e-6, 1e-6)
    assert launch.PLAN_CACHES["mhc pre"].builds == built + 1
