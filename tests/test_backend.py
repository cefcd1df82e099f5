"""Backend selection: precedence of context overrides and environment, and refusals."""

from __future__ import annotations

import pytest
import torch

from codesign.backend import requested_backend, resolve_backend, use_backend
from codesign.specs import CodesignError


def test_precedence(monkeypatch):
    monkeypatch.delenv("CODESIGN_BACKEND", raising=False)
    monkeypatch.delenv("CODESIGN_BACKEND_MY_OP", raising=False)
    assert requested_backend("my_op") == "auto"
    monkeypatch.setenv("CODESIGN_BACKEND", "torch")
    assert requested_backend("my_op") == "torch"
    monkeypatch.setenv("CODESIGN_BACKEND_MY_OP", "triton")
    assert requested_backend("my_op") == "triton"
    with use_backend("cupy"):
        assert requested_backend("my_op") == "cupy"
        with use_backend("torch", op="my_op"):
            assert requested_backend("my_op") == "torch"
            assert requested_backend("other") == "cupy"
        assert requested_backend("my_op") == "cupy"
    assert requested_backend("my_op") == "triton"


def test_resolve(monkeypatch):
    monkeypatch.delenv("CODESIGN_BACKEND", raising=False)
    assert resolve_backend("x", "cpu") == "torch"
    assert resolve_backend("x", "cuda") == "triton"
    with use_backend("cupy"):
        with pytest.raises(CodesignError, match="no 'cupy' backend"):
            resolve_backend("x", "cuda")
        with pytest.raises(CodesignError, match="needs CUDA tensors"):
            resolve_backend("x", "cpu", available=("cupy", "torch"))
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with use_backend("triton"), pytest.raises(CodesignError, match="TRITON_INTERPRET=1"):
        resolve_backend("x", "cpu")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with use_backend("triton"):
        assert resolve_backend("x", "cpu") == "triton"


def test_bad_backend_names(monkeypatch):
    with pytest.raises(CodesignError, match="backend must be one of"):
        with use_backend("cuda"):
            pass
    monkeypatch.setenv("CODESIGN_BACKEND", "fast")
    with pytest.raises(CodesignError, match="CODESIGN_BACKEND"):
        requested_backend("y")


def test_device_view_of_the_cpu_and_its_override(monkeypatch):
    from codesign.backend import DeviceView, device_view, use_device_view

    monkeypatch.delenv("CODESIGN_BACKEND", raising=False)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    cpu = device_view("cpu")
    assert cpu == DeviceView(interpreted=True)  # no GPU: no name (no table), 1-row dots, fp32 for bf16
    assert not cpu.gpu and not cpu.compiled and cpu.triton_runs and cpu.min_dot_rows == 1
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert not device_view("cpu").triton_runs
    lent = DeviceView(gpu=True, gpu_name="NVIDIA H200", sms=132, capability=(9, 0), hw_fp8=True,
                      min_dot_rows=16, bf16_dot=True, compile_only=True)  # fmt: skip
    with use_device_view(lent):
        assert device_view("cpu") is lent and device_view(torch.device("cpu")) is lent
        assert lent.compiled and resolve_backend("x", "cpu") == "triton"  # CPU tensors stand in for CUDA ones
    assert device_view("cpu") != lent and resolve_backend("x", "cpu") == "torch"
