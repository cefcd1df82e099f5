"""Systolic-array model: fold cycles against SCALE-Sim's look-up tables and its own demand matrices,
functional int8/int4 GEMM bit-exact against numpy, the write-buffer drain model against SCALE-Sim's
class, the closed-form ofmap row counts and USER-mode read walk against brute force, Gemm-spec costing,
and bad input."""

from __future__ import annotations

import csv
import importlib.util
import math
import random
from pathlib import Path

import numpy as np
import pytest

from codesign.accel_model.systolic.geometry import (
    _box_pairs,
    _box_pairs_reaching,
    _geometry,
    _OfmapRows,
    _operand_stream,
)
from codesign.accel_model.systolic.memory import (
    _insertions,
    _insertions_gemm,
    _simulate_write_buffer,
    _user_read_buffer,
)
from codesign.accel_model.systolic.model import (
    Layer,
    MemoryConfig,
    SystolicArray,
    compute_cycles,
    fold_cycles,
    functional_gemm,
    gemm_cost,
    num_folds,
    operand_mapping,
    simulate_layer,
)
from codesign.specs import CodesignError, Gemm, WeightFormat

SHARED = Path(__file__).resolve().parents[4] / "shared" / "reference-data"
LUT_DIR = SHARED / "scalesim-os-lut"
HAS_SCALESIM = importlib.util.find_spec("scalesim") is not None
needs_scalesim = pytest.mark.skipif(
    not HAS_SCALESIM, reason="scalesim (pip install scalesim==3.0.0) not importable"
)

# Rows copied from LLMCompass's SCALE-Sim look-up tables (PrincetonUniversity/LLMCompass,
# systolic_array_model/look_up_table_{8_8,16_16,32_32,64_64,128_128}.csv, BSD-3-Clause), as shipped in
# ../shared/reference-data/scalesim-os-lut/: M, N, K, array height, width, dataflow, SCALE-Sim cycles.
LUT_ROWS = [
    (64, 32, 1024, 128, 128, "os", 1277),
    (1, 32, 128, 128, 128, "os", 381),
    (32, 32, 64, 16, 16, "os", 375),
    (2, 32, 32, 16, 16, "os", 123),
    (128, 128, 8, 16, 16, "os", 2431),
    (128, 128, 1, 32, 32, "os", 1007),
    (8, 16, 32, 64, 64, "os", 157),
    (64, 1, 128, 64, 64, "os", 253),
    (4, 32, 8, 8, 8, "os", 87),
    (1, 1, 128, 8, 8, "os", 141),
]


@pytest.mark.parametrize("row", LUT_ROWS)
def test_compute_cycles_matches_copied_lut_rows(row):
    M, N, K, h, w, df, cycles = row
    assert compute_cycles(M, N, K, h, w, df) == cycles


@pytest.mark.skipif(not LUT_DIR.is_dir(), reason="../shared/reference-data/scalesim-os-lut not present")
def test_compute_cycles_matches_shared_lut_files():
    checked = 0
    for path in sorted(LUT_DIR.glob("look_up_table_*.csv")):
        rows = list(csv.reader(path.open()))
        for r in rows if len(rows) <= 2000 else random.sample(rows, 2000):
            M, N, K, h, w = (int(x) for x in r[:5])
            assert compute_cycles(M, N, K, h, w, r[5]) == int(r[6]), (path.name, r)
            checked += 1
    assert checked > 4000


def test_fold_cycles_code_and_paper_variants():
    R, C, T = 7, 5, 11
    assert fold_cycles(R, C, T, "os") == R + C + T - 2
    assert fold_cycles(R, C, T, "os", os_fold="paper") == 2 * R + C + T - 2
    assert fold_cycles(R, C, T, "ws") == fold_cycles(R, C, T, "is") == 2 * R + C + T - 2
    # The paper variant costs R more cycles per fold, nothing else.
    folds = math.prod(num_folds(19, 23, 11, R, C, "os"))
    assert (
        compute_cycles(19, 23, 11, R, C, "os", "paper") - compute_cycles(19, 23, 11, R, C, "os") == folds * R
    )


