"""bench/attention_predict.py: the SASS loop counter on a hand-written listing, and one format predicted from its
sm_90 lowering (compile-only, no GPU)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import load_script

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "attention_predict.py"

# A loop with an if/else (3 or 1 instructions) and an inner loop of 2 instructions, the shape of the SASS listing
# Triton gives (control codes, a tab, the instruction).
SASS = """Function:k
04:-:-:-:1\tMOV R1, R2;
LBB0:
04:-:-:-:1\tHMMA.16816.F32 R4, R8, R10, R4;
04:-:-:-:1\t@P0 BRA LBB1;
04:-:-:-:1\tIADD3 R1, R1, 1, RZ;
04:-:-:-:1\tIADD3 R1, R1, 1, RZ;
04:-:-:-:1\tBRA LBB2;
LBB1:
04:-:-:-:1\tIADD3 R1, R1, 2, RZ;
LBB2:
LBB3:
04:-:-:-:1\tLDG.E.128 R12, desc[UR4][R2.64];
04:-:-:-:1\t@P1 BRA LBB3;
04:-:-:-:1\tI2F.U16 R5, R6;
04:-:-:-:1\t@P2 BRA LBB0;
04:-:-:-:1\tEXIT;
LBB4:
04:-:-:-:1\tBRA LBB4;
"""


@pytest.fixture(scope="module")
def ap():
    return load_script(SCRIPT, "attention_predict")


def test_loop_counter_takes_both_branches_and_inner_trips(ap):
    r = ap.loop_report(SASS, inner_trips=5)
    # body: HMMA, BRA, then 3 (IADD3 x2, BRA) or 1 (IADD3), the inner loop (2) 5 times, I2F, BRA
    assert (r["static"], r["path_min"], r["path_max"]) == (10, 2 + 1 + 10 + 2, 2 + 3 + 10 + 2)
    assert r["inner_loops"] == 1 and r["outside_loops"] == 3  # MOV, EXIT, the branch to itself
    assert r["ldg"] == {"LDG.E.128": 1} and r["cvt"] == {"I2F.U16": 1} and r["hmma"] == 1


# Oaken's tile loop: a key loop unrolled 4 times (4 loads) and its remainder (1 load), then two value loops.
OAKEN_SASS = """Function:k
LBB0:
04:-:-:-:1\tHMMA.16816.F32 R4, R8, R10, R4;
LBB1:
04:-:-:-:1\tLDG.E R12, desc[UR4][R2.64];
04:-:-:-:1\tLDG.E R13, desc[UR4][R2.64+0x4];
04:-:-:-:1\tLDG.E R14, desc[UR4][R2.64+0x8];
04:-:-:-:1\tLDG.E R15, desc[UR4][R2.64+0xc];
04:-:-:-:1\t@P1 BRA LBB1;
LBB2:
04:-:-:-:1\tLDG.E R12, desc[UR4][R2.64];
04:-:-:-:1\t@P1 BRA LBB2;
LBB3:
04:-:-:-:1\tLDG.E R12, desc[UR4][R2.64];
04:-:-:-:1\tFFMA R1, R1, R2, R3;
04:-:-:-:1\t@P1 BRA LBB3;
LBB4:
04:-:-:-:1\tLDG.E R12, desc[UR4][R2.64];
04:-:-:-:1\tFFMA R1, R1, R2, R3;
04:-:-:-:1\t@P1 BRA LBB4;
04:-:-:-:1\t@P2 BRA LBB0;
04:-:-:-:1\tEXIT;
"""


def test_per_loop_trips_and_oaken_unrolled_key_loop(ap):
    """Inner loops take their own trip counts (address order); Oaken's 6 key ranks run the 4-times unrolled key
    loop once and its remainder twice, 5 value ranks each value loop 5 times."""
    t = ap.oaken_loop_trips(OAKEN_SASS, 2, 6, 5)
    assert t == {"trips": [1, 2, 5, 5], "key_unroll": 4, "value_unroll": 1, "inner_loops": 4}
    # HMMA, the key loops (5 x 1 + 2 x 2), the value loops (3 x 5 each), the back edge
    assert ap.loop_report(OAKEN_SASS, t["trips"])["path_max"] == 1 + 5 + 4 + 15 + 15 + 1
    assert ap.loop_report(OAKEN_SASS, [1, 2, 5])["path_max"] == 1 + 5 + 4 + 15 + 15 + 1  # the last entry repeats
    # ranks per trip: the value loops' 2 (5 ranks: 3 trips), the key loop's own 3 (6 ranks: 2 = 4 x 0 + 2)
    t = ap.oaken_loop_trips(OAKEN_SASS, 2, 6, 5, per_trip=2, key_per_trip=3)
    assert t["trips"] == [0, 2, 3, 3]
    assert ap.oaken_loop_trips(OAKEN_SASS, 2, 6, 5, per_trip=2)["trips"] == [0, 3, 3, 3]
    # the first trip's ranks taken ahead of the loops (the kernel now): 6 - 3 key ranks a trip of 3, 5 - 2 value
    # ranks 2 a trip
    assert ap.oaken_loop_trips(OAKEN_SASS, 2, 6, 5, per_trip=2, key_per_trip=3, ahead=True)["trips"] == [0, 1, 2, 2]
    assert ap.oaken_loop_trips(OAKEN_SASS, 2, 3, 2, per_trip=2, key_per_trip=3, ahead=True)["trips"] == [0, 0, 0, 0]
    with pytest.raises(ValueError, match="value loops"):
        ap.oaken_loop_trips(OAKEN_SASS, 4, 6, 5)


def test_occupancy_and_issue_model(ap):
    assert ap.resident_programs(4, 96, 40000) == 5  # registers: 96 x 128 threads -> 5 of 65536
    assert ap.resident_programs(8, 243, 98304) == 1
    occ = ap.issue_cycles(384, 4, 96, 40000, 1000)  # 3 programs on the busiest SM, 12 warps on 4 schedulers
    assert (occ["programs_per_sm"], occ["warps_per_scheduler"], occ["cycles"]) == (3, 3, 3000)


def test_sweep_shape_is_set_and_restored(ap):
    class Bench:
        BATCH, CONTEXT = 16, 32768

    with ap._at_shape(Bench, 64, 1024):
        assert (Bench.BATCH, Bench.CONTEXT) == (64, 1024)
    assert (Bench.BATCH, Bench.CONTEXT) == (16, 32768)
    keys = ("BLOCK_N", "num_warps", "NUM_SPLITS", "registers", "spill_stores", "sass_per_tile", "tiles_per_program",
            "programs_per_sm", "warps_per_scheduler", "issue_ms", "bound")  # fmt: skip
    row = dict.fromkeys(keys, 1)
    assert ap._sweep_row({**row, "floor_ms": 0.05, "predicted_ms": 0.1})["floor_pct"] == pytest.approx(50)


@pytest.mark.lowering
def test_int8_prediction_from_sm90_lowering(tmp_path):
    """The INT8 per-token decode compiles for sm_90 at its default config without spills or conversion
    instructions, and its predicted time is positive and not below its byte floor; INT4 runs one warp, without
    spills; both dot code planes, so no thread stores a code tile to shared memory in the loop; each fills one wave: the
    programs an SM holds (its registers and shared memory) are at least its config's PROGRAMS_PER_SM, which sets the
    splits (batch 16 x 8 kv heads: INT8 4 a SM, 4 splits; INT4 12, 12, its registers within its cap)."""
    out = tmp_path / "p.json"
    env = dict(os.environ, TRITON_INTERPRET="0")
    res = subprocess.run([sys.executable, str(SCRIPT), "--formats", "int8", "int4", "--no-tree", "--out", str(out)],
                         env=env, capture_output=True, text=True, timeout=300)  # fmt: skip
    assert res.returncode == 0, res.stderr[-3000:]
    rows = json.loads(out.read_text())["decode"]
    row = rows["int8"]
    assert row["spill_stores"] == 0 and row["loop"]["cvt"] == {} and row["loop"]["spill_ldl_stl"] == 0
    assert row["loop"]["ldgsts"].get("LDGSTS.E.BYPASS.128", 0) > 0  # the codes arrive in 16-byte copies
    assert 0 < row["floor_ms"] <= row["predicted_ms"] < 5 and row["sass_per_tile"] > 100
    assert "int8" in res.stdout
    i4 = rows["int4"]
    assert (i4["num_warps"], row["num_warps"], i4["NUM_SPLITS"], row["NUM_SPLITS"]) == (1, 4, 12, 4), i4
    assert i4["spill_stores"] == 0 and i4["registers"] <= 168
    for r, per in ((row, 4), (i4, 12)):
        assert r["waves"] == 1 and r["resident"] >= r["programs_per_sm"] == per, r
        assert "STS.128" not in r["sched"]["mio_by_op"] and r["loop"]["hmma"] > 0, r["sched"]  # no code tile stored
    assert i4["loop"]["sts"] == 0, i4["loop"]  # (one warp: no cross-warp softmax either)


@pytest.mark.lowering
def test_config_sweep_forces_each_config_and_ranks_them(tmp_path):
    """bench/attention_configs.py on INT4 with two warp counts: each config is the one compiled (its warps, and the
    split count that follows them), the simulation's time is in each row, and the best is the fastest spill-free."""
    out = tmp_path / "c.json"
    env = dict(os.environ, TRITON_INTERPRET="0")
    script = SCRIPT.parent / "attention_configs.py"
    short = tmp_path / "s.json"
    res = subprocess.run([sys.executable, str(script), "--formats", "int4", "--block-n", "32", "--warps", "1", "4",
                          "--stages", "2", "--out", str(out), "--shortlist", str(short), "--shortlist-n", "1"],
                         env=env, capture_output=True, text=True, timeout=300)  # fmt: skip
    assert res.returncode == 0, res.stderr[-3000:]
    f = json.loads(out.read_text())["formats"]["int4"]
    best = f["best"][0]  # the shortlist: the fastest spill-free config, as the tuner's partial config
    assert json.loads(short.read_text())["paged_attention_int4"] == [
        {"BLOCK_N": 32, "num_warps": best["num_warps"], "num_stages": 2}]
    rows = {r["num_warps"]: r for r in f["configs"]}
    assert set(rows) == {1, 4} and all(r["BLOCK_N"] == 32 and r["num_stages"] == 2 for r in rows.values())
    # the splits follow the forced config: the default's tile keeps its one wave of 12 programs an SM (12 splits, its
    # register cap), 4 warps another tile, which drops both for the two-wave rule (3)
    assert (rows[1]["NUM_SPLITS"], rows[4]["NUM_SPLITS"]) == (12, 3)
    assert rows[1]["registers"] <= 168 < rows[4]["registers"] or rows[4]["registers"] <= 168
    assert all(r["predicted_ms"] >= max(r["sched_ms"], r["floor_ms"]) for r in rows.values())
    ok = [r for r in rows.values() if not r["spill_stores"]]
    assert f["best"][0]["predicted_ms"] == min(r["predicted_ms"] for r in ok)
    assert f["default"]["num_warps"] == 1 and f["default"]["predicted_ms"] == pytest.approx(rows[1]["predicted_ms"])



