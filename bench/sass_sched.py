"""A warp scheduler of one H200 SM sub-partition, simulated on a SASS loop: the cycles one iteration takes when
`warps` warps run it side by side, each issuing in order behind a scoreboard (an instruction waits for its source
registers), the scheduler issuing at most one instruction a cycle (to the first ready warp after the last one it
issued), and each functional pipe accepting a warp instruction only as fast as its lanes allow.

    seq = iteration(ins, labels, a, b, inner_trips)     # one iteration's instructions, inner loops unrolled
    simulate(seq, warps=3)                               # {"cycles": .., "single_warp": .., "issue": .., ...}

Why: the issue count of `sass_model.issue_cycles` (one warp instruction per scheduler per cycle) is a lower bound
that assumes the scheduler always has a ready warp. On the kernels the H200 timed (`bench/hindcast.py`), it was
2.4-4.6x below the measured INT8 / INT4 / INT2 / mixed decode with 2-6 warps a scheduler: a warp waits on its
block-table load, then on the codes, then on each dot, and too few warps hide it. This adds the latencies and pipe
rates below.

Figures (sm_90; cycles): pipe occupancy per warp instruction on one sub-partition = 32 lanes / (results per clock per
SM / 4), from the CUDA C++ Programming Guide's arithmetic-throughput table for compute capability 9.0 (fp32 and
packed fp16 128 an SM: 1; conversions and MUFU 16: 8; shuffles 32: 4); shared-memory and L1 traffic at 128 bytes a
clock an SM (a quarter to each sub-partition); `mma.sync` m16n8k16 at ~550 TFLOP/s dense (8 cycles; wgmma at the
measured 797 TFLOP/s bf16 matmul, rounded to 1024 FLOP a clock a sub-partition). Latencies from microbenchmarks of
Hopper (Luo et al., "Dissecting the NVIDIA Hopper Architecture through Microbenchmarking", arXiv 2501.12084;
rounded): ALU 4, MUFU 18, conversions 14, shared memory and shuffles 30, `mma.sync` 32, an L2 hit 260, DRAM under
load 600. A global load whose value reaches another global load's address (a block-table entry) is taken as an L2
hit; the loads it feeds, and every `cp.async`, as DRAM. One figure is read from the measurements, not the guide:
32-bit integer instructions at one a cycle (the guide's 64 an SM, 2 cycles, would make the timed FP8 kernel, 2780
integer instructions a warp a tile, 1.5x slower than it ran). Nothing else is fitted.

Approximations: both sides of a forward branch are executed (the decode loops' branches guard masked tails); a
barrier costs its latency only (the warps of a program on the other sub-partitions run the same code, so they
arrive together); warps of different programs are independent; the memory system has no queueing beyond the DRAM
latency (the byte floor of the predictors bounds bandwidth separately).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

# cycles a warp instruction holds its pipe on one sub-partition
PIPE_CYCLES = {"fp": 1, "int": 1, "xu": 8, "tensor": 8, "none": 1}
MIO_BYTES_PER_CYCLE = 32  # shared memory / L1: 128 B a clock an SM, a quarter to each sub-partition
WGMMA_FLOP_PER_CYCLE = 1024
LATENCY = {"alu": 4, "xu_mufu": 18, "xu_cvt": 14, "shared": 30, "mma": 32, "l2": 260, "dram": 600, "const": 20,
           "s2r": 20, "bar": 20}  # fmt: skip

_FP = ("FADD", "FMUL", "FFMA", "FMNMX", "FSEL", "FSETP", "FSET", "HADD2", "HMUL2", "HFMA2", "HMNMX2", "HSETP2",
       "FSWZADD", "FCHK")  # fmt: skip
_XU_MUFU = ("MUFU",)
_XU_CVT = ("I2F", "F2I", "F2F", "FRND", "I2I")
_SHARED = ("LDS", "LDSM", "STS", "STSM", "ATOMS", "SHFL")
_GLOBAL_LOAD = ("LDG", "LD", "LDGSTS", "ATOMG", "ATOM", "RED", "LDL")
_NO_DEST = ("ST", "STS", "STG", "STL", "STSM", "RED", "BAR", "BRA", "EXIT", "DEPBAR", "LDGDEPBAR", "LDGSTS", "NOP",
            "BSSY", "BSYNC", "WARPSYNC", "MEMBAR", "FENCE", "ERRBAR", "CCTL", "YIELD", "WARPGROUP", "CALL", "RET",
            "SYNCS", "UTMALDG", "UTMASTG", "UBLKCP", "ARRIVES")  # fmt: skip
_REG = re.compile(r"\b(U?R)(\d+)(\.64)?\b|\b(U?P)(\d)\b")
_GMMA_SHAPE = re.compile(r"\.64x(\d+)x(\d+)")
_DEPBAR_N = re.compile(r"SB0, 0x([0-9a-fA-F]+)")


@dataclass
class Instr:
    text: str
    op: str  # opcode with modifiers
    base: str  # opcode alone
    dests: list[str]
    srcs: list[str]
    addr: list[str]  # registers of the global address (loads)
    pipe: str
    pipe_cycles: int
    latency: int


def _regs(opnd: str, width: int = 1) -> list[str]:
    out: list[str] = []
    for m in _REG.finditer(opnd):
        if m.group(1):
            n, w = int(m.group(2)), 2 if m.group(3) else width
            out += [f"{m.group(1)}{n + i}" for i in range(w)]
        else:
            out.append(f"{m.group(4)}{m.group(5)}")
    return out


def _dest_width(op: str) -> int:
    parts = op.split(".")
    base = parts[0]
    if base in ("HMMA", "IMMA"):
        return 4 if ("F32" in parts or "S32" in parts) else 2
    if base in ("HGMMA", "IGMMA", "QGMMA"):
        m = _GMMA_SHAPE.search(op)
        return (int(m.group(1)) // 2) if m else 64  # 64 x N fp32 over 128 threads
    if base == "LDSM":
        return 4 if "4" in parts else (2 if "2" in parts else 1)
    if "WIDE" in parts or "64" in parts:
        return 2
    return 4 if "128" in parts else 1


def _bytes(op: str) -> int:
    """Bytes a warp instruction moves through shared memory / L1."""
    parts = op.split(".")
    if parts[0] in ("LDSM", "STSM"):
        return 128 * _dest_width(op)
    if parts[0] == "SHFL":
        return 128
    width = 4
    for p in parts[1:]:
        width = {"64": 8, "128": 16, "U8": 1, "S8": 1, "U16": 2, "S16": 2}.get(p, width)
    return 32 * width


def _pipe(op: str, base: str) -> tuple[str, int, int]:
    """(pipe, cycles a warp instruction holds it, latency) of an opcode."""
    if base in _FP:
        return "fp", PIPE_CYCLES["fp"], LATENCY["alu"]
    if base in _XU_MUFU or base in _XU_CVT:
        return "xu", PIPE_CYCLES["xu"], LATENCY["xu_mufu" if base in _XU_MUFU else "xu_cvt"]
    if base in _SHARED or base in _GLOBAL_LOAD or base in ("STG", "ST", "STL"):
        return "mio", max(1, _bytes(op) // MIO_BYTES_PER_CYCLE), LATENCY["shared" if base in _SHARED else "dram"]
    if base in ("HMMA", "IMMA"):
        return "tensor", PIPE_CYCLES["tensor"], LATENCY["mma"]
    if base in ("HGMMA", "IGMMA", "QGMMA"):
        m = _GMMA_SHAPE.search(op)
        n, k = (int(m.group(1)), int(m.group(2))) if m else (64, 16)
        flop = 2 * 64 * n * k // (2 if base != "HGMMA" else 1) // 4  # 8-bit operands: twice the rate
        cycles = max(1, flop // WGMMA_FLOP_PER_CYCLE)
        return "tensor", cycles, cycles + LATENCY["mma"]
    if base in ("LDC", "ULDC"):
        return "none", PIPE_CYCLES["none"], LATENCY["const"]
    if base in ("S2R", "S2UR", "CS2R"):
        return "none", PIPE_CYCLES["none"], LATENCY["s2r"]
    if base in _NO_DEST or op.startswith("WARPGROUP"):
        return "none", PIPE_CYCLES["none"], LATENCY["alu"]
    return "int", PIPE_CYCLES["int"], LATENCY["alu"]


def decode(text: str) -> Instr:
    """One SASS instruction: its destination and source registers (predicates included), pipe and latency."""
    guard: list[str] = []
    t = text.strip().rstrip(";").strip()
    if t.startswith("@"):
        g, t = t.split(" ", 1)
        guard = _regs(g)
    op, _, rest = t.partition(" ")
    base = op.split(".")[0]
    opnds = [o.strip() for o in rest.split(",")] if rest else []
    dests: list[str] = []
    i0 = 0
    if opnds and base not in _NO_DEST and not op.startswith("WARPGROUP"):
        dests = _regs(opnds[0], _dest_width(op))
        i0 = 1
        while i0 < len(opnds) and re.fullmatch(r"U?P\d|U?PT", opnds[i0]):  # carry / second predicate outputs
            dests += _regs(opnds[i0])
            i0 += 1
    srcs = list(guard)
    for j, o in enumerate(opnds[i0:]):
        width = 1
        if base in ("HMMA", "IMMA"):
            width = [4, 2, _dest_width(op)][j] if j < 3 else 1
        elif base in ("STS", "STG", "ST", "STL") and j == len(opnds) - 1 - i0:
            width = _dest_width(op)
        srcs += _regs(o, width)
    addr = [r for o in opnds if "[" in o for r in _regs(o[o.index("[") :])] if base in _GLOBAL_LOAD else []
    pipe, cycles, lat = _pipe(op, base)
    return Instr(text, op, base, dests, srcs, addr, pipe, cycles, lat)


def iteration(ins: list[str], labels: dict[str, int], a: int, b: int, inner_trips: int | list[int] = 1) -> list[str]:
    """The instructions of one iteration of the loop [a, b) in address order, each inner loop's body repeated its
    trips (a list: per inner loop in address order, its last entry for the loops past its end)."""
    from sass_model import loops

    inner = [(s, e) for s, e in loops(ins, labels) if a < s and e <= b]
    outermost = [lp for lp in inner if not any(o != lp and o[0] <= lp[0] and lp[1] <= o[1] for o in inner)]
    per = inner_trips if isinstance(inner_trips, list) else [inner_trips]
    trips = {lp: per[min(i, len(per) - 1)] for i, lp in enumerate(outermost)}
    out: list[str] = []
    i = a
    while i < b:
        lp = next((x for x in outermost if x[0] == i), None)
        if lp is None:
            out.append(ins[i])
            i += 1
        else:
            out += ins[lp[0] : lp[1]] * max(trips[lp], 0)
            i = lp[1]
    return out


def _index_loads(seq: list[Instr]) -> set[int]:
    """Positions of global loads whose values reach a later global load's address (block-table entries)."""
    taint: dict[str, set[int]] = {}
    found: set[int] = set()
    for i, x in enumerate(seq):
        if x.base in _GLOBAL_LOAD:
            for r in x.addr:
                found |= taint.get(r, set())
            for r in x.dests:
                taint[r] = {i}
        else:
            src: set[int] = set()
            for r in x.srcs:
                src |= taint.get(r, set())
            for r in x.dests:
                taint[r] = src
    return found


