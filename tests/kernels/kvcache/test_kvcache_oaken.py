"""Oaken paged cache (`codesign.kernels.kvcache.oaken`): the online writer equals the block reference
(`kv_quant.oaken_quantize_block`, itself bit-exact against the accelerator model's quantizer) including
capacity overflow, and the kernel (dense codes + fused sparse outliers) against an fp64 reference built
from that block reference."""

from __future__ import annotations

import contextlib

import pytest
import torch
from helpers import assert_rel_close, seq_slots, shuffled_block_tables
from paged_attention_ref import reference_attention

from codesign.autotune.lookup import forced_config
from codesign.backend import use_backend
from codesign.kernels.attention.quantized import oaken_attention
from codesign.kernels.attention.tree import build_tree_batch
from codesign.kernels.kvcache import quantizers as kvq
from codesign.kernels.kvcache.oaken import OakenPagedKV, dense_zeros
from codesign.specs import CodesignError

BS, H, D, CAP = 4, 2, 16, 3


@contextlib.contextmanager
def decode_path(split: int, tile: int | None = None):
    """Online Oaken decode in three launches (split 1, `attention.oaken_split`: the INT launch's tile `tile`) or in
    the one-launch kernel (0, its tile `tile`); extend and tree take the one-launch kernel's tile either way."""
    from codesign.kernels.attention import launch_rules as lr
    from codesign.kernels.kvcache.formats import KV_FORMAT_INT, KV_FORMAT_OAKEN

    tiles = {} if tile is None else {"BLOCK_N": tile}
    with forced_config(lr.table_op(KV_FORMAT_OAKEN, 4), {**tiles, "SPLIT": split}), \
            forced_config(lr.table_op(KV_FORMAT_INT, 4), tiles):  # fmt: skip
        yield


def _setup(ctx, bits=4, bs=BS, cap=CAP, spikes=(5,), token_spikes=(), value_spikes=()):
    bt, nb = shuffled_block_tables(ctx, bs)
    xs = [(torch.randn(c, H, D), torch.randn(c, H, D)) for c in ctx]
    for k, _ in xs:
        k[:, :, list(spikes)] *= 6  # channel outliers: more outliers than slots in some blocks
        k[[t for t in token_spikes if t < k.shape[0]]] *= 6  # token outliers: one token's many key slots
    for _, v in xs:
        v[:, :, list(value_spikes)] *= 6  # value channel outliers: long channel lists
    thr = kvq.calibrate_kv_thresholds([(torch.cat([k for k, _ in xs]), torch.cat([v for _, v in xs]))], 0.05)[
        0
    ]
    cache = OakenPagedKV.empty(nb, bs, H, D, bits, thr, cap)
    cache.k_meta.fill_(float("nan"))  # poison the slots nothing writes
    cache.v_meta.fill_(float("nan"))
    cache.ensure_index()  # a hand edit (the meta's zeros are in the index): rebuilt from it
    for b, (k, v) in enumerate(xs):  # token by token, sequences interleaved in one call
        cache.write(k, v, seq_slots(bt, b, k.shape[0], bs))
    return cache, bt, torch.tensor(ctx, dtype=torch.int32), xs, thr