@pytest.mark.lowering
def test_config_sweep_forces_kivi_value_planes(tmp_path):
    """`--vplanes 0 1` compiles KIVI's one-warp 16 x 128 tile twice, its value tiles joined and as code planes
    (VPLANES): two different kernels, each row saying which it is, the planes row the faster (predicted 0.309
    against 0.330 ms at batch 16 / 32k when it was added; 26 against 27 us at batch 4 / 8k, the shape `--batch`
    and `--context` set here, where the split count follows: 32 pairs, 32 splits), both uncapped (`--maxnreg 0`:
    the planes tile's default cap is sized for its own registers)."""
    out = tmp_path / "c.json"
    env = dict(os.environ, TRITON_INTERPRET="0")
    script = SCRIPT.parent / "attention_configs.py"
    res = subprocess.run([sys.executable, str(script), "--formats", "int4-kivi", "--block-n", "16", "--warps", "1",
                          "--stages", "2", "--per-sm", "8", "--vplanes", "0", "1", "--maxnreg", "0", "--batch", "4",
                          "--context", "8192", "--out", str(out)], env=env, capture_output=True, text=True,
                         timeout=300)  # fmt: skip
    assert res.returncode == 0, res.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["shape"]["batch"] == 4 and report["shape"]["context"] == 8192
    rows = {r["VPLANES"]: r for r in report["formats"]["int4-kivi"]["configs"]}
    assert all(r["NUM_SPLITS"] == 32 for r in rows.values()), rows
    assert set(rows) == {0, 1} and all(r["spill_stores"] == 0 for r in rows.values()), rows
    # the option reaches the kernel: the planes' value dots are another instruction stream, not the joined tile's
    assert rows[0]["sass_per_tile"] != rows[1]["sass_per_tile"], rows
    assert rows[1]["predicted_ms"] < rows[0]["predicted_ms"], rows

