"""Quantized GEMM kernels (Triton, through the interpreter on CPU) and their torch ops.

References are fp64: x @ dequantize(W)^T (+ bias). Bounds on the relative Frobenius error, per
activation dtype: fp32 1e-5 (fp32 accumulation, exact fp32 dot in the interpreter); fp16 2e-3
(the dequantized weight and the output are rounded to fp16: measured ~3e-4); bf16 8e-3 (bf16
rounding of the output, which the interpreter truncates instead of rounding: measured ~3.4e-3;
a wrong scale, group or code would give errors of order 1).
"""

from __future__ import annotations

import pytest
import torch
from helpers import assert_rel_close, device_view_with, poison_like, rel_fro_error

from codesign.autotune.lookup import forced_config
from codesign.backend import use_backend
from codesign.kernels.gemm import formats as qf
from codesign.kernels.gemm import ops as qg
from codesign.kernels.gemm import triton_gemm as qt
from codesign.specs import CodesignError

BOUND = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 8e-3}
FORMATS = [  # (dtype, group_size, symmetric)
    ("int4", 128, True),
    ("int4", 32, False),
    ("int4", None, True),
    ("int8", 64, False),
    ("int8", None, True),
]


def _ref(x, qw, bias):
    y = x.double() @ qw.dequantize(torch.float64).t()
    return y + bias.double() if bias is not None else y


def _run_wq(x, qw, bias):
    """The launcher itself, into a NaN-poisoned output."""
    out = poison_like(torch.empty(x.shape[0], qw.N, dtype=x.dtype))
    qt.wq_gemm(x, qw.qweight, qw.scales, qw.zeros, bias, qw.bits, qw.group, out)
    return out


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f"{f[0]}-g{f[1]}-{'sym' if f[2] else 'asym'}")
@pytest.mark.parametrize("m", [1, 3, 17, 64])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_weight_only_kernel_matches_fp64_reference(fmt, m, dtype):
    n, k = 96, 384
    qw = qf.quantize_rtn(torch.randn(n, k), *fmt)
    x = torch.randn(m, k).to(dtype)
    bias = torch.randn(n).to(dtype) if m % 2 else None  # odd M with bias, even M without
    assert_rel_close(_run_wq(x, qw, bias), _ref(x, qw, bias), BOUND[dtype], f"{fmt} M={m}")


@pytest.mark.parametrize("fmt", FORMATS[:3], ids=lambda f: f"{f[0]}-g{f[1]}-{'sym' if f[2] else 'asym'}")
@pytest.mark.parametrize("m", [2, 13])  # the split-K variant (M <= 16)
def test_weight_only_fp16_codes_take_bf16_rows_beyond_fp16_range(fmt, m):
    """On a GPU, split-K's bf16 activations meet the codes in fp16 products after a power-of-two row scale. Forced
    here (the interpreter otherwise multiplies bf16 in fp32): rows of magnitude 1e6, beyond fp16's 65504, and
    rows of 1e-6; the interpreter's bf16 store truncates, hence bf16's bound."""
    qw = qf.quantize_rtn(torch.randn(96, 384), *fmt)
    x = torch.randn(m, 384)
    x[::2] *= 1e6
    x[1::2] *= 1e-6
    x = x.to(torch.bfloat16)
    with device_view_with(bf16_dot=True):  # bf16 dots, as compiled for a GPU
        got = _run_wq(x, qw, None)
    assert torch.isfinite(got).all()
    want = _ref(x, qw, None)
    for rows in (slice(0, None, 2), slice(1, None, 2)):
        assert_rel_close(got[rows], want[rows], BOUND[torch.bfloat16], f"{fmt} M={m} rows {rows}")


@pytest.mark.parametrize("m", [2, 33])
def test_weight_only_kernel_bf16_activations(m):
    # bf16 is converted to fp32 right after the load; the interpreter's bf16 store truncates.
    qw = qf.quantize_rtn(torch.randn(96, 384), "int4", 64, False, torch.bfloat16)
    x = torch.randn(m, 384).to(torch.bfloat16)
    bias = torch.randn(96).to(torch.bfloat16)
    assert_rel_close(_run_wq(x, qw, bias), _ref(x, qw, bias), BOUND[torch.bfloat16])


