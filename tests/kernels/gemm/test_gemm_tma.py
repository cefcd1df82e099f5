"""The W8A8 / FP8 persistent TMA-fed variant (`triton_tma`), in the interpreter (tensor descriptors run there):
bit for bit the two-launch Triton path for int8 at the same tile config (int32 sums are exact) and within fp32
accumulation of it for e4m3, both within the output's rounding of fp64; odd M, bias on and off, per-tensor and
per-channel weight scales, fp16 / bf16 / fp32 outputs, NaN-poisoned outputs overwritten, each program walking
several tiles; the weight's descriptor cached per weight storage, hit on a second call, rebuilt after an in-place
change, gone with the weight; the default rule (sm_90 only) and forced variants; refusals with the reason; a
stale descriptor caught (teeth); and compile-only sm_90 lowering (TMA, wgmma, no spills)."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from helpers import assert_rel_close, spy_launches
from test_gemm_fusedq import _weight

from codesign.autotune.lookup import forced_config
from codesign.backend import DeviceView, use_backend, use_device_view
from codesign.kernels.gemm import formats as qf
from codesign.kernels.gemm import torch_mm
from codesign.kernels.gemm import triton_gemm as qt
from codesign.kernels.gemm import triton_tma as tt
from codesign.specs import CodesignError

# 16 x 32 tiles: at M = 33, N = 64 six tiles over INTERP_PROGRAMS = 3 programs (two each), three row tiles in
# groups of 2 (the last group short); two K steps at K = 64, four at 128.
CFG = {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 32, "GROUP_M": 2, "num_warps": 4, "num_stages": 1}
BOUND = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}  # the output's rounding
HOPPER = DeviceView(gpu=True, sms=132, capability=(9, 0), hw_fp8=True, min_dot_rows=16, bf16_dot=True)


@pytest.fixture
def launches(monkeypatch):
    """Names of the kernels launched, in order."""
    return spy_launches(monkeypatch, ((tt, "_tma_scaled_mm_kernel"), (qt, "_scaled_mm_kernel")))


def _run(variant: str, x, w, w_s, bias, fp8: bool) -> torch.Tensor:
    out = torch.full((x.shape[0], w.shape[1]), float("nan"), dtype=x.dtype)
    with (
        use_backend("triton"),
        forced_config(qt.scaled_mm_variant_op(fp8), qt.scaled_mm_variant_entry(variant)),
        forced_config(qt.scaled_mm_table_op(fp8), {**CFG, "SPLIT_K": 1}),  # one pass: the same epilogue
        forced_config(qt.scaled_mm_table_op(fp8, "tma"), CFG),
    ):
        qt.w8a8_mm(x, fp8, w, w_s, bias, out)
    return out


def _ref(x, w, w_s, bias, fmt: str) -> torch.Tensor:
    aq, a_s = qf.quantize_per_token(x, fmt)
    wk = w.to(torch.float64) if fmt != "int8" else (qf.unpack_codes(w, 8) - 128).to(torch.float64)
    ref = (aq.double() @ wk) * a_s.double()[:, None] * w_s.double()
    return ref if bias is None else ref + bias.double()


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize(("m", "n", "k", "dtype", "bias", "per_tensor"), [
    (33, 64, 64, torch.float32, True, False), (5, 48, 128, torch.float16, False, True),
    (33, 48, 128, torch.bfloat16, True, True), (5, 64, 64, torch.bfloat16, False, False),
])  # fmt: skip
def test_tma_is_the_two_launch_path(fp8, m, n, k, dtype, bias, per_tensor, launches):
    w, w_s, fmt = _weight(fp8, n, k, per_tensor)
    x = (torch.randn(m, k) * torch.logspace(-2, 2, m)[:, None]).to(dtype)
    b = torch.randn(n).to(dtype) if bias else None
    tma = _run("tma", x, w, w_s, b, fp8)
    two = _run("triton", x, w, w_s, b, fp8)
    assert launches == ["_tma_scaled_mm_kernel", "_scaled_mm_kernel"]
    assert not tma.isnan().any()  # every tile of the NaN-poisoned output was written
    if fp8:  # fp32 sums of exact e4m3 products: equal up to the accumulation order
        assert_rel_close(tma, two, 1e-6, f"e4m3 M={m} N={n} K={k} against two launches")
    else:  # exact int32 sums, the same fp32 epilogue
        assert torch.equal(tma, two), (tma - two).abs().max()
    assert_rel_close(tma, _ref(x, w, w_s, b, fmt), BOUND[dtype], f"{fmt} M={m} N={n} K={k}")


def test_the_descriptor_is_cached_per_weight_and_rebuilt_when_it_changes(monkeypatch):
    built = []
    real = tt.weight_nk
    monkeypatch.setattr(tt, "weight_nk", lambda w: built.append(w.dtype == torch.float8_e4m3fn) or real(w))
    w, w_s, _ = _weight(False, 48, 64, False)
    x = torch.randn(5, 64)
    gc.collect()  # earlier tests' weights
    before = tt.cached_descriptors()
    first = _run("tma", x, w, w_s, None, False)
    again = _run("tma", x, w, w_s, None, False)
    assert built == [False] and tt.cached_descriptors() == before + 1 and torch.equal(first, again)
    assert tt.weight_descriptor(w, False, 32, 32) is tt.weight_descriptor(w, False, 32, 32)
    w[3, 7] ^= 0x01010101  # in place: four codes of column 7 change
    changed = _run("tma", x, w, w_s, None, False)
    assert built == [False, False] and tt.cached_descriptors() == before + 1
    assert torch.equal(changed, _run("triton", x, w, w_s, None, False)) and not torch.equal(changed, first)
    del w
    gc.collect()
    assert tt.cached_descriptors() == before  # the entry died with the weight's storage


def test_a_k_contiguous_weight_is_its_own_descriptor_base_and_is_never_cached():
    """`QuantLinear`'s e4m3 and W8A8 int8 buffers are [N, K]: the descriptor is over the weight itself, built per
    call, and no cache entry holds it (one did for e4m3 before: the weight outlived its model)."""
    gc.collect()
    before = (tt.cached_descriptors(), torch_mm.cached_weight_copies())
    for fp8 in (True, False):
        w, w_s, _ = _weight(fp8, 64, 64, False)
        buf = w.t().view(torch.int8) if fp8 else qf.int8_codes_nk(w)  # [N, K], as QuantLinear keeps them
        wk = buf.view(torch.float8_e4m3fn).t() if fp8 else buf.t()
        x = torch.randn(5, 64)
        assert torch.equal(_run("tma", x, wk, w_s, None, fp8), _run("triton", x, wk, w_s, None, fp8))
        assert tt.weight_descriptor(wk, fp8, 32, 32).base.data_ptr() == buf.data_ptr()
        assert (tt.cached_descriptors(), torch_mm.cached_weight_copies()) == before
        ref = weakref.ref(buf.untyped_storage())
        del w, buf, wk
        gc.collect()
        assert ref() is None  # nothing kept the weight alive


def _choose(m: int, k: int = 128, fp8: bool = False) -> str:
    return qt.choose_scaled_mm_variant(m, 64, k, fp8, torch.float32, torch.device("cpu"))


def test_the_rule_takes_tma_only_on_hopper_at_large_m(monkeypatch):
    assert _choose(tt.TMA_MIN_M) == "triton" and _choose(4096) == "torch"  # never on CPU by default
    with use_device_view(HOPPER):
        assert _choose(tt.TMA_MIN_M - 1) == "triton" and _choose(tt.TMA_MIN_M) == "tma"
        assert _choose(4096) == "tma"  # predicted over torch's int8 path
        assert (
            _choose(4096, fp8=True) == "torch" and _choose(512, fp8=True) == "tma"
        )  # not over cuBLASLt's e4m3
        assert _choose(4096, k=120) == "torch" and _choose(512, k=120) == "triton"  # K % 16: never TMA
        assert _choose(4) == "fusedq"
        with monkeypatch.context() as patch:  # a tuned table saying torch, on a call torch cannot take
            patch.setattr(qt, "lookup_config", lambda *a: {"TORCH": 1})
            patch.setattr(torch_mm, "why_not", lambda *a: "cannot")
            assert _choose(4096) == "tma"
            patch.setattr(qt, "lookup_config", lambda *a: {"TMA": 1})  # one saying tma where TMA cannot
            assert _choose(4096, k=120) == "triton"
    with use_device_view(DeviceView(gpu=True, sms=108, capability=(8, 0), min_dot_rows=16, bf16_dot=True)):
        assert _choose(4096) == "torch" and _choose(512) == "triton"  # sm_80: no TMA
    with forced_config(qt.scaled_mm_variant_op(True), {"TMA": 1}):  # forceable on CPU (for these tests)
        assert _choose(3, fp8=True) == "tma"
    assert qt.scaled_mm_variant_entry("tma") == {"TORCH": 0, "FUSEDQ": 0, "TMA": 1}


def test_shapes_tma_cannot_take_are_refused_with_the_reason():
    cpu_view = DeviceView(interpreted=True)
    assert "multiple of 16" in tt.why_not(5, 48, 40, cpu_view)
    assert "sm_90+" in tt.why_not(5, 48, 64, DeviceView(gpu=True, capability=(8, 9)))
    raw = torch.zeros(5 * 128, dtype=torch.int8)
    assert "16-byte-aligned" in tt.why_not(5, 48, 64, cpu_view, raw[1 : 1 + 5 * 64].view(5, 64))
    assert "contiguous" in tt.why_not(5, 48, 64, cpu_view, raw[: 5 * 128].view(5, 128)[:, :64])
    assert tt.why_not(5, 48, 64, cpu_view, raw[16 : 16 + 5 * 64].view(5, 64)) == ""
    w, w_s, _ = _weight(False, 48, 40, False)
    with pytest.raises(CodesignError, match=r"tma variant of the w8a8 GEMM cannot run: .*multiple of 16"):
        _run("tma", torch.randn(5, 40), w, w_s, None, False)
    # Codes at an address TMA cannot take: forced, the reason; unforced, ours takes them.
    w, w_s, _ = _weight(False, 48, 64, False)
    aq, a_s = qf.quantize_per_token(torch.randn(5, 64), "int8")
    odd = raw[1 : 1 + 5 * 64].view(5, 64)
    odd.copy_(aq)
    out = torch.full((5, 48), float("nan"))
    with use_backend("triton"), forced_config(qt.scaled_mm_variant_op(False), {"TMA": 1}):
        with pytest.raises(CodesignError, match="16-byte-aligned"):
            qt.scaled_mm(odd, a_s, w, w_s, None, out)
    with use_backend("triton"):
        qt.scaled_mm(odd, a_s, w, w_s, None, out, "tma")
    two = torch.empty_like(out)
    with use_backend("triton"):
        qt.scaled_mm(aq, a_s, w, w_s, None, two, "triton")
    assert torch.equal(out, two)


def test_a_stale_descriptor_is_caught():
    """Teeth: a cache that missed an in-place change of the weight (the mutation: its entry's version made to
    match) gives an output the comparison with the two-launch path refuses."""
    w, w_s, _ = _weight(False, 48, 64, False)
    x = torch.randn(5, 64)
    _run("tma", x, w, w_s, None, False)
    w[0, :] ^= 0x02020202  # the first four K codes of every column change
    for entry in tt._CACHE[w.untyped_storage()].values():
        entry.version = w._version
    assert not torch.equal(_run("tma", x, w, w_s, None, False), _run("triton", x, w, w_s, None, False))


@pytest.mark.slow
@pytest.mark.lowering
def test_the_tma_gemm_lowers_for_sm90_to_tma_and_wgmma_without_spills():
    """At the GPU default config the kernel compiles for sm_90 (bf16 activations, int8 by the default rule at
    M = 1024, e4m3 forced, M and N not multiples of the tile) to bulk tensor copies and wgmma on s8 / e4m3
    operands, no spills; a 32-row tile falls back to mma.sync (wgmma takes 64 rows a warpgroup)."""
    from helpers import assert_runs_without_interpreter

    code = """
