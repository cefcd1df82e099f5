"""bench/gpu_suite.py on a machine without a GPU: a clear message and exit status 2, nothing written."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from codesign.backend import cuda_available

SUITE = Path(__file__).resolve().parents[1] / "bench" / "gpu_suite.py"


@pytest.mark.skipif(cuda_available(), reason="this machine has a GPU: the suite would really run")
def test_suite_says_no_gpu_and_exits_2(tmp_path):
    out = tmp_path / "r.json"
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    p = subprocess.run([sys.executable, str(SUITE), "--out", str(out)], capture_output=True, text=True, env=env,
                       timeout=120)  # fmt: skip
    assert p.returncode == 2, p.stderr
    assert "no CUDA GPU" in p.stderr and not out.exists()
