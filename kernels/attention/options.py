"""The two typed values every attention call carries from its public entry point to the kernel launch.

`AttentionOptions`: what the caller asks (scale, window, soft cap, ALiBi slopes, lse, splits, data checks,
sinks).
`AttentionBatch`: one launch's batch metadata on the device (block tables, lengths, query offsets; for tree
verification the node positions and ancestor masks).

`prepare` runs every check (all before any launch) and resolves the options (the scale's default; the split
count is the launch plan's, `triton_attention.plan_launch`). The custom ops take both values flattened into
their schema (`to_op_args`) and rebuild them (`from_op_args`): torch.library schemas hold tensors and
scalars, not dataclasses, and this is the one place that spells the order.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from dataclasses import dataclass

import torch

from codesign.kernels.kvcache.checks import check_block_tables, check_int_tensor, check_kv_cache, has_data
from codesign.specs import CodesignError

Q_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_SPLITS = 64  # the split-KV count's range is [1, MAX_SPLITS]


@dataclass(frozen=True, eq=False)
class AttentionOptions:
    """What an attention call asks for (the keywords of every entry point).

    sm_scale: None means 1 / sqrt(head_dim) (`prepare` fills it in); window: attend to the last `window`
    positions only; softcap: c * tanh(s / c) on the scores; alibi_slopes: fp32 [q_heads]; return_lse: also
    return the natural-log sum-exp, fp32 [tokens, q_heads]; num_splits: split-KV count in [1, 64], None to
    let the launch plan choose; check_data: run the data checks (one host sync) before the launch; sinks: fp32
    [q_heads], a learned logit per head that joins each softmax's denominator and adds no value (`sinks`).
    """

    sm_scale: float | None = None
    window: int | None = None
    softcap: float | None = None
    alibi_slopes: torch.Tensor | None = None
    return_lse: bool = False
    num_splits: int | None = None
    check_data: bool = True
    sinks: torch.Tensor | None = None

    @classmethod
    def from_keywords(cls, keywords: dict) -> AttentionOptions:
        """The options of an entry point that takes them as **keywords: a misspelt one raises, not ignored."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(keywords) - names)
        if unknown:
            raise CodesignError(f"unknown attention keyword(s) {unknown}; expected some of {sorted(names)}")
        return cls(**keywords)

    def check(self, q_heads: int, device: torch.device) -> None:
        """Types and ranges of the options but the split count (`check_splits`; no host sync)."""
        for name in ("alibi_slopes", "sinks"):
            a = getattr(self, name)
            if a is None:
                continue
            if not isinstance(a, torch.Tensor):
                raise CodesignError(f"{name} must be a float32 tensor of shape ({q_heads},), got {type(a).__name__}")
            if a.dtype != torch.float32 or tuple(a.shape) != (q_heads,):
                raise CodesignError(f"{name} must be float32 of shape ({q_heads},), got {a.dtype} {tuple(a.shape)}")
            if a.device != device:
                raise CodesignError(f"{name} is on {a.device} but q is on {device}")
        w = self.window
        if w is not None and (isinstance(w, bool) or not isinstance(w, int) or w <= 0):
            raise CodesignError(f"window must be a positive int or None, got {w!r}")
        for name in ("softcap", "sm_scale"):
            c = getattr(self, name)
            if c is not None and (isinstance(c, bool) or not isinstance(c, numbers.Real) or not math.isfinite(c)
                                  or c <= 0):  # fmt: skip
                raise CodesignError(f"{name} must be a positive finite number or None, got {c!r}")
        for name in ("return_lse", "check_data"):
            if not isinstance(getattr(self, name), bool):
                raise CodesignError(f"{name} must be a bool, got {getattr(self, name)!r}")

    def check_splits(self) -> None:
        n = self.num_splits
        if n is not None and (isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_SPLITS):
            raise CodesignError(f"num_splits must be an int in [1, {MAX_SPLITS}] or None, got {n!r}")


