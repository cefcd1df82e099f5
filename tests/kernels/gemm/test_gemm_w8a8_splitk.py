"""Split-K in the W8A8 / FP8 GEMMs (`_scaled_mm_kernel` and the fused-quantizer kernel): K cut into SPLIT_K ranges of
whole BLOCK_K tiles (`triton_parts.k_split`), each split's scaled partial added atomically into an fp32 sum that the
last split rounds into the output (`splitk_join`). Checked in the interpreter: every element within the bound stated in
`triton_gemm.scaled_mm` of an fp64 reference (int8 and e4m3, bias on and off, per-tensor and per-channel weight scales,
fp16 / bf16 / fp32 outputs, uneven splits: the last shorter, K not a multiple of BLOCK_K x SPLIT_K) into NaN-poisoned
outputs; the fused and two-launch paths bit for bit at the same split; SPLIT_K 1 exactly today's one-pass fp32 epilogue.
Compile-only for sm_90: s8 / e4m3 MMAs, fp32 reductions, no spills."""

from __future__ import annotations

import pytest
import torch
from helpers import spy_launches

from codesign.autotune.lookup import forced_config
from codesign.backend import use_backend
from codesign.kernels.gemm import formats as qf
from codesign.kernels.gemm import triton_fusedq as fq
from codesign.kernels.gemm import triton_gemm as qt
from codesign.kernels.gemm.triton_parts import k_split
from codesign.specs import CodesignError

U = 2.0**-24  # fp32's unit roundoff
# The copy into out rounds once (fp32: exact).
U_OUT = {torch.float32: 0.0, torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8}
BLOCK_K = 32


def _cfg(split: int) -> dict[str, int]:
    return {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": BLOCK_K, "GROUP_M": 2, "SPLIT_K": split, "num_warps": 4,
            "num_stages": 1}  # fmt: skip


@pytest.fixture
def launches(monkeypatch):
    """(kernel, grid, SPLIT_K) of each GEMM launch."""
    targets = ((fq, "_fusedq_kernel"), (qt, "_scaled_mm_kernel"))
    return spy_launches(monkeypatch, targets, lambda name, grid, kw: (name, grid, kw["SPLIT_K"]))


def _problem(fp8: bool, m: int, n: int, k: int, dtype: torch.dtype, bias: bool, per_tensor: bool):
    fmt = "fp8_e4m3" if fp8 else "int8"
    qw = qf.quantize_rtn(torch.randn(n, k), fmt, -1 if fp8 and per_tensor else None, True, torch.float32)
    w_s = qw.scales.amax().reshape(1, 1) if per_tensor and not fp8 else qw.scales  # int8 per tensor: [1, 1]
    x = (torch.randn(m, k) * torch.logspace(-2, 2, m)[:, None]).to(dtype)  # rows of different magnitudes
    b = torch.randn(n).to(dtype) if bias else None
    return x, qw.qweight, w_s, b


def _run(variant: str, x, w, w_s, b, fp8: bool, split: int) -> torch.Tensor:
    out = torch.full((x.shape[0], w.shape[1]), float("nan"), dtype=x.dtype)  # every element must be written
    with (
        use_backend("triton"),
        forced_config(qt.scaled_mm_variant_op(fp8), qt.scaled_mm_variant_entry(variant)),
        forced_config(qt.scaled_mm_table_op(fp8), _cfg(split)),
        forced_config(qt.scaled_mm_table_op(fp8, "fusedq"), _cfg(split)),
    ):
        qt.w8a8_mm(x, fp8, w, w_s, b, out)
    return out


def _exact(x, w, w_s, b, fp8: bool):
    """fp64 (y, magnitude): y = (q(x) @ W) a_s w_s + b and sum_k |q(x) W| |a_s w_s| + |b|, q the Triton quantizer's
    codes (the fused kernel's by contract, the two-launch path's by construction)."""
    aq = torch.empty(x.shape, dtype=torch.float8_e4m3fn if fp8 else torch.int8)
    a_s = torch.empty(x.shape[0])
    with use_backend("triton"):
        qt.quantize_per_token(x, fp8, aq, a_s)
    wk = w.double() if fp8 else (qf.unpack_codes(w, 8) - 128).double()
    a64, scale = aq.double(), a_s.double()[:, None] * w_s.double()
    b64 = torch.zeros(w.shape[1], dtype=torch.float64) if b is None else b.double()
    return (a64 @ wk) * scale + b64, (a64.abs() @ wk.abs()) * scale.abs() + b64.abs()


def _assert_within_bound(out, y, mag, n_roundings: int, what: str) -> None:
    """|out - y| <= g_n mag, then out's own rounding (relative, plus half its subnormal spacing)."""
    u_out = U_OUT[out.dtype]
    err = n_roundings * U / (1 - n_roundings * U) * mag
    bound = err + u_out * (y.abs() + err) + torch.finfo(out.dtype).smallest_normal * u_out
    diff = (out.double() - y).abs()
    assert torch.isfinite(out).all(), f"{what}: unwritten (NaN) outputs"
    worst = (diff / bound).max().item()
    assert (diff <= bound).all(), f"{what}: error up to {worst:.3g} x the stated bound"


