"""The W8A8 / FP8 fused-quantizer variant (`triton_fusedq`): bit for bit the two-launch Triton path
(quantize_per_token, then scaled_mm) at the same tile config, for int8 and fp8, odd M / N / K with masked tiles,
bias on and off, per-tensor and per-channel weight scales, fp16 / bf16 / fp32 activations; within the path's
bound of fp64; one launch where the two-launch path makes two; the default rule and forced variants; the
bad-input contract before any launch."""

from __future__ import annotations

import pytest
import torch
from helpers import assert_rel_close, spy_launches

from codesign.autotune.lookup import forced_config
from codesign.backend import use_backend
from codesign.kernels.gemm import formats as qf
from codesign.kernels.gemm import ops as qg
from codesign.kernels.gemm import triton_fusedq as fq
from codesign.kernels.gemm import triton_gemm as qt
from codesign.specs import CodesignError

# Three K tiles at K = 96, two (the last one masked) at K = 40: the prologue and the main loop both cross tiles.
# Both paths split K in two (the fused prologue still over all of K), so they are compared like with like.
CFG = {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 32, "GROUP_M": 2, "SPLIT_K": 2, "num_warps": 4,
       "num_stages": 1}  # fmt: skip
BOUND = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}  # the output's rounding


@pytest.fixture
def kernels(monkeypatch):
    """Names of the GEMM path's kernel launches, in order."""
    return spy_launches(
        monkeypatch, ((fq, "_fusedq_kernel"), (qt, "_act_quant_kernel"), (qt, "_scaled_mm_kernel"))
    )


def _weight(fp8: bool, n: int, k: int, per_tensor: bool):
    fmt = "fp8_e4m3" if fp8 else "int8"
    qw = qf.quantize_rtn(torch.randn(n, k), fmt, -1 if fp8 and per_tensor else None, True, torch.float32)
    w_s = qw.scales
    if per_tensor and not fp8:  # the kernels take a [1, 1] int8 scale too (quantize_rtn: per channel)
        w_s = qw.scales.amax().reshape(1, 1)
    return qw.qweight, w_s, fmt


def _x(m: int, k: int, dtype: torch.dtype) -> torch.Tensor:
    # Rows of very different magnitudes (a per-row scale is needed), and odd rows' absmax in the last, partly
    # masked K tile (a prologue that stopped early, or read past K, would give another scale).
    x = torch.randn(m, k) * torch.logspace(-3, 3, m)[:, None]
    x[1::2, -1] = x[1::2].abs().amax(1) * 3
    if m > 2 and dtype != torch.float16:  # a scale below the reciprocal's exact range: that row tile takes div_rn
        x[2] *= 1e-20
    return x.to(dtype)


def _run(variant: str, x, w, w_s, bias, fp8: bool, cfg: dict = CFG) -> torch.Tensor:
    out = torch.full((x.shape[0], w.shape[1]), float("nan"), dtype=x.dtype)
    with (
        use_backend("triton"),
        forced_config(qt.scaled_mm_variant_op(fp8), qt.scaled_mm_variant_entry(variant)),
        forced_config(qt.scaled_mm_table_op(fp8), cfg),
        forced_config(qt.scaled_mm_table_op(fp8, "fusedq"), cfg),
        forced_config(qt.scaled_mm_table_op(fp8, "tma"), {k: v for k, v in cfg.items() if k != "SPLIT_K"}),
    ):
        qt.w8a8_mm(x, fp8, w, w_s, bias, out)
    return out


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize(("m", "n", "k", "dtype", "bias", "per_tensor"), [
    (1, 48, 40, torch.float32, True, False), (3, 80, 96, torch.float16, False, True),
    (17, 48, 96, torch.bfloat16, True, True), (17, 80, 40, torch.float32, False, False),
])  # fmt: skip
def test_fused_is_the_two_launch_path_bit_for_bit(fp8, m, n, k, dtype, bias, per_tensor, kernels):
    w, w_s, fmt = _weight(fp8, n, k, per_tensor)
    x = _x(m, k, dtype)
    b = torch.randn(n).to(dtype) if bias else None
    fused = _run("fusedq", x, w, w_s, b, fp8)
    assert kernels == ["_fusedq_kernel"]
    two = _run("triton", x, w, w_s, b, fp8)
    assert kernels[1:] == ["_act_quant_kernel", "_scaled_mm_kernel"]
    assert not fused.isnan().any()
    assert torch.equal(fused, two), (fused - two).abs().max()
    aq, a_s = qf.quantize_per_token(x, fmt)
    wk = w.to(torch.float64) if fp8 else (qf.unpack_codes(w, 8) - 128).to(torch.float64)
    ref = (aq.double() @ wk) * a_s.double()[:, None] * w_s.double()
    assert_rel_close(fused, ref if b is None else ref + b.double(), BOUND[dtype], f"{fmt} M={m} N={n} K={k}")


