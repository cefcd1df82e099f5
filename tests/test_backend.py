"""Backend selection: precedence of context overrides and environment, and refusals."""

from __future__ import annotations

import pytest

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
