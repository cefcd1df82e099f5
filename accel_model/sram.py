"""On-chip SRAM buffer: size, banks, ports, word width; access cycles, energy, area, and fit checks.

Throughput: each of `banks` banks serves `ports` words per cycle (banks interleaved at word
granularity, so a sequential access of W words is conflict-free):
    cycles(W words) = ceil(W / (banks * ports)) + latency   (latency only for W > 0)
Energy per word comes from `energy.EnergyModel.sram_read_pj` for one bank's capacity
(size / banks): banking shortens the lines, which is why banking saves energy.
"""

from __future__ import annotations

from dataclasses import dataclass

from codesign.accel_model.energy import EnergyModel
from codesign.specs import CodesignError, check_nonneg_int, check_positive_int


@dataclass(frozen=True)
class SRAMSpec:
    """One SRAM buffer. size_bytes must divide into banks of whole words."""

    name: str
    size_bytes: int
    banks: int = 1
    ports: int = 1
    word_bits: int = 64
    latency: int = 1
    double_buffered: bool = False

    def __post_init__(self) -> None:
        check_positive_int(f"{self.name}.size_bytes", self.size_bytes)
        check_positive_int(f"{self.name}.banks", self.banks)
        check_positive_int(f"{self.name}.ports", self.ports)
        check_positive_int(f"{self.name}.word_bits", self.word_bits)
        check_nonneg_int(f"{self.name}.latency", self.latency)
        if self.word_bits % 8:
            raise CodesignError(f"{self.name}.word_bits must be a multiple of 8, got {self.word_bits}")
        if self.size_bytes % (self.banks * self.word_bytes):
            raise CodesignError(
                f"{self.name}.size_bytes={self.size_bytes} must be a multiple of banks x word "
                f"({self.banks} x {self.word_bytes} B)"
            )

    @property
    def word_bytes(self) -> int:
        return self.word_bits // 8

    @property
    def bank_bytes(self) -> int:
        return self.size_bytes // self.banks

    @property
    def bytes_per_cycle(self) -> int:
        """Peak bandwidth: banks * ports * word bytes per cycle."""
        return self.banks * self.ports * self.word_bytes

    @property
    def usable_bytes(self) -> int:
        """Capacity one tile may use: half when double-buffered."""
        return self.size_bytes // 2 if self.double_buffered else self.size_bytes

    def words(self, nbytes: int) -> int:
        return -(-nbytes // self.word_bytes)

    def access_cycles(self, nbytes: int) -> int:
        """Cycles to read (or write) `nbytes` sequentially: ceil(words / (banks * ports)) + latency."""
        check_nonneg_int("nbytes", nbytes)
        if nbytes == 0:
            return 0
        return -(-self.words(nbytes) // (self.banks * self.ports)) + self.latency

    def read_pj(self, nbytes: int, em: EnergyModel) -> float:
        """Energy of reading `nbytes` (whole words)."""
        return self.words(nbytes) * em.sram_read_pj(self.bank_bytes, self.word_bits)

    def write_pj(self, nbytes: int, em: EnergyModel) -> float:
        """Energy of writing `nbytes` (whole words)."""
        return self.words(nbytes) * em.sram_write_pj(self.bank_bytes, self.word_bits)

    def area_um2(self, em: EnergyModel) -> float:
        return em.sram_um2(self.size_bytes)

    def check_fits(self, tile_bytes: int, what: str = "tile") -> None:
        """Raise CodesignError if a `tile_bytes` tile does not fit (half the buffer if double-buffered)."""
        check_nonneg_int(f"{what} bytes", tile_bytes)
        if tile_bytes > self.usable_bytes:
            db = " (double-buffered: half of it)" if self.double_buffered else ""
            raise CodesignError(
                f"SRAM {self.name!r} of {self.size_bytes} B{db} is too small for the smallest {what} "
                f"of {tile_bytes} B"
            )