@pytest.mark.parametrize("bits, group", [(4, 32), (4, None), (8, 64), (8, None)])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_weight_only_splitk_zero_rides_in_the_unpack(bits, group, dtype):
    """Split-K meets c - z as fp16, the zero folded into each code pair's packed subtract (`words_f16_less`): zeros at
    both ends of their range (0 and 2^bits, GPTQ v1's stored 15 / 255 + 1) and random between, odd N (masked
    columns), per-channel K not a multiple of BLOCK_K (a masked tail tile), M 5 (one partial 16-row tile); bf16 rows
    through the forced bf16-dot path with a row beyond fp16's range (fp16: a row of 8). Every zero off by one failed
    all eight cases (int8 per-channel bf16 the closest: 8.1e-3 against 8e-3)."""
    n, k, m = 77, 392 if group is None else 384, 5
    qw = qf.quantize_rtn(torch.randn(n, k), f"int{bits}", group, False)
    z = torch.randint(0, (1 << bits) + 1, qw.zeros.shape).to(qw.zeros.dtype)
    z[0], z[-1] = 0, 1 << bits
    qw.zeros.copy_(z)
    x = torch.randn(m, k)
    x[1] *= 1e6 if dtype == torch.bfloat16 else 8.0  # (fp16: the output must fit too)
    x = x.to(dtype)
    with device_view_with(bf16_dot=dtype == torch.bfloat16):
        assert qt.choose_variant(m, qt.wq_op(bits)) == "splitk"
        got = _run_wq(x, qw, None)
    assert torch.isfinite(got).all()
    want = _ref(x, qw, None)
    for rows in ([1], [0, 2, 3, 4]):
        assert_rel_close(got[rows], want[rows], BOUND[dtype], f"int{bits} g{group} {dtype} rows {rows}")


@pytest.mark.parametrize("bits, group", [(4, 128), (8, None)])
def test_weight_only_splitk_fp16_rows_meet_the_codes_unscaled(bits, group):
    """fp16 activations reach split-K's fp16 dot as they are (no row scale: fp16 x (c - z) / 1024 products are exact
    in the fp32 sums): a row up to fp16's largest values (6e4) beside rows of 1e-3, N odd, M 7. A row scale that
    were needed would show as inf or an error of order 1 in the large row."""
    n, k, m = 45, 256, 7
    qw = qf.quantize_rtn(torch.randn(n, k) * 0.01, f"int{bits}", group, False)
    x = torch.randn(m, k)
    x[0] = (x[0] * 2e4).clamp(-6e4, 6e4)
    x[1:] *= 1e-3
    x = x.half()
    assert qt.choose_variant(m, qt.wq_op(bits)) == "splitk"
    got = _run_wq(x, qw, None)
    assert torch.isfinite(got).all()
    want = _ref(x, qw, None)
    for rows in ([0], list(range(1, m))):
        assert_rel_close(got[rows], want[rows], BOUND[torch.float16], f"int{bits} rows {rows}")


@pytest.mark.parametrize("m, n, k, group", [(5, 50, 160, 32), (20, 37, 200, None), (1, 130, 72, None)])
def test_weight_only_kernel_masks_odd_n_and_k(m, n, k, group):
    # N not a multiple of BLOCK_N, per-channel K not a multiple of BLOCK_K (masked tail tiles).
    qw = qf.quantize_rtn(torch.randn(n, k), "int4", group, False)
    x = torch.randn(m, k)
    assert_rel_close(_run_wq(x, qw, None), _ref(x, qw, None), BOUND[torch.float32])


@pytest.mark.parametrize("m", [5, 40])
def test_weight_only_kernel_with_small_blocks_and_three_splits(m, monkeypatch):
    # Other launch configs than the interpreter defaults: 3 uneven K splits (M=5); several M and N tiles
    # with a partial last GROUP_M group in the tiled kernel's swizzled order (M=40: 3 x 3 tiles).
    cfg = {
        "splitk": {
            "BLOCK_M": 16,
            "BLOCK_N": 32,
            "BLOCK_K": 32,
            "SPLIT_K": 3,
            "num_warps": 4,
            "num_stages": 1,
        },
        "tiled": {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 32, "GROUP_M": 2, "num_warps": 4, "num_stages": 1},
    }
    monkeypatch.setattr(qt, "_INTERP_DEFAULTS", {**qt._INTERP_DEFAULTS, **cfg})
    qw = qf.quantize_rtn(torch.randn(96, 224), "int4", 32, False)
    x = torch.randn(m, 224)
    bias = torch.randn(96)
    assert_rel_close(_run_wq(x, qw, bias), _ref(x, qw, bias), BOUND[torch.float32])


