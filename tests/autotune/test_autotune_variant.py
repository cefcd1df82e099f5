"""The weight-only GEMM's variant (GEMV, split-K, tiled or dequantize-then-matmul) as a tuned choice, and the
W8A8 / FP8 GEMMs' variants (ours in two launches, the quantizer fused, torch's) expanded the same way.

The tuner times each variant in its own space (a shape pins one with SPLITK / DEQUANT / GEMV; `expand` gives
all),
`export_variant_table` writes the faster variant per (shape key, M), and `wq_gemm` reads that table
through `choose_variant`. Tables are per GPU, so to show a table steering the kernel on a CPU the tests
name the interpreter's "GPU" (`tuner.CPU_GPU_NAME`) as the device's (`codesign.backend.use_device_view`).
"""

from __future__ import annotations

import json

import pytest
import torch
from helpers import assert_rel_close, device_view_with, spy_launches
from triton_lowering import assert_lowers_for_gpu

from codesign import cli
from codesign.autotune import lookup
from codesign.autotune.cache import TuningCache
from codesign.autotune.export import export_table, export_variant_table
from codesign.autotune.lookup import forced_config, kernel_source_hash
from codesign.autotune.ops import expand_variants, get_op
from codesign.autotune.space import DeviceLimits
from codesign.autotune.tuner import CPU_GPU_NAME, rel_error
from codesign.backend import use_backend
from codesign.kernels.gemm import formats as qf
from codesign.kernels.gemm import ops as qg
from codesign.kernels.gemm import triton_gemm as qt
from codesign.specs import CodesignError

N, K, G = 80, 256, 64
KEY = f"G={G},K={K},N={N}"


@pytest.fixture
def launched(monkeypatch):
    """Records the variant of every weight-only GEMM launch ("splitk" / "tiled")."""
    def variant(name, grid, kw):
        return "splitk" if kw["SPLITK"] else "tiled"

    return spy_launches(monkeypatch, ((qt, "_wq_kernel"),), variant)


def _reference(x, qw):
    return x.double() @ qw.dequantize(torch.float64).t()


@pytest.mark.parametrize("m", [3, 19])
@pytest.mark.parametrize("splitk", [1, 0])
def test_a_pinned_variant_is_the_one_that_runs_and_is_correct(m, splitk, launched):
    op = get_op("w4a16_gemm")
    shape = {"M": m, "N": N, "K": K, "G": G, "SPLITK": splitk}
    op.check_shape(shape)
    assert op.table_op(shape) == f"w4a16_gemm_{'splitk' if splitk else 'tiled'}"
    assert op.table_key(shape) == KEY  # the variant is not part of the key
    cand = op.space(shape, torch.float32, False).candidates(DeviceLimits(name="cpu-interpreter"))[-1]
    inputs = op.make_inputs(shape, torch.float32, "cpu", 2)
    op.poison(inputs)
    with use_backend("triton"):
        out = op.run(inputs, cand)
    assert launched == ["splitk" if splitk else "tiled"]
    assert rel_error(out, op.reference(inputs)) <= op.tolerance(torch.float32)


