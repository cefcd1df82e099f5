"""Attention sinks: a learned logit per query head that joins every softmax's denominator and adds no value
(GPT-OSS's `sinks`, passed to attention functions as `s_aux`).

With Z = sum_j exp(s_j) = exp(lse) over a query's visible scores, the softmax over the scores and the sink
weighs value j by exp(s_j) / (Z + exp(sink)): the sink-free output times Z / (Z + exp(sink)) =
sigmoid(lse - sink), and the log-sum-exp becomes logaddexp(lse, sink). Every kernel path (one launch, split-KV,
Oaken's three launches, mixed widths, trees) and the torch path already return lse, so a sink is this one
rescale of their output rather than a variant of each path's epilogue and merge. Its cost: one launch that reads
and writes `out` ([tokens, q_heads, head_dim]) once after an attention that read the whole cache, and one more
rounding of out's dtype (the rescale runs in fp32). The Triton kernel is that one launch (the torch path, the same
formula, is five or six ops).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from codesign.kernels.host_math import next_pow2


@triton.jit
def _sinks_kernel(out_ptr, lse_ptr, sinks_ptr, heads, head_dim, stride_ot, stride_oh, stride_lt, stride_lh,
                  BLOCK_D: tl.constexpr):  # fmt: skip
    """One (token, head) row: out *= sigmoid(lse - sink), lse := logaddexp(lse, sink)."""
    row = tl.program_id(0)
    t, h = row // heads, row % heads
    at_lse = lse_ptr + t.to(tl.int64) * stride_lt + h * stride_lh
    lse = tl.load(at_lse)
    s = tl.load(sinks_ptr + h)
    f = 1.0 / (1.0 + tl.exp(s - lse))
    d = tl.arange(0, BLOCK_D)
    at = out_ptr + t.to(tl.int64) * stride_ot + h * stride_oh + d
    x = tl.load(at, mask=d < head_dim, other=0.0).to(tl.float32)
    tl.store(at, (x * f).to(out_ptr.dtype.element_ty), mask=d < head_dim)
    hi = tl.maximum(lse, s)
    tl.store(at_lse, tl.where(hi == float("-inf"), hi, hi + tl.log(1.0 + tl.exp(tl.minimum(lse, s) - hi))))


def apply_sinks_(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor, backend: str = "torch") -> None:
    """Rescale `out` [tokens, q_heads, head_dim] and `lse` fp32 [tokens, q_heads] (both in place, any strides; lse
    natural log) of a sink-free attention to those of the same attention with per-head `sinks` fp32 [q_heads], on
    `backend` ("triton": one launch; "torch"). A sink of -inf changes nothing; a query with no visible key (lse
    -inf) gets 0, as the sink then takes all its weight."""
    if backend == "triton":
        tokens, heads, dim = out.shape
        if tokens:
            _sinks_kernel[(tokens * heads,)](out, lse, sinks, heads, dim, out.stride(0), out.stride(1), lse.stride(0),
                                             lse.stride(1), BLOCK_D=next_pow2(dim))  # fmt: skip
        return
    f = torch.sigmoid(lse - sinks)
    if out.dtype == torch.float32:
        out.mul_(f[..., None])
    else:
        out.copy_(out.float() * f[..., None])
    torch.logaddexp(lse, sinks, out=lse)
