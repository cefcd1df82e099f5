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

Quantized operands (design key `pim.dequant`, `PIMDequantSpec`): without it the units read fp16/bf16
only, and `supports()` refuses quantized KV caches and weights (`why_not()` says why; the evaluator
then keeps the op on the host). With it, each unit has a dequantizing front end between the column
latch and the MAC lanes:

    pim: {..., dequant: {bits: [8, 4], elems_per_cmd: 32, mac_lanes: 16, meta_bytes: 512, fp8: false}}

    bits           code widths the front end unpacks (subset of 2, 4, 8; asymmetric integer codes)
    elems_per_cmd  codes it dequantizes per command slot (tCCD_L)
    mac_lanes      fp16 MAC lanes behind it (default: `lanes`; a multiple of `lanes`: widening the
                   unit to use more of a column of narrow codes per slot)
    meta_bytes     its scale/zero register file (default 512 B, the size of HBM-PIM's GRF: 16 x
                   256-bit registers, Lee et al. ISCA 2021)
    fp8            also e4m3 codes (KV `fp8` per head, fp8 weights)

Each code becomes an fp16 operand, x = fp16(fp32(code x scale) + zero) (`pim_dequant.py`, bit-exact
with `kernels.kvcache.quantizers.dequantize_asym` rounded to fp16), then the fp16 MAC path as before. A column
of col_bytes x 8 / b codes takes
    slots = ceil((col_bytes x 8 / b) / min(elems_per_cmd, mac_lanes))
command slots per vector, so per column slots x reuse: the front end has no fp16 operand buffer, each
reuse pass dequantizes the column again (dequantized elements = codes x reuse, the `pim.dequant`
energy). 16 lanes reading int4 need 4 slots per column (the same MAC time as fp16, only fewer row
switches); `mac_lanes: 64, elems_per_cmd: 64` gets 4x.

Where the metadata lives: in the same DRAM rows as the codes it scales, packed in metadata columns
(8 fp16 (scale, zero) pairs per 32 B column) beside the code columns; the front end loads a metadata
column into its register file with one column command (one slot, not repeated per reuse pass, as the
registers hold it) and uses it for every code it covers. Bytes per unit:
    code_cols = ceil(code_bytes / units / col_bytes),  meta_cols = ceil(meta_bytes / units / col_bytes)
    t = (code_cols x slots x reuse + meta_cols) x tCCD_L + rows x (tRP + tRCD),
    rows = ceil((code_cols + meta_cols) / columns per row)
