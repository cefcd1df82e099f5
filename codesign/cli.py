"""The `codesign` console script: one entry point, one subcommand per job.

Each subcommand lives in its own module exposing `add_arguments(parser)` and
`run(args) -> int`; this file only wires them. Bad input (a CodesignError)
prints one line to stderr and exits with status 2, never a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from codesign.specs.errors import CodesignError

# name -> (module, one-line help). Modules are imported lazily so `codesign doctor`
# does not pay for torch when it is not needed.
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "roofline": ("codesign.dataflow.roofline_cli", "per-operator roofline of one model step on a GPU"),
    "doctor": ("codesign.doctor", "versions, GPU, Triton interpreter and HDL simulators found"),
    "sim": ("codesign.accel_model.scalesim_cli", "SCALE-Sim-compatible systolic-array simulation"),
    "tune": ("codesign.autotune.tune_cli", "tune kernel launch configs on this GPU"),
    "explore": (
        "codesign.dataflow.explore_cli",
        "design-space exploration over serving workloads (main job)",
    ),
    "rtl-report": (
        "codesign.rtl_report",
        "model-vs-RTL cycle and bit evidence (source checkout + hdl extra)",
    ),
    "kvq-accuracy": (
        "codesign.kernels.kvq_accuracy_cli",
        "attention error and bits per element of each KV format",
    ),
    "map": ("codesign.dataflow.map_cli", "map and schedule one model step onto a GPU or a simulated design"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="codesign", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for name, (module, help_text) in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        p.set_defaults(_module=module)
        try:
            importlib.import_module(module).add_arguments(p)
        except ModuleNotFoundError as e:  # a subcommand whose module is not built yet
            if e.name != module:
                raise
            p.set_defaults(_missing=True)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "_missing", False):
        print(f"codesign {args.command}: not available in this build", file=sys.stderr)
        return 2
    try:
        return int(importlib.import_module(args._module).run(args) or 0)
    except CodesignError as e:
        print(f"codesign {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
