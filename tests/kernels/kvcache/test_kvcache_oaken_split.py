"""Oaken decode in three launches (`codesign.kernels.attention.oaken_split`): which launches take it, each
correction's share (teeth: either launch left out fails against fp64), blocks wider than the INT tile and of no
power of two (the per-slot factor), ALiBi and soft-capping (the kept probabilities are the softmax's), and the
one-launch kernel's output beside it."""

from __future__ import annotations

import pytest
import torch
from helpers import assert_rel_close, rel_fro_error
from paged_attention_ref import reference_attention
from test_kvcache_oaken import H, _reference_pool, _setup, decode_path, read_pool

from codesign.backend import use_backend
from codesign.kernels.attention import oaken_split as osp
from codesign.kernels.attention.quantized import oaken_attention


class _Launches:
    """A stand-in for a jit kernel: counts launches, or runs `instead` (args, keywords) in its place."""

    def __init__(self, kernel, instead=None):
        self.kernel, self.instead, self.calls = kernel, instead, 0

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.calls += 1
            if self.instead is not None:
                return self.instead(args, kwargs)
            return self.kernel[grid](*args, **kwargs)

        return launch


def _pool(ctx=(70, 33, 20), bs=8, cap=24, **kw):
    cache, bt, cl, xs, thr = _setup(list(ctx), bs=bs, cap=cap, spikes=(5, 9, 12), **kw)
    kd, vd, _ = _reference_pool(cache, bt, xs, thr, 4)
    kd, vd = read_pool(cache, kd, vd)
    return cache, bt, cl, kd, vd


def test_decode_takes_three_launches_and_the_rest_one(monkeypatch):
    """With SPLIT 1, online decode (any split count) runs the bias, INT and correction launches; extend and a window
    run the one-launch kernel (no bias launch), as does decode by default at this small a batch (`split_default`);
    the offline variant's format never takes them (`split_applies`)."""
    from codesign.kernels.kvcache.formats import KV_FORMAT_OAKEN_OFFLINE

    bias = _Launches(osp._key_bias_kernel)
    corr = _Launches(osp._value_corr_kernel)
    monkeypatch.setattr(osp, "_key_bias_kernel", bias)
    monkeypatch.setattr(osp, "_value_corr_kernel", corr)
    cache, bt, cl, kd, vd = _pool()
    q = torch.randn(3, 2 * H, kd.shape[-1])
    with use_backend("triton"):
        with decode_path(1):
            for splits in (None, 1, 3):
                oaken_attention(q, cache, bt, cl, num_splits=splits)
            assert bias.calls == corr.calls == 3
            cu = torch.tensor([0, 2, 3, 5], dtype=torch.int32)
            oaken_attention(torch.randn(5, 2 * H, kd.shape[-1]), cache, bt, cl, cu)
            oaken_attention(q, cache, bt, cl, window=9)
            assert not osp.split_applies(KV_FORMAT_OAKEN_OFFLINE, q, None, None, ())
        oaken_attention(q, cache, bt, cl)
    assert bias.calls == corr.calls == 3


