"""W8A8's two weight layouts: signed int8 codes [K, N] (K contiguous, as `QuantLinear` keeps them; or row-major) and
the native int32 words [K/4, N]. Every variant (two launches, the fused quantizer, TMA, torch's `_int_mm` path) gives
the same output bit for bit from either layout (int32 sums are exact; the same epilogue), within the output's
rounding of fp64, into NaN-poisoned outputs; K not a multiple of 4 runs from signed codes; the conversion both ways
is exact; `QuantLinear` keeps one int8 [N, K] buffer, loads a state dict saved with packed words, and gives back the
packed `QuantizedWeight`; bad layouts are refused by name."""

from __future__ import annotations

import pytest
import torch
from helpers import assert_rel_close
from test_gemm_fusedq import _run as run_w8a8

from codesign.backend import use_backend
from codesign.kernels.gemm import formats as qf
from codesign.kernels.gemm import ops as qg
from codesign.kernels.gemm.linear import QuantLinear, W8A8Config
from codesign.specs import CodesignError

CFG = {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 32, "GROUP_M": 2, "SPLIT_K": 1, "num_warps": 4, "num_stages": 1}
BOUND = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}  # the output's rounding


def _run(variant: str, x, w, w_s, bias) -> torch.Tensor:
    return run_w8a8(variant, x, w, w_s, bias, False, CFG)


def _ref(x, codes_kn, w_s, bias) -> torch.Tensor:
    aq, a_s = qf.quantize_per_token(x, "int8")
    ref = (aq.double() @ codes_kn.double()) * a_s.double()[:, None] * w_s.double()
    return ref if bias is None else ref + bias.double()


def test_the_codes_convert_both_ways_exactly():
    qw = qf.quantize_rtn(torch.randn(40, 96), "int8", None, True, torch.float32)
    nk = qf.int8_codes_nk(qw.qweight)
    assert nk.dtype == torch.int8 and nk.shape == (40, 96) and nk.is_contiguous()
    assert torch.equal(nk.t().long(), qf.unpack_codes(qw.qweight, 8) - 128)
    assert torch.equal(qf.pack_int8_codes(nk.t()), qw.qweight)
    with pytest.raises(CodesignError, match="int32"):
        qf.int8_codes_nk(nk)
    with pytest.raises(CodesignError, match="int8"):
        qf.pack_int8_codes(qw.qweight)


@pytest.mark.parametrize("variant", ["triton", "fusedq", "tma", "torch"])
@pytest.mark.parametrize(("m", "n", "k", "dtype", "bias"), [
    (5, 48, 64, torch.float16, True), (33, 72, 128, torch.float32, False), (1, 40, 96, torch.bfloat16, True),
])  # fmt: skip
def test_every_variant_gives_the_same_bits_from_either_layout(variant, m, n, k, dtype, bias):
    qw = qf.quantize_rtn(torch.randn(n, k), "int8", None, True, torch.float32)
    x = (torch.randn(m, k) * torch.logspace(-2, 2, m)[:, None]).to(dtype)
    b = torch.randn(n).to(dtype) if bias else None
    nk = qf.int8_codes_nk(qw.qweight)
    packed = _run(variant, x, qw.qweight, qw.scales, b)
    k_contig = _run(variant, x, nk.t(), qw.scales, b)
    row_major = _run(variant, x, nk.t().contiguous(), qw.scales, b)
    assert not k_contig.isnan().any()  # every tile of the NaN-poisoned output was written
    assert torch.equal(k_contig, packed) and torch.equal(row_major, packed)
    assert_rel_close(k_contig, _ref(x, nk.t(), qw.scales, b), BOUND[dtype], f"{variant} M={m} N={n} K={k}")


@pytest.mark.parametrize("variant", ["triton", "fusedq", "torch"])
def test_signed_codes_take_k_not_a_multiple_of_four(variant):
    """The words pack 4 codes along K; signed codes have no such rule (K = 90: a partly masked last K tile)."""
    codes = torch.randint(-127, 128, (56, 90), dtype=torch.int8)  # [N, K]
    w_s = torch.rand(1, 56) + 0.01
    x = torch.randn(7, 90)
    out = _run(variant, x, codes.t(), w_s, None)
    assert_rel_close(out, _ref(x, codes.t(), w_s, None), BOUND[torch.float32], f"{variant} K=90")
    with use_backend("torch"):
        assert_rel_close(qg.w8a8_gemm(x, codes.t(), w_s, None), out, 1e-6, "the op's torch backend")


