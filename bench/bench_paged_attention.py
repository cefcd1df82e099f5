"""CPU benchmarks (pytest-benchmark) of the paged-attention torch implementations and the KV writer.

Run: .venv/bin/pytest bench/bench_paged_attention.py --benchmark-enable
These time the plain-torch CPU paths only; GPU numbers come from bench/gpu_attention.py.
"""

from __future__ import annotations

import random

import pytest
import torch

from codesign.backend import use_backend
from codesign.kernels.attention.paged import paged_extend_attention
from codesign.kernels.attention.wrappers import PagedDecodeWrapper, TreeAttentionWrapper
from codesign.kernels.kvcache.write import kv_write

BLOCK = 16
HEADS = (32, 8, 128)  # Llama-3-8B: q heads, kv heads, head_dim


def _cache(ctx: list[int], dtype=torch.float32):
    hq, hkv, d = HEADS
    need = [-(-c // BLOCK) for c in ctx]
    nb = sum(need)
    k = torch.randn(nb, BLOCK, hkv, d, dtype=dtype)
    v = torch.randn_like(k)
    perm = torch.randperm(nb).to(torch.int32)
    bt = torch.zeros(len(ctx), max(need), dtype=torch.int32)
    o = 0
    for b, n in enumerate(need):
        bt[b, :n] = perm[o : o + n]
        o += n
    return k, v, bt, torch.tensor(ctx, dtype=torch.int32)


@pytest.mark.parametrize("batch, ctx", [(1, 2048), (8, 512)])
def test_bench_decode_torch(benchmark, batch, ctx):
    k, v, bt, cl = _cache([ctx] * batch)
    w = PagedDecodeWrapper()
    with use_backend("torch"):
        w.plan(k, bt, cl, HEADS[0])
        q = torch.randn(batch, HEADS[0], HEADS[2])
        benchmark(w.run, q, k, v)


def test_bench_extend_torch(benchmark):
    q_lens, prefix = [64, 32], [256, 512]
    k, v, bt, cl = _cache([p + n for p, n in zip(prefix, q_lens)])
    cu = torch.tensor([0, 64, 96], dtype=torch.int32)
    q = torch.randn(96, HEADS[0], HEADS[2])
    with use_backend("torch"):
        benchmark(paged_extend_attention, q, k, v, bt, cl, cu, check_data=False)


def test_bench_tree_torch(benchmark):
    rng = random.Random(0)
    parents = [[-1] + [rng.randrange(i) for i in range(1, 64)] for _ in range(2)]
    k, v, bt, _ = _cache([512 + 64, 1024 + 64])
    w = TreeAttentionWrapper()
    with use_backend("torch"):
        w.plan(k, bt, parents, [512, 1024], HEADS[0])
        q = torch.randn(128, HEADS[0], HEADS[2])
        benchmark(w.run, q, k, v)


def test_bench_kv_write_torch(benchmark):
    k, v, _, _ = _cache([4096])
    key = torch.randn(256, HEADS[1], HEADS[2])
    slots = torch.randperm(k.shape[0] * BLOCK)[:256]
    with use_backend("torch"):
        benchmark(kv_write, key, key, k, v, slots, check_data=False)