@pytest.mark.lowering
def test_config_sweep_counts_oakens_inner_loops_as_the_predictor_does(tmp_path):
    """Oaken's configs are forced (its table was missing from the ones the sweep forces) and predicted with its inner
    loops' trips at the bench cache's fullest lists, as `attention_predict` counts them: the default row is the
    committed prediction's (counting each inner loop once gave 1.149 ms and 1577 SASS a tile for 0.678 and 1270)."""
    out = tmp_path / "c.json"
    env = dict(os.environ, TRITON_INTERPRET="0")
    script = SCRIPT.parent / "attention_configs.py"
    res = subprocess.run([sys.executable, str(script), "--formats", "int4-oaken", "--block-n", "32", "--warps", "4",
                          "--stages", "2", "--out", str(out)], env=env, capture_output=True, text=True,
                         timeout=300)  # fmt: skip
    assert res.returncode == 0, res.stderr[-3000:]
    f = json.loads(out.read_text())["formats"]["int4-oaken"]
    committed = json.loads((SCRIPT.parent / "results" / "attention_predict_sm90.json").read_text())
    want = committed["decode"]["int4-oaken"]
    assert f["default"]["sass_per_tile"] == want["sass_per_tile"]
    assert f["default"]["predicted_ms"] == pytest.approx(want["predicted_ms"], rel=1e-6)
    (row,) = f["configs"]
    assert (row["BLOCK_N"], row["num_warps"]) == (32, 4) and row["sass_per_tile"] != want["sass_per_tile"], row