@needs_scalesim
@pytest.mark.parametrize("dataflow", ["os", "ws", "is"])
def test_fold_length_matches_scalesim_demand_matrices(dataflow):
    """SCALE-Sim's own compute module: its demand matrices have folds * fold_cycles rows."""
    from scalesim.compute.systolic_compute_is import systolic_compute_is
    from scalesim.compute.systolic_compute_os import systolic_compute_os
    from scalesim.compute.systolic_compute_ws import systolic_compute_ws
    from scalesim.scale_config import scale_config

    cls = {"os": systolic_compute_os, "ws": systolic_compute_ws, "is": systolic_compute_is}[dataflow]
    for _ in range(4):
        M, N, K = (random.randint(1, 40) for _ in range(3))
        R, C = random.randint(1, 9), random.randint(1, 9)
        cfg = scale_config()
        cfg.force_valid()
        cfg.set_arr_dims(R, C)
        ifmap = np.add.outer(np.arange(M) * K, np.arange(K))
        filt = np.add.outer(np.arange(K), np.arange(N) * K) + 10_000_000
        ofmap = np.add.outer(np.arange(M) * N, np.arange(N)) + 20_000_000
        comp = cls()
        comp.set_params(config_obj=cfg, ifmap_op_mat=ifmap, filter_op_mat=filt, ofmap_op_mat=ofmap)
        ifd, fid, ofd = comp.get_demand_matrices()
        assert ofd.shape[0] - 1 == compute_cycles(M, N, K, R, C, dataflow), (M, N, K, R, C)
        rep = simulate_layer(Layer.gemm(M, N, K), R, C, dataflow, MemoryConfig(1, 1, 1))
        assert rep.mapping_efficiency == comp.get_avg_mapping_efficiency() * 100
        assert rep.compute_util == comp.get_avg_compute_utilization() * 100
        assert rep.ifmap_sram_reads == comp.get_ifmap_requests()
        assert rep.filter_sram_reads == comp.get_filter_requests()
        assert rep.ofmap_sram_writes == comp.get_ofmap_requests()


@needs_scalesim
def test_write_buffer_with_stalls_matches_scalesim_class():
    """Drain bandwidth 1 word/cycle on a small SRAM forces stalls; compare with SCALE-Sim's write_buffer."""
    from scalesim.compute.systolic_compute_os import systolic_compute_os
    from scalesim.memory.write_buffer import write_buffer
    from scalesim.memory.write_port import write_port
    from scalesim.scale_config import scale_config

    for size, bw in ((40, 1), (64, 1), (101, 1)):
        M, N, K, R, C = random.randint(12, 30), random.randint(12, 30), random.randint(1, 2), 4, 5
        cfg = scale_config()
        cfg.force_valid()
        cfg.set_arr_dims(R, C)
        comp = systolic_compute_os()
        comp.set_params(
            config_obj=cfg,
            ifmap_op_mat=np.add.outer(np.arange(M) * K, np.arange(K)),
            filter_op_mat=np.add.outer(np.arange(K), np.arange(N) * K),
            ofmap_op_mat=np.add.outer(np.arange(M) * N, np.arange(N)) + 20_000_000,
        )
        demand = comp.get_ofmap_demand_mat()
        wb = write_buffer()
        wb.set_params(backing_buf_obj=write_port(), total_size_bytes=size, word_size=1, active_buf_frac=0.5,
                      backing_buf_bw=bw)  # fmt: skip
        stall, outs = 0, []
        for i in range(demand.shape[0]):
            cyc = np.zeros((1, 1)) + i + stall
            out = wb.service_writes(demand[i : i + 1], cyc)
            outs.append(int(out[0][0]))
            stall += int(out[0][0] - cyc[0][0])
        wb.empty_all_buffers(outs[-1])
        start, stop = wb.get_external_access_start_stop_cycles()

        g = _geometry(M, N, K, R, C, "os")
        mine = _simulate_write_buffer(_OfmapRows(g), size, bw)
        assert stall > 0, "the configuration was meant to stall"
        assert (mine.stall_cycles, mine.total_cycles) == (stall, max(outs))
        assert (mine.dram_writes, mine.dram_start, mine.dram_stop) == (wb.get_num_accesses(), start, stop)


