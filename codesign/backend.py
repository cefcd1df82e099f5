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

What a kernel may ask about the device it runs on (the GPU's name for its tuned tables, SM count, compute
capability, hardware fp8, the smallest `tl.dot`, bf16 dots, interpreter or compiled) it asks one function,
`device_view(device)`, which returns a frozen `DeviceView`. Compile-only mode is one override of that view
(`use_device_view`): CPU tensors then stand in for the lent GPU's.
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
from collections.abc import Iterator
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

from codesign.specs.errors import CodesignError, check_choice

BACKENDS = ("auto", "triton", "cupy", "torch")

# Per-context overrides: {op name or "*": backend}. A ContextVar, not a global dict,
# so threads and nested `with` blocks do not see each other's choices.
# The default is never mutated (use_backend copies before setting), hence the noqa.
_OVERRIDES: ContextVar[dict[str, str]] = ContextVar("codesign_backend_overrides", default={})  # noqa: B039


@contextlib.contextmanager
def _setting(var: ContextVar, value: Any) -> Iterator[None]:
    """`var` holds `value` inside the block (and what it held before, after)."""
    token = var.set(value)
    try:
        yield
    finally:
        var.reset(token)


def use_backend(backend: str, op: str | None = None) -> contextlib.AbstractContextManager[None]:
    """Force `backend` for `op` (or for every op when op is None) inside the block."""
    check_choice("backend", backend, BACKENDS)
    new = dict(_OVERRIDES.get())
    new[op or "*"] = backend
    return _setting(_OVERRIDES, new)


# True while a CPU stand-in for a CUDA graph records one (`integrations.hf.graphs.GraphTape`): `capturing`.
_RECORDING: ContextVar[bool] = ContextVar("codesign_graph_recording", default=False)


def recording_graph() -> contextlib.AbstractContextManager[None]:
    """Inside the block `capturing` answers True for any tensor (the CPU stand-in for a capture records)."""
    return _setting(_RECORDING, True)


def capturing(t: Any) -> bool:
    """Whether a graph is being captured over tensor t's device: a CUDA stream capturing, or the CPU stand-in
    recording. A check that reads device values on the host skips itself then: a sync breaks a capture, and the
    warm-up run before it checked the same (unchanging) tensors."""
    if _RECORDING.get():
        return True
    if not getattr(t, "is_cuda", False):
        return False
    import torch

    return torch.cuda.is_current_stream_capturing()


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
        if kernel_modules_imported():
            raise CodesignError("enable_interpreter_if_no_gpu() must run before codesign.kernels is imported")
        os.environ["TRITON_INTERPRET"] = "1"
    return interpreter_enabled()


# codesign.kernels modules that define no Triton kernel: the old-name aliases and the KV-format vocabulary
# (besides the packages themselves, whose __init__ re-export lazily).
_KERNEL_FREE = ("codesign.kernels._moved", "codesign.kernels.kvcache.formats")


def kernel_modules_imported() -> list[str]:
    """The codesign.kernels modules imported so far that may have defined Triton kernels (Triton reads
    TRITON_INTERPRET when a kernel is defined, so the interpreter can no longer be switched on for them)."""
    return sorted(
        name
        for name, mod in list(sys.modules.items())
        if name.startswith("codesign.kernels.") and name not in _KERNEL_FREE and not hasattr(mod, "__path__")
    )


@dataclass(frozen=True)
class DeviceView:
    """The answers every kernel module takes about the device its tensors are on.

    gpu: tensors count as GPU tensors (a CUDA device, or CPU stand-ins compiled for a GPU);
    gpu_name: the name tuned tables are looked up under (None: no table is read);
    sms, capability: the GPU's SM count and compute capability (None off a GPU);
    hw_fp8: Triton code runs compiled on hardware that converts e4m3 (sm_89+);
    min_dot_rows: the fewest rows a `tl.dot` takes (16 compiled for a GPU, 1 in the interpreter);
    bf16_dot: bf16 operands reach `tl.dot` as bf16 (not off a GPU: the interpreter computes bf16 on raw bits);
    interpreted: Triton runs through its interpreter (TRITON_INTERPRET=1);
    compile_only: inside `codesign.autotune.compile_only.compile_only()` (kernels compile, never run).
    """

    gpu: bool = False
    gpu_name: str | None = None
    sms: int | None = None
    capability: tuple[int, int] | None = None
    hw_fp8: bool = False
    min_dot_rows: int = 1
    bf16_dot: bool = False
    interpreted: bool = False
    compile_only: bool = False

    @property
    def compiled(self) -> bool:
        """Triton kernels compile for a GPU here (and run there, unless compile-only)."""
        return self.gpu and not self.interpreted

    @property
    def triton_runs(self) -> bool:
        """A Triton kernel can be launched (or, compile-only, compiled) for these tensors."""
        return self.gpu or self.interpreted


# The compile-only session's view of every device (None: each device answers for itself). A ContextVar, so
# the override ends with its block; set only by `use_device_view`.
_VIEW_OVERRIDE: ContextVar[DeviceView | None] = ContextVar("codesign_device_view", default=None)


def use_device_view(view: DeviceView) -> contextlib.AbstractContextManager[None]:
    """Inside the block `device_view(...)` returns `view` for every device (compile-only mode, tests)."""
    return _setting(_VIEW_OVERRIDE, view)


def device_view(device: Any) -> DeviceView:
    """The `DeviceView` of `device` (a torch.device or its name): the override inside `use_device_view`,
    else what the device and TRITON_INTERPRET say."""
    import torch

    # dynamo cannot trace a ContextVar; no compile-only session runs under torch.compile.
    if not torch.compiler.is_compiling():
        view = _VIEW_OVERRIDE.get()
        if view is not None:
            return view

    d = device if isinstance(device, torch.device) else torch.device(device)
    if d.type != "cuda":
        return _cpu_view(interpreter_enabled())
    index = d.index if d.index is not None else (torch.cuda.current_device() if cuda_available() else 0)
    return _cuda_view(index, interpreter_enabled())


@functools.lru_cache(maxsize=2)
def _cpu_view(interpreted: bool) -> DeviceView:
    return DeviceView(interpreted=interpreted)


@functools.lru_cache(maxsize=16)
def _cuda_view(index: int, interpreted: bool) -> DeviceView:
    if not cuda_available():  # a "cuda" device named on a machine without one: no properties to read
        return DeviceView(gpu=True, min_dot_rows=1 if interpreted else 16, bf16_dot=True, interpreted=interpreted)
    import torch

    props = torch.cuda.get_device_properties(index)
    cap = (props.major, props.minor)
    return DeviceView(
        gpu=True,
        gpu_name=torch.cuda.get_device_name(index),
        sms=props.multi_processor_count,
        capability=cap,
        hw_fp8=not interpreted and cap >= (8, 9),
        min_dot_rows=1 if interpreted else 16,
        bf16_dot=True,
        interpreted=interpreted,
    )


def compile_only_active() -> bool:
    """True inside `codesign.autotune.compile_only.compile_only()` (Triton launches compile, never run)."""
    view = _VIEW_OVERRIDE.get()
    return view is not None and view.compile_only


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
    view = _VIEW_OVERRIDE.get()
    gpu_like = dev == "cuda" or (view is not None and view.gpu)  # compile-only: CPU tensors stand in for CUDA
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
