"""Paged KV cache: block allocator (refcounts, exhaustion), copy-on-write forks, the slot-mapping
writer (Triton in the interpreter and torch), and the table checks every paged kernel runs."""

from __future__ import annotations

import pytest
import torch

from codesign.backend import use_backend
from codesign.kernels.kvcache.blocks import BlockAllocator, PagedKVCache
from codesign.kernels.kvcache.checks import check_block_tables
from codesign.kernels.kvcache.write import _kv_write_op, kv_write
from codesign.specs import CodesignError


# --- allocator ---------------------------------------------------------------------------------------
def test_allocator_refcounts_and_reuse():
    a = BlockAllocator(5)
    x = a.allocate(3)
    assert len(set(x)) == 3 and a.num_free == 2
    a.incref(x[:1])
    a.free(x)
    assert a.num_free == 4 and a.refcount(x[0]) == 1  # still owned once
    a.free(x[:1])
    assert a.num_free == 5
    assert sorted(a.allocate(5)) == [0, 1, 2, 3, 4]


def test_allocator_exhaustion_takes_nothing():
    a = BlockAllocator(4)
    a.allocate(3)
    with pytest.raises(CodesignError, match="exhausted: need 2 block.*1 of 4 free"):
        a.allocate(2)
    assert a.num_free == 1


def test_allocator_rejects_double_free_and_foreign_ids():
    a = BlockAllocator(3)
    (b,) = a.allocate(1)
    a.free([b])
    with pytest.raises(CodesignError, match="not allocated"):
        a.free([b])
    with pytest.raises(CodesignError, match="outside the pool"):
        a.incref([7])


