"""Attention sinks (`attention.sinks`, GPT-OSS's per-head logit in each softmax) on every path: decode, split-KV,
extend and tree over plain caches against the fp64 reference with the sink as one more column (NaN in unused
slots); every quantized cache type and its special launches (mixed widths, Oaken's three launches) against the
fp64 rescale of their own sink-free output; the plan()/run() wrappers bit-identical to the entry points; bad
sinks refused by name; and the teeth: a sink dropped or applied twice fails the reference."""

from __future__ import annotations

import pytest
import torch
from helpers import assert_rel_close
from paged_attention_ref import make_paged_kv, reference_attention
from test_attention_wrappers import CTX, HQ, _cache, _functional, _tables
from triton_lowering import assert_lowers_for_gpu

from codesign.backend import use_backend
from codesign.kernels.attention import oaken_split as osp
from codesign.kernels.attention import ops
from codesign.kernels.attention.paged import paged_decode_attention, paged_extend_attention, tree_attention
from codesign.kernels.attention.sinks import apply_sinks_
from codesign.kernels.attention.tree import build_tree_batch
from codesign.kernels.attention.wrappers import PagedDecodeWrapper, PagedExtendWrapper, TreeAttentionWrapper
from codesign.specs import CodesignError

TOL = {torch.float32: 2e-5, torch.float16: 4e-3}


def _sinks(hq: int, seed: int = 0) -> torch.Tensor:
    """Sinks over the scores' range (some heads mostly sink, some barely), one -inf (a head without a sink)."""
    g = torch.Generator().manual_seed(seed)
    s = torch.randn(hq, generator=g) * 3
    s[1] = float("-inf")
    return s


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("dtype, splits", [(torch.float32, 1), (torch.float16, 3)])
def test_decode_with_sinks_matches_reference(backend, dtype, splits):
    ctx = [1, 37, 90]
    k, v, bt, cl = make_paged_kv(ctx, 2, 64, 16, dtype, share_blocks=1)
    q = (torch.randn(3, 8, 64) * 2).to(dtype)
    sinks = _sinks(8)
    ref, ref_lse = reference_attention(q, k, v, bt, cl, [1, 1, 1], window=40, sinks=sinks)
    with use_backend(backend):
        out, lse = paged_decode_attention(q, k, v, bt, cl, window=40, sinks=sinks, return_lse=True, num_splits=splits)
        alone = paged_decode_attention(q, k, v, bt, cl, window=40, sinks=sinks, num_splits=splits)
    assert out.dtype == dtype and torch.equal(alone, out)
    assert_rel_close(out, ref, TOL[dtype])
    assert_rel_close(lse, ref_lse, 1e-5, "lse")
    plain, _ = reference_attention(q, k, v, bt, cl, [1, 1, 1], window=40)
    assert not torch.allclose(plain, ref, atol=1e-2)  # the sinks change the answer


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_extend_and_tree_with_sinks_match_reference(backend):
    q_lens, prefix = [5, 1, 12], [0, 30, 7]
    ctx = [p + n for p, n in zip(prefix, q_lens)]
    k, v, bt, cl = make_paged_kv(ctx, 2, 32, 8, torch.float32)
    q = torch.randn(sum(q_lens), 4, 32) * 2
    sinks = _sinks(4, seed=1)
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    ref, ref_lse = reference_attention(q, k, v, bt, cl, q_lens, softcap=3.0, sinks=sinks)
    with use_backend(backend):
        out, lse = paged_extend_attention(q, k, v, bt, cl, cu, softcap=3.0, sinks=sinks, return_lse=True)
    assert_rel_close(out, ref, TOL[torch.float32])
    assert_rel_close(lse, ref_lse, 1e-5, "lse")

    parents = [[-1, 0, 0, 1, 3], [-1], [-1, 0, 1, 1, 0, 4, 2, 2, 3, 0, 9, 9]]
    tree = build_tree_batch(parents, prefix, "cpu")
    ref, _ = reference_attention(q, k, v, bt, cl, q_lens, parents=parents, sinks=sinks)
    with use_backend(backend):
        out = tree_attention(q, k, v, bt, tree, sinks=sinks, num_splits=2)
    assert_rel_close(out, ref, TOL[torch.float32])


