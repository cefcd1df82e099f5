"""The attention custom ops: one factory for every cache type's op, the backend dispatch they share, and the
plain cache's op `codesign::paged_attention`.

Every attention op takes q, its cache type's tensors, the shared batch metadata and options
(`options.OP_ARGS_SCHEMA`) and its type's own parameters, and returns (out, lse). An `AttentionFormat` says
what differs per cache type: the tensors and parameters, the torch path (`reference`) and what the kernel
reads (`triton_attention.KernelKV`); `AttentionFormat.op` is the op built from that. CUDA tensors run the
Triton kernel, CPU tensors the torch path; `codesign.backend.use_backend("triton")` forces the kernel (the
interpreter on CPU).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch

from codesign.backend import device_view, resolve_backend
from codesign.kernels.attention.mixed_by_width import ByWidthPlan, attend_by_width, by_width_applies
from codesign.kernels.attention.oaken_split import SplitPlan, attend_split, split_applies
from codesign.kernels.attention.options import (
    OP_ARGS,
    OP_ARGS_SCHEMA,
    RETURN_LSE_ARG,
    AttentionBatch,
    AttentionOptions,
    alloc_lse,
    from_op_args,
)
from codesign.kernels.attention.reference import paged_attention_torch
from codesign.kernels.attention.sinks import apply_sinks_
from codesign.kernels.attention.triton_attention import KernelKV, LaunchPlan, paged_attention_triton
from codesign.specs import CodesignError

OP = "paged_attention"  # the backend choice's op name, shared by every cache type's attention


def check_backend_dtype(backend: str, q: torch.Tensor) -> None:
    """bf16 Triton kernels only on a GPU: the interpreter computes bf16 on raw bits."""
    if backend == "triton" and q.dtype == torch.bfloat16 and not device_view(q.device).compiled:
        raise CodesignError(
            "bf16 paged attention with the Triton backend needs a GPU (the interpreter mishandles bf16)"
        )


def attention_backend(q: torch.Tensor) -> str:
    """The backend ("torch" or "triton") every attention op runs on for q, after `check_backend_dtype`.

    Called inside the ops, not in the Python entry points, so torch.compile traces those (the backend
    choice reads a ContextVar, which dynamo cannot trace)."""
    backend = resolve_backend(OP, q.device)
    check_backend_dtype(backend, q)
    return backend


TorchImpl = Callable[[torch.Tensor, tuple, tuple, AttentionBatch, AttentionOptions], tuple]
KernelOperands = Callable[[torch.Tensor, tuple, tuple], KernelKV]


class AttentionFormat:
    """How attention reads one cache type, and its torch op (built here, `codesign::<name>`).

    tensors: the cache attributes the op takes after q, in order; params_schema / params(cache): the op's
    trailing parameters (after the shared ones) and their values for a cache;
    torch_impl(q, tensors, params, batch, opts) -> (out, lse): the CPU path;
    kernel_kv(q, tensors, params) -> KernelKV: what the kernel reads;
    check(cache, block_tables, check_data, expect): validates a cache (None for plain caches, which the
    attention checks validate themselves) and returns its (num_blocks, block_size, kv_heads, head_dim);
    signature_fields, signature_tensors: the host attributes and tensors a plan records (default: the
    op's tensors).
    """

    def __init__(
        self,
        name: str,
        tensors: tuple[str, ...],
        params_schema: str,
        params: Callable[[Any], tuple],
        torch_impl: TorchImpl,
        kernel_kv: KernelOperands,
        check: Callable[..., tuple[int, int, int, int]] | None = None,
        signature_fields: tuple[str, ...] = (),
        signature_tensors: tuple[str, ...] | None = None,
    ) -> None:
        self.name, self.tensors, self.params = name, tensors, params
        self.torch_impl, self.kernel_kv, self.check = torch_impl, kernel_kv, check
        self.signature_fields = signature_fields
        self.signature_tensors = tensors if signature_tensors is None else signature_tensors
        self.op = _define_op(self, params_schema)

    def op_tensors(self, cache: Any) -> tuple:
        return tuple(getattr(cache, n) for n in self.tensors)

    def signature(self, cache: Any) -> tuple:
        """The cache's type, host attributes and every tensor's (name, shape, dtype, device, stride): what
        run() compares with the plan, from host-side attributes only."""
        tens = []
        for n in self.signature_tensors:
            t = getattr(cache, n)
            tens.append(None if t is None else (n, tuple(t.shape), t.dtype, t.device, t.stride()))
        return (type(cache).__name__, *(getattr(cache, s) for s in self.signature_fields), *tens)


def _define_op(fmt: AttentionFormat, params_schema: str) -> torch.library.CustomOpDef:
    """The torch op `codesign::<fmt.name>` and its fake: q, the cache tensors, the shared arguments, the
    format's parameters -> (out, lse)."""
    n = len(fmt.tensors)
    tensors = ", ".join(f"Tensor {t}" for t in fmt.tensors)
    schema = f"(Tensor q, {tensors}, {OP_ARGS_SCHEMA}{', ' + params_schema if params_schema else ''})"

    def impl(q: torch.Tensor, *args: Any) -> tuple[torch.Tensor, torch.Tensor]:
        batch, opts = from_op_args(args[n : n + OP_ARGS])
        return run_attention(fmt, q, args[:n], args[n + OP_ARGS :], batch, opts)

    op = torch.library.custom_op(
        f"codesign::{fmt.name}", impl, mutates_args=(), schema=f"{schema} -> (Tensor, Tensor)"
    )

    @op.register_fake
    def _(q, *args):
        return torch.empty_like(q), alloc_lse(q, args[n + RETURN_LSE_ARG])

    return op


def _into(buf: torch.Tensor | None, x: torch.Tensor) -> torch.Tensor:
    """x, or x copied into the caller's buffer."""
    if buf is None or buf is x:
        return x
    return buf.copy_(x)


def run_attention(
    fmt: AttentionFormat,
    q: torch.Tensor,
    tensors: tuple,
    params: tuple,
    batch: AttentionBatch,
    opts: AttentionOptions,
    out: torch.Tensor | None = None,
    lse: torch.Tensor | None = None,
    plan: LaunchPlan | ByWidthPlan | SplitPlan | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) of `fmt`'s attention on the backend `attention_backend` picks for q, into `out` / `lse`
    when given (lse: `[0, q_heads]` when opts.return_lse is off). The Triton path launches with `plan` (made
    per call when None): given out, lse and a plan it allocates nothing and looks nothing up (but the lse of
    `opts.sinks` where the caller asks none: `sinks`)."""
    if opts.sinks is not None:
        inner = dataclasses.replace(opts, sinks=None, return_lse=True)
        keep = lse if opts.return_lse else None  # the caller's buffer, or one of its own (a `[0, q_heads]` stand-in)
        out, full = run_attention(fmt, q, tensors, params, batch, inner, out, keep, plan)
        apply_sinks_(out, full, opts.sinks, attention_backend(q))
        return out, full if opts.return_lse else (alloc_lse(q, False) if lse is None else lse)
    if attention_backend(q) == "torch":
        o, l_ = fmt.torch_impl(q, tensors, params, batch, opts)
        return _into(out, o), _into(lse, l_)
    out = torch.empty_like(q) if out is None else out
    lse = alloc_lse(q, opts.return_lse) if lse is None else lse
    kv = fmt.kernel_kv(q, tensors, params)
    lse_or = lse if opts.return_lse else None
    if isinstance(plan, ByWidthPlan) or (plan is None and by_width_applies(kv.kv_format, q, batch, opts, kv.k.shape)):
        attend_by_width(q, kv, batch, opts, out, lse_or, plan)
    elif isinstance(plan, SplitPlan) or (plan is None and split_applies(kv.kv_format, q, batch, opts, kv.k.shape)):
        attend_split(q, kv, batch, opts, out, lse_or, plan)
    else:
        paged_attention_triton(q, kv, batch, opts, out, lse_or, plan)
    return out, lse


# --- plain caches ---------------------------------------------------------------------------------------
def _plain_torch(q, tensors, params, batch, opts):
    return paged_attention_torch(q, tensors[0], tensors[1], batch, opts)


PLAIN = AttentionFormat(
    "paged_attention",
    ("k_cache", "v_cache"),
    "",
    lambda cache: (),
    _plain_torch,
    lambda q, tensors, params: KernelKV(tensors[0], tensors[1]),
)
