"""Bank-level processing-in-memory (HBM-PIM / AttAcc style) for decode attention and small-batch GEMV.

The unit: one MAC unit per `banks_per_unit` banks (HBM-PIM: a 16-lane FP16 unit per bank pair;
AttAcc: per bank or per bank group). In all-bank mode every bank of every channel opens a row at
once; each unit then reads one column (`lanes` x 2 B = 32 B, the 256-bit column of HBM) from the
open row every tCCD_L and multiplies it by `lanes` operands held in its registers:

    units       = channels x banks / banks_per_unit
    peak FLOP/s = units x lanes x 2 / tCCD_L
    HBM-PIM calibration (Kwon et al., ISSCC 2021; Lee et al., ISCA 2021, "Hardware architecture and
    software stack for PIM based on commercial DRAM technology"): HBM2 at 2.4 Gb/s, 16 pseudo-channels
    x 16 banks / 2 = 128 units x 16 lanes x 2 / 3.33 ns = 1.23 TFLOPS ("1.2 TFLOPS FP16 at 300 MHz").

Streaming W bytes through the units (balanced over units, column reads c = ceil(W / units / 32 B)):
    t = c x reuse x tCCD_L + rows x (tRP + tRCD),   rows = ceil(c / columns per row)
(each row: one ACT then tRCD before its first column, one PRE and tRP after its last; the RTL twin
`hdl_tests/rtl/pim_bank_mac.v` issues exactly this sequence, see `pim_mac.bank_cycles`)
where reuse = vectors multiplied by each column (batch M for GEMV, the GQA group for attention): the
unit does `lanes` MACs per tCCD_L, so M vectors take M slots. Row switches are not hidden (all banks
switch together in all-bank mode). Host <-> PIM traffic (input vectors broadcast to every channel,
scores out, probabilities in, partial sums out) goes over the channels' buses at their peak rate,
serialised with the PIM phases (HBM-PIM switches modes between them). The softmax runs on the host
(`host_ops` lists the vector work the caller must cost), as in AttAcc.

Operands are FP16/BF16: quantized weights or KV caches are not supported (`supports()` says so, and
the evaluator then keeps the op on the host).
"""

from __future__ import annotations

from dataclasses import dataclass

from codesign.accel_model.dram import DRAMSpec
from codesign.specs import (
    CodesignError,
    Elementwise,
    Gemm,
    OpSpec,
    PagedDecodeAttention,
    Softmax,
    check_positive_int,
)


@dataclass(frozen=True)
class PIMSpec:
    """PIM units inside the banks of `memory` (all its channels and units)."""

    memory: DRAMSpec
    banks_per_unit: int = 2
    lanes: int = 16

    def __post_init__(self) -> None:
        check_positive_int("pim.banks_per_unit", self.banks_per_unit)
        check_positive_int("pim.lanes", self.lanes)
        if self.memory.banks % self.banks_per_unit:
            raise CodesignError(
                f"pim.banks_per_unit={self.banks_per_unit} must divide the {self.memory.banks} banks "
                "per channel"
            )

    @property
    def units(self) -> int:
        return self.memory.total_channels * self.memory.banks // self.banks_per_unit

    @property
    def t_col_ns(self) -> float:
        """One column read per unit per tCCD_L (in whole clock cycles)."""
        return self.memory._cyc["nCCD_L"] * self.memory.tCK_ns

    @property
    def col_bytes(self) -> int:
        return self.lanes * 2

    @property
    def peak_gflops(self) -> float:
        """units x lanes x 2 / tCCD_L, GFLOP/s."""
        return self.units * self.lanes * 2 / self.t_col_ns

    @property
    def internal_gbps(self) -> float:
        """Bytes per ns all units read from their banks: units x 32 B / tCCD_L."""
        return self.units * self.col_bytes / self.t_col_ns


@dataclass(frozen=True)
class PIMResult:
    """Time split of one op on PIM; host_ops are the host-side vector ops (softmax, reductions) to add."""

    pim_ns: float  # MAC phases inside the banks
    io_ns: float  # host <-> PIM transfers
    io_bytes: float
    bank_bytes: float  # bytes read inside the banks
    macs: float
    host_ops: tuple[OpSpec, ...]

    @property
    def ns(self) -> float:
        return self.pim_ns + self.io_ns


def supports(spec: OpSpec) -> bool:
    """True if the op can run on the PIM units: fp16/bf16 decode attention or fp16/bf16 GEMV."""
    if isinstance(spec, PagedDecodeAttention):
        return (
            not spec.kv_format.quantized and spec.kv_format.dtype in ("fp16", "bf16") and spec.window is None
        )
    if isinstance(spec, Gemm):
        return (
            not spec.weight.quantized
            and spec.weight.dtype in ("fp16", "bf16")
            and spec.act_dtype in ("fp16", "bf16")
        )
    return False


