"""`codesign explore`: sweep a design space over serving workloads; durable, resumable, with a report.

With no arguments: Llama-3-8B on the built-in space (dataflow/explore/spaces/default.yaml),
the default workloads, a grid search, results in explore_out/results.sqlite and
the report in explore_out/report.html. Rerunning resumes.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from codesign.catalog.models import load_model
from codesign.dataflow.explore.engine import ENGINES, OBJECTIVES, run_sweep
from codesign.dataflow.explore.eval import DEFAULT_WORKLOADS, Workload
from codesign.dataflow.explore.report import write_report
from codesign.dataflow.explore.search import STRATEGIES, make_strategy
from codesign.dataflow.explore.space import load_space
from codesign.dataflow.explore.store import ResultStore
from codesign.specs import CodesignError
from codesign.specs.paths import output_dir, output_file


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--space", type=Path, help="design-space YAML (default: the built-in space)")
    p.add_argument("--model", default="llama-3-8b")
    p.add_argument(
        "--workload",
        action="append",
        metavar="W",
        help="decode:b16:c4096, prefill:b1:c2048, trace:synthetic:N:RATE, trace:azure:PATH "
        "(repeatable; default: a built-in mix)",
    )
    p.add_argument("--search", default="grid", choices=STRATEGIES)
    p.add_argument("--budget", type=int, help="at most this many design points")
    p.add_argument(
        "--objective", default="throughput", choices=OBJECTIVES, help="what guided search maximises"
    )
    p.add_argument("--engine", default="pool", choices=ENGINES)
    p.add_argument("--workers", type=int, help="pool processes (default: min(2, cores))")
    p.add_argument("--ray-address", help="Ray cluster address for --engine ray (default: a local instance)")
    p.add_argument(
        "--out", type=output_dir, default=Path("explore_out"), help="folder for the store and the report"
    )
    p.add_argument("--store", type=Path, help="result store (default: OUT/results.sqlite)")
    p.add_argument(
        "--allow-other-version",
        action="store_true",
        help="open a store written by another code version read-only (report/export only)",
    )
    p.add_argument("--export", type=output_file, help="also write every stored result as CSV")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-progress", action="store_true")


def run(args: argparse.Namespace) -> int:
    if args.workers is not None and args.workers < 1:
        raise CodesignError(f"--workers must be >= 1, got {args.workers}")
    if args.ray_address and args.engine != "ray":
        raise CodesignError(f"--ray-address is for --engine ray, not {args.engine}")
    space = load_space(args.space)
    load_model(args.model)  # fail early on an unknown model
    workloads = [Workload.parse(w).key for w in (args.workload or DEFAULT_WORKLOADS)]
    store = ResultStore(
        args.store or args.out / "results.sqlite", allow_other_version=args.allow_other_version
    )
    try:
        if not store.read_only:
            strategy = make_strategy(args.search, space, args.budget, args.seed)
            print(
                f"exploring {args.model}: {space.size()} design points in the space, "
                f"{len(workloads)} workloads, search {args.search}, engine {args.engine}; store {store.path}"
            )
            st = run_sweep(
                space,
                args.model,
                workloads,
                strategy,
                store,
                engine=args.engine,
                workers=args.workers,
                objective=args.objective,
                progress=not args.no_progress,
                ray_address=args.ray_address,
            )
            rate = st.evaluated / st.seconds if st.seconds else 0.0
            print(
                f"{st.points} points: {st.evaluated} evaluations computed, {st.reused} reused from the store, "
                f"{st.seconds:.1f} s ({rate:.0f} evaluations/s)"
            )
        summary = write_report(store.rows(), workloads, args.model, space.constraints, args.out)
        for line in summary["findings"]:
            print("  " + line)
        front = summary.get("pareto_throughput_vs_area", [])
        if front:
            print(
                f"Pareto front on {summary['workload']} (tokens/s vs area): {len(front)} designs; "
                f"best {front[-1]['tokens_per_s']:.0f} tok/s at {front[-1]['area_mm2']:.0f} mm²"
            )
        print(f"wrote {args.out / 'report.html'}")
        if args.export:
            n = store.export_csv(args.export)
            print(f"wrote {n} rows to {args.export}")
    finally:
        store.close()
    return 0
