"""Quantized paged KV cache: quantize-on-write in the Triton writer (bit-exact against the accelerator
model's quantizer), and decode / extend / tree attention with dequantization fused in the kernel,
against an fp64 reference that dequantizes first (independently: the engine's numpy dequantizer, torch's
float8 type). Caches are poisoned: unused slots hold NaN metadata / NaN fp8 codes."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import assert_rel_close, rel_fro_error
from paged_attention_ref import make_paged_kv, reference_attention

from codesign.accel_model import kv_quant_engine as eng
from codesign.autotune.lookup import forced_config
from codesign.backend import use_backend
from codesign.kernels.attention.quantized import (
    kvq_decode_attention,
    kvq_extend_attention,
    kvq_tree_attention,
)
from codesign.kernels.attention.tree import build_tree_batch
from codesign.kernels.kvcache import quantizers as kvq
from codesign.kernels.kvcache.kvq import QuantPagedKV, kvq_write
from codesign.specs import CodesignError

FMTS = ["int8", "int4", "int2", "fp8"]


def _poisoned(nb, bs, h, d, fmt, hs=None) -> QuantPagedKV:
    c = QuantPagedKV.empty(nb, bs, h, d, fmt, k_head_scale=hs, v_head_scale=hs)
    if fmt == "fp8":
        c.k_codes.fill_(0x7F)  # e4m3fn NaN
        c.v_codes.fill_(0x7F)
    else:
        c.k_codes.random_(0, 256)
        c.v_codes.random_(0, 256)
        c.k_meta.fill_(float("nan"))
        c.v_meta.fill_(float("nan"))
    return c


def _build(fmt, ctx, h, d, bs, share=0, dtype=torch.float32):
    """Plain random K/V (make_paged_kv) quantized into a poisoned cache by the Triton writer."""
    k, v, bt, cl = make_paged_kv(ctx, h, d, bs, torch.float32, share_blocks=share)
    k[..., :, 1] *= 6.0  # a channel outlier
    live = ~torch.isnan(k[:, :, 0, 0]).reshape(-1)
    slots = torch.nonzero(live).flatten()
    kl = k.reshape(-1, h, d)[slots].to(dtype)
    vl = v.reshape(-1, h, d)[slots].to(dtype)
    hs = kvq.fp8_head_scales(torch.cat([kl, vl]).float()) if fmt == "fp8" else None
    cache = _poisoned(k.shape[0], bs, h, d, fmt, hs)
    perm = torch.randperm(slots.numel())  # write order does not matter
    with use_backend("triton"):
        kvq_write(kl[perm], vl[perm], cache, slots[perm].to(torch.int32))
    return cache, bt, cl, kl, vl, slots


def _dequant_ref(cache: QuantPagedKV) -> tuple[torch.Tensor, torch.Tensor]:
    """Independent dequantization in float64 (engine's numpy code / torch's float8 type)."""
    out = []
    for codes, meta in ((cache.k_codes, cache.k_meta), (cache.v_codes, cache.v_meta)):
        if cache.fmt == "fp8":
            out.append(codes.view(torch.float8_e4m3fn).double() * meta.double()[:, None])
        else:
            c = eng.unpack_codes(codes.numpy(), cache.bits)
            m = meta.float().numpy()
            out.append(torch.from_numpy(eng.dequantize(c, m[..., 0], m[..., 1])).double())
    return out[0], out[1]


@pytest.mark.parametrize("fmt", ["int8", "int4", "int2"])
@pytest.mark.parametrize(("dtype", "h", "d"), [(torch.float16, 3, 24), (torch.float32, 3, 24),
                                              (torch.float32, 40, 128)])  # (40 x 128: two programs a token)
def test_write_int_bit_exact_vs_engine(fmt, dtype, h, d):
    bs = 5
    cache, bt, cl, kl, vl, slots = _build(fmt, [7, 11], h, d, bs, dtype=dtype)
    b = cache.bits
    for x, codes, meta in ((kl, cache.k_codes, cache.k_meta), (vl, cache.v_codes, cache.v_meta)):
        c, s, z = eng.quantize_per_token(x.float().numpy(), b)
        got_c = codes.reshape(-1, h, d * b // 8)[slots].numpy()
        assert np.array_equal(got_c, eng.pack_codes(c, b))
        got_m = meta.reshape(-1, h, 2)[slots].float().numpy()
        assert np.array_equal(got_m[..., 0], s) and np.array_equal(got_m[..., 1], z)
    untouched = torch.ones(cache.k_meta.shape[0] * bs, dtype=torch.bool)
    untouched[slots] = False
    assert torch.isnan(cache.k_meta.reshape(-1, h, 2)[untouched].float()).all()  # no stray writes


@pytest.mark.parametrize(("h", "d"), [(2, 16), (40, 128)])  # (40 x 128: a token's heads over two programs)
def test_write_fp8_rne_vs_torch(h, d):
    x = torch.randn(9, h, d) * 50
    x[0, 0, :4] = torch.tensor([100.0, 108.0, -100.0, 1000.0])  # ties to even, saturation
    x[1, 1, :3] = torch.tensor([2.0**-9 * 3, 2.0**-10, 0.0])  # e4m3 subnormals (scale 1 on head 0 / 1)
    hs = torch.tensor([1.0, 1.0] + [2.0 ** (i % 3) for i in range(h - 2)])  # powers of two: x / scale is exact
    cache = _poisoned(3, 4, h, d, "fp8", hs)
    slots = torch.tensor([0, 5, 2, 11, 7, 3, 8, 1, 9], dtype=torch.int32)
    with use_backend("triton"):
        kvq_write(x, -x, cache, slots)
    want = (x / hs[:, None]).clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8)
    assert torch.equal(cache.k_codes.reshape(-1, h, d)[slots.long()], want)
    want_v = (-x / hs[:, None]).clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8)
    assert torch.equal(cache.v_codes.reshape(-1, h, d)[slots.long()], want_v)


@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("splits", [1, 2])
def test_decode_fused_dequant_vs_fp64(fmt, splits):
    h, g, d, bs = 2, 3, 24, 4
    ctx = [13, 9, 1]  # sequence 1 shares sequence 0's first two blocks
    cache, bt, cl, *_ = _build(fmt, ctx, h, d, bs, share=2)
    q = torch.randn(len(ctx), h * g, d)
    out = torch.full_like(q, float("nan"))
    with use_backend("triton"):
        out = kvq_decode_attention(q, cache, bt, cl, num_splits=splits, fmt=fmt)
    kd, vd = _dequant_ref(cache)
    ref, _ = reference_attention(q, kd, vd, bt, cl, [1] * len(ctx))
    assert_rel_close(out, ref, 2e-6, f"{fmt} decode")
    # The CPU torch path agrees too.
    assert_rel_close(kvq_decode_attention(q, cache, bt, cl), ref, 2e-6, f"{fmt} decode (torch)")


def test_int8_read_as_words_is_the_same_attention():
    """WORDS8 (a tuning parameter, default on) reads INT8 codes as int32 words: the same codes, the same
    sums, so the output is identical to the byte path's, and right against fp64 (head_dim 24: 6 words)."""
    h, g, d, bs = 2, 3, 24, 4
    ctx = [13, 9, 1]
    cache, bt, cl, *_ = _build("int8", ctx, h, d, bs, share=2)
    q = torch.randn(len(ctx), h * g, d)
    outs = []
    for words in (0, 1):
        with use_backend("triton"), forced_config("paged_attention_int8", {"WORDS8": words}):
            outs.append(kvq_decode_attention(q, cache, bt, cl, num_splits=2))
    assert torch.equal(outs[0], outs[1])
    kd, vd = _dequant_ref(cache)
    ref, _ = reference_attention(q, kd, vd, bt, cl, [1] * len(ctx))
    assert_rel_close(outs[1], ref, 2e-6, "int8 words decode")


