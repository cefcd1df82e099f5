"""Decode over a mixed-precision cache width by width: the sequence's blocks sorted into one block table per code
width (`_width_tables_kernel`, one small launch, order kept), each width's blocks attended by the per-token INT
kernel at that width (its own tiles and code planes, no width branch in any tile loop), every launch's split
partials written into one workspace and merged by one reduction (`triton_attention.reduce_splits`).

A mixed block of b-bit codes is an INT-b block whose rows sit D bytes apart (`kvcache.mixed`: the writer is the INT
writer on the same strided views), so the three launches read the cache in place. Softmax over a sequence's keys
does not depend on their order, so the sorted tables give the same attention; what does depend on a key's position
(ALiBi, a sliding window) keeps the one-launch kernel (`by_width_applies`), as do extend and tree launches.

Why: the one-launch kernel branches on each block's width inside its loop, so every tile carries three code paths'
loads and registers (sm_90: 8 warps, one program a scheduler, latency-bound). Predicted (sm_90, bf16, batch 16,
context 32k, blocks 8/4/4/2, `bench/attention_predict.py`, untimed): see docs/results.md.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from codesign.backend import device_view
from codesign.kernels.attention.launch_rules import decode_path_on
from codesign.kernels.attention.options import AttentionBatch, AttentionOptions
from codesign.kernels.attention.triton_attention import (
    KernelKV,
    LaunchPlan,
    paged_attention_triton,
    plan_launch,
    reduce_splits,
    split_workspace,
)
from codesign.kernels.host_math import next_pow2
from codesign.kernels.kvcache.formats import KV_FORMAT_INT, KV_FORMAT_MIXED
from codesign.kernels.kvcache.mixed import MIXED_BITS

# The mixed format's config key choosing this path (1) or the one-launch kernel (0); a tuned table may set either.
BY_WIDTH_DEFAULT = 1
MIN_SPLITS = 2  # each width's launch writes partials (one split would write the output itself)
TABLES_CHUNK = 1024  # block-table entries a step of `_width_tables_kernel` sorts


@dataclass(frozen=True, eq=False)
class ByWidthPlan:
    """A by-width decode's launches, made before them (`plan_by_width`): per width (bits, its INT launch plan, whose
    workspace is that launch's slice of `workspace`), the sorted tables' buffers (int32 [widths, B, max_blocks]
    block ids, [widths, B] lengths) and the shared split workspace (fp32 [T, Hq, S, DIM_PAD], [T, Hq, S])."""

    widths: tuple[tuple[int, LaunchPlan], ...]
    tables: torch.Tensor
    lens: torch.Tensor
    workspace: tuple[torch.Tensor, torch.Tensor]
    tree_words: None = None  # (the fields a plan()/run() wrapper reads off any plan)
    oaken_scratch: None = None


def by_width_applies(kv_format: int, q: torch.Tensor, batch: AttentionBatch, opts: AttentionOptions,
                     cache_shape: tuple[int, ...]) -> bool:  # fmt: skip
    """True for a decode over a mixed cache without ALiBi or a window (both read key positions, which the sorted
    tables do not keep) whose config (tuned table or defaults) keeps "BY_WIDTH" on (BY_WIDTH_DEFAULT)."""
    if kv_format != KV_FORMAT_MIXED or not batch.is_decode or opts.alibi_slopes is not None or opts.window:
        return False
    return decode_path_on(q, batch, cache_shape, KV_FORMAT_MIXED, 8, "BY_WIDTH", BY_WIDTH_DEFAULT)


def plan_by_width(
    q: torch.Tensor,
    cache_shape: tuple[int, ...],
    batch: AttentionBatch,
    num_splits: int | None,
    workspace: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> ByWidthPlan:
    """Each width's INT launch (`plan_launch` at that width: its table or defaults, its split count, at least
    MIN_SPLITS), the sorted tables' buffers and one workspace for every launch's partials (`workspace` reused when its
    shape fits). Host-only: no sync."""
    nb, bs, hkv, dim = cache_shape[:4]
    t, hq = q.shape[:2]
    plans = []
    for bits in MIXED_BITS:
        p = plan_launch(q, (nb, bs, hkv, dim * bits // 8), KV_FORMAT_INT, bits, batch, num_splits, allocate=False)
        plans.append((bits, max(p.num_splits, MIN_SPLITS), p))
    total = sum(s for _, s, _ in plans)
    workspace = split_workspace(t, hq, total, dim, q.device, workspace)
    widths, at = [], 0
    for bits, s, p in plans:
        part = (workspace[0][:, :, at : at + s], workspace[1][:, :, at : at + s])
        widths.append((bits, dataclasses.replace(p, num_splits=s, workspace=part)))
        at += s
    b, mb = batch.block_tables.shape
    tables = torch.zeros(len(MIXED_BITS), b, mb, dtype=torch.int32, device=q.device)
    lens = torch.zeros(len(MIXED_BITS), b, dtype=torch.int32, device=q.device)
    return ByWidthPlan(tuple(widths), tables, lens, workspace)


def attend_by_width(
    q: torch.Tensor,
    kv: KernelKV,
    batch: AttentionBatch,
    opts: AttentionOptions,
    out: torch.Tensor,
    lse: torch.Tensor | None,
    plan: ByWidthPlan | None = None,
) -> None:
    """Decode over the mixed cache `kv` into `out` / `lse` (None: not written): sort the block tables by width,
    one INT launch a width, one reduction. No host sync (CUDA-graph capturable with a plan)."""
    plan = plan or plan_by_width(q, tuple(kv.k.shape), batch, opts.num_splits)
    width_tables(batch.block_tables, batch.context_lens, kv.block_bits, kv.k.shape[1], plan.tables, plan.lens)
    dim = kv.k.shape[3]
    for i, (bits, p) in enumerate(plan.widths):
        w = dim * bits // 8  # a b-bit block's bytes a row: the INT-b layout, rows D bytes apart
        sub = KernelKV(kv.k[..., :w], kv.v[..., :w], KV_FORMAT_INT, bits, kv.k_meta, kv.v_meta)
        sub_batch = dataclasses.replace(batch, block_tables=plan.tables[i], context_lens=plan.lens[i])
        paged_attention_triton(q, sub, sub_batch, opts, out, None, p, reduce=False)
    reduce_splits(*plan.workspace, out, lse)


def width_tables(
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    block_bits: torch.Tensor,
    block_size: int,
    tables: torch.Tensor,
    lens: torch.Tensor,
) -> None:
    """Sort each sequence's blocks by width into `tables` [MIXED_BITS, B, max_blocks] (the order kept; entries past
    a width's count untouched) and its token counts into `lens` [MIXED_BITS, B] (the sequence's last block, maybe
    partial, is the last of its width's list). One launch, `_width_tables_kernel`; `width_tables_torch` is the
    reference."""
    b, mb = block_tables.shape
    if b == 0:
        return
    chunk = min(next_pow2(max(mb, 1)), TABLES_CHUNK)
    _width_tables_kernel[(b,)](
        block_tables, context_lens, block_bits, tables, lens,
        block_tables.stride(0), tables.stride(0), tables.stride(1), lens.stride(0),
        BLOCK_SIZE=block_size, CHUNK=chunk, W0=MIXED_BITS[0], W1=MIXED_BITS[1], W2=MIXED_BITS[2],
        num_warps=4 if device_view(block_tables.device).compiled else 1,
    )  # fmt: skip


@triton.jit
def _compact(ids, widths, ok, width: tl.constexpr, count, out_ptr):
    """Store the ids of `width` among `ids` at out_ptr + count + (their rank); the new count."""
    sel = ok & (widths == width)
    pos = count + tl.cumsum(sel.to(tl.int32), 0) - 1
    tl.store(out_ptr + pos, ids, mask=sel)
    return count + tl.sum(sel.to(tl.int32), 0)


@triton.jit
def _width_tables_kernel(
    bt_ptr, ctx_ptr, bits_ptr, tab_ptr, len_ptr,
    stride_bt, stride_tw, stride_tb, stride_lw,
    BLOCK_SIZE: tl.constexpr, CHUNK: tl.constexpr, W0: tl.constexpr, W1: tl.constexpr, W2: tl.constexpr,
):  # fmt: skip
    """One program a sequence: its blocks' widths read through the table, each width's ids stored in order."""
    b = tl.program_id(0)
    ctx = tl.load(ctx_ptr + b)
    nblk = tl.cdiv(ctx, BLOCK_SIZE)
    row = bt_ptr + b.to(tl.int64) * stride_bt
    n0 = ctx * 0
    n1 = ctx * 0
    n2 = ctx * 0
    for c0 in range(0, nblk, CHUNK):
        i = c0 + tl.arange(0, CHUNK)
        ok = i < nblk
        ids = tl.load(row + i, mask=ok, other=0)
        w = tl.load(bits_ptr + ids, mask=ok, other=0).to(tl.int32)
        n0 = _compact(ids, w, ok, W0, n0, tab_ptr + b * stride_tb)
        n1 = _compact(ids, w, ok, W1, n1, tab_ptr + stride_tw + b * stride_tb)
        n2 = _compact(ids, w, ok, W2, n2, tab_ptr + 2 * stride_tw + b * stride_tb)
    # the last block holds ctx - (nblk - 1) * BLOCK_SIZE tokens: its width's list ends with it
    last = tl.load(row + tl.maximum(nblk - 1, 0), mask=nblk > 0, other=0)
    last_w = tl.load(bits_ptr + last, mask=nblk > 0, other=0).to(tl.int32)
    short = nblk * BLOCK_SIZE - ctx
    tl.store(len_ptr + b, n0 * BLOCK_SIZE - tl.where(last_w == W0, short, 0))
    tl.store(len_ptr + stride_lw + b, n1 * BLOCK_SIZE - tl.where(last_w == W1, short, 0))
    tl.store(len_ptr + 2 * stride_lw + b, n2 * BLOCK_SIZE - tl.where(last_w == W2, short, 0))


def width_tables_torch(
    block_tables: torch.Tensor, context_lens: torch.Tensor, block_bits: torch.Tensor, block_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """`width_tables`' reference on the host: (tables, lens), entries past a width's count 0."""
    b, mb = block_tables.shape
    tables = torch.zeros(len(MIXED_BITS), b, mb, dtype=torch.int32)
    lens = torch.zeros(len(MIXED_BITS), b, dtype=torch.int32)
    for s, ctx in enumerate(context_lens.tolist()):
        nblk = -(-ctx // block_size)
        ids = block_tables[s, :nblk].tolist()
        for i, width in enumerate(MIXED_BITS):
            mine = [blk for blk in ids if int(block_bits[blk]) == width]
            tables[i, s, : len(mine)] = torch.tensor(mine, dtype=torch.int32)
            short = nblk * block_size - ctx if ids and int(block_bits[ids[-1]]) == width else 0
            lens[i, s] = len(mine) * block_size - short
    return tables, lens
