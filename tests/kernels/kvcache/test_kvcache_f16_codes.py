"""fp16 and bf16 queries over the quantized caches (INT8/4/2, FP8, mixed chunks, KIVI, Oaken) meet the codes
in fp16 products (`paged_attention_triton.F16_MMA_FORMATS`): integer codes become fp16 by bit patterns
(`triton_codes.codes_f16`), not conversion instructions; query rows and each tile's per-token value scales are brought
into fp16's range by exact powers of two (`triton_codes.pow2_scale`); FP8's head scales are applied outside the tiles.
Checked in the interpreter against an fp64 reference that dequantizes first, at magnitudes fp16 cannot hold
unscaled: values of 1e-4 (scale x p underflowed fp16 before: 3.3 % error, 116 % at 1e-5) and bf16 queries of
1e6 (fp16's largest is 65504)."""

from __future__ import annotations

import pytest
import torch
from helpers import assert_rel_close, rel_fro_error
from paged_attention_ref import reference_attention
from test_kvcache_kvq import _build, _dequant_ref

from codesign.autotune.lookup import forced_config
from codesign.backend import use_backend
from codesign.kernels.attention import ops
from codesign.kernels.attention.quantized import kvq_decode_attention, kvq_extend_attention


def test_fp8_decodes_exhaustively_in_fp16():
    """Every e4m3 code through the fp16 path (fp16 queries; the interpreter takes the integer decode,
    `_fp8_e4m3_f16`): attention over a one-token context returns v, torch's float8 value, NaN codes included;
    a head scale of 2^-3 is applied to the output."""
    from codesign.kernels.kvcache.kvq import QuantPagedKV

    codes = torch.arange(256, dtype=torch.uint8).view(16, 1, 1, 16)
    hs = torch.full((1,), 0.125)
    cache = QuantPagedKV.empty(16, 1, 1, 16, "fp8", k_head_scale=hs, v_head_scale=hs)
    cache.k_codes.zero_()
    cache.v_codes.copy_(codes)
    bt = torch.arange(16, dtype=torch.int32).view(16, 1)
    with use_backend("triton"):
        out = kvq_decode_attention(torch.randn(16, 1, 16).half(), cache, bt, torch.ones(16, dtype=torch.int32))
    want = (codes.view(torch.float8_e4m3fn).float() * 0.125).view(16, 1, 16)
    assert out.dtype == torch.float16 and torch.equal(out.isnan(), want.isnan())
    assert torch.equal(out[~out.isnan()].float(), want[~want.isnan()])


def _case(fmt, v_scale, q_scale, dtype, ctx=(13, 9, 1), h=2, g=3, d=24, bs=4):
    cache, bt, cl, *_ = _build(fmt, list(ctx), h, d, bs, share=2)
    cache.v_meta.mul_(v_scale)  # scales and zeros: every dequantized value times v_scale
    q = (torch.randn(len(ctx), h * g, d) * q_scale).to(dtype)
    kd, vd = _dequant_ref(cache)
    return cache, bt, cl, q, kd, vd


@pytest.mark.parametrize("fmt", ["int8", "int4", "int2", "fp8"])
@pytest.mark.parametrize("v_scale", [1.0, 1e-4])
def test_fp16_queries_vs_fp64(fmt, v_scale):
    """Decode (with and without splits) and extend, fp16 queries: the error is fp16 rounding of p and the output
    (~2e-4), also where values are small (1e-4: p x scale underflowed fp16 before the per-tile scale)."""
    cache, bt, cl, q, kd, vd = _case(fmt, v_scale, 3.0, torch.float16)
    ref, _ = reference_attention(q.double(), kd, vd, bt, cl, [1, 1, 1])
    for splits in (1, 2):
        with use_backend("triton"):
            out = kvq_decode_attention(q, cache, bt, cl, num_splits=splits)
        assert out.dtype == torch.float16
        assert_rel_close(out.double(), ref, 1e-3, f"{fmt} fp16 decode v_scale={v_scale} splits={splits}")
        if fmt == "int8":  # codes read as bytes (WORDS8 0) or as words (the default): the same sums
            with use_backend("triton"), forced_config("paged_attention_int8", {"WORDS8": 0}):
                assert torch.equal(kvq_decode_attention(q, cache, bt, cl, num_splits=splits), out)
    ql = [3, 2, 1]
    qe = (torch.randn(sum(ql), q.shape[1], q.shape[2]) * 3.0).half()
    cu = torch.tensor([0, 3, 5, 6], dtype=torch.int32)
    with use_backend("triton"):
        oe = kvq_extend_attention(qe, cache, bt, cl, cu, num_splits=1)
    ref_e, _ = reference_attention(qe.double(), kd, vd, bt, cl, ql)
    assert_rel_close(oe.double(), ref_e, 1e-3, f"{fmt} fp16 extend v_scale={v_scale}")


