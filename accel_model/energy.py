"""Per-action energy and per-unit area, from cited public figures, scaled to a technology node.

Reference node 45 nm (0.9 V), from M. Horowitz, "Computing's energy problem (and what we can do about
it)", ISSCC 2014 (the 45 nm table every accelerator paper reuses):

    energy (pJ)   int8 add 0.03, int32 add 0.1, fp16 add 0.4, fp32 add 0.9,
                  int8 mult 0.2, int32 mult 3.1, fp16 mult 1.1, fp32 mult 3.7;
                  SRAM 64-bit read: 8 KB 10 pJ, 32 KB 20 pJ, 1 MB 100 pJ
    area (um^2)   int8 add 36, int32 add 137, fp16 add 1360, fp32 add 4184 (not used: below),
                  int8 mult 282, int32 mult 3495, fp16 mult 1640, fp32 mult 7700

Areas checked against the RTL twins (hdl_tests/synth_area.py, table hdl_tests/rtl_area.yaml: Yosys generic
cells, transistors relative to the int8 MAC lane): the PIM MAC lane (1.00x the model's ratio) and the
KV-quant lane (0.93x) agree; Horowitz's fp32 adder does not: 9.99 int8 MACs against the twin's 2.71 (an
IEEE round-to-nearest-even adder, the one the KV engine and the PIM front end are built from). The model
takes the twin's ratio, FP32_ADD_UM2 = 2.707 x 419 um^2 = 1134 um^2 (generic cells leave out the sizing a
fast adder needs, so this is the smaller figure of the two; the energy, 0.9 pJ, is Horowitz's).

A MAC is one multiply plus one add into the accumulator (int32 for int8, the same format for float
formats, fp32 for fp32). Formats the table does not list are *estimates*, each marked below: an
integer or float multiplier's energy and area scale with the square of the (mantissa) width, a
first-order array-multiplier rule.

SRAM energy per access follows CACTI-style scaling: energy of a 64-bit read interpolated log-log
between Horowitz's three sizes (slope ~0.5, i.e. ~sqrt(capacity): longer bit- and word-lines),
extrapolated with the end slopes, times word_bits / 64. Writes are taken equal to reads (CACTI gives
them within ~10% for small arrays). SRAM area: Intel 45 nm 6T bit cell 0.346 um^2 (Mistry et al.,
IEDM 2007) at 70% array efficiency (periphery, sense amps).

DRAM energy per bit is the memory preset's `pj_per_bit` (see `dram.py`): HBM2/2E 3.9 pJ/bit
(O'Connor et al., "Fine-Grained DRAM", MICRO 2017); HBM3 3.5, LPDDR5 4.0 and DDR5 12 pJ/bit are
estimates from vendor claims relative to HBM2 (HBM3 "~10% lower", LPDDR5 "similar to HBM", DDR5
DIMM I/O ~3x HBM).

PIM: an in-bank read does not cross the TSVs and the PHY; O'Connor et al. attribute about two thirds
of HBM2's 3.9 pJ/bit to data movement outside the bank, so an in-bank column read is estimated at
1.3 pJ/bit. A PIM FP16 MAC sits in DRAM-process logic, which is no denser or more efficient than
45 nm logic (HBM-PIM, Kwon et al. ISSCC 2021, built it in a 20 nm DRAM process at 300 MHz): the
45 nm fp16 MAC (1.5 pJ) is used unscaled.

PIM dequantizing front end (`pim.dequant`, estimates from Horowitz's 45 nm table, DRAM-process logic
used unscaled like the PIM MAC): per element, code x fp16 scale is an 8 x 11-bit multiply (int8 mult
0.2 pJ x 11/8 = 0.275 pJ, 388 um^2), the zero is added by an fp32 adder (0.9 pJ, FP32_ADD_UM2: the rule
is fp32 RNE, see pim_dequant.py) and the fp32 -> fp16 rounding is an int32-add-class incrementer
(0.1 pJ, 137 um^2): 1.275 pJ and 388 + FP32_ADD_UM2 + 137 = 1659 um^2 per element lane. Widening the
unit costs fp16 MACs (fp16 mult + add, 1640 + 1360 um^2 per lane); the scale/zero register file ~5 um^2 per
flip-flop (the Huffman lane's estimate).

Huffman (DF11) decode lane logic, per code (estimate): a 32-bit bit-pointer add (int32 add 0.1 pJ,
Horowitz) and a 32-bit, 5-stage window barrel shifter taken as two int32 adds' worth of switching
(0.2 pJ): 0.3 pJ at 45 nm; the bf16 merge is wiring. Lane area (estimate): int32 adder 137 um^2
(Horowitz) + 160 2:1 muxes of the shifter at ~4 um^2 + 64 flip-flops of window/pointer state at
~5 um^2 (45 nm standard cells): ~1100 um^2. The lane's LUTs are SRAM, costed with the SRAM rules.

NoC / on-chip wires: 0.2 pJ per bit per mm at 45 nm-class nodes (estimate from Dally et al., "GPUs
and the future of parallel computing", IEEE Micro 2011, ~25 pJ to move 64 bits 2 mm).

Scaling between nodes (documented rule, first order): dynamic energy ~ C V^2 with C ~ feature size,
so E(n) = E(45) * (n / 45) * (V(n) / V(45))^2; area ~ (n / 45)^2. Wire energy per mm scales with
V^2 only (wire capacitance per mm barely changes with the node). DRAM and PIM energies are not
scaled: they are properties of the memory preset, not of the logic node.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property, lru_cache

from codesign.specs import CodesignError, check_choice

REF_NODE_NM = 45
# Nominal supply voltage by node (45 nm from Horowitz's table; later nodes: typical foundry
# nominal voltages, 28 nm 0.9 V, 16/12 nm FinFET 0.8 V, 7 nm 0.75 V, 5 nm 0.7 V).
VDD: dict[int, float] = {45: 0.9, 28: 0.9, 16: 0.8, 12: 0.8, 7: 0.75, 5: 0.7}

# The fp32 adder's 45 nm area: the int8 MAC's 419 um^2 times its RTL twin's ratio to the int8 MAC lane (2.707,
# hdl_tests/rtl_area.yaml), not Horowitz's 4184 um^2 (module docstring).
FP32_ADD_UM2 = 1134.0
# (multiply pJ, add pJ, multiply um^2, add um^2) at 45 nm per MAC precision.
_MAC_45NM: dict[str, tuple[float, float, float, float]] = {
    "int8": (0.2, 0.1, 282.0, 137.0),  # int8 mult + int32 accumulate (Horowitz)
    "int4": (0.05, 0.1, 70.5, 137.0),  # estimate: int8 mult x (4/8)^2, int32 accumulate
    "int2": (0.0125, 0.1, 17.6, 137.0),  # estimate: int8 mult x (2/8)^2
    "fp16": (1.1, 0.4, 1640.0, 1360.0),  # Horowitz
    "bf16": (0.58, 0.4, 865.0, 1360.0),  # estimate: fp16 mult x (8/11)^2 mantissa, fp16-class add
    "fp8": (0.15, 0.4, 217.0, 1360.0),  # estimate: fp16 mult x (4/11)^2, fp16-class accumulate
    "fp32": (3.7, 0.9, 7700.0, FP32_ADD_UM2),  # Horowitz; the adder's area from its RTL twin (docstring)
}
# Which MAC row a dtype uses (fp8 variants share one row; tf32 runs on the fp32 datapath here).
_MAC_OF = {
    "int8": "int8",
    "int4": "int4",
    "int2": "int2",
    "fp16": "fp16",
    "bf16": "bf16",
    "fp32": "fp32",
    "tf32": "fp32",
    "fp8_e4m3": "fp8",
    "fp8_e5m2": "fp8",
    "fp8": "fp8",
}

_SRAM_POINTS = ((8 * 1024, 10.0), (32 * 1024, 20.0), (1024 * 1024, 100.0))  # bytes, pJ per 64-bit read
_SRAM_CELL_UM2 = 0.346 / 0.70  # per bit, including periphery

PIM_READ_PJ_PER_BIT = 1.3
PIM_MAC_FP16_PJ = 1.5
PIM_DEQUANT_ELEM_PJ = 0.2 * 11 / 8 + 0.9 + 0.1  # module docstring: multiply, fp32 add, round to fp16
PIM_DEQUANT_LANE_UM2 = 282.0 * 11 / 8 + FP32_ADD_UM2 + 137.0
PIM_MAC_FP16_UM2 = 1640.0 + 1360.0
PIM_REG_BIT_UM2 = 5.0
NOC_PJ_PER_BIT_MM_45 = 0.2
# Vector lane-op: one fp32 FMA-class operation (mult + add) on the lane's datapath.
VECTOR_OP_45 = 3.7 + 0.9
# KV quant engine, per element, fp16-class datapath: compare (0.4) + subtract (0.4) + multiply (1.1)
# + round and pack (~0.1, integer): 2.0 pJ at 45 nm.
KVQ_ELEM_45 = 2.0
# Huffman decode lane, per code and per read port (module docstring: estimates from Horowitz's int32 add).
HUFF_SYMBOL_45 = 0.3
HUFF_LANE_UM2_45 = 137.0 + 160 * 4.0 + 64 * 5.0


@lru_cache(maxsize=256)
def _sram_pj(size_bytes: int, word_bits: int, e_scale: float) -> float:
    return _log_interp(size_bytes) * word_bits / 64 * e_scale


def _log_interp(size: float) -> float:
    pts = _SRAM_POINTS
    if size <= pts[1][0]:
        (s0, e0), (s1, e1) = pts[0], pts[1]
    else:
        (s0, e0), (s1, e1) = pts[1], pts[2]
    slope = math.log(e1 / e0) / math.log(s1 / s0)
    return e0 * (size / s0) ** slope


@dataclass(frozen=True)
class EnergyModel:
    """Energies (pJ) and areas (um^2) of actions and units at one technology node."""

    node_nm: int = 45

    def __post_init__(self) -> None:
        check_choice("node_nm", self.node_nm, VDD)

    @cached_property
    def e_scale(self) -> float:
        """E(node) / E(45 nm) = (n / 45) * (V(n) / V(45))^2."""
        return (self.node_nm / REF_NODE_NM) * (VDD[self.node_nm] / VDD[REF_NODE_NM]) ** 2

    @cached_property
    def a_scale(self) -> float:
        """Area(node) / Area(45 nm) = (n / 45)^2."""
        return (self.node_nm / REF_NODE_NM) ** 2

    def mac_pj(self, dtype: str) -> float:
        """Energy of one multiply-accumulate in `dtype` (multiply + accumulator add)."""
        m, a, _, _ = _MAC_45NM[_mac_row(dtype)]
        return (m + a) * self.e_scale

    def mac_um2(self, dtype: str) -> float:
        """Area of one MAC unit in `dtype`."""
        _, _, m, a = _MAC_45NM[_mac_row(dtype)]
        return (m + a) * self.a_scale

    def sram_read_pj(self, size_bytes: int, word_bits: int) -> float:
        """Energy of one `word_bits` read from an SRAM (bank) of `size_bytes`: E64(size) * word_bits / 64."""
        if size_bytes <= 0 or word_bits <= 0:
            raise CodesignError(f"SRAM size and word width must be positive, got {size_bytes}, {word_bits}")
        return _sram_pj(size_bytes, word_bits, self.e_scale)

    def sram_write_pj(self, size_bytes: int, word_bits: int) -> float:
        """Energy of one write; taken equal to a read (see module docstring)."""
        return self.sram_read_pj(size_bytes, word_bits)

    def sram_um2(self, size_bytes: int) -> float:
        """Area of an SRAM of `size_bytes` (cells at 70% array efficiency)."""
        return size_bytes * 8 * _SRAM_CELL_UM2 * self.a_scale

    def noc_pj_per_bit_mm(self) -> float:
        """On-chip wire energy per bit per mm (scales with V^2 only)."""
        return NOC_PJ_PER_BIT_MM_45 * (VDD[self.node_nm] / VDD[REF_NODE_NM]) ** 2

    def vector_op_pj(self) -> float:
        """One lane-operation of the vector unit (fp32 FMA class)."""
        return VECTOR_OP_45 * self.e_scale

    def vector_lane_um2(self) -> float:
        """Area of one vector lane: an fp32 multiplier and adder."""
        return (7700.0 + FP32_ADD_UM2) * self.a_scale

    def kvq_elem_pj(self) -> float:
        """KV quant engine energy per element quantized (or dequantized)."""
        return KVQ_ELEM_45 * self.e_scale

    def kvq_lane_um2(self) -> float:
        """Area of one KV-quant lane (estimate: one fp16 multiplier and two fp16 adders)."""
        return (1640.0 + 2 * 1360.0) * self.a_scale

    def huffman_symbol_pj(self) -> float:
        """Huffman decode lane logic per code (bit-pointer add, window shift; estimate)."""
        return HUFF_SYMBOL_45 * self.e_scale

    def huffman_lane_um2(self) -> float:
        """Logic area of one Huffman decode read port (adder, barrel shifter, state; estimate)."""
        return HUFF_LANE_UM2_45 * self.a_scale

    @staticmethod
    def dram_pj_per_bit(pj_per_bit: float) -> float:
        """Off-chip DRAM energy per bit (a property of the preset, not scaled)."""
        return pj_per_bit

    @staticmethod
    def pim_read_pj_per_bit() -> float:
        """In-bank column read feeding a PIM unit (estimate, not scaled)."""
        return PIM_READ_PJ_PER_BIT

    @staticmethod
    def pim_mac_pj() -> float:
        """One FP16 MAC in a PIM unit (DRAM-process logic, not scaled)."""
        return PIM_MAC_FP16_PJ


def _mac_row(dtype: str) -> str:
    check_choice("MAC dtype", dtype, _MAC_OF)
    return _MAC_OF[dtype]
