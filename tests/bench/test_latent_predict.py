"""bench/latent_predict.py: latent attention decode predicted from its sm_90 lowering (compile-only, no GPU)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "latent_predict.py"


@pytest.mark.lowering
def test_every_case_compiles_without_spills_and_is_predicted_above_its_floor(tmp_path):
    out = tmp_path / "p.json"
    env = dict(os.environ, TRITON_INTERPRET="0")
    res = subprocess.run([sys.executable, str(SCRIPT), "--out", str(out)], env=env, capture_output=True, text=True,
                         timeout=300)  # fmt: skip
    assert res.returncode == 0, res.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert {(r["heads"], r["cache"]) for r in rows} == {(16, "bf16"), (128, "bf16"), (16, "e4m3"), (128, "e4m3")}
    for r in rows:
        assert r["spill_stores"] == 0 and r["spill_loads"] == 0, r
        assert r["predicted_ms"] >= r["floor_ms"] > 0 and 0 < r["floor_pct"] <= 100, r
        # the floor is the latent read once: 576 elements a token (bf16 2 B, e4m3 1 B), plus q and out
        per_token = 576 * (1 if r["cache"] == "e4m3" else 2)
        assert r["bytes"] >= r["batch"] * r["context"] * per_token
    # 32 heads a program from 32 heads: 128 take 4 programs a split where 16 take one
    grid = {(r["heads"], r["cache"]): r["grid"] for r in rows if r["context"] == 4096 and r["batch"] == 16}
    assert grid[128, "bf16"][1] == 4 * grid[16, "bf16"][1] and grid[128, "e4m3"][1] == 4 * grid[16, "e4m3"][1]
    # the tiles' rule beats the 16-heads tile it replaced for 128 heads (157.2 us predicted with it)
    assert next(r for r in rows if r["heads"] == 128 and r["cache"] == "bf16")["predicted_ms"] < 0.150
    assert "predicted us" in res.stdout
