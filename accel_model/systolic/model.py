"""Systolic-array GEMM model, cycle-exact with SCALE-Sim 3.0.0, computed in closed form over folds.

A GEMM Y[M, N] = X[M, K] @ W[K, N] runs on an R x C array in one of SCALE-Sim's three dataflows.
SCALE-Sim (scalesim/compute/systolic_compute_{os,ws,is}.py) maps the operand matrices as

    dataflow  Sr (spatial rows)  Sc (spatial cols)  T (temporal)  fold length (cycles)
    "os"      M                  N                  K             R + C + T - 2  (code; paper: 2R + C + T - 2)
    "ws"      K                  N                  M             2R + C + T - 2
    "is"      K                  M                  N             2R + C + T - 2

and runs ceil(Sr / R) * ceil(Sc / C) folds back to back (column folds outer, row folds inner). Stall-free,
its reported "Total Cycles" is folds * fold_length - 1: the index of the last demand row, because it
reports the cycle at which the last output is written, counting from 0.

Output-stationary fold length: SCALE-Sim's code streams T operand rows with C - 1 (ifmap) / R - 1
(filter) cycles of skew and drains the outputs while the next fold fills, giving R + C + T - 2; its
paper (Samajdar et al., ISPASS 2020) counts a separate R-cycle output drain, 2R + C + T - 2. The
maintainers agreed the paper's count describes the hardware but left the code (scale-sim-v3 issue #4).
We follow the code by default, so reports diff cleanly against SCALE-Sim; pass os_fold="paper" for the
paper's count.

The memory side (double-buffered SRAMs fed from DRAM, as SCALE-Sim models them) follows the compute
part: `simulate_layer` returns SCALE-Sim's per-layer report rows and `gemm_cost` prices a
`codesign.specs.Gemm` on a `SystolicArray`. Neither builds SCALE-Sim's per-cycle demand matrices:
compute fields, SRAM counts and SRAM start/stop cycles are closed forms over folds (here); where each
request and write falls is geometry.py; the SRAM buffers and their DRAM traffic are
memory.py (USER-mode GEMM read walk: user_gemm.py).
Every field matches SCALE-Sim 3.0.0 byte for byte on the tested configurations
(tests/accel_model/systolic/test_scalesim_compat.py), SCALE-Sim's quirks included (they are pointed out where
they are reproduced).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np

from codesign.accel_model.systolic.geometry import (
    Layer,
    _first_last_rows,
    _Geometry,
    _geometry,
    _OfmapRows,
)
from codesign.accel_model.systolic.memory import (
    MemoryConfig,
    _estimate_read_buffer,
    _simulate_write_buffer,
    _user_read_buffer,
)
from codesign.specs import CodesignError, Gemm, check_choice, check_positive_int, dtype_bits

__all__ = [  # Layer and MemoryConfig live in geometry / memory; importable from here too
    "DATAFLOWS", "OS_FOLDS", "GemmCost", "Layer", "LayerReport", "MemoryConfig", "SystolicArray",
    "compute_cycles", "fold_cycles", "functional_gemm", "gemm_cost", "num_folds", "operand_mapping",
    "simulate_layer",
]  # fmt: skip

DATAFLOWS = ("os", "ws", "is")
OS_FOLDS = ("code", "paper")


def _check_array(rows: int, cols: int, dataflow: str) -> None:
    check_positive_int("rows", rows)
    check_positive_int("cols", cols)
    check_choice("dataflow", dataflow, DATAFLOWS)


def operand_mapping(M: int, N: int, K: int, dataflow: str) -> tuple[int, int, int]:
    """(Sr, Sc, T) of a GEMM in `dataflow`, as SCALE-Sim maps it (see the module docstring table)."""
    check_choice("dataflow", dataflow, DATAFLOWS)
    if dataflow == "os":
        return M, N, K
    if dataflow == "ws":
        return K, N, M
    return K, M, N


def fold_cycles(rows: int, cols: int, t: int, dataflow: str, os_fold: str = "code") -> int:
    """Cycles of one stall-free fold with temporal extent `t` on a rows x cols array.

    os: R + C + t - 2 (SCALE-Sim's code; os_fold="paper" gives 2R + C + t - 2); ws, is: 2R + C + t - 2.
    """
    _check_array(rows, cols, dataflow)
    check_positive_int("t", t)
    check_choice("os_fold", os_fold, OS_FOLDS)
    if dataflow == "os" and os_fold == "code":
        return rows + cols + t - 2
    return 2 * rows + cols + t - 2


def num_folds(M: int, N: int, K: int, rows: int, cols: int, dataflow: str) -> tuple[int, int]:
    """(row_folds, col_folds) = (ceil(Sr / R), ceil(Sc / C))."""
    sr, sc, _ = operand_mapping(M, N, K, dataflow)
    return math.ceil(sr / rows), math.ceil(sc / cols)


def compute_cycles(M: int, N: int, K: int, rows: int, cols: int, dataflow: str, os_fold: str = "code") -> int:
    """Stall-free cycles of GEMM (M, N, K), equal to SCALE-Sim's "Total Cycles" column.

    cycles = ceil(Sr / R) * ceil(Sc / C) * fold_cycles(R, C, T) - 1 with (Sr, Sc, T) from `operand_mapping`.
    """
    for name, v in (("M", M), ("N", N), ("K", K)):
        check_positive_int(name, v)
    _check_array(rows, cols, dataflow)
    sr, sc, t = operand_mapping(M, N, K, dataflow)
    folds = math.ceil(sr / rows) * math.ceil(sc / cols)
    return folds * fold_cycles(rows, cols, t, dataflow, os_fold) - 1


# --------------------------------------------------------------------------------------------------
# Functional mode: the integer outputs of the array, fold by fold.


def _check_int_operand(name: str, x: np.ndarray, bits: int) -> np.ndarray:
    if not isinstance(x, np.ndarray) or x.ndim != 2:
        raise CodesignError(f"{name} must be a 2-D numpy array, got {type(x).__name__}")
    if not np.issubdtype(x.dtype, np.integer):
        raise CodesignError(f"{name} must have an integer dtype (int{bits} codes), got {x.dtype}")
    lo, hi = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
    if x.size and (int(x.min()) < lo or int(x.max()) > hi):
        raise CodesignError(f"{name} codes must lie in [{lo}, {hi}] (int{bits}), got [{x.min()}, {x.max()}]")
    return x.astype(np.int64)


def _wrap32(x: np.ndarray) -> np.ndarray:
    """Reduce int64 values modulo 2**32 into int32 two's complement, as a 32-bit accumulator does."""
    return x.astype(np.int32)  # numpy's int64 -> int32 cast keeps the low 32 bits


def functional_gemm(
    a: np.ndarray, b: np.ndarray, rows: int, cols: int, dataflow: str, *, a_bits: int = 8, b_bits: int = 8
) -> np.ndarray:
    """int32 outputs of X[M, K] @ W[K, N] computed fold by fold as an R x C array in `dataflow` would.

    a: int8 activation codes [M, K]; b: weight codes [K, N], int8 (b_bits=8) or int4 held in an integer
    array with values in [-8, 7] (b_bits=4). Each fold's partial sums are added into int32 accumulators
    with two's-complement wrap-around (os: one R x C output tile over all of K; ws: a K-block x N-block
    weight tile, streaming all M rows; is: a K-block x M-block input tile, streaming all N columns).
    Without overflow the result equals a.astype(int64) @ b exactly; with overflow, that value mod 2**32.
    """
    _check_array(rows, cols, dataflow)
    if a_bits not in (4, 8) or b_bits not in (4, 8):
        raise CodesignError(f"a_bits and b_bits must be 4 or 8, got {a_bits}, {b_bits}")
    a64 = _check_int_operand("a", a, a_bits)
    b64 = _check_int_operand("b", b, b_bits)
    if a64.shape[1] != b64.shape[0]:
        raise CodesignError(f"a is {a64.shape} and b is {b64.shape}: a's K must equal b's K")
    M, K = a64.shape
    N = b64.shape[1]
    out = np.zeros((M, N), dtype=np.int32)
    with np.errstate(over="ignore"):
        if dataflow == "os":  # each PE owns one output and accumulates all K products in place
            for n0 in range(0, N, cols):
                for m0 in range(0, M, rows):
                    tile = a64[m0 : m0 + rows] @ b64[:, n0 : n0 + cols]
                    out[m0 : m0 + rows, n0 : n0 + cols] = _wrap32(tile)
        elif dataflow == "ws":  # weights of a K-block x N-block stay; partial sums leave per fold
            for n0 in range(0, N, cols):
                for k0 in range(0, K, rows):
                    part = a64[:, k0 : k0 + rows] @ b64[k0 : k0 + rows, n0 : n0 + cols]
                    out[:, n0 : n0 + cols] += _wrap32(part)
        else:  # inputs of a K-block x M-block stay; weights stream, partial sums leave per fold
            for m0 in range(0, M, cols):
                for k0 in range(0, K, rows):
                    part = a64[m0 : m0 + cols, k0 : k0 + rows] @ b64[k0 : k0 + rows]
                    out[m0 : m0 + cols] += _wrap32(part)
    return out


@dataclass(frozen=True)
class LayerReport:
    """One layer's row of SCALE-Sim's COMPUTE_REPORT, BANDWIDTH_REPORT and DETAILED_ACCESS_REPORT.

    Cycle fields are floats where SCALE-Sim prints floats, so `str()` of each field reproduces its CSV.
    """

    overall_cycles: int  # "Total Cycles (incl. prefetch)": last ofmap DRAM write - first operand DRAM read
    total_cycles: int  # compute cycles including stalls
    stall_cycles: int
    overall_util: float  # %
    mapping_efficiency: float  # %
    compute_util: float  # %
    ifmap_sram_start: float
    ifmap_sram_stop: float
    ifmap_sram_reads: int
    filter_sram_start: float
    filter_sram_stop: float
    filter_sram_reads: int
    ofmap_sram_start: float
    ofmap_sram_stop: float
    ofmap_sram_writes: int
    ifmap_dram_start: float
    ifmap_dram_stop: float
    ifmap_dram_reads: int
    filter_dram_start: float
    filter_dram_stop: float
    filter_dram_reads: int
    ofmap_dram_start: float
    ofmap_dram_stop: float
    ofmap_dram_writes: int

    def compute_items(self) -> list:
        return [self.overall_cycles, self.total_cycles, self.stall_cycles, self.overall_util,
                self.mapping_efficiency, self.compute_util]  # fmt: skip

    def bandwidth_items(self) -> list:
        """Average words/cycle: SRAM over the compute cycles, DRAM over each stream's own active span."""
        t = self.total_cycles
        return [
            self.ifmap_sram_reads / t,
            self.filter_sram_reads / t,
            self.ofmap_sram_writes / t,
            self.ifmap_dram_reads / (self.ifmap_dram_stop - self.ifmap_dram_start + 1),
            self.filter_dram_reads / (self.filter_dram_stop - self.filter_dram_start + 1),
            self.ofmap_dram_writes / (self.ofmap_dram_stop - self.ofmap_dram_start + 1),
        ]

    def detail_items(self) -> list:
        return [
            self.ifmap_sram_start, self.ifmap_sram_stop, self.ifmap_sram_reads,
            self.filter_sram_start, self.filter_sram_stop, self.filter_sram_reads,
            self.ofmap_sram_start, self.ofmap_sram_stop, self.ofmap_sram_writes,
            self.ifmap_dram_start, self.ifmap_dram_stop, self.ifmap_dram_reads,
            self.filter_dram_start, self.filter_dram_stop, self.filter_dram_reads,
            self.ofmap_dram_start, self.ofmap_dram_stop, self.ofmap_dram_writes,
        ]  # fmt: skip


def _sram_counts(g: _Geometry, px: int, window: int, filters: int) -> tuple[int, int, int]:
    """SRAM (ifmap reads, filter reads, ofmap writes) as SCALE-Sim counts its demand requests.

    Counts include padding requests of conv ifmaps (-1 entries are counted by the shape products), and
    the output-stationary ofmap count adds R + C per fold, as SCALE-Sim's code does.
    """
    mk, kn, mn = px * window, window * filters, px * filters
    if g.dataflow == "os":
        return g.col_folds * mk, g.row_folds * kn, mn + g.folds * (g.R + g.C)
    if g.dataflow == "ws":
        return g.col_folds * mk, kn, g.row_folds * mn
    return mk, g.col_folds * kn, g.row_folds * mn


def _fold_averages(g: _Geometry) -> tuple[float, float]:
    """(mapping efficiency, compute utilisation) averaged over folds in SCALE-Sim's order and float ops."""
    cyc = g.T + g.R + g.C - 2 if g.dataflow == "os" else 2 * g.R + 2 * g.C + g.T - 3
    pes = g.R * g.C
    # Per-fold values in float64 equal SCALE-Sim's Python floats (all integers are far below 2**53);
    # Python's sum() over them then adds in SCALE-Sim's order, so the averages agree to the last bit.
    if g.folds <= 256:  # few folds: plain Python is faster than numpy's call overhead, and the same
        rus = [min(g.R, g.Sr - g.R * fr) for fr in range(g.row_folds)]
        mac = [min(g.C, g.Sc - g.C * fc) * ru for fc in range(g.col_folds) for ru in rus]
        maps = [m / pes for m in mac]
        utils = [m * g.T / (pes * cyc) for m in mac]
    else:
        ru = np.minimum(g.R, g.Sr - g.R * np.arange(g.row_folds, dtype=np.int64))
        cu = np.minimum(g.C, g.Sc - g.C * np.arange(g.col_folds, dtype=np.int64))
        mac_used = np.multiply.outer(cu, ru).ravel()  # [col_folds, row_folds] in fold order
        maps = (mac_used / pes).tolist()  # ws: (pes - padding) / pes, the same value
        utils = ((mac_used * g.T) / (pes * cyc)).tolist()
    return sum(maps) / len(maps), sum(utils) / len(utils)


def simulate_layer(layer: Layer, rows: int, cols: int, dataflow: str, memory: MemoryConfig) -> LayerReport:
    """SCALE-Sim 3.0.0's report for one layer, computed from per-fold closed forms and memory events.

    CALC mode (memory.bandwidth None): every field of COMPUTE_REPORT, BANDWIDTH_REPORT and
    DETAILED_ACCESS_REPORT. USER mode (a DRAM bandwidth): the same fields with SCALE-Sim's stalls.
    Both for GEMM and conv layers.
    """
    _check_array(rows, cols, dataflow)
    sr, sc, t = operand_mapping(layer.px, layer.filters, layer.window, dataflow)
    g = _geometry(sr, sc, t, rows, cols, dataflow)
    orows = _OfmapRows(g)
    ends = {w: _first_last_rows(g, w, layer.ifmap, layer.filt) for w in ("ifmap", "filter")}
    if memory.bandwidth is None:
        wb = _simulate_write_buffer(orows, memory.words("ofmap"), cols)

        def row_cycle(r: int) -> int:  # cycle at which demand row r is issued
            return r + wb.stalls_before(r)

        def read_out(w: str, r: int) -> int:  # cycle at which demand row r's reads are served
            return row_cycle(r) + 1

        dram = {
            w: _estimate_read_buffer(g, w, layer, memory.words(w), row_cycle(ends[w][0]), row_cycle)
            for w in ("ifmap", "filter")
        }
    else:
        rbw = memory.read_bandwidth or (memory.bandwidth, memory.bandwidth)
        dram = {
            w: _user_read_buffer(g, w, layer, memory.words(w), b) for w, b in zip(("ifmap", "filter"), rbw)
        }
        read_rows = sorted(set(dram["ifmap"].events) | set(dram["filter"].events))

        ifmap_rb, filter_rb = dram["ifmap"], dram["filter"]

        def read_stall(r: int, cycle: int) -> int:
            return max(ifmap_rb.offset(r, cycle), filter_rb.offset(r, cycle)) - 1

        wb = _simulate_write_buffer(orows, memory.words("ofmap"), memory.bandwidth, read_rows, read_stall)

        def read_out(w: str, r: int) -> int:
            cycle = r + wb.stalls_before(r)
            return cycle + dram[w].offset(r, cycle)

    ifr, ffr, ofw = _sram_counts(g, layer.px, layer.window, layer.filters)
    mapping, util = _fold_averages(g)
    total = wb.total_cycles
    overall = int(wb.dram_stop - min(dram["ifmap"].dram_start, dram["filter"].dram_start))
    num_compute = layer.px * layer.filters * layer.window
    return LayerReport(
        overall_cycles=overall,
        total_cycles=total,
        stall_cycles=wb.stall_cycles,
        overall_util=(num_compute * 100) / (total * rows * cols),
        mapping_efficiency=mapping * 100,
        compute_util=util * 100,
        ifmap_sram_start=float(read_out("ifmap", ends["ifmap"][0])),
        ifmap_sram_stop=float(read_out("ifmap", ends["ifmap"][1])),
        ifmap_sram_reads=ifr,
        filter_sram_start=float(read_out("filter", ends["filter"][0])),
        filter_sram_stop=float(read_out("filter", ends["filter"][1])),
        filter_sram_reads=ffr,
        ofmap_sram_start=float(wb.out_cycle(orows.first_valid_row())),
        ofmap_sram_stop=float(wb.out_cycle(orows.last_valid_row())),
        ofmap_sram_writes=ofw,
        ifmap_dram_start=dram["ifmap"].dram_start,
        ifmap_dram_stop=dram["ifmap"].dram_stop,
        ifmap_dram_reads=dram["ifmap"].dram_reads,
        filter_dram_start=dram["filter"].dram_start,
        filter_dram_stop=dram["filter"].dram_stop,
        filter_dram_reads=dram["filter"].dram_reads,
        ofmap_dram_start=wb.dram_start,
        ofmap_dram_stop=wb.dram_stop,
        ofmap_dram_writes=wb.dram_writes,
    )


# --------------------------------------------------------------------------------------------------
# Operator-spec integration.


@dataclass(frozen=True)
class SystolicArray:
    """An R x C MAC array with SCALE-Sim's three double-buffered SRAMs (KiB) and a DRAM link.

    dram_bandwidth None means SCALE-Sim's CALC mode: no stalls, and the cost reports the DRAM bandwidth
    needed for that. An int (words/cycle) is SCALE-Sim's USER mode with that bandwidth for the ofmap drain
    and for the ifmap / filter fills, giving stall cycles. word_bytes None takes each operand's element
    width from the operator spec.
    """

    rows: int = 32
    cols: int = 32
    dataflow: str = "os"
    ifmap_sram_kb: int = 64
    filter_sram_kb: int = 64
    ofmap_sram_kb: int = 64
    dram_bandwidth: int | None = None
    word_bytes: float | None = None
    os_fold: str = "code"

    def __post_init__(self) -> None:
        _check_array(self.rows, self.cols, self.dataflow)
        check_choice("os_fold", self.os_fold, OS_FOLDS)
        for n_ in ("ifmap_sram_kb", "filter_sram_kb", "ofmap_sram_kb"):
            check_positive_int(n_, getattr(self, n_))
        if self.dram_bandwidth is not None:
            check_positive_int("dram_bandwidth", self.dram_bandwidth)
        if self.word_bytes is not None and not (
            isinstance(self.word_bytes, int | float) and self.word_bytes > 0
        ):
            raise CodesignError(f"word_bytes must be a positive number or None, got {self.word_bytes!r}")


@dataclass(frozen=True)
class GemmCost:
    """Cost of one Gemm spec on a SystolicArray (all batches; counts in words unless named bytes)."""

    cycles: int  # compute + stall cycles
    compute_cycles: int  # stall-free
    stall_cycles: int
    utilization: float  # MACs / (cycles * R * C), in [0, 1]
    mapping_efficiency: float  # average fraction of PEs mapped per fold, in [0, 1]
    ifmap_sram_reads: int
    filter_sram_reads: int
    ofmap_sram_writes: int
    ifmap_dram_reads: int
    filter_dram_reads: int
    ofmap_dram_writes: int
    dram_bytes: float
    required_dram_bandwidth: float  # average DRAM words/cycle of the three streams (CALC mode: for no stalls)
    report: LayerReport | None  # SCALE-Sim's per-layer row for one batch (None when M == 0)


def _element_bytes(spec: Gemm) -> tuple[float, float, float]:
    return (
        dtype_bits(spec.act_dtype) / 8,
        spec.weight.code_bits() / 8,
        dtype_bits(spec.out_dtype) / 8,
    )


def gemm_cost(spec: Gemm, array: SystolicArray) -> GemmCost:
    """Cycles, stalls, utilisation and SRAM/DRAM traffic of `spec` on `array`, SCALE-Sim-exact.

    Y[M, N] = X[M, K] @ W[N, K]^T maps to SCALE-Sim's GEMM (M, N, K); batches run back to back. SRAM
    capacities in words are floor(KB * 1024 / element bytes) per operand (act, weight codes, output).
    With os_fold="paper" an output-stationary array adds R cycles per fold (its output drain).
    """
    if not isinstance(spec, Gemm):
        raise CodesignError(f"spec must be a codesign.specs.Gemm, got {type(spec).__name__}")
    if not isinstance(array, SystolicArray):
        raise CodesignError(f"array must be a SystolicArray, got {type(array).__name__}")
    return _gemm_cost(spec, array)


@functools.lru_cache(maxsize=4096)  # a model step repeats the same GEMMs layer after layer
def _gemm_cost(spec: Gemm, array: SystolicArray) -> GemmCost:
    if spec.M == 0:
        return GemmCost(0, 0, 0, 0.0, 0.0, 0, 0, 0, 0, 0, 0, 0.0, 0.0, None)
    wb = _element_bytes(spec) if array.word_bytes is None else (array.word_bytes,) * 3
    bw = array.dram_bandwidth
    mem = MemoryConfig(
        array.ifmap_sram_kb,
        array.filter_sram_kb,
        array.ofmap_sram_kb,
        wb,
        bw,
        None if bw is None else (bw, bw),
    )
    rep = simulate_layer(Layer.gemm(spec.M, spec.N, spec.K), array.rows, array.cols, array.dataflow, mem)
    extra = 0
    if array.dataflow == "os" and array.os_fold == "paper":
        rf, cf = num_folds(spec.M, spec.N, spec.K, array.rows, array.cols, "os")
        extra = rf * cf * array.rows
    b = spec.batch
    cycles = rep.total_cycles + extra
    bws = rep.bandwidth_items()
    dram = (rep.ifmap_dram_reads * wb[0] + rep.filter_dram_reads * wb[1] + rep.ofmap_dram_writes * wb[2]) * b
    return GemmCost(
        cycles=b * cycles,
        compute_cycles=b * (cycles - rep.stall_cycles),
        stall_cycles=b * rep.stall_cycles,
        utilization=spec.M * spec.N * spec.K / (cycles * array.rows * array.cols),
        mapping_efficiency=rep.mapping_efficiency / 100,
        ifmap_sram_reads=b * rep.ifmap_sram_reads,
        filter_sram_reads=b * rep.filter_sram_reads,
        ofmap_sram_writes=b * rep.ofmap_sram_writes,
        ifmap_dram_reads=b * rep.ifmap_dram_reads,
        filter_dram_reads=b * rep.filter_dram_reads,
        ofmap_dram_writes=b * rep.ofmap_dram_writes,
        dram_bytes=dram,
        required_dram_bandwidth=bws[3] + bws[4] + bws[5],
        report=rep,
    )