def test_expand_gives_both_variants_and_bad_variants_are_refused():
    op = get_op("w8a16_gemm")
    s = {"M": 7, "N": 64, "K": 128, "G": 0}
    dq, gv = {"SPLITK": 0, "DEQUANT": 1}, {"SPLITK": 0, "GEMV": 1}
    assert op.expand(s) == [{**s, "SPLITK": 1}, {**s, "SPLITK": 0}, {**s, **dq}, {**s, **gv}]
    assert op.expand({**s, "SPLITK": 0}) == [{**s, "SPLITK": 0}]
    assert expand_variants(op, [s, {**s, "M": 40}]) == [
        {**s, "SPLITK": 1}, {**s, "SPLITK": 0}, {**s, **dq}, {**s, **gv},
        {**s, "M": 40, "SPLITK": 1}, {**s, "M": 40, "SPLITK": 0}, {**s, "M": 40, **dq}, {**s, "M": 40, **gv},
    ]  # fmt: skip
    assert [op.table_op(v) for v in op.expand(s)] == [
        "w8a16_gemm_splitk", "w8a16_gemm_tiled", "w8a16_gemm_dequant", "w8a16_gemm_gemv"
    ]  # fmt: skip
    w8a8 = get_op("w8a8_gemm")
    t = {"M": 1, "N": 64, "K": 128}
    fused = {**t, "TORCH": 0, "FUSEDQ": 1}
    tma = {**t, "TORCH": 0, "TMA": 1}
    assert expand_variants(w8a8, [t]) == [{**t, "TORCH": 0}, {**t, "TORCH": 1}, fused, tma]
    assert [w8a8.table_op(v) for v in w8a8.expand(t)] == [
        "w8a8_gemm", "w8a8_gemm_torch", "w8a8_gemm_fusedq", "w8a8_gemm_tma"
    ]  # fmt: skip
    assert len(w8a8.expand({**t, "K": 100})) == 3  # K % 16: no TMA variant
    assert w8a8.expand(fused) == [fused] and w8a8.expand({**t, "FUSEDQ": 0}) == [{**t, "FUSEDQ": 0}]
    assert w8a8.table_op(t) == "w8a8_gemm_fusedq" and w8a8.table_op({**t, "M": 17}) == "w8a8_gemm"  # the rule
    assert [get_op("fp8_gemm").table_op(v) for v in w8a8.expand(t)][2] == "fp8_gemm_fusedq"
    assert w8a8.variant_configs == {
        "w8a8_gemm": {"TORCH": 0, "FUSEDQ": 0, "TMA": 0}, "w8a8_gemm_torch": {"TORCH": 1, "FUSEDQ": 0, "TMA": 0},
        "w8a8_gemm_fusedq": {"TORCH": 0, "FUSEDQ": 1, "TMA": 0}, "w8a8_gemm_tma": {"TORCH": 0, "FUSEDQ": 0, "TMA": 1},
    }  # fmt: skip
    with pytest.raises(CodesignError, match="SPLITK must be 1"):
        op.check_shape({**s, "SPLITK": 2})
    with pytest.raises(CodesignError, match="one pin at most"):
        op.check_shape({**s, "SPLITK": 1, "DEQUANT": 1})
    with pytest.raises(CodesignError, match="one pin at most"):
        op.check_shape({**s, "GEMV": 1, "DEQUANT": 1})
    with pytest.raises(CodesignError, match="TORCH must be 1"):
        w8a8.check_shape({**t, "TORCH": 2})
    with pytest.raises(CodesignError, match="one pin at most"):
        w8a8.check_shape({**t, "TORCH": 1, "FUSEDQ": 1})
    with pytest.raises(CodesignError, match="FUSEDQ 1"):
        w8a8.check_shape({**t, "FUSEDQ": 2})
    with pytest.raises(CodesignError, match="one pin at most"):
        w8a8.check_shape({**t, "FUSEDQ": 1, "TMA": 1})
    with pytest.raises(CodesignError, match="TMA needs K a multiple of 16"):
        w8a8.check_shape({**t, "K": 100, "TMA": 1})
    with pytest.raises(CodesignError, match="shape for w8a16_gemm"):
        op.check_shape({**s, "SPLIT": 1})


def test_default_rule_without_a_table():
    # No device, a CPU device, or an unknown key: the GEMV at M <= 2, M <= 16 split-K, from 1024
    # dequantize-then-matmul (W4A16 and W8A16 alike).
    want = {1: "gemv", 2: "gemv", 3: "splitk", 4: "splitk", 16: "splitk", 17: "tiled", 1023: "tiled", 1024: "dequant"}
    for m in want:
        assert qt.choose_variant(m) == want[m]
        assert qt.choose_variant(m, "w4a16_gemm", torch.device("cpu"), KEY) == want[m]
        assert qt.choose_variant(m, "w8a16_gemm", torch.device("cpu"), KEY) == want[m]
    with forced_config("w4a16_gemm_variant", {"SPLITK": 0}):
        assert qt.choose_variant(1) == "tiled"