@dataclass
class _Warp:
    pos: int = 0  # the next instruction, counted over all iterations
    ready: dict[str, int] = field(default_factory=dict)  # register -> the cycle its value is ready
    stall: int = 0
    open_group: int = -1  # completion of the cp.async group being filled
    groups: list[int] = field(default_factory=list)  # committed cp.async groups' completions, oldest first
    gmma: int = 0  # completion of the warpgroup MMAs issued
    done_at: list[int] = field(default_factory=list)  # the cycle each iteration's last instruction issued


def _earliest(x: _Warp, ins: Instr, pipe_free: dict[str, int]) -> int:
    """The first cycle warp `x` may issue `ins`: its own stall, the pipe, its sources, its copy and MMA waits."""
    at = max([x.stall, pipe_free.get(ins.pipe, 0) if ins.pipe != "none" else 0] + [x.ready.get(r, 0) for r in ins.srcs])
    if ins.base == "DEPBAR":
        m = _DEPBAR_N.search(ins.text)
        keep = int(m.group(1), 16) if m else 0
        at = max([at] + x.groups[: max(0, len(x.groups) - keep)])
    elif ins.op.startswith("WARPGROUP.DEPBAR"):
        at = max(at, x.gmma)
    return at


def _issue(x: _Warp, ins: Instr, t: int, latency: int, pipe_free: dict[str, int]) -> None:
    """Warp `x` issues `ins` at cycle `t`: the pipe taken, the destinations' ready time, copy groups and MMAs."""
    if ins.pipe != "none":
        pipe_free[ins.pipe] = t + ins.pipe_cycles
    for r in ins.dests:
        x.ready[r] = t + latency
    if ins.base == "LDGSTS":
        x.open_group = max(x.open_group, t + latency)
    elif ins.base == "LDGDEPBAR":
        x.groups.append(max(x.open_group, t))
        x.open_group = -1
    elif ins.base == "DEPBAR":
        m = _DEPBAR_N.search(ins.text)
        keep = int(m.group(1), 16) if m else 0
        x.groups = x.groups[max(0, len(x.groups) - keep) :]
    elif ins.base in ("HGMMA", "IGMMA", "QGMMA"):
        x.gmma = max(x.gmma, t + latency)
    x.stall = t + (LATENCY["bar"] if ins.base == "BAR" else 1)


