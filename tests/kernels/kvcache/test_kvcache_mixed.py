"""Per-chunk mixed precision (`codesign.kernels.kvcache.mixed`): the Cocktail-style policy, the writer
(bit-exact against the accelerator model's quantizer at each block's width) and one attention launch over
INT8 / INT4 / INT2 blocks against an fp64 reference that dequantizes first (with the engine's numpy code)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import assert_rel_close, seq_slots, shuffled_block_tables
from paged_attention_ref import reference_attention

from codesign.accel_model import kv_quant_engine as eng
from codesign.autotune.lookup import forced_config
from codesign.backend import use_backend
from codesign.kernels.attention import launch_rules as lr
from codesign.kernels.attention import mixed_by_width as mbw
from codesign.kernels.attention import triton_attention as pat
from codesign.kernels.attention.quantized import mixed_attention
from codesign.kernels.attention.tree import build_tree_batch
from codesign.kernels.kvcache.mixed import MixedPagedKV, cocktail_bits, mixed_write
from codesign.specs import CodesignError

BS, H, D = 4, 2, 16


def test_cocktail_policy_ranks_chunks_by_query_similarity():
    q = torch.zeros(3, 2 * H, D)
    q[:, :, 0] = 1.0
    chunks = [torch.randn(BS, H, D) * 0.1 for _ in range(8)]
    chunks[5][:, :, 0] += 5.0  # most similar to the queries
    chunks[2][:, :, 0] -= 5.0  # least
    bits = cocktail_bits(q, chunks, frac_int8=0.125, frac_int2=0.125)
    assert bits[5] == 8 and bits[2] == 2 and bits.count(4) == 6
    assert cocktail_bits(q, chunks, 0.0, 0.0) == [4] * 8
    assert sorted(cocktail_bits(q, chunks, 0.5, 0.5)) == [2] * 4 + [8] * 4
    with pytest.raises(CodesignError, match="sum <= 1"):
        cocktail_bits(q, chunks, 0.7, 0.7)


def _setup(ctx, bs=BS, d=D, widths=None, backend="triton"):
    """A mixed cache holding ctx tokens a sequence; block widths by the Cocktail policy, or widths[b] (one per block
    of sequence b, in order). Written by the Triton writer, or by the torch one (backend "torch": the same bytes,
    `test_write_bit_exact_per_block_width`) where a test is about the reads and hundreds of tokens would take the
    interpreted writer most of its time."""
    tables, nb = shuffled_block_tables(ctx, bs)
    cache = MixedPagedKV.empty(nb, bs, H, d)
    cache.k_codes.random_(0, 256)  # unused slots' code bytes: two-block tiles read the rows past the end unmasked
    cache.v_codes.random_(0, 256)
    cache.k_meta.fill_(float("nan"))  # poison: unused slots
    cache.v_meta.fill_(float("nan"))
    slots, ks, vs = [], [], []
    for b, c in enumerate(ctx):
        k, v = torch.randn(c, H, d), torch.randn(c, H, d)
        q_recent = torch.randn(2, 2 * H, d)
        chunks = [k[i : i + bs] for i in range(0, c, bs)]
        bits = cocktail_bits(q_recent, chunks, 1 / 3, 1 / 3) if widths is None else widths[b]
        cache.set_block_bits(tables[b, : len(chunks)].tolist(), bits)
        slots += seq_slots(tables, b, c, bs).tolist()
        ks.append(k)
        vs.append(v)
    k, v = torch.cat(ks), torch.cat(vs)
    perm = torch.randperm(k.shape[0])
    with use_backend(backend):
        mixed_write(k[perm], v[perm], cache, torch.tensor(slots, dtype=torch.int32)[perm])
    return cache, tables, torch.tensor(ctx, dtype=torch.int32), k, v, torch.tensor(slots)


def _engine_dequant(cache):
    """fp64 pool dequantized block by block with the accelerator model's numpy code."""
    out = []
    for codes, meta in ((cache.k_codes, cache.k_meta), (cache.v_codes, cache.v_meta)):
        x = torch.full(codes.shape, float("nan"), dtype=torch.float64)
        d = codes.shape[-1]
        for blk, b in enumerate(cache.block_bits.tolist()):
            c = eng.unpack_codes(codes[blk, ..., : d * b // 8].numpy(), b)
            m = meta[blk].float().numpy()
            x[blk] = torch.from_numpy(eng.dequantize(c, m[..., 0], m[..., 1])).double()
        out.append(x)
    return out


@pytest.mark.parametrize("bs, d, ctx, widths", [(BS, D, [11, 9], None), (64, 48, [11, 9, 5], [[8], [4], [2]])])
def test_write_bit_exact_per_block_width(bs, d, ctx, widths):
    """The Triton writer at each block's width, bit-exact against the engine and the torch writer; also at blocks of
    64 and head_dim 48 (rows padded past the codes: the reads tests fill such caches with the torch writer)."""
    cache, bt, cl, k, v, slots = _setup(ctx, bs, d, widths)
    assert set(cache.block_bits[bt[bt > 0]].tolist()) <= {2, 4, 8}
    assert len(set(cache.block_bits[slots // bs].tolist())) == 3  # all three widths in use
    for x, codes, meta in ((k, cache.k_codes, cache.k_meta), (v, cache.v_codes, cache.v_meta)):
        for i, s in enumerate(slots.tolist()):
            b = int(cache.block_bits[s // bs])
            c, sc, z = eng.quantize_per_token(x[i].numpy(), b)
            assert np.array_equal(codes[s // bs, s % bs, :, : d * b // 8].numpy(), eng.pack_codes(c, b))
            assert np.array_equal(meta[s // bs, s % bs].float().numpy(), np.stack([sc, z], -1))
    # the CPU torch writer stores the same bytes
    c2 = MixedPagedKV.empty(cache.k_codes.shape[0], bs, H, d)
    c2.block_bits.copy_(cache.block_bits)
    mixed_write(k, v, c2, slots.to(torch.int32))
    for s in slots.tolist():
        w = d * int(cache.block_bits[s // bs]) // 8
        assert torch.equal(c2.k_codes[s // bs, s % bs, :, :w], cache.k_codes[s // bs, s % bs, :, :w])
        assert torch.equal(c2.v_meta[s // bs, s % bs], cache.v_meta[s // bs, s % bs])


@pytest.mark.parametrize("splits, by_width", [(1, 1), (2, 1), (2, 0)])
def test_decode_and_extend_over_mixed_blocks(splits, by_width, monkeypatch):
    """Decode width by width (`mixed_by_width`, the default) and in one launch (BY_WIDTH 0), extend in one launch."""
    monkeypatch.setattr(mbw, "BY_WIDTH_DEFAULT", by_width)
    cache, bt, cl, k, v, slots = _setup([11, 9, 14])
    kd, vd = _engine_dequant(cache)
    q = torch.randn(3, 2 * H, D)
    with use_backend("triton"):
        out = mixed_attention(q, cache, bt, cl, num_splits=splits)
    ref, _ = reference_attention(q, kd, vd, bt, cl, [1, 1, 1])
    assert_rel_close(out, ref, 2e-6, "mixed decode")
    assert_rel_close(mixed_attention(q, cache, bt, cl), ref, 2e-6, "mixed decode (torch)")
    qe = torch.randn(6, 2 * H, D)
    cu = torch.tensor([0, 2, 3, 6], dtype=torch.int32)
    with use_backend("triton"):
        oe = mixed_attention(qe, cache, bt, cl, cu, num_splits=splits)
    ref_e, _ = reference_attention(qe, kd, vd, bt, cl, [2, 1, 3])
    assert_rel_close(oe, ref_e, 2e-6, "mixed extend")


@pytest.mark.slow
@pytest.mark.parametrize(
    "bs, d, dtype",
    [(32, 64, torch.float16), (32, 48, torch.float16), (32, 16, torch.float16), (32, 64, torch.float32),
     (16, 128, torch.float32)],  # fmt: skip
)
def test_two_block_tiles_read_each_block_at_its_width(bs, d, dtype):
    """Tiles of two whole blocks (`mixed_span_codes`: the default tile where two blocks fill it) read each block at
    its own width: adjacent blocks of every ordered pair of widths, tiles whose second block is partial or absent,
    decode with splits and extend; fp16 queries (the fp16 dot per block) and fp32; head_dim 48 and 16 (padded and
    one-load 8-bit rows). fp32 queries default to one block a tile (two spilled on sm_90), so they force two: the
    exact fp32 path checks the two-block logic at 2e-6. Where the path does not apply: the test below."""
    elem = torch.tensor([], dtype=dtype).element_size()
    tile = lr.default_config(d, elem, pat.KV_FORMAT_MIXED, 8, bs)["BLOCK_N"]
    two = (bs, dtype) in ((32, torch.float16),)
    assert lr.mixed_reads_words(pat.KV_FORMAT_MIXED, d, bs, tile) and (tile == 2 * bs) == two
    if dtype == torch.float32:
        tile = 2 * bs
        assert tile > lr.default_config(d, elem, pat.KV_FORMAT_MIXED, 8, bs)["BLOCK_N"]
    def forced():
        return forced_config(lr.table_op(pat.KV_FORMAT_MIXED, 8), {"BLOCK_N": tile, "num_warps": 4, "BY_WIDTH": 0})

    assert lr.mixed_reads_words(pat.KV_FORMAT_MIXED, d, bs, tile)
    widths = [[8, 4, 4, 2, 2, 8, 8, 8, 2, 4], [4, 8, 2], [2], [2, 2, 8], [8, 2, 4, 4]]
    ctx = [9 * bs + 5, 3 * bs, bs - 3, 2 * bs + 1, 4 * bs]
    cache, bt, cl, *_ = _setup(ctx, bs, d, widths, backend="torch")  # the reads are under test, not the writer
    kd, vd = _engine_dequant(cache)
    tol = 2e-6 if dtype == torch.float32 else 1e-3
    q = (torch.randn(len(ctx), 2 * H, d) * 3.0).to(dtype)
    ref, _ = reference_attention(q.double(), kd, vd, bt, cl, [1] * len(ctx))
    for splits in (1, 3):
        with use_backend("triton"), forced():
            out = mixed_attention(q, cache, bt, cl, num_splits=splits)
        assert_rel_close(out.double(), ref, tol, f"mixed decode bs={bs} d={d} {dtype} splits={splits}")
    qe = (torch.randn(13, 2 * H, d) * 3.0).to(dtype)
    cu = torch.tensor([0, 3, 5, 8, 9, 13], dtype=torch.int32)
    with use_backend("triton"), forced():
        oe = mixed_attention(qe, cache, bt, cl, cu, num_splits=1)
    ref_e, _ = reference_attention(qe.double(), kd, vd, bt, cl, [3, 2, 3, 1, 4])
    assert_rel_close(oe.double(), ref_e, tol, f"mixed extend bs={bs} d={d} {dtype}")


@pytest.mark.parametrize("bs", [64, 16])
def test_two_block_tiles_only_where_two_blocks_fill_the_tile(bs):
    """Blocks of 64 (one block a tile) and of 16 under fp16 queries (16-token tiles) keep one block a tile: the
    two-block path (above) does not apply; their reads are the one-block tiles' (`test_whole_block_tiles_read_words`,
    `test_decode_and_extend_over_mixed_blocks`)."""
    tile = lr.default_config(64, 2, pat.KV_FORMAT_MIXED, 8, bs)["BLOCK_N"]
    assert lr.mixed_reads_words(pat.KV_FORMAT_MIXED, 64, bs, tile) and tile != 2 * bs


@pytest.mark.slow
@pytest.mark.parametrize("bs, d", [(32, 64), (64, 48)])
def test_whole_block_tiles_read_words(bs, d, monkeypatch):
    """Blocks a multiple of the default tile (32 tokens at these head sizes): each tile has one width and
    reads its codes as int32 words (`mixed_reads_words`); all three widths in one launch (BY_WIDTH 0), decode with
    splits and extend; head_dim 48 pads the tile (three 2-bit words a row)."""
    monkeypatch.setattr(mbw, "BY_WIDTH_DEFAULT", 0)
    tile = lr.default_config(d, 4, pat.KV_FORMAT_MIXED, 8)["BLOCK_N"]
    assert lr.mixed_reads_words(pat.KV_FORMAT_MIXED, d, bs, tile)
    ctx = [5 * bs + 3, 2 * bs, 3 * bs - 1, 7]
    cache, bt, cl, k, v, slots = _setup(ctx, bs, d, backend="torch")  # the reads are under test, not the writer
    assert len(set(cache.block_bits[bt[0, :5]].tolist())) >= 2
    kd, vd = _engine_dequant(cache)
    q = torch.randn(len(ctx), 2 * H, d)
    ref, _ = reference_attention(q, kd, vd, bt, cl, [1] * len(ctx))
    for splits in (1, 3):
        with use_backend("triton"):
            out = mixed_attention(q, cache, bt, cl, num_splits=splits)
        assert_rel_close(out, ref, 2e-6, f"mixed decode bs={bs} splits={splits}")
    qe = torch.randn(9, 2 * H, d)
    cu = torch.tensor([0, 3, 5, 8, 9], dtype=torch.int32)
    with use_backend("triton"):
        oe = mixed_attention(qe, cache, bt, cl, cu, num_splits=1)
    ref_e, _ = reference_attention(qe, kd, vd, bt, cl, [3, 2, 3, 1])
    assert_rel_close(oe, ref_e, 2e-6, "mixed extend")


def test_tree_over_mixed_blocks():
    parents = [[-1, 0, 0, 1], [-1, 0, 1]]
    tree = build_tree_batch(parents, [7, 6])  # contexts 11 and 9: the tree nodes are the newest tokens
    cache, bt, cl, k, v, slots = _setup(tree.context_lens.tolist())
    kd, vd = _engine_dequant(cache)
    q = torch.randn(7, 2 * H, D)
    with use_backend("triton"):
        out = mixed_attention(q, cache, bt, None, tree=tree, num_splits=1)
    ref, _ = reference_attention(q, kd, vd, bt, tree.context_lens, [4, 3], parents=parents)
    assert_rel_close(out, ref, 2e-6, "mixed tree")
    assert_rel_close(mixed_attention(q, cache, bt, None, tree=tree), ref, 2e-6, "mixed tree (torch)")


def test_bad_input():
    c = MixedPagedKV.empty(4, BS, H, D)
    with pytest.raises(CodesignError, match="chunk bits must be one of"):
        c.set_block_bits([0], [3])
    with pytest.raises(CodesignError, match="outside the pool"):
        c.set_block_bits([7], [4])
    with pytest.raises(CodesignError, match="multiple of 4"):
        MixedPagedKV.empty(4, BS, H, 18)
    c.block_bits[1] = 5
    bt = torch.tensor([[0, 1]], dtype=torch.int32)
    with pytest.raises(CodesignError, match="block_bits must all be in"):
        mixed_attention(torch.randn(1, H, D), c, bt, torch.tensor([6], dtype=torch.int32))
    c.block_bits = c.block_bits.long()
    with pytest.raises(CodesignError, match="block_bits must be a contiguous torch.uint8"):
        mixed_attention(torch.randn(1, H, D), c, bt, torch.tensor([6], dtype=torch.int32))


def test_mixed_cache_with_a_width_unused_dequantizes():
    """A cache with no block at some width (here: none at 2 bits) must still dequantize (CPU path)."""
    cache = MixedPagedKV.empty(4, 16, 2, 32)
    cache.set_block_bits([0, 1, 2, 3], [8, 8, 4, 4])
    k, v = cache.dequantize()
    assert k.shape == v.shape and k.shape[:2] == (4, 16)


def _random_tables(ctx, bs, nb, widths=(8, 4, 2)):
    """Shuffled block tables over a pool of nb blocks with random widths (entries past a context: -1)."""
    per = max(1, max(-(-c // bs) for c in ctx))
    ids = torch.randperm(nb)[: len(ctx) * per].reshape(len(ctx), per).to(torch.int32)
    for b, c in enumerate(ctx):
        ids[b, -(-c // bs) :] = -1
    bits = torch.tensor(widths, dtype=torch.uint8)[torch.randint(len(widths), (nb,))]
    return ids, bits


@pytest.mark.parametrize("chunk", [2, mbw.TABLES_CHUNK])
def test_width_tables_sort_each_sequence_by_width(chunk, monkeypatch):
    """`_width_tables_kernel` (interpreted) against the host reference: order kept, the partial last block at the end
    of its width's list, empty contexts and widths, several chunks a row (chunk 2); entries past a width's count
    untouched."""
    monkeypatch.setattr(mbw, "TABLES_CHUNK", chunk)
    bs = 4
    ctx = torch.tensor([0, 1, 4, 5, 17, 40, 39], dtype=torch.int32)
    bt, bits = _random_tables(ctx.tolist(), bs, 96)
    want_t, want_l = mbw.width_tables_torch(bt, ctx, bits, bs)
    tables = torch.full((3, *bt.shape), -7, dtype=torch.int32)
    lens = torch.full((3, len(ctx)), -7, dtype=torch.int32)
    with use_backend("triton"):
        mbw.width_tables(bt, ctx, bits, bs, tables, lens)
    assert torch.equal(lens, want_l)
    assert torch.equal(lens.sum(0), ctx)  # every token in exactly one width's list
    for i in range(3):
        for b in range(len(ctx)):
            n = -(-int(want_l[i, b]) // bs)
            assert torch.equal(tables[i, b, :n], want_t[i, b, :n])
            assert (tables[i, b, n:] == -7).all()


def _spy_launches(monkeypatch):
    calls = []
    orig = mbw.paged_attention_triton

    def spy(q, kv, batch, opts, out, lse, plan, reduce=True):
        calls.append((kv.kv_format, kv.bits, plan.num_splits, reduce))
        return orig(q, kv, batch, opts, out, lse, plan, reduce)

    monkeypatch.setattr(mbw, "paged_attention_triton", spy)
    return calls


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_decode_by_width_runs_one_int_launch_a_width(dtype, monkeypatch):
    """A mixed decode is three per-token INT launches (8, 4, 2 bits, each at least MIN_SPLITS splits, partials left
    for one reduction) over the cache in place, equal to fp64 attention over the engine-dequantized cache (out and
    lse), a sequence with no block of some width and one shorter than a block included; ALiBi, a window or a config
    with BY_WIDTH 0 keep the one-launch kernel. Teeth: a length one token long (a NaN-poisoned slot) must fail."""
    calls = _spy_launches(monkeypatch)
    bs, d = 8, 32
    widths = [[8, 4, 4, 2, 8], [4, 4], [2], [2, 8, 8]]
    ctx = [4 * bs + 3, 2 * bs, bs - 5, 3 * bs]
    cache, bt, cl, *_ = _setup(ctx, bs, d, widths, backend="torch")
    kd, vd = _engine_dequant(cache)
    q = (torch.randn(len(ctx), 2 * H, d) * 3.0).to(dtype)
    ref, ref_lse = reference_attention(q.double(), kd, vd, bt, cl, [1] * len(ctx))
    tol = 2e-6 if dtype == torch.float32 else 1e-3
    for splits in (None, 1, 3):
        calls.clear()
        with use_backend("triton"):
            out, lse = mixed_attention(q, cache, bt, cl, num_splits=splits, return_lse=True)
        assert [c[:2] for c in calls] == [(pat.KV_FORMAT_INT, 8), (pat.KV_FORMAT_INT, 4), (pat.KV_FORMAT_INT, 2)]
        assert all(c[2] >= max(mbw.MIN_SPLITS, splits or 1) and not c[3] for c in calls)
        assert_rel_close(out.double(), ref, tol, f"mixed decode by width {dtype} splits={splits}")
        assert_rel_close(lse.double(), ref_lse.double(), 2e-6, "lse")
    calls.clear()
    slopes = torch.rand(2 * H)
    with use_backend("triton"):
        mixed_attention(q, cache, bt, cl, alibi_slopes=slopes)
        mixed_attention(q, cache, bt, cl, window=5)
        with forced_config(lr.table_op(pat.KV_FORMAT_MIXED, 8), {"BY_WIDTH": 0}):
            out0 = mixed_attention(q, cache, bt, cl)
    assert not calls
    assert_rel_close(out0.double(), ref, tol, "mixed decode in one launch")
    orig = mbw.width_tables

    def one_too_many(*args):
        orig(*args)
        args[-1].add_(args[-1] > 0)

    monkeypatch.setattr(mbw, "width_tables", one_too_many)
    with use_backend("triton"):
        bad = mixed_attention(q, cache, bt, cl)
    assert not torch.allclose(bad.double(), ref, atol=tol, equal_nan=False)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_write_with_the_widths_named_writes_the_same_bytes(backend):
    """`mixed_write(widths=...)` (the caller knows its blocks' widths: no sync to find them): the same bytes as
    finding them, a width named without tokens writes nothing, one left out leaves its tokens unwritten (as
    documented); widths outside INT8/4/2 are refused; finding the widths checks the values are finite anyway."""
    torch.manual_seed(4)
    nb, bs, d = 6, 4, 16
    k, v = torch.randn(7, H, d), torch.randn(7, H, d)
    slots = torch.tensor([0, 1, 5, 6, -1, 13, 14], dtype=torch.int32)  # blocks 0, 1, 3: widths 8, 2, 4

    def write(**kw):
        c = MixedPagedKV.empty(nb, bs, H, d)
        c.set_block_bits([1, 3, 4], [2, 4, 2])
        c.k_codes.fill_(0xA5)  # poison: a slot written shows
        with use_backend(backend):
            mixed_write(k, v, c, slots, **kw)
        return c

    ref = write()
    for widths in ({8, 4, 2}, [2, 4, 8, 8]):
        got = write(widths=widths, dispatch=False)
        assert all(torch.equal(getattr(got, n), getattr(ref, n)) for n in ("k_codes", "v_codes", "k_meta", "v_meta"))
    partial = write(widths={8, 4})
    assert torch.equal(partial.k_codes[1], torch.full_like(partial.k_codes[1], 0xA5))  # the INT2 block's tokens
    assert torch.equal(partial.k_codes[3], ref.k_codes[3]) and torch.equal(partial.k_codes[0], ref.k_codes[0])
    with pytest.raises(CodesignError, match="widths must be among"):
        write(widths={8, 3})
    nan = k.clone()
    nan[0, 0, 0] = float("nan")
    with pytest.raises(CodesignError, match="finite"):
        mixed_write(nan, v, MixedPagedKV.empty(nb, bs, H, d), slots, check_data=False)  # finding widths syncs anyway