def _record(cache, table_op, m, config, ms):
    cache.append({"gpu": CPU_GPU_NAME, "triton": lookup.triton_version(),
                  "source_hash": kernel_source_hash(get_op("w4a16_gemm").source_modules), "op": table_op,
                  "key": KEY, "m": m, "dtype": "float32", "config": config, "ok": True, "time_ms": ms})  # fmt: skip


def test_an_exported_variant_table_changes_which_variant_runs(tmp_path, monkeypatch, launched):
    """Timings (synthetic, written as the tuner writes them) make tiled win at M = 3 and split-K at
    M = 40, the opposite of the default rule; the exported tables then steer the kernel both ways."""
    op = get_op("w4a16_gemm")
    cache = TuningCache(tmp_path / "c.jsonl")
    splitk_cfg, tiled_cfg = qt._INTERP_DEFAULTS["splitk"], qt._INTERP_DEFAULTS["tiled"]
    for m, t_splitk, t_tiled in ((3, 2.0, 1.0), (40, 1.0, 3.0)):
        _record(cache, "w4a16_gemm_splitk", m, splitk_cfg, t_splitk)
        _record(cache, "w4a16_gemm_splitk", m, {**splitk_cfg, "SPLIT_K": 1}, t_splitk + 0.5)  # slower
        _record(cache, "w4a16_gemm_tiled", m, tiled_cfg, t_tiled)
        _record(cache, "w4a16_gemm_dequant", m, qt._INTERP_DEFAULTS["dequant"], 9.0)  # never the fastest here
        _record(cache, "w4a16_gemm_gemv", m, qt._INTERP_DEFAULTS["gemv"], 8.0)
    _record(cache, "w4a16_gemm_tiled", 64, tiled_cfg, 1.0)  # split-K never timed at 64: no variant entry
    root = tmp_path / "tables"
    for t in op.variant_configs:
        export_table(cache, CPU_GPU_NAME, t, op.source_modules, "float32", root)
    path = export_variant_table(
        cache, CPU_GPU_NAME, op.variant_op, op.variant_configs, op.source_modules, "float32", root
    )
    table = json.loads(path.read_text())
    tiled, splitk = qt.wq_variant_entry("tiled"), qt.wq_variant_entry("splitk")
    assert table["entries"] == {KEY: {"3": tiled, "40": splitk}}
    want = {"w4a16_gemm_dequant": 9.0, "w4a16_gemm_gemv": 8.0, "w4a16_gemm_splitk": 2.0, "w4a16_gemm_tiled": 1.0}
    assert table["timings_ms"][KEY]["3"] == want

    qw = qf.quantize_rtn(torch.randn(N, K), "int4", G, False)
    monkeypatch.setenv("CODESIGN_CONFIG_DIR", str(root))
    lookup.reload_tables()
    with use_backend("triton"):
        for m in (5, 40):
            qg.quant_matmul(torch.randn(m, K), qw)  # CPU: no table is read, the default rule runs
        assert launched == ["splitk", "tiled"]
        launched.clear()
        with device_view_with(gpu_name=CPU_GPU_NAME):  # the tables' GPU
            for m, want in ((3, "tiled"), (2, "tiled"), (40, "splitk"), (33, "splitk")):  # nearest tuned M
                x = torch.randn(m, K)
                y = qg.quant_matmul(x, qw)
                assert launched.pop() == want, f"M={m}"
                assert_rel_close(y, _reference(x, qw), 1e-4, f"M={m} {want}")
    lookup.reload_tables()


