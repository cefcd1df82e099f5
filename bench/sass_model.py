"""The SASS model shared by the compile-only predictors (`bench/attention_predict.py`, `bench/gemm_predict.py`):
parse Triton's sm_90 SASS listing, find its loops, count one iteration along its longest (or shortest) path, and
turn warp instructions into the busiest scheduler's issue cycles on an H200.

    ins, labels = parse_sass(kernel.asm["sass"])      # instructions (no control codes), label -> index
    loop_report(sass)                                  # the largest loop with a matrix instruction
    program_report(sass)                               # every outermost loop in address order, and the rest
    issue_cycles(programs, warps, registers, shared, warp_instructions_per_program)

One warp instruction per scheduler per cycle, 4 schedulers per SM, the busiest SM's programs (ceil(programs /
132)); occupancy (programs resident at once, waves) is reported, it changes latency, not issue. Lower bounds:
dependent latency with few warps per scheduler, integer ops at half rate, shared-memory (MIO) throughput and
(here) the tensor-core rate are not modelled; each predictor adds the bounds it needs (docs/kernels.md).
"""

from __future__ import annotations

import collections
import json
import math
import os
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

SMS, SCHEDULERS, CLOCK_HZ = 132, 4, 1.98e9  # H200 (SXM): SMs, warp schedulers per SM, boost clock
REGS_PER_SM, MAX_WARPS_PER_SM, MAX_BLOCKS_PER_SM = 65536, 64, 32  # sm_90 occupancy limits
SMEM_PER_SM, SMEM_PER_BLOCK_RESERVED = 228 * 1024, 1024
_LABEL = re.compile(r"\s*(\w+):\s*$")
# A branch and its target: a label, or a byte address (16 bytes an sm_90 instruction, the listing from address 0). A
# second predicate operand (`@!P2 BRA P3, 0x1d40;`, `BRA !P4, ...`: ptxas's uniform branches) makes it conditional.
_BRA = re.compile(r"\bBRA(?:\.\w+)* (!?U?P\w+, )?(\w+);")
_INSTRUCTION_BYTES = 16


# ----------------------------------------------------------------------------- SASS
def is_matrix(op: str) -> bool:
    """A tensor-core instruction (HMMA, IMMA, HGMMA, IGMMA, QGMMA), not ptxas's HFMA2.MMA (a move of a constant
    issued on the FMA pipe)."""
    return "MMA" in op and not op.startswith("HFMA2")


def parse_sass(sass: str) -> tuple[list[str], dict[str, int]]:
    """(instructions without control codes, label -> index of the instruction it precedes)."""
    ins: list[str] = []
    labels: dict[str, int] = {}
    for line in sass.splitlines():
        if m := _LABEL.fullmatch(line):
            labels[m.group(1)] = len(ins)
        elif ";" in line:
            ins.append(line.split("\t")[-1].strip())
    for t in ins:  # branches to an address rather than a label: the address names its instruction
        if (m := _BRA.search(t)) and m.group(2).startswith("0x"):
            labels[m.group(2)] = int(m.group(2), 16) // _INSTRUCTION_BYTES
    return ins, labels


def loops(ins: list[str], labels: dict[str, int]) -> list[tuple[int, int]]:
    """[start, end) of every loop (a branch back to a label), in address order; 1-instruction loops (the
    `BRA` to itself after EXIT) left out."""
    out = []
    for i, t in enumerate(ins):
        m = _BRA.search(t)
        if m and m.group(2) in labels and labels[m.group(2)] < i:
            a = labels[m.group(2)]
            # Not a loop: a jump back from out-of-line code placed after the kernel's EXIT (ptxas puts the
            # retry of an mbarrier wait there, `SYNCS.PHASECHK ... BRA` back into the TMA pipeline).
            if not any(ins[j].startswith("EXIT") for j in range(a, i)):
                out.append((a, i + 1))
    return sorted(out)


def opcode(t: str) -> str:
    """The opcode with its modifiers (`LDG.E.128`), predicate stripped."""
    return re.sub(r"^@!?U?P\w+\s+", "", t).split()[0].rstrip(";")


def _successors(ins: list[str], labels: dict[str, int], a: int, b: int, e: int) -> list[int]:
    """Where control goes after the basic block ending before `e` inside the loop [a, b): `b` for the end of the
    iteration (the back edge, or falling off the end); a branch out of the loop is not followed."""
    m = _BRA.search(ins[e - 1])
    if not m:
        return [e]
    t = labels.get(m.group(2))
    out = [e] if ins[e - 1].startswith("@") or m.group(1) else []
    if t is None or t >= b or t < a:
        return out  # leaves the loop
    if t == a:
        return [b]  # the back edge: the iteration ends
    if t < e:
        return [e]  # an inner loop's back edge: its trips are counted separately
    return out + [t]


def _block_starts(ins: list[str], labels: dict[str, int], a: int, b: int) -> list[int]:
    """The first instruction of every basic block of the loop [a, b) (at a label or after a branch) in address
    order, then b."""
    starts = {a, *(v for v in labels.values() if a < v < b)}
    starts |= {i + 1 for i in range(a, b - 1) if _BRA.search(ins[i])}
    return sorted(starts) + [b]