# --- cache bookkeeping -------------------------------------------------------------------------------
def _write_tokens(cache: PagedKVCache, seq: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    h, d = cache.k_cache.shape[2:]
    k = torch.randn(n, h, d)
    v = torch.randn(n, h, d)
    slots = torch.tensor(cache.append_slots(seq, n), dtype=torch.int64)
    kv_write(k, v, cache.k_cache, cache.v_cache, slots)
    return k, v


def _read_seq(cache: PagedKVCache, seq: int) -> tuple[torch.Tensor, torch.Tensor]:
    bs = cache.block_size
    n = cache.seq_len(seq)
    blocks = torch.tensor(cache.seq_blocks(seq))
    t = torch.arange(n)
    return cache.k_cache[blocks[t // bs], t % bs], cache.v_cache[blocks[t // bs], t % bs]


def test_append_fork_copy_on_write():
    cache = PagedKVCache(
        num_blocks=10, block_size=4, num_kv_heads=2, head_dim=8, dtype=torch.float32, fill=float("nan")
    )
    cache.add_sequence(0)
    k0, v0 = _write_tokens(cache, 0, 6)  # one full block + 2 tokens
    cache.fork(0, 1)
    assert cache.seq_blocks(1) == cache.seq_blocks(0)
    assert cache.allocator.refcount(cache.seq_blocks(0)[0]) == 2
    k1, v1 = _write_tokens(cache, 1, 3)  # writes into the shared partial block: must copy first
    assert cache.seq_blocks(1)[0] == cache.seq_blocks(0)[0]  # full block still shared
    assert cache.seq_blocks(1)[1] != cache.seq_blocks(0)[1]  # partial block copied
    k_par, v_par = _read_seq(cache, 0)
    assert torch.equal(k_par, k0) and torch.equal(v_par, v0)  # parent unchanged
    k_ch, v_ch = _read_seq(cache, 1)
    assert torch.equal(k_ch, torch.cat([k0, k1])) and torch.equal(v_ch, torch.cat([v0, v1]))
    cache.free(0)
    assert cache.allocator.refcount(cache.seq_blocks(1)[0]) == 1
    cache.free(1)
    assert cache.allocator.num_free == 10


def test_fork_prefix_and_truncate():
    cache = PagedKVCache(8, 3, 1, 4, torch.float32)
    cache.add_sequence(0)
    k0, _ = _write_tokens(cache, 0, 7)
    cache.fork(0, 5, num_tokens=4)  # shares blocks 0 and 1 (partial: 1 of 3 tokens)
    assert cache.seq_len(5) == 4 and cache.seq_blocks(5) == cache.seq_blocks(0)[:2]
    k5, _ = _write_tokens(cache, 5, 2)
    assert torch.equal(_read_seq(cache, 5)[0], torch.cat([k0[:4], k5]))
    assert torch.equal(_read_seq(cache, 0)[0], k0)
    cache.truncate(0, 2)
    assert cache.seq_len(0) == 2 and len(cache.seq_blocks(0)) == 1
    assert torch.equal(_read_seq(cache, 0)[0], k0[:2])
    bt = cache.block_tables([0, 5])
    assert bt.dtype == torch.int32 and bt.shape == (2, 2)
    assert cache.context_lens([5, 0]).tolist() == [6, 2]


def test_cache_errors():
    cache = PagedKVCache(2, 4, 1, 4, torch.float32)
    cache.add_sequence(0)
    cache.append_slots(0, 8)
    with pytest.raises(CodesignError, match="exhausted"):
        cache.append_slots(0, 1)
    assert cache.seq_len(0) == 8  # unchanged after the failed append
    with pytest.raises(CodesignError, match="unknown seq_id"):
        cache.append_slots(3, 1)
    with pytest.raises(CodesignError, match="already exists"):
        cache.add_sequence(0)
    with pytest.raises(CodesignError, match="exceeds"):
        cache.fork(0, 1, num_tokens=9)
    with pytest.raises(CodesignError, match="block_size"):
        PagedKVCache(2, 257, 1, 4)
    with pytest.raises(CodesignError, match="dtype"):
        PagedKVCache(2, 4, 1, 4, torch.int8)


# --- kv_write ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize(
    "dtype, bs, h, d",
    [(torch.float16, 16, 8, 128), (torch.float32, 5, 3, 80), (torch.float32, 1, 1, 64),
     (torch.float32, 4, 40, 128)],  # 40 heads of 128: a token's heads over two programs (32, then 8)
)  # fmt: skip
def test_kv_write_matches_loop(backend, dtype, bs, h, d):
    nb, t = 12, 11
    kc = torch.full((nb, bs, h, d), float("nan"), dtype=dtype)
    vc = kc.clone()
    key = torch.randn(t, h, d).to(dtype)
    val = torch.randn(t, h, d).to(dtype)
    slots = torch.randperm(nb * bs)[:t]
    slots[torch.randint(t, (2,))] = -1  # padding tokens are skipped
    with use_backend(backend):
        kv_write(key, val, kc, vc, slots.to(torch.int32 if backend == "torch" else torch.int64))
    want_k = torch.full_like(kc, float("nan"))
    want_v = want_k.clone()
    for i, s in enumerate(slots.tolist()):
        if s >= 0:
            want_k[s // bs, s % bs] = key[i]
            want_v[s // bs, s % bs] = val[i]
    assert torch.equal(kc.isnan(), want_k.isnan())  # untouched slots stay NaN
    assert torch.equal(kc.nan_to_num(), want_k.nan_to_num()) and torch.equal(
        vc.nan_to_num(), want_v.nan_to_num()
    )


@pytest.mark.lowering
def test_kv_write_splits_many_heads_over_programs_without_spills():
    """Compile-only sm_90: a token of 128 heads of 192 (DeepSeek's expanded prefill keys, the transient pool) takes
    8 programs of 16 heads; Llama-3-8B's 8 x 128 stays one program a token. No spills (one program a token of 128 x
    192 spilled 6 KB)."""
    from helpers import assert_runs_without_interpreter

    assert_runs_without_interpreter(
        """
import torch
from codesign.autotune.compile_only import compile_only
from codesign.kernels.kvcache.write import kv_write
for h, d, programs in ((128, 192, 8), (8, 128, 1)):
    key = torch.zeros(32, h, d, dtype=torch.bfloat16)
    cache = torch.zeros(4, 16, h, d, dtype=torch.bfloat16)
    with compile_only(arch=90, gpu_name="NVIDIA H200", sms=132) as s:
        kv_write(key, key, cache, cache.clone(), torch.arange(32), check_data=False)
    (l,) = s.launches
    assert l.error is None and l.spill_stores == 0 and l.spill_loads == 0, l
    assert l.grid[0] == 32 and l.grid[1] == programs, l
print("ok")
"""
    )


def test_kv_write_strided_key():
    kc = torch.zeros(4, 4, 2, 64)
    vc = torch.zeros_like(kc)
    qkv = torch.randn(5, 3, 2, 64)  # keys and values as views into a fused QKV output
    slots = torch.tensor([3, 0, 9, 15, 4])
    with use_backend("triton"):
        kv_write(qkv[:, 1], qkv[:, 2], kc, vc, slots)
    assert torch.equal(kc.view(-1, 2, 64)[slots], qkv[:, 1])
    assert torch.equal(vc.view(-1, 2, 64)[slots], qkv[:, 2])


@pytest.mark.parametrize(
    "slots, match",
    [([0, 16], "outside"), ([0, -2], "outside"), ([3, 3], "twice")],
)
def test_kv_write_bad_slots(slots, match):
    kc = torch.zeros(4, 4, 1, 8)
    with pytest.raises(CodesignError, match=match):
        kv_write(torch.zeros(2, 1, 8), torch.zeros(2, 1, 8), kc, kc.clone(), torch.tensor(slots))


def test_kv_write_bad_shapes_and_dtypes():
    kc = torch.zeros(4, 4, 2, 8)
    vc = torch.zeros_like(kc)
    s = torch.tensor([0, 1])
    with pytest.raises(CodesignError, match="key must have shape"):
        kv_write(torch.zeros(2, 3, 8), torch.zeros(2, 3, 8), kc, vc, s)
    with pytest.raises(CodesignError, match="dtype"):
        kv_write(torch.zeros(2, 2, 8).half(), torch.zeros(2, 2, 8).half(), kc, vc, s)
    with pytest.raises(CodesignError, match="slot_mapping"):
        kv_write(torch.zeros(2, 2, 8), torch.zeros(2, 2, 8), kc, vc, s.float())
    # the kernels read the slots as one contiguous row: strided ones wrote unchecked slots
    with pytest.raises(CodesignError, match="slot_mapping must be contiguous"):
        kv_write(torch.zeros(2, 2, 8), torch.zeros(2, 2, 8), kc, vc, torch.tensor([0, 9, 5, 9])[::2])
    with pytest.raises(CodesignError, match="key must be a tensor, got list"):
        kv_write([[0.0] * 8] * 2, torch.zeros(2, 2, 8), kc, vc, s)
    with pytest.raises(CodesignError, match="v_cache dtype"):
        kv_write(torch.zeros(2, 2, 8), torch.zeros(2, 2, 8), kc, vc.half(), s)


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_kv_write_opcheck(backend):
    kc = torch.zeros(3, 4, 2, 16)
    args = (torch.randn(3, 2, 16), torch.randn(3, 2, 16), kc, kc.clone(), torch.tensor([5, -1, 0]))
    with use_backend(backend):
        torch.library.opcheck(_kv_write_op, args)


# --- table checks --------------------------------------------------------------------------------------
def test_check_block_tables():
    bt = torch.tensor([[0, 1, -7], [2, 3, 3]], dtype=torch.int32)
    check_block_tables(bt, torch.tensor([8, 12], dtype=torch.int32), 4, 4)  # -7 is past the live blocks
    with pytest.raises(CodesignError, match=r"block_tables\[0, 2\]=-7"):
        check_block_tables(bt, torch.tensor([9, 12], dtype=torch.int32), 4, 4)
    with pytest.raises(CodesignError, match=r"block_tables\[1, 0\]=2 is outside the pool \[0, 2\)"):
        check_block_tables(bt, torch.tensor([1, 1], dtype=torch.int32), 2, 4)
    with pytest.raises(CodesignError, match=r"context_lens\[1\]=13 needs 4 blocks"):
        check_block_tables(bt, torch.tensor([1, 13], dtype=torch.int32), 4, 4)
    with pytest.raises(CodesignError, match="negative"):
        check_block_tables(bt, torch.tensor([1, -1], dtype=torch.int32), 4, 4)


def test_kv_write_bf16_triton_refused_in_interpreter():
    kc = torch.zeros(2, 4, 1, 8, dtype=torch.bfloat16)
    x = torch.zeros(1, 1, 8, dtype=torch.bfloat16)
    with use_backend("triton"), pytest.raises(CodesignError, match="bf16"):
        kv_write(x, x, kc, kc.clone(), torch.tensor([0]))
    kv_write(x + 1, x + 2, kc, kc, torch.tensor([5]))  # torch backend handles bf16
    assert kc[1, 1, 0, 0].item() == 2.0
