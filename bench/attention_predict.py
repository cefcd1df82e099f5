"""Predicted H200 times of paged decode over every KV-cache format, and of tree verification against the causal
extend, from the sm_90 SASS of the kernels the default launch configs choose (compile-only: no GPU, nothing timed).

    python bench/attention_predict.py                      # every format + tree/extend, a table on stdout
    python bench/attention_predict.py --formats int8 fp8 --no-tree --out /tmp/p.json
    python bench/attention_predict.py --no-tree --sweep      # also gpu_kvquant's sweep (batch x context)
    python bench/attention_predict.py --formats int4 int4-kivi --no-tree --heads 32 1 --batch 64   # other GQA groups

Decode (issue 21's shape: batch 16, context 32k, 32 q / 8 kv heads, head_dim 128, blocks of 32, bf16 queries;
`gpu_kvquant`'s caches, through `lowering_report`'s cases): each launch compiles for sm_90 under
`codesign.autotune.compile_only`; the attention kernel's main loop (its largest SASS loop, one KV tile per
iteration: Triton's software pipeline does not unroll) is counted along its longest path (inner loops times their
trip count: Oaken's key loop the fullest token's slot count, each value loop the fullest channel's, over the
bench's cache, `oaken_trips`; the outlier index those loops read is the cache's, kept per written block by the
writer: its cost is reported apart, not predicted), and

    issue_ms = ceil(ceil(programs / 132) * warps / 4) * (tiles * loop + the rest once) / clock
    sched_ms = waves * tiles * sim(loop, warps a scheduler) / clock (+ the rest once, at least issue_ms)
    floor_ms = format's byte floor (`gpu_kvquant.floor_bytes`) / the bf16 cache's achieved bandwidth
    predicted_ms = max(floor_ms, sched_ms) + MERGE_MS            (split-KV merge: its own launch)

with `issue_ms` one warp instruction per scheduler per cycle, 4 schedulers per SM, the busiest SM's programs (grid
over 132 SMs), and `sim` the warp-scheduler simulation of one loop iteration (`bench/sass_sched.py`: the warps of
the programs an SM holds at once, each in order behind its scoreboard, with published latencies and pipe rates;
programs past the resident count run in later waves); the bandwidth calibrated so the bf16 cache predicts its
measured 0.517 ms (`BF16_MS`). `issue_ms` alone was 2.4-4.6x below the measured times of the INT8 / INT4 / INT2 /
mixed decode kernels timed on 2026-11-30; with the simulation those timings and the FP8 and bf16 ones are predicted
within 0.69-2.04x, median 1.04 (the old KIVI and Oaken kernels' 3-30x lie outside the loop's count):
`bench/hindcast.py`, reproduced by `tests/bench/test_hindcast.py`.
Not modelled: shared-memory bank conflicts, memory-system queueing past the DRAM latency (the floor bounds
bandwidth apart), the tensor-core rate beyond its pipe occupancy (docs/kernels.md).

Tree (64 nodes over a 4k prefix, batch 16, `gpu_attention`'s extend case, blocks of 16): the scheduler simulation
of the tree launch's tile loops (its prefix loop and its masked loop) and of the causal extend's, waves x tiles x
simulated cycles each (the issue count beside it); predicted tree = the measured extend (0.293 ms) x the simulated
tree / extend ratio (neither memory-bound). On the kernels timed on 2026-11-30 the ratio came out 3.51x against the
measured 3.32x (the issue count: 2.89x; `bench/hindcast.py`).

`--sweep` also predicts every format at the GPU suite's sweep points (`gpu_kvquant.SWEEP_BATCH` x `SWEEP_CONTEXT`,
each at that shape's split count and tiles, the bandwidth above), each row with its share of its byte floor's speed
(`floor_pct`): issue 21's "every format at >= 70 % of its byte floor at batch >= 16, context >= 8k", predicted.

The SASS model (listing parser, loop paths, census, occupancy, issue cycles) is `bench/sass_model.py`, shared with
`bench/gemm_predict.py`. Also per launch: registers, spills, the loop's load widths (LDG / LDGSTS by width),
shared-memory traffic, conversion instructions (I2F, F2F, F2I; packed F2FP separately) and tensor-core
instructions. JSON with --out.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

BENCH_DIR = Path(__file__).resolve().parent
if str(BENCH_DIR) not in sys.path:
    sys.path.insert(0, str(BENCH_DIR))
from sass_model import (  # noqa: E402  (the SASS model, shared with gemm_predict.py)
    CLOCK_HZ,
    SMS,
    issue_cycles,
    loop_path,
    loop_report,
    loops,
    opcode,
    outer_loops,
    parse_sass,
    run_report,
    shortest_path,
    tile_loop,
    tile_loops,
)
from sass_model import resident_programs as resident_programs  # noqa: E402, F401  (re-exported)
from sass_sched import LATENCY, iteration, simulate  # noqa: E402  (the warp-scheduler simulation of a loop)

BF16_MS = 0.517  # bf16 cache at the decode shape, H200 run 2 (bench/results/h200-2026-11-30-run2.json: 0.518, 0.517)
EXTEND_MS, TREE_MS = 0.293, 0.973  # run 2: extend 16 x 64 over 4k, tree 64 nodes (the old one-phase kernel)
# The split-KV merge: a second launch (~1-2 us apart in a CUDA graph) reading 0.8 MB of fp32 partials.
MERGE_MS = 0.003
ATTN_KERNEL = "_paged_attn_kernel"
BIAS_KERNEL, CORR_KERNEL = "_key_bias_kernel", "_value_corr_kernel"  # Oaken decode in three launches (`oaken_split`)
# A launch more in a CUDA graph: its start after the one before drains (as MERGE_MS, without its bytes)
LAUNCH_GAP_MS = 0.002


def _attn(launches: list, compiled: list) -> tuple[Any, Any, int]:
    """The attention launch of one case, its compiled kernel, and how many launches the case made."""
    i = next(k for k, launch in enumerate(launches) if launch.kernel == ATTN_KERNEL)
    return launches[i], compiled[i], len(launches)


def _resources(launch: Any) -> dict[str, Any]:
    cx = launch.constexprs
    return {"grid": launch.grid, "num_warps": launch.num_warps, "num_stages": launch.num_stages,
            "registers": launch.registers, "spill_stores": launch.spill_stores, "spill_loads": launch.spill_loads,
            "shared_bytes": launch.shared_bytes, "BLOCK_N": cx.get("BLOCK_N"), "NUM_SPLITS": cx.get("NUM_SPLITS"),
            "WORDS": cx.get("WORDS"), "cvt_i2f_ptx": launch.ptx_ops.get("cvt_i2f")}  # fmt: skip


def oaken_trips(walks: dict[str, tuple[int, int, int]] | None = None) -> dict[str, Any]:
    """Oaken's inner-loop trips for the bench's cache (`gpu_kvquant.oaken_slots` at the decode shape): the fullest
    token's slot count (the key loop's bound) and the fullest channel's (each value loop's), over the whole
    cache, from the kernel's own index (`oaken.outlier_index`); with their means over (block, head) beside.

    The index is kept by the cache, rebuilt per written block by the writer (not by the launch): a decode step's
    cost is its written blocks' (one a sequence, K and V: `index_step_bytes`, at least their slots read and their
    index rows written), not the pool's (`index_pool_bytes`: paid only when the whole index is rebuilt, after a
    change made outside the cache). Neither is in the prediction (the kernel's). With `walks` (side: (blocks a step,
    ranks taken straight, ranks a trip): `oaken_split`'s walks): the mean trips of each side's remainder loop, to
    the fullest list of the step's blocks past the straight ranks (`{side}_walk_trips`)."""
    import gpu_kvquant as kvq

    from codesign.kernels.kvcache.oaken import index_width, outlier_index

    shape = (kvq.BATCH * kvq.CONTEXT // kvq.BLOCK_SIZE, kvq.HKV, kvq._oaken_capacity())
    out: dict[str, Any] = {"capacity": shape[2]}
    row = shape[1] * (shape[2] + index_width(shape[2], kvq.BLOCK_SIZE, kvq.DIM)) * 4  # a block's, one side
    out["index_per"] = "written block"
    out["index_step_bytes"] = 2 * kvq.BATCH * row
    out["index_pool_bytes"] = 2 * shape[0] * row
    for side, by, seed, n in (("key", "token", 0, kvq.BLOCK_SIZE), ("value", "channel", 1, kvq.DIM)):
        ix = outlier_index(kvq.oaken_slots(shape, "cpu", seed), kvq.BLOCK_SIZE, kvq.DIM, by)
        rank = ix[..., shape[2] + n + 1]  # each list's fullest (`outlier_index`)
        out[f"{side}_max"], out[f"{side}_mean"] = int(rank.max()), float(rank.float().mean())
        if walks:
            nblk, first, per = walks[side]
            step = rank[: rank.shape[0] // nblk * nblk].view(-1, nblk, rank.shape[1]).amax(1)  # a step's fullest
            out[f"{side}_walk_trips"] = float((-(-(step - first).clamp(min=0) // per)).float().mean())
    return out


def oaken_loop_trips(
    sass: str, nbt: int, key: int, value: int, per_trip: int = 1, key_per_trip: int | None = None,
    ahead: bool = False,
) -> dict[str, Any]:
    """Trips of each inner loop of Oaken's tile loop (address order) for `key` ranks per tile and `value` ranks per
    block. The loops fall into 1 + `nbt` groups (the key loop, then one value loop per block of the tile), each a
    loop LLVM may unroll U times, with its remainder loop right after when it keeps one (a loop whose global loads
    are a 1/U of the one before). The unrolled loop runs ranks // U times, the remainder ranks % U (an upper bound:
    straight-line remainder code is counted on the path as well); U of a value group without a remainder loop is
    the other value groups' (the same code). `per_trip`: ranks the kernel's value loop body takes a trip
    (`triton_attention.OAKEN_RANKS`), `key_per_trip` its key loop's (`OAKEN_KEY_RANKS`; default `per_trip`).
    `ahead`: the kernel takes each list's first trip of ranks outside its loops (`oaken_key_first`,
    `oaken_value_first`), so the loops run only for the ranks past them."""
    ins, labels = parse_sass(sass)
    a, b = tile_loop(ins, labels)
    inner = [lp for lp in loops(ins, labels) if a < lp[0] and lp[1] <= b]

    def ldg(lp: tuple[int, int]) -> int:
        return sum(opcode(t).startswith("LDG") for t in ins[lp[0] : lp[1]])

    groups: list[list[int]] = []  # per group: the loads of its loop, then of its remainder loop if any
    for lp in inner:
        n, g = ldg(lp), groups[-1] if groups else None
        if g is not None and len(g) == 1 and 0 < n < g[0] and g[0] % n == 0:
            g.append(n)
        else:
            groups.append([n])
    if len(groups) != nbt + 1:
        raise ValueError(f"expected a key loop and {nbt} value loops, got {len(groups)} groups of {len(inner)} loops")
    v_unroll = max([g[0] // g[1] for g in groups[1:] if len(g) == 2], default=1)
    trips: list[int] = []
    unrolls = []
    for i, g in enumerate(groups):
        per = (per_trip if key_per_trip is None else key_per_trip) if i == 0 else per_trip
        ranks = -(-max((key if i == 0 else value) - (per if ahead else 0), 0) // per)  # the kernel's trips
        u = g[0] // g[1] if len(g) == 2 else (1 if i == 0 else v_unroll)
        unrolls.append(u)
        trips += [ranks // u, ranks % u] if len(g) == 2 else [ranks // u]
    return {"trips": trips, "key_unroll": unrolls[0], "value_unroll": v_unroll, "inner_loops": len(inner)}


def oaken_decode_trips(sass: str, constexprs: dict[str, Any], key: int, value: int) -> dict[str, Any]:
    """`oaken_loop_trips` of an Oaken decode launch for `key` ranks a token and `value` a channel: its loops take
    `OAKEN_KEY_RANKS` / `OAKEN_RANKS` ranks a trip, the first trip loaded ahead of them (decode's `oaken_*_first`)."""
    from codesign.kernels.attention.triton_attention import OAKEN_KEY_RANKS, OAKEN_RANKS

    return oaken_loop_trips(sass, constexprs["OAKEN_NBT"], key, value, OAKEN_RANKS, OAKEN_KEY_RANKS, ahead=True)


def decode_prediction(
    launch: Any, kernel: Any, floor_bytes: float, bandwidth: float, context: int, trips: int | list[int] = 1
) -> dict:
    """One decode launch's prediction (module docstring): its loop (inner loops `trips` times, `loop_path`),
    occupancy, issue and byte-floor times."""
    from codesign.kernels.kvcache.formats import KV_FORMAT_KIVI

    cx = launch.constexprs
    bn, splits = cx["BLOCK_N"], cx["NUM_SPLITS"]
    tiles = math.ceil(math.ceil(context / splits) / bn)  # the kernel's split length, whole tiles
    ring = 0
    programs = math.prod(launch.grid)
    # the scheduler simulation's warps: the programs an SM runs at once (the rest run in later waves)
    wps = issue_cycles(programs, launch.num_warps, launch.registers, launch.shared_bytes, 0)[
        "resident_warps_per_scheduler"]  # fmt: skip
    common = "path_max"  # the tile a program runs most: its longest path (a branch guards a masked tail)
    if cx.get("KV_FORMAT") == KV_FORMAT_KIVI:  # a code-only tile loop, then one over the ring (the last split's)
        g, r = cx["KIVI_G"], cx["KIVI_R"]
        ring = math.ceil(context / bn) - max(context - r, 0) // g * g // bn
        loop, ring_loop = loop_report(kernel.asm["sass"], which=0), loop_report(kernel.asm["sass"], which=1)
        sim, ring_sim = _sched(kernel.asm["sass"], 1, wps, which=0), _sched(kernel.asm["sass"], 1, wps, which=1)
        codes = tiles - ring
        if cx.get("VPLANES") and loop["path_min"] < loop["path_max"] and codes > 1:
            # The code-only loop's one branch is the lazy rescale (`triton_attention._RESCALE_TAU`): taken in a
            # program's first tile, then only when a row's max grows by 2^8 (for the bench's random scores, never)
            common = "path_min"
            fast = _sched(kernel.asm["sass"], 1, wps, which=0, shortest=True)
            per = (codes - 1) * loop["path_min"] + loop["path_max"]
            sched = (codes - 1) * fast["cycles"] + sim["cycles"]
            sim = fast
        else:
            per, sched = codes * loop["path_max"], codes * sim["cycles"]
        per += ring * ring_loop["path_max"] + loop["outside_loops"]
        sched += ring * ring_sim["cycles"]
    else:
        loop = loop_report(kernel.asm["sass"], trips)
        per = tiles * loop["path_max"] + loop["outside_loops"]
        sim = _sched(kernel.asm["sass"], trips, wps)
        sched = tiles * sim["cycles"]
    occ = issue_cycles(programs, launch.num_warps, launch.registers, launch.shared_bytes, per)
    issue_ms = occ["cycles"] / CLOCK_HZ * 1e3
    # the simulated tile loop, wave after wave, plus the code outside it at one instruction a cycle a warp
    sched_ms = (occ["waves"] * sched + occ["warps_per_scheduler"] * loop["outside_loops"]) / CLOCK_HZ * 1e3
    floor_ms = floor_bytes / bandwidth * 1e3
    merge = MERGE_MS if splits > 1 else 0.0
    per_byte = (
        loop[common] * launch.num_warps * programs * tiles / floor_bytes
    )  # warp instructions per byte
    sched_ms = max(sched_ms, issue_ms)
    return {**_resources(launch), "tiles_per_program": tiles, "ring_tiles": ring, "loop": loop, **occ,
            "sass_per_tile": loop[common], "warp_instr_per_kv_byte": per_byte,
            "sched": {k: sim[k] for k in ("cycles", "single_warp", "issue", "nearest_bound", "mio_by_op")},
            "sched_warps": wps,
            "issue_ms": issue_ms, "sched_ms": sched_ms, "floor_ms": floor_ms, "merge_ms": merge,
            "bound": "memory" if floor_ms >= sched_ms else sim["nearest_bound"],
            "predicted_ms": max(sched_ms, floor_ms) + merge}  # fmt: skip


def by_width_prediction(launches: list, compiled: list, kvq: Any, bandwidth: float, batch: int, context: int) -> dict:
    """A mixed decode width by width (`attention.mixed_by_width`): each width's per-token INT launch predicted at its
    share of the context and of the bytes (`gpu_kvquant.MIXED_BITS`, the bench cache's block widths in turn), the
    launches one after another, plus the one reduction and the tables launch (MERGE_MS each: launches of a few hundred
    small programs, as the split merge). Per-launch fields are the slowest launch's; `by_width` holds each."""
    parts: dict[str, dict[str, Any]] = {}
    for launch, kernel in zip(launches, compiled):
        if launch.kernel == ATTN_KERNEL:
            bits = launch.constexprs["BITS"]
            ctx = context * kvq.MIXED_BITS.count(bits) // len(kvq.MIXED_BITS)
            floor = kvq.floor_bytes(f"int{bits}", batch, ctx)
            parts[f"int{bits}"] = {**decode_prediction(launch, kernel, floor, bandwidth, ctx), "context": ctx}
    lead = max(parts.values(), key=lambda r: r["predicted_ms"])
    total = sum(r["predicted_ms"] - r["merge_ms"] for r in parts.values()) + 2 * MERGE_MS
    keep = ("BLOCK_N", "num_warps", "NUM_SPLITS", "context", "sass_per_tile", "floor_ms", "predicted_ms", "bound")
    return {**lead, "issue_ms": sum(r["issue_ms"] for r in parts.values()), "merge_ms": 2 * MERGE_MS,
            "floor_ms": kvq.floor_bytes("mixed-8/4/4/2", batch, context) / bandwidth * 1e3, "predicted_ms": total,
            "bound": "by width", "by_width": {k: {f: r[f] for f in keep} for k, r in parts.items()}}  # fmt: skip


def _case_prediction(name: str, session: Any, n0: int, kvq: Any, bandwidth: float, batch: int, context: int,
                     trips: int | list[int] = 1) -> dict:  # fmt: skip
    """The prediction of the decode case whose launches start at session.launches[n0]: one attention launch, or a
    mixed cache's launches width by width."""
    launches, compiled = session.launches[n0:], session.compiled[n0:]
    if sum(launch.kernel == ATTN_KERNEL for launch in launches) > 1:
        return by_width_prediction(launches, compiled, kvq, bandwidth, batch, context)
    if any(launch.kernel == BIAS_KERNEL for launch in launches):
        return split_prediction(launches, compiled, kvq, bandwidth, batch, context)
    launch, kernel, _ = _attn(launches, compiled)
    return decode_prediction(launch, kernel, kvq.floor_bytes(_floor_name(name), batch, context), bandwidth, context,
                             trips)  # fmt: skip


def _floor_name(name: str) -> str:
    """The format whose byte floor a case has (a variant's, e.g. Oaken in three launches: the format's)."""
    return name.removesuffix("-split")


def walk_prediction(launch: Any, kernel: Any, steps: int, trips: float, floor_bytes: float,
                    bandwidth: float) -> dict[str, Any]:  # fmt: skip
    """A launch without matrix instructions (`oaken_split`'s walks of the outlier index): its largest outermost loop
    (one block of keys a step, `steps` a program) through the scheduler simulation with its inner loops (the ranks)
    `trips` times (a mean: interpolated between the whole trips around it), the programs an SM holds at once, wave
    after wave, plus the code outside it once; against its own bytes' floor."""
    sass = kernel.asm["sass"]
    ins, labels = parse_sass(sass)
    outer, _ = outer_loops(ins, labels)
    a, b = max(outer, key=lambda lp: lp[1] - lp[0])
    lo_t, hi_t = math.floor(trips), math.ceil(trips)
    w = trips - lo_t
    programs = math.prod(launch.grid)
    rest = len(ins) - sum(e - s for s, e in outer)
    path = [loop_path(ins, labels, a, b, t)[1] for t in (lo_t, hi_t)]
    per_step = (1 - w) * path[0] + w * path[1]
    occ = issue_cycles(programs, launch.num_warps, launch.registers, launch.shared_bytes, steps * per_step + rest)
    warps = occ["resident_warps_per_scheduler"]
    sims = [simulate(iteration(ins, labels, a, b, t), warps) for t in (lo_t, hi_t)]
    cycles = (1 - w) * sims[0]["cycles"] + w * sims[1]["cycles"]
    issue_ms = occ["cycles"] / CLOCK_HZ * 1e3
    sched_ms = max((occ["waves"] * steps * cycles + occ["warps_per_scheduler"] * rest) / CLOCK_HZ * 1e3, issue_ms)
    floor_ms = floor_bytes / bandwidth * 1e3
    return {**_resources(launch), "steps_per_program": steps, "inner_trips": trips, "sass_per_step": per_step,
            "sched": {k: sims[1][k] for k in ("cycles", "single_warp", "issue", "nearest_bound")}, **occ,
            "sched_warps": warps, "issue_ms": issue_ms, "sched_ms": sched_ms, "floor_ms": floor_ms,
            "bound": "memory" if floor_ms >= sched_ms else sims[1]["nearest_bound"],
            "predicted_ms": max(sched_ms, floor_ms)}  # fmt: skip


def split_prediction(launches: list, compiled: list, kvq: Any, bandwidth: float, batch: int, context: int) -> dict:
    """An Oaken decode in three launches (`attention.oaken_split`): the key-bias walk, the per-token INT launch
    (`decode_prediction`, its floor the INT4 cache's plus the biases it reads and the probabilities and maxima it
    keeps) and the value-correction walk (`walk_prediction`, their remainder loops at the bench cache's mean trips,
    `oaken_trips`), one after the other, plus a gap a launch more (the merge is the INT launch's). The row is the
    INT launch's, with the three apart and the whole time in `predicted_ms`."""
    from codesign.kernels.attention.oaken_split import BIAS_FIRST, BIAS_RANKS, CORR_FIRST, CORR_RANKS

    by = {launch.kernel: (launch, kernel) for launch, kernel in zip(launches, compiled, strict=True)}
    (bias, kb), (attn, ka), (corr, kc) = by[BIAS_KERNEL], by[ATTN_KERNEL], by[CORR_KERNEL]
    nblk_k, nblk_v = bias.constexprs["NBLK"], corr.constexprs["NBLK"]
    ot = oaken_trips({"key": (nblk_k, BIAS_FIRST, BIAS_RANKS), "value": (nblk_v, CORR_FIRST, CORR_RANKS)})
    bs, d, hq, hkv = kvq.BLOCK_SIZE, kvq.DIM, kvq.HQ, kvq.HKV
    blocks = batch * hkv * math.ceil(context / bs)
    tokens = batch * math.ceil(context / bs) * bs
    bias_bytes = tokens * hq * 4  # fp32 biases, written by the walk, read by the INT launch
    probs_bytes = tokens * hq * 2  # fp16 probabilities, kept by the INT launch, gathered by the walk
    maxima_bytes = tokens // attn.constexprs["BLOCK_N"] * hq * 4
    words = ot["capacity"] * 4  # a full block's slot words (the bench's cache: every slot used)
    main = decode_prediction(attn, ka, kvq.floor_bytes("int4", batch, context) + bias_bytes + probs_bytes
                             + maxima_bytes, bandwidth, context)  # fmt: skip
    walk_k = walk_prediction(bias, kb, math.ceil(_bias_chunk(bias, blocks) / nblk_k), ot["key_walk_trips"],
                             blocks * (words + (bs + 2) * 4) + bias_bytes, bandwidth)  # fmt: skip
    splits, walks = corr.constexprs["NUM_SPLITS"], corr.constexprs["WALKS"]
    steps = math.ceil(math.ceil(math.ceil(context / splits) / bs / walks) / nblk_v)
    walk_v = walk_prediction(corr, kc, steps, ot["value_walk_trips"],
                             blocks * (words + (d + 2) * 4) + probs_bytes + maxima_bytes, bandwidth)  # fmt: skip
    total = walk_k["predicted_ms"] + main["predicted_ms"] + walk_v["predicted_ms"] + 2 * LAUNCH_GAP_MS
    return {**main, "launches": {"key_bias": walk_k, "int": dict(main), "value_corr": walk_v},
            "oaken_split_trips": ot, "floor_ms": kvq.floor_bytes("int4-oaken", batch, context) / bandwidth * 1e3,
            "predicted_ms": total}  # fmt: skip


def _bias_chunk(launch: Any, blocks: int) -> int:
    """Blocks a program of the key-bias walk: its grid's third axis over the blocks of a (sequence, kv head)."""
    seq_heads = launch.grid[0] * launch.grid[1]
    return math.ceil(blocks / seq_heads / launch.grid[2])


def _sched(sass: str, trips: int | list[int], warps: int, which: int = -1, shortest: bool = False) -> dict[str, Any]:
    """`sass_sched.simulate` on the tile loop (`tile_loop`, as `loop_report` picks it) with `warps` warps a
    scheduler: both sides of every branch, or with `shortest` its shortest path only (`sass_model.shortest_path`)."""
    ins, labels = parse_sass(sass)
    a, b = tile_loop(ins, labels, which)
    seq = [ins[i] for i in shortest_path(ins, labels, a, b)] if shortest else iteration(ins, labels, a, b, trips)
    return simulate(seq, warps)


def tree_prediction(ext: tuple[Any, Any], tree: tuple[Any, Any], batch: int, q_len: int, prefix: int) -> dict:
    """Tree verification against the causal extend (module docstring): both launches' tile loops through the
    scheduler simulation (`sim_cycles`: waves x the busiest program's tiles x each loop's simulated cycles, plus the
    code outside them) and their issue cycles; the tree's predicted time is the measured extend's scaled by the
    simulated ratio (by the issue ratio too, reported). A tree kernel with one tile loop (the old one-phase kernel)
    walks every tile in it."""
    rows = {}
    for name, (launch, kernel) in (("extend", ext), ("tree", tree)):
        cx = launch.constexprs
        bq, bn = cx["BLOCK_Q"], cx["BLOCK_N"]
        live = launch.grid[0] - batch  # one program per sequence past its q-blocks exits at once
        sass = kernel.asm["sass"]
        two_phase = len(tile_loops(*parse_sass(sass))) >= 2
        if name == "extend":  # q-block i sees the prefix and its tokens up to its last one
            loop = loop_report(sass)
            tiles = [
                math.ceil((prefix + min((i + 1) * bq, q_len)) / bn) for i in range(math.ceil(q_len / bq))
            ]
            per = sum(tiles) / len(tiles) * loop["path_max"] + loop["outside_loops"]
            loops_ = {"loop": loop, "tiles_per_program": sum(tiles) / len(tiles)}
            segments, outside = [(-1, max(tiles))], loop["outside_loops"]
        elif two_phase:  # the unmasked prefix tiles, then the rest (the tree and a partial prefix tile) under the mask
            pre, masked = loop_report(sass, which=0), loop_report(sass, which=1)
            t0 = prefix // bn
            t1 = math.ceil((prefix + q_len - t0 * bn) / bn)
            per = t0 * pre["path_max"] + t1 * masked["path_max"] + pre["outside_loops"]
            loops_ = {"prefix_loop": pre, "masked_loop": masked, "tiles_per_program": [t0, t1]}
            segments, outside = [(0, t0), (1, t1)], pre["outside_loops"]
        else:  # one loop, every tile masked
            loop = loop_report(sass)
            t = math.ceil((prefix + q_len) / bn)
            per = t * loop["path_max"] + loop["outside_loops"]
            loops_ = {"loop": loop, "tiles_per_program": t}
            segments, outside = [(-1, t)], loop["outside_loops"]
        occ = issue_cycles(live * launch.grid[1] * launch.grid[2], launch.num_warps, launch.registers,
                           launch.shared_bytes, per)  # fmt: skip
        wps = occ["resident_warps_per_scheduler"]
        sims = [(tiles, _sched(sass, 1, wps, which)["cycles"]) for which, tiles in segments]
        sim_cycles = occ["waves"] * sum(t * c for t, c in sims) + occ["warps_per_scheduler"] * outside
        rows[name] = {**_resources(launch), **loops_, **occ, "issue_ms": occ["cycles"] / CLOCK_HZ * 1e3,
                      "sched_cycles_per_tile": [c for _, c in sims], "sim_cycles": sim_cycles,
                      "sched_ms": max(sim_cycles, occ["cycles"]) / CLOCK_HZ * 1e3}  # fmt: skip
    ratio = rows["tree"]["cycles"] / rows["extend"]["cycles"]
    sim = rows["tree"]["sched_ms"] / rows["extend"]["sched_ms"]
    return {**rows, "tree_over_extend_issue": ratio, "tree_over_extend": sim, "extend_measured_ms": EXTEND_MS,
            "tree_last_measured_ms": TREE_MS, "tree_predicted_ms": EXTEND_MS * sim,
            "tree_predicted_ms_issue": EXTEND_MS * ratio}  # fmt: skip


# ----------------------------------------------------------------------------- the cases
def _decode_cases(formats: list[str] | None) -> list[tuple[str, Any]]:
    """(format, call): the bf16 cache and every quantized format at gpu_kvquant's shape, bf16 queries."""
    sys.path.insert(0, str(BENCH_DIR))
    import gpu_kvquant as kvq
    import lowering_report as lr
    import torch

    from codesign.kernels.attention.paged import paged_decode_attention

    def bf16() -> None:
        bt, cl = lr._tables(kvq.BATCH, kvq.CONTEXT, kvq.BLOCK_SIZE)
        k = torch.zeros(2, kvq.BLOCK_SIZE, kvq.HKV, kvq.DIM, dtype=torch.bfloat16)
        q = torch.zeros(kvq.BATCH, kvq.HQ, kvq.DIM, dtype=torch.bfloat16)
        paged_decode_attention(q, k, k.clone(), bt, cl, check_data=False)

    cases = [("bf16", bf16)]
    for _, label, call in lr._kvquant_cases(lr._suite_modules()):
        name = label.split()[1]
        decode = label.startswith("decode ") and label.endswith("bfloat16")
        if decode and _floor_name(name) in kvq.SWEEP_FORMATS:
            cases.append(
                (name, call)
            )  # (not the offline Oaken variant: no byte floor there, not timed either)
    return [c for c in cases if formats is None or c[0] in formats]


def _tree_cases() -> tuple[tuple[int, int, int], Any, Any]:
    """gpu_attention's first extend case (batch 16, 64 tokens, 4k prefix) and its tree, bf16."""
    import lowering_report as lr

    mods = lr._suite_modules()
    case = mods["att"].EXTEND_CASES[0]
    want = (
        f"batch={case[0]} q_len={case[1]} prefix={case[2]} ",
        f"batch={case[0]} nodes={case[1]} prefix={case[2]} ",
    )
    calls = {
        label.split()[0]: call
        for _, label, call in lr._attention_cases(mods)
        if any(w in label for w in want)
    }
    return case, calls["extend"], calls["tree"]


@contextlib.contextmanager
def _at_shape(kvq: Any, batch: int, context: int) -> Iterator[None]:
    """gpu_kvquant's decode shape set to (batch, context) for the cases built inside (they read it when called)."""
    saved = kvq.BATCH, kvq.CONTEXT
    kvq.BATCH, kvq.CONTEXT = batch, context
    try:
        yield
    finally:
        kvq.BATCH, kvq.CONTEXT = saved


def _sweep_row(row: dict[str, Any]) -> dict[str, Any]:
    keep = ("BLOCK_N", "num_warps", "NUM_SPLITS", "registers", "spill_stores", "sass_per_tile", "tiles_per_program",
            "programs_per_sm", "warps_per_scheduler", "issue_ms", "floor_ms", "predicted_ms", "bound")
    return {k: row[k] for k in keep} | {"floor_pct": 100 * row["floor_ms"] / row["predicted_ms"]}


def _sweep(session: Any, kvq: Any, formats: list[str] | None, bandwidth: float, oaken: int | list[int], log) -> dict:
    """Every format at each of gpu_kvquant's sweep points (`--sweep`), compiled in `session`; Oaken's loops at
    the bench cache's fullest lists (`oaken`, from the issue shape's row)."""
    report: dict[str, Any] = {}
    for batch in kvq.SWEEP_BATCH:
        for context in kvq.SWEEP_CONTEXT:
            point = report[f"batch={batch} context={context}"] = {}
            with _at_shape(kvq, batch, context):
                for name, call in _decode_cases(formats):
                    n0 = len(session.launches)
                    call()
                    trips = oaken if name == "int4-oaken" else 1
                    point[name] = _sweep_row(_case_prediction(name, session, n0, kvq, bandwidth, batch, context,
                                                              trips))  # fmt: skip
            base = point.get("bf16", {}).get("predicted_ms")
            for row in point.values():
                row["vs_bf16"] = base / row["predicted_ms"] if base else None
            log(f"  swept batch={batch} context={context}")
    return report


def predict(formats: list[str] | None = None, tree: bool = True, log=print, sweep: bool = False) -> dict[str, Any]:
    """Compile every case for sm_90 (compile-only) and predict its time; the report (module docstring)."""
    import torch

    from codesign.autotune.compile_only import compile_only
    from codesign.backend import use_backend
    from codesign.kernels.attention.triton_attention import OAKEN_KEY_RANKS, OAKEN_RANKS

    sys.path.insert(0, str(BENCH_DIR))
    import gpu_kvquant as kvq

    warnings.filterwarnings("ignore", message="no tuned config for")
    warnings.filterwarnings("ignore", message="TRITON_DEFAULT_FP_FUSION")
    bandwidth = kvq.floor_bytes("bf16", kvq.BATCH, kvq.CONTEXT) / ((BF16_MS - MERGE_MS) * 1e-3)
    out: dict[str, Any] = {"gpu": "NVIDIA H200 (compile-only sm_90; nothing timed)", "sms": SMS,
                           "clock_hz": CLOCK_HZ, "bf16_measured_ms": BF16_MS, "merge_ms": MERGE_MS,
                           "bandwidth_Bps": bandwidth, "decode": {}}  # fmt: skip
    with compile_only(90, "NVIDIA H200") as session, use_backend("triton"), torch.no_grad():
        for name, call in _decode_cases(formats):
            n0 = len(session.launches)
            call()
            launch, kernel, _ = _attn(session.launches[n0:], session.compiled[n0:])
            floor = kvq.floor_bytes(_floor_name(name), kvq.BATCH, kvq.CONTEXT)
            trips: int | list[int] = 1
            cx = launch.constexprs
            if cx.get("OAKEN_CAP", 0) > 0:  # the key loop, then each block's value loop
                ot = oaken_trips()
                mean = oaken_decode_trips(kernel.asm["sass"], cx, round(ot["key_mean"]), round(ot["value_mean"]))
                ot.update(oaken_decode_trips(kernel.asm["sass"], cx, ot["key_max"], ot["value_max"]))
                ot["ranks_per_trip"] = OAKEN_RANKS
                ot["key_ranks_per_trip"] = OAKEN_KEY_RANKS
                trips = ot["trips"]
                at_mean = decode_prediction(launch, kernel, floor, bandwidth, kvq.CONTEXT, mean["trips"])
                ot["at_mean_trips"] = {k: at_mean[k] for k in ("sass_per_tile", "issue_ms", "predicted_ms")}
                # The writer's per step, and a whole rebuild's (after a change outside the cache): not predicted.
                ot["index_step_floor_ms"] = ot["index_step_bytes"] / bandwidth * 1e3
                ot["index_pool_floor_ms"] = ot["index_pool_bytes"] / bandwidth * 1e3
                out["oaken_trips"] = ot
            row = _case_prediction(name, session, n0, kvq, bandwidth, kvq.BATCH, kvq.CONTEXT, trips)
            row["vs_bf16"] = None
            out["decode"][name] = row
            log(f"  compiled {name}: {row['sass_per_tile']} SASS per tile, {row['predicted_ms']:.3f} ms")
        if sweep:
            out["sweep"] = _sweep(session, kvq, formats, bandwidth, out.get("oaken_trips", {}).get("trips", 1), log)
        if tree:
            (batch, q_len, prefix), ext_call, tree_call = _tree_cases()
            pair = []
            for call in (ext_call, tree_call):
                n0 = len(session.launches)
                call()
                pair.append(_attn(session.launches[n0:], session.compiled[n0:])[:2])
            out["tree"] = {"batch": batch, "nodes": q_len, "prefix": prefix,
                           **tree_prediction(pair[0], pair[1], batch, q_len, prefix)}  # fmt: skip
    base = out["decode"].get("bf16", {}).get("predicted_ms", BF16_MS)
    for row in out["decode"].values():
        row["vs_bf16"] = base / row["predicted_ms"]
    return out


# ----------------------------------------------------------------------------- output
def _loads(loop: dict) -> str:
    both = {**loop["ldg"], **loop["ldgsts"]}
    return " ".join(f"{k.replace('.E', '').replace('.BYPASS', '')}x{v}" for k, v in both.items())


def table(report: dict[str, Any]) -> str:
    """The report as text: one row per decode format, then tree vs extend."""
    lines = ["format        tile    warps regs spill SASS/tile  instr/B  cvt  LDS8/16 loads              "
             "issue_ms floor_ms predicted  vs bf16"]  # fmt: skip
    for name, r in report["decode"].items():
        lp = r["loop"]
        cvt = sum(lp["cvt"].values())
        lines.append(
            f"{name:13s} {r['BLOCK_N']:3d}x128 {r['num_warps']:5d} {r['registers']:4d} {r['spill_stores']:5d} "
            f"{r['sass_per_tile']:9d} {r['warp_instr_per_kv_byte']:8.3f} {cvt:4d} {lp['lds_u8_u16']:7d} "
            f"{_loads(lp):18s} {r['issue_ms']:8.3f} {r['floor_ms']:8.3f} {r['predicted_ms']:9.3f} "
            f"{r['vs_bf16']:7.2f}x"
        )
    for point, rows in report.get("sweep", {}).items():
        lines.append(f"sweep {point}: " + ", ".join(
            f"{name} {r['predicted_ms']:.3f} ms ({r['floor_pct']:.0f} % of floor, {r['NUM_SPLITS']} splits)"
            for name, r in rows.items()))  # fmt: skip
    t = report.get("tree")
    if t:
        for name in ("extend", "tree"):
            r = t[name]
            lines.append(f"{name}: BLOCK_N {r['BLOCK_N']} x {r['num_warps']} warps, {r['registers']} regs, "
                         f"spills {r['spill_stores']}, {r['resident']} resident/SM, tiles {r['tiles_per_program']}, "
                         f"issue {r['issue_ms']:.3f} ms")  # fmt: skip
        lines.append(f"tree / extend: {t['tree_over_extend']:.2f}x simulated ({t['tree_over_extend_issue']:.2f}x by "
                     f"issue cycles) -> tree predicted {t['tree_predicted_ms']:.3f} ms (extend measured "
                     f"{t['extend_measured_ms']} ms, tree last measured {t['tree_last_measured_ms']} ms)")  # fmt: skip
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """CLI (module docstring)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--formats", nargs="*", default=None, help="bf16 int8 int4 int2 fp8 int4-kivi ... (default all)"
    )
    ap.add_argument("--no-tree", action="store_true", help="skip tree verification vs extend")
    ap.add_argument("--sweep", action="store_true", help="also every format at gpu_kvquant's sweep points")
    ap.add_argument("--out", type=Path, default=None, help="write the report as JSON here")
    ap.add_argument("--heads", type=int, nargs=2, default=None, metavar=("Q", "KV"),
                    help="query and kv heads of the decode cases (default gpu_kvquant's 32 / 8; e.g. 32 1)")
    ap.add_argument("--batch", type=int, default=None, help="decode batch (default gpu_kvquant's 16)")
    ap.add_argument("--dram-latency", type=int, default=None,
                    help=f"what-if: cycles for every global load but the block-table ones (default "
                    f"{LATENCY['dram']}; e.g. 40: how much of a tile's time is load latency)")  # fmt: skip
    args = ap.parse_args(argv)
    if args.dram_latency is not None:
        LATENCY["dram"] = args.dram_latency
    if args.heads or args.batch:  # (this process's cases only: gpu_kvquant's shape, read when they are built)
        import gpu_kvquant as kvq

        kvq.HQ, kvq.HKV = args.heads or (kvq.HQ, kvq.HKV)
        kvq.BATCH = args.batch or kvq.BATCH
    return run_report("attention_predict", lambda: predict(args.formats, not args.no_tree, sweep=args.sweep), table,
                      args.out)  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
