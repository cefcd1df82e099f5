"""Decode over an Oaken cache in three launches: the key outliers' score biases (`_key_bias_kernel`), the per-token
INT kernel over the dense codes with those biases added, keeping its probabilities (`triton_attention`'s SCORE_IO),
then the value outliers' corrections of each split (`_value_corr_kernel`), added to its partial by the merge
(`triton_attention.reduce_splits`).

Oaken's dense part is a per-token INT cache in the same layout (`kvcache.oaken`: codes, fp16 (scale, lower bound);
an outlier's position holds code 0, i.e. its token's lower bound `zr`), so the middle launch is the INT kernel
itself, with its tiles, code planes and tables. The outlier index (`kvcache.oaken.outlier_index`, kept by the cache)
holds each slot's difference from that dense value:

    scores   s[h, t] += sum over t's key slots (d, delta) of q[h, d] delta         (before softmax: a bias)
    output   o_s[h, d] += sum over d's value slots (t, delta) of p_s[h, t] delta   (after: into split s's partial)

where p_s[h, t] = 2^(s[h, t] - lse2_s[h]) is split s's normalized probability, so the split merge weighs the
correction as it weighs the rest of the partial. The INT launch keeps p as it computed it, relative to the tile's
running max m (fp16 for 16-bit queries, as its value dot takes p; fp32 for fp32 ones), m per tile, and lse2_s in its
partials; p_s = p 2^(m - lse2_s).

Why: the one-launch kernel (`triton_oaken`) applies both corrections inside every tile. Its tile carries the index
walks, a scratch round trip and their registers (sm_90: 64 x 128 on 4 warps, 236 registers, two warps a
scheduler), and the warp-scheduler simulation found it bound by one warp's dependent chain
(`bench/attention_predict.py`: 0.678 ms at issue 21's shape, 0.76x the bf16 cache). Apart, each launch runs at its
own occupancy: the INT tile on one warp, the walks on small programs with few registers. Predictions:
docs/results.md.

Applies to decode over the online variant without a window whose Oaken config sets "SPLIT" 1 (`split_applies`;
without a table where the batch is large enough to carry the walks' fixed cost, `split_default`, as predicted:
no GPU has timed either path; the tuner tries both); the offline variant (8-bit metadata on a grid the INT kernel
does not decode), extend, tree and windowed launches keep the one-launch kernel.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from codesign.backend import device_view
from codesign.kernels.attention.launch_rules import (
    OCCUPANCY,
    choose_num_splits,
    decode_occupancy,
    decode_path_on,
    default_config,
    dim_pad,
    same_tile,
    with_cap,
)
from codesign.kernels.attention.options import AttentionBatch, AttentionOptions
from codesign.kernels.attention.triton_attention import (
    KernelKV,
    LaunchPlan,
    paged_attention_triton,
    plan_launch,
    reduce_splits,
    split_workspace,
)
from codesign.kernels.attention.triton_oaken import oaken_slot
from codesign.kernels.host_math import cdiv, next_pow2
from codesign.kernels.kvcache.formats import KV_FORMAT_INT, KV_FORMAT_OAKEN
from codesign.kernels.kvcache.oaken import index_capacity

# The Oaken config's key "SPLIT" chooses this path (1) or the one-launch kernel (0). Without a table: this path from
# SPLIT_MIN_TOKEN_HEADS sequences x kv heads x context (the block table's width) on, where it is predicted faster
# (sm_90, bench/attention_predict.py --sweep, untimed: 16 x 8k 94 against 170 us, 64 x 1k 51 against 82, 1 x 32k 37
# against 46, 16 x 1k 24.1 against 24.8); below, the walks' fixed cost loses (1 x 8k 24 against 15 us)
SPLIT_MIN_TOKEN_HEADS = 1 << 17
MIN_SPLITS = 2  # the INT launch writes partials (one split would write the output itself)
# The walks (one warp a program): blocks a step side by side (a step's chain of dependent loads shared by them), the
# first FIRST ranks of every list in straight-line code (their loads in flight together), then RANKS a trip. The
# value walk's 4 and 1 (were 2 and 2) are the bench cache's best (sm_90, issue 21's shape, untimed: 0.116 -> 0.105 ms;
# 2..6 straight ranks by 1 or 2 a trip within 0.105-0.119, each pair set here by hand): its lists hold 1.3 slots a
# channel, a block's fullest ~5
BIAS_NBLK, BIAS_FIRST, BIAS_RANKS = 2, 6, 2
CORR_NBLK, CORR_FIRST, CORR_RANKS = 1, 4, 1
# The value walks split each split's blocks among programs: as many as one wave holds at CORR_MAXNREG registers
# (65536 / 32 lanes / 64 = 32 one-warp programs an SM; uncapped it took 80, 25 an SM), each over at least
# CORR_MIN_BLOCKS blocks. A walk is a chain of dependent loads: more of them at once, not fewer registers, sets its time
CORR_MAXNREG, CORR_PROGRAMS_PER_SM, CORR_MIN_BLOCKS = 64, 32, 2
# The INT launch with biases in and probabilities out holds more registers than the INT format's own (sm_90, INT4,
# head_dim 128, one warp: 223 uncapped, 9 an SM, and 92 B of spills at the INT tile's own cap of 168), so on the INT
# format's default tile it takes its own occupancy: a program an SM fewer than the INT tile uncapped (SCORE_IO_FEWER;
# a program more would run in a second wave), and by width SCORE_IO_CAP (cap, programs an SM) where that raises the
# split count (`launch_rules.decode_occupancy`): INT4 at 200 registers, no spills, 10 an SM, the INT launch predicted
# 0.207 -> 0.190 ms, the three launches 0.459 -> 0.431 (1.13x -> 1.20x bf16) at issue 21's shape (at 184, 11 an SM,
# it spills 60 B). Other tiles keep their config, a program fewer an SM.
SCORE_IO_CAP = {4: (200, 10)}  # by bits
# query heads a kv head the cap fits (`bench/attention_predict.py --heads 64 8`: none; at 32 2, with the cap forced,
# it spilled 32 B: sm_90, bf16)
SCORE_IO_MAX_GROUP = 8
SCORE_IO_FEWER = 1
BIAS_PROGRAMS_PER_SM = 16  # the bias launch's programs: blocks a program so that about this many fill an SM
_NEG_INF = tl.constexpr(float("-inf"))


@dataclass(frozen=True, eq=False)
class SplitPlan:
    """An Oaken decode's launches, made before them (`plan_split`): the INT launch's plan (its workspace the split
    partials, its `oaken_scratch` the tiles' running maxima fp32 [B, Hq, T / BLOCK_N]), the score biases fp32
    [B, Hq, T], the kept probabilities [B, kv heads, T, group] (fp16, fp32 for fp32 queries), q fp32 channel-major
    [B, kv_heads, D, GP], the value walks' corrections fp32 [B, Hq, S, W, DIM_PAD] (W walks a split) and the bias
    launch's blocks a program; T: the block table's tokens, to a multiple of the tile."""

    launch: LaunchPlan
    bias: torch.Tensor
    probs: torch.Tensor
    q_t: torch.Tensor
    corr: torch.Tensor
    chunk: int
    tree_words: None = None  # (the fields a plan()/run() wrapper reads off any plan)
    oaken_scratch: None = None

    @property
    def workspace(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        return self.launch.workspace


def split_applies(kv_format: int, q: torch.Tensor, batch: AttentionBatch, opts: AttentionOptions,
                  cache_shape: tuple[int, ...]) -> bool:  # fmt: skip
    """True for a decode over an online Oaken cache without a window (the kept probabilities cover the split's
    tiles, which a window would move) whose Oaken config (tuned table or defaults) keeps "SPLIT" on."""
    if kv_format != KV_FORMAT_OAKEN or not batch.is_decode or opts.window:
        return False
    return decode_path_on(q, batch, cache_shape, KV_FORMAT_OAKEN, 4, "SPLIT", split_default(batch, cache_shape))


def split_default(batch: AttentionBatch, cache_shape: tuple[int, ...]) -> int:
    """SPLIT without a table: 1 from SPLIT_MIN_TOKEN_HEADS sequences x kv heads x context (host-side shapes only)."""
    b, mb = batch.block_tables.shape
    return int(b * cache_shape[2] * mb * cache_shape[1] >= SPLIT_MIN_TOKEN_HEADS)


def plan_split(
    q: torch.Tensor,
    cache_shape: tuple[int, ...],
    bits: int,
    batch: AttentionBatch,
    num_splits: int | None,
    workspace: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> SplitPlan:
    """The INT launch over the dense codes (`plan_launch` at `bits`: its table or defaults, its split count, at least
    MIN_SPLITS) and the buffers the three launches share (`workspace` reused when its shape fits). Host-only."""
    nb, bs, hkv, dim = cache_shape[:4]
    t, hq = q.shape[:2]
    p = plan_launch(q, (nb, bs, hkv, dim * bits // 8), KV_FORMAT_INT, bits, batch, num_splits, allocate=False)
    view, programs, ctx = device_view(q.device), batch.block_tables.shape[0] * hkv, batch.block_tables.shape[1] * bs
    sms = view.sms
    cfg, per_sm = p.config, p.config.get("PROGRAMS_PER_SM")
    base = default_config(dim, q.element_size(), KV_FORMAT_INT, bits, bs)
    if "PROGRAMS_PER_SM" in base and same_tile(cfg, base):  # the INT default's tile: this launch's own occupancy
        own = {k: v for k, v in cfg.items() if k not in OCCUPANCY}
        own["PROGRAMS_PER_SM"] = max(1, base["PROGRAMS_PER_SM"] - SCORE_IO_FEWER)
        if bits in SCORE_IO_CAP and hq // hkv <= SCORE_IO_MAX_GROUP and base["num_warps"] == 1:
            own = with_cap(own, *SCORE_IO_CAP[bits])
        cfg = decode_occupancy(own, programs, ctx, sms, num_splits, view.capability)
        per_sm = cfg["PROGRAMS_PER_SM"]
    elif per_sm is not None and per_sm > SCORE_IO_FEWER:
        per_sm -= SCORE_IO_FEWER
    if num_splits is None and per_sm:  # its own occupancy
        p = dataclasses.replace(p, num_splits=choose_num_splits(programs, ctx, sms, cfg["num_warps"], per_sm))
    p = dataclasses.replace(p, config=cfg)
    s, bn = max(p.num_splits, MIN_SPLITS), p.config["BLOCK_N"]
    workspace = split_workspace(t, hq, s, dim, q.device, workspace)
    b, mb = batch.block_tables.shape
    tokens = -(-mb * bs // bn) * bn
    gp = next_pow2(hq // hkv)
    maxima = torch.empty(b, hq, tokens // bn, dtype=torch.float32, device=q.device)
    launch = dataclasses.replace(p, num_splits=s, workspace=workspace, oaken_scratch=maxima)
    if b * hq * tokens >= 2**31:  # (the INT launch's offsets into them are int32)
        raise ValueError(f"{b} sequences x {hq} heads x {tokens} tokens: too many scores to keep (< 2^31)")
    bias = torch.empty(b, hq, tokens, dtype=torch.float32, device=q.device)
    # p as the INT tile feeds it to its value dot: fp16 for 16-bit queries, fp32 for fp32 ones
    pdt = torch.float32 if q.dtype == torch.float32 else torch.float16
    probs = torch.empty(b, hkv, tokens, hq // hkv, dtype=pdt, device=q.device)  # (a token's heads side by side)
    q_t = torch.zeros(b, hkv, dim, gp, dtype=torch.float32, device=q.device)  # padding heads stay 0
    sms = sms or 132  # (CPU: an H100's, as `choose_num_splits` assumes)
    # the value walks: at most CORR_PROGRAMS_PER_SM an SM (one wave), each over at least CORR_MIN_BLOCKS blocks
    walks = max(1, min(sms * CORR_PROGRAMS_PER_SM // (b * hkv * s), -(-mb // (s * CORR_MIN_BLOCKS))))
    corr = torch.empty(b, hq, s, walks, dim_pad(dim), dtype=torch.float32, device=q.device)
    chunk = -(-max(1, -(-mb * b * hkv // (sms * BIAS_PROGRAMS_PER_SM))) // BIAS_NBLK) * BIAS_NBLK  # whole steps
    return SplitPlan(launch, bias, probs, q_t, corr, chunk)


def attend_split(
    q: torch.Tensor,
    kv: KernelKV,
    batch: AttentionBatch,
    opts: AttentionOptions,
    out: torch.Tensor,
    lse: torch.Tensor | None,
    plan: SplitPlan | None = None,
) -> None:
    """Decode over the Oaken cache `kv` (its k_side / v_side the outlier index) into `out` / `lse` (None: not
    written): biases, the INT launch, the value corrections, the merge. No host sync (CUDA-graph capturable
    with a plan)."""
    plan = plan or plan_split(q, tuple(kv.k.shape[:3]) + (q.shape[2],), kv.bits, batch, opts.num_splits)
    t, hq, dim = q.shape
    nb, bs, hkv = kv.k.shape[:3]
    group, gp = hq // hkv, plan.q_t.shape[3]
    cap = index_capacity(kv.k_side.shape[2], bs, dim)
    plan.q_t[..., :group].copy_(q.reshape(t, hkv, group, dim).transpose(2, 3))
    bt = batch.block_tables
    _key_bias_kernel[(t, hkv, cdiv(bt.shape[1], plan.chunk))](
        plan.q_t, kv.k_side, bt, batch.context_lens, plan.bias,
        kv.k_side.stride(0), kv.k_side.stride(1), bt.stride(0), plan.bias.stride(0), plan.bias.stride(1),
        plan.chunk, bt.shape[1],
        GROUP=group, GP=gp, HEAD_DIM=dim, BLOCK_SIZE=bs, BS_PAD=next_pow2(bs), NBLK=BIAS_NBLK,
        CAP=cap, FIRST=BIAS_FIRST, R=BIAS_RANKS, num_warps=1,
    )  # fmt: skip
    dense = KernelKV(kv.k, kv.v, KV_FORMAT_INT, kv.bits, kv.k_meta, kv.v_meta, plan.bias, plan.probs)
    paged_attention_triton(q, dense, batch, opts, out, None, plan.launch, reduce=False)
    o_part, l_part = plan.launch.workspace
    cfg, s, w = plan.launch.config, plan.launch.num_splits, plan.corr.shape[3]
    _value_corr_kernel[(t, hkv, s * w)](
        kv.v_side, bt, batch.context_lens, plan.probs, plan.launch.oaken_scratch, plan.corr, l_part,
        kv.v_side.stride(0), kv.v_side.stride(1), bt.stride(0), *l_part.stride(), plan.bias.stride(0),
        plan.bias.stride(1),
        GROUP=group, GP=gp, HEAD_DIM=dim, DIM_PAD=dim_pad(dim), BLOCK_SIZE=bs, BLOCK_N=cfg["BLOCK_N"],
        NUM_SPLITS=s, WALKS=w, NBLK=CORR_NBLK, CAP=cap, FIRST=CORR_FIRST, R=CORR_RANKS, num_warps=1,
        maxnreg=CORR_MAXNREG,
    )  # fmt: skip
    reduce_splits(o_part, l_part, out, lse, plan.corr)


@triton.jit
def _walk_heads(ix_ptr, blk, kvh, stride_ib, stride_ih, at, ok, CAP: tl.constexpr, N: tl.constexpr):
    """Each lane's list in its block's index (`outlier_index`): the index row, the list's (start, end) for list
    `at` of that block, and the fullest list of the step's blocks (the remainder loops' bound)."""
    ib = ix_ptr + blk * stride_ib + kvh * stride_ih
    st = tl.load(ib + CAP + at, mask=ok, other=0)
    en = tl.load(ib + CAP + at + 1, mask=ok, other=0)
    nr = tl.max(tl.load(ib + CAP + N + 1, mask=ok, other=0))
    return ib, st, en, nr


@triton.jit
def _slot(ib, st, en, r):
    """Rank r of each lane's list as (coordinate, delta, live): past the list's end coordinate 0, delta 0."""
    live = r < en - st
    c, delta = oaken_slot(tl.load(ib + (st + r), mask=live, other=0))
    return c, delta, live


@triton.jit
def _key_bias_kernel(
    qt_ptr, ix_ptr, bt_ptr, ctx_ptr, bias_ptr,
    stride_ib, stride_ih, stride_bt, stride_sb, stride_sh, chunk, max_blocks,
    GROUP: tl.constexpr, GP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, BS_PAD: tl.constexpr,
    NBLK: tl.constexpr, CAP: tl.constexpr, FIRST: tl.constexpr, R: tl.constexpr,
):  # fmt: skip
    """One program a (sequence, kv head, `chunk` blocks), NBLK blocks a step side by side (a lane a token), each
    step's block ids loaded a step ahead: each token's key slots (the token-sorted index: (channel, delta) words)
    times the group's q at that channel (qt: fp32 channel-major, a slot's heads one load), summed per token into
    the biases [B, Hq, T] (a head's tokens side by side). The first FIRST ranks of every list in straight-line code
    (their loads in flight together), the rest R a trip."""
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    kv_len = tl.load(ctx_ptr + b)
    lane = tl.arange(0, NBLK * BS_PAD)
    t = lane % BS_PAD
    g = tl.arange(0, GP)
    qrow = qt_ptr + (b * tl.num_programs(1) + kvh).to(tl.int64) * (HEAD_DIM * GP)
    btrow = bt_ptr + b.to(tl.int64) * stride_bt
    lo = tl.program_id(2) * chunk
    hi = tl.minimum(tl.minimum(lo + chunk, max_blocks), tl.cdiv(kv_len, BLOCK_SIZE))
    bi_n = lo + lane // BS_PAD
    blk_n = tl.load(btrow + bi_n, mask=bi_n < hi, other=0)
    for b0 in range(lo, hi, NBLK):
        bi = b0 + lane // BS_PAD
        ok = (t < BLOCK_SIZE) & (bi < hi)
        blk = blk_n.to(tl.int64)
        blk_n = tl.load(btrow + bi + NBLK, mask=bi + NBLK < hi, other=0)  # the next step's (off its chain)
        ib, st, en, nr = _walk_heads(ix_ptr, blk, kvh, stride_ib, stride_ih, t, ok, CAP, BLOCK_SIZE)
        acc = tl.zeros([GP, NBLK * BS_PAD], tl.float32)
        for u in tl.static_range(FIRST):
            ch, delta, _ = _slot(ib, st, en, u)
            acc += tl.load(qrow + (ch * GP)[None, :] + g[:, None]) * delta[None, :]
        for r in range(FIRST, nr, R):
            for u in tl.static_range(R):
                ch, delta, _ = _slot(ib, st, en, r + u)
                acc += tl.load(qrow + (ch * GP)[None, :] + g[:, None]) * delta[None, :]
        tj = bi * BLOCK_SIZE + t
        tl.store(bias_ptr + b.to(tl.int64) * stride_sb + (kvh * GROUP + g)[:, None] * stride_sh + tj[None, :], acc,
                 mask=(g < GROUP)[:, None] & (ok & (tj < kv_len))[None, :])  # fmt: skip


@triton.jit
def _value_slot(ib, st, en, r, first, s_lo, s_hi, pk, mk, lse, g, g_ok, acc, GROUP: tl.constexpr,
                WHOLE: tl.constexpr, BLOCK_N: tl.constexpr, STRIDE_MH):  # fmt: skip
    """Rank r of each (block, channel) list: its token's kept p, the group's heads side by side (one load), times
    its delta, into `acc` [NBLK, DIM_PAD, GP]; tokens outside the split's keys count nothing. Not WHOLE (blocks
    across tiles): each p times its tile's factor 2^(m - lse2) here."""
    tok, delta, live = _slot(ib, st, en, r)
    tj = first + tok
    ok = live & (tj >= s_lo) & (tj < s_hi)  # the split's keys only
    delta = tl.where(ok, delta, 0.0)
    m3 = ok[:, :, None] & g_ok[None, None, :]
    pg = tl.load(pk + (tj * GROUP)[:, :, None] + g[None, None, :], mask=m3, other=0.0).to(tl.float32)
    if not WHOLE:
        mt = tl.load(mk + (tj // BLOCK_N)[:, :, None] + (g * STRIDE_MH)[None, None, :], mask=m3, other=0.0)
        pg = pg * tl.exp2(mt - lse[None, None, :])
    return acc + pg * delta[:, :, None]


@triton.jit
def _value_corr_kernel(
    ix_ptr, bt_ptr, ctx_ptr, pk_ptr, mk_ptr, c_ptr, lsep_ptr,
    stride_ib, stride_ih, stride_bt, stride_pt, stride_ph, stride_ps, stride_kb, stride_kh,
    GROUP: tl.constexpr, GP: tl.constexpr, HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr, WALKS: tl.constexpr, NBLK: tl.constexpr, CAP: tl.constexpr,
    FIRST: tl.constexpr, R: tl.constexpr,
):  # fmt: skip
    """One program a (sequence, kv head, split, walk: a WALKS-th of the split's blocks), NBLK blocks a step side by
    side (lanes: the blocks' channels), each step's block ids loaded a step ahead: over its keys (the INT launch's
    split), each channel's value slots (the channel-sorted index: (token, delta) words) times the kept probabilities
    of the slot's token (pk [B, kv heads, T, GROUP]: the group's heads one load; maxima mk [B, Hq, T / BLOCK_N],
    stride_kb / stride_kh the [B, Hq, T] strides) normalized to the split (2^(m - lse2)), summed per channel into the
    walk's row of the corrections c [B, Hq, NUM_SPLITS, WALKS, DIM_PAD] (the merge, `reduce_splits`, adds them to the
    split's partial). Ranks as the key walk's."""
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2) // WALKS
    walk = tl.program_id(2) % WALKS
    kv_len = tl.load(ctx_ptr + b)
    per = tl.cdiv(tl.cdiv(kv_len, NUM_SPLITS), BLOCK_N) * BLOCK_N  # (`_paged_attn_kernel`'s split of the keys)
    s_lo = split * per
    s_hi = tl.minimum(kv_len, s_lo + per)
    d = tl.arange(0, DIM_PAD)
    d_ok = d < HEAD_DIM
    nb = tl.arange(0, NBLK)
    g = tl.arange(0, GP)
    g_ok = g < GROUP
    btrow = bt_ptr + b.to(tl.int64) * stride_bt
    pt = b.to(tl.int64) * stride_pt + split * stride_ps  # the split's partial rows (a head's: + qh stride_ph)
    head0 = b.to(tl.int64) * stride_kb + kvh * GROUP * stride_kh  # the group's first head in [B, Hq, T]
    pk = pk_ptr + head0  # ([B, kv heads, T, GROUP]: the same offset)
    mk = mk_ptr + head0 // BLOCK_N
    STRIDE_MH = stride_kh // BLOCK_N
    # the split's lse2 per head (+inf for -inf, a split of no keys or a padding head: its factors 2^(m - lse2) are 0)
    lse = tl.load(lsep_ptr + pt + (kvh * GROUP + g) * stride_ph, mask=g_ok, other=float("-inf"))
    lse = tl.where(lse > _NEG_INF, lse, float("inf"))
    parts = tl.zeros([NBLK, DIM_PAD, GP], tl.float32)
    WHOLE: tl.constexpr = BLOCK_N % BLOCK_SIZE == 0  # a block inside one tile: one factor a block and head
    first_blk = s_lo // BLOCK_SIZE
    per_walk = tl.cdiv(tl.maximum(tl.cdiv(s_hi, BLOCK_SIZE) - first_blk, 0), WALKS)
    lo = first_blk + walk * per_walk
    hi = tl.minimum(tl.cdiv(s_hi, BLOCK_SIZE), lo + per_walk)
    blk_n = tl.load(btrow + lo + nb, mask=lo + nb < hi, other=0)
    for b0 in range(lo, hi, NBLK):
        bi = b0 + nb
        b_ok = bi < hi
        blk = blk_n.to(tl.int64)
        blk_n = tl.load(btrow + bi + NBLK, mask=bi + NBLK < hi, other=0)  # the next step's (off its chain)
        m2 = b_ok[:, None] & d_ok[None, :]
        ib, st, en, nr = _walk_heads(ix_ptr, blk[:, None], kvh, stride_ib, stride_ih, d[None, :], m2, CAP, HEAD_DIM)
        first = (bi * BLOCK_SIZE)[:, None]
        step = tl.zeros([NBLK, DIM_PAD, GP], tl.float32)
        for u in tl.static_range(FIRST):
            step = _value_slot(ib, st, en, u, first, s_lo, s_hi, pk, mk, lse, g, g_ok, step, GROUP, WHOLE, BLOCK_N,
                               STRIDE_MH)  # fmt: skip
        for r in range(FIRST, nr, R):
            for u in tl.static_range(R):
                step = _value_slot(ib, st, en, r + u, first, s_lo, s_hi, pk, mk, lse, g, g_ok, step, GROUP, WHOLE,
                                   BLOCK_N, STRIDE_MH)  # fmt: skip
        if WHOLE:  # p of the split: 2^(m - lse2), m the tile's running max, one a block and head
            mt = tl.load(mk + (bi * BLOCK_SIZE // BLOCK_N)[:, None] + (g * STRIDE_MH)[None, :],
                         mask=b_ok[:, None] & g_ok[None, :], other=0.0)  # fmt: skip
            parts += step * tl.exp2(mt - lse[None, :])[:, None, :]
        else:  # (each slot's factor applied in `_value_slot`)
            parts += step
    out = tl.sum(parts, 0)  # [DIM_PAD, GP]
    tl.store(c_ptr + ((pt + (kvh * GROUP + g)[None, :] * stride_ph) * WALKS + walk) * DIM_PAD + d[:, None], out,
             mask=d_ok[:, None] & g_ok[None, :])  # fmt: skip
