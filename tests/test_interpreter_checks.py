"""`codesign.interpreter_speed`: what the suite skips of Triton's interpreter changes no result. The overflow
check is off by default (unchecked, its int64 recomputation only costs time), on with CODESIGN_OVERFLOW_CHECKS=1,
and on means an int32 overflow fails the launch; the language is patched once a launch, not at every
device-function call, and a kernel of nested helpers gives the same bits either way."""

from __future__ import annotations

import os

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
