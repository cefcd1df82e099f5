"""bench/hf_host_time.py: host time of a decode step with Triton's launches stubbed (a subprocess: the stub changes
the interpreter process-wide)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "hf_host_time.py"


def test_rows_time_every_variant_and_count_two_launches_a_layer(tmp_path):
    out = tmp_path / "h.json"
    env = {**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""}
    r = subprocess.run([sys.executable, str(SCRIPT), "--layers", "2", "--tokens", "3", "--formats", "fp32", "int4",
                        "--json", str(out)], capture_output=True, text=True, env=env, timeout=300)  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    rows = {x["variant"]: x for x in json.loads(out.read_text())["rows"]}
    assert set(rows) == {"hf-sdpa", "codesign-fp32", "codesign-int4", "codesign-fp32+checks"}
    assert rows["hf-sdpa"]["launches_per_layer"] == 0 and rows["hf-sdpa"]["extra_us_per_layer"] == 0
    # one KV write and one attention launch a layer (decode steps and the prefill alike)
    assert all(rows[v]["launches_per_layer"] == 2 for v in rows if v != "hf-sdpa"), rows
    assert all(x["ms_per_token"] > 0 for x in rows.values()) and "codesign-fp32" in r.stdout


def test_refuses_without_the_interpreter_and_formats_that_read_their_values():
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    r = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 2 and "needs TRITON_INTERPRET=1" in r.stderr
    env["TRITON_INTERPRET"] = "1"
    r = subprocess.run([sys.executable, str(SCRIPT), "--formats", "int8", "int4-oaken"], capture_output=True,
                       text=True, env=env, timeout=120)  # fmt: skip
    assert r.returncode == 2 and "--formats 'int4-oaken'" in r.stderr
