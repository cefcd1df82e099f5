"""Designs as YAML (load, validation errors naming file and field) and evaluate() golden numbers.

Every golden number below is re-derived by hand in the comment next to it, from the design's YAML
and the formulas in the model docstrings (not copied from a run of the code).
"""

from __future__ import annotations

import math

import pytest
import yaml

from codesign.accel_model.design import DESIGN_DIR, builtin_designs, design_from_dict, load_design
from codesign.accel_model.evaluate import evaluate, gemm_compute_cycles, sram_words
from codesign.specs import (
    ALL_SPECS,
    AllReduce,
    AllToAll,
    CausalConv1d,
    CodesignError,
    Elementwise,
    Embedding,
    GatedDeltaRule,
    Gemm,
    KVDequantize,
    KVFormat,
    KVWrite,
    MoERouter,
    Norm,
    PagedDecodeAttention,
    PagedExtendAttention,
    PrefillAttention,
    RoPE,
    Sampling,
    SelectiveScan,
    Softmax,
    SSDScan,
    TreeAttention,
    WeightFormat,
)

# Refresh: 1 - (nRTP + nRP + nRFC + nRCD) / nREFI. HBM2E at tCK 0.625 ns: (8 + 23 + 256 + 23) / 6240;
# HBM2 at 0.8333 ns: (6 + 17 + 192 + 17) / 4680.
REFRESH = 1 - 310 / 6240
REFRESH_HBM2 = 1 - 232 / 4680


def test_builtin_designs_load():
    names = builtin_designs()
    assert {"tpu_like", "gpu_like", "hbm_pim", "oaken_like", "attacc_like"} <= set(names)
    for n in names:
        d = load_design(n)
        assert d.name == n and d.source == f"{n}.yaml"
        assert all(v > 0 for v in d.area_mm2().values())
    assert load_design("hbm_pim").pim.units == 4 * 128
    assert load_design("oaken_like").kv_quant.count == 64


def test_gemm_fallback_matches_scalesim_lut_rows_and_systolic_model():
    # Rows of ../shared/reference-data/scalesim-os-lut (SCALE-Sim 3.0 output-stationary, stall-free).
    assert gemm_compute_cycles(64, 16, 4096, 128, 128, "os") == 4349
    assert gemm_compute_cycles(32, 32, 128, 16, 16, "os") == 631
    assert gemm_compute_cycles(8, 32, 1024, 32, 32, "os") == 1085
    assert gemm_compute_cycles(0, 32, 1024, 32, 32, "os") == 0
    systolic = pytest.importorskip("codesign.accel_model.systolic.model")
    for df in ("os", "ws", "is"):
        for m, n, k in ((5, 96, 64), (130, 7, 300), (1, 4096, 128)):
            assert gemm_compute_cycles(m, n, k, 32, 16, df) == systolic.compute_cycles(m, n, k, 32, 16, df)


def test_sram_counts_match_systolic_model():
    systolic = pytest.importorskip("codesign.accel_model.systolic.model")
    for df in ("os", "ws", "is"):
        arr = systolic.SystolicArray(rows=8, cols=4, dataflow=df)
        for m, n, k in ((13, 7, 21), (5, 30, 9), (1, 3, 40)):
            c = systolic.gemm_cost(Gemm(m, n, k), arr)
            ifmap, filt, ofmap = sram_words(m, n, k, 8, 4, df)
            assert (c.ifmap_sram_reads, c.filter_sram_reads) == (ifmap, filt)
            if df != "os":  # os: the systolic model adds R + C drain entries per fold (see sram_words)
                assert c.ofmap_sram_writes == ofmap


