"""The KV quantization engine RTL is bit- and cycle-exact against codesign.accel_model.kv_quant_engine.

Each case builds rtl/kv_quant_engine.v (with fp32_add, fp32_div, delay_line) for one configuration
on one simulator and runs kv_quant/tb_kv_quant.py: four back-to-back jobs (hand-made corner
vectors, keys with channel outliers, plain values), every packed byte, fp16 scale/zero pattern
and outlier compared with `quantize_per_token` / `quantize_oaken` + `pack_codes`, and start ->
done with `kvq_cost` on a KVWrite (engine depth = kv_quant_control.rtl_depth). The teeth tests
inject a one-line fault; bad configurations fail before any simulator starts.
"""

from __future__ import annotations

import sys

import numpy as np
import pytest
from hdl_bench_kvq import KVQ_JOBS, KVQ_TEETH, KVQConfig, kvq_bench, kvq_matrix
from hdl_sim import HDL_DIR, matrix_cases, run_bench

from codesign.accel_model import kv_quant_control, kv_quant_engine
from codesign.specs import KVFormat, KVWrite
from codesign.specs.errors import CodesignError


@pytest.mark.parametrize(("simulator", "cfg"), matrix_cases(kvq_matrix))
def test_kv_quant_rtl_matches_model(simulator, cfg, hdl_seed, require_simulator):
    require_simulator(simulator)
    result = run_bench(kvq_bench(cfg), simulator, hdl_seed)
    assert result.passed, result.summary()
    assert [r["t"] for r in result.records] == [2 * t * h for _, t, h in KVQ_JOBS]
    if cfg.oaken:  # the corner job sends outliers and over-budget vectors
        assert result.records[0]["outliers"] > 0 and result.records[0]["overflow_vectors"] > 0


@pytest.mark.parametrize("cfg", KVQ_TEETH, ids=lambda c: f"fault{c.fault}")
def test_kv_quant_bench_catches_injected_fault(cfg, hdl_seed, require_simulator):
    require_simulator("icarus")
    result = run_bench(kvq_bench(cfg), "icarus", hdl_seed)
    assert not result.passed, f"bench passed with FAULT={cfg.fault} injected: it has no teeth"
    if cfg.fault == 1:  # round half up: the ties vectors' codes differ, the timing does not
        assert not result.records[0]["bits_ok"] and all(r["cycles_ok"] for r in result.records)
    else:  # slot counter one cycle long: every multi-vector job takes longer than the model says
        assert not any(r["cycles_ok"] for r in result.records), result.records


def test_rtl_depth_and_cycle_formula():
    """The engine's start -> done formula (kv_quant_control docstring) equals kvq_cost's."""
    assert kv_quant_control.rtl_depth(4) == 2 * 9 + 4
    for lanes, d, max_out, ports, tokens, heads in [
        (4, 16, 2, 1, 3, 2),
        (8, 16, 3, 1, 2, 1),
        (1, 8, 1, 1, 1, 1),
    ]:
        pv = kv_quant_control.per_vector(d, lanes, max_out, ports)
        fmt = KVFormat(
            dtype="int4", scheme="oaken", outlier_fraction=kv_quant_control.outlier_fraction(max_out, d)
        )
        spec = KVWrite(tokens=tokens, kv_heads=heads, head_dim=d, kv_format=fmt)
        cost = kv_quant_engine.kvq_cost(kv_quant_control.rtl_engine_spec(lanes, ports), spec)
        assert cost.cycles == 2 * tokens * heads * pv + d // lanes + kv_quant_control.rtl_depth()


def test_corner_vectors_hit_their_corners():
    """The hand-made vectors do what the bench claims, checked in float64 (independent of the model)."""
    sys.path.insert(0, str(HDL_DIR / "kv_quant"))
    from kvq_vectors import corner

    for bits in (2, 4, 8):
        x, names = corner(np.random.default_rng(bits), 9, 16, bits, False, 0)
        qmax = 2**bits - 1
        v = dict(zip(names, x.astype(np.float64)))
        for name, s in (("ties", 2.0**-3), ("ties_shift", 2.0**-4)):
            y = (v[name] - v[name].min()) / s
            assert (v[name].max() - v[name].min()) / qmax == s  # the scale is exactly s
            inner = y[(y > 0) & (y < qmax)]  # all but the two ends sit exactly on k + 1/2
            assert np.all(inner % 1 == 0.5) and inner.size == 14
        sub_scale = (v["subnormal"].max() - v["subnormal"].min()) / qmax
        assert 0 < sub_scale < 2.0**-14  # an fp16 subnormal scale
        assert 0 < (v["scale_zero"].max() - v["scale_zero"].min()) / qmax < 2.0**-25  # rounds to fp16 zero
        assert np.float16((v["scale_zero"].max() - v["scale_zero"].min()) / qmax) == 0
        assert np.ptp(v["constant"]) == 0 and len(set(v["two_values"].tolist())) == 2
    assert not np.any(np.signbit(x) & (x == 0))  # no -0 anywhere


