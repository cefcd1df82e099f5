"""bench/gemm_predict.py: the per-launch model on a hand-written SASS listing with hand-computed times, the
variant sums (split-K buffer, torch's rule), and one case predicted from its sm_90 lowering (compile-only, no
GPU)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from helpers import load_script

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "gemm_predict.py"


def _sass(rest_before: int, body: int, rest_after: int) -> str:
    """A kernel listing as Triton gives it: `rest_before` instructions, a loop of `body` instructions on its
    longest path (an HMMA, an if/else of 3 or 1 instructions, the back branch), `rest_after` more, EXIT, the
    branch to itself and NOP padding (neither counted)."""
    ins = ["\tIMAD.MOV.U32 R1, RZ, RZ, c[0x0][0x28];"] * rest_before + ["LBB0:"]
    ins += ["\tHMMA.16816.F32 R4, R8, R10, R4;", "\t@P0 BRA LBB1;", "\tIADD3 R1, R1, 1, RZ;",
            "\tIADD3 R1, R1, 1, RZ;", "\tBRA LBB2;", "LBB1:", "\tIADD3 R1, R1, 2, RZ;", "LBB2:"]  # fmt: skip
    # independent fillers (no chain through one register): the loop issue-bound in the scheduler simulation too
    ins += [f"\tLOP3.LUT R{20 + i % 16}, R5, 0xf, RZ, 0xc0, !PT;" for i in range(body - 6)] + ["\t@P2 BRA LBB0;"]
    ins += ["\tSTG.E [R2.64], R4;"] * (rest_after - 1) + ["\tEXIT;", "LBB3:", "\tBRA LBB3;", "\tNOP;", "\tNOP;"]
    return "\n".join(f"04:-:-:-:1{t}" if t.startswith("\t") else t for t in ins)


@pytest.fixture(scope="module")
def gp():
    return load_script(SCRIPT, "gemm_predict")


def _splitk_launch(block_k: int = 128) -> SimpleNamespace:
    """The split-K W4A16 launch at M = 16, N = K = 8192 as the default config makes it: 16 x 64 tiles, 4 K slices,
    4 warps (512 programs: 4 on the busiest of 132 SMs)."""
    cx = {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": block_k, "SPLITK": True, "USE_ATOMIC": True}
    return SimpleNamespace(kernel="_wq_kernel", constexprs=cx, grid=[128, 4, 1], num_warps=4, num_stages=4,
                           registers=80, spill_stores=0, shared_bytes=45056)  # fmt: skip


def test_listing_counts_longest_path_and_rest(gp):
    prog = gp.program_report(_sass(200, 600, 100))
    (lp,) = prog["loops"]
    assert (lp["static"], lp["path_min"], lp["path_max"], lp["hmma"]) == (601, 598, 600, 1)  # else: 1 of 3
    assert prog["outside"] == 300  # 200 before, 99 stores and EXIT after; not the branch to itself, not NOPs


def test_splitk_launch_hand_computed(gp):
    """512 programs -> 4 on the busiest SM, 16 warps on 4 schedulers = 4 each; a program runs 2048 / 128 = 16
    iterations of 600 plus 300 once: 4 x 9900 cycles at 1.98 GHz = 20.0 us. Tensor: 4 programs x 2 x 16 x 64 x
    2048 flops at 989 / 132 TFLOP/s a SM = 2.24 us. Bytes: 4-bit codes 32 MiB, bf16 scales and zeros 2 x 1 MiB,
    x 256 KiB, fp32 output 512 KiB = 36,438,016 B at 4.18 TB/s = 8.72 us. Predicted = the issue bound."""
    r = gp.launch_prediction(_splitk_launch(), _sass(200, 600, 100), "w4a16_g128", 16, 8192, 8192)
    assert r["trips"] == [16] and r["instructions_per_program"] == 300 + 16 * 600
    assert (r["programs_per_sm"], r["warps_per_scheduler"]) == (4, 4)
    assert r["issue_ms"] == pytest.approx(4 * 9900 / 1.98e9 * 1e3)
    assert r["tensor_ms"] == pytest.approx(4 * 2 * 16 * 64 * 2048 / (989e12 / 132) * 1e3)
    assert r["bytes"] == 36_438_016 and r["floor_ms"] == pytest.approx(36_438_016 / 4.18e12 * 1e3)
    assert r["bound"] == "issue" and r["predicted_ms"] == r["issue_ms"]
    # the simulated loop: 4 warps a scheduler issue-bound (both arms of the if counted: 601 a warp an iteration)
    assert r["sched"]["warps_per_scheduler"] == 4 and r["sched"]["cycles_per_iter"] == pytest.approx(4 * 601, abs=8)
    assert r["sched"]["ms"] <= r["issue_ms"] * 1.01
    # a chain of shared-memory loads through one register instead (30 cycles each): 4 warps cannot hide it
    chain = "\n".join(t if "LOP3" not in t else "04:-:-:-:1\tLDS R5, [R5];" for t in _sass(200, 600, 100).splitlines())
    rc = gp.launch_prediction(_splitk_launch(), chain, "w4a16_g128", 16, 8192, 8192)
    assert rc["bound"] == "latency" and rc["sched"]["single_warp"] >= 30 * 594
    assert rc["predicted_ms"] > 5 * rc["issue_ms"]
    # a wrong trip count must change the answer: K tiles of 64 are 32 a slice, twice the loop's issue
    r64 = gp.launch_prediction(_splitk_launch(64), _sass(200, 600, 100), "w4a16_g128", 16, 8192, 8192)
    assert r64["trips"] == [32] and r64["issue_ms"] == pytest.approx(4 * (300 + 32 * 600) / 1.98e9 * 1e3)


def test_loop_count_mismatch_is_refused(gp):
    with pytest.raises(ValueError, match="expects 2"):  # the quantizer has two K loops; this listing one
        gp.loop_trips("_act_quant_kernel", {"BLOCK_K": 1024}, [16], 16, 8192, [{"ldg": {"LDG.E.128": 1}}], 4)


def test_uniform_branches_to_addresses_are_conditional(gp):
    """ptxas's uniform branches name a second predicate and a byte address (`@!P2 BRA P3, 0x...;`): both are read,
    so a loop whose fast side skips a slow side has two paths, and the quantizers count the short one."""
    body = ["\tLOP3.LUT R5, R5, 0xf, RZ, 0xc0, !PT;"]
    ins = ["LBB0:", "\tLDG.E.128 R8, desc[UR8][R16.64];", "\t@!P2 BRA P3, 0x{:x};"] + body * 10 + ["\tBRA LBB1;"]
    fast = len([t for t in ins if t.startswith("\t")])  # the fast side's first instruction
    ins[2] = ins[2].format(fast * 16)
    ins += body * 3 + ["LBB1:", "\t@P0 BRA LBB0;", "\tEXIT;"]
    sass = "\n".join(f"04:-:-:-:1{t}" if t.startswith("\t") else t for t in ins)
    (lp,) = gp.program_report(sass)["loops"]
    assert (lp["path_min"], lp["path_max"]) == (6, 14)  # load, branch, 3 fast, back edge / 10 slow and its BRA
    cx = {"BLOCK_K": 1024}
    one = gp.per_program("_act_quant_kernel", cx, [16], 16, 8192, 8192, {"loops": [lp, lp], "outside": 0}, 4)
    assert one["sass_per_iter"] == 6 and one["instructions"] == 8 * 6 + 8 * 6


def test_unrolled_absmax_loops_run_fewer_trips(gp):
    """LLVM unrolls the quantizers' absmax loops: four 16-byte loads an iteration where a 1024-element bf16 tile on
    4 warps is one a thread, so 8192 / 1024 = 8 K tiles are 2 trips; the quantize loop's single load, 8."""
    unrolled, single = {"ldg": {"LDG.E.128": 4}}, {"ldg": {"LDG.E.128": 1}}
    assert gp.loop_trips("_act_quant_kernel", {"BLOCK_K": 1024}, [16], 16, 8192, [unrolled, single], 4) == [2, 8]
    assert gp.loop_trips("_act_quant_kernel", {"BLOCK_K": 1024}, [16], 16, 8192, [single, single], 4) == [8, 8]
    # the fused quantizer at 4 rows: 4 x 128 bf16 on 4 warps = 8 B a thread a tile; four 8-byte loads = 4 tiles
    cx = {"BLOCK_K": 128, "ROWS": 4}
    assert gp.loop_trips("_fusedq_kernel", cx, [128, 1], 4, 8192, [{"ldg": {"LDG.E.64": 4}}, single], 4) == [16, 64]


