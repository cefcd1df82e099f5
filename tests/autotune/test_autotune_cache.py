"""Durable tuning cache: round trip, corrupt/truncated lines, two concurrent writer processes, resume after kill."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from codesign.autotune.cache import TuningCache, best_by_shape, point_id
from codesign.specs import CodesignError


def _rec(i: int, **over) -> dict:
    base = {"gpu": "G", "triton": "3.9.0", "source_hash": "h", "op": "op", "key": "K=1", "m": 1 + i % 3,
            "dtype": "float16", "config": {"BLOCK": i}, "ok": True, "time_ms": 1.0 + i}  # fmt: skip
    return {**base, **over}


def test_round_trip_and_best_by_shape(tmp_path):
    c = TuningCache(tmp_path / "sub" / "c.jsonl")
    for i in range(6):
        c.append(_rec(i))
    c.append(_rec(6, ok=False, time_ms=None, error="incorrect"))
    c.append(_rec(7, time_ms=0.1, source_hash="old"))  # another kernel version: must not win
    recs = c.load().records
    assert [r["config"]["BLOCK"] for r in recs] == list(range(8))
    best = best_by_shape(recs, gpu="G", triton="3.9.0", source_hash="h", op="op", dtype="float16")
    # m = 1 + i % 3: m=1 <- i in {0, 3}, m=2 <- {1, 4}, m=3 <- {2, 5}; fastest is the smallest i.
    assert {m: cfg["BLOCK"] for m, (cfg, _) in best["K=1"].items()} == {1: 0, 2: 1, 3: 2}
    assert len(c.measured()) == 8
    with pytest.raises(CodesignError, match="time_ms"):
        c.append(_rec(9, time_ms="fast"))


def test_corrupt_and_truncated_lines_are_reported_and_valid_ones_kept(tmp_path):
    p = tmp_path / "c.jsonl"
    c = TuningCache(p)
    c.append(_rec(0))
    with open(p, "a") as f:
        f.write("this is not json\n")
        f.write(json.dumps({k: v for k, v in _rec(1).items() if k != "config"}) + "\n")  # missing field
    c.append(_rec(2))
    full = json.dumps(_rec(3))
    with open(p, "a") as f:
        f.write(full[: len(full) // 2])  # a writer killed mid-line: no newline
    with pytest.warns(UserWarning, match="skipped 3 bad line"):
        res = c.load()
    assert [r["config"]["BLOCK"] for r in res.records] == [0, 2]
    assert [pr.split(":")[0] for pr in res.problems] == ["line 2", "line 3", "line 5"]
    # The next append must not glue onto the truncated fragment.
    c.append(_rec(4))
    with pytest.warns(UserWarning, match="skipped 3 bad line"):
        assert [r["config"]["BLOCK"] for r in c.load().records] == [0, 2, 4]


def _writer(path: str, worker: int, n: int) -> None:
    c = TuningCache(path)
    for i in range(n):
        # Long lines (several KB) make a torn or interleaved write visible as a JSON error.
        c.append(_rec(i, config={"BLOCK": i, "worker": worker, "pad": "x" * (3000 + 97 * worker)}))


def test_two_processes_writing_at_once_lose_nothing(tmp_path):
    p = str(tmp_path / "c.jsonl")
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_writer, args=(p, w, 150)) for w in range(2)]
    for pr in procs:
        pr.start()
    for pr in procs:
        pr.join(60)
        assert pr.exitcode == 0
    res = TuningCache(p).load(warn=False)
    assert res.problems == []
    got = sorted((r["config"]["worker"], r["config"]["BLOCK"]) for r in res.records)
    assert got == sorted((w, i) for w in range(2) for i in range(150))
    assert {r["pid"] for r in res.records} == {pr.pid for pr in procs}


# A script that tunes a fake op (pure torch, 30 configs, 50 ms each) into a cache, counting evaluations.
_SCRIPT = textwrap.dedent(
    """
    import os, sys, time
    os.environ["TRITON_INTERPRET"] = "1"
    import torch
    from codesign.autotune.cache import TuningCache
    from codesign.autotune.space import ConfigSpace
    from codesign.autotune.tuner import Tuner

    class Fake:
        name = "fake"
        source_modules = ("codesign.autotune.space",)
        def check_shape(self, s): pass
        def table_op(self, s): return "fake"
        def table_key(self, s): return "N=8"
        def m(self, s): return s["M"]
        def space(self, s, dtype, on_gpu): return ConfigSpace({"A": list(range(6)), "B": list(range(5))})
        def make_inputs(self, s, dtype, device, seed): return torch.randn(8, dtype=torch.float64)
        def input_bytes(self, x): return 64
        def run(self, x, cfg):
            with open(sys.argv[2], "a") as f:
                f.write(f"{cfg['A']},{cfg['B']}\\n")
            time.sleep(0.05)
            return x * 1.0
        def reference(self, x): return x.clone()
        def tolerance(self, dtype): return 1e-12

    t = Tuner(Fake(), TuningCache(sys.argv[1]), dtype=torch.float32, device="cpu", strategy="exhaustive",
              log=lambda s: None)
    r = t.tune_shape({"M": 1})
    print(r.n_new, r.n_known)
    """
)


@pytest.mark.slow
def test_resume_after_kill_skips_measured_points(tmp_path):
    script, cache, calls = tmp_path / "tune_fake.py", tmp_path / "c.jsonl", tmp_path / "calls.txt"
    script.write_text(_SCRIPT)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.Popen([sys.executable, str(script), str(cache), str(calls)], env=env)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if cache.exists() and cache.read_text().count("\n") >= 8:
            break
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait(10)
    done = {(r["config"]["A"], r["config"]["B"]) for r in TuningCache(cache).load(warn=False).records}
    first = len(done)
    assert 8 <= first < 30, f"the kill came too late to test resume ({first} of 30 recorded)"
    calls_before = len(calls.read_text().splitlines())
    out = subprocess.run([sys.executable, str(script), str(cache), str(calls)], env=env, capture_output=True,
                         text=True, timeout=120)  # fmt: skip
    assert out.returncode == 0, out.stderr
    n_new, n_known = map(int, out.stdout.split())
    recs = TuningCache(cache).load(warn=False).records
    # The candidate in flight at the kill left its in-flight marker: the rerun records it as crashed
    # (a kill -9 looks like a crash) and skips it. The kill may also land between two candidates.
    crashed = [r for r in recs if r.get("crashed")]
    assert len(crashed) <= 1 and all("found on restart" in r["error"] for r in crashed)
    assert (n_new, n_known) == (30 - first - len(crashed), first + len(crashed))
    assert len(recs) == 30 and len({point_id(r) for r in recs}) == 30, "lost or duplicated points"
    rerun = {tuple(map(int, line.split(","))) for line in calls.read_text().splitlines()[calls_before:]}
    assert rerun and not rerun & done, "a point measured before the kill was launched again"
