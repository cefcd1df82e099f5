"""bench/hf_host_time.py: host time of a decode step with Triton's launches stubbed (a subprocess: the stub changes
the interpreter process-wide)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "hf_host_time.py"


def test_rows_time_every_variant_and_count_two_launches_a_layer(tmp_path):
    out = tmp_path / "h.json"
    env = {**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""}
    r = subprocess.run([sys.executable, str(SCRIPT), "--layers", "2", "--tokens", "3", "--batch", "2", "--formats",
                        "fp32", "int4", "int4-kivi", "--json", str(out)], capture_output=True, text=True, env=env,
                       timeout=300)  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    rep = json.loads(out.read_text())
    rows = {x["variant"]: x for x in rep["rows"]}
    assert set(rows) == {"hf-sdpa", "codesign-fp32", "codesign-int4", "codesign-int4-kivi", "codesign-fp32+checks"}
    assert rows["hf-sdpa"]["launches_per_layer"] == 0 and rows["hf-sdpa"]["extra_us_per_layer"] == 0
    # one KV write and one attention launch a layer (decode steps and the prefill alike); KIVI's write is torch
    # ops into the rings until a group leaves the residual window (not within these 19 tokens)
    assert all(rows[v]["launches_per_layer"] == 2 for v in rows if v not in ("hf-sdpa", "codesign-int4-kivi")), rows
    assert rows["codesign-int4-kivi"]["launches_per_layer"] == 1 and rep["batch"] == 2
    assert all(x["ms_per_forward"] > 0 for x in rows.values()) and "codesign-fp32" in r.stdout
    assert json.loads(out.read_text())["entry_point"] is False


def test_mla_rows_time_the_latent_cache_against_transformers_mla(tmp_path):
    """--mla: a small DeepSeek-V3 on its latent cache (bf16-free formats: fp32, e4m3) beside transformers' own MLA;
    three launches a layer (prefill: the latent write, the transient pool's write, the expanded extend; decode: the
    latent write, the absorbed decode, the split merge)."""
    out = tmp_path / "h.json"
    env = {**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""}
    r = subprocess.run([sys.executable, str(SCRIPT), "--mla", "--layers", "2", "--tokens", "3", "--batch", "2",
                        "--json", str(out)], capture_output=True, text=True, env=env, timeout=300)  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    rep = json.loads(out.read_text())
    rows = {x["variant"]: x for x in rep["rows"]}
    assert set(rows) == {"hf-sdpa", "codesign-fp32", "codesign-fp8", "codesign-fp32+checks"} and rep["mla"]
    assert rows["hf-sdpa"]["launches_per_layer"] == 0
    assert all(rows[v]["launches_per_layer"] == 3 for v in rows if v != "hf-sdpa"), rows
    for bad, message in ((["--tree"], "not --tree"), (["--formats", "int8"], "--formats 'int8': one of fp32, fp8")):
        r = subprocess.run([sys.executable, str(SCRIPT), "--mla", *bad], capture_output=True, text=True, env=env,
                           timeout=120)  # fmt: skip
        assert r.returncode == 2 and message in r.stderr, r.stderr


def test_entry_point_decodes_without_a_plan(tmp_path):
    """--entry-point: the path before planned decode (the same two launches a layer), the planned one restored."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "CODESIGN_BACKEND": "triton", "CUDA_VISIBLE_DEVICES": ""}
    # (run from tmp_path: at the repo root `kernels/` would shadow the `kernels` package transformers imports)
    code = (f"import sys, json; sys.path.insert(0, {str(SCRIPT.parent)!r}); import hf_host_time as h; "
            "from codesign.integrations.hf import kv_formats as kf; from codesign.kernels.attention import wrappers; "
            "plans = []; p = wrappers.PagedDecodeWrapper.plan; "
            "wrappers.PagedDecodeWrapper.plan = lambda *a, **k: (plans.append(1), p(*a, **k))[1]; "
            "rep = h.measure(2, 2, ('fp32',), 1, entry_point=True); "
            "assert not plans and kf.PlainStorage.planned_run is not kf.Storage.planned_run, plans; "
            "h.measure(2, 2, ('fp32',), 1); assert plans; print(json.dumps(rep))")  # fmt: skip
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300,
                       cwd=tmp_path)  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    rep = json.loads(r.stdout.strip().splitlines()[-1])
    assert rep["entry_point"] is True and {x["launches_per_layer"] for x in rep["rows"][1:]} == {2.0}