def test_variant_sums_and_torch_rule(gp):
    launch = gp.launch_prediction(_splitk_launch(), _sass(200, 600, 100), "w4a16_g128", 16, 8192, 8192)
    # Today's kernels join their splits in the launch: one launch, no gap, the join's tail of two DRAM latencies.
    v = gp.variant_prediction("w4a16_g128", "splitk", 16, 8192, 8192, [launch], 0.0342)
    assert v["predicted_ms"] == pytest.approx(launch["predicted_ms"] + 1200 / gp.CLOCK_HZ * 1e3)
    # The kernels before the join (the hindcast's): a zeroed fp32 buffer and its copy into bf16, two more launches.
    v = gp.variant_prediction("w4a16_g128", "splitk", 16, 8192, 8192, [launch], 0.0342, joined=False)
    buf = (16 * 8192 * 4 + 16 * 8192 * 6) / 4.18e12 * 1e3
    assert v["predicted_ms"] == pytest.approx(launch["predicted_ms"] + buf + 2 * gp.LAUNCH_GAP_MS)
    # torch's e4m3 path: the GEMM at half the measured bf16 time and out.copy_ (the weight's column-major copy is
    # cached per weight, torch_mm.weight_nk: not a per-call pass)
    t = gp.variant_prediction("fp8", "torch", 1024, 8192, 8192, [], 0.2008)
    gemm, ocopy = (p["ms"] for p in t["torch_passes"])
    assert gemm == pytest.approx(0.1004) and ocopy == pytest.approx(1024 * 8192 * 4 / 4.18e12 * 1e3)
    assert t["predicted_ms"] == pytest.approx(gemm + ocopy + gp.LAUNCH_GAP_MS)
    assert t["basis"] == "torch-derived" and t["torch_passes"][0]["bound"] == "torch-derived"
    assert t["dominant"] == "torch-derived (torch._scaled_mm (e4m3, row-wise))"