@pytest.mark.parametrize("fmt", ["int4", "fp8"])
def test_extend_fused_dequant_vs_fp64(fmt):
    h, g, d, bs = 1, 2, 16, 4
    ctx, ql = [10, 7], [3, 7]
    cache, bt, cl, *_ = _build(fmt, ctx, h, d, bs, share=1)
    q = torch.randn(sum(ql), h * g, d)
    cu = torch.tensor([0, 3, 10], dtype=torch.int32)
    with use_backend("triton"):
        out, lse = kvq_extend_attention(q, cache, bt, cl, cu, return_lse=True, num_splits=1)
    kd, vd = _dequant_ref(cache)
    ref, ref_lse = reference_attention(q, kd, vd, bt, cl, ql)
    assert_rel_close(out, ref, 2e-6, f"{fmt} extend")
    assert_rel_close(lse, ref_lse, 2e-6, f"{fmt} extend lse")


def test_tree_fused_dequant_vs_fp64():
    h, g, d, bs = 2, 2, 16, 4
    parents = [[-1, 0, 0, 1], [-1, 0]]
    prefix = [6, 5]
    tree = build_tree_batch(parents, prefix)
    ctx = tree.context_lens.tolist()
    cache, bt, cl, *_ = _build("int4", ctx, h, d, bs, share=1)
    q = torch.randn(6, h * g, d)
    with use_backend("triton"):
        out = kvq_tree_attention(q, cache, bt, tree, num_splits=1)
    kd, vd = _dequant_ref(cache)
    ref, _ = reference_attention(q, kd, vd, bt, cl, [4, 2], parents=parents)
    assert_rel_close(out, ref, 2e-6, "int4 tree")


