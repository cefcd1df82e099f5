"""GPTQ and AWQ importers: checkpoints built and dequantized here straight from each format's definition.

The packers and dequantizers below are written element by element from the layouts AutoGPTQ and
AutoAWQ document (GPTQ: qweight packed along K, qzeros along N, stored zero = zero - 1 in v1,
g_idx per input channel; AWQ: both packed along N with nibble j holding column 8i + [0,2,4,6,1,3,5,7][j]),
independently of the importer's vectorized unpacking.
"""

from __future__ import annotations

import pytest
import torch
from helpers import assert_rel_close

from codesign.backend import use_backend
from codesign.kernels.gemm import checkpoints as qi
from codesign.kernels.gemm import ops as qg
from codesign.specs import CodesignError

ORDER = [0, 2, 4, 6, 1, 3, 5, 7]


def _to_int32(words: torch.Tensor) -> torch.Tensor:
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def _pack_gptq(codes, stored_zeros, bits):
    """codes [K, N], stored_zeros [G, N] (already minus the v1 offset, masked) -> qweight, qzeros."""
    p = 32 // bits
    k, n = codes.shape
    qweight = torch.zeros(k // p, n, dtype=torch.int64)
    for j in range(p):
        qweight |= codes[j::p, :].to(torch.int64) << (bits * j)
    qzeros = torch.zeros(stored_zeros.shape[0], n // p, dtype=torch.int64)
    for j in range(p):
        qzeros |= stored_zeros[:, j::p].to(torch.int64) << (bits * j)
    return _to_int32(qweight), _to_int32(qzeros)


def _dequant_gptq_reference(qweight, qzeros, scales, g_idx, bits, zero_offset):
    p, mask = 32 // bits, (1 << bits) - 1
    k, n = qweight.shape[0] * p, qweight.shape[1]
    u = qweight.to(torch.int64) & 0xFFFFFFFF
    uz = qzeros.to(torch.int64) & 0xFFFFFFFF
    w = torch.empty(n, k, dtype=torch.float64)
    zeros = torch.empty(scales.shape, dtype=torch.float64)
    for col in range(n):
        zeros[:, col] = ((uz[:, col // p] >> (bits * (col % p))) & mask) + zero_offset
    for row in range(k):
        q = (u[row // p, :] >> (bits * (row % p))) & mask
        g = int(g_idx[row])
        w[:, row] = scales[g].double() * (q.double() - zeros[g])
    return w


def _pack_awq(codes, zeros):
    k, n = codes.shape
    qweight = torch.zeros(k, n // 8, dtype=torch.int64)
    qzeros = torch.zeros(zeros.shape[0], n // 8, dtype=torch.int64)
    for j in range(8):
        qweight |= codes[:, ORDER[j] :: 8].to(torch.int64) << (4 * j)
        qzeros |= zeros[:, ORDER[j] :: 8].to(torch.int64) << (4 * j)
    return _to_int32(qweight), _to_int32(qzeros)


def _dequant_awq_reference(qweight, qzeros, scales, group):
    u = qweight.to(torch.int64) & 0xFFFFFFFF
    uz = qzeros.to(torch.int64) & 0xFFFFFFFF
    k, n = qweight.shape[0], qweight.shape[1] * 8
    w = torch.empty(n, k, dtype=torch.float64)
    for col in range(n):
        j = ORDER.index(col % 8)  # the nibble that holds this column
        q = (u[:, col // 8] >> (4 * j)) & 15
        z = (uz[:, col // 8] >> (4 * j)) & 15
        w[col, :] = (
            scales[:, col].double().repeat_interleave(group) * (q - z.repeat_interleave(group)).double()
        )
    return w


def _gptq_case(bits, k, n, group, act_order):
    g = k if group == -1 else group
    codes = torch.randint(0, 1 << bits, (k, n))
    stored = torch.randint(0, 1 << bits, (k // g, n))
    scales = (torch.rand(k // g, n) * 0.02 + 0.001).to(torch.float16)
    if act_order:  # GPTQ's act-order: channel perm[t] is quantized t-th, in group t // g
        order = torch.randperm(k)
        g_idx = torch.empty(k, dtype=torch.int32)
        g_idx[order] = (torch.arange(k) // g).to(torch.int32)
    else:
        g_idx = (torch.arange(k) // g).to(torch.int32)
    qweight, qzeros = _pack_gptq(codes, stored, bits)
    return qweight, qzeros, scales, g_idx


@pytest.mark.parametrize(
    "bits, group, act_order, zero_offset",
    [(4, 128, False, 1), (4, 32, True, 1), (8, -1, False, 0), (8, 64, True, 0), (4, 64, False, 0)],
)
def test_gptq_import_dequantizes_exactly(bits, group, act_order, zero_offset):
    k, n = 256, 40
    qweight, qzeros, scales, g_idx = _gptq_case(bits, k, n, group, act_order)
    w = qi.from_gptq(qweight, qzeros, scales, g_idx, bits, group, zero_offset)
    want = _dequant_gptq_reference(qweight, qzeros, scales, g_idx, bits, zero_offset)
    assert torch.equal(w.dequantize(torch.float64), want)
    assert (w.perm is not None) == act_order
    assert w.group_size == (None if group == -1 else group)


def test_gptq_symmetric_checkpoint_imports_without_zeros():
    k, n = 128, 16
    qweight, _, scales, g_idx = _gptq_case(4, k, n, 32, False)
    _, qzeros = _pack_gptq(torch.zeros(k, n, dtype=torch.int64), torch.full((4, n), 7), 4)  # v1: 8 - 1
    w = qi.from_gptq(qweight, qzeros, scales, g_idx, 4, 32)
    assert w.zeros is None
    assert torch.equal(
        w.dequantize(torch.float64), _dequant_gptq_reference(qweight, qzeros, scales, g_idx, 4, 1)
    )


@pytest.mark.parametrize("m", [1, 19])
def test_gptq_act_order_gemm_through_the_kernel(m):
    k, n = 256, 48
    qweight, qzeros, scales, g_idx = _gptq_case(4, k, n, 64, True)
    w = qi.from_gptq(qweight, qzeros, scales, g_idx, 4, 64)
    x = torch.randn(m, k)
    want = x.double() @ _dequant_gptq_reference(qweight, qzeros, scales, g_idx, 4, 1).t()
    with use_backend("triton"):
        assert_rel_close(qg.quant_matmul(x, w), want, 1e-5)


@pytest.mark.parametrize("group", [64, 128, -1])
def test_awq_import_dequantizes_exactly(group):
    k, n = 256, 48
    g = k if group == -1 else group
    codes = torch.randint(0, 16, (k, n))
    zeros = torch.randint(0, 16, (k // g, n))
    scales = (torch.rand(k // g, n) * 0.02 + 0.001).to(torch.float16)
    qweight, qzeros = _pack_awq(codes, zeros)
    w = qi.from_awq(qweight, qzeros, scales, group)
    want = _dequant_awq_reference(qweight, qzeros, scales, g)
    assert torch.equal(w.dequantize(torch.float64), want)
    x = torch.randn(3, k).to(torch.float16)
    with use_backend("triton"):
        assert_rel_close(qg.quant_matmul(x, w), x.double() @ want.t(), 2e-3)


def test_awq_nibble_order_is_interleaved():
    # Column c in 0..7 holds code c: AWQ puts column ORDER[j] in nibble j -> nibbles 0,2,4,6,1,3,5,7.
    qweight, _ = _pack_awq(torch.arange(8).view(1, 8), torch.zeros(1, 8, dtype=torch.int64))
    assert qweight.item() == 0x75316420
    w = qi.from_awq(
        qweight.expand(32, 1).contiguous(),
        torch.zeros(1, 1, dtype=torch.int32),
        torch.ones(1, 8, dtype=torch.float16),
        32,
    )
    assert torch.equal(w.dequantize()[:, 0], torch.arange(8, dtype=torch.float32))


def test_importers_refuse_bad_checkpoints():
    qweight, qzeros, scales, g_idx = _gptq_case(4, 128, 16, 32, False)
    with pytest.raises(CodesignError, match="bits"):
        qi.from_gptq(qweight, qzeros, scales, g_idx, bits=3, group_size=32)
    with pytest.raises(CodesignError, match="groups"):
        qi.from_gptq(qweight, qzeros, scales, g_idx, 4, 64)
    with pytest.raises(CodesignError, match="qzeros must have shape"):
        qi.from_gptq(qweight, qzeros[:, :1], scales, g_idx, 4, 32)
    bad = g_idx.clone()
    bad[0] = 1  # group 0 gets 31 channels, group 1 gets 33
    with pytest.raises(CodesignError, match="exactly group_size"):
        qi.from_gptq(qweight, qzeros, scales, bad, 4, 32)
    with pytest.raises(CodesignError, match="g_idx values"):
        qi.from_gptq(qweight, qzeros, scales, g_idx + 10, 4, 32)
    with pytest.raises(CodesignError, match="int32"):
        qi.from_awq(qweight.to(torch.int64), qzeros, scales, 32)
    with pytest.raises(CodesignError, match="qweight must have shape"):
        qi.from_awq(torch.zeros(128, 3, dtype=torch.int32), torch.zeros(4, 2, dtype=torch.int32), scales, 32)