def test_golden_gpu_like_gemv_is_memory_bound():
    r = evaluate(load_design("gpu_like"), Gemm(16, 4096, 4096))
    # Compute: 108 arrays split N: ceil(4096 / 108) = 38 -> os folds 1 x 2, (32 + 32 + 4096 - 2) x 2 - 1
    # = 8315 cycles at 1.41 GHz = 5.897 us.
    assert r.utilisation["systolic"] * r.seconds == pytest.approx(8315 / 1.41e9)
    # DRAM: 16x4096 fp16 in + 4096^2 fp16 W + 16x4096 fp16 out = 33,816,576 B; W (32 MiB) exceeds the
    # 10368 KiB filter buffer -> 4 chunks, activations re-read 3 more times (+393,216 B) = 34,209,792 B.
    assert r.traffic["dram"] == 34_209_792
    # 1,069,056 bursts of 32 B over 80 pseudo-channels -> 13364 on the busiest; t_burst = nBL = 2:
    # (23 + 23 + 2 + 13363 x 2) / REFRESH = 28173.7 cycles x 0.625 ns = 17.6085 us.
    assert r.seconds == pytest.approx((48 + 13363 * 2) / REFRESH * 0.625e-9, rel=1e-9)
    assert r.bound == "dram"
    # Energy: DRAM 34,209,792 B x 8 x 3.9 pJ/bit (HBM2E); MACs 16 x 4096^2 x 1.5 pJ (fp16 at 45 nm)
    # x (7/45)(0.75/0.9)^2 for 7 nm.
    assert r.energy_pj["dram.access"] == pytest.approx(34_209_792 * 8 * 3.9)
    assert r.energy_pj["systolic.mac"] == pytest.approx(16 * 4096**2 * 1.5 * (7 / 45) * (0.75 / 0.9) ** 2)


def test_golden_tpu_like_rmsnorm():
    r = evaluate(load_design("tpu_like"), Norm(16, 4096))
    # Vector: 16 x (3 x 4096 + 4 + log2(1024) = 10) = 196,832 slots / 1024 lanes -> 193, + depth 8 = 201.
    assert r.utilisation["vector"] * r.seconds == pytest.approx(201 / 1.05e9)
    # SRAM (ofmap, 32 banks x 32 B): 270,336 B read and written, 8448 words / 32 -> 264 + 1 latency each
    # = 530 cycles -> the bound. (DRAM: 8448 bursts over 48 channels = 176 -> (48 + 350) / REFRESH x 0.625
    # = 261.8 ns.)
    assert r.seconds == pytest.approx(530 / 1.05e9)
    assert r.bound == "sram.ofmap"
    assert r.utilisation["dram"] * r.seconds == pytest.approx((48 + 175 * 2) / REFRESH * 0.625e-9)


def test_golden_hbm_pim_gemv():
    r = evaluate(load_design("hbm_pim"), Gemm(1, 4096, 4096))
    # 4 stacks -> 512 units: 65,536 B each = 2048 columns, 64 rows:
    # (2048 x 3.3333 + 64 x (tRP + tRCD = 34) x 0.83333) / REFRESH_HBM2 = 9091.1 ns (each row: ACT, columns,
    # PRE — the command sequence the PIM RTL twin issues);
    # x broadcast 8192 B at 19.2 GB/s per channel = 426.67 ns; outputs 8192 B at 1228.8 GB/s = 6.67 ns.
    pim_ns = (2048 * 4 / 1.2 + 64 * 34 / 1.2) / REFRESH_HBM2
    assert r.unit == "pim"
    assert r.seconds == pytest.approx((pim_ns + 8192 / 19.2 + 8192 / 1228.8) * 1e-9, rel=1e-9)
    assert r.energy_pj["pim.mac"] == pytest.approx(4096 * 4096 * 1.5)
    # Batch 8 exceeds gemv_max_batch 4: back on the host arrays.
    assert evaluate(load_design("hbm_pim"), Gemm(8, 4096, 4096)).unit == "systolic"