@dataclass(frozen=True, eq=False)
class AttentionBatch:
    """One launch's batch metadata (device tensors; contracts in docs/architecture.md).

    cu_seqlens_q: int32 [B+1], sequence b's new tokens are q[cu[b]:cu[b+1]] (decode: 0, 1, ..., B);
    positions, tree_mask, mask_indptr: tree verification only (`tree.TreeBatch`), else None.
    """

    block_tables: torch.Tensor
    context_lens: torch.Tensor
    cu_seqlens_q: torch.Tensor
    is_decode: bool
    positions: torch.Tensor | None = None
    tree_mask: torch.Tensor | None = None
    mask_indptr: torch.Tensor | None = None

    @property
    def is_tree(self) -> bool:
        return self.tree_mask is not None


def _check_inputs(q, k_cache, v_cache, block_tables, context_lens, cu_seqlens_q, opts: AttentionOptions) -> None:
    """`prepare`'s checks: shapes, dtypes and devices; with `opts.check_data` also the data (one host sync)."""
    nb, bs, hkv, dim = check_kv_cache(k_cache, v_cache)
    _check_q(q, k_cache, dim, hkv)
    check_int_tensor("block_tables", block_tables, 2, k_cache.device)
    check_int_tensor("context_lens", context_lens, 1, k_cache.device)
    b = block_tables.shape[0]
    if context_lens.shape[0] != b:
        raise CodesignError(f"context_lens has {context_lens.shape[0]} entries, block_tables {b} rows")
    if cu_seqlens_q is not None:
        check_int_tensor("cu_seqlens_q", cu_seqlens_q, 1, k_cache.device)
        if cu_seqlens_q.shape[0] != b + 1:
            raise CodesignError(
                f"cu_seqlens_q must have batch + 1 = {b + 1} entries, got {cu_seqlens_q.shape[0]}"
            )
    elif q.shape[0] != b:
        raise CodesignError(
            f"decode takes one query per sequence: q has {q.shape[0]} tokens for {b} sequences"
        )
    opts.check(q.shape[1], q.device)
    if opts.check_data and has_data(q, block_tables, context_lens, cu_seqlens_q):  # (meta tensors: no data)
        check_block_tables(block_tables, context_lens, nb, bs)
        _check_lengths(q, context_lens, cu_seqlens_q)
    opts.check_splits()


def _check_q(q: torch.Tensor, k_cache: torch.Tensor, dim: int, hkv: int) -> None:
    if not isinstance(q, torch.Tensor) or q.dim() != 3:
        raise CodesignError(
            f"q must be a 3-D tensor [tokens, q_heads, head_dim], got {getattr(q, 'shape', q)}"
        )
    if q.dtype not in Q_DTYPES:
        raise CodesignError(f"q dtype must be one of {Q_DTYPES}, got {q.dtype}")
    if q.dtype != k_cache.dtype:
        raise CodesignError(f"q dtype {q.dtype} != cache dtype {k_cache.dtype}")
    if q.device != k_cache.device:
        raise CodesignError(f"q is on {q.device} but the cache is on {k_cache.device}")
    if q.shape[2] != dim:
        raise CodesignError(f"q head_dim {q.shape[2]} != cache head_dim {dim}")
    if q.stride(-1) != 1:
        raise CodesignError("q must be contiguous along head_dim")
    hq = q.shape[1]
    if hq == 0 or hq % hkv:
        raise CodesignError(f"q_heads={hq} must be a positive multiple of kv_heads={hkv}")


