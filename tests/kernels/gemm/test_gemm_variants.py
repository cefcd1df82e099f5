"""The variants of the quantized GEMMs: the CUDA-core GEMV at the smallest M, and torch's own paths:
dequantize-then-matmul for the weight-only ops, and
`torch._int_mm` / `torch._scaled_mm` for W8A8 / FP8. Each forced variant against fp64 on odd shapes into a
NaN-poisoned output; the dequantized buffer bit for bit against the torch reference; the default rule by M;
shapes torch cannot take never chosen, and refused with the reason when forced; every variant tunable."""

from __future__ import annotations

import gc

import pytest
import torch
from helpers import assert_rel_close

from codesign.autotune.lookup import forced_config
from codesign.autotune.ops import get_op
from codesign.autotune.space import DeviceLimits
from codesign.autotune.tuner import rel_error
from codesign.backend import use_backend
from codesign.kernels.gemm import formats as qf
from codesign.kernels.gemm import ops as qg
from codesign.kernels.gemm import torch_mm
from codesign.kernels.gemm import triton_dequant as td
from codesign.kernels.gemm import triton_gemm as qt
from codesign.specs import CodesignError

BOUND = {torch.float16: 2e-3, torch.float32: 1e-5}


def _ref(x, qw, bias):
    y = x.double() @ qw.dequantize(torch.float64).t()
    return y if bias is None else y + bias.double()