def test_the_default_rule_and_forced_variants(kernels):
    cpu = torch.device("cpu")
    top = qt.FUSEDQ_MAX_M
    for m, want in ((1, "fusedq"), (top, "fusedq"), (top + 1, "triton"), (1024, "torch")):
        assert qt.choose_scaled_mm_variant(m, 64, 128, False, torch.float32, cpu) == want
    op = qt.scaled_mm_variant_op(True)
    for entry, want in (({"FUSEDQ": 1}, "fusedq"), ({"TORCH": 0}, "triton"), ({"TORCH": 1}, "torch")):
        with forced_config(op, entry):  # a missing flag is 0, as in the variant tables
            assert qt.choose_scaled_mm_variant(300, 64, 128, True, torch.float32, cpu) == want
            assert qt.choose_scaled_mm_variant(3, 64, 128, True, torch.float32, cpu) == want
    # Through the op, unforced: one launch at decode M, two from FUSEDQ_MAX_M + 1 on.
    qw = qf.quantize_rtn(torch.randn(40, 64), "int8", None, True, torch.float32)
    with use_backend("triton"):
        for m in (2, qt.FUSEDQ_MAX_M + 1):
            qg.quant_matmul(torch.randn(m, 64), qw, act_quant=True)
    assert kernels == ["_fusedq_kernel", "_act_quant_kernel", "_scaled_mm_kernel"]


def test_a_forced_fusedq_given_codes_says_why_and_bad_input_launches_nothing(kernels):
    w, w_s, _ = _weight(False, 40, 64, False)
    aq, a_s = qf.quantize_per_token(torch.randn(3, 64), "int8")
    out = torch.empty(3, 40)
    with use_backend("triton"):
        with forced_config("w8a8_gemm_variant", {"FUSEDQ": 1}):
            with pytest.raises(CodesignError, match=r"fusedq variant of the w8a8 GEMM cannot run.*codes"):
                qt.scaled_mm(aq, a_s, w, w_s, None, out)
        qt.scaled_mm(aq, a_s, w, w_s, None, out)  # unforced, the rule's fusedq at M = 3: ours runs
        assert kernels == ["_scaled_mm_kernel"]
        kernels.clear()
        with pytest.raises(CodesignError, match=r"w_scales must have shape \(1, 40\)"):
            qg.w8a8_gemm(torch.randn(3, 64), w, torch.ones(40), None)
        with pytest.raises(CodesignError, match="bias must have shape"):
            qg.w8a8_gemm(torch.randn(3, 64), w, w_s, torch.ones(41))
    assert kernels == []


def test_the_bit_identity_check_has_teeth():
    """One ulp on one row's scale in the two-launch path is an output the comparison above would refuse."""
    w, w_s, _ = _weight(False, 48, 40, False)
    x = _x(3, 40, torch.float32)
    fused = _run("fusedq", x, w, w_s, None, False)
    aq, a_s = qf.quantize_per_token(x, "int8")
    a_s[1] = torch.nextafter(a_s[1], torch.tensor(2.0))
    out = torch.empty_like(fused)
    with use_backend("triton"), forced_config(qt.scaled_mm_table_op(False), CFG):
        qt.scaled_mm(aq, a_s, w, w_s, None, out, "triton")
    assert not torch.equal(out, fused) and torch.equal(out[[0, 2]], fused[[0, 2]])


