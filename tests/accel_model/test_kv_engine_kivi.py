"""KV quant engine, KIVI mode (`accel_model.kv_quant_engine`): the functional quantizer against the
kernels' KIVI reference (`kernels.kvcache.quantizers.quantize_asym` on KIVI's groups, the paged writer
`KiviPagedKV.append`, and `kivi_fake_quant`) bit for bit on random data with channel outliers, and
`kvq_cost`'s KIVI formula on hand-computed cases and against a step-by-step two-pass pipeline."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from codesign.accel_model.kv_quant_engine import (
    KVQuantEngineSpec,
    dequantize_kivi_keys,
    dequantize_kivi_values,
    kivi_split,
    kvq_cost,
    pack_codes,
    quantize_kivi_keys,
    quantize_kivi_values,
)
from codesign.backend import use_backend
from codesign.kernels.kvcache import quantizers as kvq
from codesign.kernels.kvcache.kivi import KiviPagedKV
from codesign.specs import CodesignError, KVDequantize, KVFormat, KVWrite


def _kv_with_outlier_channels(t: int, h: int, d: int) -> torch.Tensor:
    """fp16-representable K/V [t, h, d] with a few channels 10-40x larger (KIVI's reason for per-channel keys)."""
    x = torch.randn(t, h, d)
    outliers = torch.randperm(d)[: max(1, d // 8)]
    x[:, :, outliers] *= torch.empty(len(outliers)).uniform_(10, 40)
    x[:, :, outliers[0]] += 25.0  # one channel also far off zero
    return x.half().float()


@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize(
    ("t", "h", "d", "group", "residual"), [(13, 2, 16, 4, 3), (40, 3, 24, 8, 0), (37, 1, 8, 16, 2)]
)
def test_kivi_codes_equal_kernel_reference(bits, t, h, d, group, residual):
    """Codes, scales and zeros equal the kernel reference's quantize_asym over KIVI's groups (keys: dim 1
    of [groups, G, h, d]; values: the last axis of [T, h, d / GV, GV]) on the kivi_split tokens."""
    k, v = _kv_with_outlier_channels(t, h, d), _kv_with_outlier_channels(t, h, d)
    nq = kivi_split(t, group, residual)
    assert nq == kvq.kivi_split(t, group, residual)
    assert nq > 0
    codes, scale, zero = quantize_kivi_keys(k[:nq].numpy(), bits, group)
    rc, rs, rz = kvq.quantize_asym(k[:nq].reshape(nq // group, group, h, d), bits, dim=1)
    np.testing.assert_array_equal(codes, rc.reshape(nq, h, d).numpy())
    np.testing.assert_array_equal(scale, rs.numpy())
    np.testing.assert_array_equal(zero, rz.numpy())
    gv = min(group, d)
    codes, scale, zero = quantize_kivi_values(v[:nq].numpy(), bits, group)
    rc, rs, rz = kvq.quantize_asym(v[:nq].reshape(nq, h, d // gv, gv), bits, dim=-1)
    np.testing.assert_array_equal(codes, rc.reshape(nq, h, d).numpy())
    np.testing.assert_array_equal(scale, rs.numpy())
    np.testing.assert_array_equal(zero, rz.numpy())
    # Per-channel keys really differ from per-token ones on this data (the test would catch a swap).
    per_token = kvq.quantize_asym(k[:nq], bits, dim=-1)[0].numpy()
    assert (quantize_kivi_keys(k[:nq].numpy(), bits, group)[0] != per_token).any()


@pytest.mark.parametrize("bits", [2, 4])
def test_kivi_codes_equal_paged_writer_and_fake_quant(bits):
    """What the paged writer stores (unpacked codes, fp16 metadata) equals the engine's codes / scale /
    zero, appended in odd chunks; the engine's dequantized K/V equal kivi_fake_quant exactly."""
    g, r, bs, h, d, t = 4, 3, 8, 2, 16, 23
    k, v = _kv_with_outlier_channels(t, h, d), _kv_with_outlier_channels(t, h, d)
    cache = KiviPagedKV.empty(4, bs, h, d, bits, g, r, 1)
    cache.k_meta.fill_(float("nan"))  # poison: every quantized slot must be written
    cache.v_meta.fill_(float("nan"))
    row = torch.tensor([2, 0, 3, 1], dtype=torch.int32)
    with use_backend("torch"):
        for start, n in ((0, 5), (5, 1), (6, 11), (17, 6)):
            cache.append(0, row, start, k[start : start + n], v[start : start + n])
    nq = kivi_split(t, g, r)
    assert nq == 20
    tok = torch.arange(nq)
    blk, off = row.long()[tok // bs], tok % bs
    kc, ks, kz = quantize_kivi_keys(k[:nq].numpy(), bits, g)
    np.testing.assert_array_equal(kvq.unpack_codes(cache.k_codes[blk, off], bits).numpy(), kc)
    np.testing.assert_array_equal(pack_codes(kc, bits), cache.k_codes[blk, off].numpy())  # stored bytes
    km = cache.k_meta[row.long()[(tok[::g]) // bs], (tok[::g] % bs) // g].float().numpy()  # [groups, h, d, 2]
    np.testing.assert_array_equal(km[..., 0], ks)
    np.testing.assert_array_equal(km[..., 1], kz)
    vc, vs, vz = quantize_kivi_values(v[:nq].numpy(), bits, g)
    np.testing.assert_array_equal(kvq.unpack_codes(cache.v_codes[blk, off], bits).numpy(), vc)
    np.testing.assert_array_equal(pack_codes(vc, bits), cache.v_codes[blk, off].numpy())
    vm = cache.v_meta[blk, off].float().numpy()  # [nq, h, d / GV, 2]
    np.testing.assert_array_equal(vm[..., 0], vs)
    np.testing.assert_array_equal(vm[..., 1], vz)
    fk, fv = kvq.kivi_fake_quant(k, v, bits, g, r)
    np.testing.assert_array_equal(dequantize_kivi_keys(kc, ks, kz), fk[:nq].numpy())
    np.testing.assert_array_equal(dequantize_kivi_values(vc, vs, vz), fv[:nq].numpy())


def test_kivi_constant_channel_and_bad_input():
    """A constant channel over a group gets scale 0, codes 0 and dequantizes to its value; bad input is
    refused with the argument named."""
    k = np.random.randn(8, 1, 4).astype(np.float32)
    k[:4, 0, 2] = 1.5
    codes, scale, zero = quantize_kivi_keys(k, 4, 4)
    assert scale[0, 0, 2] == 0 and zero[0, 0, 2] == 1.5 and (codes[:4, 0, 2] == 0).all()
    assert (dequantize_kivi_keys(codes, scale, zero)[:4, 0, 2] == 1.5).all()
    with pytest.raises(CodesignError, match="multiple of the group"):
        quantize_kivi_keys(k[:6], 4, 4)
    with pytest.raises(CodesignError, match="finite"):
        quantize_kivi_values(np.full((2, 1, 4), np.nan), 4, 4)
    with pytest.raises(CodesignError, match="value group"):
        quantize_kivi_values(np.ones((2, 1, 6)), 4, 4)
    with pytest.raises(CodesignError, match="bits"):
        quantize_kivi_keys(k, 3, 4)
    with pytest.raises(CodesignError, match="group"):
        quantize_kivi_keys(k, 4, 0)
    with pytest.raises(CodesignError, match="tokens"):
        quantize_kivi_values(np.ones(4), 4, 4)
    with pytest.raises(CodesignError, match="residual"):
        kivi_split(5, 4, -1)
    assert [kivi_split(n, 4, 3) for n in (0, 6, 7, 10, 11)] == [0, 0, 4, 4, 8]


def _kivi(group: int) -> KVFormat:
    return KVFormat(dtype="int4", scheme="kivi", group_size=group, residual=8)


def test_kvq_cost_kivi_hand_checked():
    """cycles = ceil(2 tokens kv_heads / count) x beats + G x beats + depth (module docstring)."""
    eng = KVQuantEngineSpec(lanes=16, depth=6, count=1)
    # 7 tokens x 3 heads x (K, V) = 42 vectors, beats = 128 / 16 = 8, G = 32: 42 x 8 + 32 x 8 + 6 = 598
    # (per-token int4: 42 x 8 + 8 + 6 = 350, unchanged).
    assert kvq_cost(eng, KVWrite(7, 3, 128, _kivi(32))).cycles == 598
    assert kvq_cost(eng, KVWrite(7, 3, 128, KVFormat.parse("int4"))).cycles == 350
    # One decode token, one head, head_dim 100 on 16 lanes: beats = 7; G = 4: 2 x 7 + 4 x 7 + 6 = 48.
    assert kvq_cost(eng, KVWrite(1, 1, 100, _kivi(4))).cycles == 48
    # 3 engines: ceil(42 / 3) = 14 vectors each: 14 x 8 + 32 x 8 + 6 = 374.
    three = KVQuantEngineSpec(lanes=16, depth=6, count=3)
    assert kvq_cost(three, KVWrite(7, 3, 128, _kivi(32))).cycles == 374
    # Dequantize is one pass whatever the scheme: 42 x 8 + 6 = 342; nothing written costs nothing.
    assert kvq_cost(eng, KVDequantize(7, 3, 128, _kivi(32))).cycles == 342
    assert kvq_cost(eng, KVWrite(0, 3, 128, _kivi(32))).cycles == 0


def _two_pass_end(groups: int, g: int, beats: int) -> int:
    """Step the engine's two passes for `groups` back-to-back flushes of one head (count = 1, no depth).

    Pass 1 takes K_0..K_{G-1} then V_0..V_{G-1} of each group in order; pass 2 quantizes a group's keys
    once its last key left pass 1, a value once it left pass 1, in arrival order; each item `beats`.
    """
    ready, t1 = [], 0
    for _ in range(groups):
        keys_done = t1 + g * beats
        ready += [keys_done] * g  # the group's keys wait for the G-th key's min/max
        ready += [keys_done + (i + 1) * beats for i in range(g)]
        t1 = keys_done + g * beats
    t2 = 0
    for r in ready:
        t2 = max(t2, r) + beats
    return t2


@pytest.mark.parametrize(("groups", "g", "beats"), [(1, 2, 1), (2, 2, 1), (3, 4, 3), (5, 8, 2), (1, 1, 5)])
def test_kvq_cost_kivi_equals_two_pass_pipeline(groups, g, beats):
    """For whole groups on one engine the formula equals stepping the two passes item by item."""
    eng = KVQuantEngineSpec(lanes=4, depth=3, count=1)
    spec = KVWrite(groups * g, 1, 4 * beats, _kivi(g))
    assert kvq_cost(eng, spec).cycles == _two_pass_end(groups, g, beats) + 3
