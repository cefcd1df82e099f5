"""The outlier index an Oaken cache keeps (`OakenPagedKV.k_index` / `v_index`, `kvcache.oaken`'s module docstring):
after any sequence of writes (torch and Triton writers, blocks revisited and reused, skipped tokens, odd shapes)
it equals `outlier_index` recomputed from the slots; a write rebuilds exactly its blocks' rows; a slot change
made outside the cache is caught by the validity rule (the next attention rebuilds the whole index), and a
check that skipped every rebuild would see the kernel read a stale index. Attention over the kept index against
the fp64 reference of the pool as stored."""

from __future__ import annotations

import dataclasses
import pickle

import pytest
import torch
from helpers import assert_rel_close, seq_slots
from paged_attention_ref import reference_attention
from test_kvcache_oaken import H, _setup

from codesign.backend import use_backend
from codesign.kernels.attention.quantized import oaken_attention
from codesign.kernels.kvcache import quantizers as kvq
from codesign.kernels.kvcache.oaken import OakenPagedKV, dense_zeros, index_defined, outlier_index
from codesign.specs import CodesignError


def _fresh_index(c: OakenPagedKV) -> tuple[torch.Tensor, torch.Tensor]:
    """Both sides' `outlier_index` of the slots and meta now, whole (the deltas included)."""
    bs, d = c.k_codes.shape[1], c.head_dim
    kg, vg = (None, None) if c.grid is None else (c.grid[0], c.grid[1])
    return (outlier_index(c.k_out, bs, d, "token", zeros=dense_zeros(c.k_meta, kg)),
            outlier_index(c.v_out, bs, d, "channel", zeros=dense_zeros(c.v_meta, vg)))  # fmt: skip


def _assert_index_fresh(c: OakenPagedKV, what: str) -> None:
    """The kept index equals a rebuild on the words the layout defines (`oaken.index_defined`: the CAP slot words,
    then the n + 2 list words; n = block_size for keys, head_dim for values)."""
    bs, d, cap = c.k_codes.shape[1], c.head_dim, c.capacity
    for kept, fresh, n in zip((c.k_index, c.v_index), _fresh_index(c), (bs, d)):
        assert torch.equal(index_defined(kept, cap, n), index_defined(fresh, cap, n)), what