def test_variant_is_chosen_by_m():
    got = [qt.choose_variant(m) for m in (1, 2, 3, 4, 16, 17, 1023, 1024, 4096)]
    assert got == ["gemv", "gemv", "splitk", "splitk", "splitk", "tiled", "tiled", "dequant", "dequant"]
    assert [qt.choose_variant(m, "w8a16_gemm") for m in (1, 2, 3)] == ["gemv", "gemv", "splitk"]


@pytest.mark.parametrize("m", [1, 17])
def test_ops_dispatch_to_both_backends_with_leading_dims(m):
    qw = qf.quantize_rtn(torch.randn(96, 384), "int4", 128, False)
    x = torch.randn(2, m, 384)
    bias = torch.randn(96)
    with use_backend("triton"):
        y_tr = qg.quant_matmul(x, qw, bias)
    with use_backend("torch"):
        y_to = qg.quant_matmul(x, qw, bias)
    ref = _ref(x.reshape(-1, 384), qw, bias).reshape(2, m, 96)
    assert y_tr.shape == (2, m, 96)
    assert_rel_close(y_tr, ref, BOUND[torch.float32], "triton")
    assert_rel_close(y_to, ref, BOUND[torch.float32], "torch")


def test_noncontiguous_x_is_copied():
    qw = qf.quantize_rtn(torch.randn(96, 128), "int8", 32)
    x = torch.randn(128, 5).t()  # [5, 128], not contiguous
    with use_backend("triton"):
        y = qg.quant_matmul(x, qw)
    assert_rel_close(y, _ref(x, qw, None), BOUND[torch.float32])


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_m_zero_returns_empty(backend):
    qw = qf.quantize_rtn(torch.randn(96, 128), "int4", 32)
    with use_backend(backend):
        assert qg.quant_matmul(torch.randn(0, 128), qw).shape == (0, 96)
        assert qg.quant_matmul(
            torch.randn(0, 128), qf.quantize_rtn(torch.randn(96, 128), "int8", None), act_quant=True
        ).shape == (0, 96)


# ----------------------------------------------------------------------------- W8A8 int8 and FP8


@pytest.mark.parametrize("fp8", [False, True], ids=["int8", "fp8"])
@pytest.mark.parametrize("m", [1, 17])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_act_quantizer_kernel_is_bit_exact(fp8, m, dtype):
    x = (torch.randn(m, 300) * 3).to(dtype)
    x[0, :] = 0  # all-zero row: scale 1
    # Values that round to zero keep their sign in e4m3 (-0 is 0x80): an H200 run found the kernel
    # writing +0 for them (rare in random data: 1 in ~10^5 at this scale).
    x[-1, 1:4] = torch.tensor([-1e-6, 1e-6, -2e-5]).to(dtype)
    if m > 4:
        # Quotients at and beside rounding ties (absmax 100: s = RN(100 / QMAX) is inexact), where a division off by an
        # ulp flips a code; and fp32 rows whose scales are outside the reciprocal's exact range (`triton_div`), which
        # divide by div_rn.
        qmax = 448.0 if fp8 else 127.0
        s_row = torch.tensor(100.0) / qmax
        ties = ((torch.arange(300) % 200 - 100) + 0.5).double() * s_row.double()
        away = torch.tensor([0.0, float("inf"), float("-inf")]).repeat(100)  # on the tie, an ulp up, an ulp down
        ties = torch.where(away == 0, ties.float(), torch.nextafter(ties.float(), away))
        x[1] = torch.where(ties.abs() <= 100, ties, 0.0).to(dtype)
        x[1, 0] = 100.0
        if dtype == torch.float32:
            x[2] *= 1e-20
            x[3] *= 1e25
    # Poison codes: -128 is never produced (clamp at -127); 0xFF is an e4m3 NaN.
    q = torch.full((m, 300), -1 if fp8 else -128, dtype=torch.int8)
    if fp8:
        q = q.view(torch.float8_e4m3fn)
    s = poison_like(torch.empty(m))
    qt.quantize_per_token(x, fp8, q, s)
    q_ref, s_ref = qf.quantize_per_token(x, "fp8_e4m3" if fp8 else "int8")
    assert torch.equal(s, s_ref)
    assert torch.equal(q.view(torch.int8), q_ref.view(torch.int8))