def _reference_pool(cache, bt, xs, thr, bits):
    """fp64 pool from the block reference; also the total overflow it reports."""
    bs, cap = cache.k_codes.shape[1], cache.capacity
    kd = torch.full((cache.k_codes.shape[0], bs, H, D), float("nan"), dtype=torch.float64)
    vd = kd.clone()
    over = 0
    for b, (k, v) in enumerate(xs):
        for s in range(0, k.shape[0], bs):
            blk = int(bt[b, s // bs])
            for x, pool, t in ((k, kd, thr[0]), (v, vd, thr[1])):
                qb = kvq.oaken_quantize_block(x[s : s + bs], bits, t, cap)
                pool[blk, : qb.codes.shape[0]] = kvq.oaken_dequantize_block(qb).double()
                over += int(qb.overflow.sum())
    return kd, vd, over


def read_pool(cache, kd, vd):
    """A reference pool (fp64 K, V: the cache's pool as stored) as the attention kernels read it: each outlier its
    token's zero plus its delta as the index rounds it (`OakenPagedKV.dequantize(as_read=True)`: within 2^-15 of
    the delta, `test_read_pool_moves_only_outliers_within_the_rounding`), every other element as it is."""
    (sk, sv), (rk, rv) = cache.dequantize(), cache.dequantize(as_read=True)
    return kd + (rk.double() - sk.double()), vd + (rv.double() - sv.double())


@pytest.mark.parametrize("offline", [False, True])
def test_read_pool_moves_only_outliers_within_the_rounding(offline):
    """The pool as the kernels read it (`dequantize(as_read=True)`, the kernel tests' reference) differs from the
    pool as stored only at the slots' positions, each by less than 2^-15 of its delta (its value minus its token's
    zero) and in fp32 by the sum's own rounding (half an ulp); offline most slots do move (the rounding is there),
    online none does here."""
    if offline:
        from test_kvcache_oaken_offline import _setup as setup

        cache = setup([11, 70, 100])[0]
    else:
        cache = _setup([11, 70, 100], bs=8, cap=12, spikes=(5, 9))[0]
    d = cache.head_dim
    sides = zip(cache.dequantize(), cache.dequantize(as_read=True), (cache.k_out, cache.v_out),
                (cache.k_meta, cache.v_meta))  # fmt: skip
    for i, (stored, read, out, meta) in enumerate(sides):
        at = torch.zeros_like(stored, dtype=torch.bool)
        blk, hh, _ = torch.nonzero(out >= 0, as_tuple=True)
        pos = out[out >= 0] >> 16
        at[blk, pos // d, hh, pos % d] = True
        assert at.sum() > 10
        torch.testing.assert_close(read[~at], stored[~at], rtol=0, atol=0, equal_nan=True)  # (unwritten: NaN)
        zeros = dense_zeros(meta, None if cache.grid is None else cache.grid[i]).transpose(1, 2).unsqueeze(-1)
        z = zeros.expand_as(stored)[at].double()
        moved = (read[at].double() - stored[at].double()).abs()
        bound = (stored[at].double() - z).abs() * 2**-15 + read[at].double().abs() * 2**-24
        assert (moved <= bound).all()
        if offline:  # fp32 zeros on the grid: most deltas need more than the word's 15 significant bits
            assert (moved > 0).float().mean() > 0.5
        else:  # an fp16 value minus an fp16 zero of like scale fits in them: exact here
            assert not moved.any()


@pytest.mark.parametrize("bits", [2, 4])
def test_online_writer_equals_block_reference(bits):
    cache, bt, cl, xs, thr = _setup([11, 6], bits)
    kd, vd, over = _reference_pool(cache, bt, xs, thr, bits)
    gk, gv = cache.dequantize()
    live = ~torch.isnan(kd[..., 0, 0])
    assert torch.equal(gk[live].double(), kd[live]) and torch.equal(gv[live].double(), vd[live])
    assert int(cache.overflow.sum()) == over > 0  # the capacity did overflow, and both count alike
    assert int(cache.k_count.max()) == CAP


@pytest.mark.parametrize("splits", [1, 2])
def test_kernel_vs_fp64(splits):
    cache, bt, cl, xs, thr = _setup([11, 6, 9])
    kd, vd, _ = _reference_pool(cache, bt, xs, thr, 4)
    kd, vd = read_pool(cache, kd, vd)
    q = torch.randn(3, 2 * H, D)
    with use_backend("triton"):
        out = oaken_attention(q, cache, bt, cl, num_splits=splits)
    ref, _ = reference_attention(q, kd, vd, bt, cl, [1, 1, 1])
    assert_rel_close(out, ref, 2e-6, "oaken decode")
    assert_rel_close(oaken_attention(q, cache, bt, cl), ref, 2e-6, "oaken decode (torch)")
    qe = torch.randn(5, 2 * H, D)
    cu = torch.tensor([0, 3, 3, 5], dtype=torch.int32)
    with use_backend("triton"):
        oe = oaken_attention(qe, cache, bt, cl, cu, num_splits=splits)
    ref_e, _ = reference_attention(qe, kd, vd, bt, cl, [3, 0, 2])
    assert_rel_close(oe, ref_e, 2e-6, "oaken extend")


@pytest.mark.parametrize("bs, cap", [(32, 40), (24, 20), (8, 12), (128, 60)])
def test_kernel_outlier_chunks_vs_fp64(bs, cap):
    """The kernel adds each outlier's correction through the per-launch index (token lists for keys, channel lists
    for values): blocks as wide as the 64-token tile (32: two a tile), straddling tiles (24, 32-token tiles),
    several blocks per tile (8), wider than the tile (128: a tile takes only its tokens' value slots); many slots per
    block, full blocks (the outlier channel overflows them, so channel lists run long) and short last blocks."""
    cache, bt, cl, xs, thr = _setup([70, 33, 20, 50], bs=bs, cap=cap, spikes=(5, 9, 12))
    assert int(cache.k_count.max()) > (8 if bs == 8 else 16)  # many slots in use
    kd, vd, _ = _reference_pool(cache, bt, xs, thr, 4)
    kd, vd = read_pool(cache, kd, vd)
    q = torch.randn(4, 2 * H, D)
    ref, _ = reference_attention(q, kd, vd, bt, cl, [1] * 4)
    for splits in (1, 3):
        with use_backend("triton"):
            out = oaken_attention(q, cache, bt, cl, num_splits=splits)
        assert_rel_close(out, ref, 2e-6, f"oaken decode bs={bs} cap={cap} splits={splits}")



@pytest.mark.parametrize("tile, split", [(32, 0), (64, 0), (32, 1)])
@pytest.mark.parametrize("qdtype", [torch.float32, torch.float16])
def test_kernel_lists_past_the_ranks_loaded_ahead_vs_fp64(tile, qdtype, split):
    """Decode with 16-bit queries loads each tile's first OAKEN_KEY_RANKS key slots a token and OAKEN_RANKS value
    slots a channel ahead of its dense part (`oaken_key_first`, `oaken_value_first`; fp32 queries, extend and
    tree load 3 / 5 a trip where used); longer lists go on in loops. Token spikes (many key slots on one token)
    and value channel spikes (a channel's slot on most tokens of a block) make both kinds of list run past those
    ranks: decode with splits and extend against fp64, decode in one launch and in three (`oaken_split`: its walks
    run to each block's fullest list, RANKS a trip)."""
    from codesign.kernels.attention import triton_attention as ta

    cache, bt, cl, xs, thr = _setup([70, 45, 61], bs=32, cap=160, spikes=(), token_spikes=(13, 45, 60),
                                    value_spikes=(3, 9, 14))  # fmt: skip
    kd, vd, over = _reference_pool(cache, bt, xs, thr, 4)
    kd, vd = read_pool(cache, kd, vd)
    assert over == 0
    k_rank = cache.k_index[..., cache.capacity + 32 + 1]  # each (block, head)'s fullest token
    v_rank = cache.v_index[..., cache.capacity + D + 1]  # and fullest channel
    assert int(k_rank.max()) > ta.OAKEN_KEY_RANKS and int(v_rank.max()) > ta.OAKEN_RANKS, (k_rank, v_rank)
    q = torch.randn(3, 2 * H, D).to(qdtype)
    ref, _ = reference_attention(q.float(), kd, vd, bt, cl, [1, 1, 1])
    qe = torch.randn(5, 2 * H, D).to(qdtype)
    cu = torch.tensor([0, 3, 3, 5], dtype=torch.int32)
    ref_e, _ = reference_attention(qe.float(), kd, vd, bt, cl, [3, 0, 2])
    tol = 2e-6 if qdtype == torch.float32 else 2e-3
    with use_backend("triton"), decode_path(split, tile):
        for splits in (1, 3):
            out = oaken_attention(q, cache, bt, cl, num_splits=splits).double()
            assert_rel_close(out, ref, tol, f"splits={splits}")
        assert_rel_close(oaken_attention(qe, cache, bt, cl, cu, num_splits=2).double(), ref_e, tol, "extend")

def test_tree_kernel_vs_fp64():
    parents = [[-1, 0, 1], [-1, 0, 0, 2]]
    tree = build_tree_batch(parents, [8, 5])
    cache, bt, cl, xs, thr = _setup(tree.context_lens.tolist())
    kd, vd, _ = _reference_pool(cache, bt, xs, thr, 4)
    kd, vd = read_pool(cache, kd, vd)
    q = torch.randn(7, 2 * H, D)
    with use_backend("triton"):
        out = oaken_attention(q, cache, bt, None, tree=tree, num_splits=1)
    ref, _ = reference_attention(q, kd, vd, bt, tree.context_lens, [3, 4], parents=parents)
    assert_rel_close(out, ref, 2e-6, "oaken tree")
    assert_rel_close(oaken_attention(q, cache, bt, None, tree=tree), ref, 2e-6, "oaken tree (torch)")


def test_bad_input():
    thr = torch.tensor([[[-1.0, 1.0]] * H] * 2)
    with pytest.raises(CodesignError, match=r"shape \(2, 2, 2\)"):
        OakenPagedKV.empty(4, BS, H, D, 4, thr[0], CAP)
    bad = thr.clone()
    bad[1, 0, 1] = float("nan")
    with pytest.raises(CodesignError, match="finite"):
        OakenPagedKV.empty(4, BS, H, D, 4, bad, CAP)
    with pytest.raises(CodesignError, match="< 32768"):
        OakenPagedKV.empty(4, 256, H, 128, 4, thr, CAP)
    with pytest.raises(CodesignError, match="capacity"):
        OakenPagedKV.empty(4, BS, H, D, 4, thr, -1)
    with pytest.raises(CodesignError, match="bits must be one of"):
        OakenPagedKV.empty(4, BS, H, D, 3, thr, CAP)
    c = OakenPagedKV.empty(4, BS, H, D, 4, thr, CAP)
    with pytest.raises(CodesignError, match="finite"):
        c.write(torch.full((1, H, D), float("inf")), torch.zeros(1, H, D), torch.tensor([0]))
    c.k_out = c.k_out.to(torch.int64)
    with pytest.raises(CodesignError, match="k_out must be a contiguous torch.int32"):
        oaken_attention(
            torch.randn(1, H, D), c, torch.zeros(1, 1, dtype=torch.int32), torch.ones(1, dtype=torch.int32)
        )


def _index_by_loop(slots, bs, d, by):
    """`outlier_index` by a plain loop: per (block, head) the used in-block slots in stable key order (each with its
    other coordinate and its fp16 value), the starts of each key's list and the longest list."""
    nb, h, cap = slots.shape
    n = bs if by == "token" else d
    entries, starts, longest = [], [], []
    for blk in range(nb):
        for hh in range(h):
            used = [int(w) for w in slots[blk, hh] if w >= 0 and (int(w) >> 16) < bs * d]
            key = [(w >> 16) // d if by == "token" else (w >> 16) % d for w in used]
            order = sorted(range(len(used)), key=lambda i: key[i])  # sorted() is stable
            other = [(w >> 16) % d if by == "token" else (w >> 16) // d for w in used]
            tok = [(w >> 16) // d for w in used]
            val = [torch.tensor(w & 0xFFFF, dtype=torch.int32).to(torch.int16).view(torch.float16).float()
                   for w in used]  # fmt: skip
            entries.append([(other[i], tok[i], val[i]) for i in order])
            st = [sum(1 for k in key if k < i) for i in range(n + 1)]
            starts.append(st)
            longest.append(max([st[i + 1] - st[i] for i in range(n)], default=0))
    return entries, starts, longest


@pytest.mark.parametrize("bs, d, cap", [(3, 5, 7), (4, 16, 3), (5, 2, 12)])
def test_outlier_index_sorts_and_starts_every_list(bs, d, cap):
    """`oaken.outlier_index` against a plain loop, both sides: odd sizes, empty slots (in the middle too), words
    past the block (dropped), duplicate keys (kept in slot order), into a wider buffer as the kernel's. Each slot
    word: its other coordinate in the low INDEX_COORD_BITS, the rest its delta (its value minus its token's zero)
    rounded there (`index_delta`); unused words 0; then the lists' starts and the fullest list's length."""
    from codesign.kernels.kvcache.oaken import (
        index_defined,
        index_delta,
        index_slots,
        index_width,
        outlier_index,
    )

    g = torch.Generator().manual_seed(bs * 100 + d)
    nb, h = 4, 3
    pos = torch.randint(0, bs * d + 3, (nb, h, cap), generator=g, dtype=torch.int32)  # a few past the block
    bits = torch.randint(0, 1 << 16, (nb, h, cap), generator=g, dtype=torch.int32)
    slots = (pos << 16) | bits
    slots[torch.rand(nb, h, cap, generator=g) < 0.3] = -1
    slots[0, 0] = -1  # a (block, head) with no outlier
    assert ((pos >= bs * d) & (slots >= 0)).any() and (slots < 0).any()
    for by in ("token", "channel"):
        n = bs if by == "token" else d
        zeros = torch.randn(nb, h, bs, generator=g)
        out = torch.full((nb, h, index_width(cap, bs, d)), -7, dtype=torch.int32)
        got = outlier_index(slots, bs, d, by, out, zeros=zeros)
        assert got is out
        entries, starts, longest = _index_by_loop(slots, bs, d, by)
        coord, delta = index_slots(out, cap)
        for i, (blk, hh) in enumerate((b_, h_) for b_ in range(nb) for h_ in range(h)):
            m = len(entries[i])
            assert coord[blk, hh, :m].tolist() == [e[0] for e in entries[i]], (by, blk, hh)
            exact = torch.tensor([float(e[2] - zeros[blk, hh, e[1]]) for e in entries[i]])
            # (random bits: some values are NaN or inf, compared as such)
            torch.testing.assert_close(delta[blk, hh, :m], index_delta(exact), rtol=0, atol=0, equal_nan=True)
            torch.testing.assert_close(delta[blk, hh, :m], exact, rtol=2**-15, atol=0, equal_nan=True)
            assert not out[blk, hh, m:cap].any(), (by, blk, hh)  # unused words 0
            assert out[blk, hh, cap : cap + n + 1].tolist() == starts[i], (by, blk, hh)
            assert int(out[blk, hh, cap + n + 1]) == longest[i], (by, blk, hh)
        fresh = outlier_index(slots, bs, d, by, zeros=zeros)  # (a fresh buffer: the same defined words)
        assert torch.equal(index_defined(fresh, cap, n), index_defined(out, cap, n))
        # no zeros: the deltas are the values themselves
        plain = outlier_index(slots, bs, d, by)
        nz = outlier_index(slots, bs, d, by, zeros=torch.zeros(nb, h, bs))
        assert torch.equal(index_defined(plain, cap, n), index_defined(nz, cap, n))


def test_index_delta_rounds_to_nearest_and_keeps_specials():
    """`oaken.index_delta`: the last INDEX_COORD_BITS mantissa bits 0, to the nearest (ties away from zero),
    within 2^-15 of the delta; carries into the exponent; infinities and NaN stay; an unrounded (truncated) word
    would fail the nearest check (teeth: the error bound alone would not)."""
    from codesign.kernels.kvcache.oaken import INDEX_COORD_BITS, index_delta

    x = torch.randn(10000, generator=torch.Generator().manual_seed(5)) * 100
    x = torch.cat([x, torch.tensor([1.0 - 2**-24, 2.0 - 2**-23, -3.0, 0.0, 65504.0, -1e-30])])
    r = index_delta(x)
    assert not (r.view(torch.int32) & ((1 << INDEX_COORD_BITS) - 1)).any()
    torch.testing.assert_close(r, x, rtol=2**-15, atol=0)
    step = torch.ldexp(torch.ones_like(x), torch.frexp(x)[1] - 24 + INDEX_COORD_BITS)  # the kept grid's spacing
    assert ((r - x).double().abs() <= step.double() / 2).all()
    truncated = (x.view(torch.int32) & ~((1 << INDEX_COORD_BITS) - 1)).view(torch.float32)
    assert not ((truncated - x).double().abs() <= step.double() / 2 - 1e-45).all()
    assert r[-5] == 2.0 and r[-4] == -3.0 and r[-3] == 0.0  # a carry into the exponent; exact values kept
    special = index_delta(torch.tensor([float("inf"), float("-inf"), float("nan")]))
    assert special[0] == float("inf") and special[1] == float("-inf") and special[2].isnan()


def padded_rows_pool(offline: bool):
    """(cache, block tables, context lengths, fp64 K, V) of three sequences (11, 70, 100 tokens) over an Oaken cache,
    online (blocks of 8, 12 slots, spikes) or offline: the padded-rows tests' pool (here and fp16 queries')."""
    if offline:
        from test_kvcache_oaken_offline import _reference_pool as ref_pool
        from test_kvcache_oaken_offline import _setup as setup

        cache, bt, cl, xs, thr, grid = setup([11, 70, 100])
        kd, vd, *_ = ref_pool(cache, bt, xs, thr, grid, 4)
        kd, vd = read_pool(cache, kd, vd)
    else:
        cache, bt, cl, xs, thr = _setup([11, 70, 100], bs=8, cap=12, spikes=(5, 9))
        kd, vd, _ = _reference_pool(cache, bt, xs, thr, 4)
        kd, vd = read_pool(cache, kd, vd)
    return cache, bt, cl, kd, vd


@pytest.mark.parametrize("tile, split", [(32, 0), (64, 0), (64, 1)])
@pytest.mark.parametrize("padded", [False, True])
def test_kernel_key_spikes_in_later_blocks_vs_fp64(padded, tile, split):
    """Key outliers crowded on single tokens in a tile's later blocks (blocks of 8, 32-token tiles: 4 blocks a
    tile; tokens 13, 45, 60: blocks 1, 5 and 7, none a tile's first): the key loop runs to the fullest of the
    tile's blocks' fullest tokens (a count per block), so those tokens' ranks beyond the first block's fullest
    are taken; decode with splits (a split ending inside a tile: its later blocks not live) and extend against
    fp64, with and without padded rows (16-row tiles: the corrections through the program's scratch; 64-token
    tiles reload them through a dot of zeros, 32-token tiles by a plain add); decode in one launch and in three
    (`oaken_split`: its INT tile of 64 over blocks of 8, eight blocks a tile)."""
    import dataclasses

    from codesign.backend import device_view, use_device_view
    from codesign.kernels.attention import launch_rules as lr
    from codesign.kernels.attention import triton_attention as ta

    cache, bt, cl, xs, thr = _setup([70, 45, 61], bs=8, cap=24, spikes=(), token_spikes=(13, 45, 60))
    kd, vd, over = _reference_pool(cache, bt, xs, thr, 4)
    kd, vd = read_pool(cache, kd, vd)
    assert over == 0
    assert lr.default_config(D, 4, ta.KV_FORMAT_OAKEN, 4, 8)["BLOCK_N"] == 32  # 4 blocks a tile
    k_rank = cache.k_index[..., cache.capacity + 8 + 1]  # each (block, head)'s fullest token
    assert int(k_rank[bt[0, 1]].max()) > int(k_rank[bt[0, 0]].max())  # block 1 fuller than its tile's first
    assert int(k_rank.max()) > ta.OAKEN_KEY_RANKS  # lists past the ranks loaded ahead: the key loop runs
    q = torch.randn(3, 3 * H, D)
    ref, _ = reference_attention(q, kd, vd, bt, cl, [1, 1, 1])
    qe = torch.randn(5, 3 * H, D)
    cu = torch.tensor([0, 3, 3, 5], dtype=torch.int32)
    ref_e, _ = reference_attention(qe, kd, vd, bt, cl, [3, 0, 2])
    view = dataclasses.replace(device_view("cpu"), min_dot_rows=16) if padded else device_view("cpu")
    with use_device_view(view), use_backend("triton"), decode_path(split, tile):
        for splits in (1, 3):
            out = oaken_attention(q, cache, bt, cl, num_splits=splits)
            assert_rel_close(out, ref, 2e-6, f"decode splits={splits}")
        assert_rel_close(oaken_attention(qe, cache, bt, cl, cu, num_splits=2), ref_e, 2e-6, "extend")


@pytest.mark.parametrize("offline, split", [(False, 0), (False, 1), (True, 0)])
def test_kernel_padded_rows_vs_fp64(offline, split, monkeypatch):
    """Outlier corrections on the real query heads only (3 per kv head, 4 with padding) while the tile has 16
    rows (a GPU's smallest tl.dot, as on GPUs): decode with splits (several tiles a split: the separate value
    correction accumulator is rescaled as the output) and extend against fp64. The program scratch starts as NaN:
    the kernel reads only what each tile wrote (every row's p, 0 for rows of no query); so do the three launches'
    buffers (`oaken_split`: biases, kept probabilities and maxima past what the launches wrote are never read)."""
    import dataclasses

    from codesign.backend import device_view, use_device_view
    from codesign.kernels.attention import oaken_split as osp
    from codesign.kernels.attention import triton_attention as ta

    plan_launch, plan_split = ta.plan_launch, osp.plan_split

    def poisoned(*args, **kwargs):
        plan = plan_launch(*args, **kwargs)
        if plan.oaken_scratch is not None:
            plan.oaken_scratch.fill_(float("nan"))
        return plan

    def poisoned_split(*args, **kwargs):
        plan = plan_split(*args, **kwargs)
        for t in (plan.bias, plan.probs, plan.corr, plan.launch.oaken_scratch, *plan.launch.workspace):
            t.fill_(float("nan"))
        return plan

    monkeypatch.setattr(ta, "plan_launch", poisoned)
    monkeypatch.setattr(osp, "plan_split", poisoned_split)

    cache, bt, cl, kd, vd = padded_rows_pool(offline)
    hq = 3 * H
    q = torch.randn(3, hq, D)
    ref, _ = reference_attention(q, kd, vd, bt, cl, [1, 1, 1])
    qe = torch.randn(5, hq, D)
    cu = torch.tensor([0, 3, 3, 5], dtype=torch.int32)
    ref_e, _ = reference_attention(qe, kd, vd, bt, cl, [3, 0, 2])
    view = dataclasses.replace(device_view("cpu"), min_dot_rows=16)
    with use_device_view(view), use_backend("triton"), decode_path(split):
        for splits in (1, 2):
            out = oaken_attention(q, cache, bt, cl, num_splits=splits)
            assert_rel_close(out, ref, 2e-6, f"decode splits={splits}")
        assert_rel_close(oaken_attention(qe, cache, bt, cl, cu, num_splits=2), ref_e, 2e-6, "extend")