def loop_path(
    ins: list[str], labels: dict[str, int], a: int, b: int, inner_trips: int | list[int] = 1
) -> tuple[int, int]:
    """(shortest, longest) instructions executed by one iteration of the loop [a, b): forward branches inside it
    form a DAG over its basic blocks; an inner loop's body counts `inner_trips` times (a list: per inner loop in
    address order, its last entry for the loops past its end)."""
    inner = [(s, e) for s, e in loops(ins, labels) if a < s and e <= b and (s, e) != (a, b)]
    per = inner_trips if isinstance(inner_trips, list) else [inner_trips]
    trips = {lp: per[min(i, len(per) - 1)] for i, lp in enumerate(inner)}
    order = _block_starts(ins, labels, a, b)
    best: dict[int, tuple[float, float]] = {s: (math.inf, -math.inf) for s in order}
    best[a] = (0, 0)
    for s, e in zip(order, order[1:]):
        lo, hi = best[s]
        if lo == math.inf:
            continue  # not reachable inside one iteration
        n = (e - s) + sum((trips[(is_, ie)] - 1) * (ie - is_) for is_, ie in inner if is_ == s)
        for t in _successors(ins, labels, a, b, e):
            best[t] = (min(best[t][0], lo + n), max(best[t][1], hi + n))
    lo, hi = best[b]
    return int(lo), int(hi)


def shortest_path(ins: list[str], labels: dict[str, int], a: int, b: int) -> list[int]:
    """The instruction indices one iteration of the loop [a, b) executes along its shortest path through its forward
    branches (`loop_path`'s lower count; an inner loop's body once), in address order: the path a kernel takes when
    a branch it guards is cold (predicates a loop body; a rescale taken in a program's first tile only)."""
    order = _block_starts(ins, labels, a, b)
    best: dict[int, tuple[float, int | None]] = {s: (math.inf, None) for s in order}
    best[a] = (0, None)
    for s, e in zip(order, order[1:]):
        if best[s][0] == math.inf:
            continue
        for t in _successors(ins, labels, a, b, e):
            if best[s][0] + (e - s) < best[t][0]:
                best[t] = (best[s][0] + (e - s), s)
    blocks, at = [], b
    while best[at][1] is not None:
        at = best[at][1]
        blocks.append(at)
    ends = dict(zip(order, order[1:]))
    return [i for s in sorted(blocks) for i in range(s, ends[s])]


def census(ins: list[str]) -> dict[str, Any]:
    """What the instructions are: global loads by width (LDG, LDGSTS = cp.async), shared-memory traffic, conversion
    instructions (I2F/F2F/F2I per element; packed F2FP two at a time), tensor-core ops, spills, barriers."""
    ops = collections.Counter(opcode(t) for t in ins)

    def n(pred) -> int:
        return sum(c for o, c in ops.items() if pred(o))

    return {
        "instructions": len(ins),
        "hmma": n(is_matrix),  # any matrix instruction: HMMA / IMMA (mma.sync), HGMMA / IGMMA / QGMMA
        "mma": {o: c for o, c in sorted(ops.items()) if is_matrix(o)},
        "ldg": {o: c for o, c in sorted(ops.items()) if o.startswith("LDG.") or o == "LDG"},
        "ldgsts": {o: c for o, c in sorted(ops.items()) if o.startswith("LDGSTS")},
        "lds": n(lambda o: o.startswith(("LDS", "LDSM"))),
        "lds_u8_u16": n(lambda o: o in ("LDS.U8", "LDS.S8", "LDS.U16", "LDS.S16")),
        "sts": n(lambda o: o.startswith(("STS", "STSM"))),
        "cvt": {o: c for o, c in sorted(ops.items()) if o.startswith(("I2F", "F2F.", "F2I", "I2I"))},
        "f2fp_packed": n(lambda o: o.startswith("F2FP")),
        "spill_ldl_stl": n(lambda o: o.startswith(("LDL", "STL"))),
        "bar": n(lambda o: o.startswith("BAR")),
        "int_alu": n(
            lambda o: o.split(".")[0] in ("LOP3", "SHF", "PRMT", "SEL", "IADD3", "LEA", "SGXT", "ISETP")
        ),
        "moves": n(lambda o: o.startswith(("IMAD.MOV", "MOV"))),
        "top": ops.most_common(8),
    }


def outer_loops(ins: list[str], labels: dict[str, int]) -> tuple[list[tuple[int, int]], int]:
    """(the outermost loops in address order, how many loops are nested in them)."""
    all_loops = loops(ins, labels)
    outer = [
        lp for lp in all_loops if not any(o != lp and o[0] <= lp[0] and lp[1] <= o[1] for o in all_loops)
    ]
    return outer, len(all_loops) - len(outer)