CFG64 = {**CFG, "BLOCK_M": 64, "SPLIT_K": 1}  # the GPU default's shape: 64 rows (a decode batch's, copied up), no split


@pytest.mark.parametrize("variant", ["fusedq", "triton"])
def test_an_fp8_weight_in_either_layout_gives_the_same_output(variant, monkeypatch):
    """`quantize_rtn` gives the e4m3 weight K contiguous (the [K, N] view of an [N, K]); a row-major [K, N] copy of
    it runs too (strides), bit for bit, at the 16- and the 64-row tile; any other layout is refused by name."""
    w, w_s, _ = _weight(True, 80, 96, False)
    assert w.shape == (96, 80) and w.t().is_contiguous() and not w.is_contiguous()
    x = _x(5, 96, torch.bfloat16)
    rows = []  # the GEMM's tile rows per call: both configs really run
    real = qt.launch_config
    monkeypatch.setattr(qt, "launch_config", lambda *a, **k: rows.append(real(*a, **k).get("BLOCK_M")) or real(*a, **k))
    for cfg in (CFG, CFG64):
        kmaj = _run(variant, x, w, w_s, None, True, cfg)
        rowmaj = _run(variant, x, w.contiguous(), w_s, None, True, cfg)
        assert not kmaj.isnan().any() and torch.equal(kmaj, rowmaj)
    assert [r for r in rows if r is not None] == [16, 16, 64, 64], rows
    with use_backend("triton"), pytest.raises(CodesignError, match="qweight must be contiguous"):
        qg.fp8_gemm(x, torch.empty(80, 192, dtype=torch.float8_e4m3fn)[:, ::2].t(), w_s, None)


@pytest.mark.slow
@pytest.mark.lowering
def test_the_fused_quantizer_lowers_for_sm90_to_wgmma_with_the_weight_pipelined():
    """At the GPU default config on sm_90 (N = K = 8192, bf16): the dot on wgmma with s8 / e4m3 operands; a K-contiguous
    e4m3 weight streams into shared memory by cp.async (a row-major one does not: 8-bit wgmma reads K-contiguous
    operands, so that tile is transposed through registers, the loop waiting on each load; the two-launch GEMM's
    e4m3 path alike); one rounding an element
    of the rows there are (not the dot operand's replicated copy: `opaque_bytes`); no spills."""
    from helpers import assert_runs_without_interpreter

    code = """
import torch
from codesign.autotune.compile_only import compile_only
from codesign.kernels.gemm import formats as qf
from codesign.kernels.gemm import triton_gemm as qt
from codesign.kernels.gemm.triton_fusedq import fusedq_mm
cfg = qt._GPU_DEFAULTS["fusedq"]
n = k = 8192
runs = []
with compile_only(90, "NVIDIA H200") as s:
    for fp8, m, layout in ((True, 1, "k"), (True, 1, "row"), (False, 8, "k"), (True, 8, "k")):
        w = torch.empty(n, k, dtype=torch.float8_e4m3fn).t() if fp8 else torch.empty(k // 4, n, dtype=torch.int32)
        w = w.contiguous() if layout == "row" else w
        fusedq_mm(torch.empty(m, k, dtype=torch.bfloat16), w, torch.empty(1, n), None,
                  torch.empty(m, n, dtype=torch.bfloat16), fp8, cfg, False)
        runs.append((fp8, m, layout))
    n0 = len(s.launches)
    for layout in ("k", "row"):  # the two-launch GEMM's e4m3 path alike
        w = torch.empty(n, k, dtype=torch.float8_e4m3fn).t()
        w = w if layout == "k" else w.contiguous()
        qt.scaled_mm(torch.empty(16, k, dtype=torch.float8_e4m3fn), torch.empty(16), w, torch.empty(1, n), None,
                     torch.empty(16, n, dtype=torch.bfloat16), "triton")
two = s.launches[n0:]
assert [l.kernel for l in two] == ["_scaled_mm_kernel"] * 2, two
assert two[0].ptx_ops["cp_async"] > two[1].ptx_ops["cp_async"] and two[0].shared_bytes > two[1].shared_bytes, two
assert (two[0].sync_staged, two[1].sync_staged) == (0, 1), two
ls = dict(zip(runs, zip(s.launches, s.compiled)))
for (fp8, m, layout), (l, kern) in ls.items():
    assert l.sync_staged == (layout == "row"), (layout, l.sync_staged)  # the census names the unpipelined tile
    assert (l.problems() == []) == (layout == "k"), l.problems()
    assert l.spill_stores == 0 and l.ptx_ops["wgmma_8bit"] == l.ptx_ops["wgmma"] > 0, l
    rows = l.constexprs["ROWS"]
    per_thread = rows * cfg["BLOCK_K"] // (32 * cfg["num_warps"])
    ptx = kern.asm["ptx"]
    rounds = ptx.count("cvt.rn.satfinite.e4m3x2.f32") * 2 if fp8 else ptx.count("cvt.rni.f32.f32")
    assert 0 < rounds <= per_thread, (fp8, m, rounds, per_thread)
k_major, row_major = ls[(True, 1, "k")][0], ls[(True, 1, "row")][0]
assert k_major.ptx_ops["cp_async"] > row_major.ptx_ops["cp_async"], (k_major.ptx_ops, row_major.ptx_ops)
assert k_major.shared_bytes >= (cfg["num_stages"] - 1) * 128 * 64 > row_major.shared_bytes, (
    k_major.shared_bytes, row_major.shared_bytes)
print("ok")
"""
    assert_runs_without_interpreter(code)