def test_quantized_attention_error_orders_with_bits():
    """Against the unquantized fp64 attention (keys with a 6x channel outlier): int8 < 3 %, fp8 < 10 %,
    and fewer bits cost accuracy (int8 < int4 < int2)."""
    h, g, d, bs = 2, 2, 32, 8
    ctx = [40, 23]
    errs = {}
    for fmt in ["int8", "int4", "int2", "fp8"]:
        torch.manual_seed(7)  # the same K/V and q for every format
        cache, bt, cl, kl, vl, slots = _build(fmt, ctx, h, d, bs)
        q = torch.randn(len(ctx), h * g, d)
        k = torch.full((cache.k_codes.shape[0] * bs, h, d), float("nan"), dtype=torch.float64)
        v = k.clone()
        k[slots], v[slots] = kl.double(), vl.double()
        shape = (-1, bs, h, d)
        exact, _ = reference_attention(q, k.view(shape), v.view(shape), bt, cl, [1, 1])
        errs[fmt] = rel_fro_error(kvq_decode_attention(q, cache, bt, cl), exact)
    assert errs["int8"] < 0.03 and errs["fp8"] < 0.1
    assert errs["int8"] < errs["int4"] < errs["int2"]


def test_bad_input():
    cache = QuantPagedKV.empty(4, 4, 2, 16, "int4")
    bt = torch.tensor([[0, 1]], dtype=torch.int32)
    cl = torch.tensor([5], dtype=torch.int32)
    q = torch.randn(1, 2, 16)
    with pytest.raises(CodesignError, match="does not match the kernel"):
        kvq_decode_attention(q, cache, bt, cl, fmt="int8")
    with pytest.raises(CodesignError, match="kv cache format must be one of"):
        QuantPagedKV.empty(4, 4, 2, 16, "int3")
    with pytest.raises(CodesignError, match="multiple of 4"):
        QuantPagedKV.empty(4, 4, 2, 18, "int2")
    with pytest.raises(CodesignError, match="k_head_scale"):
        QuantPagedKV.empty(4, 4, 2, 16, "fp8")
    with pytest.raises(CodesignError, match="float32"):
        QuantPagedKV.empty(
            4, 4, 2, 16, "fp8", k_head_scale=torch.ones(2, dtype=torch.float16), v_head_scale=torch.ones(2)
        )
    bad = QuantPagedKV(
        cache.fmt, 16, cache.k_codes, cache.v_codes, cache.k_meta.float(), cache.v_meta.float()
    )
    with pytest.raises(CodesignError, match="k_meta of a int4 cache must be torch.float16"):
        kvq_decode_attention(q, bad, bt, cl)
    bad = QuantPagedKV(
        cache.fmt, 16, cache.k_codes.view(torch.int8), cache.v_codes, cache.k_meta, cache.v_meta
    )
    with pytest.raises(CodesignError, match="uint8"):
        kvq_decode_attention(q, bad, bt, cl)
    bad = QuantPagedKV("int8", 16, cache.k_codes, cache.v_codes, cache.k_meta, cache.v_meta)
    with pytest.raises(CodesignError, match="need 16 bytes per row"):
        kvq_write(torch.randn(1, 2, 16), torch.randn(1, 2, 16), bad, torch.tensor([0], dtype=torch.int32))
    with pytest.raises(CodesignError, match="key must have shape"):
        kvq_write(torch.randn(1, 2, 8), torch.randn(1, 2, 8), cache, torch.tensor([0], dtype=torch.int32))
    with pytest.raises(CodesignError, match="dtype must be one of"):
        kvq_write(torch.ones(1, 2, 16, dtype=torch.int32), torch.randn(1, 2, 16), cache, torch.tensor([0]))
    with pytest.raises(CodesignError, match="slot_mapping"):
        kvq_write(torch.randn(1, 2, 16), torch.randn(1, 2, 16), cache, torch.tensor([99], dtype=torch.int32))
    with pytest.raises(CodesignError, match="context_lens"):
        kvq_decode_attention(q, cache, bt, torch.tensor([9], dtype=torch.int32))  # past the 2 blocks
    with pytest.raises(CodesignError, match="finite"):
        kvq_write(torch.full((1, 2, 16), float("nan")), torch.randn(1, 2, 16), cache, torch.tensor([0]))