code_bytes + meta_bytes is exactly the format's bytes (`KVFormat.bytes_per_token`,
`WeightFormat.total_bytes`): per token b x D / 8 codes + one pair per (token, kv head); KIVI keys one
pair per (channel, group of G tokens, kv head) (the group's D pairs held in the register file while
its G tokens stream: meta_bytes >= D x pair bytes), KIVI values one pair per (token, group of
min(G, D) channels); fp8 one fp32 scale per kv head (held in a register, 0 bytes per token, as the
format counts). KIVI's fp16 residual window is not counted, as in `KVFormat`. Oaken formats are
refused: their sparse outliers (fp16 value + in-block position) must be scattered into the dense
operand stream, and the front end has no scatter path.
"""

from __future__ import annotations

from dataclasses import dataclass

from codesign.accel_model.dram import DRAMSpec
from codesign.accel_model.energy import (
    PIM_DEQUANT_LANE_UM2,
    PIM_MAC_FP16_UM2,
    PIM_REG_BIT_UM2,
)
from codesign.specs import (
    CodesignError,
    Elementwise,
    Gemm,
    KVFormat,
    OpSpec,
    PagedDecodeAttention,
    Softmax,
    check_positive_int,
    dtype_bits,
    dtype_bytes,
)

DEQUANT_BITS = (2, 4, 8)


@dataclass(frozen=True)
class PIMDequantSpec:
    """The dequantizing front end of every PIM unit (module docstring: fields and cost)."""

    bits: tuple[int, ...] = (8, 4)
    elems_per_cmd: int = 32
    mac_lanes: int | None = None  # None: the unit's `lanes`
    meta_bytes: int = 512
    fp8: bool = False

    def __post_init__(self) -> None:
        b = self.bits
        if (
            not isinstance(b, tuple)
            or not b
            or len(set(b)) != len(b)
            or any(isinstance(x, bool) or x not in DEQUANT_BITS for x in b)
        ):
            raise CodesignError(f"pim.dequant.bits must be distinct values from {DEQUANT_BITS}, got {b!r}")
        check_positive_int("pim.dequant.elems_per_cmd", self.elems_per_cmd)
        if self.mac_lanes is not None:
            check_positive_int("pim.dequant.mac_lanes", self.mac_lanes)
        check_positive_int("pim.dequant.meta_bytes", self.meta_bytes)
        if not isinstance(self.fp8, bool):
            raise CodesignError(f"pim.dequant.fp8 must be true or false, got {self.fp8!r}")


@dataclass(frozen=True)
class PIMSpec:
    """PIM units inside the banks of `memory` (all its channels and units); `dequant`: optional front end."""

    memory: DRAMSpec
    banks_per_unit: int = 2
    lanes: int = 16
    dequant: PIMDequantSpec | None = None

    def __post_init__(self) -> None:
        check_positive_int("pim.banks_per_unit", self.banks_per_unit)
        check_positive_int("pim.lanes", self.lanes)
        if self.memory.banks % self.banks_per_unit:
            raise CodesignError(
                f"pim.banks_per_unit={self.banks_per_unit} must divide the {self.memory.banks} banks "
                "per channel"
            )
        dq = self.dequant
        if dq is not None and dq.mac_lanes is not None and dq.mac_lanes % self.lanes:
            raise CodesignError(
                f"pim.dequant.mac_lanes must be a multiple of pim.lanes={self.lanes}, got {dq.mac_lanes}"
            )
        if dq is not None and dq.meta_bytes < self.col_bytes:
            raise CodesignError(
                f"pim.dequant.meta_bytes must hold at least one {self.col_bytes} B metadata column, "
                f"got {dq.meta_bytes}"
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
    def mac_lanes(self) -> int:
        """MAC lanes the dequantized stream can use (= lanes without a wider front end)."""
        dq = self.dequant
        return self.lanes if dq is None or dq.mac_lanes is None else dq.mac_lanes

    @property
    def peak_gflops(self) -> float:
        """units x lanes x 2 / tCCD_L, GFLOP/s."""
        return self.units * self.lanes * 2 / self.t_col_ns

    @property
    def internal_gbps(self) -> float:
        """Bytes per ns all units read from their banks: units x 32 B / tCCD_L."""
        return self.units * self.col_bytes / self.t_col_ns

    def slots_per_column(self, bits: int) -> int:
        """MAC command slots per column per vector: ceil((col_bytes x 8 / bits) / min(elems_per_cmd, mac
        lanes)); 1 for fp16/bf16 (bits 16, no front end)."""
        if bits >= 16:
            return 1
        if self.dequant is None:
            raise CodesignError("this PIM has no dequantizing front end (pim.dequant)")
        rate = min(self.dequant.elems_per_cmd, self.mac_lanes)
        return -(-(self.col_bytes * 8 // bits) // rate)


def area_mm2(pim: PIMSpec) -> dict[str, float]:
    """Logic area on the DRAM dies, mm^2: {"pim.mac": the units' fp16 MAC lanes, "pim.dequant": front
    ends + extra MAC lanes + registers (only with a front end)}.

    Per unit: lanes x PIM_MAC_FP16_UM2 for the MACs; elems_per_cmd x PIM_DEQUANT_LANE_UM2 +
    (mac_lanes - lanes) x PIM_MAC_FP16_UM2 + meta_bytes x 8 x PIM_REG_BIT_UM2 for the front end
    (energy.py: sources); DRAM-process logic, not node-scaled. Not part of `Design.area_mm2` (the
    accelerator die): explorations report it as its own metric, `pim_logic_mm2`.
    """
    out = {"pim.mac": pim.units * pim.lanes * PIM_MAC_FP16_UM2 / 1e6}
    dq = pim.dequant
    if dq is None:
        return out
    per_unit = (
        dq.elems_per_cmd * PIM_DEQUANT_LANE_UM2
        + (pim.mac_lanes - pim.lanes) * PIM_MAC_FP16_UM2
        + dq.meta_bytes * 8 * PIM_REG_BIT_UM2
    )
    out["pim.dequant"] = pim.units * per_unit / 1e6
    return out


@dataclass(frozen=True)
class PIMStream:
    """One streamed operand (K, V or W) on every unit: totals in bytes, per-unit columns and rows."""

    code_bytes: float  # all units together
    meta_bytes: float
    bits: int  # code width (16: fp16/bf16, no front end)
    code_cols: int  # per unit
    meta_cols: int
    slots: int  # command slots per code column per vector
    reuse: int
    rows: int
    ns: float

    @property
    def dequant_elems(self) -> float:
        """Elements the front ends dequantize: codes x reuse (no operand buffer); 0 for fp16/bf16."""
        return 0.0 if self.bits >= 16 else self.code_bytes * 8 / self.bits * self.reuse


@dataclass(frozen=True)
class PIMResult:
    """Time split of one op on PIM; host_ops are the host-side vector ops (softmax, reductions) to add."""

    pim_ns: float  # MAC phases inside the banks
    io_ns: float  # host <-> PIM transfers
    io_bytes: float
    bank_bytes: float  # bytes read inside the banks (codes + metadata)
    macs: float
    host_ops: tuple[OpSpec, ...]
    dequant_elems: float = 0.0  # elements the dequantizing front ends produced

    @property
    def ns(self) -> float:
        return self.pim_ns + self.io_ns


def _kv_bits(fmt: KVFormat) -> int:
    return 16 if fmt.dtype in ("fp16", "bf16") else dtype_bits(fmt.dtype)


def why_not(spec: OpSpec, pim: PIMSpec | None = None) -> str | None:
    """Why `spec` cannot run on the units of `pim` (None: a plain unit, no front end); None if it can.

    Plain units: fp16/bf16 decode attention without a window, fp16/bf16 GEMV with fp16/bf16
    activations. With `pim.dequant`: also per-token or KIVI int KV caches and int weights whose code
    width is in `dequant.bits`, and e4m3 KV / weights when `dequant.fp8`. Never: Oaken KV, df11 weights.
    """
    dq = pim.dequant if pim is not None else None
    if isinstance(spec, PagedDecodeAttention):
        return _why_not_attention(spec, dq)
    if isinstance(spec, Gemm):
        return _why_not_gemv(spec, dq)
    return f"PIM units run decode attention and GEMV, not {type(spec).__name__}"


def _why_not_attention(spec: PagedDecodeAttention, dq: PIMDequantSpec | None) -> str | None:
    """`why_not` for decode attention: the KV cache's format against the front end `dq` (None: none)."""
    fmt = spec.kv_format
    if spec.window is not None:
        return "PIM attention streams whole KV caches: sliding windows are not supported"
    if not fmt.quantized:
        return None if fmt.dtype in ("fp16", "bf16") else f"PIM MACs are fp16: {fmt.dtype} KV is not"
    if dq is None:
        return f"PIM attention needs an fp16/bf16 KV cache (no pim.dequant front end), got {fmt.name}"
    if fmt.scheme == "oaken":
        return (
            f"{fmt.name}: Oaken's sparse outliers (fp16 value + in-block position) must be scattered "
            "into the dense operand stream, and the PIM dequant front end has no scatter path"
        )
    if fmt.scheme == "per_head":
        return None if dq.fp8 else f"{fmt.name}: the PIM dequant front end has no fp8 path (dequant.fp8)"
    bits = _kv_bits(fmt)
    if bits not in dq.bits:
        return f"{fmt.name}: the PIM dequant front end unpacks {list(dq.bits)}-bit codes, not {bits}-bit"
    pair = 2 * dtype_bytes(fmt.scale_dtype)
    if fmt.scheme == "kivi" and spec.head_dim * pair > dq.meta_bytes:
        return (
            f"{fmt.name}: per-channel keys need head_dim x {pair:g} B = {spec.head_dim * pair:g} B of "
            f"scale/zero registers, pim.dequant.meta_bytes is {dq.meta_bytes}"
        )
    return None