@pytest.mark.parametrize("dataflow", ["os", "ws", "is"])
@pytest.mark.parametrize("shape", [(1, 1, 1), (7, 13, 5), (33, 17, 29), (64, 3, 70)])
@pytest.mark.parametrize("array", [(4, 4), (3, 8), (16, 5)])
def test_functional_gemm_int8_bit_exact(dataflow, shape, array):
    M, N, K = shape
    a = np.random.randint(-128, 128, size=(M, K)).astype(np.int8)
    b = np.random.randint(-128, 128, size=(K, N)).astype(np.int8)
    out = functional_gemm(a, b, *array, dataflow)
    assert out.dtype == np.int32
    np.testing.assert_array_equal(out.astype(np.int64), a.astype(np.int64) @ b.astype(np.int64))


@pytest.mark.parametrize("dataflow", ["os", "ws", "is"])
def test_functional_gemm_int4_weights(dataflow):
    a = np.random.randint(-128, 128, size=(19, 37)).astype(np.int8)
    b = np.random.randint(-8, 8, size=(37, 11)).astype(np.int8)
    out = functional_gemm(a, b, 5, 6, dataflow, b_bits=4)
    np.testing.assert_array_equal(out.astype(np.int64), a.astype(np.int64) @ b.astype(np.int64))
    with pytest.raises(CodesignError, match=r"\[-8, 7\]"):
        functional_gemm(a, np.full((37, 11), 8, dtype=np.int8), 5, 6, dataflow, b_bits=4)


@pytest.mark.parametrize("dataflow", ["os", "ws", "is"])
def test_functional_gemm_wraps_like_a_32bit_accumulator(dataflow):
    K = (1 << 31) // (128 * 128) + 3  # K products of (-128)^2 overflow int32
    a = np.full((2, K), -128, dtype=np.int8)
    b = np.full((K, 3), -128, dtype=np.int8)
    exact = a.astype(np.int64) @ b.astype(np.int64)
    assert exact.max() > np.iinfo(np.int32).max
    wrapped = (exact + (1 << 31)) % (1 << 32) - (1 << 31)
    np.testing.assert_array_equal(functional_gemm(a, b, 2, 2, dataflow).astype(np.int64), wrapped)


def test_functional_gemm_bad_input():
    a = np.zeros((3, 4), dtype=np.int8)
    with pytest.raises(CodesignError, match="dataflow"):
        functional_gemm(a, np.zeros((4, 2), np.int8), 2, 2, "rs")
    with pytest.raises(CodesignError, match="rows"):
        functional_gemm(a, np.zeros((4, 2), np.int8), 0, 2, "os")
    with pytest.raises(CodesignError, match="K"):
        functional_gemm(a, np.zeros((5, 2), np.int8), 2, 2, "os")
    with pytest.raises(CodesignError, match="integer dtype"):
        functional_gemm(a.astype(np.float32), np.zeros((4, 2), np.int8), 2, 2, "os")
    with pytest.raises(CodesignError, match=r"\[-128, 127\]"):
        functional_gemm(np.full((3, 4), 300, dtype=np.int32), np.zeros((4, 2), np.int8), 2, 2, "os")


def test_operand_mapping_and_cycles_bad_input():
    assert operand_mapping(3, 5, 7, "is") == (7, 3, 5)
    with pytest.raises(CodesignError, match="dataflow"):
        compute_cycles(3, 5, 7, 4, 4, "xs")
    with pytest.raises(CodesignError, match="cols"):
        compute_cycles(3, 5, 7, 4, 2.5, "os")
    with pytest.raises(CodesignError, match="M"):
        compute_cycles(0, 5, 7, 4, 4, "os")
    with pytest.raises(CodesignError, match="os_fold"):
        fold_cycles(4, 4, 4, "os", os_fold="book")


def test_gemm_cost_matches_layer_report_and_scales_with_batch():
    spec = Gemm(45, 70, 33, weight=WeightFormat("int8"), act_dtype="int8", out_dtype="fp32")
    arr = SystolicArray(rows=8, cols=16, dataflow="ws", ifmap_sram_kb=2, filter_sram_kb=2, ofmap_sram_kb=2)
    cost = gemm_cost(spec, arr)
    # int8 operands: 1-byte words; fp32 outputs: 4-byte words, so the ofmap SRAM holds 512 of them.
    rep = simulate_layer(Layer.gemm(45, 70, 33), 8, 16, "ws", MemoryConfig(2, 2, 2, (1, 1, 4)))
    assert cost.report == rep
    assert cost.cycles == rep.total_cycles == compute_cycles(45, 70, 33, 8, 16, "ws")
    assert 0 < cost.utilization <= cost.mapping_efficiency <= 1
    assert cost.dram_bytes == rep.ifmap_dram_reads + rep.filter_dram_reads + 4 * rep.ofmap_dram_writes
    batched = gemm_cost(Gemm(45, 70, 33, weight=WeightFormat("int8"), act_dtype="int8", out_dtype="fp32",
                             batch=3), arr)  # fmt: skip
    assert (batched.cycles, batched.ifmap_dram_reads) == (3 * cost.cycles, 3 * cost.ifmap_dram_reads)
    assert batched.utilization == cost.utilization