def test_fp8_head_scale_values_are_a_data_check():
    """A non-finite or non-positive fp8 head scale is refused by the data checks (a host sync, on by default) of
    the writer and the attention; with check_data=False their Triton paths read no scale on the host (a CUDA graph
    captures both), and the wrong scale reaches the output, as any unchecked data would."""
    hs = torch.ones(2)
    cache = QuantPagedKV.empty(4, 4, 2, 16, "fp8", k_head_scale=hs, v_head_scale=hs)
    cache.v_meta[1] = 0.0
    k, v, slots = torch.randn(3, 2, 16), torch.randn(3, 2, 16), torch.tensor([0, 1, 2])
    bt, cl, q = torch.tensor([[0]], dtype=torch.int32), torch.tensor([3], dtype=torch.int32), torch.randn(1, 4, 16)
    with pytest.raises(CodesignError, match="fp8 head scales must be finite and > 0"):
        kvq_write(k, v, cache, slots)
    with use_backend("triton"):
        kvq_write(k, v, cache, slots, check_data=False)
        with pytest.raises(CodesignError, match="fp8 head scales must be finite and > 0"):
            kvq_decode_attention(q, cache, bt, cl)
        out = kvq_decode_attention(q, cache, bt, cl, check_data=False)
    assert (out[:, 2:] == 0).all() and (out[:, :2] != 0).any()  # kv head 1's values decoded with its scale 0


