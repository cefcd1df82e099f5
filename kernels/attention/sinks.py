"""Attention sinks: a learned logit per query head that joins every softmax's denominator and adds no value
(GPT-OSS's `sinks`, passed to attention functions as `s_aux`).

With Z = sum_j exp(s_j) = exp(lse) over a query's visible scores, the softmax over the scores and the sink
weighs value j by exp(s_j) / (Z + exp(sink)): the sink-free output times Z / (Z + exp(sink)) =
sigmoid(lse - sink), and the log-sum-exp becomes logaddexp(lse, sink). Every kernel path (one launch, split-KV,
Oaken's three launches, mixed widths, trees) and the torch path already return lse, so a sink is this one
rescale of their output rather than a variant of each path's epilogue and merge. Its cost: one read and write
of `out` ([tokens, q_heads, head_dim]) after an attention that read the whole cache, and one more rounding of
out's dtype (the rescale runs in fp32).
"""

from __future__ import annotations

import torch


def apply_sinks_(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> None:
    """Rescale `out` [tokens, q_heads, head_dim] and `lse` fp32 [tokens, q_heads] (both in place, lse natural log)
    of a sink-free attention to those of the same attention with per-head `sinks` fp32 [q_heads]. A sink of -inf
    changes nothing; a query with no visible key (lse -inf) gets 0, as the sink then takes all its weight."""
    f = torch.sigmoid(lse - sinks)
    if out.dtype == torch.float32:
        out.mul_(f[..., None])
    else:
        out.copy_(out.float() * f[..., None])
    torch.logaddexp(lse, sinks, out=lse)
