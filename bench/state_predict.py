"""Predicted H200 times of the recurrent-state kernels of hybrid models (`kernels.layers.state_ops`) from their sm_90
SASS (compile-only: no GPU, nothing timed; every number is a prediction).

    python bench/state_predict.py [--tokens 2048 ...] [--out F]

Cases, the shapes of `lowering_report._state_cases` and `gpu_ops._state_cases` (bf16, fp32 states): Qwen3-Next's
Gated DeltaNet (16 key / 32 value heads of 128) at 16 sequences, one token and four (`triton_gated_delta`'s
recurrence), a tree step's 15 and 31 nodes (`triton_gated_delta_tree`: one launch, the state read once), and over
one prompt (`triton_gated_delta_chunk`: the prep launch, all chunks at once, the state walk over the chunks, then the
output launch, all chunks at once); Granite-4.0-H's Mamba-2 (128 heads of 64, state 128, one group), its one-token
update at 16 sequences (`triton_ssd_update`), a tree step's 15 and 31 nodes (`triton_ssd_tree`) and its scan over one
prompt (`triton_ssd_chunk`); Jamba's Mamba-1 (8192 channels, state 16), its one-token update at 16 sequences with the
gate (`triton_selective_update`) and its scan over one prompt with the views, gate and fp32 output transformers'
module passes (`triton_selective_scan`). `--tokens`: the prompt lengths
(default 2048; several: each prompt case at each). Each call compiles under `codesign.autotune.compile_only(90,
"NVIDIA H200")`; per Triton launch (its SASS through `sass_model` / `sass_sched`, the programs the busiest SM runs,
`ceil(programs / 132)`, its warps spread over its 4 schedulers):

    issue   = warps a scheduler * (trips * loop path + the rest once) / 1.98 GHz
    pipe:P  = warps a scheduler * the pipe cycles of those instructions (P: xu = MUFU and conversions at 16 an SM a
              clock, 8 cycles a warp instruction: the scans' exp2 / softplus / sigmoid; mio = shared memory, shuffles
              and L1 at 128 B an SM a clock; tensor = mma.sync / wgmma at sass_sched's rates; fp, int: 1 a cycle)
    latency = a walk (a loop carrying the state from token to token or chunk to chunk: decode's tokens, the chunk
              walks, the scans): waves * trips * sim(loop, the warps a scheduler runs together) + the rest at issue;
              otherwise (the one-token updates, the prep and output launches): waves * sim(the whole program
              once, its loops unrolled by their trips), `sass_sched.simulate` both ways
    floor   = the launch's bytes / 4.18 TB/s (the measured device-to-device copy, `gemm_predict.COPY_BPS`)
    launch  = max(issue, pipes, latency, floor);   case = its launches + LAUNCH_GAP_MS (1 us) between two

The case's floor is the op spec's `min_bytes()` (`codesign.specs` GatedDeltaRule, SSDScan, SelectiveScan) at the
copy rate, a tree's without the state's write (its kernel writes none); a launch's floor is the spec's plus what the
spec does not count (a case's `extra`): the chunked Gated DeltaNet's scratch (w and u, the states entering the
chunks) and the inputs each launch reads again (`gdn_chunk_extra`); Mamba-1's gate z, its fp32 A `[D, N]` and its
scan's fp32 output; less the state's write for a tree.
Trips: decode's T tokens (T = 1 compiles without a loop), a walk's ceil(T / chunk) (`C`, `BT`), the prep launch's
forward substitution SUB - 1 steps over LLVM's loop unrolled U times (the loops' MMA ratio), its U - 1 straight-line
steps counted once with the rest (`prep_trips`).

Modelled: issue, each pipe's throughput (MUFU / conversions, shared memory and shuffles, tensor cores), the
latency of the walks' serial chain (few warps a scheduler: one to three programs an SM at 148-250 registers) and of a
program's loads and reductions, bytes at the copy rate. The simulation has the resident warps contend for the pipes
too, so a pipe bound rarely exceeds the latency one: it says where a walk's time goes (the table's bound names the
simulation's nearest bound beside "latency"). Not modelled: shared-memory bank conflicts, L2 (hits or its
bandwidth: every byte at the DRAM copy rate, each read once), sector waste of the strided views (Mamba-1's dt and
gate load 16 of each 32-byte sector), memory-system queueing past the DRAM latency, the tensor cores below their
pipe rate, overlap of one wave's tail with the next wave's start, host time. Both sides of a branch are executed
(`sass_sched`). JSON with --out.
"""