def test_fp8_codec_exhaustive():
    """Every e4m3 code decodes (attention over a one-token context returns v) to torch's float8 value, NaN
    codes included; every finite grid value and every midpoint between neighbours encodes like torch."""
    codes = torch.arange(256, dtype=torch.uint8).view(16, 1, 16)
    hs = torch.ones(1)
    cache = QuantPagedKV.empty(16, 1, 1, 16, "fp8", k_head_scale=hs, v_head_scale=hs)
    cache.k_codes.zero_()
    cache.v_codes.copy_(codes.view(16, 1, 1, 16))
    bt = torch.arange(16, dtype=torch.int32).view(16, 1)
    with use_backend("triton"):
        out = kvq_decode_attention(torch.randn(16, 1, 16), cache, bt, torch.ones(16, dtype=torch.int32))
    want = codes.view(torch.float8_e4m3fn).float()
    assert torch.equal(out.isnan(), want.isnan()) and torch.equal(out[~out.isnan()], want[~want.isnan()])
    grid = want.flatten()
    grid = grid[grid.isfinite()].unique()  # sorted, -448 .. 448
    mids = (grid[1:] + grid[:-1]) / 2
    x = torch.cat([grid, mids, torch.zeros(1)])
    x = torch.cat([x, torch.zeros((-x.numel()) % 16)]).view(-1, 1, 16)
    cache = QuantPagedKV.empty(x.shape[0], 1, 1, 16, "fp8", k_head_scale=hs, v_head_scale=hs)
    with use_backend("triton"):
        kvq_write(x, -x, cache, torch.arange(x.shape[0], dtype=torch.int32))
    assert torch.equal(cache.k_codes.view(-1), x.to(torch.float8_e4m3fn).view(torch.uint8).view(-1))
    assert torch.equal(cache.v_codes.view(-1), (-x).to(torch.float8_e4m3fn).view(torch.uint8).view(-1))


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_opcheck(backend):
    """Schemas, fake (meta) implementations and mutation declarations of the quantized-cache ops."""
    from codesign.kernels.attention.quantized import KIVI, KVQ, MIXED, OAKEN
    from codesign.kernels.kvcache.kivi import KiviPagedKV
    from codesign.kernels.kvcache.kvq import kvq_write_op
    from codesign.kernels.kvcache.mixed import MixedPagedKV
    from codesign.kernels.kvcache.oaken import OakenPagedKV

    c = QuantPagedKV.empty(4, 4, 1, 16, "int4")
    key = torch.randn(5, 1, 16)
    slots = torch.tensor([0, 3, 6, 9, 12], dtype=torch.int32)
    bt = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
    cl = torch.tensor([5, 7], dtype=torch.int32)
    cu = torch.tensor([0, 1, 3], dtype=torch.int32)
    q = torch.randn(3, 2, 16)
    with use_backend(backend):
        torch.library.opcheck(
            kvq_write_op, (key, -key, c.k_codes, c.v_codes, c.k_meta, c.v_meta, slots, 1, 4)
        )
        kvq_write(key, -key, c, slots)
        args = (None, None, None, None, 0.25, 0, 0.0, 1, False, True, torch.tensor([0.5, -1.0]))  # sinks too
        torch.library.opcheck(
            KVQ.op, (q, c.k_codes, c.v_codes, c.k_meta, c.v_meta, bt, cl, cu, *args, 1, 4)
        )
        kc = KiviPagedKV.empty(4, 4, 1, 16, 4, 2, 2, 2)
        kc.append(0, bt[0], 0, key, key)
        kc.append(1, bt[1], 0, torch.cat([key, key[:2]]), torch.cat([key, key[:2]]))
        kt = (kc.k_codes, kc.v_codes, kc.k_meta, kc.v_meta, kc.k_res, kc.v_res)
        torch.library.opcheck(KIVI.op, (q, *kt, bt, cl, cu, *args, 4, 2, 2))
        mc = MixedPagedKV.empty(4, 4, 1, 16)
        mc.set_block_bits([0, 1, 2, 3], [8, 4, 2, 4])
        mt = (mc.k_codes, mc.v_codes, mc.k_meta, mc.v_meta, mc.block_bits)
        torch.library.opcheck(MIXED.op, (q, *mt, bt, cl, cu, *args))
        oc = OakenPagedKV.empty(4, 4, 1, 16, 4, torch.tensor([[[-1.0, 1.0]], [[-1.0, 1.0]]]), 2)
        oc.write(key * 2, key * 2, slots)
        ot = (oc.k_codes, oc.v_codes, oc.k_meta, oc.v_meta, oc.k_out, oc.v_out)
        torch.library.opcheck(OAKEN.op, (q, *ot, bt, cl, cu, *args, 4))


def _odd_offset(t: torch.Tensor) -> torch.Tensor:
    """The same values in a buffer one element in: pairs are no longer aligned 4-byte words."""
    buf = torch.empty(t.numel() + 1, dtype=t.dtype)
    out = buf[1:].view(t.shape)
    out.copy_(t)
    return out


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_meta_pairs_not_aligned_as_words_give_the_same_attention(fmt):
    """META32 reads a token's (scale, zero) fp16 pair as one int32 word where `pairs_are_words` says it may;
    metadata at an odd element offset takes the two 2-byte loads instead, with the same sums."""
    from codesign.kernels.attention.triton_attention import pairs_are_words

    h, g, d, bs = 2, 3, 32, 4
    ctx = [13, 9, 1]
    cache, bt, cl, *_ = _build(fmt, ctx, h, d, bs, share=2)
    assert pairs_are_words(cache.k_meta) and not pairs_are_words(cache.k_meta.float())
    odd = QuantPagedKV(**{**vars(cache), "k_meta": _odd_offset(cache.k_meta), "v_meta": _odd_offset(cache.v_meta)})
    assert not pairs_are_words(odd.k_meta) and not pairs_are_words(odd.v_meta)
    q = torch.randn(len(ctx), h * g, d)
    with use_backend("triton"):
        outs = [kvq_decode_attention(q, c, bt, cl, num_splits=2) for c in (cache, odd)]
    assert torch.equal(outs[0], outs[1])
    kd, vd = _dequant_ref(cache)
    ref, _ = reference_attention(q, kd, vd, bt, cl, [1] * len(ctx))
    assert_rel_close(outs[1], ref, 2e-6, f"{fmt} decode, metadata not word-aligned")


