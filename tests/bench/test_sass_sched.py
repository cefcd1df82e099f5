"""bench/sass_sched.py: operands read from SASS text, and the warp-scheduler simulation on hand-written loops whose
cycles follow from the latencies and pipe rates (a dependent chain, independent work, a block-table load feeding the
codes' load, a conversion-heavy loop); bench/hindcast.py's rank statistics."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import load_script

BENCH = Path(__file__).resolve().parents[2] / "bench"


@pytest.fixture(scope="module")
def sched():
    import importlib
    import sys

    sys.path.insert(0, str(BENCH))  # sass_sched imports sass_model from its folder; its dataclasses need a module
    return importlib.import_module("sass_sched")


def test_operands_of_mma_carry_stores_and_guarded_loads(sched):
    mma = sched.decode("HMMA.16816.F32.BF16 R24, R88, R100, R24 ;")
    assert mma.dests == ["R24", "R25", "R26", "R27"] and mma.pipe == "tensor"
    assert mma.srcs == ["R88", "R89", "R90", "R91", "R100", "R101", "R24", "R25", "R26", "R27"]
    add = sched.decode("IADD3 R26, P4, P5, R26, UR39, R31 ;")  # carries out: P4, P5 written
    assert add.dests == ["R26", "P4", "P5"] and add.srcs == ["R26", "UR39", "R31"]
    x = sched.decode("IADD3.X R27, R30, UR29, R33, P4, P5 ;")  # carries in: read
    assert x.dests == ["R27"] and {"P4", "P5"} <= set(x.srcs)
    st = sched.decode("STS.128 [R3+0x100], R8 ;")
    assert st.dests == [] and st.srcs == ["R3", "R8", "R9", "R10", "R11"] and st.pipe_cycles == 512 // 32
    ld = sched.decode("@!P3 LDG.E.128 R12, desc[UR18][R24.64] ;")
    assert ld.dests == ["R12", "R13", "R14", "R15"] and ld.addr == ["UR18", "R24", "R25"] and "P3" in ld.srcs
    assert sched.decode("ISETP.GE.AND P3, PT, R37, R66, PT ;").dests == ["P3"]
    assert sched.decode("I2F.BF16.U32 R5, R6 ;").pipe_cycles == 8 and sched.decode("MUFU.EX2 R7, R7 ;").latency == 18


def _loop(body: list[str]) -> list[str]:
    return body + ["BRA LBB0;"]


def test_dependent_chain_is_latency_bound_until_warps_hide_it(sched):
    n = 40
    chain = _loop([f"FADD R{i + 1}, R{i}, R{i} ;" for i in range(n)] + ["FADD R0, R40, R40 ;"])
    one = sched.simulate(chain, 1)
    assert one["cycles"] == pytest.approx(4 * (n + 1) + 1, abs=2)  # 4 cycles each, the branch issued meanwhile
    assert one["nearest_bound"] == "latency"
    # four warps fill the chain's gaps: about one instruction a cycle, the same time for four times the work
    four = sched.simulate(chain, 4)
    assert four["cycles"] == pytest.approx(one["cycles"], rel=0.1)
    # eight: issue-bound, twice the single-warp time
    eight = sched.simulate(chain, 8)
    assert eight["cycles"] == pytest.approx(8 * (n + 2), rel=0.05) and eight["nearest_bound"] == "issue"


def test_independent_work_is_issue_bound_and_conversions_pipe_bound(sched):
    free = _loop([f"FADD R{i}, R100, R101 ;" for i in range(60)])
    assert sched.simulate(free, 2)["cycles"] == pytest.approx(2 * 61, abs=3)
    cvt = _loop([f"I2F.F32.S32 R{i}, R100 ;" for i in range(20)])
    r = sched.simulate(cvt, 2)
    assert r["cycles"] == pytest.approx(2 * 20 * 8, abs=4) and r["nearest_bound"] == "pipe:xu"


def test_shared_memory_traffic_is_counted_by_opcode_and_bounds_the_loop(sched):
    """A warp's MIO cycles an iteration, by opcode: 128 B a clock an SM, a quarter to a sub-partition, so a 16-byte
    store a thread (512 B) takes 16 and an ldmatrix x4 16, a shuffle 4; with 4 warps the pipe bounds the loop."""
    body = ["STS.128 [R2], R4 ;"] * 4 + ["LDSM.16.M88.4 R8, [R3] ;"] * 2 + ["SHFL.BFLY PT, R12, R13, 0x1, 0x1f ;"]
    r = sched.simulate(_loop(body), 4)
    assert r["mio_by_op"] == {"STS.128": 64, "LDSM.16.M88.4": 32, "SHFL.BFLY": 4}
    assert r["nearest_bound"] == "pipe:mio" and r["cycles"] == pytest.approx(4 * 100, abs=8)


def test_block_table_load_is_an_l2_hit_and_the_codes_a_dram_access(sched):
    body = _loop([
        "LDG.E R4, desc[UR4][R2.64] ;",           # the block-table entry
        "IMAD.WIDE R6, R4, 0x100, R8 ;",           # its block's address
        "LDG.E.128 R12, desc[UR4][R6.64] ;",       # the codes
        "FADD R20, R12, R13 ;",
        "IADD3 R2, R2, 0x4, RZ ;",
    ])  # fmt: skip
    r = sched.simulate(body, 1)
    assert r["index_loads"] == 1
    lat = sched.LATENCY
    assert r["cycles"] == pytest.approx(lat["l2"] + lat["alu"] + lat["dram"] + 4, abs=6)


def test_cp_async_wait_counts_outstanding_groups(sched):
    # two stages: the wait for all but the newest group lets one copy overlap an iteration of work
    work = [f"FADD R{i}, R100, R101 ;" for i in range(30)]
    keep1 = _loop(["LDGSTS.E.BYPASS.128 [R5+0x2000], desc[UR8][R10.64] ;", "LDGDEPBAR ;", "DEPBAR.LE SB0, 0x1 ;",
                   *work])  # fmt: skip
    keep0 = _loop(["LDGSTS.E.BYPASS.128 [R5+0x2000], desc[UR8][R10.64] ;", "LDGDEPBAR ;", "DEPBAR.LE SB0, 0x0 ;",
                   *work])  # fmt: skip
    dram = sched.LATENCY["dram"]
    assert sched.simulate(keep0, 1)["cycles"] == pytest.approx(dram + 34, abs=8)  # waits for this iteration's copy
    # two copies in flight: each has two iterations to land, so half the latency an iteration
    assert sched.simulate(keep1, 1)["cycles"] == pytest.approx((dram + 34) / 2, abs=8)
    many = _loop(["LDGSTS.E.BYPASS.128 [R5+0x2000], desc[UR8][R10.64] ;", "LDGDEPBAR ;", "DEPBAR.LE SB0, 0x1 ;",
                  *[f"FADD R{i % 90}, R100, R101 ;" for i in range(700)]])  # fmt: skip
    assert sched.simulate(many, 1)["cycles"] == pytest.approx(704, abs=8)  # the copy hidden behind 700 cycles


def test_iteration_repeats_inner_loops_by_their_trips(sched):
    import sys

    sys.path.insert(0, str(BENCH))
    from sass_model import parse_sass

    sass = "\n".join(["LBB0:", "04:-:-:-:1\tFADD R1, R2, R3;", "LBB1:", "04:-:-:-:1\tFADD R4, R5, R6;",
                      "04:-:-:-:1\t@P0 BRA LBB1;", "04:-:-:-:1\tBRA LBB0;"])  # fmt: skip
    ins, labels = parse_sass(sass)
    seq = sched.iteration(ins, labels, 0, len(ins), 3)
    assert seq == [ins[0]] + ins[1:3] * 3 + [ins[3]]


def test_shortest_path_skips_a_cold_branch():
    """sass_model.shortest_path: the instructions one iteration runs when a forward branch skips a block (a lazy
    rescale not taken), as many as loop_path's shorter count; the longer path runs them all."""
    import sys

    sys.path.insert(0, str(BENCH))
    from sass_model import loop_path, parse_sass, shortest_path

    sass = "\n".join(["LBB0:", "04:-:-:-:1\tFADD R1, R2, R3;", "04:-:-:-:1\t@P0 BRA LBB2;",
                      "04:-:-:-:1\tFMUL R4, R4, R5;", "04:-:-:-:1\tFMUL R6, R6, R5;", "LBB2:",
                      "04:-:-:-:1\tFADD R7, R1, R7;", "04:-:-:-:1\tBRA LBB0;"])  # fmt: skip
    ins, labels = parse_sass(sass)
    path = shortest_path(ins, labels, 0, len(ins))
    assert path == [0, 1, 4, 5] and loop_path(ins, labels, 0, len(ins)) == (4, 6)


def test_hindcast_rank_statistics():
    hc = load_script(BENCH / "hindcast.py", "hindcast")
    assert hc._spearman([(1, 10), (2, 20), (3, 30)]) == pytest.approx(1.0)
    assert hc._spearman([(1, 30), (2, 20), (3, 10)]) == pytest.approx(-1.0)
    assert hc._spearman([(1, 1), (2, 2)]) is None
    assert hc._rank_of_best([(3.0, 1.0), (1.0, 2.0), (2.0, 3.0)]) == 2  # the measured best is predicted last