@pytest.mark.lowering
def test_splitk_prediction_from_sm90_lowering(tmp_path):
    """W4A16 g128 at M = 16 (the split-K variant, the default there) compiles for sm_90 without spills; its loop
    runs 16 K tiles a program, holds a matrix instruction, and the prediction is above its byte floor."""
    out = tmp_path / "g.json"
    env = dict(os.environ, TRITON_INTERPRET="0")
    cmd = [sys.executable, str(SCRIPT), "--ops", "w4a16_g128", "--ms", "16", "--shapes", "8192",
           "--variants", "splitk", "--out", str(out)]  # fmt: skip
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    (row,) = json.loads(out.read_text())["cases"]
    assert row["variant"] == "splitk" and row["default"] and row["bf16_measured_ms"] == pytest.approx(0.03415, 1e-3)
    (launch,) = row["launches"]
    assert launch["kernel"] == "_wq_kernel" and launch["spill_stores"] == 0 and launch["trips"] == [16]
    assert launch["mma"] and launch["sass_per_iter"] > 100
    assert sum(launch["main_loop_cvt"].values()) <= 2  # k0 // GROUP's reciprocal; no conversion per element
    assert 0 < launch["floor_ms"] <= launch["predicted_ms"] <= row["predicted_ms"] < 0.2
    assert "splitk" in res.stdout