def test_golden_oaken_kv_write():
    fmt = KVFormat.parse("int4-oaken")
    r = evaluate(load_design("oaken_like"), KVWrite(16, 32, 128, fmt))
    # 1024 vectors over 64 engines = 16 each; beats 128 / 64 = 2; outliers ceil(0.04 x 128) = 6 over 2
    # ports = 3 cycles > 2 beats: 16 x 3 + 2 (fill) + 6 (depth) = 56 cycles at 1 GHz.
    assert r.unit == "kv_quant"
    assert r.utilisation["kv_quant"] * r.seconds == pytest.approx(56e-9)
    # DRAM: 262,144 B in + 128 B slots + 16 x 2 x 32 x 128 x (4 + 32/128 + 0.04 x 32) / 8 = 90,603.52 B out
    # (an outlier slot is 32 bits: fp16 value + 16-bit position) = 352,876 B -> 11028 bursts over 80 channels
    # = 138 -> (48 + 137 x 2) / REFRESH x 0.625 ns = 212.2 ns.
    assert r.traffic["dram"] == pytest.approx(262_144 + 128 + 90_603.52)
    assert r.bound == "dram"
    assert r.seconds == pytest.approx((48 + 137 * 2) / REFRESH * 0.625e-9)
    # Per-element energy: 16 tokens x 32 heads x 128 x 2 (K and V) = 131,072 elements x 2.0 pJ at 45 nm,
    # scaled to 7 nm by (7/45)(0.75/0.9)^2.
    assert r.energy_pj["kv_quant.elem"] == pytest.approx(131_072 * 2.0 * (7 / 45) * (0.75 / 0.9) ** 2)


def test_golden_attacc_decode_attention_on_pim():
    r = evaluate(load_design("attacc_like"), PagedDecodeAttention(8, 8, 128, context_lens=(1024,) * 4))
    # PIM: 5 HBM3 stacks x 32 PCs x 16 banks = 2560 units, tCCD_L = 8 x 0.3125 = 2.5 ns. K = 4096 tokens
    # x 8 heads x 128 x 2 B = 8,388,608 B -> 3277 B per unit = 103 columns of 32 B = 4 rows of 1 KB:
    # (103 x 2.5 + 4 x (45 + 45) x 0.3125) / (1 - (16 + 45 + 512 + 45) / 12480) = 389.28 ns,
    # twice (QK^T, then P.V) = 778.6 ns.
    pim_ns = 2 * (103 * 2.5 + 4 * 90 * 0.3125) / (1 - 618 / 12480)
    # Host <-> PIM: q 8192 B to each PC at 25.6 GB/s = 320 ns; scores out and probabilities in, 2 x 65,536 B
    # at 4096 GB/s = 32 ns; partial sums of 2560 units x 128 x 2 B at 4096 GB/s = 160 ns.
    io_ns = 8192 / 25.6 + 131_072 / 4096 + 655_360 / 4096
    # Host vector unit (6912 lanes, depth 16): softmax over 32,768 scores, (8 x 32768 + 4 + 2 x 6) slots
    # -> 38 + 16 = 54 cycles; adding the (2560 - 32) x 128 extra partials -> 47 + 16 = 63 cycles; 117 at 1.41 GHz.
    host_ns = 117 / 1.41
    assert r.unit == "pim"
    assert r.seconds == pytest.approx((pim_ns + io_ns + host_ns) * 1e-9, rel=1e-9)
    assert r.traffic["pim_bank"] == 2 * 8_388_608
    assert r.traffic["host_pim"] == 8192 * 160 + 131_072 + 655_360


def _one_of_each() -> list:
    kv4 = KVFormat.parse("int4-oaken")
    return [
        Gemm(5, 96, 64),
        Gemm(7, 128, 256, weight=WeightFormat.parse("int4-g128")),
        Gemm(3, 64, 128, weight=WeightFormat.parse("int8-pc"), act_dtype="int8", batch=3),
        PrefillAttention(8, 2, 64, seq_lens=(37, 5)),
        PagedDecodeAttention(8, 2, 64, context_lens=(100, 7, 33)),
        PagedDecodeAttention(8, 8, 64, context_lens=(100, 7), kv_format=kv4),
        PagedExtendAttention(8, 2, 64, q_lens=(3, 9), prefix_lens=(40, 0)),
        TreeAttention(8, 2, 64, tree_sizes=(4,), prefix_lens=(30,), ancestor_pairs=(7,)),
        KVWrite(3, 2, 64, kv4),
        KVWrite(3, 2, 64),
        KVDequantize(11, 2, 64, kv4),
        Norm(3, 100),
        Norm(3, 100, norm="layer"),
        Softmax(4, 77),
        RoPE(3, 8, 2, 64),
        Elementwise("silu_mul", 999),
        Embedding(3, 1000, 64),
        MoERouter(5, 64, 8, 2),
        AllReduce(1000, 4),
        AllToAll(1000, 4, "fp8_e4m3"),
        Sampling(3, 1000),
        GatedDeltaRule(2, 4, 32, 48, new_tokens=(1, 1, 1)),
        GatedDeltaRule(2, 4, 32, 48, new_tokens=(70, 5), initial_state=False),
        CausalConv1d(96, 4, new_tokens=(3, 1)),
        SSDScan(8, 32, 16, 2, new_tokens=(1, 1)),
        SSDScan(8, 32, 16, 2, new_tokens=(300, 9), initial_state=False),
        SelectiveScan(96, 16, new_tokens=(1, 5)),
    ]


