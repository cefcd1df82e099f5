"""DRAM writes (`accel_model.dram`): write timings of the presets, WR in the event model, read/write
turnaround in the analytical stream, in the style of Ramulator 2's checks: a pure write stream still
reaches >= 90% of peak; reads and writes interleaved burst by burst lose bandwidth by the turnaround
formula (hand-computed cycles); a read after a write to the same bank waits for tWTR (row hit) or the
write recovery tWR before the precharge (row conflict). Reads-only results are unchanged."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from codesign.accel_model.dram import PRESETS, dram_preset, map_bursts, simulate_bursts, stream_access
from codesign.specs import CodesignError

NAMES = sorted(PRESETS)


def test_write_timings_in_cycles_match_their_sources():
    """LPDDR5: Ramulator 2's LPDDR5_6400 preset lists nCWL 11, nWR 28, nWTRS 5, nWTRL 10 at tCK 1.25 ns.
    DDR5-4800B: CWL = CL - 2 = 38, tWR 30 ns = 72 nCK, tWTR_S 2.5 ns = 6, tWTR_L 10 ns = 24 (tCK 0.4167 ns),
    RD->WR = nCL + nBL + 2 - nCWL + 2 = 40 + 8 + 4 - 38 = 14 (Ramulator 2's DDR5 constraint)."""
    lp = dram_preset("LPDDR5").cycles()
    assert (lp["nCWL"], lp["nWR"], lp["nWTR_S"], lp["nWTR_L"]) == (11, 28, 5, 10)
    d5 = dram_preset("DDR5").cycles()
    assert (d5["nCWL"], d5["nWR"], d5["nWTR_S"], d5["nWTR_L"], d5["nRTW"]) == (38, 72, 6, 24, 14)


@pytest.mark.parametrize("name", NAMES)
def test_pure_write_stream_reaches_90_percent_of_peak(name):
    spec = dram_preset(name, units=2)
    nbytes = 4 << 20
    idx = np.arange(nbytes // spec.burst_bytes)
    e = simulate_bursts(spec, idx, is_write=np.ones(idx.size, dtype=bool))
    a = stream_access(spec, nbytes, write_fraction=1.0)
    assert e.gbps >= 0.9 * spec.peak_gbps
    assert a.gbps >= 0.9 * spec.peak_gbps
    assert e.row_hits > 0.9 * e.bursts
    # Writes stream like reads: only the end differs, nCWL instead of nCL after the last command.
    c = spec.cycles()
    r = simulate_bursts(spec, idx)
    assert (r.cycles - e.cycles) * (1 - spec.refresh_loss) == pytest.approx(c["nCL"] - c["nCWL"])
    assert a.cycles == pytest.approx(e.cycles, rel=0.01)


@pytest.mark.parametrize("name", NAMES)
def test_reads_only_results_unchanged(name):
    spec = dram_preset(name)
    rng = np.random.default_rng(np.random.randint(2**31))  # seeded by the autouse fixture
    idx = rng.integers(0, 1 << 20, size=3000)
    assert simulate_bursts(spec, idx, is_write=np.zeros(idx.size, dtype=bool)) == simulate_bursts(spec, idx)
    assert stream_access(spec, 123_457, write_fraction=0.0) == stream_access(spec, 123_457)


# Hand-computed RD+WR pair of a burst-by-burst interleaving on other bank groups (cycle tables of the
# presets): RD->WR nRTW = nCL + nBL + gap - nCWL, WR->RD nCWL + nBL + nWTR_S.
#   HBM2e  (23 + 2 + 2 - 7 = 20) + (7 + 2 + 10 = 19) = 39
#   HBM3   (45 + 4 + 2 - 13 = 38) + (13 + 4 + 20 = 37) = 75
#   HBM2   (17 + 2 + 2 - 5 = 16) + (5 + 2 + 8 = 15) = 31
#   LPDDR5 (20 + 2 + 2 - 11 = 13) + (11 + 2 + 5 = 18) = 31
#   DDR5   (40 + 8 + 4 - 38 = 14) + (38 + 8 + 6 = 52) = 66
PAIR = {"HBM2e": 39, "HBM3": 75, "HBM2": 31, "LPDDR5": 31, "DDR5": 66}


@pytest.mark.parametrize("name", NAMES)
def test_fine_grain_interleave_pays_both_turnarounds(name):
    """One channel, bursts rotating over bank groups of open rows, RD WR RD WR ... in order: each more
    RD+WR pair costs exactly the hand-computed turnarounds (PAIR); the analytical stream with
    write_batch=1 agrees, and so does the lost bandwidth."""
    spec = dram_preset(name)
    m = 20
    idx = spec.total_channels * np.arange(2 * m + 2)  # channel 0, bank groups 0, 1, 2, ... in one row each
    assert (map_bursts(spec, idx)[0] == 0).all() and 2 * m + 2 <= spec.bank_groups * (
        spec.row_bytes // spec.burst_bytes
    )
    wr = np.arange(idx.size) % 2 == 1
    keep = 1 - spec.refresh_loss
    long = simulate_bursts(spec, idx, queue=1, is_write=wr).cycles * keep
    short = simulate_bursts(spec, idx[:-2], queue=1, is_write=wr[:-2]).cycles * keep
    assert long - short == pytest.approx(PAIR[name])
    # Whole-device stream, every channel alternating: analytical vs event model, and the bandwidth lost.
    n = 1000 * spec.total_channels
    idx = np.arange(n)
    wr = (idx // spec.total_channels) % 2 == 1
    e = simulate_bursts(spec, idx, queue=1, is_write=wr)
    a = stream_access(spec, n * spec.burst_bytes, write_fraction=0.5, write_batch=1)
    assert a.cycles == pytest.approx(e.cycles, rel=0.03)
    reads = stream_access(spec, n * spec.burst_bytes)
    c = spec.cycles()
    t_burst = max(c["nBL"], c["nCCD_S"])
    assert reads.gbps / a.gbps == pytest.approx(PAIR[name] / (2 * t_burst), rel=0.03)


@pytest.mark.parametrize("name", ["HBM3", "DDR5"])
def test_controller_batches_writes_to_save_turnarounds(name):
    """With a queue, FR-FCFS-like issue runs reads and writes in batches: fewer turnarounds than in order;
    the analytical model with larger write batches is faster too."""
    spec = dram_preset(name)
    rng = np.random.default_rng(np.random.randint(2**31))
    idx = np.arange(200 * spec.total_channels)
    wr = rng.random(idx.size) < 0.3
    assert (
        simulate_bursts(spec, idx, queue=32, is_write=wr).cycles
        < simulate_bursts(spec, idx, queue=1, is_write=wr).cycles
    )
    nbytes = idx.size * spec.burst_bytes
    assert (
        stream_access(spec, nbytes, 0.3, write_batch=16).cycles
        < stream_access(spec, nbytes, 0.3, write_batch=1).cycles
    )
    assert stream_access(spec, nbytes, 0.3).cycles > stream_access(spec, nbytes).cycles


@pytest.mark.parametrize("name", NAMES)
def test_read_after_write_to_same_bank(name):
    """Hand timelines (closed bank at 0, ACT at 0, the first column command at nRCD):
    row hit, WR then RD:       RD at nRCD + nCWL + nBL + nWTR_L (same bank group), done + nCL + nBL;
    row conflict, WR then RD:  PRE at max(nRAS, nRCD + nCWL + nBL + nWR), ACT + nRP, RD + nRCD, done + nCL + nBL;
    row hit, RD then WR:       WR at nRCD + nRTW, done + nCWL + nBL.
    HBM3 conflict: nRAS 106 < 45 + 13 + 4 + 52 = 114 (write recovery binds), ACT 159, RD 204, done 253."""
    spec = dram_preset(name)
    c = spec.cycles()
    keep = 1 - spec.refresh_loss
    col = spec.total_channels * spec.bank_groups  # next column of the same row
    other_row = col * (spec.row_bytes // spec.burst_bytes) * spec.banks_per_group
    ch, bg, bank, row, _ = map_bursts(spec, np.array([0, col, other_row]))
    assert len(set(ch)) == len(set(bg)) == len(set(bank)) == 1 and row[0] == row[1] != row[2]
    wr_rd = np.array([True, False])

    def run(i):
        return simulate_bursts(spec, np.array(i), queue=1, is_write=wr_rd).cycles * keep

    hit = c["nRCD"] + c["nCWL"] + c["nBL"] + c["nWTR_L"] + c["nCL"] + c["nBL"]
    assert run([0, col]) == pytest.approx(hit)
    pre = max(c["nRAS"], c["nRCD"] + c["nCWL"] + c["nBL"] + c["nWR"])
    conflict = pre + c["nRP"] + c["nRCD"] + c["nCL"] + c["nBL"]
    assert run([0, other_row]) == pytest.approx(conflict)
    if name == "HBM3":
        assert conflict == 253
    rd_wr = simulate_bursts(spec, np.array([0, col]), queue=1, is_write=np.array([False, True]))
    assert rd_wr.cycles * keep == pytest.approx(c["nRCD"] + c["nRTW"] + c["nCWL"] + c["nBL"])
    # Without the write the second read would be a plain row hit nCCD_L later: the write really costs.
    assert simulate_bursts(spec, np.array([0, col]), queue=1).cycles * keep < hit


def test_write_bad_input():
    spec = dram_preset("HBM3")
    with pytest.raises(CodesignError, match="is_write"):
        simulate_bursts(spec, np.arange(4), is_write=np.ones(4, dtype=np.int8))
    with pytest.raises(CodesignError, match="is_write"):
        simulate_bursts(spec, np.arange(4), is_write=np.ones(3, dtype=bool))
    for bad in (-0.1, 1.5, True, "half", float("nan")):
        with pytest.raises(CodesignError, match="write_fraction"):
            stream_access(spec, 1024, write_fraction=bad)
    with pytest.raises(CodesignError, match="write_batch"):
        stream_access(spec, 1024, 0.5, write_batch=0)
    with pytest.raises(CodesignError, match="rtw_gap"):
        replace(spec, rtw_gap=-1)
    with pytest.raises(CodesignError, match="tWR"):
        replace(spec, tWR=0.0)