def test_gemm_cost_int4_weights_fit_twice_as_many_words():
    arr = SystolicArray(rows=8, cols=8, dataflow="os", filter_sram_kb=8)
    w8 = gemm_cost(Gemm(16, 64, 64, weight=WeightFormat("int8"), act_dtype="int8"), arr)
    w4 = gemm_cost(Gemm(16, 64, 64, weight=WeightFormat("int4"), act_dtype="int8"), arr)
    # 4096 weights; SCALE-Sim's read window is half the SRAM (50 sets of floor(words / 100)): 4050 int8
    # words in 8 KB, so some weights are fetched twice; 8150 int4 words, so each is fetched once.
    assert w4.filter_dram_reads == 64 * 64 < w8.filter_dram_reads
    assert w4.cycles == w8.cycles


def test_gemm_cost_edge_and_bad_input():
    assert gemm_cost(Gemm(0, 8, 8), SystolicArray()).cycles == 0
    paper = gemm_cost(Gemm(40, 40, 9), SystolicArray(rows=16, cols=16, os_fold="paper"))
    code = gemm_cost(Gemm(40, 40, 9), SystolicArray(rows=16, cols=16))
    assert paper.cycles - code.cycles == 9 * 16
    with pytest.raises(CodesignError, match="Gemm"):
        gemm_cost("gemm", SystolicArray())
    with pytest.raises(CodesignError, match="dataflow"):
        SystolicArray(dataflow="rs")
    with pytest.raises(CodesignError, match="ifmap_sram_kb"):
        SystolicArray(ifmap_sram_kb=0)
    with pytest.raises(CodesignError, match="read_bandwidth"):
        MemoryConfig(1, 1, 1, read_bandwidth=(2, 2))
    with pytest.raises(CodesignError, match="at least 100"):
        simulate_layer(Layer.gemm(4, 4, 4), 2, 2, "os", MemoryConfig(1, 1, 1, (16, 1, 1)))
    with pytest.raises(CodesignError, match="filter 3x3 larger"):
        Layer.conv("c", 2, 5, 3, 3, 1, 1, 1, 1)


def test_gemm_cost_bandwidth_limited_stalls():
    """USER mode (checked field by field against SCALE-Sim in test_scalesim_compat): a starved link stalls."""
    spec = Gemm(60, 50, 40, weight=WeightFormat("int8"), act_dtype="int8", out_dtype="fp32")
    calc = gemm_cost(spec, SystolicArray(rows=8, cols=8, ifmap_sram_kb=1, filter_sram_kb=1, ofmap_sram_kb=1))
    slow = gemm_cost(spec, SystolicArray(rows=8, cols=8, ifmap_sram_kb=1, filter_sram_kb=1, ofmap_sram_kb=1,
                                         dram_bandwidth=1))  # fmt: skip
    assert calc.stall_cycles == 0 and slow.stall_cycles > 0
    assert slow.cycles == slow.compute_cycles + slow.stall_cycles
    assert slow.compute_cycles == calc.cycles == compute_cycles(60, 50, 40, 8, 8, "os")
    assert slow.utilization < calc.utilization


def test_gemm_read_window_walk_equals_request_replay():
    """The O(folds) GEMM walk of SCALE-Sim's CALC read window equals replaying every request address
    (the replay path is the one conv layers take; both are checked against SCALE-Sim in the compat tests)."""
    for _ in range(60):
        M, N, K = (random.randint(1, 60) for _ in range(3))
        R, C, df = random.randint(1, 9), random.randint(1, 9), random.choice(["os", "ws", "is"])
        g = _geometry(*operand_mapping(M, N, K, df), R, C, df)
        layer = Layer.gemm(M, N, K)
        for which in ("ifmap", "filter"):
            first, later = random.randint(1, 200), random.randint(1, 200)
            replay = _insertions(*_operand_stream(g, which, layer.ifmap, layer.filt), first, later)
            assert _insertions_gemm(g, which, first, later) == replay, (M, N, K, R, C, df, which)