def test_refuses_without_the_interpreter_and_formats_that_read_their_values():
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    r = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 2 and "needs TRITON_INTERPRET=1" in r.stderr
    env["TRITON_INTERPRET"] = "1"
    r = subprocess.run([sys.executable, str(SCRIPT), "--formats", "int8", "int4-oaken"], capture_output=True,
                       text=True, env=env, timeout=120)  # fmt: skip
    assert r.returncode == 2 and "--formats 'int4-oaken'" in r.stderr
    r = subprocess.run([sys.executable, str(SCRIPT), "--batch", "0"], capture_output=True, text=True, env=env,
                       timeout=120)  # fmt: skip
    assert r.returncode == 2 and "--batch must be >= 1" in r.stderr
    r = subprocess.run([sys.executable, str(SCRIPT), "--cuda-graph", "--tokens", "4"], capture_output=True,
                       text=True, env=env, timeout=120)  # fmt: skip
    assert r.returncode == 2 and "--cuda-graph needs --tokens >= 5" in r.stderr


def test_tree_rows_time_tree_speculation_a_forward(tmp_path):
    """--tree: tree speculation's forwards (planned by default), no sdpa row, two launches a forward and layer (a
    split-KV merge may add one to a longer forward's)."""
    out = tmp_path / "t.json"
    env = {**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""}
    r = subprocess.run([sys.executable, str(SCRIPT), "--layers", "2", "--tokens", "4", "--tree", "--formats", "fp32",
                        "--json", str(out)], capture_output=True, text=True, env=env, timeout=300)  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    rep = json.loads(out.read_text())
    rows = {x["variant"]: x for x in rep["rows"]}
    assert rep["tree"] is True and set(rows) == {"codesign-fp32", "codesign-fp32+checks"}
    assert all(x["extra_us_per_layer"] is None and x["us_per_layer"] > 0 for x in rows.values())
    assert all(2 <= x["launches_per_layer"] < 3 for x in rows.values()), rows


@pytest.mark.parametrize("tree", [False, True])
def test_graph_rows_time_a_captured_steps_host_side(tmp_path, tree):
    """--cuda-graph: a row per capturable format (KIVI's decode, not its trees) whose replays are free: the host side
    of a step (with --tree, a tree step's), far under the eager step's (no per-layer work); 0 launches counted (the
    replay's run on the GPU)."""
    out = tmp_path / "g.json"
    env = {**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""}
    r = subprocess.run([sys.executable, str(SCRIPT), "--layers", "4", "--tokens", "16" if tree else "6",
                        "--cuda-graph", "--formats", "fp32", "int4-kivi", "--json", str(out), *(["--tree"] * tree)],
                       capture_output=True, text=True, env=env, timeout=300, cwd=tmp_path)  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    rows = {x["variant"]: x for x in json.loads(out.read_text())["rows"]}
    assert "codesign-fp32-graph" in rows and ("codesign-int4-kivi-graph" in rows) is not tree
    g, eager = rows["codesign-fp32-graph"], rows["codesign-fp32"]
    assert g["launches_per_layer"] == 0 and 0 < g["ms_per_forward"] < eager["ms_per_forward"] / 2, rows


def test_quantized_weights_add_one_launch_a_linear(tmp_path):
    """--weights w4a16: the codesign rows' seven linears a layer are W4A16 GEMMs, one launch each (their K splits
    join in the launch); the sdpa row keeps transformers' linears. A weight format it does not know exits 2."""
    out = tmp_path / "h.json"
    env = {**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""}
    r = subprocess.run([sys.executable, str(SCRIPT), "--layers", "2", "--tokens", "3", "--formats", "int8",
                        "--weights", "w4a16", "--json", str(out)], capture_output=True, text=True, env=env,
                       timeout=300, cwd=tmp_path)  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    rows = {x["variant"]: x for x in json.loads(out.read_text())["rows"]}
    assert rows["hf-sdpa"]["launches_per_layer"] == 0 and rows["codesign-int8"]["launches_per_layer"] == 2 + 7
    r = subprocess.run([sys.executable, str(SCRIPT), "--weights", "w3a16"], capture_output=True, text=True, env=env,
                       timeout=120, cwd=tmp_path)  # fmt: skip
    assert r.returncode == 2 and "--weights 'w3a16'" in r.stderr


def test_gemm_host_time_counts_one_launch_a_call(tmp_path):
    """bench/gemm_host_time.py: every format's decode call is one launch (W8A8 / FP8 at M = 1: the fused quantizer;
    the weight-only GEMV and split-K: their splits joined in the launch)."""
    script = SCRIPT.parent / "gemm_host_time.py"
    out = tmp_path / "g.json"
    env = {**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""}
    r = subprocess.run([sys.executable, str(script), "--n", "256", "--k", "256", "--json", str(out)],
                       capture_output=True, text=True, env=env, timeout=300, cwd=tmp_path)  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert [x["format"] for x in rows] == ["w4a16", "w8a16", "w8a8", "fp8"]
    assert all(x["launches_per_call"] == 1 and x["us_per_call"] > 0 for x in rows), rows
    r = subprocess.run([sys.executable, str(script), "--k", "100"], capture_output=True, text=True, env=env,
                       timeout=120, cwd=tmp_path)  # fmt: skip
    assert r.returncode == 2 and "multiple of 128" in r.stderr
