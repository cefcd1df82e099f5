"""Backend selection: which implementation of an op runs for a given call.

Backends: "triton" (the Triton kernel; on CPU tensors only through the Triton
interpreter, TRITON_INTERPRET=1), "cupy" (CuPy RawKernel, CUDA tensors only),
"torch" (the plain-torch implementation, any device), and "auto" (the default:
Triton for CUDA tensors, torch for CPU tensors). Inside `codesign.autotune.compile_only.compile_only()`
(kernels compile for a GPU target and never launch) CPU tensors count as CUDA ones.

How a user or a test picks one, highest precedence first:
  1. `with use_backend("triton", op="w4a16_gemm"):` for one op, or `use_backend("triton")` for all;
  2. the environment: CODESIGN_BACKEND_<OP>=triton (op name upper-cased), then CODESIGN_BACKEND=triton;
  3. "auto".
Ops call `resolve_backend(op, device, available)` once per call, before launching.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

from codesign.specs.errors import CodesignError, check_choice

BACKENDS = ("auto", "triton", "cupy", "torch")

# Per-context overrides: {op name or "*": backend}. A ContextVar, not a global dict,
# so threads and nested `with` blocks do not see each other's choices.
# The default is never mutated (use_backend copies before setting), hence the noqa.
_OVERRIDES: ContextVar[dict[str, str]] = ContextVar("codesign_backend_overrides", default={})  # noqa: B039


@contextmanager
def use_backend(backend: str, op: str | None = None) -> Iterator[None]:
    """Force `backend` for `op` (or for every op when op is None) inside the block."""
    check_choice("backend", backend, BACKENDS)
    new = dict(_OVERRIDES.get())
    new[op or "*"] = backend
    token = _OVERRIDES.set(new)
    try:
        yield
    finally:
        _OVERRIDES.reset(token)


def requested_backend(op: str) -> str:
    """The backend asked for `op` (may be "auto"), following the precedence above."""
    ov = _OVERRIDES.get()
    if op in ov:
        return ov[op]
    if "*" in ov:
        return ov["*"]
    for var in (f"CODESIGN_BACKEND_{op.upper()}", "CODESIGN_BACKEND"):
        val = os.environ.get(var)
        if val:
            return check_choice(var, val.lower(), BACKENDS)
    return "auto"


def interpreter_enabled() -> bool:
    """True when Triton kernels run on the CPU through Triton's interpreter."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def cuda_available() -> bool:
    """True when torch sees a CUDA device (False if torch is not importable)."""
    try:
        import torch
    except ImportError:  # pragma: no cover - torch is a core dependency
        return False
    return bool(torch.cuda.is_available())


def enable_interpreter_if_no_gpu() -> bool:
    """Set TRITON_INTERPRET=1 when there is no GPU, so Triton kernels run on CPU tensors.

    Must run before any `@triton.jit` function is defined (Triton reads the
    variable then), so call it before importing codesign.kernels. Returns
    whether the interpreter is on afterwards.
    """
    if not interpreter_enabled() and not cuda_available():
        if any(m.startswith("codesign.kernels") for m in sys.modules):
            raise CodesignError("enable_interpreter_if_no_gpu() must run before codesign.kernels is imported")
        os.environ["TRITON_INTERPRET"] = "1"
    return interpreter_enabled()


# Set only by `codesign.autotune.compile_only`: kernels are compiled for a GPU target and never launched, and
# CPU tensors stand in for CUDA ones, so "triton" is allowed (and "auto" picks it) on CPU tensors meanwhile.
_COMPILE_ONLY = False


def compile_only_active() -> bool:
    """True inside `codesign.autotune.compile_only.compile_only()` (Triton launches compile, never run)."""
    return _COMPILE_ONLY


def canonical_device(device: Any) -> Any:
    """`device` as tensors on it report it: a bare "cuda" becomes "cuda:<current>" (a tensor made on
    "cuda" says cuda:0, and torch.device("cuda") != torch.device("cuda:0")), so plans made for "cuda"
    accept the tensors made for them."""
    import torch

    d = torch.device(device)
    if d.type == "cuda" and d.index is None and torch.cuda.is_available():
        d = torch.device("cuda", torch.cuda.current_device())
    return d


def _device_type(device: Any) -> str:
    return device if isinstance(device, str) else getattr(device, "type", str(device))


def resolve_backend(op: str, device: Any, available: tuple[str, ...] = ("triton", "torch")) -> str:
    """Concrete backend ("triton", "cupy" or "torch") for one call of `op` on `device`.

    Raises CodesignError when the requested backend cannot run there (e.g.
    "triton" on CPU tensors without the interpreter, "cupy" on CPU tensors, or
    a backend the op does not implement).
    """
    req = requested_backend(op)
    dev = _device_type(device)
    gpu_like = dev == "cuda" or _COMPILE_ONLY  # compile-only: CPU tensors stand in for CUDA ones
    if req == "auto":
        req = "triton" if gpu_like and "triton" in available else "torch"
    if req not in available:
        raise CodesignError(f"op {op!r} has no {req!r} backend; available: {', '.join(available)}")
    if req == "triton" and not gpu_like and not interpreter_enabled():
        raise CodesignError(
            f"backend 'triton' for op {op!r} on {dev} tensors needs Triton's interpreter: "
            "set TRITON_INTERPRET=1 before importing codesign.kernels (or use backend 'torch')"
        )
    if req == "cupy" and dev != "cuda":
        raise CodesignError(f"backend 'cupy' for op {op!r} needs CUDA tensors, got {dev} tensors")
    return req