def test_stages_shrink_where_rows_of_activations_fill_shared_memory():
    """Decode's few rows keep the default's stages; a forced 64-row fp32 tile gets as many as fit SMEM_BUDGET (six
    took 221 KB, over sm_80's 163 KB), never fewer than one."""
    cfg = qt._GPU_DEFAULTS["fusedq"]
    assert fq._stages(cfg, 2, 2) == fq._stages(cfg, 8, 4) == cfg["num_stages"]
    big = fq._stages(cfg, 64, 4)
    stage = 64 * cfg["BLOCK_K"] * 4 + cfg["BLOCK_K"] * cfg["BLOCK_N"]
    assert 1 <= big < cfg["num_stages"] and big * stage <= fq.SMEM_BUDGET
    assert fq._stages({**cfg, "BLOCK_K": 4096}, 64, 4) == 1


def test_split_k_0_fills_the_sms_and_sums_the_same(monkeypatch):
    """SPLIT_K 0 (the GPU default) splits K until the SMs hold AUTO_SPLIT_PROGRAMS programs each, at most
    AUTO_SPLIT_MAX: N = K = 8192 at decode M (128 output tiles, 132 SMs) takes 4, Llama-2-70B's gate_up (896) one;
    none without an SM count. Through the kernel (interpreter, 132 SMs given): the grid carries the split, and the
    output is the one-split kernel's within the split's rounding."""
    assert fq.auto_split_k(128, 132) == 4 and fq.auto_split_k(896, 132) == 1 and fq.auto_split_k(200, 132) == 2
    assert fq.auto_split_k(1, 132) == fq.AUTO_SPLIT_MAX and fq.auto_split_k(128, None) == 1
    assert qt._GPU_DEFAULTS["fusedq"]["SPLIT_K"] == 0
    grids = []
    launch = fq._fusedq_kernel.__getitem__
    monkeypatch.setattr(fq, "_fusedq_kernel", type("Spy", (), {
        "__getitem__": staticmethod(lambda grid: grids.append(grid) or launch(grid))})())  # fmt: skip
    m, n, k = 3, 64, 256
    w, w_s, _ = _weight(False, n, k, False)
    x = _x(m, k, torch.float32)
    outs = []
    for split in (0, 1):
        out = torch.full((m, n), float("nan"))
        with use_backend("triton"):
            fq.fusedq_mm(x, w, w_s, None, out, False, {**CFG, "BLOCK_K": 64, "SPLIT_K": split}, True, sms=132)
        outs.append(out)
    assert [g[1] for g in grids] == [4, 1]  # 2 tiles of 32 columns: 4 splits (the cap), K 256 = 4 tiles of 64
    assert not outs[0].isnan().any()
    assert_rel_close(outs[0], outs[1].double(), BOUND[torch.float32], "SPLIT_K 0 against 1")