def _oaken_split_forced(monkeypatch) -> list:
    """Oaken's three launches at the tests' small shapes (by default from 2^17 sequences x heads x context); the
    list the spy appends to at each such launch."""
    monkeypatch.setattr(osp, "split_default", lambda batch, shape: 1)
    calls, real = [], ops.attend_split

    def spy(*a):
        calls.append(1)
        return real(*a)

    monkeypatch.setattr(ops, "attend_split", spy)
    return calls


@pytest.mark.parametrize("kind", ["int4", "int2", "fp8", "kivi", "oaken", "oaken-split", "oaken_offline", "mixed"])
def test_every_cache_type_applies_its_sinks_once(kind, monkeypatch):
    """The Triton kernels (mixed: width by width; oaken-split: three launches) with sinks against the fp64 rescale of
    the torch path's sink-free (out, lse): each path hands run_attention its lse, which folds the sink in once."""
    calls = _oaken_split_forced(monkeypatch) if kind == "oaken-split" else []
    nb, bt, cl, slots = _tables(CTX)
    cache = _cache(kind.removesuffix("-split"), nb, bt, slots)
    q = torch.randn(len(CTX), HQ, 16) * 2
    sinks = _sinks(HQ, seed=2)
    base = kind.removesuffix("-split")
    with use_backend("triton"):
        out = _functional(base, q, cache, bt, cl, None, 2, sinks=sinks)
    plain, lse = _functional(base, q, cache, bt, cl, None, 2, return_lse=True)  # CPU: the torch path
    want = plain.double() * torch.sigmoid(lse.double() - sinks.double())[..., None]
    assert_rel_close(out, want, 2e-6, f"{kind} with sinks")
    assert len(calls) == (kind == "oaken-split")


@pytest.mark.parametrize("kind", ["int4", "mixed", "oaken-split"])
def test_wrappers_take_sinks_per_run_bit_identical_to_entry_points(kind, monkeypatch):
    """One plan, two layers' sinks: run(sinks=) gives each layer the entry point's bits."""
    calls = _oaken_split_forced(monkeypatch) if kind == "oaken-split" else []
    base = kind.removesuffix("-split")
    nb, bt, cl, slots = _tables(CTX)
    cache = _cache(base, nb, bt, slots)
    q = torch.randn(len(CTX), HQ, 16)
    w = PagedDecodeWrapper()
    with use_backend("triton"):
        w.plan(cache, bt, cl, HQ, num_splits=2, q_dtype=torch.float32)
        for seed in (3, 4):
            sinks = _sinks(HQ, seed)
            out, lse = w.run(q, cache, return_lse=True, sinks=sinks)
            f_out, f_lse = _functional(base, q, cache, bt, cl, None, 2, sinks=sinks, return_lse=True)
            assert torch.equal(out, f_out) and torch.equal(lse, f_lse)
        assert torch.equal(w.run(q, cache), _functional(base, q, cache, bt, cl, None, 2))  # none kept from a run
    assert len(calls) == (6 if kind == "oaken-split" else 0)


def test_extend_and_tree_wrappers_take_sinks():
    q_lens, prefix = [3, 2], [6, 9]
    ctx = [p + n for p, n in zip(prefix, q_lens)]
    k, v, bt, cl = make_paged_kv(ctx, 1, 16, 4, torch.float32)
    cu = torch.tensor([0, 3, 5], dtype=torch.int32)
    q, sinks = torch.randn(5, 2, 16), _sinks(2, seed=5)
    w = PagedExtendWrapper()
    w.plan(k, bt, cl, cu, 2)
    assert torch.equal(w.run(q, k, v, sinks=sinks), paged_extend_attention(q, k, v, bt, cl, cu, sinks=sinks))
    parents = [[-1, 0, 0], [-1, 0]]
    t = TreeAttentionWrapper()
    tree = t.plan(k, bt, parents, prefix, 2)
    assert torch.equal(t.run(q, k, v, sinks=sinks), tree_attention(q, k, v, bt, tree, sinks=sinks))