from __future__ import annotations

import argparse
import math
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

BENCH_DIR = Path(__file__).resolve().parent
if str(BENCH_DIR) not in sys.path:
    sys.path.insert(0, str(BENCH_DIR))
from gemm_predict import COPY_BPS, LAUNCH_GAP_MS  # noqa: E402
from sass_model import (  # noqa: E402
    CLOCK_HZ,
    SMS,
    census,
    issue_cycles,
    opcode,
    outer_loops,
    parse_sass,
    program_report,
    run_report,
)
from sass_model import _self_branch as _self_branch  # noqa: E402  (the branch to itself after EXIT)
from sass_sched import PIPE_CYCLES, decode, iteration, simulate  # noqa: E402

BATCH = 16  # decode sequences
GDN = (16, 32, 128)  # Qwen3-Next: key heads, value heads, head dim (key and value)
MAMBA2 = (128, 64, 128)  # Granite-4.0-H: heads, head dim, state (one group)
MAMBA1 = (8192, 16)  # Jamba: channels, state
TREE_NODES = (15, 31)  # a tree step's nodes (binary trees of depth 3 and 4; GDN's 64 spills, its inverse unmodelled)
PROMPT = 2048  # tokens of the prompt cases (gpu_ops' `_prompt_case`, `_scan_case`, `_mamba1_cases`)
DTYPE_BYTES = 2  # bf16 activations
# kernels whose one loop carries the state from token to token or chunk to chunk (a serial chain)
WALKS = ("_gated_delta_kernel", "_state_kernel", "_ssd_scan_kernel", "_selective_scan_kernel", "_ssd_steps_kernel")


# ----------------------------------------------------------------------------- the cases
def _case(name: str, family: str, tokens: int, spec: Any, call: Callable[[], Any],
          extra: Callable[[str], float] | None = None, floor_bytes: float | None = None) -> dict[str, Any]:  # fmt: skip
    """A case: `tokens` the kernels' T (a sequence's new tokens), `extra(kernel)` the bytes a launch of `kernel`
    moves past the spec's `min_bytes()` (None: none), `floor_bytes` the case's floor where the op moves fewer bytes
    than its spec counts (a tree reads the state and writes none; None: the spec's)."""
    return {"name": name, "family": family, "tokens": tokens, "spec": spec, "call": call, "extra": extra,
            "floor_bytes": floor_bytes}  # fmt: skip