def test_no_variant_entry_unless_every_variant_was_timed(tmp_path):
    op = get_op("w4a16_gemm")
    cache = TuningCache(tmp_path / "c.jsonl")
    _record(cache, "w4a16_gemm_splitk", 8, qt._INTERP_DEFAULTS["splitk"], 1.0)
    _record(cache, "w4a16_gemm_tiled", 9, qt._INTERP_DEFAULTS["tiled"], 1.0)  # another M
    args = (op.variant_op, op.variant_configs, op.source_modules, "float32", tmp_path / "t")
    assert export_variant_table(cache, CPU_GPU_NAME, *args) is None
    assert not (tmp_path / "t").exists()


def test_cli_tunes_every_variant_and_exports_the_fastest(tmp_path):
    """End to end through the interpreter (CPU timer): `--variants all` times the four variants at M = 3, the
    export writes five tables, and the variant table names the fastest variant."""
    cache, out = tmp_path / "c.jsonl", tmp_path / "tables"
    argv = ["tune", "--op", "w4a16_gemm", "--shape", f"M=3,N={N},K={K},G={G}", "--variants", "all",
            "--device", "cpu", "--cache", str(cache), "--strategy", "random", "--max-evals", "1",
            "--export", "--out-dir", str(out)]  # fmt: skip
    assert cli.main(argv) == 0
    folder = out / lookup.gpu_slug(CPU_GPU_NAME)
    assert sorted(p.name for p in folder.iterdir()) == [
        "w4a16_gemm_dequant.json", "w4a16_gemm_gemv.json", "w4a16_gemm_splitk.json", "w4a16_gemm_tiled.json",
        "w4a16_gemm_variant.json",
    ]  # fmt: skip
    recs = TuningCache(cache).load().records
    assert sorted(r["op"] for r in recs) == [f"w4a16_gemm_{v}" for v in ("dequant", "gemv", "splitk", "tiled")]
    assert all(r["ok"] for r in recs)
    best = {r["op"]: r["time_ms"] for r in recs}
    fastest = min(best, key=best.get)
    table = json.loads((folder / "w4a16_gemm_variant.json").read_text())
    assert table["entries"] == {KEY: {"3": qt.wq_variant_entry(fastest.rsplit("_", 1)[1])}}
    assert lookup.table_key_problem(table) is None
    # Exporting again from the cache alone rewrites the same three tables (and the variant one).
    assert (
        cli.main(["tune", "--export", "--device", "cpu", "--cache", str(cache), "--out-dir", str(out)]) == 0
    )
    assert json.loads((folder / "w4a16_gemm_variant.json").read_text())["entries"] == table["entries"]


@pytest.mark.slow
def test_weight_only_kernel_lowers_for_sm90_in_both_variants():
    """The one weight-only kernel compiles for a GPU with either variant (the interpreter cannot show it)."""
    types = {"x_ptr": "*fp16", "qw_ptr": "*i32", "s_ptr": "*fp16", "z_ptr": "*fp16", "b_ptr": "*fp16",
             "out_ptr": "*fp16", "sum_ptr": "*fp32", "cnt_ptr": "*i32"}  # fmt: skip
    common = dict(
        BITS=4, HAS_ZEROS=True, HAS_BIAS=True, DOT_DTYPE="tl.float16", DOT_PREC="tf32", BLOCK_N=64, BLOCK_K=64,
        GROUP_M=8,
    )
    variants = [
        {**common, "BLOCK_M": 64, "SPLITK": False, "USE_ATOMIC": False},
        {**common, "BLOCK_M": 64, "SPLITK": False, "USE_ATOMIC": False, "MAGIC_DQ": True},
        {**common, "BLOCK_M": 16, "SPLITK": True, "USE_ATOMIC": True},
    ]
    assert_lowers_for_gpu("codesign.kernels.gemm.triton_gemm:_wq_kernel", types, variants)
