"""`codesign.kernels.triton_codes` in the interpreter: every code below 1024 becomes its exact fp16 value,
the power-of-two scales are exact and land where they say, and the join-tree unpack returns each word's
codes in order at 2, 4 and 8 bits (random words, sign bits set), the paired fp16 unpack returns them
exactly in its stated column order at 2, 4 and 8 bits, the mixed chunks' unpack (`chunk_words_f16`: fp16 subnormals
scaled up, byte permutes) returns c / CODE_UNITS exactly in its one column order at 2, 4 and 8 bits, and `prmt`
picks PTX's bytes."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from codesign.backend import use_backend
from codesign.kernels.triton_codes import (
    CODE_UNITS,
    chunk_words_f16,
    codes_f16,
    pair_order,
    pow2_scale,
    prmt,
    unpack_words,
    words_f16,
)


@triton.jit
def _probe(code_ptr, out16_ptr, amax_ptr, f_ptr, inv_ptr, N: tl.constexpr, M: tl.constexpr):
    i = tl.arange(0, N)
    tl.store(out16_ptr + i, codes_f16(tl.load(code_ptr + i)))
    j = tl.arange(0, M)
    f, inv = pow2_scale(tl.load(amax_ptr + j), 14)
    tl.store(f_ptr + j, f)
    tl.store(inv_ptr + j, inv)


def test_codes_f16_exact_and_pow2_scale_exact():
    codes = torch.arange(1024, dtype=torch.int32)
    out16 = torch.full((1024,), float("nan"), dtype=torch.float16)
    amax = torch.tensor([0.0, 1.0, 1.5, 3.0e-40, 6.0e4, 1.0e6, 3.0e38, 2.0**-20, 0.7, 2.0**14, 1e-30, 123.0, 5.0,
                         2.0**15 - 1, 1e-45, 17.0])  # fmt: skip
    f = torch.full_like(amax, float("nan"))
    inv = torch.full_like(amax, float("nan"))
    with use_backend("triton"):
        _probe[(1,)](codes, out16, amax, f, inv, N=1024, M=16)
    assert torch.equal(out16.float(), codes.float())  # every code below 1024, exactly
    assert torch.equal(f * inv, torch.ones_like(f))  # exact reciprocals
    assert torch.equal(torch.frexp(f).mantissa, torch.full_like(f, 0.5))  # powers of two
    normal = (amax >= 2.0**-112) & (amax <= 2.0**140)  # where no clamp applies
    assert ((amax * f >= 2.0**14) & (amax * f < 2.0**15))[normal].all()
    assert f[0] == 2.0**126 and (amax * f)[~normal].max() < 2.0**15  # zero and tiny rows: clamped, finite


@triton.jit
def _unpack_probe(w_ptr, out_ptr, R: tl.constexpr, NW: tl.constexpr, BITS: tl.constexpr):
    r = tl.arange(0, R)
    w = tl.arange(0, NW)
    words = tl.load(w_ptr + r[:, None] * NW + w[None, :])
    codes = tl.reshape(unpack_words(words, BITS), (R, NW * (32 // BITS)))
    c = tl.arange(0, NW * (32 // BITS))
    tl.store(out_ptr + r[:, None] * (NW * (32 // BITS)) + c[None, :], codes)


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_unpack_words_in_order(bits):
    per = 32 // bits
    words = torch.randint(-(2**31), 2**31 - 1, (4, 8), dtype=torch.int64).to(torch.int32)
    out = torch.full((4, 8 * per), -1, dtype=torch.int32)
    with use_backend("triton"):
        _unpack_probe[(1,)](words, out, R=4, NW=8, BITS=bits)
    u = words.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    shifts = torch.arange(per) * bits
    want = ((u[:, :, None] >> shifts) & (2**bits - 1)).reshape(4, 8 * per).to(torch.int32)
    assert torch.equal(out, want)


@triton.jit
def _pairs_probe(w_ptr, out_ptr, order_ptr, R: tl.constexpr, NW: tl.constexpr, BITS: tl.constexpr):
    r = tl.arange(0, R)
    w = tl.arange(0, NW)
    words = tl.load(w_ptr + r[:, None] * NW + w[None, :])
    x = tl.reshape(words_f16(words, BITS), (R, NW * (32 // BITS)))
    c = tl.arange(0, NW * (32 // BITS))
    tl.store(out_ptr + r[:, None] * (NW * (32 // BITS)) + c[None, :], x)
    tl.store(order_ptr + c, pair_order(c, BITS))


def _run_unpack_probe(probe, bits: int):
    """(fp16 out [4, 8 P] NaN-poisoned, column order, the codes in element order [4, 8 P]) of a probe unpacking 4 x 8
    random words (row 0 all ones: every code at its largest, sign bits set; row 1 zeros), P = 32 / bits."""
    per = 32 // bits
    words = torch.randint(-(2**31), 2**31 - 1, (4, 8), dtype=torch.int64).to(torch.int32)
    words[0] = -1
    words[1] = 0
    out = torch.full((4, 8 * per), float("nan"), dtype=torch.float16)
    order = torch.full((8 * per,), -1, dtype=torch.int32)
    with use_backend("triton"):
        probe[(1,)](words, out, order, R=4, NW=8, BITS=bits)
    u = words.to(torch.int64) & 0xFFFFFFFF
    return out, order, ((u[:, :, None] >> (torch.arange(per) * bits)) & (2**bits - 1)).reshape(4, 8 * per)


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_words_f16_exact_in_pair_order(bits):
    per = 32 // bits
    out, order, codes = _run_unpack_probe(_pairs_probe, bits)
    assert sorted(order.tolist()) == list(range(8 * per))  # a permutation inside each word
    assert torch.equal(order.view(8, per) // per, torch.arange(8)[:, None].expand(8, per).to(torch.int32))
    assert torch.equal(out.double(), codes[:, order.long()].double())


@triton.jit
def _chunk_probe(w_ptr, out_ptr, order_ptr, R: tl.constexpr, NW: tl.constexpr, BITS: tl.constexpr):
    r = tl.arange(0, R)
    w = tl.arange(0, NW)
    words = tl.load(w_ptr + r[:, None] * NW + w[None, :])
    x = chunk_words_f16(words, BITS, True)
    c = tl.arange(0, NW * (32 // BITS))
    tl.store(out_ptr + r[:, None] * (NW * (32 // BITS)) + c[None, :], x)
    tl.store(order_ptr + c, pair_order(c, 2))


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_chunk_words_f16_exact_in_chunk_order(bits):
    """Every code c of every width as c / CODE_UNITS exactly (fp16 subnormals brought up by powers of two), in the
    16-element chunks' order that q and the output follow (column 2 i + half: element i + 8 half of its chunk)."""
    per = 32 // bits
    out, order, codes = _run_unpack_probe(_chunk_probe, bits)
    chunks = 8 * per // 16
    assert sorted(order.tolist()) == list(range(8 * per))
    chunk_of = torch.arange(chunks, dtype=torch.int32)[:, None].expand(chunks, 16)
    assert torch.equal(order.view(chunks, 16) // 16, chunk_of)  # a permutation inside each chunk
    assert torch.equal(out.double() * CODE_UNITS, codes[:, order.long()].double())


@triton.jit
def _prmt_probe(a_ptr, b_ptr, out_ptr, N: tl.constexpr):
    i = tl.arange(0, N)
    a = tl.load(a_ptr + i)
    b = tl.load(b_ptr + i)
    tl.store(out_ptr + i, prmt(a, b, 0x5410, True))
    tl.store(out_ptr + N + i, prmt(a, b, 0x7632, True))
    tl.store(out_ptr + 2 * N + i, prmt(a, a & 0, 0x4341, True))
    tl.store(out_ptr + 3 * N + i, prmt(a, b, 0x0746, True))


def test_prmt_picks_ptx_bytes():
    """The interpreted `prmt` (the compiled one is PTX's `prmt.b32`) against its definition: byte n of the result is
    byte SEL[4n + 2 : 4n] of b:a (a's bytes 0-3, b's 4-7)."""
    n = 64
    a = torch.randint(-(2**31), 2**31 - 1, (n,), dtype=torch.int64).to(torch.int32)
    b = torch.randint(-(2**31), 2**31 - 1, (n,), dtype=torch.int64).to(torch.int32)
    out = torch.zeros(4 * n, dtype=torch.int32)
    with use_backend("triton"):
        _prmt_probe[(1,)](a, b, out, N=n)
    ba = [((a.to(torch.int64) & 0xFFFFFFFF) >> (8 * k)) & 0xFF for k in range(4)]
    ba += [((b.to(torch.int64) & 0xFFFFFFFF) >> (8 * k)) & 0xFF for k in range(4)]
    zero = [ba[k] for k in range(4)] + [torch.zeros_like(ba[0])] * 4
    for row, (sel, src) in enumerate(((0x5410, ba), (0x7632, ba), (0x4341, zero), (0x0746, ba))):
        want = sum(src[(sel >> (4 * k)) & 7] << (8 * k) for k in range(4))
        assert torch.equal(out[row * n : (row + 1) * n].to(torch.int64) & 0xFFFFFFFF, want), hex(sel)