def _gdn_cases(prompts: tuple[int, ...]) -> list[dict[str, Any]]:
    import torch

    from codesign.kernels.layers import state_ops as S
    from codesign.kernels.layers import tree_state_ops as TS
    from codesign.specs import GatedDeltaRule

    hk, hv, d = GDN
    bf = dict(dtype=torch.bfloat16)
    out = []
    for t in (1, 4):
        q, v = torch.zeros(BATCH, t, hk, d, **bf), torch.zeros(BATCH, t, hv, d, **bf)
        g, h0 = torch.zeros(BATCH, t, hv), torch.zeros(BATCH, hv, d, d)
        spec = GatedDeltaRule(key_heads=hk, value_heads=hv, key_dim=d, value_dim=d, new_tokens=(t,) * BATCH,
                              dtype="bf16", state_dtype="fp32")  # fmt: skip
        out.append(_case(f"gated_delta_rule B={BATCH} T={t} heads={hk}/{hv} d={d}", "Gated DeltaNet decode", t,
                         spec, lambda q=q, v=v, g=g, h0=h0: S.gated_delta_rule(q, q, v, g, g.bfloat16(), h0,
                                                                               dispatch=False)))  # fmt: skip
    for n in TREE_NODES:
        q, v = torch.zeros(BATCH, n, hk, d, **bf), torch.zeros(BATCH, n, hv, d, **bf)
        g, h0 = torch.zeros(BATCH, n, hv), torch.zeros(BATCH, hv, d, d)
        parents = [-1] + [(i - 1) // 2 for i in range(1, n)]
        spec = GatedDeltaRule(key_heads=hk, value_heads=hv, key_dim=d, value_dim=d, new_tokens=(n,) * BATCH,
                              dtype="bf16", state_dtype="fp32")  # fmt: skip
        # (the tree kernel reads the state and writes none: the spec's write is not its)
        out.append(_case(f"gated_delta_tree B={BATCH} N={n} heads={hk}/{hv} d={d}", "Gated DeltaNet tree", n, spec,
                         lambda q=q, v=v, g=g, h0=h0, p=parents: TS.gated_delta_tree(q, q, v, g, g.bfloat16(), p, h0,
                                                                                    dispatch=False),
                         lambda kernel, s=spec: -s.state_bytes(), spec.min_bytes() - spec.state_bytes()))  # fmt: skip
    for t in prompts:
        q, v, g = torch.zeros(1, t, hk, d, **bf), torch.zeros(1, t, hv, d, **bf), torch.zeros(1, t, hv)
        spec = GatedDeltaRule(key_heads=hk, value_heads=hv, key_dim=d, value_dim=d, new_tokens=(t,),
                              initial_state=False, dtype="bf16", state_dtype="fp32")  # fmt: skip
        out.append(_case(f"gated_delta_rule (prompt) B=1 T={t} heads={hk}/{hv} d={d}", "Gated DeltaNet prompt", t,
                         spec, lambda q=q, v=v, g=g: S.gated_delta_rule(q, q, v, g, g.bfloat16(), dispatch=False),
                         lambda kernel, s=spec: gdn_chunk_extra(s, kernel)))  # fmt: skip
    return out


def gdn_chunk_extra(spec: Any, kernel: str) -> float:
    """Bytes a launch of the chunked Gated DeltaNet moves past the spec's `min_bytes()`, which counts q, k, v, g,
    beta and o once and the state: the prep launch reads k, v, g and beta and writes the fp32 scratch w and u
    (`[B, HV, T, DK]`, `[B, HV, T, DV]`); the state walk reads k, g, w and u, writes v' over u, the state entering
    each chunk (`[B, HV, chunks, DK, DV]`, bf16 here as the inputs) and the final state; the output launch reads q,
    k, g, v' and those states and writes o. Returned as a launch's whole bytes minus the spec's."""
    from codesign.kernels.layers.triton_gated_delta_chunk import CHUNK

    e = DTYPE_BYTES
    tok, hk, hv, dk, dv = spec.tokens, spec.key_heads, spec.value_heads, spec.key_dim, spec.value_dim
    w, u = tok * hv * dk * 4, tok * hv * dv * 4
    chunk_states = _cdiv(tok, CHUNK) * hv * dk * dv * e
    q_bytes = k_bytes = tok * hk * dk * e
    v_bytes, gate = tok * hv * dv * e, tok * hv * e
    state = (2 if spec.initial_state else 1) * spec.state_bytes()
    own = {"_prep_kernel": k_bytes + v_bytes + 2 * gate + w + u,
           "_state_kernel": k_bytes + gate + w + 2 * u + chunk_states + state,
           "_output_kernel": q_bytes + k_bytes + gate + u + chunk_states + v_bytes}[kernel]  # fmt: skip  (o: v's)
    return own - spec.min_bytes()


def _mamba2_cases(prompts: tuple[int, ...]) -> list[dict[str, Any]]:
    import torch

    from codesign.kernels.layers import state_ops as S
    from codesign.kernels.layers import tree_state_ops as TS
    from codesign.specs import SSDScan

    h, p, n = MAMBA2
    bf = dict(dtype=torch.bfloat16)
    st, x = torch.zeros(BATCH, h, p, n), torch.zeros(BATCH, h, p, **bf)
    bc, dt, a = torch.zeros(BATCH, 1, n, **bf), torch.zeros(BATCH, h, **bf), torch.zeros(h)
    spec = SSDScan(heads=h, head_dim=p, state=n, groups=1, new_tokens=(1,) * BATCH, dtype="bf16", state_dtype="fp32")
    out = [_case(f"ssd_update B={BATCH} heads={h} P={p} N={n}", "Mamba-2 decode", 1, spec,
                 lambda: S.ssd_update(st, x, dt, a, bc, bc, a, a, True, dispatch=False))]  # fmt: skip
    for nodes in TREE_NODES:
        xt, bct = torch.zeros(BATCH, nodes, h, p, **bf), torch.zeros(BATCH, nodes, 1, n, **bf)
        dtt, parents = torch.zeros(BATCH, nodes, h, **bf), [-1] + [(i - 1) // 2 for i in range(1, nodes)]
        tspec = SSDScan(heads=h, head_dim=p, state=n, groups=1, new_tokens=(nodes,) * BATCH, dtype="bf16",
                        state_dtype="fp32")  # fmt: skip
        # (the tree kernel reads the state and writes none: the spec's write is not its)
        out.append(_case(f"ssd_tree B={BATCH} N={nodes} heads={h} P={p} N={n}", "Mamba-2 tree", nodes, tspec,
                         lambda xt=xt, bct=bct, dtt=dtt, q=parents: TS.ssd_tree(xt, dtt, a, bct, bct, q, a, a, True, st,
                                                                               dispatch=False),
                         lambda kernel, s=tspec: -s.state_bytes(),
                         tspec.min_bytes() - tspec.state_bytes()))  # fmt: skip
    # a tree step's accepted path (4 tokens at depth 3) from each sequence's state: one scan (`state_trees`), below
    # SCAN_CHUNKED_FROM tokens the recurrence (`triton_ssd_steps`)
    xa, bca, dta = torch.zeros(BATCH, 4, h, p, **bf), torch.zeros(BATCH, 4, 1, n, **bf), torch.zeros(BATCH, 4, h)
    aspec = SSDScan(heads=h, head_dim=p, state=n, groups=1, new_tokens=(4,) * BATCH, dtype="bf16", state_dtype="fp32")
    out.append(_case(f"ssd_scan B={BATCH} T=4 heads={h} P={p} N={n} (a tree's accepted path)", "Mamba-2 decode", 4,
                     aspec, lambda: S.ssd_scan(xa, dta, a, bca, bca, initial_state=st, dispatch=False)))
    for t in prompts:
        xs, bcs = torch.zeros(1, t, h, p, **bf), torch.zeros(1, t, 1, n, **bf)
        dts = torch.zeros(1, t, h, **bf)
        spec = SSDScan(heads=h, head_dim=p, state=n, groups=1, new_tokens=(t,), initial_state=False, dtype="bf16",
                       state_dtype="fp32")  # fmt: skip
        out.append(_case(f"ssd_scan (prompt) B=1 T={t} heads={h} P={p} N={n}", "Mamba-2 prompt", t, spec,
                         lambda xs=xs, bcs=bcs, dts=dts: S.ssd_scan(xs, dts, a, bcs, bcs, a, a, True,
                                                                    dispatch=False)))  # fmt: skip
    return out


def _mamba1_cases(prompts: tuple[int, ...]) -> list[dict[str, Any]]:
    import torch

    from codesign.kernels.layers import state_ops as S
    from codesign.specs import SelectiveScan

    d, n = MAMBA1
    bf = dict(dtype=torch.bfloat16)
    st, x, a, bc = torch.zeros(BATCH, d, n), torch.zeros(BATCH, d, **bf), torch.zeros(d, n), torch.zeros(BATCH, n, **bf)
    spec = SelectiveScan(channels=d, state=n, new_tokens=(1,) * BATCH, dtype="bf16", state_dtype="fp32")
    out = [_case(f"selective_state_update B={BATCH} D={d} N={n}", "Mamba-1 decode", 1, spec,
                 lambda: S.selective_state_update(st, x, x, a, bc, bc, a[:, 0], a[:, 0], True, x, dispatch=False),
                 lambda kernel: BATCH * d * DTYPE_BYTES + d * n * 4)]  # fmt: skip  (the gate z, fp32 A)
    for t in prompts:
        # transformers' module's layout: x and dt contiguous `[Bt, D, T]`, the gate a `[D, T]` view of the input
        # projection (channels contiguous), B and C their norms' `[Bt, T, N]` outputs transposed; fp32 A, D, dt
        # bias; fp32 out
        proj = torch.zeros(1, t, 2 * d, **bf)
        gate, dts = proj[..., d:].transpose(1, 2), torch.zeros(1, d, t, **bf)
        bcs, xs = torch.zeros(1, t, n, **bf).transpose(1, 2), torch.zeros(1, d, t, **bf)
        spec = SelectiveScan(channels=d, state=n, new_tokens=(t,), initial_state=False, dtype="bf16",
                             state_dtype="fp32")  # fmt: skip
        call = lambda xs=xs, dts=dts, bcs=bcs, gate=gate: S.selective_scan(  # noqa: E731
            xs, dts, a, bcs, bcs, a[:, 0], a[:, 0], True, gate, None, torch.float32, dispatch=False)
        out.append(_case(f"selective_scan (prompt) B=1 D={d} T={t} N={n}", "Mamba-1 prompt", t, spec, call,
                         lambda kernel, t=t: 2 * d * t * DTYPE_BYTES + d * n * 4))  # fmt: skip  (z, y at fp32, A)
    return out


def cases(prompts: tuple[int, ...] = (PROMPT,)) -> list[dict[str, Any]]:
    """Every case (module docstring), the prompt ones at each of `prompts` tokens."""
    return _gdn_cases(prompts) + _mamba2_cases(prompts) + _mamba1_cases(prompts)


# ----------------------------------------------------------------------------- one launch
def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def loop_trips(kernel: str, cx: dict[str, Any], tokens: int, lps: list[dict[str, Any]]) -> list[int]:
    """Trips of each outermost SASS loop of one program (address order): decode's tokens, a walk's chunks, the prep
    launch's forward-substitution steps (module docstring); ValueError where the SASS has other loops than these."""
    if kernel in ("_gated_delta_kernel", "_ssd_steps_kernel"):
        want = [tokens] if tokens > 1 else []  # (T = 1 is a specialised constant: no loop)
    elif kernel in ("_state_kernel", "_ssd_scan_kernel"):
        want = [_cdiv(tokens, cx["C"])]
    elif kernel == "_selective_scan_kernel":
        want = [_cdiv(tokens, cx["BT"])]
    elif kernel in ("_ssd_update_kernel", "_selective_update_kernel", "_output_kernel", "_ssd_tree_kernel"):
        want = []
    elif kernel in ("_prep_kernel", "_tree_kernel"):  # (the tree's: the prep's inverse over its padded nodes)
        return prep_trips(lps, cx["SUB"], cx["C"])
    else:
        raise ValueError(f"no loop model for {kernel}")
    if len(lps) != len(want):
        raise ValueError(f"{kernel}: {len(lps)} outermost SASS loops, the model expects {len(want)}")
    return want


def prep_trips(lps: list[dict[str, Any]], sub: int, chunk: int) -> list[int]:
    """The prep launch's loops: the inverse's SUB - 1 steps within the diagonal blocks (one tl.dot each), kept as a
    loop (one), or unrolled U times by LLVM with a remainder loop after it (two, U their matrix instructions' ratio)
    and U - 1 steps in straight-line code around them (counted once with the rest of the program); the block rows'
    loop (C / SUB - 1 trips, two dots each) runs 1 trip at C = 32 and is no loop in the SASS."""
    steps = sub - 1
    if chunk // sub - 1 > 1:
        raise ValueError(f"_prep_kernel: no loop model for {chunk // sub - 1} block rows")
    if len(lps) == 1:
        return [steps]
    if len(lps) == 2 and lps[1]["hmma"] and lps[0]["hmma"] % lps[1]["hmma"] == 0:
        u = lps[0]["hmma"] // lps[1]["hmma"]
        rest = steps - (u - 1)
        return [rest // u, rest % u]
    raise ValueError(f"_prep_kernel: {len(lps)} outermost SASS loops, the model expects 1 or 2")


def _pipes(lines: list[str]) -> dict[str, int]:
    """A warp's cycles on each pipe for `lines` (`sass_sched.decode`'s pipe and rate)."""
    out: dict[str, int] = {}
    for t in lines:
        x = decode(t)
        if x.pipe != "none":
            out[x.pipe] = out.get(x.pipe, 0) + x.pipe_cycles
    return out


def _mix(lines: list[str]) -> dict[str, int]:
    """What an iteration (or a program) is made of, per warp: MUFU.EX2 and every XU instruction (MUFU and
    conversions), shuffles, barriers, shared-memory loads and stores, matrix instructions, spills."""
    ops = [opcode(t) for t in lines]
    c = census(lines)
    return {"instructions": len(lines), "mufu_ex2": sum(o.startswith("MUFU.EX2") for o in ops),
            "xu": sum(decode(t).pipe == "xu" for t in lines), "shfl": sum(o.startswith("SHFL") for o in ops),
            "bar": c["bar"], "lds": c["lds"], "sts": c["sts"], "mma": c["hmma"],
            "spill_ldl_stl": c["spill_ldl_stl"]}  # fmt: skip


def _program(ins: list[str], labels: dict[str, int], outer: list[tuple[int, int]],
             trips: list[int] | None) -> list[str]:  # fmt: skip
    """The instructions a program runs in address order: each outermost loop's iteration (`sass_sched.iteration`)
    its trips, the rest once (NOP padding and the branch to itself after EXIT left out, as `program_report` counts
    them); `trips` None: the rest only."""
    out: list[str] = []
    starts = {a: (b, k) for k, (a, b) in enumerate(outer)}
    i = 0
    while i < len(ins):
        if i in starts:
            b, k = starts[i]
            if trips is not None:
                out += iteration(ins, labels, i, b) * trips[k]
            i = b
            continue
        if opcode(ins[i]) != "NOP" and not _self_branch(ins, labels, i):
            out.append(ins[i])
        i += 1
    return out


def launch_prediction(launch: dict[str, Any], sass: str, trips: list[int], nbytes: float, walk: bool) -> dict:
    """One launch's bounds (module docstring) from its compiled facts (`launch`: kernel, grid, num_warps, registers,
    shared_bytes; spills reported), its SASS, the trips of its outermost loops (address order), its bytes, and
    whether its loop is a walk (a serial chain: latency per trip) or the program is simulated whole."""
    ins, labels = parse_sass(sass)
    outer, _ = outer_loops(ins, labels)
    if len(trips) != len(outer):
        raise ValueError(f"{launch['kernel']}: {len(outer)} outermost loops, {len(trips)} trips given")
    prog = program_report(sass)
    rest = _program(ins, labels, outer, None)
    bodies = [iteration(ins, labels, a, b) for a, b in outer]  # both sides of a branch
    per_program = len(rest) + sum(t * lp["path_max"] for t, lp in zip(trips, prog["loops"]))
    programs, warps = math.prod(launch["grid"]), launch["num_warps"]
    occ = issue_cycles(programs, warps, launch["registers"], launch["shared_bytes"], per_program)
    pipe_warp = _pipes(rest)
    for t, body in zip(trips, bodies):
        for p, c in _pipes(body).items():
            pipe_warp[p] = pipe_warp.get(p, 0) + t * c
    wps, together = occ["warps_per_scheduler"], occ["resident_warps_per_scheduler"]
    ms = {"issue": occ["cycles"] / CLOCK_HZ * 1e3}
    ms.update({f"pipe:{p}": wps * c / CLOCK_HZ * 1e3 for p, c in pipe_warp.items()})
    main = max(range(len(outer)), key=lambda i: trips[i] * len(bodies[i])) if outer else None
    if walk and main is not None:  # the walk's loop, trip after trip, wave after wave; the rest at issue rate
        sim = simulate(bodies[main], together)
        cycles = occ["waves"] * trips[main] * sim["cycles"] + wps * (per_program - trips[main] *
                                                                     prog["loops"][main]["path_max"])  # fmt: skip
    else:  # the whole program once (its loops unrolled by their trips), wave after wave
        sim = simulate(_program(ins, labels, outer, trips), together, iterations=1)
        cycles = occ["waves"] * sim["cycles"]
    ms["latency"] = cycles / CLOCK_HZ * 1e3
    ms["memory"] = nbytes / COPY_BPS * 1e3
    bound = max(ms, key=ms.get)
    loop = bodies[main] if main is not None else rest
    return {"kernel": launch["kernel"], "grid": list(launch["grid"]), "num_warps": warps,
            "num_stages": launch.get("num_stages"), "registers": launch["registers"],
            "spill_stores": launch.get("spill_stores"), "spill_loads": launch.get("spill_loads"),
            "shared_bytes": launch["shared_bytes"], "walk": bool(walk and main is not None),
            "loops": [{k: lp[k] for k in ("static", "path_min", "path_max", "hmma")} for lp in prog["loops"]],
            "trips": trips, "main_loop": main, "outside_loops": len(rest),
            "sass_per_iter": prog["loops"][main]["path_max"] if main is not None else len(rest),
            "iter_trips": trips[main] if main is not None else 1, "per_iter": _mix(loop),
            "instructions_per_program": per_program, **occ, "pipe_cycles_per_warp": pipe_warp,
            "sched": {k: sim[k] for k in ("cycles", "single_warp", "issue", "nearest_bound")},
            "bytes": nbytes, "times_ms": ms, "floor_ms": ms["memory"], "bound": bound,
            "predicted_ms": ms[bound]}  # fmt: skip


# ----------------------------------------------------------------------------- the report
def _launch_facts(launch: Any) -> dict[str, Any]:
    return {"kernel": launch.kernel, "grid": list(launch.grid), "num_warps": launch.num_warps,
            "num_stages": launch.num_stages, "registers": launch.registers, "spill_stores": launch.spill_stores,
            "spill_loads": launch.spill_loads, "shared_bytes": launch.shared_bytes}  # fmt: skip


def case_prediction(case: dict[str, Any], launches: list, compiled: list) -> dict[str, Any]:
    """A case's launches predicted one by one (`launch_prediction`), summed with a gap between two; its floor the
    spec's bytes at the copy rate."""
    spec = case["spec"]
    rows = []
    for launch, kernel in zip(launches, compiled, strict=True):
        sass = kernel.asm["sass"]
        lps = program_report(sass)["loops"]
        trips = loop_trips(launch.kernel, launch.constexprs, case["tokens"], lps)
        extra = case["extra"](launch.kernel) if case["extra"] else 0.0
        row = launch_prediction(_launch_facts(launch), sass, trips, spec.min_bytes() + extra,
                                launch.kernel in WALKS and case["tokens"] > 1)  # fmt: skip
        row["constexprs"] = {k: v for k, v in launch.constexprs.items() if k.isupper()}
        rows.append(row)
    total = sum(r["predicted_ms"] for r in rows) + LAUNCH_GAP_MS * (len(rows) - 1)
    nbytes = spec.min_bytes() if case.get("floor_bytes") is None else case["floor_bytes"]
    floor = nbytes / COPY_BPS * 1e3
    top = max(rows, key=lambda r: r["predicted_ms"])
    return {"case": case["name"], "family": case["family"], "tokens": case["tokens"], "spec": spec.kind,
            "bytes": nbytes, "spec_bytes": spec.min_bytes(), "floor_ms": floor, "launches": rows,
            "gaps_ms": LAUNCH_GAP_MS * (len(rows) - 1),
            "predicted_ms": total, "bound": f"{top['bound']} ({top['kernel']})",
            "floor_pct": 100 * floor / total}  # fmt: skip


def predict(prompts: tuple[int, ...] = (PROMPT,), log=print) -> dict[str, Any]:
    """Compile every case for sm_90 (compile-only) and predict its launches (module docstring)."""
    import torch

    from codesign.autotune.compile_only import compile_only
    from codesign.backend import use_backend

    warnings.filterwarnings("ignore", message="no tuned config for")
    warnings.filterwarnings("ignore", message="TRITON_DEFAULT_FP_FUSION")
    rows = []
    with compile_only(90, "NVIDIA H200") as session, use_backend("triton"), torch.no_grad():
        for case in cases(tuple(prompts)):
            n0 = len(session.launches)
            case["call"]()
            row = case_prediction(case, session.launches[n0:], session.compiled[n0:])
            rows.append(row)
            log(f"  {row['case']}: {row['predicted_ms'] * 1e3:.1f} us predicted ({row['bound']})")
    return {"gpu": "NVIDIA H200 (compile-only sm_90; nothing timed: every number is a prediction)", "sms": SMS,
            "clock_hz": CLOCK_HZ, "copy_Bps": COPY_BPS, "launch_gap_ms": LAUNCH_GAP_MS,
            "xu_cycles_per_warp_instruction": PIPE_CYCLES["xu"], "prompts": list(prompts), "cases": rows}  # fmt: skip


def _bound(row: dict[str, Any]) -> str:
    """A launch's bound, the simulation's nearest bound beside a latency bound (`sass_sched.simulate`)."""
    near = row["sched"]["nearest_bound"]
    return f"latency (sim: {near})" if row["bound"] == "latency" and near != "latency" else row["bound"]


def table(report: dict[str, Any]) -> str:
    """One row per launch (its bound, predicted time and floor, registers, SASS an iteration and trips), then the
    case's total against its floor (the spec's bytes, or the op's own where it moves fewer: a tree's)."""
    head = ("case / launch                  grid    warps regs res SASS/iter trips  EX2 SHFL BAR issue us   xu us  "
            "mio us latency us floor us predicted us  bound")  # fmt: skip
    lines = [f"{report['gpu']}", head]
    for c in report["cases"]:
        lines.append(c["case"])
        for r in c["launches"]:
            t, it = r["times_ms"], r["per_iter"]
            grid = "x".join(str(g) for g in r["grid"])
            lines.append(
                f"  {r['kernel']:24s} {grid:>10s} {r['num_warps']:5d} {r['registers']:4d} {r['resident']:3d} "
                f"{r['sass_per_iter']:9d} {r['iter_trips']:5d} {it['mufu_ex2']:4d} {it['shfl']:4d} {it['bar']:3d} "
                f"{t['issue'] * 1e3:8.1f} {t.get('pipe:xu', 0) * 1e3:7.1f} {t.get('pipe:mio', 0) * 1e3:7.1f} "
                f"{t['latency'] * 1e3:10.1f} {r['floor_ms'] * 1e3:8.1f} {r['predicted_ms'] * 1e3:12.1f}  {_bound(r)}"
            )
        lines.append(f"  = predicted {c['predicted_ms'] * 1e3:.1f} us (bound: {c['bound']}); the floor "
                     f"{c['floor_ms'] * 1e3:.1f} us ({c['bytes'] / 1e6:.1f} MB), {c['floor_pct']:.0f} % of it")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", nargs="*", type=int, default=[PROMPT], help="prompt lengths of the prompt cases")
    ap.add_argument("--out", type=Path, default=None, help="write the report as JSON here")
    args = ap.parse_args(argv)
    return run_report("state_predict", lambda: predict(tuple(args.tokens), log=lambda *a: None), table, args.out)


if __name__ == "__main__":
    sys.exit(main())