@pytest.mark.parametrize("fmt", ["int4", "int2"])
def test_fp16_queries_over_word_rows(fmt):
    """Rows of whole int32 words (head_dim 32; 24 above is a byte gather at 2 bits): INT4 and INT2 codes unpack two
    per 32-bit op (`words_f16`) in `pair_order`, which q and the output follow; decode and extend vs fp64."""
    cache, bt, cl, q, kd, vd = _case(fmt, 1.0, 3.0, torch.float16, d=32)
    ref, _ = reference_attention(q.double(), kd, vd, bt, cl, [1, 1, 1])
    for splits in (1, 2):
        with use_backend("triton"):
            out = kvq_decode_attention(q, cache, bt, cl, num_splits=splits)
        assert_rel_close(out.double(), ref, 1e-3, f"{fmt} fp16 decode over words splits={splits}")
    qe = (torch.randn(6, q.shape[1], q.shape[2]) * 3.0).half()
    with use_backend("triton"):
        oe = kvq_extend_attention(qe, cache, bt, cl, torch.tensor([0, 3, 5, 6], dtype=torch.int32), num_splits=1)
    ref_e, _ = reference_attention(qe.double(), kd, vd, bt, cl, [3, 2, 1])
    assert_rel_close(oe.double(), ref_e, 1e-3, f"{fmt} fp16 extend over words")


@pytest.mark.parametrize("fmt", ["int8", "fp8"])
def test_bf16_queries_beyond_fp16_range(fmt, monkeypatch):
    """bf16 queries of magnitude 1e6 (no fp16 holds them) meet the codes in fp16 after the per-row power of
    two. The interpreter computes bf16 arithmetic on raw bits, which is why the ops refuse bf16 Triton on CPU;
    this kernel path converts bf16 queries to fp32 before any arithmetic, so the refusal is lifted here. The
    interpreter rounds the bf16 output toward zero (a GPU to nearest): the bound is bf16's."""
    monkeypatch.setattr(ops, "check_backend_dtype", lambda backend, q: None)
    cache, bt, cl, q, kd, vd = _case(fmt, 1.0, 1.0, torch.float32)
    q = (q * 1e6).bfloat16()
    scale = 3e-7  # softmax over scores of order 1
    ref, _ = reference_attention(q.double(), kd, vd, bt, cl, [1, 1, 1], scale=scale)
    for splits in (1, 2):
        with use_backend("triton"):
            out = kvq_decode_attention(q, cache, bt, cl, num_splits=splits, sm_scale=scale)
        assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()
        err = rel_fro_error(out.double(), ref)
        assert err < 8e-3, f"{fmt} bf16 1e6 queries: {err:.2e}"


@pytest.mark.parametrize("bs, d", [(4, 16), (32, 64), (32, 48), (32, 16)])
def test_fp16_queries_over_mixed_chunks(bs, d):
    """Mixed INT8/4/2 chunks in one launch, fp16 queries: byte-gathered rows (block 4) and whole-block word
    tiles (block 32), small values included; head_dim 48 pads the word tile (12 of 16 8-bit words a row, so the
    8-bit rows' two 4-word loads, `row_major_words`, mask a whole second load in the last group); head_dim 16: 4
    words an 8-bit row, one plain load."""
    from test_kvcache_mixed import H, _engine_dequant, _setup

    from codesign.kernels.attention.quantized import mixed_attention

    ctx = [3 * bs + 1, 2 * bs - 1, 5]
    cache, bt, cl, *_ = _setup(ctx, bs, d, backend="torch")  # the reads are under test, not the writer
    cache.v_meta.mul_(1e-4)
    kd, vd = _engine_dequant(cache)
    q = (torch.randn(len(ctx), 2 * H, d) * 3.0).half()
    ref, _ = reference_attention(q.double(), kd, vd, bt, cl, [1] * len(ctx))
    for splits in (1, 3):
        with use_backend("triton"):
            out = mixed_attention(q, cache, bt, cl, num_splits=splits)
        assert_rel_close(out.double(), ref, 1e-3, f"mixed fp16 decode bs={bs} splits={splits}")


