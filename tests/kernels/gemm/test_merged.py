"""Sibling linears as one GEMM (`kernels.gemm.merged`): every format's merged module computes each part's columns
(fp64 on the dequantized weights; the Triton kernels in the interpreter), `split_tensors` gives each part exactly
the tensors it held, and what cannot be one GEMM is refused with the reason."""

from __future__ import annotations

import pytest
import torch
from helpers import assert_rel_close
from torch import nn

from codesign.backend import use_backend
from codesign.kernels.gemm import merged as M
from codesign.kernels.gemm.linear import FP8Config, QuantLinear, W4A16Config, W8A8Config, W8A16Config
from codesign.specs import CodesignError

SIZES = (96, 32, 32)  # q / k / v of a GQA layer: two smaller siblings
CONFIGS = {"w4a16": W4A16Config(32, False), "w4a16-sym": W4A16Config(64), "w8a16": W8A16Config(),
           "w8a16-g": W8A16Config(32), "w8a8": W8A8Config(), "fp8": FP8Config()}  # fmt: skip


def _parts(config, sizes=SIZES, k=128, bias=True, seed=0):
    torch.manual_seed(seed)
    lins = [nn.Linear(k, n, bias=bias) for n in sizes]
    return lins if config is None else [QuantLinear.from_linear(lin, config) for lin in lins]


def _own(module):
    return {n: t for n, t in [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]
            if t is not None}  # fmt: skip


@pytest.mark.parametrize("name", [None, *CONFIGS])
def test_the_merged_gemm_computes_each_parts_columns(name):
    """Torch paths: each part's columns as the part computes them (to fp32 summation order, 1e-6), and the
    weight-only ones against fp64 on the dequantized weights; the parts' tensors back bit for bit."""
    parts = _parts(None if name is None else CONFIGS[name])
    merged = M.merge_linears(parts)
    assert type(merged) is type(parts[0]) and merged.out_features == sum(SIZES)
    x = torch.randn(5, 128)
    with torch.no_grad(), use_backend("torch"):
        got = merged(x).split(SIZES, -1)
        for part, y in zip(parts, got):
            assert_rel_close(y, part(x), 1e-6)
            if name is None or not part.act_quant:
                w = part.weight if name is None else part.quantized_weight().dequantize(torch.float64)
                ref = x.double() @ w.double().t() + part.bias.double()
                assert_rel_close(y, ref, 1e-5)
    for part, tensors in zip(parts, M.split_tensors(merged, SIZES)):
        own = _own(part)
        assert set(tensors) == set(own)
        for n, t in tensors.items():
            assert t.dtype == own[n].dtype and t.is_contiguous() and torch.equal(t, own[n]), n


@pytest.mark.parametrize("name", ["w4a16", "w8a8"])
def test_the_merged_gemm_through_the_triton_kernels(name):
    """The Triton kernels (interpreter) at decode's M = 1 and a prefill's M = 7, into each part's columns."""
    parts = _parts(CONFIGS[name], k=64)
    merged = M.merge_linears(parts)
    for m in (1, 7):
        x = torch.randn(m, 64)
        with torch.no_grad(), use_backend("triton"):
            got = merged(x).split(SIZES, -1)
            for part, y in zip(parts, got):
                assert_rel_close(y, part(x), 1e-5)


def test_a_per_tensor_scale_is_shared_where_equal():
    """FP8 per tensor: one scale for the merged GEMM, so parts that share it merge and parts that do not are
    refused."""
    lins = _parts(None)
    parts = [QuantLinear.from_linear(lin, FP8Config(per_tensor=True)) for lin in lins]
    assert "scales: one tensor for the merged GEMM, but not equal" in M.why_not(parts)
    for p in parts[1:]:
        p.scales.copy_(parts[0].scales)
    merged = M.merge_linears(parts)
    assert merged.scales.shape == (1, 1)
    assert all(torch.equal(t["scales"], parts[0].scales) for t in M.split_tensors(merged, SIZES))


def test_what_cannot_be_one_gemm_is_refused():
    w4 = _parts(CONFIGS["w4a16"])
    cases = {
        "two or more": w4[:1],
        "not all nn.Linear or all QuantLinear": [w4[0], nn.Linear(128, 32)],
        "dtype_name": [w4[0], _parts(CONFIGS["w8a16"])[1]],
        "group_size": [w4[0], _parts(W4A16Config(64, False))[1]],
        "a bias or zero points on some only": [w4[0], _parts(CONFIGS["w4a16"], bias=False)[1]],
        "in_features": [nn.Linear(128, 8), nn.Linear(64, 8)],
        "more than one dtype": [nn.Linear(64, 8), nn.Linear(64, 8).double()],
        "meta device": [nn.Linear(64, 8), nn.Linear(64, 8, device="meta")],
    }
    sub = type("MyLinear", (nn.Linear,), {})
    cases["MyLinear"] = [nn.Linear(64, 8), sub(64, 8)]
    perm = _parts(CONFIGS["w4a16"])
    perm[0].perm, perm[1].perm = torch.randperm(128), torch.randperm(128)
    perm[2].perm = perm[1].perm
    cases["perm: one tensor for the merged GEMM, but not equal"] = perm
    for why, parts in cases.items():
        assert why in M.why_not(parts), (why, M.why_not(parts))
        with pytest.raises(CodesignError, match="cannot merge these linears"):
            M.merge_linears(parts)
    with pytest.raises(CodesignError, match="sizes"):
        M.split_tensors(M.merge_linears(w4), [96, 32])


def test_a_shared_input_permutation_is_kept():
    """GPTQ's act order permutes the input once for q / k / v: equal perms merge and the merged GEMM applies it."""
    parts = _parts(CONFIGS["w4a16"])
    perm = torch.randperm(128)
    for p in parts:
        p.perm = perm.clone()
    merged = M.merge_linears(parts)
    x = torch.randn(3, 128)
    with torch.no_grad():
        for part, y in zip(parts, merged(x).split(SIZES, -1)):
            assert_rel_close(y, part(x), 1e-6)


def test_teeth_a_wrong_axis_is_caught():
    """A mutation of the layout rule (int32 codes stacked along K) fails the part round trip."""
    parts = _parts(CONFIGS["w4a16"], sizes=(32, 32, 32), k=768)  # (codes [96, 96]: both axes split)
    merged = M.merge_linears(parts)
    original = M.n_axis
    try:
        M.n_axis = lambda module, name, t: 0 if name == "qweight" else original(module, name, t)
        back = M.split_tensors(merged, (32, 32, 32))
    finally:
        M.n_axis = original
    assert not all(torch.equal(b["qweight"], p.qweight) for b, p in zip(back, parts))
