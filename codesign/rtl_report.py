"""`codesign rtl-report`: the model-vs-RTL evidence table (cycles and bits per unit, config, simulator).

A thin front for hdl_tests/report.py, which needs a source checkout (the Verilog and cocotb benches are not
installed with the package) and the `hdl` extra plus Icarus Verilog.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import codesign
from codesign.specs import CodesignError


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--sim", help="comma-separated simulators: icarus,verilator (default: both)")
    p.add_argument("--unit", help="comma-separated units (default: all)")
    p.add_argument("--seed", type=int, help="seed for the random operands (recorded)")
    p.add_argument("--format", choices=("text", "markdown"))
    p.add_argument("--teeth", action="store_true", help="also show each injected RTL fault being caught")


def run(args: argparse.Namespace) -> int:
    script = Path(codesign.__file__).resolve().parents[1] / "hdl_tests" / "report.py"
    if not script.is_file():
        raise CodesignError("rtl-report needs a source checkout of codesign (hdl_tests/ is not installed)")
    fwd = []
    for name in ("sim", "unit", "seed", "format"):
        v = getattr(args, name)
        if v is not None:
            fwd += [f"--{name}", str(v)]
    if args.teeth:
        fwd.append("--teeth")
    import os

    from codesign.doctor import verilator_env

    env = {**os.environ, **verilator_env()}
    return subprocess.call([sys.executable, str(script), *fwd], env=env)
