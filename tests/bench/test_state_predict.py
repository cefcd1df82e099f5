"""bench/state_predict.py: the model's arithmetic on a hand-written loop (trips, the MUFU pipe, bytes), the trip
rules, the chunked Gated DeltaNet's bytes, and every recurrent-state case compiled for sm_90 and predicted
(compile-only, no GPU): structural facts, and a prompt twice as long predicted about twice as slow."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import load_script

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "state_predict.py"
CLOCK = 1.98e9


@pytest.fixture(scope="module")
def sp():
    return load_script(SCRIPT, "state_predict")


def _listing(n: int) -> str:
    """A program: one instruction, a loop of `n` dependent MUFU.EX2 (each reads the one before; the last feeds the
    next trip's first), EXIT and the branch to itself after it."""
    chain = [f"MUFU.EX2 R{i + 2}, R{i + 1} ;" for i in range(n - 1)] + [f"MUFU.EX2 R1, R{n} ;"]
    lines = ["\tS2R R0, SR_TID.X ;", "LBB0:", *(f"\t{t}" for t in chain), "\t@P0 BRA LBB0;", "\tEXIT ;", "LBB1:",
             "\tBRA LBB1;"]  # fmt: skip
    return "\n".join(lines)


# one program of 4 warps an SM (132 programs): one warp a scheduler
ONE_WAVE = {"kernel": "_toy", "grid": [132], "num_warps": 4, "registers": 32, "shared_bytes": 0}


def test_a_chain_of_exp2_is_latency_bound_and_trips_scale_it(sp):
    n, trips = 16, 10
    r = sp.launch_prediction(ONE_WAVE, _listing(n), [trips], nbytes=1.0, walk=True)
    assert r["warps_per_scheduler"] == 1 and r["waves"] == 1 and r["sass_per_iter"] == n + 1
    assert r["per_iter"]["mufu_ex2"] == n and r["per_iter"]["xu"] == n
    # issue: one warp, the loop's n + 1 instructions a trip and the two outside it (S2R, EXIT) once
    assert r["times_ms"]["issue"] == pytest.approx((trips * (n + 1) + 2) / CLOCK * 1e3)
    # the MUFU pipe: 16 an SM a clock, 8 cycles a warp instruction on a scheduler
    assert r["times_ms"]["pipe:xu"] == pytest.approx(trips * n * 8 / CLOCK * 1e3)
    # a dependent chain with one warp waits each MUFU's latency (18 cycles): latency-bound, above the pipe
    assert r["bound"] == "latency" and r["predicted_ms"] == r["times_ms"]["latency"]
    assert r["times_ms"]["latency"] == pytest.approx(trips * n * 18 / CLOCK * 1e3, rel=0.1)
    # teeth: twice the trips, twice the issue and about twice the time
    r2 = sp.launch_prediction(ONE_WAVE, _listing(n), [2 * trips], nbytes=1.0, walk=True)
    assert r2["times_ms"]["issue"] == pytest.approx((2 * trips * (n + 1) + 2) / CLOCK * 1e3)
    assert r2["predicted_ms"] == pytest.approx(2 * r["predicted_ms"], rel=0.05)
    # the program simulated whole (its loop unrolled by its trips) gives the same chain
    whole = sp.launch_prediction(ONE_WAVE, _listing(n), [trips], nbytes=1.0, walk=False)
    assert whole["walk"] is False and whole["predicted_ms"] == pytest.approx(r["predicted_ms"], rel=0.1)
    # bytes past the chain's time: memory-bound at the copy rate
    big = sp.launch_prediction(ONE_WAVE, _listing(n), [trips], nbytes=1e9, walk=True)
    assert big["bound"] == "memory" and big["predicted_ms"] == pytest.approx(1e9 / sp.COPY_BPS * 1e3)
    with pytest.raises(ValueError, match="trips"):
        sp.launch_prediction(ONE_WAVE, _listing(n), [trips, 1], nbytes=1.0, walk=True)


def test_more_programs_than_an_sm_holds_run_in_waves(sp):
    """Programs of 4 warps at 128 registers: 4 an SM at once; 32 an SM run in 8 waves of the resident 4 warps a
    scheduler, whose MUFU pipe the chain then fills (the pipe and the simulated time agree)."""
    launch = {**ONE_WAVE, "grid": [132 * 32], "registers": 128}
    r = sp.launch_prediction(launch, _listing(16), [10], nbytes=1.0, walk=True)
    assert (r["resident"], r["waves"], r["warps_per_scheduler"], r["resident_warps_per_scheduler"]) == (4, 8, 32, 4)
    assert r["times_ms"]["pipe:xu"] == pytest.approx(32 * 10 * 16 * 8 / CLOCK * 1e3)
    assert r["times_ms"]["latency"] == pytest.approx(r["times_ms"]["pipe:xu"], rel=0.1)


def test_trip_rules(sp):
    assert sp.loop_trips("_ssd_scan_kernel", {"C": 32}, 2048, [{}]) == [64]
    assert sp.loop_trips("_state_kernel", {"C": 32}, 2049, [{}]) == [65]
    assert sp.loop_trips("_output_kernel", {"C": 32}, 2049, []) == []
    assert sp.loop_trips("_selective_scan_kernel", {"BT": 32}, 1000, [{}]) == [32]
    assert sp.loop_trips("_gated_delta_kernel", {}, 4, [{}]) == [4] and sp.loop_trips("_gated_delta_kernel", {}, 1,
                                                                                         []) == []  # fmt: skip
    assert sp.loop_trips("_ssd_update_kernel", {}, 1, []) == []
    with pytest.raises(ValueError, match="outermost SASS loops"):
        sp.loop_trips("_ssd_scan_kernel", {"C": 32}, 2048, [{}, {}])
    with pytest.raises(ValueError, match="no loop model"):
        sp.loop_trips("_other_kernel", {}, 1, [])
    # the forward substitution's 15 steps: one loop; or unrolled 4x (16 MMA to the remainder loop's 4) with 3
    # steps in straight-line code: 3 trips of 4, none left for the remainder loop; unrolled 2x: 7 trips of 2
    assert sp.prep_trips([{"hmma": 4}], 16, 32) == [15]
    assert sp.prep_trips([{"hmma": 16}, {"hmma": 4}], 16, 32) == [3, 0]
    assert sp.prep_trips([{"hmma": 8}, {"hmma": 4}], 16, 32) == [7, 0]
    with pytest.raises(ValueError):
        sp.prep_trips([{"hmma": 4}], 16, 64)  # three block rows: a loop the model does not have


def test_the_chunked_gated_delta_launches_move_their_scratch(sp):
    """Each launch's bytes (the spec's plus its extra): the prep reads k, v, g and beta and writes w and u; the state
    walk reads k, g, w and u, rewrites u (v'), writes the states entering the chunks and the final state; the output
    launch reads q, k, g, v' and those states and writes o (o's bytes as v's)."""
    from codesign.specs import GatedDeltaRule

    spec = GatedDeltaRule(key_heads=16, value_heads=32, key_dim=128, value_dim=128, new_tokens=(2048,),
                          initial_state=False, dtype="bf16", state_dtype="fp32")  # fmt: skip
    w = u = 2048 * 32 * 128 * 4
    chunk_states = 64 * 32 * 128 * 128 * 2  # (bf16, as the inputs)
    qk, v, gate, state = 2048 * 16 * 128 * 2, 2048 * 32 * 128 * 2, 2048 * 32 * 2, 32 * 128 * 128 * 4
    want = {"_prep_kernel": qk + v + 2 * gate + w + u, "_state_kernel": qk + gate + w + 2 * u + chunk_states + state,
            "_output_kernel": 2 * qk + gate + u + chunk_states + v}  # fmt: skip
    for kernel, nbytes in want.items():
        assert spec.min_bytes() + sp.gdn_chunk_extra(spec, kernel) == nbytes, kernel


@pytest.mark.lowering
def test_every_case_compiles_without_spills_and_prompts_scale(tmp_path):
    out = tmp_path / "s.json"
    env = dict(os.environ, TRITON_INTERPRET="0")
    res = subprocess.run([sys.executable, str(SCRIPT), "--tokens", "1024", "2048", "--out", str(out)], env=env,
                         capture_output=True, text=True, timeout=300)  # fmt: skip
    assert res.returncode == 0, res.stderr[-3000:]
    assert "nothing timed" in res.stdout and "predicted us" in res.stdout
    report = json.loads(out.read_text())
    rows = {(c["family"], c["tokens"]): c for c in report["cases"]}
    prompts = ("Gated DeltaNet prompt", "Mamba-2 prompt", "Mamba-1 prompt")
    decode = {("Gated DeltaNet decode", 1), ("Gated DeltaNet decode", 4), ("Mamba-2 decode", 1), ("Mamba-1 decode", 1),
              ("Gated DeltaNet tree", 15), ("Gated DeltaNet tree", 31), ("Mamba-2 tree", 15), ("Mamba-2 tree", 31),
              ("Mamba-2 decode", 4)}
    assert set(rows) == decode | {(f, t) for f in prompts for t in (1024, 2048)}
    for c in report["cases"]:
        for r in c["launches"]:
            assert r["spill_stores"] == 0 and r["spill_loads"] == 0 and r["registers"] > 0, (c["case"], r["kernel"])
            assert r["predicted_ms"] > 0 and r["predicted_ms"] == max(r["times_ms"].values())
            assert r["times_ms"][r["bound"]] == r["predicted_ms"]
            assert r["bound"] in ("issue", "latency", "memory") or r["bound"].startswith("pipe:")
            assert r["floor_ms"] == pytest.approx(r["bytes"] / report["copy_Bps"] * 1e3)
        gaps = report["launch_gap_ms"] * (len(c["launches"]) - 1)
        assert c["predicted_ms"] == pytest.approx(sum(r["predicted_ms"] for r in c["launches"]) + gaps)
        assert c["floor_ms"] == pytest.approx(c["bytes"] / report["copy_Bps"] * 1e3) and c["floor_pct"] <= 100
        (walk,) = [r for r in c["launches"] if r["walk"]] or [None]
        # the state carried token to token or chunk to chunk: the walk's trips are the tokens or the chunks
        if c["family"] in ("Gated DeltaNet tree", "Mamba-2 tree"):  # one launch, no walk, the state read once
            (tree,) = c["launches"]
            assert walk is None and tree["kernel"] in ("_tree_kernel", "_ssd_tree_kernel")
            assert tree["grid"] == ([16 * 32, 2] if tree["kernel"] == "_tree_kernel" else [16 * 128, 1])
            # the floor the kernel's bytes: the state read, none written (the spec counts a write)
            assert tree["floor_ms"] == pytest.approx(c["floor_ms"]) and c["bytes"] < c["spec_bytes"]
        elif c["tokens"] > 1:
            chunk = walk["constexprs"].get("C", walk["constexprs"].get("BT", 1))
            assert walk["trips"][walk["main_loop"]] == walk["iter_trips"] == math.ceil(c["tokens"] / chunk)
        else:  # one token: no loop
            assert walk is None and all(r["trips"] == [] for r in c["launches"])
    gdn = rows["Gated DeltaNet prompt", 2048]["launches"]
    assert [r["kernel"] for r in gdn] == ["_prep_kernel", "_state_kernel", "_output_kernel"]
    assert gdn[0]["grid"] == [2048 // 32 * 32] and gdn[0]["walk"] is False  # (chunk, head) programs, all at once
    assert rows["Gated DeltaNet decode", 4]["launches"][0]["iter_trips"] == 4
    for f in prompts:
        ratio = rows[f, 2048]["predicted_ms"] / rows[f, 1024]["predicted_ms"]
        assert 1.8 <= ratio <= 2.1, (f, ratio)
