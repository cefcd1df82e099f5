"""`codesign map`: map and schedule one model step onto a GPU or a simulated design, with reports."""

from __future__ import annotations

import argparse

from codesign.dataflow.reports import (
    check_fits,
    chrome_trace,
    format_report,
    gantt_png,
    per_op,
    per_unit,
    totals,
    write_json_atomic,
)
from codesign.dataflow.schedule import OBJECTIVES, schedule
from codesign.dataflow.step_args import add_step_arguments, step_graph
from codesign.dataflow.targets import make_target
from codesign.specs import CodesignError
from codesign.specs.paths import output_file


def _pins(text: list[str] | None) -> dict[str, str]:
    out = {}
    for item in text or []:
        op, sep, unit = item.partition("=")
        if not sep or not op or not unit:
            raise CodesignError(f"--pin expects OP=UNIT (e.g. attention=pim), got {item!r}")
        if out.get(op, unit) != unit:
            raise CodesignError(f"--pin {op} given twice: {op}={out[op]} and {item}")
        out[op] = unit
    return out


def _check_tiling_target(target) -> None:
    from codesign.dataflow.targets import DesignTarget

    if not isinstance(target, DesignTarget):
        raise CodesignError(
            "--tiling needs a design target (the search models a systolic array and its buffers)"
        )


def _tilings(g, target, objective: str) -> list[dict]:
    """Best tile sizes and loop order of each distinct GEMM of the graph on a design's systolic array (a design
    target: `run` checks it before any work)."""
    from codesign.dataflow.tiling import problem_for, search
    from codesign.specs import Gemm

    seen, rows = set(), []
    for _, d in g.nodes(data=True):
        spec = d["spec"]
        if not isinstance(spec, Gemm) or spec.M == 0 or (d["op"], spec) in seen:
            continue
        seen.add((d["op"], spec))
        t = search(problem_for(spec, target.design), objective)
        rows.append(
            {
                "op": d["op"],
                "gemm": f"{spec.M}x{spec.N}x{spec.K}",
                "tile": f"{t.tm}x{t.tn}x{t.tk}",
                "order": t.order,
                "cycles": t.cycles,
                "dram_mb": t.dram_bytes / 1e6,
            }
        )
    return rows


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_step_arguments(p, context=2048)
    p.add_argument(
        "--design", default="tpu_like", help="built-in design, design YAML, or a catalogue GPU key"
    )
    p.add_argument("--objective", default="latency", choices=OBJECTIVES)
    p.add_argument("--pin", action="append", metavar="OP=UNIT", help="force an operator role onto a unit")
    p.add_argument("--json", type=output_file, help="write per-op, per-unit and total results as JSON")
    p.add_argument("--trace", type=output_file, help="write a Chrome-trace/Perfetto timeline (JSON)")
    p.add_argument("--plot", type=output_file, help="write a Gantt chart (PNG)")
    p.add_argument(
        "--tiling",
        action="store_true",
        help="also search tile sizes and loop order for each distinct GEMM (design targets)",
    )


def run(args: argparse.Namespace) -> int:
    target = make_target(args.design)
    outputs = [p.resolve() for p in (args.json, args.trace, args.plot) if p is not None]
    if len(set(outputs)) < len(outputs):
        raise CodesignError("--json, --trace and --plot must name different files")
    if args.tiling:
        _check_tiling_target(target)
    g = step_graph(args)
    check_fits(g, target.memory_capacity_bytes(), target.name)
    s = schedule(g, target, objective=args.objective, pins=_pins(args.pin))
    print(format_report(s))
    tilings = _tilings(g, target, args.objective) if args.tiling else []
    for row in tilings:
        print(
            f"  {row['op']:<10} {row['gemm']:<22} tile {row['tile']:<16} order {row['order']}  "
            f"{row['cycles']:.0f} cycles, {row['dram_mb']:.2f} MB DRAM"
        )
    if args.json:
        write_json_atomic(
            {"totals": totals(s), "per_op": per_op(s), "per_unit": per_unit(s), "tilings": tilings}, args.json
        )
        print(f"wrote {args.json}")
    if args.trace:
        write_json_atomic(chrome_trace(s), args.trace)
        print(f"wrote {args.trace}")
    if args.plot:
        gantt_png(s, args.plot)
        print(f"wrote {args.plot}")
    return 0
