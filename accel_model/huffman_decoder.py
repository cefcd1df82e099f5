"""Huffman / look-up-table decode unit for DFloat11-style weights (DF11): cycles, energy, area per tensor.

What it decodes is the container of `codesign.kernels.df11.codec`: per weight one Huffman-coded exponent
(canonical code, lengths capped at 16 bits) plus a raw sign+mantissa byte; the bitstream is cut into
fixed chunks whose first-code offsets are stored (`gaps`), so chunks decode independently. The unit has
`lanes` identical decoders, each owning one chunk at a time (the hardware image of the Triton kernel's
one-chunk-per-lane loop). Per code a lane:
  1. aligns a 32-bit window of the stream at its bit pointer (barrel shifter),
  2. reads its table-0 LUT at the window's top 8 bits: a leaf gives (length, exponent); a pointer
     (codes longer than 8 bits, fraction `second_level_fraction` of the codes) costs one more dependent
     read of a sub-table at the next 8 bits -- the two-level 8-bit LUTs of the codec (a 16-bit cap
     needs exactly 2 levels);
  3. advances the bit pointer by the length and merges sign | exponent | mantissa into a bf16 word.
A lane issues `symbols_per_cycle` LUT reads per cycle (its LUT SRAM has that many read ports, as
`symbols_per_cycle` replicas), so with the second-level reads taking issue slots as well:

    cycles(n codes) = ceil(n * (1 + f2) / (lanes * symbols_per_cycle)) + pipeline_depth,  f2 = second_level_fraction

(pipeline_depth: window align, LUT read, merge/write, counted once per tensor: the lanes stream chunk
after chunk). The unit sits between DRAM and the arrays' filter buffer: it reads the compressed stream
at the compressed bits per weight and writes dense bf16, so the arrays run a plain bf16 GEMM.

LUT SRAM per lane: symbols_per_cycle x lut_tables x 512 B (256 uint16 entries a table; a 16-bit cap
gives 1 + (distinct 8-bit prefixes of long codes) tables: 3 on all-MiniLM-L6-v2 and on N(0, 0.02)
weights, so 4 tables = 2 KiB covers them).

Energy: per code (1 + f2) LUT reads of a 16-bit entry from one lane's LUT (`EnergyModel.sram_read_pj` at
the lane's table bytes: Horowitz's SRAM points, CACTI-style scaling) plus the lane logic per code
(`EnergyModel.huffman_symbol_pj`: bit-pointer add and window shift, an estimate from Horowitz's int32
add; see energy.py). Area: the LUT SRAM (`sram_um2`) plus `huffman_lane_um2` of logic per read port.

second_level_fraction default 0.01: measured with the codec, 0.40% of the codes of all-MiniLM-L6-v2's
2-D weights (BF16) and 0.67% of N(0, 0.02) weights are longer than 8 bits (bench/bench_df11.py data;
rounded up).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from codesign.accel_model.energy import EnergyModel
from codesign.specs import CodesignError, check_nonneg_int, check_positive_int

LUT_TABLE_BYTES = 512  # 256 entries x uint16 (length << 8 | symbol, or 0x8000 | sub-table)
LUT_ENTRY_BITS = 16
SYMBOLS_PER_CYCLE = (1, 2, 4)
DEFAULT_SECOND_LEVEL_FRACTION = 0.01


@dataclass(frozen=True)
class HuffmanDecoderSpec:
    """A DF11 decode unit: `lanes` chunk decoders of `symbols_per_cycle` LUT reads per cycle each."""

    lanes: int
    symbols_per_cycle: int = 1
    pipeline_depth: int = 3
    lut_tables: int = 4
    second_level_fraction: float = DEFAULT_SECOND_LEVEL_FRACTION

    def __post_init__(self) -> None:
        check_positive_int("huffman_decoder.lanes", self.lanes)
        if self.symbols_per_cycle not in SYMBOLS_PER_CYCLE:
            raise CodesignError(
                f"huffman_decoder.symbols_per_cycle must be one of {SYMBOLS_PER_CYCLE}, "
                f"got {self.symbols_per_cycle!r}"
            )
        check_nonneg_int("huffman_decoder.pipeline_depth", self.pipeline_depth)
        check_positive_int("huffman_decoder.lut_tables", self.lut_tables)
        f = self.second_level_fraction
        if isinstance(f, bool) or not isinstance(f, int | float) or not 0.0 <= f <= 1.0:
            raise CodesignError(f"huffman_decoder.second_level_fraction must be in [0, 1], got {f!r}")

    @property
    def lane_lut_bytes(self) -> int:
        """LUT bytes of one read port (one replica): lut_tables x 512."""
        return self.lut_tables * LUT_TABLE_BYTES

    @property
    def lut_bytes(self) -> int:
        """All LUT SRAM: lanes x symbols_per_cycle x lut_tables x 512 B."""
        return self.lanes * self.symbols_per_cycle * self.lane_lut_bytes

    @property
    def symbols_per_clock(self) -> float:
        """Sustained codes per cycle of the unit: lanes x symbols_per_cycle / (1 + f2)."""
        return self.lanes * self.symbols_per_cycle / (1.0 + self.second_level_fraction)


@dataclass(frozen=True)
class HuffmanCost:
    """Decode cost of one tensor: cycles of the unit's clock, LUT reads, energies (pJ)."""

    cycles: int
    lut_reads: float
    lut_pj: float
    logic_pj: float

    @property
    def energy_pj(self) -> float:
        return self.lut_pj + self.logic_pj


def huffman_cycles(spec: HuffmanDecoderSpec, n: int) -> int:
    """ceil(n (1 + f2) / (lanes x symbols_per_cycle)) + pipeline_depth cycles for n codes (0 for n = 0)."""
    check_nonneg_int("n", n)
    if n == 0:
        return 0
    # round() before ceil: n * (1 + 0.01) must not land a hair above an integer through float error.
    slots = round(n * (1.0 + spec.second_level_fraction), 6)
    return math.ceil(slots / (spec.lanes * spec.symbols_per_cycle)) + spec.pipeline_depth


def huffman_cost(spec: HuffmanDecoderSpec, n: int, em: EnergyModel) -> HuffmanCost:
    """Cycles and energy to decode n DF11 weights (module docstring for the formulas)."""
    reads = n * (1.0 + spec.second_level_fraction)
    lut_pj = reads * em.sram_read_pj(spec.lane_lut_bytes, LUT_ENTRY_BITS)
    return HuffmanCost(huffman_cycles(spec, n), reads, lut_pj, n * em.huffman_symbol_pj())


def huffman_area_um2(spec: HuffmanDecoderSpec, em: EnergyModel) -> float:
    """LUT SRAM (all replicas) + logic per read port (lanes x symbols_per_cycle), um^2."""
    return em.sram_um2(spec.lut_bytes) + spec.lanes * spec.symbols_per_cycle * em.huffman_lane_um2()