@pytest.mark.lowering
def test_int2_rows_copy_16_bytes_and_mixed_decodes_by_width(tmp_path):
    """INT2 rows at head_dim 128 are 8 words, heads 8 words apart: with `kv_align` the kernel knows it and copies
    them 16 bytes at a time (it copied 4, `LDGSTS.E`, 1167 SASS a tile against 1043). The mixed cache's prediction is
    its three INT launches at their shares of the context (8/4/4/2: a quarter, half, a quarter), plus the
    reduction and the tables launch; its INT2 width decodes INT2's half-word planes tile."""
    out = tmp_path / "p.json"
    env = dict(os.environ, TRITON_INTERPRET="0")
    res = subprocess.run([sys.executable, str(SCRIPT), "--formats", "int2", "mixed-8/4/4/2", "--no-tree", "--out",
                          str(out)], env=env, capture_output=True, text=True, timeout=300)  # fmt: skip
    assert res.returncode == 0, res.stderr[-3000:]
    rows = json.loads(out.read_text())["decode"]
    i2 = rows["int2"]
    assert i2["loop"]["ldgsts"].get("LDGSTS.E.BYPASS.128", 0) > 0 and i2["spill_stores"] == 0, i2["loop"]["ldgsts"]
    mixed = rows["mixed-8/4/4/2"]
    parts = mixed["by_width"]
    assert {k: p["context"] for k, p in parts.items()} == {"int8": 8192, "int4": 16384, "int2": 8192}
    # each part's own merge (0.003 ms, 3 of them) gives way to one reduction and the tables launch (2)
    assert mixed["predicted_ms"] == pytest.approx(sum(p["predicted_ms"] for p in parts.values()) - 0.003, rel=1e-9)
    # the INT2 width on the half-word planes' one-warp tile, as the INT2 cache's own decode
    assert (parts["int2"]["BLOCK_N"], parts["int2"]["num_warps"]) == (i2["BLOCK_N"], i2["num_warps"]) == (32, 1)
    assert parts["int2"]["predicted_ms"] < i2["predicted_ms"]  # a quarter of the context