def test_kv_align_is_the_strides_common_power_of_two():
    """`kv_align`: 1 where every stride and offset divides by 16 (Triton specializes those) or none by 2; else the
    largest of 4, 2 dividing all (INT2 at head_dim 128: heads 8 words apart -> 4; head_dim 48: 3 words -> 1); a view at
    an odd offset lowers it. The kernel rounds the strides down to it, so a wrong answer would read wrong rows: the
    INT2 attention tests run with it."""
    from codesign.kernels.attention.triton_attention import kv_align

    def words(nb, bs, h, nw):
        return torch.zeros(nb, bs, h, nw, dtype=torch.int32)

    assert kv_align(words(4, 16, 8, 32), words(4, 16, 8, 32)) == 1  # INT8 at 128: every stride a multiple of 16
    assert kv_align(words(4, 16, 8, 8), words(4, 16, 8, 8)) == 4  # INT2 at 128
    assert kv_align(words(4, 16, 2, 3)) == 1  # INT2 at 48: heads 3 words apart
    assert kv_align(words(4, 16, 2, 6)) == 2
    assert kv_align(words(4, 16, 8, 8), words(5, 16, 8, 8)[1:]) == 4  # a view one block in: 1024 words
    assert kv_align(torch.zeros(4 * 16 * 8 * 8 + 2, dtype=torch.int32)[2:].view(4, 16, 8, 8)) == 2  # offset 2


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_writers_without_the_dispatcher_write_the_same_bytes(backend, monkeypatch):
    """`dispatch=False` runs the writer ops' bodies directly (eager callers: the HF cache): the same bytes as
    through the ops, no op called; torch.compile still traces the op (fullgraph: the direct body would break it)."""
    from codesign.kernels.kvcache import kvq as kvq_mod
    from codesign.kernels.kvcache import write as write_mod

    torch.manual_seed(5)
    key, value = torch.randn(5, 2, 16), torch.randn(5, 2, 16)
    slots = torch.tensor([0, 3, -1, 9, 14], dtype=torch.int64)

    def run(dispatch):
        plain = torch.full((4, 4, 2, 16), float("nan")), torch.full((4, 4, 2, 16), float("nan"))
        write_mod.kv_write(key, value, *plain, slots, dispatch=dispatch)
        caches = [QuantPagedKV.empty(4, 4, 2, 16, f) for f in ("int4", "int8")]
        for c in caches:
            kvq_write(key, value, c, slots, dispatch=dispatch)
        return [*plain] + [getattr(c, n) for c in caches for n in ("k_codes", "v_codes", "k_meta", "v_meta")]

    with use_backend(backend):
        ref = run(True)
        calls = []
        for mod, name in ((write_mod, "_kv_write_op"), (kvq_mod, "kvq_write_op")):
            monkeypatch.setattr(mod, name, lambda *a, name=name: calls.append(name))
        got = run(False)
        assert not calls
        for a, b in zip(got, ref):
            assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))  # bytes: NaN where nothing was written
        run(True)
        assert calls == ["_kv_write_op", "kvq_write_op", "kvq_write_op"]
    monkeypatch.undo()
    kc, vc = torch.zeros(4, 4, 2, 16), torch.zeros(4, 4, 2, 16)
    f = torch.compile(lambda k, v, kc, vc, s: write_mod.kv_write(k, v, kc, vc, s, check_data=False, dispatch=False),
                      backend="aot_eager", fullgraph=True)  # fmt: skip
    f(key, value, kc, vc, slots)
    assert torch.equal(kc.view(-1, 2, 16)[slots[slots >= 0]], key[slots >= 0])