def _empty(nb, bs, h, d, cap, bits=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    calib = [(torch.randn(64, h, d, generator=g) * 1.5, torch.randn(64, h, d, generator=g))]
    thr = kvq.calibrate_kv_thresholds(calib, 0.08)[0]
    c = OakenPagedKV.empty(nb, bs, h, d, bits, thr, cap)
    c.k_meta.fill_(float("nan"))  # poison the slots nothing writes
    c.v_meta.fill_(float("nan"))
    c.ensure_index()  # a hand edit (the meta's zeros are in the index): rebuilt from it
    return c


def _tokens(n, h, d, g):
    k = torch.randn(n, h, d, generator=g) * 1.5
    k[:, 0, 1] *= 5  # a channel outlier: some blocks' slots run full
    return k, torch.randn(n, h, d, generator=g)


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("bs, h, d, cap", [(4, 2, 16, 3), (5, 3, 8, 7), (3, 1, 32, 1), (8, 2, 16, 0)])
def test_kept_index_equals_a_rebuild_after_random_writes(backend, bs, h, d, cap):
    """Random writes: decode-sized ones (fewer tokens than blocks: only their blocks' rows rebuilt) and whole-pool
    ones, tokens of several blocks interleaved, skipped (-1) tokens, blocks written again from offset 0 (a freed
    block reused: its old outliers must leave the index). The index stays current and equal to a rebuild."""
    g = torch.Generator().manual_seed(bs * 1000 + d)
    nb = 12
    c = _empty(nb, bs, h, d, cap)
    assert c.index_current()
    _assert_index_fresh(c, "empty")
    fill = [0] * nb  # tokens written into each block so far
    with use_backend(backend):
        for step in range(7):  # whole-pool writes at steps 0, 3, 6; skipped tokens at 1, 5
            slots = []
            n = int(torch.randint(1, nb if step % 3 else 2 * nb * bs, (1,), generator=g))
            for _ in range(n):
                blk = int(torch.randint(0, nb, (1,), generator=g))
                if torch.rand(1, generator=g) < 0.15:
                    fill[blk] = 0  # reuse: the block starts afresh
                if fill[blk] < bs and blk * bs + fill[blk] not in slots:
                    slots.append(blk * bs + fill[blk])
                    fill[blk] += 1
            if step % 4 == 1:
                slots.insert(len(slots) // 2, -1)
            k, v = _tokens(len(slots), h, d, g)
            c.write(k, v, torch.tensor(slots, dtype=torch.int64))
            assert c.index_current(), step
            _assert_index_fresh(c, f"{backend} step {step}")
    assert int(c.k_count.sum()) > 0 or cap == 0


def test_a_write_rebuilds_exactly_its_blocks():
    """With every index row poisoned, a write of a few tokens rebuilds the rows of its blocks and no other; the
    index is then not current (the poison was not made through the cache), and attention's ensure_index
    rebuilds it whole."""
    bs, d = 4, 16
    c = _empty(10, bs, H, d, 3)
    g = torch.Generator().manual_seed(3)
    k, v = _tokens(12, H, d, g)
    c.write(k, v, torch.arange(12))  # blocks 0-2
    c.k_index.fill_(-7)
    c.v_index.fill_(-7)
    assert not c.index_current()
    k, v = _tokens(3, H, d, g)
    c.write(k, v, torch.tensor([2 * bs + 1, 6 * bs, -1]))  # blocks 2 and 6 (the skipped token: block 0 as it is)
    fk, fv = _fresh_index(c)
    for blk in range(10):
        rebuilt = blk in (0, 2, 6)
        assert torch.equal(c.k_index[blk, :, : fk.shape[2]], fk[blk]) == rebuilt, blk
        assert torch.equal(c.v_index[blk, :, : fv.shape[2]], fv[blk]) == rebuilt, blk
        assert bool((c.k_index[blk] == -7).all()) != rebuilt, blk
    assert not c.index_current()
    c.ensure_index()
    assert c.index_current()
    _assert_index_fresh(c, "after ensure_index")


def _pool_reference(c, q, bt, cl):
    """fp64 attention over the pool as the kernels read it (dense codes, then the slots written over, each as its
    index word holds it: `dequantize(as_read=True)`)."""
    kd, vd = (x.double() for x in c.dequantize(as_read=True))
    return reference_attention(q, kd, vd, bt, cl, [1] * len(cl))[0]


def _edit_slots_by_hand(c, bt):
    """Change some outliers of used blocks outside the cache: values moved, a slot emptied (keys and values)."""
    b0, b1 = int(bt[0, 0]), int(bt[1, 0])
    used = c.k_out[b0, 0] >= 0
    assert used.any()
    c.k_out[b0, 0] = torch.where(used, (c.k_out[b0, 0] & ~0xFFFF) | 0x4A00, c.k_out[b0, 0])  # fp16 12.0
    c.v_out[b1, 1, 0] = -1
    c.v_out[b0, 0] = torch.where(c.v_out[b0, 0] >= 0, (c.v_out[b0, 0] & ~0xFFFF) | 0xC900, -1)  # fp16 -10.0


@pytest.mark.parametrize("splits", [1, 2])
def test_attention_over_the_kept_index_vs_fp64(splits):
    """The kernel reads the index the writes kept (no rebuild at the launch) and matches fp64 over the pool."""
    cache, bt, cl, _, _ = _setup([11, 6, 9])
    assert cache.index_current()
    q = torch.randn(3, 2 * H, cache.head_dim)
    kix, vix = cache.k_index, cache.v_index
    with use_backend("triton"):
        out = oaken_attention(q, cache, bt, cl, num_splits=splits)
    assert cache.k_index is kix and cache.v_index is vix and cache.index_current()
    assert_rel_close(out, _pool_reference(cache, q, bt, cl), 2e-6, "oaken decode over the kept index")


def _edit_meta_by_hand(c, bt):
    """Move the zero of every token of two used blocks outside the cache (keys and values); slots untouched."""
    for blk in (int(bt[0, 0]), int(bt[1, 0])):
        c.k_meta[blk, :, :, 1] += 0.75
        c.v_meta[blk, :, :, 1] -= 0.5


@pytest.mark.parametrize(
    ("edit", "skip_rebuild"),
    [(_edit_slots_by_hand, False), (_edit_meta_by_hand, False), (_edit_meta_by_hand, True)],
)
def test_a_hand_edit_is_caught_and_rebuilt(edit, skip_rebuild, monkeypatch):
    """Slots or meta changed outside the cache (the index's deltas hold each token's zero, from the meta) leave the
    index not current; the next attention rebuilds it whole and matches fp64 over the edited pool (the edit does
    change the output). With the rebuild skipped (the check's teeth) the stale deltas miss it."""
    cache, bt, cl, _, _ = _setup([11, 6, 9])
    q = torch.randn(3, 2 * H, cache.head_dim)
    before = _pool_reference(cache, q, bt, cl)
    if skip_rebuild:
        monkeypatch.setattr(OakenPagedKV, "_index_rows", lambda self, blocks: None)
    edit(cache, bt)
    assert not cache.index_current()
    ref = _pool_reference(cache, q, bt, cl)
    assert (ref - before).abs().max() > 1e-3
    with use_backend("triton"):
        out = oaken_attention(q, cache, bt, cl)
    if skip_rebuild:
        with pytest.raises(AssertionError):
            assert_rel_close(out, ref, 2e-6, "stale deltas")
    else:
        assert cache.index_current()
        _assert_index_fresh(cache, f"after {edit.__name__}")
        assert_rel_close(out, ref, 2e-6, f"oaken decode after {edit.__name__}")


def test_a_skipped_rebuild_reads_a_stale_index(monkeypatch):
    """The checks above have teeth: with every index rebuild skipped, the kernel reads the index of the slots
    before the edit and misses fp64 over the pool as it is."""
    cache, bt, cl, _, _ = _setup([11, 6, 9])
    q = torch.randn(3, 2 * H, cache.head_dim)
    monkeypatch.setattr(OakenPagedKV, "_index_rows", lambda self, blocks: None)
    _edit_slots_by_hand(cache, bt)
    with use_backend("triton"):
        out = oaken_attention(q, cache, bt, cl)
    with pytest.raises(AssertionError):
        assert_rel_close(out, _pool_reference(cache, q, bt, cl), 2e-6, "stale index")


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_a_write_that_skips_its_rebuild_is_caught(backend, monkeypatch):
    """Both writers bump the slots' version counters (the Triton one through `increment_version`): a write whose
    own index update were skipped leaves the index not current, so attention rebuilds it rather than read it."""
    cache, bt, cl, xs, _ = _setup([11, 6, 9])
    q = torch.randn(3, 2 * H, cache.head_dim)
    monkeypatch.setattr(OakenPagedKV, "_reindex", lambda self, blocks, current: None)
    n = int(cl[0])
    k, v = xs[0]
    with use_backend(backend):
        cache.write(-3 * k, v.flip(0) * 4, seq_slots(bt, 0, n, cache.k_codes.shape[1]))  # new outliers
    assert not cache.index_current()
    with use_backend("triton"):
        out = oaken_attention(q, cache, bt, cl)
    assert_rel_close(out, _pool_reference(cache, q, bt, cl), 2e-6, f"{backend} write, rebuild skipped")


def test_copy_unpickle_replace_and_inference_tensors():
    """A cache without a valid record (unpickled, its index dropped, an inference-tensor slot pool) is rebuilt
    before the kernel reads it; a bad index tensor is refused by name."""
    cache, bt, cl, _, _ = _setup([11, 6, 9])
    q = torch.randn(3, 2 * H, cache.head_dim)
    ref = _pool_reference(cache, q, bt, cl)
    loaded = pickle.loads(pickle.dumps(cache))
    assert not loaded.index_current()
    dropped = dataclasses.replace(cache, k_index=None, v_index=None)
    with use_backend("triton"):
        for what, c in (("unpickled", loaded), ("index dropped", dropped)):
            assert not c.index_current(), what
            assert_rel_close(oaken_attention(q, c, bt, cl), ref, 2e-6, what)
            _assert_index_fresh(c, what)
            assert c.index_current(), what
        with torch.inference_mode():  # inference tensors keep no version counter: rebuilt at every attention
            frozen = dataclasses.replace(cache, k_out=cache.k_out.clone(), k_index=cache.k_index.clone())
            frozen.k_index.fill_(-7)
            assert_rel_close(oaken_attention(q, frozen, bt, cl), ref, 2e-6, "inference tensors")
            _assert_index_fresh(frozen, "inference tensors")
            assert not frozen.index_current()
    with torch.inference_mode():  # a cache made in inference mode still keeps version counters
        made = OakenPagedKV.empty(4, 4, H, 16, 4, torch.tensor([[[-1.0, 1.0]] * H] * 2), 3)
        made.write(torch.randn(5, H, 16) * 3, torch.randn(5, H, 16) * 3, torch.arange(5))
    assert made.index_current()
    _assert_index_fresh(made, "made in inference mode")
    cache.v_index = cache.v_index[:, :, :-1].contiguous()
    with pytest.raises(CodesignError, match="v_index must be a contiguous torch.int32"):
        oaken_attention(q, cache, bt, cl)


def test_the_op_without_an_index_builds_one():
    """A caller of `codesign::paged_attention_oaken` that passes no index (the op's schema before the cache kept
    one) gets the same output as through the cache; a wrong-shaped index is refused by name."""
    from codesign.kernels.attention.options import AttentionOptions, prepare, to_op_args
    from codesign.kernels.attention.quantized import OAKEN
    from codesign.kernels.kvcache.checks import geometry_probe

    cache, bt, cl, _, _ = _setup([11, 6, 9])
    q = torch.randn(3, 2 * H, cache.head_dim)
    probe = geometry_probe(cache.check(), q.dtype, q.device)
    batch, opts = prepare(q, probe, probe, bt, cl, None, None, AttentionOptions())
    tensors = OAKEN.op_tensors(cache)
    with use_backend("triton"):
        kept, _ = OAKEN.op(q, *tensors, *to_op_args(batch, opts), *OAKEN.params(cache))
        built, _ = OAKEN.op(q, *tensors, *to_op_args(batch, opts), cache.bits, cache.grid)
        assert torch.equal(kept, built)
        with pytest.raises(CodesignError, match="k_index must be a contiguous int32"):
            OAKEN.op(q, *tensors, *to_op_args(batch, opts), cache.bits, cache.grid, cache.k_index[:, :, 1:])
        # the kernel loads 4-byte words (pairs took 8): an index at an odd int32 offset reads as well
        odd = torch.empty(cache.k_index.numel() + 1, dtype=torch.int32)[1:].view(cache.k_index.shape)
        odd.copy_(cache.k_index)
        assert torch.equal(OAKEN.op(q, *tensors, *to_op_args(batch, opts), cache.bits, cache.grid, odd)[0], kept)


def test_stored_bits_count_the_index_and_shapes_it_cannot_address_are_refused():
    """`stored_bits_per_element` is the format's bits plus the kept index's (one int32 word a slot, the lists'
    starts and fullest length: per (block, kv head), each side); a head_dim or block_size past the slot word's
    INDEX_COORD_BITS is refused by name when the cache is made."""
    from codesign.kernels.kvcache.oaken import INDEX_COORD_BITS, index_width

    cache = _empty(6, 8, H, 32, 5)
    words = index_width(5, 8, 32)
    assert words == 5 + 32 + 2
    assert cache.stored_bits_per_element == pytest.approx(cache.bits_per_element + words * 32 / (8 * 32))
    assert cache.kv_format.bits_per_element(32) == pytest.approx(cache.bits_per_element)  # the format's: no index
    assert (cache.k_index.shape[-1], cache.v_index.shape[-1]) == (words, words)
    thr = torch.tensor([[[-1.0, 1.0]]] * 2)
    big = 2 << INDEX_COORD_BITS
    with pytest.raises(CodesignError, match="head_dim must be at most 512"):
        OakenPagedKV.empty(2, 1, 1, big, 4, thr, 1)