@pytest.mark.parametrize(
    "sinks, match",
    [
        (torch.zeros(4, dtype=torch.float16), r"sinks must be float32 of shape \(4,\)"),
        (torch.zeros(3), r"sinks must be float32 of shape \(4,\)"),
        (torch.zeros(1, 4), r"sinks must be float32 of shape \(4,\)"),
        ([0.0] * 4, "sinks must be a float32 tensor"),
        (torch.zeros(4, device="meta"), "sinks is on meta but q is on cpu"),
    ],
)
def test_bad_sinks_are_refused_by_name(sinks, match):
    k, v, bt, cl = make_paged_kv([5], 2, 16, 4, torch.float32)
    q = torch.randn(1, 4, 16)
    with pytest.raises(CodesignError, match=match):
        paged_decode_attention(q, k, v, bt, cl, sinks=sinks)
    w = PagedDecodeWrapper()
    w.plan(k, bt, cl, 4)
    with pytest.raises(CodesignError, match=match):
        w.run(q, k, v, sinks=sinks)


@pytest.mark.parametrize("mutation", ["dropped", "twice"])
def test_teeth_a_sink_dropped_or_applied_twice_fails_the_reference(mutation, monkeypatch):
    real = ops.apply_sinks_

    def mutated(*args):
        if mutation == "twice":
            real(*args)
            real(*args)

    monkeypatch.setattr(ops, "apply_sinks_", mutated)
    k, v, bt, cl = make_paged_kv([9, 20], 1, 16, 4, torch.float32)
    q = torch.randn(2, 2, 16)
    sinks = torch.tensor([0.5, 2.0])
    ref, _ = reference_attention(q, k, v, bt, cl, [1, 1], sinks=sinks)
    with pytest.raises(AssertionError):
        assert_rel_close(paged_decode_attention(q, k, v, bt, cl, sinks=sinks), ref, TOL[torch.float32])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_the_rescale_kernel_matches_fp64_on_strided_rows(dtype):
    """One launch (the interpreter) and the torch path against fp64: an out with padded rows and an lse of
    transposed storage (strides their own), head_dim 80 (not a power of 2), a -inf sink (no change), an lse of
    -inf (the row goes to 0), tokens 0."""
    g = torch.Generator().manual_seed(6)
    buf = torch.randn(7, 5, 96, generator=g).to(dtype)
    lse = torch.randn(7, 5, generator=g) * 4
    lse[3, 2] = float("-inf")
    sinks = torch.randn(5, generator=g) * 3
    sinks[4] = float("-inf")
    f = torch.sigmoid(lse.double() - sinks.double())
    f[3, 2] = 0.0
    want = buf[:, :, :80].double() * f[..., None]
    want_lse = torch.logaddexp(lse.double(), sinks.double())
    for backend in ("triton", "torch"):
        out, l_ = buf.clone()[:, :, :80], lse.t().contiguous().t()
        apply_sinks_(out, l_, sinks, backend)
        assert_rel_close(out, want, {torch.float32: 1e-6, torch.float16: 1e-3}[dtype], backend)
        torch.testing.assert_close(l_.double(), want_lse, rtol=1e-6, atol=1e-6)
        assert torch.equal(out[:, 4], buf[:, 4, :80]) and float(out[3, 2].abs().max()) == 0.0
    apply_sinks_(buf[:0], lse[:0], sinks, "triton")  # no tokens: no launch


def test_the_rescale_kernel_lowers_for_sm90():
    types = {"out_ptr": "*bf16", "lse_ptr": "*fp32", "sinks_ptr": "*fp32"}
    assert_lowers_for_gpu("codesign.kernels.attention.sinks:_sinks_kernel", types,
                          [dict(BLOCK_D=128), dict(BLOCK_D=64, types={"out_ptr": "*fp16"})], num_warps=1)  # fmt: skip