def _unsplit(variant: str):
    return forced_config(qt.scaled_mm_table_op(False, variant), {"SPLIT_K": 1})


@pytest.mark.parametrize("m", [1, 3, 17, 64])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_w8a8_kernel_is_bit_exact_against_integer_reference(m, dtype):
    n, k = 96, 384
    qw = qf.quantize_rtn(torch.randn(n, k), "int8", None, True, torch.float32)
    x = (torch.randn(m, k) * 2).to(dtype)
    bias = torch.randn(n).to(dtype)
    aq, a_s = qf.quantize_per_token(x, "int8")
    out = poison_like(torch.empty(m, n, dtype=dtype))
    # Unsplit (SPLIT_K 1: one fp32 epilogue, a direct store); the split-K sums: test_gemm_w8a8_splitk.py.
    with _unsplit("triton"):
        qt.scaled_mm(aq, a_s, qw.qweight, qw.scales, bias, out)
    # Independent integer reference: int64 matmul of the codes, then the same fp32 epilogue.
    wcodes = qf.unpack_codes(qw.qweight, 8) - 128
    acc = (aq.to(torch.int64) @ wcodes).to(torch.float32)
    want = (acc * a_s[:, None] * qw.scales + bias.float()).to(dtype)
    assert torch.equal(out, want)
    # And the whole op is close to the unquantized-activation fp64 reference (act quantization error).
    with use_backend("triton"), _unsplit("fusedq" if m <= qt.FUSEDQ_MAX_M else "triton"):
        y = qg.quant_matmul(x, qw, bias, act_quant=True)
    assert torch.equal(y, want)
    assert rel_fro_error(y, _ref(x, qw, bias)) < 2e-2


@pytest.mark.parametrize("group_size", [None, -1], ids=["per-channel", "per-tensor"])
@pytest.mark.parametrize("m", [3, 64])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_fp8_kernel_runs_in_the_interpreter(group_size, m, dtype):
    # The interpreter runs fp8 tl.dot exactly (e4m3 products are exact in fp32); the GPU path is
    # covered by test_fp8_gemm_on_gpu.
    n, k = 96, 160
    qw = qf.quantize_rtn(torch.randn(n, k), "fp8_e4m3", group_size)
    x = (torch.randn(m, k) * 2).to(dtype)
    aq, a_s = qf.quantize_per_token(x, "fp8_e4m3")
    out = poison_like(torch.empty(m, n, dtype=dtype))
    qt.scaled_mm(aq, a_s, qw.qweight, qw.scales, None, out)
    want = (aq.double() @ qw.qweight.double()) * a_s.double()[:, None] * qw.scales.double()
    assert_rel_close(out, want, BOUND[dtype])
    with use_backend("triton"):
        y = qg.quant_matmul(x, qw)
    assert_rel_close(y, want, BOUND[dtype])
    assert rel_fro_error(y, _ref(x, qw, None)) < 8e-2  # e4m3 activations: 3 mantissa bits


# ----------------------------------------------------------------------------- bad input


def _args(**over):
    qw = qf.quantize_rtn(torch.randn(96, 128), "int4", 32, False)
    a = dict(
        x=torch.randn(3, 128), qweight=qw.qweight, scales=qw.scales, zeros=qw.zeros, bias=None, group_size=32
    )
    a.update(over)
    return a


@pytest.mark.parametrize(
    "over, match",
    [
        (dict(x=torch.randn(3, 160)), "qweight must have shape"),
        (dict(x=torch.randn(3, 100)), "multiple of 8"),
        (dict(x=torch.randint(0, 5, (3, 128))), "x must be fp16"),
        (dict(group_size=48), "group_size"),
        (dict(group_size=64), "scales must have shape"),
        (dict(qweight=torch.zeros(16, 96, dtype=torch.int64)), "qweight must be a 2-D int32"),
        (dict(qweight=torch.zeros(8, 96, dtype=torch.int32)), "qweight must have shape"),
        (dict(scales=torch.ones(4, 96, dtype=torch.int32)), "scales must have dtype"),
        (dict(zeros=torch.zeros(4, 95, dtype=torch.float16)), "zeros must have shape"),
        (dict(zeros=torch.zeros(4, 96, dtype=torch.float32)), "zeros must have dtype"),
        (dict(bias=torch.zeros(96, dtype=torch.float16)), "bias must have dtype"),
        (dict(bias=torch.zeros(95)), "bias must have shape"),
        (dict(bias=torch.zeros(96, device="meta")), "bias is on meta"),
    ],
)
@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_w4a16_op_refuses_bad_arguments(over, match, backend):
    with use_backend(backend), pytest.raises(CodesignError, match=match):
        qg.w4a16_gemm(**_args(**over))


