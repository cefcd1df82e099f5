"""bench/gpu_suite.py on a machine without a GPU: a clear message and exit status 2, nothing written."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import load_script

from codesign.backend import cuda_available

SUITE = Path(__file__).resolve().parents[2] / "bench" / "gpu_suite.py"


@pytest.mark.skipif(cuda_available(), reason="this machine has a GPU: the suite would really run")
def test_suite_says_no_gpu_and_exits_2(tmp_path):
    out = tmp_path / "r.json"
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    p = subprocess.run([sys.executable, str(SUITE), "--out", str(out)], capture_output=True, text=True, env=env,
                       timeout=120)  # fmt: skip
    assert p.returncode == 2, p.stderr
    assert "no CUDA GPU" in p.stderr and not out.exists()


def _suite():
    return load_script(SUITE, "_gpu_suite")


def test_every_shipped_op_has_suite_shapes_that_it_accepts():
    import torch

    from codesign.autotune.ops import get_op, parse_shape, registered_ops
    from codesign.autotune.space import DeviceLimits

    suite = _suite()
    for name in (n for n in registered_ops() if not n.startswith("test_")):
        op = get_op(name)
        assert name in suite.TUNE_SHAPES and suite.CORRECTNESS_SHAPES.get(name), name
        for text in [suite.TUNE_SHAPES[name], *suite.CORRECTNESS_SHAPES[name]]:
            op.check_shape(parse_shape(text))
        space = op.space(parse_shape(suite.TUNE_SHAPES[name]), torch.float16, True)
        # Something to choose between on an H100 (the writers and the DF11 decoder tune num_warps only).
        assert len(space.candidates(DeviceLimits())) >= 2, name


def test_tuning_pass_through_the_interpreter_writes_rows_and_tables(tmp_path):
    from codesign.autotune.ops import registered_ops

    suite = _suite()
    shapes = {"quantize_per_token": "M=3,K=300", "w8a8_gemm": "M=5,N=80,K=128"}
    report: dict = {}
    suite._tuning(report, 20.0, tmp_path, device="cpu", dtype_name="float32", shapes=shapes)
    t = report["tuning"]
    rows = {r["op"]: r for r in t["rows"]}
    assert (
        t["error"] is None
        and t["isolated"]
        and set(rows) == {n for n in registered_ops() if not n.startswith("test_")}
    )
    for name in shapes:
        r = rows[name]
        assert r["best"] is not None and r["n_failed"] == 0 and r["default_ms"] > 0, r
        # The best candidate is exported, or no entry where the default (timed beside it) was faster.
        entry = t["tables"].get(r["table_op"], {}).get("entries", {}).get(r["key"], {}).get(str(r["m"]))
        assert entry == (None if r["default_ms"] < r["best_ms"] else r["best"]), (r, entry)
    assert all("no tuning shape" in r["error"] for n, r in rows.items() if n not in shapes)
