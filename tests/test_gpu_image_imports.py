"""What the GPU suite imports must work on the lent GPU machine's image, which cannot install anything.

That image (docs/gpu-suite.md, "One lent GPU session") has torch, triton, numpy, networkx, numba, pyyaml, matplotlib
and tqdm, but not optuna, ray, cocotb or scalesim. A missing top-level import would only show on the
GPU, wasting its minutes; here a fresh process with those packages hidden imports the kernels, every
tunable op and every `bench/gpu_*.py` module, and runs the search strategy the suite falls back to.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ABSENT_ON_GPU_IMAGE = ("optuna", "ray", "cocotb", "cocotb_tools", "scalesim", "pytest_benchmark")

CODE = f"""
import sys
for name in {ABSENT_ON_GPU_IMAGE!r}:
    sys.modules[name] = None  # import raises ImportError; importlib.util.find_spec returns None
import importlib.util
from pathlib import Path

import codesign.kernels  # noqa: F401
from codesign.autotune.ops import get_op, registered_ops
from codesign.autotune.strategies import Budget, search

ops = [get_op(n) for n in registered_ops()]
bench = Path({str(Path(__file__).resolve().parents[1] / "bench")!r})
for path in sorted(bench.glob("gpu_*.py")):
    spec = importlib.util.spec_from_file_location("_b_" + path.stem, path)
    spec.loader.exec_module(importlib.util.module_from_spec(spec))
assert importlib.util.find_spec("optuna") is None  # so the suite picks "random"
cands = [{{"BLOCK": b}} for b in (16, 32, 64, 128)]
res = search("random", cands, lambda c: abs(c["BLOCK"] - 64) + 1.0, Budget(max_evals=4))
assert res.best[0] == {{"BLOCK": 64}}, res.best
print("ok", len(ops))
"""


def test_suite_imports_without_packages_the_gpu_image_lacks():
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().startswith("ok")
