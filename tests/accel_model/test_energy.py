"""Energy/area tables: the cited 45 nm figures reproduce, the scaling rule holds; SRAM buffer model."""

from __future__ import annotations

import pytest

from codesign.accel_model.energy import EnergyModel
from codesign.accel_model.sram import SRAMSpec
from codesign.specs import CodesignError


def test_horowitz_45nm_figures_reproduce():
    em = EnergyModel(45)
    # Horowitz ISSCC 2014: int8 mult 0.2 + int32 add 0.1; fp16 1.1 + 0.4; fp32 3.7 + 0.9 (pJ).
    assert em.mac_pj("int8") == pytest.approx(0.3)
    assert em.mac_pj("fp16") == pytest.approx(1.5)
    assert em.mac_pj("fp32") == pytest.approx(4.6)
    # SRAM 64-bit reads: 8 KB 10 pJ, 32 KB 20 pJ, 1 MB 100 pJ.
    assert em.sram_read_pj(8 * 1024, 64) == pytest.approx(10.0)
    assert em.sram_read_pj(32 * 1024, 64) == pytest.approx(20.0)
    assert em.sram_read_pj(1 << 20, 64) == pytest.approx(100.0)
    assert em.sram_read_pj(32 * 1024, 256) == pytest.approx(80.0)  # x word_bits / 64
    # Areas (um^2): int8 mult 282 + int32 add 137; fp16 1640 + 1360.
    assert em.mac_um2("int8") == pytest.approx(419.0)
    assert em.mac_um2("fp16") == pytest.approx(3000.0)


def test_ordering_and_interpolation():
    em = EnergyModel(45)
    assert (
        em.mac_pj("int4") < em.mac_pj("int8") < em.mac_pj("fp8_e4m3") < em.mac_pj("fp16") < em.mac_pj("fp32")
    )
    sizes = [4096, 8192, 20000, 32768, 300_000, 1 << 20, 8 << 20]
    e = [em.sram_read_pj(s, 64) for s in sizes]
    assert all(a < b for a, b in zip(e, e[1:]))
    # Between the published points the curve is log-log linear: 16 KB sits at sqrt(10 * 20).
    assert em.sram_read_pj(16 * 1024, 64) == pytest.approx((10 * 20) ** 0.5)


def test_node_scaling_rule():
    e45, e7 = EnergyModel(45), EnergyModel(7)
    factor = (7 / 45) * (0.75 / 0.9) ** 2
    assert e7.mac_pj("bf16") == pytest.approx(e45.mac_pj("bf16") * factor)
    assert e7.sram_read_pj(65536, 128) == pytest.approx(e45.sram_read_pj(65536, 128) * factor)
    assert e7.mac_um2("int8") == pytest.approx(e45.mac_um2("int8") * (7 / 45) ** 2)
    assert e7.noc_pj_per_bit_mm() == pytest.approx(0.2 * (0.75 / 0.9) ** 2)
    assert e7.pim_mac_pj() == e45.pim_mac_pj()  # DRAM-process figures are not node-scaled


def test_energy_bad_input():
    with pytest.raises(CodesignError, match="node_nm"):
        EnergyModel(10)
    with pytest.raises(CodesignError, match="MAC dtype"):
        EnergyModel().mac_pj("int3")
    with pytest.raises(CodesignError, match="positive"):
        EnergyModel().sram_read_pj(0, 64)


def test_sram_cycles_energy_and_fit():
    s = SRAMSpec("buf", size_bytes=64 * 1024, banks=4, ports=2, word_bits=128, latency=2)
    assert s.bytes_per_cycle == 4 * 2 * 16
    # 1000 B = 63 words of 16 B; 8 words a cycle -> 8 cycles + latency 2.
    assert s.access_cycles(1000) == 10
    assert s.access_cycles(0) == 0
    em = EnergyModel(45)
    assert s.read_pj(1000, em) == pytest.approx(63 * em.sram_read_pj(16 * 1024, 128))
    # Banking: a 4-bank buffer spends less per word than one 64 KB bank.
    one = SRAMSpec("one", size_bytes=64 * 1024, banks=1, word_bits=128)
    assert s.read_pj(4096, em) < one.read_pj(4096, em)
    s.check_fits(64 * 1024)
    db = SRAMSpec("db", size_bytes=64 * 1024, banks=4, word_bits=128, double_buffered=True)
    with pytest.raises(CodesignError, match="too small"):
        db.check_fits(40 * 1024, "weight tile")


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"size_bytes": 0}, "size_bytes"),
        ({"banks": 0}, "banks"),
        ({"word_bits": 12}, "word_bits"),
        ({"size_bytes": 1000, "banks": 3}, "size_bytes"),
        ({"latency": -1}, "latency"),
        ({"ports": 1.5}, "ports"),
    ],
)
def test_sram_validation(kwargs, field):
    args = {"name": "b", "size_bytes": 4096, "banks": 2, "ports": 1, "word_bits": 64} | kwargs
    with pytest.raises(CodesignError, match=field):
        SRAMSpec(**args)