def _why_not_gemv(spec: Gemm, dq: PIMDequantSpec | None) -> str | None:
    """`why_not` for a GEMM: activations and the weight format against the front end `dq` (None: none)."""
    w = spec.weight
    if spec.act_dtype not in ("fp16", "bf16"):
        return f"PIM GEMV needs fp16/bf16 activations, got {spec.act_dtype}"
    if not w.quantized:
        if w.dtype in ("fp16", "bf16"):
            return None
        return f"PIM GEMV needs fp16/bf16 weights and activations, got {w.name} weights"
    if dq is None:
        return f"PIM GEMV needs fp16/bf16 weights and activations (no pim.dequant front end), got {w.name}"
    if w.dtype.startswith("fp8"):
        return None if dq.fp8 else f"{w.name}: the PIM dequant front end has no fp8 path (dequant.fp8)"
    if dtype_bits(w.dtype) not in dq.bits:
        return f"{w.name}: the PIM dequant front end unpacks {list(dq.bits)}-bit codes"
    return None


def supports(spec: OpSpec, pim: PIMSpec | None = None) -> bool:
    """True if the op can run on the units of `pim` (None: plain fp16 units): `why_not` is None."""
    return why_not(spec, pim) is None


def stream(pim: PIMSpec, code_bytes: float, reuse: int, bits: int = 16, meta_bytes: float = 0.0) -> PIMStream:
    """Columns, rows and time for the units to read `code_bytes` + `meta_bytes` (balanced over units)
    and use each code column `reuse` times (module docstring's formula)."""
    m = pim.memory
    code_cols = -(-int(-(-code_bytes // pim.units)) // pim.col_bytes) if code_bytes > 0 else 0
    meta_cols = -(-int(-(-meta_bytes // pim.units)) // pim.col_bytes) if meta_bytes > 0 else 0
    slots = pim.slots_per_column(bits)
    rows = -(-(code_cols + meta_cols) // (m.row_bytes // pim.col_bytes))
    c = m._cyc
    row_switch = (c["nRP"] + c["nRCD"]) * m.tCK_ns
    cmds = code_cols * slots * reuse + meta_cols
    ns = (cmds * pim.t_col_ns + rows * row_switch) / (1 - m.refresh_loss) if cmds else 0.0
    return PIMStream(float(code_bytes), float(meta_bytes), bits, code_cols, meta_cols, slots, reuse, rows, ns)


def _stream_ns(pim: PIMSpec, nbytes: float, reuse: int) -> float:
    """Time for the units to read `nbytes` of fp16 (balanced) and use each column `reuse` times."""
    return stream(pim, nbytes, reuse).ns


def _bus_ns(pim: PIMSpec, nbytes: float) -> float:
    return nbytes / pim.memory.peak_gbps if nbytes > 0 else 0.0


def _check(spec: OpSpec, pim: PIMSpec) -> None:
    reason = why_not(spec, pim)
    if reason is not None:
        raise CodesignError(reason)


def weight_stream(pim: PIMSpec, spec: Gemm) -> PIMStream:
    """The weight stream of a PIM GEMV: codes and scales (+ zeros) of `spec.weight`, reuse M."""
    _check(spec, pim)
    w = spec.weight
    n = spec.batch * spec.N * spec.K
    if not w.quantized:
        return stream(pim, n * 2, max(spec.M, 1))
    bits = 8 if w.dtype.startswith("fp8") else dtype_bits(w.dtype)
    return stream(pim, n * bits / 8, max(spec.M, 1), bits, spec.batch * w.metadata_bytes(spec.N, spec.K))


def gemv(pim: PIMSpec, spec: Gemm) -> PIMResult:
    """Y[M, N] = X[M, K] W[N, K]^T with W resident in the banks (small batch M).

    Inputs X are broadcast to every channel (M*K*2 B per channel, channels in parallel); when N is
    smaller than the unit count, K is split over split = ceil(units / N) units and the host adds the
    partial sums (split x M x N partials out, an Elementwise add of (split - 1) x M x N on the host).
    Quantized weights (with `pim.dequant`) stream codes + metadata (`weight_stream`).
    """
    ws = weight_stream(pim, spec)
    m_rows = max(spec.M, 1) * spec.batch
    split = max(1, -(-pim.units // (spec.N * spec.batch)))
    ch = pim.memory.total_channels
    x_bytes = m_rows * spec.K * 2 * ch  # one copy per channel, written in parallel
    out_bytes = split * m_rows * spec.N * 2
    io_ns = (m_rows * spec.K * 2) / (pim.memory.peak_gbps / ch) + _bus_ns(pim, out_bytes)
    host: tuple[OpSpec, ...] = ()
    if split > 1:
        host = (Elementwise("add", (split - 1) * m_rows * spec.N, "fp32"),)
    return PIMResult(
        ws.ns,
        io_ns,
        x_bytes + out_bytes,
        ws.code_bytes + ws.meta_bytes,
        float(spec.M * spec.N * spec.K * spec.batch),
        host,
        ws.dequant_elems,
    )


def kv_streams(pim: PIMSpec, spec: PagedDecodeAttention) -> tuple[PIMStream, PIMStream]:
    """(K stream, V stream) of decode attention: codes and metadata of each (module docstring), reuse G.

    Metadata bytes, T tokens, H kv heads, D head_dim (Dv v_dim for V), p = 2 x scale bytes (scale + zero):
        per_token: K and V each T x H x p;  kivi: K  T x H x D x p / G,  V  T x H x (Dv / min(G, Dv)) x p;
        fp8 per head, fp16/bf16: 0.
    A latent (MLA) cache streams its vectors twice, whole for QK^T and their first v_dim channels for P.V (the
    probabilities come back from the host in between), with G = every query head of the rank.
    """
    _check(spec, pim)
    fmt = spec.kv_format
    g = spec.q_heads // spec.kv_heads
    vectors = spec.kv_tokens() * spec.kv_heads
    ek, ev = vectors * spec.head_dim, vectors * spec.v_dim  # elements of K and of V
    if not fmt.quantized:
        return stream(pim, ek * 2, g), stream(pim, ev * 2, g)
    bits = _kv_bits(fmt)
    pair = 2 * dtype_bytes(fmt.scale_dtype)
    if fmt.scheme == "per_head":
        meta_k = meta_v = 0.0
    elif fmt.scheme == "per_token":
        meta_k = meta_v = vectors * pair
    else:  # kivi
        meta_k = ek * pair / fmt.group_size
        meta_v = ev * pair / min(fmt.group_size, spec.v_dim)
    return stream(pim, ek * bits / 8, g, bits, meta_k), stream(pim, ev * bits / 8, g, bits, meta_v)


def decode_attention(pim: PIMSpec, spec: PagedDecodeAttention) -> PIMResult:
    """Decode attention with K and V in the banks: QK^T on PIM, softmax on the host, P.V on PIM.

    Phases: q broadcast to every channel; QK^T streams K (reuse = GQA group G); scores out
    (batch x q_heads x L x 2 B); host softmax; probabilities in (same bytes); P.V streams V (reuse G);
    partial outputs out: each unit returns its `lanes`-wide accumulators for every head-slice it
    holds, max(units, batch x kv_heads) x head_dim x G x 2 B in all; the host sums them.
    A quantized cache (with `pim.dequant`) streams its codes and metadata (`kv_streams`).
    """
    sk, sv = kv_streams(pim, spec)
    g = spec.q_heads // spec.kv_heads
    tokens = spec.kv_tokens()
    ch = pim.memory.total_channels
    q_bytes = spec.batch * spec.q_heads * spec.head_dim * 2
    score_bytes = tokens * spec.q_heads * 2
    slices = max(pim.units, spec.batch * spec.kv_heads)
    partial_bytes = slices * spec.v_dim * g * 2
    io_ns = (
        q_bytes / (pim.memory.peak_gbps / ch) + _bus_ns(pim, 2 * score_bytes) + _bus_ns(pim, partial_bytes)
    )
    partial_elems = max(0, slices - spec.batch * spec.kv_heads) * spec.v_dim * g
    host: tuple[OpSpec, ...] = (Softmax(rows=1, cols=tokens * spec.q_heads),)
    if partial_elems:
        host = host + (Elementwise("add", partial_elems, "fp32"),)
    macs = 1.0 * tokens * spec.q_heads * (spec.head_dim + spec.v_dim)
    bank = sk.code_bytes + sk.meta_bytes + sv.code_bytes + sv.meta_bytes
    return PIMResult(
        sk.ns + sv.ns,
        io_ns,
        q_bytes * ch + 2 * score_bytes + partial_bytes,
        bank,
        macs,
        host,
        sk.dequant_elems + sv.dequant_elems,
    )