@pytest.mark.parametrize("bad", [0.5, -1.0, 17.0, float("nan"), float("inf")])
@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_weight_only_ops_refuse_zeros_that_are_not_codes(bad, backend):
    """zeros hold the format's integer zero points in [0, 2^bits] (16 included: GPTQ v1); the kernels meet c - z in
    16-bit arithmetic, exact only for these, so any other value is refused by name, not computed inexactly. The
    check is kept per tensor and made again after an in-place change."""
    a = _args()
    z = a["zeros"]
    z[1, 2] = 16.0  # the largest zero a 4-bit format stores (GPTQ v1's 15 + 1)
    with use_backend(backend):
        qg.w4a16_gemm(**a)
        z[1, 2] = bad  # in place: a new version of a tensor already checked
        with pytest.raises(CodesignError, match=r"zeros must hold integers in \[0, 16\]"):
            qg.w4a16_gemm(**a)
        z8 = qf.quantize_rtn(torch.randn(96, 128), "int8", 32, False)
        z8.zeros[0, 0] = 256.0 if bad != 17.0 else 257.0
        a8 = dict(a, qweight=z8.qweight, scales=z8.scales, zeros=z8.zeros)
        if bad == 17.0:
            with pytest.raises(CodesignError, match=r"\[0, 256\]"):
                qg.w8a16_gemm(**a8)
        else:
            qg.w8a16_gemm(**a8)


def test_zero_values_are_checked_once_per_tensor(monkeypatch):
    """One host sync per zeros tensor, not per call (a decode loop calls each layer's op every step)."""
    a = _args()
    calls = []
    real = qf.zeros_are_codes
    monkeypatch.setattr(qf, "zeros_are_codes", lambda z, b: calls.append(1) or real(z, b))
    with use_backend("torch"):
        for _ in range(3):
            qg.w4a16_gemm(**a)
        assert len(calls) == 1
        a["zeros"].add_(0)  # an in-place change: checked again
        qg.w4a16_gemm(**a)
    assert len(calls) == 2


@pytest.mark.parametrize(
    "fp8, over, match",
    [
        (False, dict(qweight=torch.zeros(32, 96, dtype=torch.int16)), r"qweight must be int8 \[K, N\] .* or int32"),
        (False, dict(qweight=torch.zeros(32, 96, dtype=torch.int8)), r"qweight must have shape \(128, 96\)"),
        (False, dict(w_scales=torch.ones(2, 96)), "w_scales must have shape"),
        (False, dict(x=torch.randn(3, 126)), "% 4 == 0"),
        (True, dict(w_scales=torch.ones(1, 96, dtype=torch.float16)), "w_scales must have dtype"),
        (True, dict(qweight=torch.zeros(128, 96)), "float8_e4m3fn"),
    ],
)
def test_w8a8_ops_refuse_bad_arguments(fp8, over, match):
    qw = qf.quantize_rtn(torch.randn(96, 128), "fp8_e4m3" if fp8 else "int8", None)
    a = dict(x=torch.randn(3, 128), qweight=qw.qweight, w_scales=qw.scales.float(), bias=None)
    a.update(over)
    with use_backend("triton"), pytest.raises(CodesignError, match=match):
        (qg.fp8_gemm if fp8 else qg.w8a8_gemm)(**a)


def test_shapes_beyond_int32_offsets_are_refused_before_copying():
    qw = qf.quantize_rtn(torch.randn(96, 128), "int8", None)
    x = torch.zeros(1, 128).expand(2**24, 128)  # 2**31 elements, no memory behind them
    with use_backend("triton"):
        with pytest.raises(CodesignError, match="2\\*\\*31"):
            qg.quant_matmul(x, qw)
        with pytest.raises(CodesignError, match="2\\*\\*31"):
            qg.quant_matmul(x, qw, act_quant=True)