def test_bad_layouts_are_refused_by_name():
    codes = torch.randint(-127, 128, (48, 64), dtype=torch.int8)
    x, w_s = torch.randn(3, 64), torch.ones(1, 48)
    for bad, what in (
        (codes.t()[:, ::2], r"qweight must be contiguous"),  # [64, 24], neither K nor N contiguous
        (codes, r"qweight must have shape \(64, 64\)"),  # [48, 64] taken as a row-major [K, N]: K is not x's
        (codes.t().to(torch.int16), r"qweight must be int8 \[K, N\]"),
    ):
        with pytest.raises(CodesignError, match=what):
            qg.w8a8_gemm(x, bad, w_s, None)


def test_quant_linear_keeps_one_signed_buffer_and_loads_packed_state_dicts():
    lin = torch.nn.Linear(96, 40)
    q = QuantLinear.from_linear(lin, W8A8Config())
    assert q.qweight.dtype == torch.int8 and q.qweight.shape == (40, 96) and q.qweight.is_contiguous()
    qw = q.quantized_weight()  # packed back
    x = torch.randn(6, 96)
    with use_backend("triton"):
        want = qg.quant_matmul(x, qw, q.bias, act_quant=True)
        assert torch.equal(q(x), want)
    old = {**q.state_dict(), "qweight": qw.qweight}  # as saved before the signed layout
    fresh = QuantLinear.from_linear(torch.nn.Linear(96, 40), W8A8Config())
    fresh.load_state_dict(old)
    assert torch.equal(fresh.qweight, q.qweight)
    with use_backend("triton"):
        assert torch.equal(fresh(x), want)


@pytest.mark.parametrize(("m", "n", "k"), [(1, 41, 90), (7, 3, 4), (33, 64, 128), (2, 1, 1)])
def test_the_cpu_torch_path_sums_exactly_in_either_layout(m, n, k):
    """The torch backend on a CPU takes `torch._int_mm` (exact int32 sums, as the kernels' accumulator): the same
    bits as the exact fp64 sums it replaced, for signed codes (either layout) and packed words."""
    codes = torch.randint(-127, 128, (n, k), dtype=torch.int8)
    x = torch.randn(m, k) * 4
    w_s = torch.rand(1, n) + 0.01
    aq, a_s = qf.quantize_per_token(x, "int8")
    want = ((aq.double() @ codes.t().double()).float() * a_s[:, None] * w_s).to(x.dtype)
    layouts = [codes.t(), codes.t().contiguous()] + ([qf.pack_int8_codes(codes.t())] if k % 4 == 0 else [])
    with use_backend("torch"):
        for w in layouts:
            assert torch.equal(qg.w8a8_gemm(x, w, w_s, None), want), w.dtype


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 8, 300])
@pytest.mark.parametrize("variant", ["triton", "fusedq", "tma", "torch"])
def test_every_variant_compiled_gives_the_same_bits_from_either_layout(variant, m):
    """The compiled kernels at their default configs (the signed codes streamed by `cp.async` / TMA, the packed words
    unpacked in registers): the same outputs bit for bit, within the output's rounding of fp64."""
    from codesign.autotune.lookup import forced_config
    from codesign.backend import device_view
    from codesign.kernels.gemm import torch_mm
    from codesign.kernels.gemm import triton_gemm as qt
    from codesign.kernels.gemm import triton_tma as tt

    n, k = 4096 + 64, 1024
    dev = torch.device("cuda")
    if variant == "tma" and tt.why_not(m, n, k, device_view(dev)):
        pytest.skip(tt.why_not(m, n, k, device_view(dev)))
    if variant == "torch" and torch_mm.why_not(m, n, k, False, torch.bfloat16, dev):
        pytest.skip(torch_mm.why_not(m, n, k, False, torch.bfloat16, dev))
    qw = qf.quantize_rtn(torch.randn(n, k), "int8", None, True, torch.float32)
    x = torch.randn(m, k, dtype=torch.bfloat16)
    nk = qf.int8_codes_nk(qw.qweight)
    outs = []
    with use_backend("triton"), forced_config(qt.scaled_mm_variant_op(False), qt.scaled_mm_variant_entry(variant)):
        for w in (qw.qweight.cuda(), nk.cuda().t()):
            outs.append(qg.w8a8_gemm(x.cuda(), w, qw.scales.cuda(), None).cpu())
    assert torch.equal(outs[0], outs[1])
    assert_rel_close(outs[1], _ref(x, nk.t(), qw.scales, None), BOUND[torch.bfloat16], f"{variant} M={m}")