def _check_lengths(q: torch.Tensor, context_lens: torch.Tensor, cu_seqlens_q: torch.Tensor | None) -> None:
    """Decode: every context holds the query's own token; extend: offsets valid, contexts hold the new tokens."""
    lens = context_lens.cpu()
    if cu_seqlens_q is None:
        short = lens < 1
        if short.any():
            i = int(torch.nonzero(short)[0])
            raise CodesignError(f"context_lens[{i}]={int(lens[i])}: decode needs >= 1 (the query's own token)")
        return
    cu = cu_seqlens_q.cpu()
    ql = cu[1:] - cu[:-1]
    if cu[0] != 0 or (ql < 0).any() or cu[-1] != q.shape[0]:
        raise CodesignError(
            f"cu_seqlens_q must start at 0, not decrease and end at {q.shape[0]} "
            f"(the tokens in q), got {cu.tolist()}"
        )
    bad = lens < ql
    if bad.any():
        i = int(torch.nonzero(bad)[0])
        raise CodesignError(
            f"context_lens[{i}]={int(lens[i])} < its {int(ql[i])} new tokens "
            "(context_lens counts the new tokens, already written to the cache)"
        )


def prepare(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    cu_seqlens_q: torch.Tensor | None,
    tree_args: tuple | None,
    opts: AttentionOptions,
) -> tuple[AttentionBatch, AttentionOptions]:
    """Every check of an attention entry point (all before any launch) and the resolved options.

    k_cache, v_cache: a plain cache, or a quantized cache's `kvcache.checks.geometry_probe` (q's dtype).
    cu_seqlens_q None means decode (the batch gets offsets 0..B); tree_args: (positions, tree_mask,
    mask_indptr) of tree verification, else None.
    """
    _check_inputs(q, k_cache, v_cache, block_tables, context_lens, cu_seqlens_q, opts)
    scale = 1.0 / math.sqrt(q.shape[2]) if opts.sm_scale is None else float(opts.sm_scale)
    is_decode = cu_seqlens_q is None
    cu = torch.arange(q.shape[0] + 1, dtype=torch.int32, device=q.device) if is_decode else cu_seqlens_q
    batch = AttentionBatch(block_tables, context_lens, cu, is_decode, *(tree_args or (None, None, None)))
    return batch, dataclasses.replace(opts, sm_scale=scale)


# --- the custom ops' view of the two values ---------------------------------------------------------------
# The schema every attention op takes after its cache tensors (before its format's own parameters).
OP_ARGS_SCHEMA = (
    "Tensor block_tables, Tensor context_lens, Tensor cu_seqlens_q, Tensor? positions, Tensor? tree_mask, "
    "Tensor? mask_indptr, Tensor? alibi_slopes, float sm_scale, SymInt window, float softcap, "
    "SymInt num_splits, bool is_decode, bool return_lse, Tensor? sinks"
)
OP_ARGS = 14
RETURN_LSE_ARG = 12  # index of return_lse among them


def to_op_args(batch: AttentionBatch, opts: AttentionOptions) -> tuple:
    """The batch and the resolved options in `OP_ARGS_SCHEMA`'s order (0 for an unset window, soft cap or
    split count)."""
    b = batch
    return (b.block_tables, b.context_lens, b.cu_seqlens_q, b.positions, b.tree_mask, b.mask_indptr,
            opts.alibi_slopes, float(opts.sm_scale), opts.window or 0, float(opts.softcap or 0.0),
            opts.num_splits or 0, b.is_decode, bool(opts.return_lse), opts.sinks)  # fmt: skip


def from_op_args(args: tuple) -> tuple[AttentionBatch, AttentionOptions]:
    """`to_op_args`, undone (the data checks ran before the op: check_data is not carried)."""
    bt, cl, cu, pos, mask, mptr, alibi, scale, window, softcap, splits, is_decode, return_lse, sinks = args
    batch = AttentionBatch(bt, cl, cu, is_decode, pos, mask, mptr)
    opts = AttentionOptions(scale, window or None, softcap or None, alibi, return_lse, splits or None, sinks=sinks)
    return batch, opts


def alloc_lse(q: torch.Tensor, return_lse: bool) -> torch.Tensor:
    """Every attention op's second output: lse fp32 `[tokens, q_heads]`, or `[0, q_heads]` when not asked."""
    return torch.empty(q.shape[0] if return_lse else 0, q.shape[1], dtype=torch.float32, device=q.device)
