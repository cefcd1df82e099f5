"""evaluate(design, op_spec) -> Result: cycles, seconds, traffic per level, energy by unit and action.

Where each op runs:
    Gemm, MoERouter's GEMM     systolic arrays (or the PIM units for M <= pim_gemv_max_batch)
    Gemm with df11 weights     DRAM streams the compressed weights (the format's bits per weight); the
                               Huffman decode unit (`huffman_decoder.py`) turns them into bf16 in the
                               filter buffer, overlapped with the arrays' dense GEMM as a stream; a
                               design without that unit decodes on the vector lanes (software decode,
                               DF11_VECTOR_OPS lane-ops per weight)
    PagedDecodeAttention       PIM units when the design has them and they read the KV format: fp16/
                               bf16, or a quantized cache their dequantizing front end takes
                               (`pim.supports(spec, design.pim)`; softmax and partial-sum reduction
                               on the vector unit, serialised); a latent (MLA) cache, whose group is
                               every query head, takes PIM or the host path, the faster;
                               otherwise QK^T and P.V (GEMVs) on the arrays or as FMAs on the vector
                               lanes, whichever is faster; softmax on the vector unit; dequantization
                               on the KV quant engines (or the vector unit)
    Prefill/Extend/Tree attn.  arrays + vector unit (softmax)
    KVWrite, KVDequantize      KV quant engines if present and the format is quantized, else vector unit
    Norm, Softmax, RoPE, Elementwise, Sampling, CausalConv1d, SelectiveScan     vector unit
    GatedDeltaRule, SSDScan    one-token sequences (decode): the recurrence on the vector lanes; a prompt's
                               chunks: their products on the arrays, the triangular solve and decay masks
                               on the vector unit (`vector_unit.py`)
    Embedding                  DRAM (random rows)
    AllReduce                  chip-to-chip link (ring: the interconnect's latency per collective and per
                               step plus the spec's bytes, `collectives.py`), adds on the vector unit
    AllToAll                   chip-to-chip link (one direct step: latency, one step, the bytes sent)

Timing: units of one op overlap (double-buffered streaming), so time = max over the units' busy time
and the DRAM time (`dram.stream_access` on the spec's `min_bytes()`), except the PIM path, whose
phases are serialised (mode switches), as `pim.py` documents. DRAM traffic of a GEMM whose weights
do not fit in the filter buffer re-reads the activations once per weight chunk.

GEMM compute cycles come from `systolic.compute_cycles` (SCALE-Sim 3.0's stall-free closed form,
folds x fold_cycles - 1, output-stationary fold R + C + T - 2 as SCALE-Sim's code). If that module
is absent, `gemm_compute_cycles` here, the same closed form, stands in. Stalls are not taken from the
systolic simulation (`systolic.gemm_cost`): here the array and DRAM overlap and the op takes the
longer of the two, which is the stall-free bound; SRAM traffic follows SCALE-Sim's access counts
(`sram_words`). `systolic.gemm_cost` itself runs SCALE-Sim's trace-level model, seconds per large
GEMM, too slow for hundreds of ops per model step.

Energy (pJ) by "unit.action": systolic.mac, sram.<buffer>.read/write, dram.access (reads and writes
alike), noc.transfer, vector.op, kv_quant.elem, pim.mac, pim.bank_read, pim.io, pim.dequant (elements
the PIM front ends dequantize, present only when they do), link.transfer, huffman.lut_read,
huffman.logic.
Static (leakage) power is not modelled.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass

from codesign.accel_model import pim as pim_model
from codesign.accel_model.collectives import interconnect
from codesign.accel_model.design import Design
from codesign.accel_model.dram import random_access, stream_access
from codesign.accel_model.energy import PIM_DEQUANT_ELEM_PJ
from codesign.accel_model.huffman_decoder import huffman_cost
from codesign.accel_model.kv_quant_engine import kvq_cost
from codesign.accel_model.vector_unit import vector_cost
from codesign.specs import (
    AllReduce,
    AllToAll,
    CausalConv1d,
    CodesignError,
    Elementwise,
    Embedding,
    GatedDeltaRule,
    Gemm,
    KVDequantize,
    KVWrite,
    MoERouter,
    Norm,
    OpSpec,
    PagedDecodeAttention,
    PagedExtendAttention,
    PrefillAttention,
    RoPE,
    Sampling,
    SelectiveScan,
    Softmax,
    SSDScan,
    TreeAttention,
    dtype_bytes,
)


@dataclass(frozen=True)
class Result:
    """Cost of one op on one design. cycles are design-clock cycles; energy in pJ; traffic in bytes."""

    op: str
    unit: str
    cycles: float
    seconds: float
    traffic: dict[str, float]
    energy_pj: dict[str, float]
    utilisation: dict[str, float]
    bound: str

    @property
    def energy_total_pj(self) -> float:
        return sum(self.energy_pj.values())


def _fold_cycles(rows: int, cols: int, t: int, dataflow: str) -> int:
    return (rows if dataflow == "os" else 2 * rows) + cols + t - 2


def gemm_compute_cycles(M: int, N: int, K: int, rows: int, cols: int, dataflow: str) -> int:
    """Stall-free compute cycles of one GEMM on one rows x cols array (fallback, module docstring).

    os: spatial (M, N), temporal K; ws: spatial (K, N), temporal M; is: spatial (K, M), temporal N.
    cycles = folds x fold_cycles - 1, folds = ceil(S_r / rows) x ceil(S_c / cols).
    """
    if M == 0:
        return 0
    sr, sc, t = {"os": (M, N, K), "ws": (K, N, M), "is": (K, M, N)}[dataflow]
    folds = -(-sr // rows) * -(-sc // cols)
    return folds * _fold_cycles(rows, cols, t, dataflow) - 1


def sram_words(M: int, N: int, K: int, rows: int, cols: int, dataflow: str) -> tuple[int, int, int]:
    """(ifmap reads, filter reads, ofmap writes) in words of one GEMM on one array, as SCALE-Sim counts.

    The stationary operand is read once; a streamed operand once per fold of the other spatial dim:
        os: M*K*ceil(N/C), N*K*ceil(M/R), M*N
        ws: M*K*ceil(N/C), N*K,           M*N*ceil(K/R)
        is: M*K,           N*K*ceil(M/C), M*N*ceil(K/R)
    (ws and is equal `systolic.gemm_cost`'s counts; for os that model also counts R + C drain
    entries per fold in the ofmap writes, which are left out here.)
    """
    if dataflow == "os":
        return M * K * -(-N // cols), N * K * -(-M // rows), M * N
    if dataflow == "ws":
        return M * K * -(-N // cols), N * K, M * N * -(-K // rows)
    return M * K, N * K * -(-M // cols), M * N * -(-K // rows)


try:  # the systolic-array model, when present, is the one source of GEMM cycles
    from codesign.accel_model.systolic.model import compute_cycles as _compute_cycles  # type: ignore
except ImportError:  # pragma: no cover - depends on the other module being present
    _compute_cycles = gemm_compute_cycles


def _array_cycles(d: Design, M: int, N: int, K: int, batch: int) -> float:
    """Cycles for `batch` independent M x N x K GEMMs spread over the design's arrays."""
    a = d.systolic
    if M == 0 or batch == 0:
        return 0.0
    if batch >= a.count:
        return -(-batch // a.count) * _compute_cycles(M, N, K, a.rows, a.cols, a.dataflow)
    per = a.count // batch  # arrays per GEMM: split N
    return float(_compute_cycles(M, -(-N // per), K, a.rows, a.cols, a.dataflow))


class _Acc:
    """Accumulates busy time per unit, traffic and energy for one op."""

    def __init__(self, d: Design):
        self.d = d
        self.em = d.energy
        self.busy: dict[str, float] = {}
        self.traffic: dict[str, float] = {}
        self.energy: dict[str, float] = {}

    def add(self, table: dict[str, float], key: str, v: float) -> None:
        table[key] = table.get(key, 0.0) + v

    def dram(self, nbytes: float, pattern: str = "stream", request: int = 64) -> None:
        if nbytes <= 0:
            return
        m = self.d.memory
        r = stream_access(m, int(nbytes)) if pattern == "stream" else random_access(m, int(nbytes), request)
        self.add(self.busy, "dram", r.ns * 1e-9)
        self.add(self.traffic, "dram", float(nbytes))
        self.add(self.energy, "dram.access", nbytes * 8 * m.pj_per_bit)
        noc = self.d.links.noc_mm * self.em.noc_pj_per_bit_mm()
        self.add(self.traffic, "noc", float(nbytes))
        self.add(self.energy, "noc.transfer", nbytes * 8 * noc)

    def sram(self, name: str, read: float, write: float) -> None:
        buf = self.d.buffer(name)
        self.add(self.traffic, "sram", read + write)
        if read:
            self.add(self.energy, f"sram.{name}.read", buf.read_pj(int(read), self.em))
        if write:
            self.add(self.energy, f"sram.{name}.write", buf.write_pj(int(write), self.em))
        cyc = buf.access_cycles(int(read)) + buf.access_cycles(int(write))
        self.add(self.busy, f"sram.{name}", cyc / (self.d.clock_ghz * 1e9))

    def array(self, M: int, N: int, K: int, batch: int, act_dtype: str, w_bytes_elem: float) -> None:
        d = self.d
        cyc = _array_cycles(d, M, N, K, batch)
        self.add(self.busy, "systolic", cyc / (d.clock_ghz * 1e9))
        macs = float(M) * N * K * batch
        self.add(self.energy, "systolic.mac", macs * self.em.mac_pj(_mac_dtype(d, act_dtype)))
        self.add(self.traffic, "macs", macs)
        a = d.systolic
        ifmap, filt, ofmap = sram_words(M, N, K, a.rows, a.cols, a.dataflow)
        e = dtype_bytes(a.dtype)
        self.sram("ifmap", batch * ifmap * e, 0)
        self.sram("filter", batch * filt * w_bytes_elem, 0)
        self.sram("ofmap", 0, batch * ofmap * 4)  # fp32 partial sums

    def vector(self, spec: OpSpec) -> None:
        c = vector_cost(self.d.vector, spec)
        self.add(self.busy, "vector", c.cycles / (self.d.clock_ghz * 1e9))
        self.add(self.energy, "vector.op", c.lane_ops * self.em.vector_op_pj())

    def kvq(self, spec: OpSpec) -> None:
        c = kvq_cost(self.d.kv_quant, spec)
        self.add(self.busy, "kv_quant", c.cycles / (self.d.clock_ghz * 1e9))
        self.add(self.energy, "kv_quant.elem", c.elements * self.em.kvq_elem_pj())

    def result(self, spec: OpSpec, unit: str) -> Result:
        """Units overlap: time is the busiest unit's time; `bound` names that unit."""
        d = self.d
        seconds = max(self.busy.values(), default=0.0)
        bound = max(self.busy, key=self.busy.get) if self.busy else "none"
        util = {k: (v / seconds if seconds else 0.0) for k, v in self.busy.items()}
        macs = self.traffic.pop("macs", 0.0)
        if macs and seconds:
            a = d.systolic
            util["systolic_mac"] = macs / (seconds * d.clock_ghz * 1e9 * a.rows * a.cols * a.count)
        if "dram" in self.traffic and seconds:
            util["dram_bw"] = self.traffic["dram"] / (seconds * d.memory.peak_gbps * 1e9)
        return Result(
            spec.describe(),
            unit,
            seconds * d.clock_ghz * 1e9,
            seconds,
            self.traffic,
            self.energy,
            util,
            bound,
        )


def _mac_dtype(d: Design, act_dtype: str) -> str:
    if act_dtype in ("int8", "fp8_e4m3"):
        return act_dtype
    return d.systolic.dtype


def _weight_elem_bytes(spec: Gemm) -> float:
    return spec.weight.total_bytes(spec.N, spec.K) / (spec.N * spec.K)


# Software DF11 decode on the vector lanes, lane-ops per weight (estimate, the Triton decoder's per-code
# work): align the 32-bit window (2), LUT lookup (1), length/symbol extract and pointer add (2), load
# sign+mantissa and merge into bf16 (2), loop control (1).
DF11_VECTOR_OPS = 8
DF11_DECODED_BYTES = 2  # the decoder writes dense bf16 into the filter buffer


def _gemm(acc: _Acc, spec: Gemm) -> Result:
    d = acc.d
    if d.pim is not None and 0 < spec.M <= d.pim_gemv_max_batch and pim_model.supports(spec, d.pim):
        return _pim_gemv(acc, spec)
    if spec.weight.dtype == "df11":
        return _df11_gemm(acc, spec)
    acc.array(spec.M, spec.N, spec.K, spec.batch, spec.act_dtype, _weight_elem_bytes(spec))
    w_bytes = spec.batch * spec.weight.total_bytes(spec.N, spec.K)
    act_bytes = spec.batch * spec.M * spec.K * dtype_bytes(spec.act_dtype)
    chunks = max(1, math.ceil(w_bytes / d.buffer("filter").usable_bytes))
    acc.dram(spec.min_bytes() + (chunks - 1) * act_bytes)
    return acc.result(spec, "systolic")


def _df11_gemm(acc: _Acc, spec: Gemm) -> Result:
    """Decompress (Huffman unit, or vector lanes without one) + dense bf16 GEMM, overlapped as a stream.

    DRAM moves the compressed weights (`spec.min_bytes()` counts the format's bits per weight); the
    filter buffer holds decoded bf16, so the activation re-reads follow the decoded size.
    """
    d = acc.d
    n_w = spec.batch * spec.N * spec.K
    if d.huffman_decoder is not None:
        c = huffman_cost(d.huffman_decoder, n_w, acc.em)
        acc.add(acc.busy, "huffman", c.cycles / (d.clock_ghz * 1e9))
        acc.add(acc.energy, "huffman.lut_read", c.lut_pj)
        acc.add(acc.energy, "huffman.logic", c.logic_pj)
    else:
        ops = n_w * DF11_VECTOR_OPS
        acc.add(acc.busy, "vector", -(-ops // (d.vector.lanes * d.vector.count)) / (d.clock_ghz * 1e9))
        acc.add(acc.energy, "vector.op", ops * acc.em.vector_op_pj())
    acc.array(spec.M, spec.N, spec.K, spec.batch, spec.act_dtype, DF11_DECODED_BYTES)
    act_bytes = spec.batch * spec.M * spec.K * dtype_bytes(spec.act_dtype)
    chunks = max(1, math.ceil(n_w * DF11_DECODED_BYTES / d.buffer("filter").usable_bytes))
    acc.dram(spec.min_bytes() + (chunks - 1) * act_bytes)
    return acc.result(spec, "systolic")


def _pim_gemv(acc: _Acc, spec: Gemm) -> Result:
    return _pim_result(acc, spec, pim_model.gemv(acc.d.pim, spec))


def _pim_result(acc: _Acc, spec: OpSpec, r: pim_model.PIMResult) -> Result:
    """PIM phases, host transfers and host vector work run one after another (pim.py)."""
    d = acc.d
    em = acc.em
    acc.add(acc.energy, "pim.mac", r.macs * em.pim_mac_pj())
    acc.add(acc.energy, "pim.bank_read", r.bank_bytes * 8 * em.pim_read_pj_per_bit())
    acc.add(acc.energy, "pim.io", r.io_bytes * 8 * d.pim.memory.pj_per_bit)
    if r.dequant_elems:
        acc.add(acc.energy, "pim.dequant", r.dequant_elems * PIM_DEQUANT_ELEM_PJ)
    acc.add(acc.traffic, "pim_bank", r.bank_bytes)
    acc.add(acc.traffic, "host_pim", r.io_bytes)
    host_s = 0.0
    for op in r.host_ops:
        c = vector_cost(d.vector, op)
        host_s += c.cycles / (d.clock_ghz * 1e9)
        acc.add(acc.energy, "vector.op", c.lane_ops * em.vector_op_pj())
    busy = {"pim": r.pim_ns * 1e-9, "host_pim_io": r.io_ns * 1e-9, "vector": host_s}
    seconds = sum(busy.values())
    util = {k: (v / seconds if seconds else 0.0) for k, v in busy.items()}
    util["pim_mac"] = r.macs * 2 / (seconds * d.pim.peak_gflops * 1e9) if seconds else 0.0
    return Result(
        spec.describe(),
        "pim",
        seconds * d.clock_ghz * 1e9,
        seconds,
        acc.traffic,
        acc.energy,
        util,
        max(busy, key=busy.get),
    )


def _decode_attention(acc: _Acc, spec: PagedDecodeAttention) -> Result:
    d = acc.d
    if d.pim is not None and pim_model.supports(spec, d.pim):
        on_pim = _pim_result(acc, spec, pim_model.decode_attention(d.pim, spec))
        if not spec.latent_kv:
            return on_pim
        # A latent cache's group is every query head of the rank (16-128): the PIM MACs take each streamed
        # element that many times and may not keep up with the host's units; the faster of the two.
        on_host = _host_decode_attention(_Acc(d), spec)
        return on_pim if on_pim.seconds <= on_host.seconds else on_host
    return _host_decode_attention(acc, spec)


def _host_decode_attention(acc: _Acc, spec: PagedDecodeAttention) -> Result:
    """Decode attention on the arrays or the vector lanes (whichever is faster), softmax on the vector unit."""
    d = acc.d
    g = spec.q_heads // spec.kv_heads
    b = spec.batch
    L = -(-spec.kv_tokens() // b)
    act = "fp16" if spec.dtype != "fp32" else "fp32"
    kv_elem = spec.kv_format.bits_per_element(spec.head_dim) / 8
    # QK^T and P.V are GEMVs (M = GQA group): run them on the arrays or as FMAs on the vector lanes,
    # whichever finishes first given the vector unit's other work here (weight-stationary arrays are
    # poor at M = 1).
    n = b * spec.kv_heads
    arr = _array_cycles(d, g, L, spec.head_dim, n) + _array_cycles(d, g, spec.v_dim, L, n)
    macs = spec.kv_tokens() * spec.q_heads * (spec.head_dim + spec.v_dim)
    vec = -(-macs // (d.vector.lanes * d.vector.count)) + d.vector.depth
    softmax = Softmax(b * spec.q_heads, L)
    deq = None
    if spec.kv_format.quantized:
        deq = KVDequantize(spec.kv_tokens(), spec.kv_heads, spec.head_dim, spec.kv_format, latent=spec.latent_kv)
    other = vector_cost(d.vector, softmax).cycles
    if deq is not None and d.kv_quant is None:
        other += vector_cost(d.vector, deq).cycles
    on_array = max(arr, other) <= vec + other
    if on_array:
        acc.array(g, L, spec.head_dim, n, act, kv_elem)  # QK^T
        acc.array(g, spec.v_dim, L, n, act, kv_elem)  # P.V
    else:
        acc.add(acc.busy, "vector", vec / (d.clock_ghz * 1e9))
        acc.add(acc.energy, "vector.op", macs * acc.em.vector_op_pj())
    acc.vector(softmax)
    if deq is not None:
        acc.kvq(deq) if d.kv_quant is not None else acc.vector(deq)
    acc.dram(spec.min_bytes())
    return acc.result(spec, "systolic" if on_array else "vector")


def _dense_attention(acc: _Acc, spec: OpSpec, q_lens: tuple[int, ...], kv_lens: tuple[int, ...]) -> Result:
    """Prefill / extend / tree attention: work from the spec's flops, array efficiency from the means."""
    q_heads, kv_heads, hd, vd = spec.q_heads, spec.kv_heads, spec.head_dim, spec.v_dim
    n = len(q_lens)
    mq = -(-sum(q_lens) // n)
    mk = -(-sum(kv_lens) // n)
    hm = (hd + vd) / 2  # the mean of the two products' widths (head_dim itself unless MLA's values differ)
    pairs = (spec.flops() / q_heads) / (4.0 * hm + 5)
    # Representative per-head GEMMs give the array efficiency; the total work scales it.
    rep_macs = 2.0 * mq * mk * hm
    a = acc.d.systolic
    rep_cyc = _array_cycles(acc.d, mq, mk, hd, 1) + _array_cycles(acc.d, mq, vd, mk, 1)
    eff_cyc = rep_cyc * (pairs * 2 * hm * q_heads) / rep_macs / a.count if rep_macs else 0.0
    acc.add(acc.busy, "systolic", eff_cyc / (acc.d.clock_ghz * 1e9))
    macs = 2.0 * pairs * hm * q_heads
    acc.add(acc.energy, "systolic.mac", macs * acc.em.mac_pj(a.dtype))
    acc.add(acc.traffic, "macs", macs)
    acc.vector(Softmax(q_heads, max(1, int(pairs))))
    kv_fmt = getattr(spec, "kv_format", None)
    if kv_fmt is not None and kv_fmt.quantized:
        deq = KVDequantize(sum(kv_lens), kv_heads, hd, kv_fmt, latent=spec.latent_kv)
        acc.kvq(deq) if acc.d.kv_quant is not None else acc.vector(deq)
    acc.dram(spec.min_bytes())
    return acc.result(spec, "systolic")


def _chunk_products(spec: GatedDeltaRule | SSDScan, c: int) -> list[tuple[int, int, int, int]]:
    """(M, N, K, GEMMs) of one chunk of c tokens' products: what `matmul_flops` counts."""
    if isinstance(spec, SSDScan):
        p, n = spec.head_dim, spec.state
        # C B^T a group; a head's scores on x, the chunk's state B^T x, the output from the incoming state C h
        return [(c, c, n, spec.groups), (c, p, c, spec.heads), (n, p, c, spec.heads), (c, p, n, spec.heads)]
    dk, dv, h = spec.key_dim, spec.value_dim, spec.value_heads
    # K K^T and Q K^T; the solve's result on beta V and on decayed beta K; attention on the new values; the two
    # reads of the state and its update
    return [(c, c, dk, 2 * h), (c, dv, c, h), (c, dk, c, h), (c, dv, c, h), (c, dv, dk, 2 * h), (dk, dv, c, h)]


def _chunked_scan(acc: _Acc, spec: GatedDeltaRule | SSDScan) -> Result:
    """A recurrent layer's step (Gated DeltaNet, Mamba-2): a prompt's chunk products on the arrays, grouped by chunk
    length; the recurrence, solves and masks on the vector lanes."""
    counts = Counter(spec.prompt_chunks())
    for c, k in sorted(counts.items()):
        for m, n, kk, per_chunk in _chunk_products(spec, c):
            acc.array(m, n, kk, k * per_chunk, spec.dtype, dtype_bytes(spec.dtype))
    acc.vector(spec)
    acc.dram(spec.min_bytes())
    return acc.result(spec, "systolic" if counts else "vector")


def _vector_op(acc: _Acc, spec: OpSpec) -> Result:
    acc.vector(spec)
    nbytes = spec.min_bytes()
    acc.sram("ofmap", nbytes, nbytes)
    acc.dram(nbytes)
    return acc.result(spec, "vector")


def _kv_op(acc: _Acc, spec: KVWrite | KVDequantize) -> Result:
    use_engine = acc.d.kv_quant is not None and spec.kv_format.quantized
    acc.kvq(spec) if use_engine else acc.vector(spec)
    acc.dram(spec.min_bytes())
    return acc.result(spec, "kv_quant" if use_engine else "vector")


def _router(acc: _Acc, spec: MoERouter) -> Result:
    acc.array(spec.tokens, spec.experts, spec.hidden, 1, "fp16", dtype_bytes(spec.dtype))
    acc.vector(spec)
    acc.dram(spec.min_bytes())
    return acc.result(spec, "systolic")


def _embedding(acc: _Acc, spec: Embedding) -> Result:
    row = int(spec.hidden * dtype_bytes(spec.dtype))
    acc.dram(spec.tokens * row, "random", row)
    acc.dram(spec.min_bytes() - spec.tokens * row)
    return acc.result(spec, "dram")


def _collective(acc: _Acc, spec: AllReduce | AllToAll) -> Result:
    """Bytes over the chip link (the interconnect's collective time), read from and written to DRAM; an
    all-reduce's sums on the vector lanes."""
    d = acc.d
    if spec.world_size > 1 and spec.numel:
        if d.links.chip_link_gbps <= 0:
            raise CodesignError(f"design {d.name!r} has no chip-to-chip link (links.chip_link_gbps = 0)")
        nbytes = spec.min_bytes()
        acc.add(acc.busy, "link", interconnect(d.links.interconnect).collective_s(spec, d.links.chip_link_gbps * 1e9))
        acc.add(acc.traffic, "link", nbytes)
        acc.add(acc.energy, "link.transfer", nbytes * 8 * d.links.link_pj_per_bit)
        if isinstance(spec, AllReduce):
            acc.vector(Elementwise("add", int(spec.flops()), spec.dtype))
        acc.dram(2 * nbytes)
    return acc.result(spec, "link")


# Design fields every cost reads (DRAM time and energy, NoC energy, clock, SRAM buffers, energy model).
_ALWAYS = ("node_nm", "clock_ghz", "memory", "sram", "links")


def design_fields_read(
    pim: bool | pim_model.PIMSpec | None, pim_gemv_max_batch: int, spec: OpSpec
) -> tuple[str, ...]:
    """Names of the `Design` fields `evaluate(design, spec)` can read, for a design with/without PIM.

    `pim`: the design's `PIMSpec` (exact lists), or only whether it has one (True/False: for a
    quantized decode attention the list then holds both paths' fields, since whether the PIM takes it
    depends on its dequant front end).
    Contract: two designs equal on these fields give equal `evaluate` results for `spec` (the name and
    source never enter a result). Kept next to the dispatch below: a cost function that starts reading
    another unit must add it here (tests/dataflow/explore/test_explore_speed.py compares against uncached evaluation).
    """
    has_pim = pim is not None and pim is not False
    pim_spec = pim if isinstance(pim, pim_model.PIMSpec) else None
    if isinstance(spec, Gemm):
        if spec.weight.dtype == "df11":  # never PIM (pim.why_not refuses df11); decoder or vector lanes
            return (*_ALWAYS, "systolic", "vector", "huffman_decoder")
        if has_pim and 0 < spec.M <= pim_gemv_max_batch:  # may take the PIM GEMV path (host ops on vector)
            return (*_ALWAYS, "systolic", "vector", "pim", "pim_gemv_max_batch")
        return (*_ALWAYS, "systolic")
    if isinstance(spec, PagedDecodeAttention):
        host = (
            (*_ALWAYS, "systolic", "vector", "kv_quant")
            if spec.kv_format.quantized
            else (*_ALWAYS, "systolic", "vector")
        )
        if not has_pim:
            return host  # arrays or vector lanes; the KV-quant engines only dequantize a quantized cache
        if pim_spec is not None or not spec.kv_format.quantized:
            # fp16/bf16 caches: pim.supports does not depend on the front end
            if pim_model.supports(spec, pim_spec):
                if spec.latent_kv:  # PIM or the host, the faster: both paths' fields
                    return (*host, "pim")
                return (*_ALWAYS, "vector", "pim")  # the PIM path: PIM units plus host vector work only
            return host
        return (*host, "pim")  # PIM or host, decided by the unknown front end: both paths' fields
    if isinstance(spec, PrefillAttention | PagedExtendAttention | TreeAttention):
        return (*_ALWAYS, "systolic", "vector", "kv_quant")
    if isinstance(spec, KVWrite | KVDequantize):
        return (*_ALWAYS, "vector", "kv_quant")
    if isinstance(spec, MoERouter):
        return (*_ALWAYS, "systolic", "vector")
    if isinstance(spec, Embedding):
        return _ALWAYS
    if isinstance(spec, Norm | Softmax | RoPE | Elementwise | Sampling | AllReduce | AllToAll | CausalConv1d |
                  SelectiveScan):  # fmt: skip
        return (*_ALWAYS, "vector")
    if isinstance(spec, GatedDeltaRule | SSDScan):
        return (*_ALWAYS, "systolic", "vector")
    # Unknown operators: every field (evaluate raises for them anyway).
    return (*_ALWAYS, "systolic", "vector", "kv_quant", "pim", "pim_gemv_max_batch", "huffman_decoder")


def evaluate(design: Design, spec: OpSpec) -> Result:
    """Cost of `spec` on `design` (placement and timing rules in the module docstring)."""
    acc = _Acc(design)
    if isinstance(spec, Gemm):
        return _gemm(acc, spec)
    if isinstance(spec, PagedDecodeAttention):
        return _decode_attention(acc, spec)
    if isinstance(spec, PrefillAttention):
        return _dense_attention(acc, spec, spec.seq_lens, spec.seq_lens)
    if isinstance(spec, PagedExtendAttention):
        kv = tuple(p + q for p, q in zip(spec.prefix_lens, spec.q_lens))
        return _dense_attention(acc, spec, spec.q_lens, kv)
    if isinstance(spec, TreeAttention):
        kv = tuple(p + t for p, t in zip(spec.prefix_lens, spec.tree_sizes))
        return _dense_attention(acc, spec, spec.tree_sizes, kv)
    if isinstance(spec, KVWrite | KVDequantize):
        return _kv_op(acc, spec)
    if isinstance(spec, Norm | Softmax | RoPE | Elementwise | Sampling | CausalConv1d | SelectiveScan):
        return _vector_op(acc, spec)
    if isinstance(spec, GatedDeltaRule | SSDScan):
        return _chunked_scan(acc, spec)
    if isinstance(spec, MoERouter):
        return _router(acc, spec)
    if isinstance(spec, Embedding):
        return _embedding(acc, spec)
    if isinstance(spec, AllReduce | AllToAll):
        return _collective(acc, spec)
    raise CodesignError(f"evaluate: no cost model for {type(spec).__name__}")