@pytest.mark.parametrize("variant", ["dequant", "gemv"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize(("bits", "group", "sym", "n", "k", "m"),
                         [(4, 32, False, 97, 224, 5), (4, 128, True, 40, 384, 1), (8, None, True, 72, 100, 3),
                          (8, 64, False, 24, 192, 13), (4, None, False, 33, 96, 2)])  # fmt: skip
def test_forced_variant_matches_fp64(bits, group, sym, n, k, m, dtype, variant):
    qw = qf.quantize_rtn(torch.randn(n, k), f"int{bits}", group, sym, dtype)
    x = torch.randn(m, k).to(dtype)
    bias = torch.randn(n).to(dtype) if m % 2 else None
    out = torch.full((m, n), float("nan"), dtype=dtype)
    with use_backend("triton"), forced_config(qt.wq_variant_op(bits), qt.wq_variant_entry(variant)):
        qt.wq_gemm(x, qw.qweight, qw.scales, qw.zeros, bias, bits, qw.group, out)
    assert_rel_close(out, _ref(x, qw, bias), BOUND[dtype], f"{variant} int{bits} g{group} M={m}")


@pytest.mark.parametrize("bits", [4, 8])
def test_the_dequantized_buffer_is_the_torch_reference_bit_for_bit(bits):
    qw = qf.quantize_rtn(torch.randn(56, 256), f"int{bits}", 64, False, torch.float16)
    w = torch.full((256, 56), float("nan"), dtype=torch.float16)
    with use_backend("triton"):
        td.dequantize_into(qw.qweight, qw.scales, qw.zeros, bits, 64, w, qt._INTERP_DEFAULTS["dequant"])
    want = qg._dequant_kn(qw.qweight, qw.scales, qw.zeros, bits, 64).to(torch.float16)
    assert torch.equal(w, want)
    sym = qf.quantize_rtn(torch.randn(56, 256), f"int{bits}", 64, True, torch.float16)
    with use_backend("triton"):
        td.dequantize_into(sym.qweight, sym.scales, None, bits, 64, w, qt._INTERP_DEFAULTS["dequant"])
    assert torch.equal(w, qg._dequant_kn(sym.qweight, sym.scales, None, bits, 64).to(torch.float16))


def test_the_workspace_is_shared_and_grows():
    big = td.workspace(64, 96, torch.float32, torch.device("cpu"))
    small = td.workspace(32, 16, torch.float32, torch.device("cpu"))
    assert small.shape == (32, 16) and small.data_ptr() == big.data_ptr()
    bigger = td.workspace(128, 96, torch.float32, torch.device("cpu"))
    assert bigger.shape == (128, 96) and bigger.numel() >= big.numel()


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize(("m", "n", "k", "per_tensor"), [(5, 97, 100, False), (40, 48, 256, True)])
def test_torch_variant_of_the_scaled_mm_matches_ours(fp8, m, n, k, per_tensor):
    fmt = "fp8_e4m3" if fp8 else "int8"
    group = -1 if (fp8 and per_tensor) else None
    qw = qf.quantize_rtn(torch.randn(n, k), fmt, group, True, torch.float32)
    x, bias = torch.randn(m, k), torch.randn(n)
    outs = {}
    for variant in (0, 1):
        with (
            use_backend("triton"),
            forced_config(qt.scaled_mm_variant_op(fp8), {"TORCH": variant}),
            # Ours unsplit, like torch's one-pass epilogue (the interpreter default splits K in two).
            forced_config(qt.scaled_mm_table_op(fp8), {"SPLIT_K": 1}),
        ):
            outs[variant] = qg.quant_matmul(x, qw, bias, act_quant=not fp8)
    if fp8:
        assert_rel_close(outs[1], outs[0], 1e-6, "fp8 torch vs ours")
    else:  # int32 sums are exact and the fp32 epilogue is the same: bit-identical
        assert torch.equal(outs[1], outs[0])
    aq, a_s = qf.quantize_per_token(x, fmt)
    ref = (aq.double() * a_s.double()[:, None]) @ qw.dequantize(torch.float64).t() + bias.double()
    assert_rel_close(outs[1], ref, 1e-5, f"{fmt} torch variant vs fp64")


def test_torch_variant_copies_the_weight_once_and_again_when_it_changes(monkeypatch):
    """The [N, K] copy cuBLASLt's GEMMs read is made on the first call, reused after (a per-call copy of an
    8192^2 e4m3 weight costs ~32 us on an H200), rebuilt when the weight changes in place, and dies with it."""
    made = []
    real = qf.int8_codes_nk
    monkeypatch.setattr(qf, "int8_codes_nk", lambda w: made.append(1) or real(w))
    qw = qf.quantize_rtn(torch.randn(48, 64), "int8", None, True, torch.float32)
    x = torch.randn(40, 64)

    def run(qw, torch_variant=1):
        with use_backend("triton"), forced_config(qt.scaled_mm_variant_op(False), {"TORCH": torch_variant}):
            return qg.quant_matmul(x, qw, None, act_quant=True)

    gc.collect()  # earlier tests' weights
    before = torch_mm.cached_weight_copies()
    first, again = run(qw), run(qw)
    assert made == [1] and torch_mm.cached_weight_copies() == before + 1 and torch.equal(first, again)
    qw.qweight[3, 7] ^= 0x01010101  # in place: four codes of column 7 change
    changed = run(qw)
    assert made == [1, 1] and torch_mm.cached_weight_copies() == before + 1
    assert not torch.equal(changed, first) and torch.equal(changed, run(qw, torch_variant=0))  # ours: new codes
    del qw
    gc.collect()
    assert torch_mm.cached_weight_copies() == before  # the entry died with the weight's storage


def test_default_rule_and_what_torch_cannot_take():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    for fp8 in (False, True):
        assert qt.choose_scaled_mm_variant(qt.FUSEDQ_MAX_M, 64, 128, fp8, torch.float32, cpu) == "fusedq"
        assert qt.choose_scaled_mm_variant(qt.FUSEDQ_MAX_M + 1, 64, 128, fp8, torch.float32, cpu) == "triton"
        assert qt.choose_scaled_mm_variant(1024, 64, 128, fp8, torch.float32, cpu) == "torch"
    # On a GPU torch's int8 matmul needs M > 16 and K, N multiples of 8; its fp8 one 16: never chosen there.
    assert "M > 16" in torch_mm.why_not(16, 64, 128, False, torch.bfloat16, cuda)
    assert "multiples of 8" in torch_mm.why_not(2048, 60, 128, False, torch.bfloat16, cuda)
    assert "multiples of 16" in torch_mm.why_not(2048, 64, 120, True, torch.bfloat16, cuda)
    assert qt.choose_scaled_mm_variant(2048, 60, 128, False, torch.bfloat16, cuda) == "triton"
    with forced_config(qt.scaled_mm_variant_op(False), {"TORCH": 1}):  # even a table saying torch
        assert qt.choose_scaled_mm_variant(2048, 60, 128, False, torch.bfloat16, cuda) == "torch"


def test_a_forced_torch_variant_that_cannot_run_says_why(monkeypatch):
    monkeypatch.setattr(torch_mm, "why_not", lambda *a: "torch._int_mm needs M > 16, got M=5")
    qw = qf.quantize_rtn(torch.randn(48, 64), "int8", None, True, torch.float32)
    with use_backend("triton"), forced_config("w8a8_gemm_variant", {"TORCH": 1}):
        with pytest.raises(CodesignError, match=r"torch variant of the w8a8 GEMM cannot run: .*M > 16"):
            qg.quant_matmul(torch.randn(5, 64), qw, act_quant=True)
    with use_backend("triton"):  # unforced, the same call takes our kernel
        qg.quant_matmul(torch.randn(5, 64), qw, act_quant=True)


@pytest.mark.parametrize(("name", "shape"), [
    ("w4a16_gemm", {"M": 5, "N": 48, "K": 256, "G": 64}), ("w8a16_gemm", {"M": 33, "N": 40, "K": 128, "G": 0}),
    ("w8a8_gemm", {"M": 20, "N": 48, "K": 128}), ("fp8_gemm", {"M": 3, "N": 32, "K": 64}),
])  # fmt: skip
def test_every_variant_is_tunable_and_correct(name, shape):
    op = get_op(name)
    for variant in op.expand(shape):
        op.check_shape(variant)
        cand = op.space(variant, torch.float32, False).candidates(DeviceLimits(name="cpu-interpreter"))[-1]
        inputs = op.make_inputs(variant, torch.float32, "cpu", 3)
        op.poison(inputs)
        with use_backend("triton"):
            out = op.run(inputs, cand)
        assert rel_error(out, op.reference(inputs)) <= op.tolerance(torch.float32), (variant, cand)


@pytest.mark.slow
@pytest.mark.lowering
def test_the_gemv_and_the_dequant_pass_lower_for_sm90_without_spills_or_conversions():
    """What the designs need, from the compiler (the interpreter cannot show it): at their GPU defaults the GEMV
    (M = 1 and M = 3, int4 and int8) and the dequantize pass compile for sm_90 without register spills, and the
    GEMV turns codes into fp32 with no integer-to-float conversion instruction."""
    from helpers import assert_runs_without_interpreter

    code = """
import torch
from codesign.autotune.compile_only import compile_only
from codesign.autotune.lookup import forced_config
from codesign.kernels.gemm import formats as qf
from codesign.kernels.gemm import triton_gemm as qt
from codesign.kernels.gemm.ops import quant_matmul
with compile_only(90) as s:
    for bits, group in ((4, 128), (8, None)):
        qw = qf.quantize_rtn(torch.randn(256, 1024), f"int{bits}", group, group is None, torch.bfloat16)
        quant_matmul(torch.randn(2048, 1024, dtype=torch.bfloat16), qw)  # the rule's dequantize pass
        with forced_config(qt.wq_variant_op(bits), qt.wq_variant_entry("gemv")):  # a variant for tables: forced
            for m in (1, 3):
                quant_matmul(torch.randn(m, 1024, dtype=torch.bfloat16), qw)
kinds = sorted({l.kernel for l in s.launches})
assert kinds == ["_dequant_kernel", "_wq_gemv_kernel"], kinds
from codesign.kernels.gemm.triton_gemv import PROGRAMS_PER_SM
for l in s.launches:
    assert l.error is None and l.spill_stores == 0 and 0 < l.registers <= 255, l
    if l.kernel == "_wq_gemv_kernel":
        assert l.ptx_ops["cvt_i2f"] == 0 and l.constexprs["USE_ATOMIC"], l
        # The K split aims at PROGRAMS_PER_SM programs an SM: their registers must fit one SM's 64 Ki.
        assert l.registers * 32 * l.num_warps * PROGRAMS_PER_SM <= 65536, l
    else:
        assert l.registers <= 128, l
print("ok")
"""
    assert_runs_without_interpreter(code)


@pytest.mark.slow
@pytest.mark.lowering
def test_the_fused_quantizer_gemm_lowers_for_sm90_without_spills():
    """The fused-quantizer W8A8 / FP8 kernel at its GPU default config (`_GPU_DEFAULTS["fusedq"]`) compiles for
    sm_90 from bf16 activations at decode M (1, 3, 8, 16: each row-tile height it quantizes; int8 and e4m3) with no
    spills, one launch per call, its dot on the warpgroup MMA with s8 / e4m3 operands (its 64-row tile; a 16-row one
    took mma.sync, e4m3 through fp16) (the interpreter cannot show any of it)."""
    from helpers import assert_runs_without_interpreter

    code = """
import torch
from codesign.autotune.compile_only import compile_only
from codesign.autotune.lookup import forced_config
from codesign.kernels.gemm import formats as qf
from codesign.kernels.gemm import triton_gemm as qt
from codesign.kernels.gemm.ops import quant_matmul
with compile_only(90, "NVIDIA H200") as s:
    for fmt in ("int8", "fp8_e4m3"):
        qw = qf.quantize_rtn(torch.randn(512, 1024), fmt, None, True, torch.float32)
        with forced_config(qt.scaled_mm_variant_op(fmt != "int8"), {"FUSEDQ": 1}):  # 16 is past the rule's M
            for m in (1, 3, 8, 16):
                quant_matmul(torch.randn(m, 1024, dtype=torch.bfloat16), qw, act_quant=True)
assert [l.kernel for l in s.launches] == ["_fusedq_kernel"] * 8, [l.kernel for l in s.launches]
want = {k: v for k, v in qt._GPU_DEFAULTS["fusedq"].items() if k.startswith("BLOCK")}
for l in s.launches:
    assert {k: l.constexprs[k] for k in want} == want and l.num_stages == qt._GPU_DEFAULTS["fusedq"]["num_stages"], l
    # (<= 192: one 4-warp program an SM at the sizes it serves, so registers do not bound its occupancy; e4m3 at M = 16
    # took 150)
    assert l.error is None and l.problems() == [] and l.spill_stores == 0 and 0 < l.registers <= 192, l
    assert l.ptx_ops["mma_sync"] == 0 and l.ptx_ops["wgmma_8bit"] == l.ptx_ops["wgmma"] > 0, l.ptx_ops
print("ok")
"""
    assert_runs_without_interpreter(code)


def test_gemv_k_split_fills_each_sm_without_an_extra_round():
    """`gemv_splits`: at most PROGRAMS_PER_SM programs an SM (N = K = 8192 on an H200's 132 SMs: 16 column tiles x 32
    K slices = 512 programs <= 528), whole BLOCK_K tiles each; a layer too short to split keeps one slice a tile."""
    from codesign.kernels.gemm.triton_gemv import PROGRAMS_PER_SM, gemv_splits

    s = gemv_splits(8192, 8192, 512, 64, 132)
    assert s == 32 and 16 * s <= PROGRAMS_PER_SM * 132
    assert gemv_splits(57344, 8192, 512, 64, 132) == 4  # gate_up: 112 column tiles
    assert gemv_splits(8192, 64, 512, 64, 132) == 1  # one K tile
    assert gemv_splits(400000, 8192, 512, 64, 132) == 1  # more column tiles than the programs aimed at
    assert gemv_splits(8192, 8192, 512, 64, None) == 2  # off a GPU: the atomic path, exercised