@pytest.mark.parametrize(
    "g, r, bs, d, bits",
    [(4, 4, 8, 16, 4), (8, 4, 16, 24, 4), (16, 8, 32, 32, 4), (32, 0, 32, 64, 4), (16, 8, 32, 32, 2),
     (32, 0, 32, 64, 2)],  # fmt: skip
)
def test_kivi_fp16_and_bf16_queries(g, r, bs, d, bits, monkeypatch):
    """KIVI tiles dequantize in fp16 arithmetic (fp16 codes by bit patterns, one fused multiply-add with the
    stored fp16 scale and zero): per-row key metadata (G = 4, 8), one row per tile (G = 16, 32), value groups of
    4, 16 and 32 (one [BLOCK_N, groups] load spread by a reshape) and of 8 in a padded head of 24 (a select per
    group), the fp16 residual ring; fp16 queries, and bf16 queries of 1e6 (refusal lifted as above). Value groups
    of whole words (16 and 32 at 4 bits, 16 and 32 at 2) take the paired unpack (`words_f16`, `pair_order`)."""
    from test_kvcache_kivi import _ref, _setup

    from codesign.kernels.attention.quantized import kivi_decode_attention, kivi_extend_attention

    monkeypatch.setattr(ops, "check_backend_dtype", lambda backend, q: None)
    ctx = [2 * g + r - 1, 2 * g + r, 2 * g + r + 1, 5 * g + 3]
    cache, bt, cl, ks, vs = _setup(ctx, bits, chunks=(g + 3, 1, 1000), share=True, g=g, r=r, bs=bs, d=d)
    q = torch.randn(len(ctx), 2 * cache.k_codes.shape[2], d) * 3.0
    ref, _ = _ref(q.half().double(), cache, ks, vs, [1] * len(ctx))
    for splits in (1, 3):
        with use_backend("triton"):
            out = kivi_decode_attention(q.half(), cache, bt, cl, num_splits=splits)
        assert_rel_close(out.double(), ref, 2e-3, f"kivi fp16 decode G={g} splits={splits}")
    qe = torch.randn(9, q.shape[1], d).half()
    cu = torch.tensor([0, 2, 4, 7, 9], dtype=torch.int32)
    with use_backend("triton"):
        oe = kivi_extend_attention(qe, cache, bt, cl, cu, num_splits=1)
    ref_e, _ = _ref(qe.double(), cache, ks, vs, [2, 2, 3, 2])
    assert_rel_close(oe.double(), ref_e, 2e-3, f"kivi fp16 extend G={g}")
    qb = (q * 1e6).bfloat16()
    ref_b, _ = _ref(qb.double(), cache, ks, vs, [1] * len(ctx), scale=1e-7)
    with use_backend("triton"):
        ob = kivi_decode_attention(qb, cache, bt, cl, num_splits=2, sm_scale=1e-7)
    assert torch.isfinite(ob).all()
    err = rel_fro_error(ob.double(), ref_b)
    assert err < 8e-3, f"kivi bf16 1e6 queries G={g}: {err:.2e}"


def _oaken_check(name, cache, bt, cl, kd, vd, monkeypatch):
    from codesign.kernels.attention.quantized import oaken_attention

    monkeypatch.setattr(ops, "check_backend_dtype", lambda backend, q: None)
    n = cl.numel()
    q = torch.randn(n, 2 * cache.k_codes.shape[2], kd.shape[-1]) * 3.0
    ref, _ = reference_attention(q.half().double(), kd, vd, bt, cl, [1] * n)
    for splits in (1, 3):
        with use_backend("triton"):
            out = oaken_attention(q.half(), cache, bt, cl, num_splits=splits)
        assert_rel_close(out.double(), ref, 2e-3, f"{name} fp16 splits={splits}")
    qb = (q * 1e6).bfloat16()
    ref_b, _ = reference_attention(qb.double(), kd, vd, bt, cl, [1] * n, scale=1e-7)
    with use_backend("triton"):
        ob = oaken_attention(qb, cache, bt, cl, num_splits=2, sm_scale=1e-7)
    assert torch.isfinite(ob).all()
    err = rel_fro_error(ob.double(), ref_b)
    assert err < 8e-3, f"{name} bf16 1e6 queries: {err:.2e}"