def test_k_split_gives_whole_tiles_and_no_empty_split():
    for k, split, want in ((96, 2, (2, 64)), (96, 3, (3, 32)), (96, 8, (3, 32)), (200, 2, (2, 128)),
                           (200, 3, (3, 96)), (200, 5, (4, 64)), (40, 1, (1, 64))):  # fmt: skip
        got = k_split(k, BLOCK_K, split)
        assert got == want, (k, split, got)
        s, per = got
        assert per % BLOCK_K == 0 and (s - 1) * per < k <= s * per  # the last split non-empty
    with pytest.raises(CodesignError, match="SPLIT_K must be >= 1, got 0"):
        k_split(96, BLOCK_K, 0)


@pytest.mark.parametrize("fp8", [False, True], ids=["int8", "e4m3"])
@pytest.mark.parametrize(("m", "n", "k", "dtype", "bias", "per_tensor", "split"), [
    (1, 48, 96, torch.float32, True, False, 2),     # 3 tiles: 64 + 32
    (1, 80, 96, torch.float16, True, True, 3),      # one tile a split
    (3, 80, 200, torch.float16, False, True, 3),    # 96 + 96 + 8: a partial tile alone in the last split
    (3, 48, 200, torch.bfloat16, True, False, 2),   # 128 + 72
    (3, 80, 200, torch.float32, False, False, 5),   # asks 5, gets 4 of 64 (no empty split)
])  # fmt: skip
def test_split_k_is_within_its_bound_of_fp64(fp8, m, n, k, dtype, bias, per_tensor, split, launches):
    x, w, w_s, b = _problem(fp8, m, n, k, dtype, bias, per_tensor)
    s, per = k_split(k, BLOCK_K, split)
    fused = _run("fusedq", x, w, w_s, b, fp8, split)
    two = _run("triton", x, w, w_s, b, fp8, split)
    want = [("_fusedq_kernel", s, s), ("_scaled_mm_kernel", s, s)]  # grid's split axis, SPLIT_K
    assert [(name, grid[1], sk) for name, grid, sk in launches] == want
    # The same codes, partials and (in the interpreter, programs in order) the same order of the atomic adds.
    assert torch.equal(fused, two), (fused - two).abs().max()
    y, mag = _exact(x, w, w_s, b, fp8)
    # int8: exact int32 partials, 3 roundings in the epilogue, the bias once, S - 1 additions. e4m3: each partial
    # also an fp32 sum of up to `per` exact products.
    _assert_within_bound(fused, y, mag, (per if fp8 else 0) + s + 3, f"M={m} N={n} K={k} S={s} {dtype}")


def _exact_sum_problem(m: int, n: int, k: int, dtype: torch.dtype, per_tensor: bool):
    """e4m3 data whose fp32 dot is exact in any order: integer codes |c| <= 16 on both sides (e4m3 holds them), so
    every partial sum is an integer below 2^24; each row of x is a power of two times such codes with 448 in it
    (its scale that power of two)."""
    ints = torch.randint(-16, 17, (m, k)).double()
    ints[:, 0] = 448.0
    x = (ints * 2.0 ** torch.randint(-4, 5, (m, 1)).double()).to(dtype)
    w = torch.randint(-16, 17, (k, n)).to(torch.float8_e4m3fn)
    w_s = torch.rand(1, 1 if per_tensor else n) + 0.5
    return x, w, w_s


@pytest.mark.parametrize("fp8", [False, True], ids=["int8", "e4m3"])
@pytest.mark.parametrize(("m", "k", "dtype", "bias", "per_tensor"), [
    (1, 96, torch.float32, True, False), (3, 200, torch.float16, False, True), (3, 96, torch.float16, True, False),
])  # fmt: skip
def test_split_k_1_is_todays_one_pass_epilogue_bit_for_bit(fp8, m, k, dtype, bias, per_tensor, launches):
    """One K range: the sum's fp32 value, x a_scale, x w_scale, + bias, one rounding into out, as before split-K, from
    an independent torch emulation (int8: int64 sums; e4m3: data whose fp32 sums are exact). fp16 / fp32 outputs:
    the interpreter casts fp32 to bf16 by truncation (the split path's join rounds by the bits)."""
    n = 48
    if fp8:
        x, w, w_s = _exact_sum_problem(m, n, k, dtype, per_tensor)
    else:
        x, w, w_s, _ = _problem(fp8, m, n, k, dtype, False, per_tensor)
    b = torch.randn(n).to(dtype) if bias else None
    aq = torch.empty(x.shape, dtype=torch.float8_e4m3fn if fp8 else torch.int8)
    a_s = torch.empty(m)
    with use_backend("triton"):
        qt.quantize_per_token(x, fp8, aq, a_s)
    wk = w.double() if fp8 else (qf.unpack_codes(w, 8) - 128).double()
    acc = (aq.double() @ wk).float()  # exact: int8 |sum| < 2^53, e4m3 integer sums < 2^24
    want = acc * a_s[:, None] * w_s.float()
    want = (want if b is None else want + b.float()).to(dtype)
    for variant in ("fusedq", "triton"):
        assert torch.equal(_run(variant, x, w, w_s, b, fp8, 1), want), variant
    assert [(grid[1], sk) for _, grid, sk in launches] == [(1, 1), (1, 1)]


