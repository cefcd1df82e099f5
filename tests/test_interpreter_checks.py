"""`codesign.interpreter_speed`: what the suite skips of Triton's interpreter changes no result. The overflow
check is off by default (unchecked, its int64 recomputation only costs time), on with CODESIGN_OVERFLOW_CHECKS=1,
and on means an int32 overflow fails the launch; the language is patched once a launch, not at every
device-function call; block shapes are built once and numpy dtypes looked up once a type; kernels give the same
bits either way."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
import triton
import triton.language as tl

from codesign.backend import cuda_available
from codesign.interpreter_speed import OVERFLOW_CHECKS_ENV, overflow_checks

pytestmark = pytest.mark.skipif(cuda_available(), reason="Triton's interpreter: CPU machines only")


@triton.jit
def _add_kernel(x_ptr, y_ptr, out_ptr):
    r = tl.arange(0, 2)
    tl.store(out_ptr + r, tl.load(x_ptr + r) + tl.load(y_ptr + r))


@triton.jit
def _inner(x, k):
    return tl.where(x > 0, tl.exp(-x * k), tl.sum(x, axis=0) / 7.0)


@triton.jit
def _outer(x, n: tl.constexpr):
    for i in tl.static_range(n):
        x = _inner(x, 0.25 * i) + 0.5 * tl.max(x, axis=0)
    return x


@triton.jit
def _nested_kernel(x_ptr, out_ptr, N: tl.constexpr, CALLS: tl.constexpr):
    r = tl.program_id(0) * N + tl.arange(0, N)
    tl.store(out_ptr + r, _outer(tl.load(x_ptr + r), CALLS))


@triton.jit
def _pair(x, y):
    return x * 2.0 + y[:, None], tl.reshape(tl.broadcast_to(y[:, None], (8, 4)), (32,))


@triton.jit
def _shapes_kernel(x_ptr, q_ptr, out_ptr, n):
    """2-D tiles, broadcasts, a reshape, a tuple from a helper, int8 and fp16 codes cast to fp32, masked loads."""
    r, c = tl.arange(0, 8), tl.arange(0, 4)
    m = (r < n)[:, None] & (c >= 0)[None, :]
    x = tl.load(x_ptr + r[:, None] * 4 + c[None, :], mask=m, other=0.0)
    codes = tl.load(q_ptr + r[:, None] * 4 + c[None, :], mask=m, other=0).to(tl.float16)
    a, b = _pair(x, tl.sum(codes.to(tl.float32), axis=1))
    out = tl.reshape(a, (32,)) + b + tl.reshape(codes, (32,)).to(tl.float32)
    tl.store(out_ptr + tl.arange(0, 32), out)


@pytest.fixture
def interpreter():
    from triton.runtime import interpreter

    before = interpreter.interpreter_builder.options
    yield interpreter
    interpreter.interpreter_builder.options = before


def test_the_suite_runs_as_the_environment_says(interpreter):
    want = os.environ.get(OVERFLOW_CHECKS_ENV, "0") == "1"
    opts = interpreter.interpreter_builder.options
    assert (opts.sanitize_overflow, opts.debug) == (want, want)
    assert getattr(interpreter._patch_lang, "_codesign_once", False)


def test_checks_on_an_overflow_fails_and_off_it_wraps_as_a_gpu_does(interpreter):
    x = torch.tensor([2**31 - 1, 5], dtype=torch.int32)
    y = torch.tensor([1, 6], dtype=torch.int32)
    out = torch.full((2,), 7, dtype=torch.int32)
    assert overflow_checks(False) is False
    _add_kernel[(1,)](x, y, out)
    assert out.tolist() == [-(2**31), 11]
    assert overflow_checks(True) is True
    with pytest.raises(Exception, match="int32 overflow detected for operation add"):
        _add_kernel[(1,)](x, y, out)
    x[0] = 2**31 - 2  # the largest sum that fits passes
    _add_kernel[(1,)](x, y, out)
    assert out.tolist() == [2**31 - 1, 11]


def test_the_language_is_patched_once_a_launch_with_the_same_bits(interpreter, monkeypatch):
    scans = []
    scan = interpreter._patch_builtin
    monkeypatch.setattr(interpreter, "_patch_builtin", lambda *a: (scans.append(a[0]), scan(*a))[1])
    x = torch.randn(3 * 16)

    def run(calls):
        out = torch.full_like(x, float("nan"))
        scans.clear()
        _nested_kernel[(3,)](x, out, N=16, CALLS=calls)
        return out, len(scans)

    run(1)  # the first launch also rewrites each function's source
    once, once_scans = run(5)
    assert run(1)[1] == once_scans  # 15 device calls a program or 3: the same scans (the launch's, and the
    # first call into triton.language.standard, whose globals hold one more language module)
    monkeypatch.setattr(interpreter, "_patch_lang", interpreter._patch_lang._codesign_original)
    every, every_scans = run(5)
    assert every_scans > 5 * once_scans  # upstream: again at every device call
    assert torch.equal(once, every) and not once.isnan().any()


def test_another_interpreter_is_left_as_it_is(interpreter, monkeypatch):
    from codesign.interpreter_speed import patch_device_calls_once

    monkeypatch.setattr(interpreter, "interpreter_builder", object())
    assert overflow_checks(True) is False
    monkeypatch.delattr(interpreter, "_patch_lang")
    assert patch_device_calls_once() is False
    from triton.language import core

    from codesign.interpreter_speed import cache_np_dtypes, share_block_shapes

    monkeypatch.delattr(interpreter, "_get_np_dtype")
    assert cache_np_dtypes() is False
    from codesign.interpreter_speed import skip_same_shape_broadcasts

    monkeypatch.setattr(interpreter, "interpreter_semantic", object())
    assert skip_same_shape_broadcasts() is False
    monkeypatch.delattr(core, "block_type")
    assert share_block_shapes() is False


def _originals(monkeypatch) -> None:
    """Triton's own block_type / tensor constructors and `_get_np_dtype` for the rest of a test."""
    from triton.language import core
    from triton.runtime import interpreter

    monkeypatch.setattr(core.block_type, "__init__", core.block_type.__init__._codesign_original)
    monkeypatch.setattr(core.tensor, "__init__", core.tensor.__init__._codesign_original)
    monkeypatch.setattr(interpreter, "_get_np_dtype", interpreter._get_np_dtype._codesign_original)
    sem = interpreter.interpreter_semantic
    monkeypatch.setattr(sem, "broadcast_impl_value", sem.broadcast_impl_value._codesign_original)