def _stream_ns(pim: PIMSpec, nbytes: float, reuse: int) -> float:
    """Time for the units to read `nbytes` (balanced) and use each column `reuse` times."""
    if nbytes <= 0:
        return 0.0
    m = pim.memory
    cols = -(-int(-(-nbytes // pim.units)) // pim.col_bytes)
    rows = -(-cols // (m.row_bytes // pim.col_bytes))
    c = m._cyc
    row_switch = (c["nRP"] + c["nRCD"]) * m.tCK_ns
    return (cols * reuse * pim.t_col_ns + rows * row_switch) / (1 - m.refresh_loss)


def _bus_ns(pim: PIMSpec, nbytes: float) -> float:
    return nbytes / pim.memory.peak_gbps if nbytes > 0 else 0.0


def gemv(pim: PIMSpec, spec: Gemm) -> PIMResult:
    """Y[M, N] = X[M, K] W[N, K]^T with W resident in the banks (small batch M).

    Inputs X are broadcast to every channel (M*K*2 B per channel, channels in parallel); when N is
    smaller than the unit count, K is split over split = ceil(units / N) units and the host adds the
    partial sums (split x M x N partials out, an Elementwise add of (split - 1) x M x N on the host).
    """
    if not supports(spec):
        raise CodesignError(f"PIM GEMV needs fp16/bf16 weights and activations, got {spec.describe()}")
    m_rows = max(spec.M, 1) * spec.batch
    w_bytes = spec.batch * spec.N * spec.K * 2
    pim_ns = _stream_ns(pim, w_bytes, max(spec.M, 1))
    split = max(1, -(-pim.units // (spec.N * spec.batch)))
    ch = pim.memory.total_channels
    x_bytes = m_rows * spec.K * 2 * ch  # one copy per channel, written in parallel
    out_bytes = split * m_rows * spec.N * 2
    io_ns = (m_rows * spec.K * 2) / (pim.memory.peak_gbps / ch) + _bus_ns(pim, out_bytes)
    host: tuple[OpSpec, ...] = ()
    if split > 1:
        host = (Elementwise("add", (split - 1) * m_rows * spec.N, "fp32"),)
    return PIMResult(
        pim_ns, io_ns, x_bytes + out_bytes, w_bytes, float(spec.M * spec.N * spec.K * spec.batch), host
    )


def decode_attention(pim: PIMSpec, spec: PagedDecodeAttention) -> PIMResult:
    """Decode attention with K and V in the banks: QK^T on PIM, softmax on the host, P.V on PIM.

    Phases: q broadcast to every channel; QK^T streams K (reuse = GQA group G); scores out
    (batch x q_heads x L x 2 B); host softmax; probabilities in (same bytes); P.V streams V (reuse G);
    partial outputs out: each unit returns its `lanes`-wide accumulators for every head-slice it
    holds, max(units, batch x kv_heads) x head_dim x G x 2 B in all; the host sums them.
    """
    if not supports(spec):
        raise CodesignError(
            f"PIM attention needs an fp16/bf16 KV cache without a window, got {spec.kv_format.name}"
        )
    g = spec.q_heads // spec.kv_heads
    tokens = spec.kv_tokens()
    kv_bytes = tokens * spec.kv_heads * spec.head_dim * 2  # K alone (V is the same)
    t_qk = _stream_ns(pim, kv_bytes, g)
    t_sv = _stream_ns(pim, kv_bytes, g)
    ch = pim.memory.total_channels
    q_bytes = spec.batch * spec.q_heads * spec.head_dim * 2
    score_bytes = tokens * spec.q_heads * 2
    slices = max(pim.units, spec.batch * spec.kv_heads)
    partial_bytes = slices * spec.head_dim * g * 2
    io_ns = (
        q_bytes / (pim.memory.peak_gbps / ch) + _bus_ns(pim, 2 * score_bytes) + _bus_ns(pim, partial_bytes)
    )
    partial_elems = max(0, slices - spec.batch * spec.kv_heads) * spec.head_dim * g
    host: tuple[OpSpec, ...] = (Softmax(rows=1, cols=tokens * spec.q_heads),)
    if partial_elems:
        host = host + (Elementwise("add", partial_elems, "fp32"),)
    macs = 2.0 * tokens * spec.q_heads * spec.head_dim
    return PIMResult(
        t_qk + t_sv, io_ns, q_bytes * ch + 2 * score_bytes + partial_bytes, 2.0 * kv_bytes, macs, host
    )