def program_report(sass: str, inner_trips: int = 1) -> dict[str, Any]:
    """Every outermost loop of a kernel in address order (its static size, the shortest and longest path of one
    iteration, its matrix instructions and census) and the instructions outside them, run once per program
    (`outside`: the trailing NOP padding and the branch to itself after EXIT not counted)."""
    ins, labels = parse_sass(sass)
    outer, inner = outer_loops(ins, labels)
    rows = []
    for a, b in outer:
        lo, hi = loop_path(ins, labels, a, b, inner_trips)
        rows.append({"start": a, "static": b - a, "path_min": lo, "path_max": hi, **census(ins[a:b])})
    inside = {i for a, b in outer for i in range(a, b)}
    rest = [t for i, t in enumerate(ins) if i not in inside and opcode(t) != "NOP" and not _self_branch(ins, labels, i)]
    return {"loops": rows, "inner_loops": inner, "outside": len(rest), "instructions": len(ins)}


def _self_branch(ins: list[str], labels: dict[str, int], i: int) -> bool:
    m = _BRA.search(ins[i])
    return bool(m) and labels.get(m.group(2)) == i


def tile_loops(ins: list[str], labels: dict[str, int]) -> list[tuple[int, int]]:
    """[start, end) of the outermost loops with a matrix instruction (KV-tile or K-step loops), in address order."""
    outer, _ = outer_loops(ins, labels)
    return [(a, b) for a, b in outer if any(is_matrix(opcode(t)) for t in ins[a:b])]


def tile_loop(ins: list[str], labels: dict[str, int], which: int = -1) -> tuple[int, int]:
    """One of `tile_loops`: `which` -1 the largest, else its index in address order (a tree launch's prefix loop,
    then its masked loop); ValueError when there is none."""
    tiles = tile_loops(ins, labels)
    if not tiles:
        raise ValueError("no loop with a matrix instruction in the SASS")
    return max(tiles, key=lambda lp: lp[1] - lp[0]) if which < 0 else tiles[which]


def loop_report(sass: str, inner_trips: int | list[int] = 1, which: int = -1) -> dict[str, Any]:
    """A KV-tile loop (`tile_loop`): its executed path per iteration, its census and the instructions outside the
    outermost loops (run once per program)."""
    ins, labels = parse_sass(sass)
    outer, inner = outer_loops(ins, labels)
    a, b = tile_loop(ins, labels, which)
    lo, hi = loop_path(ins, labels, a, b, inner_trips)
    rest = len(ins) - sum(e - s for s, e in outer)
    return {"static": b - a, "path_min": lo, "path_max": hi, "inner_loops": inner, "outside_loops": rest,
            "tile_loops": [e - s for s, e in tile_loops(ins, labels)], **census(ins[a:b])}  # fmt: skip


# ----------------------------------------------------------------------------- the model
def resident_programs(warps: int, registers: int, shared: int) -> int:
    """Programs of one launch an sm_90 SM holds at once: registers (allocated per warp in 256s), warps, shared
    memory (plus 1 KB reserved per block), blocks."""
    regs_per_warp = math.ceil(registers * 32 / 256) * 256
    by_regs = REGS_PER_SM // (regs_per_warp * warps)
    by_smem = SMEM_PER_SM // (shared + SMEM_PER_BLOCK_RESERVED)
    return max(1, min(by_regs, MAX_WARPS_PER_SM // warps, by_smem, MAX_BLOCKS_PER_SM))


def issue_cycles(
    programs: int, warps: int, registers: int, shared: int, per_program: float
) -> dict[str, Any]:
    """Cycles of the busiest scheduler when `programs` programs of `warps` warps each issue `per_program` warp
    instructions per warp: ceil(programs / SMS) on the busiest SM, their warps spread evenly over its SCHEDULERS
    schedulers, one instruction per cycle each (waves of the resident count change latency, not issue)."""
    per_sm = math.ceil(programs / SMS)
    res = resident_programs(warps, registers, shared)
    waves = math.ceil(per_sm / res)
    warps_per_scheduler = math.ceil(per_sm * warps / SCHEDULERS)
    # the warps a scheduler runs together (the programs an SM holds at once): what `sass_sched.simulate` takes
    together = math.ceil(min(per_sm, res) * warps / SCHEDULERS)
    return {"programs_per_sm": per_sm, "resident": res, "waves": waves, "warps_per_scheduler": warps_per_scheduler,
            "resident_warps_per_scheduler": together, "cycles": warps_per_scheduler * per_program}  # fmt: skip


# ----------------------------------------------------------------------------- the scripts' common tail
def run_report(name: str, make: Callable[[], dict], table: Callable[[dict], str], out: Path | None) -> int:
    """A predictor's CLI body: refuse the interpreter (kernels must compile), print the table, write the JSON."""
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        print(f"{name}: unset TRITON_INTERPRET (kernels must compile)", file=sys.stderr)
        return 2
    report = make()
    print(table(report))
    if out:
        from codesign.autotune.export import atomic_write_json

        atomic_write_json(out, json.loads(json.dumps(report, default=str)))
        print(f"wrote {out}")
    return 0