def test_shared_shapes_and_dtypes_give_the_same_bits_and_the_same_types(monkeypatch):
    from triton.language import core
    from triton.runtime import interpreter

    assert getattr(core.block_type.__init__, "_codesign_shared", False)
    assert getattr(interpreter._get_np_dtype, "_codesign_cached", False)
    x, q = torch.randn(8, 4), torch.randint(-100, 100, (8, 4), dtype=torch.int8)

    def run():
        out = torch.full((32,), float("nan"))
        _shapes_kernel[(1,)](x, q, out, 6)
        blk = tl.block_type(tl.float16, [tl.constexpr(8), 4])
        t = tl.tensor(None, blk)
        same = blk == tl.block_type(tl.float16, [8, 4])
        return out, (blk.shape, blk.numel, blk.name, t.shape, t.numel, t.dtype, same)

    shared, shared_types = run()
    _originals(monkeypatch)
    own, own_types = run()
    assert torch.equal(shared, own) and not shared.isnan().any()
    assert shared_types == own_types and shared_types[-1]
    kinds = (tl.bfloat16, tl.pointer_type(tl.float16), tl.block_type(tl.int8, [4]), tl.block_type(tl.float32, [2]))
    want = [np.dtype(d) for d in ("uint16", "uint64", "int8", "float32")]
    assert [interpreter._get_np_dtype(t) for t in kinds] == want


def test_same_shape_operands_skip_the_broadcast_and_others_still_broadcast(monkeypatch):
    """The kernel's ops on one shared shape skip Triton's broadcast walk; [8, 1] against [1, 4] and a scalar against a
    block still take it; the bits are those of Triton's own walk on every op. (Teeth: a fast path that returned
    every pair unbroadcast fails the kernel's [8, 4] + [8, 1].)"""
    from triton.runtime import interpreter

    sem = interpreter.interpreter_semantic
    fast = sem.broadcast_impl_value
    assert getattr(fast, "_codesign_fast", False)
    x, q = torch.randn(8, 4), torch.randint(-100, 100, (8, 4), dtype=torch.int8)

    def run(impl):
        seen = []
        monkeypatch.setattr(sem, "broadcast_impl_value", lambda lhs, rhs: (seen.append((lhs.type, rhs.type)),
                                                                          impl(lhs, rhs))[1])  # fmt: skip
        out = torch.full((32,), float("nan"))
        _shapes_kernel[(1,)](x, q, out, 6)
        return out, seen

    skipped, seen = run(fast)
    own, _ = run(fast._codesign_original)
    assert torch.equal(skipped, own) and not skipped.isnan().any()
    blocks = [a.shape is b.shape for a, b in seen if type(a) is tl.block_type and type(b) is tl.block_type]
    assert any(blocks) and not all(blocks)  # ops on one shared shape (skipped) and broadcasts between shapes
    assert any(type(a) is not type(b) for a, b in seen)  # and a scalar against a block


def test_a_bad_shape_is_still_refused():
    with pytest.raises(ValueError, match="power of 2"):
        tl.block_type(tl.float16, [3, 4])
    with pytest.raises(TypeError, match="0d block_type"):
        tl.block_type(tl.float16, [])
    tl.block_type(tl.float16, [4, 4])  # built and shared: a bad shape of the same rank still fails
    with pytest.raises(ValueError, match="power of 2"):
        tl.block_type(tl.float16, [4, 6])