def test_w8a8_needs_per_channel_symmetric_int8():
    with pytest.raises(CodesignError, match="W8A8"):
        qg.quant_matmul(torch.randn(2, 128), qf.quantize_rtn(torch.randn(8, 128), "int8", 32), act_quant=True)


def test_cupy_backend_on_cpu_tensors_is_refused():
    with use_backend("cupy"), pytest.raises(CodesignError, match="cupy"):
        qg.w4a16_gemm(**_args())


# ----------------------------------------------------------------------------- torch.library integration


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_opcheck(backend):
    qw4 = qf.quantize_rtn(torch.randn(40, 64), "int4", 32, False)
    qw8 = qf.quantize_rtn(torch.randn(40, 64), "int8", None)
    qf8 = qf.quantize_rtn(torch.randn(40, 64), "fp8_e4m3", None)
    x = torch.randn(3, 64)
    b = torch.randn(40)
    with use_backend(backend):
        torch.library.opcheck(torch.ops.codesign.w4a16_gemm, (x, qw4.qweight, qw4.scales, qw4.zeros, b, 32))
        torch.library.opcheck(torch.ops.codesign.w8a16_gemm, (x, qw8.qweight, qw8.scales, None, None, 64))
        torch.library.opcheck(torch.ops.codesign.w8a8_gemm, (x, qw8.qweight, qw8.scales, b))
        # test_schema compares inputs with a multiply that torch has no CPU fp8 kernel for.
        torch.library.opcheck(
            torch.ops.codesign.fp8_gemm,
            (x, qf8.qweight, qf8.scales, None),
            test_utils=("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic"),
        )
        torch.library.opcheck(torch.ops.codesign.quantize_per_token_int8, (x,))


@pytest.mark.numerics  # Inductor generates its C++ for the CPU's capability: rerun under AVX2 (Makefile)
def test_torch_compile_fullgraph_through_the_triton_kernel():
    qw = qf.quantize_rtn(torch.randn(48, 64), "int4", 32, False)
    bias = torch.randn(48)

    def f(x):
        return torch.relu(qg.quant_matmul(x * 2, qw, bias)) + 1

    x = torch.randn(5, 64)
    with use_backend("triton"):
        y = torch.compile(f, fullgraph=True)(x)
    assert_rel_close(y, torch.relu(_ref(x * 2, qw, bias)) + 1, BOUND[torch.float32])


# ----------------------------------------------------------------------------- GPU only


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 16, 17, 300])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_weight_only_kernel_on_gpu(m, dtype):
    qw = qf.quantize_rtn(torch.randn(4096 + 96, 1024), "int4", 128, False)
    qw = qf.QuantizedWeight(
        *(t.cuda() if t is not None else None for t in (qw.qweight, qw.scales, qw.zeros)),
        "int4",
        128,
        qw.N,
        qw.K,
    )
    x = torch.randn(m, 1024, device="cuda").to(dtype)
    with use_backend("triton"):
        y = qg.quant_matmul(x, qw)
    # bf16/fp16 operands into tensor cores: rounding of the dequantized weight and the output.
    assert_rel_close(
        y,
        _ref(
            x.cpu(),
            qf.QuantizedWeight(qw.qweight.cpu(), qw.scales.cpu(), qw.zeros.cpu(), "int4", 128, qw.N, qw.K),
            None,
        ),
        1e-2,
    )


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 200])
def test_fp8_gemm_on_gpu(m):
    # Needs fp8 tensor cores (sm_89+); bit-level quantizer equality checked against the torch cast.
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("fp8 tensor cores need sm_89+ (Ada/Hopper)")
    qw = qf.quantize_rtn(torch.randn(512, 1024), "fp8_e4m3", None)
    x = torch.randn(m, 1024, dtype=torch.bfloat16, device="cuda")
    with use_backend("triton"):
        q, s = qg.quantize_per_token_fp8(x)
        y = qg.fp8_gemm(x, qw.qweight.cuda(), qw.scales.cuda(), None)
    q_ref, s_ref = qf.quantize_per_token(x.cpu(), "fp8_e4m3")
    assert torch.equal(s.cpu(), s_ref) and torch.equal(q.cpu().view(torch.int8), q_ref.view(torch.int8))
    want = (q_ref.double() @ qw.qweight.double()) * s_ref.double()[:, None] * qw.scales.double()
    assert_rel_close(y, want, 8e-3)