def test_shortlist_ranks_spill_free_configs_per_table_op():
    """`attention_configs.shortlist`: per tuner table op, the n fastest predicted configs that compiled without
    spilling, as partial configs; KIVI's two widths share one table (the first listed, INT4, gives it)."""
    ac = load_script(SCRIPT.parent / "attention_configs.py", "_attention_configs")
    def row(bn, w, ms, spill=0, sched=0.1, **kw):
        return {"BLOCK_N": bn, "num_warps": w, "num_stages": 2, "PROGRAMS_PER_SM": None, "VPLANES": None,
                "predicted_ms": ms, "sched_ms": sched, "spill_stores": spill, **kw}  # fmt: skip

    report = {"shape": {"batch": 16, "context": 32768}, "formats": {
        "int4-kivi": {"configs": [row(16, 1, 0.3, VPLANES=1), row(32, 4, 0.2, spill=24), row(32, 2, 0.4),
                                  {"BLOCK_N": 64, "num_warps": 8, "num_stages": 2, "error": "refused"}]},
        "int2-kivi": {"configs": [row(64, 1, 0.1)]},
        "mixed-8/4/4/2": {"configs": [row(64, 4, 0.5, BY_WIDTH=0)]},
        "int8": {"configs": [row(16, 1, 0.268, sched=0.25), row(64, 4, 0.268, sched=0.19)]}}}  # fmt: skip
    out = ac.shortlist(report, 2, grid=None)
    # at the byte floor (equal predictions) the config with the most headroom under it first
    assert [c["BLOCK_N"] for c in out["paged_attention_int8"]] == [64, 16]
    assert out["paged_attention_kivi"] == [{"BLOCK_N": 16, "num_warps": 1, "num_stages": 2, "VPLANES": 1},
                                           {"BLOCK_N": 32, "num_warps": 2, "num_stages": 2}]  # fmt: skip
    # mixed: its width-by-width default, then one-launch tiles
    one_launch = {"BLOCK_N": 64, "num_warps": 4, "num_stages": 2, "BY_WIDTH": 0}
    assert out["paged_attention_mixed"] == [{"BY_WIDTH": 1}, one_launch]
    # the tuner's space filters: a tile it does not hold is left out
    only = ac.shortlist(report, 2, grid=lambda op, shape: [{"BLOCK_N": 64, "num_warps": 4, "num_stages": 2}])
    assert only["paged_attention_int8"] == [{"BLOCK_N": 64, "num_warps": 4, "num_stages": 2}]
    assert "batch 16, context 32768" in out["_about"]