import torch
from codesign.autotune.compile_only import compile_only
from codesign.autotune.lookup import forced_config
from codesign.kernels.gemm import formats as qf
from codesign.kernels.gemm import triton_gemm as qt
from codesign.kernels.gemm.ops import quant_matmul
small = {"BLOCK_M": 32, "BLOCK_N": 128, "BLOCK_K": 128, "GROUP_M": 8, "num_warps": 4, "num_stages": 4}
with compile_only(90, "NVIDIA H200") as s:
    for fmt in ("int8", "fp8_e4m3"):
        qw = qf.quantize_rtn(torch.randn(1000, 1024), fmt, None, True, torch.float32)
        with forced_config(qt.scaled_mm_variant_op(fmt != "int8"), {"TMA": 1}):
            quant_matmul(torch.randn(1000, 1024, dtype=torch.bfloat16), qw, act_quant=True)
            with forced_config(qt.scaled_mm_table_op(fmt != "int8", "tma"), small):
                quant_matmul(torch.randn(1000, 1024, dtype=torch.bfloat16), qw, act_quant=True)
    qw = qf.quantize_rtn(torch.randn(1000, 1024), "int8", None, True, torch.float32)
    quant_matmul(torch.randn(1024, 1024, dtype=torch.bfloat16), qw, act_quant=True)  # the rule: tma
tma = [l for l in s.launches if l.kernel == "_tma_scaled_mm_kernel"]
assert len(tma) == 5, [l.kernel for l in s.launches]
default = qt._GPU_DEFAULTS["tma"]
for l in tma[:1] + tma[2:3] + tma[4:]:
    assert l.constexprs["BLOCK_M"] == default["BLOCK_M"] and l.num_warps == default["num_warps"], l
    assert l.problems() == [] and l.spill_stores == 0 and 0 < l.registers <= 255, l
    assert l.ptx_ops["tma"] > 0 and l.ptx_ops["wgmma_8bit"] == l.ptx_ops["wgmma"] > 0, l.ptx_ops
    assert l.ptx_ops["mma_sync"] == 0, l.ptx_ops
for l in (tma[1], tma[3]):
    assert l.ptx_ops["wgmma"] == 0 and l.ptx_ops["mma_sync"] > 0 and l.ptx_ops["tma"] > 0, l.ptx_ops
print("ok")
"""
    assert_runs_without_interpreter(code)