def test_gemm_user_read_walk_equals_request_scan():
    """USER mode: the per-fold GEMM walk of SCALE-Sim's circular read window (scalesim_user_gemm.py)
    gives the same fetch events, DRAM reads and stop cycle as scanning every request's set (the path conv
    layers take; both are checked against SCALE-Sim in the compat tests). Small SRAMs make it miss."""
    with_events = 0
    for _ in range(150):
        M, N, K = (random.randint(1, 90) for _ in range(3))
        R, C, df = random.randint(1, 17), random.randint(1, 17), random.choice(["os", "ws", "is"])
        g = _geometry(*operand_mapping(M, N, K, df), R, C, df)
        layer = Layer.gemm(M, N, K)
        for which in ("ifmap", "filter"):
            size, bw = random.randint(100, 3000), random.choice([1, 2, 3, 5, 10])
            try:
                scan = _user_read_buffer(g, which, layer, size, bw, scan=True)
            except CodesignError as e:  # SCALE-Sim would loop forever: both must say so
                with pytest.raises(CodesignError, match="never reaches"):
                    _user_read_buffer(g, which, layer, size, bw)
                assert "never reaches" in str(e)
                continue
            walk = _user_read_buffer(g, which, layer, size, bw)
            assert walk == scan, (M, N, K, R, C, df, which, size, bw)
            with_events += bool(scan.events)
    assert with_events > 50, "the draw should make most operands miss"


def test_ofmap_row_counts_closed_form_equal_enumeration():
    """_OfmapRows' closed forms (per fold kind) equal counting every ofmap write's demand row: fold f
    writes an a x cu block skewed by column from local row `start` (os: a = rows used, start = T - 1 +
    R - a; ws/is: a = T, start = 2R - 1), as SCALE-Sim's ofmap demand matrices place them."""
    for _ in range(40):
        M, N, K = (random.randint(1, 40) for _ in range(3))
        R, C, df = random.randint(1, 9), random.randint(1, 9), random.choice(["os", "ws", "is"])
        g = _geometry(*operand_mapping(M, N, K, df), R, C, df)
        counts = np.zeros(g.folds * g.L, dtype=np.int64)
        for fc in range(g.col_folds):
            for fr in range(g.row_folds):
                ru, cu = g.used(fr, fc)
                a, start = (ru, g.T - 1 + R - ru) if df == "os" else (g.T, 2 * R - 1)
                base = (fc * g.row_folds + fr) * g.L + start
                for p in range(a):
                    counts[base + p : base + p + cu] += 1
        through = np.cumsum(counts)
        rows = _OfmapRows(g)
        assert rows.total == through[-1] == M * N * (1 if df == "os" else g.row_folds)
        picks = random.sample(range(-1, rows.nrows + 2), min(rows.nrows + 3, 60))
        for r in picks:
            assert rows.through(r) == (0 if r < 0 else int(through[min(r, rows.nrows - 1)])), r
        for x in random.sample(range(1, rows.total + 1), min(rows.total, 60)):
            assert rows.first_row_reaching(x) == int(np.searchsorted(through, x)), x
        assert rows.first_row_reaching(rows.total + 1) == rows.nrows


def test_box_pair_counts_and_inverse_exhaustive():
    """_box_pairs(n, a, b) = #{(p, q) in [0, a) x [0, b): p + q < n} (the cumulative writes of a skewed
    block) and _box_pairs_reaching(x) = the smallest n reaching x, by enumeration for all small boxes."""
    for a in range(1, 13):
        for b in range(1, 13):
            sums = [p + q for p in range(a) for q in range(b)]
            for n in range(-2, a + b + 2):
                assert _box_pairs(n, a, b) == sum(s < n for s in sums), (n, a, b)
            for x in range(1, a * b + 1):
                n = _box_pairs_reaching(x, a, b)
                assert _box_pairs(n, a, b) >= x > _box_pairs(n - 1, a, b), (x, a, b, n)