@pytest.mark.parametrize("bs, cap", [(4, 3), (32, 40), (8, 12)])
def test_oaken_fp16_and_bf16_queries(bs, cap, monkeypatch):
    """Oaken's dense codes meet the queries as fp16 (words, `words_f16`'s column order) with each token's scale
    and lower bound factored out per row; the outliers' differences from the lower bound are added to the scores
    and output in fp32; fp16 queries, and bf16 queries of 1e6 (refusal lifted as above). Blocks with more outliers
    than slots, slot chunks past 16, tiles over several blocks."""
    from test_kvcache_oaken import _reference_pool, _setup, read_pool

    cache, bt, cl, xs, thr = _setup([70, 33, 20, 50], bs=bs, cap=cap, spikes=(5, 9, 12))
    kd, vd, _ = _reference_pool(cache, bt, xs, thr, 4)
    kd, vd = read_pool(cache, kd, vd)
    _oaken_check(f"oaken bs={bs} cap={cap}", cache, bt, cl, kd, vd, monkeypatch)


def test_oaken_offline_fp16_and_bf16_queries(monkeypatch):
    """The offline variant: per-row scale and lower bound from 8-bit codes on the head's grid, rounded to fp16
    once per row."""
    from test_kvcache_oaken import read_pool
    from test_kvcache_oaken_offline import _reference_pool, _setup

    cache, bt, cl, xs, thr, grid = _setup([11, 6, 9, 30])
    kd, vd, *_ = _reference_pool(cache, bt, xs, thr, grid, 4)
    kd, vd = read_pool(cache, kd, vd)
    _oaken_check("oaken offline", cache, bt, cl, kd, vd, monkeypatch)


@pytest.mark.parametrize("offline", [False, True])
def test_oaken_padded_rows_fp16_queries(offline, monkeypatch):
    """fp16 queries over 16-row tiles (a GPU's smallest tl.dot) with 3 real heads per kv head: the key corrections
    reach the tile's rows through the program's scratch and the value corrections' columns follow the codes'
    column order (`words_f16`), as a GPU decode runs them; decode with splits and extend against fp64."""
    import dataclasses

    from test_kvcache_oaken import padded_rows_pool

    from codesign.backend import device_view, use_device_view
    from codesign.kernels.attention.quantized import oaken_attention

    cache, bt, cl, kd, vd = padded_rows_pool(offline)
    monkeypatch.setattr(ops, "check_backend_dtype", lambda backend, q: None)
    h, d = cache.k_codes.shape[2], kd.shape[-1]
    q = (torch.randn(3, 3 * h, d) * 3.0).half()
    ref, _ = reference_attention(q.double(), kd, vd, bt, cl, [1, 1, 1])
    qe = (torch.randn(5, 3 * h, d) * 3.0).half()
    cu = torch.tensor([0, 3, 3, 5], dtype=torch.int32)
    ref_e, _ = reference_attention(qe.double(), kd, vd, bt, cl, [3, 0, 2])
    with use_device_view(dataclasses.replace(device_view("cpu"), min_dot_rows=16)), use_backend("triton"):
        for splits in (1, 2):
            out = oaken_attention(q, cache, bt, cl, num_splits=splits)
            assert_rel_close(out.double(), ref, 2e-3, f"decode splits={splits}")
        assert_rel_close(oaken_attention(qe, cache, bt, cl, cu, num_splits=2).double(), ref_e, 2e-3, "extend")


def test_fp16_tree_verification_over_int4():
    """Tree attention (prefix tiles without a mask, then the ancestor-masked tree) through the fp16 path."""
    from codesign.kernels.attention.quantized import kvq_tree_attention
    from codesign.kernels.attention.tree import build_tree_batch

    parents = [[-1, 0, 0, 1], [-1, 0]]
    tree = build_tree_batch(parents, [6, 5])
    cache, bt, cl, *_ = _build("int4", tree.context_lens.tolist(), 2, 16, 4, share=1)
    cache.v_meta.mul_(1e-4)
    q = (torch.randn(6, 4, 16) * 3.0).half()
    with use_backend("triton"):
        out = kvq_tree_attention(q, cache, bt, tree, num_splits=1)
    kd, vd = _dequant_ref(cache)
    ref, _ = reference_attention(q.double(), kd, vd, bt, cl, [4, 2], parents=parents)
    assert_rel_close(out.double(), ref, 1e-3, "int4 fp16 tree")
