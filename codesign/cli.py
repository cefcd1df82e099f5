"""The `codesign` console script: one entry point, one subcommand per job.

Each subcommand lives in its own module exposing `add_arguments(parser)` and
`run(args) -> int`; this file only wires them. Bad input (a CodesignError, or a
file that cannot be read or written) prints one line to stderr and exits with
status 2, never a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from codesign.specs.errors import CodesignError

# name -> (module, one-line help). Modules are imported lazily so `codesign doctor`
# does not pay for torch when it is not needed.
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "roofline": ("codesign.dataflow.roofline_cli", "per-operator roofline of one model step on a GPU"),
    "doctor": ("codesign.doctor", "versions, GPU, Triton interpreter and HDL simulators found"),
    "sim": ("codesign.accel_model.systolic.cli", "SCALE-Sim-compatible systolic-array simulation"),
    "tune": ("codesign.autotune.tune_cli", "tune kernel launch configs on this GPU"),
    "explore": (
        "codesign.dataflow.explore.cli",
        "design-space exploration over serving workloads (main job)",
    ),
    "rtl-report": (
        "codesign.rtl_report",
        "model-vs-RTL cycle and bit evidence (source checkout + hdl extra)",
    ),
    "kvq-accuracy": (
        "codesign.kernels.kvcache.accuracy_cli",
        "attention error and bits per element of each KV format",
    ),
    "map": ("codesign.dataflow.map_cli", "map and schedule one model step onto a GPU or a simulated design"),
    "generate": ("codesign.integrations.hf.cli", "run a transformers model on codesign's kernels; cost it on a design"),
}


def _chosen(argv: list[str]) -> str | None:
    """The subcommand named in argv (its first non-option word), if it is one of ours."""
    for a in argv:
        if not a.startswith("-"):
            return a if a in SUBCOMMANDS else None
    return None


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The parser; only the chosen subcommand's module is imported (all of them when argv is None).

    Importing lazily keeps `codesign doctor` or `codesign explore` from paying for torch and the
    Triton kernels, and lets a kernel subcommand switch on Triton's interpreter (no GPU) before
    `codesign.kernels` defines its kernels: Triton reads TRITON_INTERPRET only then.
    """
    parser = argparse.ArgumentParser(prog="codesign", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    chosen = None if argv is None else _chosen(argv)
    for name, (module, help_text) in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        p.set_defaults(_module=module)
        if argv is not None and name != chosen:
            continue
        if module.startswith("codesign.kernels."):
            from codesign.backend import enable_interpreter_if_no_gpu

            enable_interpreter_if_no_gpu()
        try:
            importlib.import_module(module).add_arguments(p)
        except ModuleNotFoundError as e:  # a subcommand whose module is not built yet
            if e.name != module:
                raise
            p.set_defaults(_missing=True)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        parser = build_parser(argv)
    except CodesignError as e:  # e.g. codesign.kernels already imported by the caller without a GPU
        print(f"codesign: error: {e}", file=sys.stderr)
        return 2
    args = parser.parse_args(argv)
    if getattr(args, "_missing", False):
        print(f"codesign {args.command}: not available in this build", file=sys.stderr)
        return 2
    try:
        return int(importlib.import_module(args._module).run(args) or 0)
    except CodesignError as e:
        print(f"codesign {args.command}: error: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # (`codesign roofline | head`: the reader left; Python's documented recipe)
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except OSError as e:  # a file the run reads or writes (the output paths are checked before it starts)
        print(f"codesign {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
