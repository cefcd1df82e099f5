"""Predicted H200 times of the quantized GEMMs, every Triton variant that can run each shape, from the sm_90 SASS
of the launches the default configs choose (compile-only: no GPU, nothing timed; every number is a prediction).

    python bench/gemm_predict.py                                  # both shapes, every op, M and variant
    python bench/gemm_predict.py --ops w4a16_g128 --ms 16 --shapes square --out /tmp/g.json

Cases: `gpu_quant_gemm`'s quick shapes (N = K = 8192, and Llama-2-70B gate_up, N = 57344, K = 8192) through
`lowering_report`'s cases (bf16 activations; W4A16 g128 asymmetric with bf16 scales and zeros, W8A16 per channel,
W8A8 int8 and FP8 with fp32 per-channel weight scales), M in 1, 2, 4, 8, 16, 256, 1024, 4096 (M = 2 and 8, untimed
by the GPU bench, take the next timed M's bf16 time: `bf16_ms`). Each op runs once per
variant, pinned by `forced_config` as `gpu_quant_gemm` pins them (W4A16 / W8A16: gemv, splitk, tiled, dequant;
W8A8 / FP8: fusedq, triton, tma, torch), under `codesign.autotune.compile_only(90, "NVIDIA H200")`; the default
rule's choice (`triton_gemm.choose_variant`, `choose_scaled_mm_variant`, with that device view) is marked.

Per Triton launch (its SASS through `sass_model`; the loops in address order, each counted along its longest
path, times its trip count from the grid and constexprs: K tiles of the program's split (the GEMV's K range too),
both K loops of the quantizers, the prologue and main loop of the fused quantizer; the persistent TMA kernel's
one flattened loop as K steps on its shortest path, the last of each tile on its longest, the epilogue's):

    issue  = ceil(ceil(programs / 132) * warps / 4) * (sum of loop trips * path + the rest once) / 1.98 GHz
    tensor = ceil(programs / 132) * 2 * BLOCK_M * BLOCK_N * K-range / (peak / 132)      (launches with a dot)
    floor  = the launch's unique bytes (weight codes, scales, zeros, activations or codes, output; fp32 output
             where K slices meet by atomics) / 4.18 TB/s (the measured device-to-device copy, docs/results.md)
    latency = waves * main-loop trips * sim(main loop, warps a scheduler) + the rest at issue rate   (not TMA)
    launch = max(issue, tensor, floor, latency)

Tensor-core peak: dense 989 TFLOP/s for fp16 / bf16 and 1979 TOPS for int8 / fp8 (NVIDIA H100 SXM5 datasheet,
the figures the H200 datasheet repeats: the same GH100 tensor cores; bf16 8192^3 measured 797 TFLOP/s here, 81 %).
The rate follows the SASS's matrix opcode (IMMA / IGMMA / QGMMA: 8-bit; HMMA / HGMMA: 16-bit, e4m3 on mma.sync
included: it is converted to fp16 first). The same peak is used for mma.sync (HMMA / IMMA: the BLOCK_M 16
tiles) as for wgmma (HGMMA / IGMMA / QGMMA), though Hopper's mma.sync runs below it: a lower bound there.

A variant's time = the sum of its launches + torch's own passes + LAUNCH_GAP_MS per launch after the first:
split-K's join tail (two DRAM latencies: the last split's ticket and its read-back of the sum; the splits meet
in the launch, `splitk_join`, with no zeroing or copy pass), dequant's bf16
`torch.matmul` (the measured bf16 time at that shape and M: the same GEMM), and torch's int8 / fp8 paths
(`torch_mm`), which cannot be compiled here: their GEMM is predicted as the measured bf16 `torch.matmul` time / 2
(stated rule: int8 / fp8 peak = 2x bf16 peak, and at small M half the weight bytes), plus the passes
`torch_mm.torch_scaled_mm` makes per call at copy bandwidth (the fp32 epilogue over M x N; the weight's [N, K]
copy is made once per weight and cached, so it is not counted) and the activation quantizer (compiled, predicted
as above). `torch._int_mm` needs M > 16: no prediction below.

`latency`: the warp-scheduler simulation of `bench/sass_sched.py` (in-order warps behind a scoreboard, Hopper
latencies and sm_90 pipe rates), held against the measured decode attention by `bench/hindcast.py` (0.69-2.04x,
where the issue count alone was 2.4-4.6x low) and the measured GEMMs by `bench/hindcast_gemm.py` (`mma.sync`
split-K 1.06-1.25x; the wgmma loops fed by `cp.async` 1.33-1.71x tiled, 2.2-3.3x the 8-bit scaled GEMM: a constant
gap a K step it does not explain, docs/results.md; the issue count alone was 1.9-4.9x low there); not run on the TMA
kernel's wgmma loop, whose mbarrier waits it does not follow. Lower bounds otherwise: the tensor-core peak, unique
bytes (L2 reuse perfect: the tiled kernels' re-reads of weight and activation tiles, fp32 atomics'
read-modify-writes in L2: the GEMV makes programs x BLOCK_N x M of them a call), full HBM bandwidth even when fewer
programs than SMs stream it (the TMA and tiled grids at small M), no host work (the TMA descriptors' encoding per
launch). The launch gap is assumed (1 us, CUDA-graph replay, as docs/kernels.md
estimates), not measured here. JSON with --out.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import warnings
from pathlib import Path
from typing import Any

BENCH_DIR = Path(__file__).resolve().parent
if str(BENCH_DIR) not in sys.path:
    sys.path.insert(0, str(BENCH_DIR))
from sass_model import (  # noqa: E402
    CLOCK_HZ,
    SMS,
    issue_cycles,
    outer_loops,
    parse_sass,
    program_report,
    run_report,
)
from sass_sched import LATENCY, iteration, simulate  # noqa: E402

COPY_BPS = 4.18e12  # measured device-to-device copy, H200 run 1 (docs/results.md, "Ceilings")
TENSOR_OPS = {16: 989e12, 8: 1979e12}  # dense tensor-core peak by operand bits (H100 / H200 SXM datasheets)
LAUNCH_GAP_MS = 0.001  # between two launches of one call in a CUDA graph (assumed: ~1 us, docs/kernels.md)
MS = (1, 2, 4, 8, 16, 256, 1024, 4096)
RUN = BENCH_DIR / "results" / "h200-2026-11-30-run2.json"  # bf16 torch.matmul and the old kernels, measured
# op -> (kind, bits or fp8); the variants in the order the table shows them
OPS = {"w4a16_g128": ("wq", 4), "w8a16_pc": ("wq", 8), "w8a8_int8": ("mm", False), "fp8": ("mm", True)}
WQ_VARIANTS = ("gemv", "splitk", "tiled", "dequant")
GEMV_MAX_PREDICTED_M = 16  # the smallest-M variant: beyond this its launch per 4 rows only floods the report
MM_VARIANTS = ("fusedq", "triton", "tma", "torch")


# ----------------------------------------------------------------------------- bytes
def weight_bytes(op: str, n: int, k: int) -> int:
    """The packed weight, its scales and zeros as `lowering_report` builds them (W4A16 g128: 4-bit codes, bf16
    scales and zeros per 128; W8A16: int8 codes, bf16 per-channel scales; W8A8 / FP8: 1-byte codes, fp32 scales)."""
    if op == "w4a16_g128":
        return k * n // 2 + 2 * (k // 128) * n * 2
    return k * n + n * (2 if op == "w8a16_pc" else 4)


def launch_bytes(kernel: str, op: str, m: int, n: int, k: int, atomic: bool) -> int:
    """Unique bytes one launch must move (each read or written once; L2 reuse perfect)."""
    out = m * n * (4 if atomic else 2)
    if kernel in ("_wq_gemv_kernel", "_wq_kernel"):
        return weight_bytes(op, n, k) + m * k * 2 + out
    if kernel == "_dequant_kernel":
        return weight_bytes(op, n, k) + k * n * 2  # the bf16 weight written for torch.matmul
    if kernel == "_act_quant_kernel":
        return m * k * 2 + m * k + m * 4
    if kernel == "_fusedq_kernel":
        return m * k * 2 + weight_bytes(op, n, k) + out
    if kernel in ("_scaled_mm_kernel", "_tma_scaled_mm_kernel"):
        return m * k + m * 4 + weight_bytes(op, n, k) + out
    raise ValueError(f"no byte model for {kernel}")


# ----------------------------------------------------------------------------- one launch
def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


ACT_BYTES = 2  # bf16 activations (the cases)
# Kernels whose loops count along their shortest path: their only branches are the activation quantizer's fallback
# to div_rn for rows whose scale is outside the reciprocal's exact range (`kernels/triton_div.py`: 2^-60 .. 2^60)
# and div_rn's out-of-line slow path, neither taken for the bench's activations.
COLD_BRANCHES = ("_act_quant_kernel", "_fusedq_kernel")


def _ldg_bytes(lp: dict) -> int:
    """Bytes one thread loads by LDG in one iteration of the loop (the opcode's width suffix; 4 without one)."""
    width = {"64": 8, "128": 16, "U8": 1, "S8": 1, "U16": 2, "S16": 2}
    return sum(c * width.get(op.split(".")[-1], 4) for op, c in lp["ldg"].items())


def _absmax_trips(lp: dict, steps: int, rows: int, cx: dict, warps: int) -> int:
    """Trips of an absmax loop over `steps` K tiles of `rows` activation rows: LLVM unrolls it (4 K tiles an
    iteration for `_act_quant_kernel`'s 1024-element tiles and the fused quantizer's at 4 rows; the remainder runs
    outside the loop), which the loop's loads tell: bytes an iteration / bytes a K tile, per thread."""
    per_tile = rows * cx["BLOCK_K"] * ACT_BYTES / (32 * warps)
    return _cdiv(steps, max(1, round(_ldg_bytes(lp) / per_tile)))


def loop_trips(kernel: str, cx: dict, grid: list[int], m: int, k: int, lps: list[dict], warps: int) -> list[int]:
    """Trips of each outermost SASS loop (address order) of one program, the busiest (longest K range)."""
    n_loops = len(lps)
    if kernel == "_wq_gemv_kernel":
        want = [_cdiv(_cdiv(k, cx["BLOCK_K"]), grid[1])]  # the program's K tiles (rows: M_PAD inside each)
    elif kernel == "_wq_kernel":
        tiles = _cdiv(k, cx["BLOCK_K"])
        want = [_cdiv(tiles, grid[1]) if cx["SPLITK"] else tiles]
    elif kernel == "_dequant_kernel":
        want = []
    elif kernel == "_act_quant_kernel":
        steps = _cdiv(k, cx["BLOCK_K"])
        want = [_absmax_trips(lps[0], steps, 1, cx, warps) if lps else steps, steps]  # absmax, then quantize
    elif kernel == "_scaled_mm_kernel":
        want = [_cdiv(_cdiv(k, cx["BLOCK_K"]), grid[1] if len(grid) > 1 else 1)]
    elif kernel == "_fusedq_kernel":
        steps = _cdiv(k, cx["BLOCK_K"])
        prologue = _absmax_trips(lps[0], steps, cx["ROWS"], cx, warps) if lps else steps
        want = [prologue, _cdiv(steps, grid[1])]  # absmax over all K, then dots
    else:
        raise ValueError(f"no loop model for {kernel}")
    if n_loops != len(want):
        raise ValueError(f"{kernel}: {n_loops} outermost SASS loops, the model expects {len(want)}")
    return want


def per_program(
    kernel: str, cx: dict, grid: list[int], m: int, n: int, k: int, prog: dict, warps: int
) -> dict[str, Any]:
    """Warp instructions one program issues (per warp), from its loops' paths and trips (module docstring)."""
    lps = prog["loops"]
    if kernel == "_tma_scaled_mm_kernel":
        # One flattened loop over (tile, K step): the K steps on its shortest path, the tile's last (start, epilogue)
        # on its longest; its other loops (no K step: K = 0; the mbarrier retry) run no trips here.
        i = max((j for j, lp in enumerate(lps) if lp["hmma"]), key=lambda j: lps[j]["static"])
        tiles = _cdiv(_cdiv(m, cx["BLOCK_M"]) * _cdiv(n, cx["BLOCK_N"]), grid[0])
        steps = _cdiv(k, cx["BLOCK_K"])
        trips = [0] * len(lps)
        trips[i] = tiles * steps
        count = tiles * ((steps - 1) * lps[i]["path_min"] + lps[i]["path_max"]) + prog["outside"]
        return {"trips": trips, "main": i, "sass_per_iter": lps[i]["path_min"], "instructions": count,
                "tiles_per_program": tiles, "k_range": tiles * steps * cx["BLOCK_K"]}  # fmt: skip
    trips = loop_trips(kernel, cx, grid, m, k, lps, warps)
    path = "path_min" if kernel in COLD_BRANCHES else "path_max"
    count = prog["outside"] + sum(t * lp[path] for t, lp in zip(trips, lps))
    mma = [j for j, lp in enumerate(lps) if lp["hmma"]]
    main = mma[-1] if mma else (len(lps) - 1 if lps else None)
    k_range = trips[main] * cx["BLOCK_K"] if mma else 0
    return {"trips": trips, "main": main, "sass_per_iter": lps[main][path] if main is not None else 0,
            "instructions": count, "tiles_per_program": 1, "k_range": k_range}  # fmt: skip


def launch_prediction(launch: Any, sass: str, op: str, m: int, n: int, k: int) -> dict[str, Any]:
    """One launch's bounds (module docstring): issue, tensor, bytes; its SASS loops and resources."""
    cx, grid, kern = launch.constexprs, list(launch.grid), launch.kernel
    prog = program_report(sass)
    pp = per_program(kern, cx, grid, m, n, k, prog, launch.num_warps)
    programs = math.prod(grid)
    occ = issue_cycles(programs, launch.num_warps, launch.registers, launch.shared_bytes, pp["instructions"])
    atomic = bool(cx.get("USE_ATOMIC")) or (kern in ("_fusedq_kernel", "_scaled_mm_kernel") and grid[1] > 1)
    nbytes = launch_bytes(kern, op, m, n, k, atomic)
    tensor_ms, mma = 0.0, {}
    if pp["k_range"]:
        mma = prog["loops"][pp["main"]]["mma"]
        # 8-bit operands where the SASS multiplies them as such (IMMA, IGMMA, QGMMA); e4m3 on mma.sync is
        # converted to fp16 and runs HMMA at the 16-bit rate
        bits = 8 if any(o.startswith(("IMMA", "IGMMA", "QGMMA")) for o in mma) else 16
        flops = 2 * cx["BLOCK_M"] * cx["BLOCK_N"] * pp["k_range"] * occ["programs_per_sm"]
        tensor_ms = flops / (TENSOR_OPS[bits] / SMS) * 1e3
    times = {"issue": occ["cycles"] / CLOCK_HZ * 1e3, "tensor": tensor_ms, "memory": nbytes / COPY_BPS * 1e3}
    sim = _sched(sass, prog, pp, occ) if kern not in ASYNC_KERNELS else None
    if sim is not None:
        times["latency"] = sim["ms"]
    bound = max(times, key=times.get)
    main = prog["loops"][pp["main"]] if pp["main"] is not None else None
    return {"kernel": kern, "grid": grid, "num_warps": launch.num_warps, "num_stages": launch.num_stages,
            "registers": launch.registers, "spill_stores": launch.spill_stores, "shared_bytes": launch.shared_bytes,
            "constexprs": {c: v for c, v in cx.items() if c.startswith(("BLOCK", "SPLIT", "ROWS", "GROUP_M"))},
            "loops": [{c: lp[c] for c in ("static", "path_min", "path_max", "hmma")} for lp in prog["loops"]],
            "outside_loops": prog["outside"], "trips": pp["trips"], "sass_per_iter": pp["sass_per_iter"],
            "main_loop_cvt": main["cvt"] if main else {}, "mma": mma, "instructions_per_program": pp["instructions"],
            **occ, "atomic": atomic, "bytes": nbytes, "issue_ms": times["issue"], "tensor_ms": times["tensor"],
            "sched": sim, "floor_ms": times["memory"], "bound": bound, "predicted_ms": times[bound]}  # fmt: skip


# wgmma fed by TMA / mbarriers (`SYNCS` waits): async proxies the scheduler simulation does not follow
ASYNC_KERNELS = ("_tma_scaled_mm_kernel",)


def _sched(sass: str, prog: dict, pp: dict, occ: dict) -> dict[str, Any] | None:
    """The main loop through the warp-scheduler simulation (`bench/sass_sched.py`: the resident programs' warps a
    scheduler), times its trips and the waves, plus everything else at one instruction a cycle a warp: the
    latency-aware time of a launch whose loop has too few warps to hide its loads and dots. wgmma loops fed by
    cp.async included (the simulation follows their copy groups and `WARPGROUP.DEPBAR` waits); None without a
    loop (the TMA kernel's mbarrier waits are not followed: `ASYNC_KERNELS`, never passed here)."""
    if pp["main"] is None:
        return None
    ins, labels = parse_sass(sass)
    a, b = outer_loops(ins, labels)[0][pp["main"]]
    wps = occ["resident_warps_per_scheduler"]
    sim = simulate(iteration(ins, labels, a, b), wps)
    main_trips = pp["trips"][pp["main"]]
    rest = pp["instructions"] - main_trips * pp["sass_per_iter"]
    cycles = occ["waves"] * main_trips * sim["cycles"] + occ["warps_per_scheduler"] * rest
    return {"warps_per_scheduler": wps, "cycles_per_iter": sim["cycles"], "single_warp": sim["single_warp"],
            "nearest_bound": sim["nearest_bound"], "ms": cycles / CLOCK_HZ * 1e3}  # fmt: skip


# ----------------------------------------------------------------------------- one variant
JOIN_TAIL_CYCLES = 2 * LATENCY["dram"]  # the split-K join's tail: the last split's ticket and its read-back


def torch_passes(op: str, variant: str, m: int, n: int, k: int, launches: list[dict], bf16_ms: float | None,
                 joined: bool = True):
    """The work outside Triton a variant does per call, each {what, ms, bound, how}: the split-K join's tail
    ("latency", in the launch; `joined` False: the zeroed buffer and its copy of the kernels before the join) and
    torch_mm's per-call passes ("memory": bytes at copy bandwidth), dequant's bf16 matmul ("measured bf16": the
    measured time of the same GEMM), torch's int8 / fp8 GEMMs ("torch-derived": measured bf16 time / 2)."""

    def bw(name: str, nbytes: float) -> dict[str, Any]:
        return {"what": name, "ms": nbytes / COPY_BPS * 1e3, "bound": "memory",
                "how": f"{nbytes / 1e6:.2f} MB at copy bandwidth"}  # fmt: skip

    out = []
    if any(r["atomic"] for r in launches) and not joined:  # kernels before the join (the hindcast's)
        out += [bw("zero the fp32 split-K buffer", m * n * 4), bw("copy it into the bf16 output", m * n * 6)]
    elif any(r["atomic"] for r in launches):
        # The splits meet in the launch (`splitk_join`): no zeroing or copy pass, but the last program of a tile waits
        # for its ticket and then reads the sum back, two L2 round trips after its loop (taken at DRAM latency).
        out.append({"what": "split-K join tail", "ms": JOIN_TAIL_CYCLES / CLOCK_HZ * 1e3, "bound": "latency",
                    "in_launch": True, "how": f"{JOIN_TAIL_CYCLES} cycles: ticket + read-back atomics"})  # fmt: skip
    if variant == "dequant":
        out.append({"what": "torch.matmul (bf16)", "ms": bf16_ms, "bound": "measured bf16",
                    "how": "bf16 torch.matmul measured at this shape and M (H200 run 2)"})  # fmt: skip
    if variant == "torch":
        gemm = "torch._scaled_mm (e4m3, row-wise)" if op == "fp8" else "torch._int_mm"
        out.append({"what": gemm, "ms": bf16_ms / 2, "bound": "torch-derived",
                    "how": "measured bf16 torch.matmul / 2 (stated rule: int8 / fp8 peak = 2x bf16)"})  # fmt: skip
        # The weight's [N, K] copy is made once per weight (torch_mm.weight_nk, cached), not per call.
        if op == "fp8":
            out += [bw("out.copy_", m * n * 4)]
        else:
            out += [bw("acc.to(float32)", m * n * 8), bw("* a_scale", m * n * 8), bw("* w_scale", m * n * 8),
                    bw("out.copy_", m * n * 6)]  # fmt: skip
    return out


def variant_prediction(op, variant, m, n, k, launches, bf16_ms, joined: bool = True) -> dict[str, Any]:
    """A variant's predicted time: its Triton launches, torch's passes, the gaps between launches; `basis` says
    what it rests on (compiled SASS only, or measured / torch-derived parts too). joined False: split-K launches of
    the kernels before `splitk_join` (a zeroing and a copy pass around them)."""
    passes = torch_passes(op, variant, m, n, k, launches, bf16_ms, joined)
    steps = [(r["kernel"], r["predicted_ms"], r["bound"]) for r in launches]
    steps += [(p["what"], p["ms"], p["bound"]) for p in passes]
    gaps = LAUNCH_GAP_MS * (len(steps) - 1 - sum(1 for p in passes if p.get("in_launch")))
    total = sum(ms for _, ms, _ in steps) + gaps
    top = max(steps, key=lambda s: s[1])
    basis = {"torch": "torch-derived", "dequant": "compiled + measured bf16 matmul"}.get(variant, "compiled")
    return {"launches": launches, "torch_passes": passes, "gaps_ms": gaps, "predicted_ms": total,
            "dominant": f"{top[2]} ({top[0]})", "basis": basis}  # fmt: skip


# ----------------------------------------------------------------------------- the cases
def measured(path: Path = RUN) -> dict[tuple[str, int, str], float]:
    """(layer, M, kernel) -> ms of H200 run 2: `bf16_matmul`, and the old kernels each op ran then."""
    rows = json.loads(path.read_text())["quant_gemm"]["rows"]
    return {(r["layer"], r["M"], r["kernel"]): r["ms"] for r in rows}


def bf16_ms(meas: dict[tuple[str, int, str], float], shape: str, m: int) -> float | None:
    """The measured bf16 matmul at (shape, M); at an M the run did not time (M = 2), the next larger timed M's: the
    same weight stream, and bf16's time does not fall with M (an upper bound)."""
    timed = sorted(mm for (sh, mm, kern) in meas if sh == shape and kern == "bf16_matmul" and mm >= m)
    return meas[(shape, timed[0], "bf16_matmul")] if timed else None


def _cases(ops, ms, shapes, extra_shapes=None):
    """(shape label, op, M, N, K, call) from `lowering_report`'s quant_gemm cases (bf16 activations); with
    `extra_shapes` ({label: (N, K)}) over those shapes instead of the GPU bench's."""
    import lowering_report as lr

    mods = lr._suite_modules()
    bench_ms, bench_shapes = mods["qg"].MS, mods["qg"].QUICK_SHAPES
    mods["qg"].MS = tuple(sorted(set(bench_ms) | set(ms)))  # Ms the GPU bench does not time (M = 2) too
    if extra_shapes:
        mods["qg"].QUICK_SHAPES = {"extra": dict(extra_shapes)}
    try:
        for _, label, call in lr._quant_gemm_cases(mods, 90):
            parts = label.split()  # quant_gemm {model}/{layer} M= N= K= {op} bf16
            shape = parts[1].split("/")[1]
            m, n, k = (int(p.split("=")[1]) for p in parts[2:5])
            if parts[5] in ops and m in ms and shape in shapes:
                yield shape, parts[5], m, n, k, call
    finally:
        mods["qg"].MS, mods["qg"].QUICK_SHAPES = bench_ms, bench_shapes


def _pin(op: str, variant: str):
    """The variant-table op and entry that force `variant` (as gpu_quant_gemm pins its rows)."""
    from codesign.kernels.gemm import triton_gemm as qt

    kind, arg = OPS[op]
    if kind == "wq":
        return qt.wq_variant_op(arg), qt.wq_variant_entry(variant)
    return qt.scaled_mm_variant_op(arg), qt.scaled_mm_variant_entry(variant)


def _default(op: str, m: int, n: int, k: int) -> str:
    """The default rule's variant under the session's device view (sm_90, H200; no tuned table)."""
    import torch

    from codesign.kernels.gemm import triton_gemm as qt

    kind, arg = OPS[op]
    cpu = torch.device("cpu")  # compile-only: CPU tensors stand for the H200's
    if kind == "wq":
        return qt.choose_variant(m, qt.wq_op(arg), cpu, qt.wq_table_key(n, k, 128 if arg == 4 else k))
    return qt.choose_scaled_mm_variant(m, n, k, arg, torch.bfloat16, cpu)


def _cannot(op: str, variant: str, m: int, n: int, k: int) -> str:
    """Why a variant cannot take the call on the H200 ('' when it can): torch's rules, checked as on a GPU."""
    import torch

    from codesign.kernels.gemm import torch_mm, triton_gemv

    if variant == "torch" and op == "w8a8_int8":  # (the e4m3 rules need a CUDA device to ask; all met here)
        return torch_mm.why_not(m, n, k, False, torch.bfloat16, torch.device("cuda"))
    if variant == "gemv" and m > GEMV_MAX_PREDICTED_M:
        return f"not predicted past M = {GEMV_MAX_PREDICTED_M}: the GEMV takes {triton_gemv.M_ROWS} rows of x a launch"
    return ""


def predict(ops=tuple(OPS), ms=MS, shapes=("8192", "gate_up"), variants=None, log=print,
            extra_shapes=None) -> dict[str, Any]:  # fmt: skip
    """Compile every case for sm_90 (compile-only) and predict each variant's time; the report (module docstring).
    `extra_shapes` ({label: (N, K)}, `shapes` naming some of them): those shapes instead (no measured bf16 time)."""
    import torch

    from codesign.autotune.compile_only import compile_only
    from codesign.autotune.lookup import forced_config
    from codesign.backend import use_backend

    warnings.filterwarnings("ignore", message="no tuned config for")
    warnings.filterwarnings("ignore", message="TRITON_DEFAULT_FP_FUSION")
    meas = measured()
    rows = []
    with compile_only(90, "NVIDIA H200") as session, use_backend("triton"), torch.no_grad():
        for shape, op, m, n, k, call in _cases(ops, ms, shapes, extra_shapes):
            bf16 = bf16_ms(meas, shape, m)
            default = _default(op, m, n, k)
            for variant in WQ_VARIANTS if OPS[op][0] == "wq" else MM_VARIANTS:
                if variants and variant not in variants:
                    continue
                row = {"shape": shape, "op": op, "M": m, "N": n, "K": k, "variant": variant,
                       "default": variant == default, "bf16_measured_ms": bf16,
                       "last_measured_ms": meas.get((shape, m, op))}  # fmt: skip
                reason = _cannot(op, variant, m, n, k)
                if not reason and variant in ("dequant", "torch") and bf16 is None:
                    reason = "no measured bf16 matmul at this shape (its torch GEMM's time)"
                if reason:
                    rows.append({**row, "cannot": reason, "predicted_ms": None})
                    continue
                n0 = len(session.launches)
                with forced_config(*_pin(op, variant)):
                    call()
                launches = [launch_prediction(lc, kern.asm["sass"], op, m, n, k)
                            for lc, kern in zip(session.launches[n0:], session.compiled[n0:])]  # fmt: skip
                pred = variant_prediction(op, variant, m, n, k, launches, bf16)
                row.update(pred, vs_bf16=bf16 / pred["predicted_ms"] if bf16 else None)
                rows.append(row)
                log(f"  {shape} {op} M={m} {variant}: {pred['predicted_ms'] * 1e3:.1f} us ({pred['dominant']})")
    return {"gpu": "NVIDIA H200 (compile-only sm_90; nothing timed: predictions)", "sms": SMS, "clock_hz": CLOCK_HZ,
            "copy_Bps": COPY_BPS, "tensor_ops": {f"{b}-bit": v for b, v in TENSOR_OPS.items()},
            "launch_gap_ms": LAUNCH_GAP_MS, "measured_from": str(RUN.relative_to(BENCH_DIR.parent)),
            "cases": rows, "rule_check": rule_check(rows)}  # fmt: skip


def rule_check(rows: list[dict]) -> list[dict[str, Any]]:
    """Per (shape, op, M): the default rule's variant beside the fastest predicted one (both predictions)."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        if r["predicted_ms"] is not None:
            groups.setdefault((r["shape"], r["op"], r["M"]), []).append(r)
    out = []
    for (shape, op, m), rs in groups.items():
        best = min(rs, key=lambda r: r["predicted_ms"])
        dflt = next((r for r in rs if r["default"]), None)
        if dflt is None:
            continue  # the default variant was not asked for (--variants)
        out.append({"shape": shape, "op": op, "M": m, "default": dflt["variant"], "default_ms": dflt["predicted_ms"],
                    "fastest": best["variant"], "fastest_ms": best["predicted_ms"],
                    "default_over_fastest": dflt["predicted_ms"] / best["predicted_ms"]})  # fmt: skip
    return out


# ----------------------------------------------------------------------------- output
def table(report: dict[str, Any]) -> str:
    """One row per (shape, op, M, variant); * marks the default rule's variant; times in microseconds."""
    lines = ["shape   op          M     variant   launches                      regs  SASS/it   issue  tensor"
             "   floor  other predicted  x bf16  bound"]  # fmt: skip
    for r in report["cases"]:
        mark = "*" if r["default"] else " "
        head = f"{r['shape']:7s} {r['op']:11s} {r['M']:<5d} {mark}{r['variant']:8s}"
        if r["predicted_ms"] is None:
            lines.append(f"{head} cannot: {r['cannot']}")
            continue
        main = max(r["launches"], key=lambda x: x["predicted_ms"]) if r["launches"] else None
        names = "+".join(x["kernel"].strip("_").replace("_kernel", "") for x in r["launches"]) or "-"
        regs = f"{main['registers']:4d}" if main else "   -"
        per = f"{main['sass_per_iter']:7d}" if main and main["sass_per_iter"] else "      -"
        us = [sum(x[key] for x in r["launches"]) * 1e3 for key in ("issue_ms", "tensor_ms", "floor_ms")]
        other = (sum(p["ms"] for p in r["torch_passes"]) + r["gaps_ms"]) * 1e3
        vs = f"{r['vs_bf16']:6.2f}x" if r["vs_bf16"] else "      -"
        lines.append(f"{head} {names[:29]:29s} {regs} {per} {us[0]:7.1f} {us[1]:7.1f} {us[2]:7.1f} {other:6.1f} "
                     f"{r['predicted_ms'] * 1e3:9.1f} {vs}  {r['dominant']}")  # fmt: skip
    slower = [c for c in report.get("rule_check", []) if c["default"] != c["fastest"]]
    if slower:
        lines.append("\ndefault rule vs the fastest predicted variant (both lower bounds or measured-based, untimed):")
    for c in slower:
        lines.append(f"  {c['shape']:7s} {c['op']:11s} M={c['M']:<5d} default {c['default']} "
                     f"{c['default_ms'] * 1e3:.1f} us, {c['fastest']} {c['fastest_ms'] * 1e3:.1f} us "
                     f"({c['default_over_fastest']:.2f}x)")  # fmt: skip
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """CLI (module docstring)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ops", nargs="*", default=list(OPS), choices=list(OPS))
    ap.add_argument("--ms", nargs="*", type=int, default=list(MS))
    ap.add_argument("--shapes", nargs="*", default=["8192", "gate_up"], help="8192 (N = K = 8192), gate_up")
    ap.add_argument("--variants", nargs="*", default=None, help="only these (default: every one)")
    ap.add_argument("--out", type=Path, default=None, help="write the report as JSON here")
    args = ap.parse_args(argv)
    return run_report("gemm_predict", lambda: predict(args.ops, args.ms, args.shapes, args.variants), table, args.out)


if __name__ == "__main__":
    sys.exit(main())