def test_committed_shortlist_names_configs_of_the_tuners_spaces():
    """Each config of bench/results/attention_shortlist_sm90.json (what the GPU session tunes first) stands for at
    least one candidate of its op's GPU space at issue 21's shape (a space change that orphans one fails here)."""
    import torch

    import codesign.autotune.adapters  # noqa: F401  (registers the ops)
    from codesign.autotune.ops import get_op, parse_shape

    data = json.loads((SCRIPT.parent / "results" / "attention_shortlist_sm90.json").read_text())
    shape = parse_shape("M=16,q_heads=32,kv_heads=8,head_dim=128,block_size=32,ctx=32768")
    ops = [k for k in data if not k.startswith("_")]
    assert len(ops) == 7
    for name in ops:
        grid = list(get_op(name).space(shape, torch.bfloat16, True).grid())
        assert data[name], name
        for part in data[name]:
            assert any(all(c.get(k) == v for k, v in part.items()) for c in grid), (name, part)


@pytest.mark.lowering
def test_oaken_in_three_launches_is_predicted_launch_by_launch(tmp_path):
    """Oaken decode in three launches (`attention.oaken_split`) compiles for sm_90 without spills and is predicted
    as the sum of its key walk, its INT launch (the per-token INT4 tile with score biases in and probabilities out,
    one wave of the programs an SM holds) and its value walk, plus a gap a launch more; the row is the committed
    prediction's."""
    out = tmp_path / "p.json"
    env = dict(os.environ, TRITON_INTERPRET="0")
    res = subprocess.run([sys.executable, str(SCRIPT), "--formats", "int4-oaken-split", "--no-tree", "--out", str(out)],
                         env=env, capture_output=True, text=True, timeout=300)  # fmt: skip
    assert res.returncode == 0, res.stderr[-3000:]
    row = json.loads(out.read_text())["decode"]["int4-oaken-split"]
    parts = row["launches"]
    assert set(parts) == {"key_bias", "int", "value_corr"}
    assert all(p["spill_stores"] == 0 for p in parts.values()), {k: p["spill_stores"] for k, p in parts.items()}
    assert parts["int"]["waves"] == 1 and parts["int"]["num_warps"] == 1
    # the value walk within its register cap, all its programs resident at once (one wave)
    from codesign.kernels.attention import oaken_split

    corr = parts["value_corr"]
    assert corr["registers"] <= oaken_split.CORR_MAXNREG and corr["waves"] == 1
    assert corr["programs_per_sm"] <= corr["resident"] <= oaken_split.CORR_PROGRAMS_PER_SM
    gaps = row["predicted_ms"] - sum(p["predicted_ms"] for p in parts.values())
    assert gaps == pytest.approx(2 * 0.002)
    committed = json.loads((SCRIPT.parent / "results" / "attention_predict_sm90.json").read_text())
    assert row["predicted_ms"] == pytest.approx(committed["decode"]["int4-oaken-split"]["predicted_ms"], rel=1e-6)


def test_oakens_default_path_follows_the_committed_sweep():
    """`oaken_split.split_default`'s crossover (SPLIT_MIN_TOKEN_HEADS sequences x kv heads x context) agrees with
    the committed sm_90 sweep: the three launches wherever the rule takes them are predicted faster than the one
    launch, and slower wherever it does not."""
    from codesign.kernels.attention import oaken_split

    committed = json.loads((SCRIPT.parent / "results" / "attention_predict_sm90.json").read_text())
    hkv = 8  # gpu_kvquant's kv heads, the sweep's
    for point, rows in committed["sweep"].items():
        b, ctx = (int(part.split("=")[1]) for part in point.split())
        one, split = rows["int4-oaken"]["predicted_ms"], rows["int4-oaken-split"]["predicted_ms"]
        takes = b * hkv * ctx >= oaken_split.SPLIT_MIN_TOKEN_HEADS
        assert takes == (split < one), (point, one, split)