def test_the_interpreter_default_splits_and_the_gpu_default_is_stated():
    """Interpreter tests that do not pin SPLIT_K run the atomic path (as the weight-only split-K does); on a GPU the
    fused kernel splits K until the SMs hold 3 programs each (SPLIT_K 0, `triton_fusedq.auto_split_k`: its 64-row tile
    left one program an SM at N = 8192, latency-bound; docs/kernels.md, untimed), the two-launch one does not (it
    serves M 9-1023); tuned tables may set either."""
    for kind in ("scaled_mm", "fusedq"):
        assert qt._INTERP_DEFAULTS[kind]["SPLIT_K"] == 2
    assert qt._GPU_DEFAULTS["fusedq"]["SPLIT_K"] == 0 and qt._GPU_DEFAULTS["scaled_mm"]["SPLIT_K"] == 1


@pytest.mark.slow
@pytest.mark.lowering
def test_split_k_lowers_for_sm90_with_int8_e4m3_mmas_and_fp32_reductions():
    """At the GPU defaults (the fused kernel split until the SMs are full), a forced split of the fused kernel, and
    forced splits of the two-launch kernel (16-row tiles: mma.sync; 64-row: wgmma), from bf16 at decode M: no
    spills, the MMA on s8 codes (int8) or e4m3 (wgmma; a 16-row mma.sync on sm_90 takes the e4m3 tile upcast to
    f16, as before split-K), the partials reduced by fp32 global atomics, and none without a split."""
    from helpers import assert_runs_without_interpreter

    code = """
import torch
from codesign.autotune.compile_only import compile_only
from codesign.autotune.lookup import forced_config
from codesign.kernels.gemm import formats as qf
from codesign.kernels.gemm import triton_fusedq as fq
from codesign.kernels.gemm import triton_gemm as qt
from codesign.kernels.gemm.ops import quant_matmul
with compile_only(90, "NVIDIA H200") as s:
    for fmt in ("int8", "fp8_e4m3"):
        fp8 = fmt != "int8"
        qw = qf.quantize_rtn(torch.randn(512, 1024), fmt, None, True, torch.float32)
        for m in (1, 8):  # the rule's fused variant, its GPU default config
            quant_matmul(torch.randn(m, 1024, dtype=torch.bfloat16), qw, act_quant=True)
        with forced_config(qt.scaled_mm_table_op(fp8, "fusedq"), {"SPLIT_K": 2}):
            quant_matmul(torch.randn(3, 1024, dtype=torch.bfloat16), qw, act_quant=True)
        with forced_config(qt.scaled_mm_variant_op(fp8), {"FUSEDQ": 0}):
            for bm, split in ((16, 4), (64, 2), (64, 1)):
                with forced_config(qt.scaled_mm_table_op(fp8), {"BLOCK_M": bm, "SPLIT_K": split}):
                    quant_matmul(torch.randn(16, 1024, dtype=torch.bfloat16), qw, act_quant=True)
mm = [l for l in s.launches if l.kernel != "_act_quant_kernel"]
assert [l.kernel for l in mm] == (["_fusedq_kernel"] * 3 + ["_scaled_mm_kernel"] * 3) * 2, [l.kernel for l in mm]
for i, l in enumerate(mm):
    fp8, split = l.constexprs["IS_FP8"], l.constexprs["SPLIT_K"]
    assert l.error is None and l.problems() == [] and l.spill_stores == 0 and 0 < l.registers <= 128, l
    # the defaults' SPLIT_K 0: 8 output tiles of N = 512 on 132 SMs split to the cap (`auto_split_k`)
    assert l.kernel != "_fusedq_kernel" or split == (2 if i % 6 == 2 else fq.AUTO_SPLIT_MAX), l
    assert (l.ptx_ops["atomic_add_f32"] > 0) == (split > 1), l
    if not fp8:
        assert l.ptx_ops["mma_s8"] > 0, l.ptx_ops
    elif l.constexprs["BLOCK_M"] >= 64:
        assert l.ptx_ops["wgmma"] > 0 and l.ptx_ops["mma_e4m3"] > 0, l.ptx_ops
    else:
        assert l.ptx_ops["mma_sync"] > 0, l.ptx_ops
print("ok")
"""
    assert_runs_without_interpreter(code)
