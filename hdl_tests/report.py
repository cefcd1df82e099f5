"""Evidence table for the accelerator models: unit x configuration x simulator, model vs RTL cycles.

Runs every bench of the suite's matrix (hdl_benches.UNITS) and prints one line per job: its
streamed length t (os: K, ws: M, dequant_mac: K), the cycles the Python model predicts
(codesign.accel_model) and the RTL took from start to done, for the systolic array also the
fold (SCALE-Sim's compute phase, timed on internal signals), and the verdict (PASS =
cycle-exact and every output bit-exact; X/Z on a checked output fails).

    python hdl_tests/report.py                      # both simulators, text table
    python hdl_tests/report.py --sim icarus --format markdown --seed 7
    python hdl_tests/report.py --teeth              # also show each injected fault being caught

Exit status 0 if every job passes, 1 otherwise. Builds go to sim_build/ (reused between runs).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # hdl_tests is not a package

from hdl_benches import UNITS  # noqa: E402
from hdl_sim import SIMULATORS, run_bench, simulator_available  # noqa: E402

# Per-job checks in a bench record; a unit's records carry the ones its bench makes (a missing one passes).
FLAGS = ("bits_ok", "cycles_ok", "order_ok", "xz_ok", "trace_ok", "protocol_ok", "refuse_ok")
COLUMNS = (
    "unit",
    "config",
    "simulator",
    "t",
    "model fold",
    "RTL fold",
    "model cycles",
    "RTL cycles",
    "verdict",
)


def collect(simulators: list[str], seed: int, units: list[str]) -> list[tuple]:
    """One row per job, in COLUMNS order (fold columns "-" for units without a fold)."""
    rows = []
    for unit in units:
        matrix, bench = UNITS[unit].matrix, UNITS[unit].bench
        for sim in simulators:
            if not simulator_available(sim):
                rows.append((unit, "-", sim, "-", "-", "-", "-", "-", "SKIP (not installed)"))
                continue
            for cfg in matrix(sim):
                result = run_bench(bench(cfg), sim, seed)
                if not result.records:
                    rows.append((unit, cfg.label, sim, "-", "-", "-", "-", "-", "FAIL (no jobs ran)"))
                for r in result.records:
                    why = [k[:-3] for k in FLAGS if not r.get(k, True)]
                    verdict = "PASS" if r["ok"] and result.passed else "FAIL " + ",".join(why or ["bench"])
                    folds = (r.get("model_fold", "-"), r.get("rtl_fold", "-"))
                    rows.append(
                        (unit, cfg.label, sim, r["t"], *folds, r["model_cycles"], r["rtl_cycles"], verdict)
                    )
    return rows


def collect_teeth(seed: int, units: list[str]) -> list[tuple]:
    """One row per fault-injected configuration (Icarus): CAUGHT if the bench failed, else MISSED."""
    rows = []
    for unit in units:
        for cfg in UNITS[unit].teeth:
            result = run_bench(UNITS[unit].bench(cfg), "icarus", seed)
            broken = sorted({k[:-3] for r in result.records for k in FLAGS if not r.get(k, True)})
            verdict = "MISSED" if result.passed else "CAUGHT " + ",".join(broken or ["bench"])
            rows.append((unit, cfg.label, "icarus", "-", "-", "-", "-", "-", verdict))
    return rows


def render(rows: list[tuple], fmt: str) -> str:
    """The rows as an aligned text table or a Markdown table."""
    cells = [COLUMNS] + [tuple(str(c) for c in r) for r in rows]
    if fmt == "markdown":
        lines = ["| " + " | ".join(r) + " |" for r in cells]
        lines.insert(1, "|" + "|".join("---" for _ in COLUMNS) + "|")
        return "\n".join(lines)
    widths = [max(len(r[i]) for r in cells) for i in range(len(COLUMNS))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in cells)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="codesign rtl-report", description=__doc__.splitlines()[0])
    p.add_argument("--sim", default=",".join(SIMULATORS), help="comma-separated: icarus,verilator")
    p.add_argument("--unit", default=",".join(UNITS), help=f"comma-separated units: {','.join(UNITS)}")
    p.add_argument("--seed", type=int, default=0, help="seed for the random operands (recorded)")
    p.add_argument("--format", choices=("text", "markdown"), default="text")
    p.add_argument("--teeth", action="store_true", help="also run the fault-injected RTL (Icarus)")
    args = p.parse_args(argv)
    sims = [s for s in args.sim.split(",") if s]
    units = [u for u in args.unit.split(",") if u]
    bad = [s for s in sims if s not in SIMULATORS] + [u for u in units if u not in UNITS]
    if bad:
        p.error(f"unknown simulator or unit: {', '.join(bad)}")
    if not sims or not units:
        p.error("--sim and --unit name at least one simulator and unit")
    if args.seed < 0:
        p.error(f"--seed must be >= 0, got {args.seed}")
    rows = collect(sims, args.seed, units)
    print(render(rows, args.format))
    n_pass = sum(r[-1] == "PASS" for r in rows)
    print(f"\n{n_pass}/{len(rows)} jobs pass (seed {args.seed})")
    ok = n_pass == len(rows)
    if args.teeth:
        teeth = collect_teeth(args.seed, units)
        print("\nFault-injected RTL (the bench must fail):\n" + render(teeth, args.format))
        ok = ok and all(r[-1].startswith("CAUGHT") for r in teeth)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