def _run(seq: list[Instr], lat: list[int], warps: int, iterations: int) -> int:
    """Steady-state cycles an iteration of `warps` warps on one scheduler (`simulate`)."""
    n = len(seq)
    ws = [_Warp() for _ in range(warps)]
    pipe_free: dict[str, int] = {}
    t, last, total = 0, -1, n * iterations
    while any(x.pos < total for x in ws):
        best, best_at = None, None
        for k in range(warps):
            j = (last + 1 + k) % warps
            if ws[j].pos >= total:
                continue
            at = _earliest(ws[j], seq[ws[j].pos % n], pipe_free)
            if at <= t:
                best = j
                break
            best_at = at if best_at is None else min(best_at, at)
        if best is None:
            t = max(t + 1, best_at)
            continue
        x = ws[best]
        _issue(x, seq[x.pos % n], t, lat[x.pos % n], pipe_free)
        x.pos += 1
        if x.pos % n == 0:
            x.done_at.append(t)
        last = best
        t += 1  # one instruction a cycle
    ends = [max(x.done_at[i] for x in ws) for i in range(iterations)]
    warm = min(2, iterations - 1)
    return round((ends[-1] - ends[warm - 1]) / (iterations - warm)) if warm else ends[-1]


def simulate(lines: list[str], warps: int, iterations: int = 6) -> dict[str, Any]:
    """Cycles per iteration of `lines` (one loop iteration) with `warps` warps on one sub-partition in steady state:
    the mean of the iterations after the first two (register state and `cp.async` groups carried from one to the
    next: a two-stage copy pipeline fills in two), the slowest warp's. Also the single-warp time, the issue count
    (warps x instructions), each pipe's occupancy, for the bound they name, and one warp's shared-memory / L1 pipe
    cycles by opcode (`mio_by_op`: where shared-memory traffic goes)."""
    seq = [decode(t) for t in lines]
    index = _index_loads(seq)
    lat = [LATENCY["l2"] if i in index else x.latency for i, x in enumerate(seq)]
    pipes: dict[str, int] = {}
    mio: dict[str, int] = {}  # a warp's shared-memory / L1 pipe cycles an iteration, by opcode
    for x in seq:
        if x.pipe != "none":
            pipes[x.pipe] = pipes.get(x.pipe, 0) + x.pipe_cycles
        if x.pipe == "mio":
            mio[x.op] = mio.get(x.op, 0) + x.pipe_cycles
    cycles = _run(seq, lat, warps, iterations)
    single = _run(seq, lat, 1, iterations) if warps > 1 else cycles
    issue = warps * len(seq)
    pipe_bound = {p: warps * c for p, c in pipes.items()}
    bound = max([("latency", single), ("issue", issue)] + [(f"pipe:{p}", c) for p, c in pipe_bound.items()],
                key=lambda kv: kv[1])[0]  # fmt: skip
    return {"cycles": cycles, "single_warp": single, "issue": issue, "pipes": pipe_bound, "nearest_bound": bound,
            "instructions": len(seq), "index_loads": len(index),
            "mio_by_op": dict(sorted(mio.items(), key=lambda kv: -kv[1]))}  # fmt: skip