@pytest.mark.parametrize("name", ["tpu_like", "gpu_like", "hbm_pim", "oaken_like", "attacc_like"])
def test_every_spec_evaluates(name):
    d = load_design(name)
    ops = _one_of_each()
    assert {type(o) for o in ops} == set(ALL_SPECS)
    for op in ops:
        if isinstance(op, AllReduce | AllToAll) and d.links.chip_link_gbps == 0:
            with pytest.raises(CodesignError, match="chip-to-chip"):
                evaluate(d, op)
            continue
        r = evaluate(d, op)
        assert r.seconds > 0 and math.isfinite(r.seconds), op
        assert r.cycles == pytest.approx(r.seconds * d.clock_ghz * 1e9)
        assert r.energy_total_pj > 0 and all(v >= 0 for v in r.energy_pj.values())
        assert all(0 <= u <= 1 + 1e-9 for u in r.utilisation.values()), (op, r.utilisation)


def test_quantized_kv_cuts_decode_attention_time():
    d = load_design("oaken_like")
    fp16 = evaluate(d, PagedDecodeAttention(32, 32, 128, context_lens=(2048,) * 8))
    int4 = evaluate(
        d, PagedDecodeAttention(32, 32, 128, context_lens=(2048,) * 8, kv_format=KVFormat.parse("int4-oaken"))
    )
    assert int4.traffic["dram"] < 0.4 * fp16.traffic["dram"]
    assert int4.seconds < 0.5 * fp16.seconds


def _base() -> dict:
    return yaml.safe_load((DESIGN_DIR / "tpu_like.yaml").read_text())


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda d: d["systolic"].update(rows=0), "systolic.rows: must be a positive integer"),
        (lambda d: d["systolic"].update(dataflow="rs"), "systolic.dataflow: must be one of os, ws, is"),
        (lambda d: d["memory"].update(preset="HBM4"), "memory.preset: must be one of"),
        (lambda d: d["memory"].pop("units"), "memory.units: missing"),
        (lambda d: d.update(clock_ghz="fast"), "clock_ghz: must be a positive number"),
        (lambda d: d.update(colour="red"), "colour: unknown field"),
        (lambda d: d["sram"].pop("filter"), "sram.filter: missing"),
        (
            lambda d: d["sram"]["ifmap"].update(banks=3),
            "sram.ifmap: ifmap.size_bytes=8388608 must be a multiple of banks",
        ),
        (lambda d: d["sram"]["filter"].update(size_kib=32, banks=1), "sram.filter.size_kib: SRAM 'filter'"),
        (lambda d: d.update(version=2), "version: unsupported design version 2"),
        (lambda d: d.update(node_nm=10), "node_nm: must be one of"),
        (lambda d: d.update(pim={"preset": "HBM3", "units": 1, "banks_per_unit": 3}), "pim.banks_per_unit"),
    ],
)
def test_bad_design_errors_name_file_and_field(tmp_path, edit, message):
    data = _base()
    edit(data)
    path = tmp_path / "mine.yaml"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(CodesignError) as e:
        load_design(path)
    assert str(e.value).startswith("mine.yaml: ")
    assert message in str(e.value)


def test_load_errors(tmp_path):
    with pytest.raises(CodesignError, match="unknown design 'nope'; built-in: "):
        load_design("nope")
    with pytest.raises(CodesignError, match="does not exist"):
        load_design(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("version: [1\n")
    with pytest.raises(CodesignError, match="bad.yaml: not valid YAML"):
        load_design(bad)
    with pytest.raises(CodesignError, match="<dict>: <top>: must be a mapping"):
        design_from_dict([1, 2])