@pytest.mark.parametrize(
    ("cfg", "match"),
    [
        (KVQConfig(3, 16, 4), "multiple of lanes"),
        (KVQConfig(2, 6, 2), "whole bytes"),
        (KVQConfig(4, 16, 3), "bits"),
        (KVQConfig(0, 16, 4), "lanes"),
        (KVQConfig(4, 512, 4), "head_dim"),
        (KVQConfig(4, 16, 4, oaken=True, max_outliers=0), "max_outliers"),
        (KVQConfig(4, 16, 4, oaken=True, max_outliers=2, ports=3), "outlier_ports"),
        (KVQConfig(4, 16, 4, oaken=True, max_outliers=17), "max_outliers"),
        (KVQConfig(4, 16, 4, div_step=28), "div_step"),
        (KVQConfig(4, 16, 4, fault=3), "fault"),
    ],
)
def test_unsupported_kv_quant_config_fails_before_build(cfg, match):
    with pytest.raises(CodesignError, match=match):
        kvq_bench(cfg)


def test_engine_number_formats_match_numpy(tmp_path):
    """The engine's fp16 <-> fp32 conversions and rint-and-clamp against numpy, on every finite fp16
    pattern (fp16 -> fp32), 8000 fp32 values whose fp16 rounding lands on normals, subnormals, zero
    and exact ties (fp32 -> fp16, the scale path), and quotients around every code incl. k + 1/2."""
    import shutil
    import subprocess

    if shutil.which("iverilog") is None:
        pytest.skip("iverilog not found (apt-get install iverilog)")
    bits = 8  # the clamp is checked both ways: codes 256..511 (rounded > qmax) and >= 512 (exponent)
    rng = np.random.default_rng(8)
    n = 8000
    exp = rng.integers(95, 142, n).astype(np.uint32)  # fp16 subnormal (< 113) to near 2^15
    frac = rng.integers(0, 1 << 23, n).astype(np.uint32)
    frac[::4] = (frac[::4] & ~np.uint32(0x1FFF)) | np.uint32(0x1000)  # ties of the fp16 normal rounding
    frac[1::4] &= ~np.uint32(0x3FF)  # short significands: exact and tie cases of the subnormal rounding
    f32 = np.concatenate([(exp << np.uint32(23)) | frac, np.array([0], np.uint32)])
    f16 = np.array([x for x in range(1 << 16) if (x >> 10) & 31 != 31], np.uint16)  # every finite fp16
    k = np.arange(0, 2**bits + 3, dtype=np.float32)
    q = np.concatenate(
        [rng.uniform(-2, 1000, n), k, k + 0.5, np.nextafter(k + 0.5, np.float32(0)), -k - 0.5]
    ).astype(np.float32)
    for name, arr, fmt in (("f32", f32, "%08x"), ("f16", f16, "%04x"), ("q", q.view(np.uint32), "%08x")):
        np.savetxt(tmp_path / f"{name}.hex", arr, fmt=fmt)
    rtl = HDL_DIR / "rtl"
    defines = [f"-DBITS={bits}", f"-DN32={len(f32)}", f"-DN16={len(f16)}", f"-DNQ={len(q)}"]
    sources = [HDL_DIR / "kv_quant" / "tb_formats.v"] + [
        rtl / s for s in ("kv_quant_engine.v", "fp32_add.v", "fp32_div.v", "delay_line.v")
    ]
    cmd = [
        "iverilog",
        "-g2005",
        "-s",
        "tb_formats",
        "-o",
        str(tmp_path / "tb.vvp"),
        *defines,
        *map(str, sources),
    ]
    subprocess.run(cmd, check=True, capture_output=True, timeout=120)
    subprocess.run(
        ["vvp", "-n", str(tmp_path / "tb.vvp")], check=True, cwd=tmp_path, capture_output=True, timeout=300
    )
    out = np.array([int(w, 16) for w in (tmp_path / "out.hex").read_text().split()], np.uint32)
    got16, got32, got_code = np.split(out, [len(f32), len(f32) + len(f16)])
    with np.errstate(over="ignore"):
        want16 = f32.view(np.float32).astype(np.float16).view(np.uint16)
    assert np.array_equal(got16, want16), np.flatnonzero(got16 != want16)[:5]
    assert ((want16 & 0x7C00) == 0).sum() > n // 4  # many subnormal (and zero) fp16 results
    assert np.array_equal(got32, f16.view(np.float16).astype(np.float32).view(np.uint32))
    assert np.array_equal(got_code, np.clip(np.rint(q), 0, 2**bits - 1).astype(np.uint32))