@pytest.mark.parametrize(
    "batch, context, hkv, want",
    [(16, 8192, 8, 1), (64, 1024, 8, 1), (16, 32768, 8, 1), (16, 1024, 8, 1), (1, 32768, 8, 1), (1, 8192, 8, 0),
     (4, 1024, 32, 1), (16, 1008, 8, 0), (8, 1024, 8, 0)],  # fmt: skip
)
def test_the_default_takes_three_launches_from_the_crossover(batch, context, hkv, want):
    """Without a table, decode takes the three launches from SPLIT_MIN_TOKEN_HEADS sequences x kv heads x context
    (the block table's width times the block size) on, where they are predicted faster; and that is what routes."""
    from codesign.kernels.attention.options import AttentionBatch, AttentionOptions

    bs = 16
    bt = torch.zeros(batch, -(-context // bs), dtype=torch.int32)
    cl = torch.full((batch,), context, dtype=torch.int32)
    b = AttentionBatch(bt, cl, torch.arange(batch + 1, dtype=torch.int32), is_decode=True)
    shape = (bt.numel(), bs, hkv, 128)
    assert osp.split_default(b, shape) == want
    q = torch.empty(batch, 4 * hkv, 128, dtype=torch.float16)
    assert osp.split_applies(osp.KV_FORMAT_OAKEN, q, b, AttentionOptions(), shape) is bool(want)
    assert not osp.split_applies(osp.KV_FORMAT_OAKEN, q, b, AttentionOptions(window=64), shape)
    with decode_path(0):
        assert not osp.split_applies(osp.KV_FORMAT_OAKEN, q, b, AttentionOptions(), shape)


@pytest.mark.parametrize("left_out", ["keys", "values"])
def test_each_correction_counts(left_out, monkeypatch):
    """Teeth: with the key biases zeroed, or the value corrections not added, decode misses fp64 by far more than
    its bound (the spikes put outliers on most tokens); with both launches it is within it."""
    cache, bt, cl, kd, vd = _pool()
    q = torch.randn(3, 2 * H, kd.shape[-1])
    ref, _ = reference_attention(q, kd, vd, bt, cl, [1, 1, 1])
    with use_backend("triton"), decode_path(1):
        assert_rel_close(oaken_attention(q, cache, bt, cl, num_splits=2), ref, 2e-6, "three launches")
        if left_out == "keys":
            stub = _Launches(osp._key_bias_kernel, lambda args, kwargs: args[4].zero_())
            monkeypatch.setattr(osp, "_key_bias_kernel", stub)
        else:
            monkeypatch.setattr(osp, "_value_corr_kernel", _Launches(osp._value_corr_kernel, lambda a, k: None))
        err = rel_fro_error(oaken_attention(q, cache, bt, cl, num_splits=2).double(), ref)
    assert err > 1e-3, f"without the {left_out}' corrections: {err:.2e}"


@pytest.mark.parametrize("bs, tile, qdtype", [(64, 32, torch.float32), (24, 32, torch.float16),
                                              (32, 16, torch.float16), (8, 64, torch.float32)])  # fmt: skip
def test_blocks_against_tiles_vs_fp64(bs, tile, qdtype):
    """Blocks wider than the INT launch's tile (64 over 32, 32 over 16: a factor per slot from its tile's max), of
    no power of two (24, straddling tiles), and several a tile (8 over 64); splits ending inside a block (the
    corrections keep only their split's tokens); fp32 queries (p kept in fp32) and fp16 (kept in fp16)."""
    cache, bt, cl, kd, vd = _pool(ctx=(100, 33, 57), bs=bs, cap=3 * bs)
    q = torch.randn(3, 2 * H, kd.shape[-1]).to(qdtype)
    ref, _ = reference_attention(q.double(), kd, vd, bt, cl, [1] * 3)
    tol = 2e-6 if qdtype == torch.float32 else 2e-3
    with use_backend("triton"), decode_path(1, tile):
        for splits in (1, 3):
            out = oaken_attention(q, cache, bt, cl, num_splits=splits)
            assert_rel_close(out.double(), ref, tol, f"bs={bs} tile={tile} splits={splits}")


@pytest.mark.parametrize("group", [1, 3, 4])
def test_query_head_groups_vs_fp64(group):
    """The kept probabilities hold a token's query heads side by side (one load a slot in the value walk): one head
    a kv head, a group of no power of two (3 of 4 lanes, the fourth masked) and 4."""
    cache, bt, cl, kd, vd = _pool()
    q = torch.randn(3, group * H, kd.shape[-1]).half()
    ref, _ = reference_attention(q.double(), kd, vd, bt, cl, [1] * 3)
    with use_backend("triton"), decode_path(1):
        assert_rel_close(oaken_attention(q, cache, bt, cl, num_splits=2).double(), ref, 2e-3, f"group {group}")


def test_alibi_softcap_and_lse_vs_fp64():
    """ALiBi and soft-capping act on the biased scores; the kept probabilities are the capped softmax's, so the
    value corrections follow; lse from the merge."""
    cache, bt, cl, kd, vd = _pool()
    hq, d = 2 * H, kd.shape[-1]
    q = torch.randn(3, hq, d)
    alibi = torch.rand(hq) * 0.2
    ref, ref_lse = reference_attention(q, kd, vd, bt, cl, [1, 1, 1], softcap=4.0, alibi=alibi)
    with use_backend("triton"), decode_path(1):
        out, lse = oaken_attention(q, cache, bt, cl, num_splits=3, softcap=4.0, alibi_slopes=alibi, return_lse=True)
    assert_rel_close(out, ref, 2e-6, "alibi + softcap")
    assert_rel_close(lse, ref_lse, 2e-6, "lse")


def test_three_launches_match_the_one_launch_kernel():
    """The same decode through both paths, fp16 queries: each within its bound of fp64 and of each other."""
    cache, bt, cl, kd, vd = _pool(ctx=(100, 45, 64))
    q = torch.randn(3, 2 * H, kd.shape[-1]).half()
    ref, _ = reference_attention(q.double(), kd, vd, bt, cl, [1, 1, 1])
    outs = []
    with use_backend("triton"):
        for split in (0, 1):
            with decode_path(split):
                outs.append(oaken_attention(q, cache, bt, cl, num_splits=2).double())
    for split, out in enumerate(outs):
        assert_rel_close(out, ref, 2e-3, f"split={split}")
    assert_rel_close(outs[1], outs[0], 2e-3, "three launches vs one")


@pytest.mark.parametrize("bits", [2, 8])
def test_code_widths_vs_fp64(bits):
    """2- and 8-bit Oaken caches take the INT launch of their width (INT2 half-word planes, INT8 words)."""
    cache, bt, cl, xs, thr = _setup([70, 33, 20], bits=bits, bs=8, cap=24, spikes=(5, 9, 12))
    kd, vd, _ = _reference_pool(cache, bt, xs, thr, bits)
    kd, vd = read_pool(cache, kd, vd)
    q = torch.randn(3, 2 * H, kd.shape[-1])
    ref, _ = reference_attention(q, kd, vd, bt, cl, [1, 1, 1])
    with use_backend("triton"), decode_path(1):
        assert_rel_close(oaken_attention(q, cache, bt, cl, num_splits=2), ref, 2e-6, f"INT{bits}")
