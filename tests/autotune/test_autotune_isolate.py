"""Crash isolation of the tuner, with real processes: in-flight markers, the --isolate supervisor, restarts.

A synthetic tunable op (no Triton) sleeps a config-dependent time and returns its input (exact).
One config, the one that would be fastest, kills its process: `os._exit(139)` (what a segfault
handler leaves), `os.abort()` (SIGABRT) or, outside any candidate, dies while building inputs.
It only dies in a child process; in the pytest process it raises instead, so a tuner that wrongly
retried it shows as a failed assertion, not a dead test run.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import subprocess
import sys
import time
import warnings

import pytest
import torch

from codesign import cli
from codesign.autotune import inflight
from codesign.autotune.cache import TuningCache
from codesign.autotune.isolate import TuneJob, run_isolated
from codesign.autotune.ops import register
from codesign.autotune.space import ConfigSpace, config_id
from codesign.autotune.tuner import DeviceLost, Tuner
from codesign.specs import CodesignError

OP = "test_crashy"
# Sleep per config in ms: the crashing config is the fastest; the best of the others is BLOCK=2, W=1.
# The gaps (>= 30 ms) are far beyond timer noise on a loaded machine (a CI run times with 2 test workers).
SLEEP_MS = {(1, 1): 50, (1, 2): 1, (2, 1): 5, (2, 2): 70, (4, 1): 35, (4, 2): 90}
CRASH = {"BLOCK": 1, "W": 2}
BEST_OTHER = {"BLOCK": 2, "W": 1}
# shape["kind"]: how CRASH fails. 1: os._exit(139), 2: os.abort(), 3: die building inputs (no candidate),
# 4: raise a sticky "CUDA" error, 5: hang (until terminated), 0: never.
EXIT, ABORT, DIE_OUTSIDE, STICKY, HANG, NONE = 1, 2, 3, 4, 5, 0


def _die(kind: int) -> None:
    if mp.parent_process() is None and "CRASHY_CHILD" not in os.environ:
        raise RuntimeError("the crashing config ran in the test process (it should have been skipped)")
    sys.stdout.flush()
    if kind == ABORT:
        os.abort()
    os._exit(139)


class CrashyOp:
    """A tunable op whose config CRASH kills the process (see the module docstring)."""

    name = OP
    source_modules = ("codesign.autotune.space",)

    def check_shape(self, shape):
        if set(shape) != {"M", "N", "kind"} or min(shape["M"], shape["N"]) < 1:
            raise CodesignError(f"shape for {OP}: expected dims M, N, kind; got {shape}")

    def table_op(self, shape):
        return OP

    def table_key(self, shape):
        return f"N={shape['N']}"

    def m(self, shape):
        return shape["M"]

    def space(self, shape, dtype, on_gpu):
        return ConfigSpace(params={"BLOCK": [1, 2, 4], "W": [1, 2]})

    def make_inputs(self, shape, dtype, device, seed):
        if shape["kind"] == DIE_OUTSIDE:
            _die(EXIT)
        x = torch.randn(shape["M"], shape["N"], generator=torch.Generator().manual_seed(seed))
        return {"x": x.to(dtype), "kind": shape["kind"]}

    def input_bytes(self, inputs):
        return inputs["x"].numel() * inputs["x"].element_size()

    def run(self, inputs, config):
        if config_id(config) == config_id(CRASH):
            if inputs["kind"] == STICKY:
                raise RuntimeError("CUDA error: an illegal memory access was encountered")
            if inputs["kind"] == HANG and mp.parent_process() is not None:
                time.sleep(120)
            if inputs["kind"] in (EXIT, ABORT):
                _die(inputs["kind"])
        time.sleep(SLEEP_MS[config["BLOCK"], config["W"]] / 1e3)
        return inputs["x"].clone()

    def reference(self, inputs):
        return inputs["x"].double()

    def tolerance(self, dtype):
        return 0.0


register(OP, CrashyOp)
SETTINGS = {"dtype": torch.float32, "device": "cpu", "strategy": "exhaustive"}


def _shape(kind: int) -> dict:
    return {"M": 3, "N": 5, "kind": kind}


def _records_of(cache: TuningCache, cfg: dict) -> list[dict]:
    return [r for r in cache.load().records if config_id(r["config"]) == config_id(cfg)]


def _markers(cache: TuningCache) -> list:
    return sorted(cache.path.parent.glob(inflight.marker_glob(cache.path)))


def test_isolated_tune_records_the_crash_once_and_picks_the_best_of_the_rest(tmp_path):
    cache = TuningCache(tmp_path / "c.jsonl")
    logs: list[str] = []
    job = TuneJob([(OP, [_shape(ABORT)])], str(cache.path), SETTINGS, imports=("test_autotune_isolate",))
    (res,) = run_isolated(job, log=logs.append)
    assert res["best"] == BEST_OTHER and res["n_crashed"] == 1
    # One run across two children: 5 measured + 1 crash, none counted as "known from before".
    assert (res["n_new"], res["n_known"], res["n_failed"]) == (6, 0, 1)
    (crash,) = _records_of(cache, CRASH)  # tried once only
    assert crash["ok"] is False and crash["crashed"] is True
    assert crash["error"] == "crashed the tuning process: killed by signal 6 (SIGABRT)"
    assert len(cache.load().records) == 6 and not _markers(cache)
    assert any("died (killed by signal 6" in s for s in logs) and any("restarting" in s for s in logs)

    # A rerun (here in this process: CRASH would raise, and be recorded, if launched) measures nothing.
    again = Tuner(CrashyOp(), cache, log=lambda s: None, **SETTINGS).tune_shape(_shape(ABORT))
    assert again.best == BEST_OTHER and again.n_new == 0 and len(cache.load().records) == 6


def _tune_without_isolation(cache_path: str, kind: int) -> None:
    Tuner(CrashyOp(), TuningCache(cache_path), log=lambda s: None, **SETTINGS).tune_shape(_shape(kind))


def test_a_killed_plain_run_leaves_a_marker_that_the_next_run_records_as_a_crash(tmp_path):
    cache = TuningCache(tmp_path / "c.jsonl")
    child = mp.get_context("spawn").Process(target=_tune_without_isolation, args=(str(cache.path), EXIT))
    child.start()
    child.join()
    assert child.exitcode == 139
    (marker,) = _markers(cache)
    body = json.loads(marker.read_text())
    assert body["pid"] == child.pid and body["record"]["config"] == CRASH and body["record"]["op"] == OP
    assert not _records_of(cache, CRASH)  # the crash itself wrote nothing to the cache

    logs: list[str] = []
    tuner = Tuner(CrashyOp(), cache, log=logs.append, **SETTINGS)  # recovery happens on start
    (crash,) = _records_of(cache, CRASH)
    assert crash["crashed"] and crash["pid"] == child.pid and "exit status unknown" in crash["error"]
    assert not _markers(cache) and any("recorded crashed config" in s for s in logs)
    res = tuner.tune_shape(_shape(EXIT))  # would raise in this process if CRASH were tried again
    assert res.best == BEST_OTHER and len(_records_of(cache, CRASH)) == 1
    assert res.n_new + res.n_known == 6


def _tune_until_terminated(cache_path: str) -> None:
    with inflight.sigterm_exits():
        _tune_without_isolation(cache_path, HANG)


def test_a_terminated_run_is_not_taken_for_a_crash(tmp_path):
    # SIGTERM (a batch system's time limit) unwinds the tuner: the marker goes, nothing is recorded.
    cache = TuningCache(tmp_path / "c.jsonl")
    child = mp.get_context("spawn").Process(target=_tune_until_terminated, args=(str(cache.path),))
    child.start()
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        try:
            if json.loads(_markers(cache)[0].read_text())["record"]["config"] == CRASH:
                break  # the hanging config is in flight
        except (IndexError, OSError, ValueError, KeyError):
            pass
        time.sleep(0.05)
    child.terminate()
    child.join(30)
    assert child.exitcode == 143
    assert not _markers(cache) and not _records_of(cache, CRASH) and len(cache.load().records) == 1
    assert inflight.recover_crashed(cache) == []


def test_a_termination_while_the_marker_is_written_leaves_no_marker(tmp_path, monkeypatch):
    # The process test above can terminate the child between the marker's write and its fsyncs
    # (the test sees the marker as soon as it is written): here that moment, made deterministic.
    cache = TuningCache(tmp_path / "c.jsonl")

    def _terminated(folder):
        raise SystemExit(143)

    monkeypatch.setattr(inflight, "_fsync_dir", _terminated)
    tuner = Tuner(CrashyOp(), cache, log=lambda s: None, **SETTINGS)
    with pytest.raises(SystemExit):
        tuner.tune_shape(_shape(NONE))
    assert not _markers(cache) and not cache.load().records


def test_restarts_are_bounded(tmp_path):
    cache = TuningCache(tmp_path / "c.jsonl")
    job = TuneJob([(OP, [_shape(EXIT)])], str(cache.path), SETTINGS, imports=("test_autotune_isolate",))
    with pytest.raises(CodesignError, match="died 1 times .*exit status 139.*--max-restarts 0"):
        run_isolated(job, max_restarts=0, log=lambda s: None)
    assert len(_records_of(cache, CRASH)) == 1  # the crash is recorded even when giving up

    # Dying outside any candidate records nothing: the second such death stops the run.
    job = TuneJob([(OP, [_shape(DIE_OUTSIDE)])], str(tmp_path / "d.jsonl"), SETTINGS,
                  imports=("test_autotune_isolate",))  # fmt: skip
    with pytest.raises(CodesignError, match="died twice in a row without recording anything"):
        run_isolated(job, log=lambda s: None)


def test_a_python_error_in_the_child_is_reported_not_restarted(tmp_path):
    job = TuneJob([(OP, [{"M": 3}])], str(tmp_path / "c.jsonl"), SETTINGS, imports=("test_autotune_isolate",))
    t0 = time.monotonic()
    with pytest.raises(CodesignError, match=r"tuning failed in the child process: shape for test_crashy"):
        run_isolated(job, log=lambda s: None)
    assert time.monotonic() - t0 < 60
    with pytest.raises(CodesignError, match="max_restarts"):
        run_isolated(job, max_restarts=-1)


def test_a_sticky_device_error_is_recorded_and_stops_the_process(tmp_path, monkeypatch):
    # On a GPU, device_usable() syncs; here it is told the context is gone after the "CUDA" error.
    cache = TuningCache(tmp_path / "c.jsonl")
    monkeypatch.setattr(Tuner, "device_usable", lambda self: False)
    tuner = Tuner(CrashyOp(), cache, log=lambda s: None, **SETTINGS)
    with pytest.raises(DeviceLost, match="left the GPU unusable"):
        tuner.tune_shape(_shape(STICKY))
    (rec,) = _records_of(cache, CRASH)
    assert rec["device_lost"] and "illegal memory access" in rec["error"] and not _markers(cache)
    monkeypatch.undo()
    res = Tuner(CrashyOp(), cache, log=lambda s: None, **SETTINGS).tune_shape(_shape(STICKY))
    assert res.best == BEST_OTHER and len(_records_of(cache, CRASH)) == 1


def test_markers_of_live_processes_are_left_alone_and_unreadable_ones_removed(tmp_path):
    cache = TuningCache(tmp_path / "c.jsonl")
    rec = {"gpu": "G", "triton": None, "source_hash": "h", "op": OP, "key": "N=5", "m": 3, "dtype": "float32",
           "config": CRASH}  # fmt: skip
    parent = os.getppid()
    live = inflight.marker_path(cache.path, parent)
    live.write_text(json.dumps({"pid": parent, "start": inflight.process_start(parent), "record": rec}))
    dead_pid = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                              text=True, check=True).stdout.strip()  # fmt: skip
    broken = inflight.marker_path(cache.path, int(dead_pid))
    broken.write_text('{"pid": ')  # its process died while writing it
    other_host = inflight.marker_path(cache.path, 1, host="elsewhere")
    other_host.write_text(json.dumps({"pid": 1, "record": rec}))
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        assert inflight.recover_crashed(cache) == []
    assert any("unreadable in-flight marker" in str(x.message) for x in w)
    assert live.exists() and other_host.exists() and not broken.exists()
    assert not cache.path.exists()

    # ... but a live pid that started at another time is a reused pid: its marker's process is gone.
    live.write_text(json.dumps({"pid": parent, "start": -1, "record": rec}))
    (got,) = inflight.recover_crashed(cache, how={parent: "killed by signal 9 (SIGKILL)"})
    assert got["error"].endswith("killed by signal 9 (SIGKILL)") and not live.exists()
    assert _records_of(cache, CRASH)[0]["pid"] == parent
    # This process's own pid: a marker left by an earlier process that had the same pid is recovered.
    mine = inflight.marker_path(cache.path)
    mine.write_text(json.dumps({"pid": os.getpid(), "start": -1, "record": {**rec, "config": BEST_OTHER}}))
    assert len(inflight.recover_crashed(cache)) == 1 and not mine.exists()
    assert inflight.describe_exit(-11) == "killed by signal 11 (SIGSEGV)" and inflight.describe_exit(139) == (
        "exit status 139"
    )


def test_a_marker_whose_outcome_reached_the_cache_is_not_a_crash(tmp_path):
    # A kill between `cache.append` and `marker.clear`: the config ran to completion, so the rerun must
    # neither record it as crashed nor hold two records of it (this race once failed CI's resume test).
    cache = TuningCache(tmp_path / "c.jsonl")
    rec = {"gpu": "G", "triton": None, "source_hash": "h", "op": OP, "key": "N=5", "m": 3, "dtype": "float32",
           "config": BEST_OTHER}  # fmt: skip
    dead = int(subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                              text=True, check=True).stdout)  # fmt: skip
    marker = inflight.marker_path(cache.path, dead)
    marker.write_text(json.dumps({"pid": dead, "start": -1, "ts": time.time() - 1, "record": rec}))
    cache.append({**rec, "ok": True, "time_ms": 5.0})
    assert inflight.recover_crashed(cache) == [] and not marker.exists()
    assert [r["ok"] for r in cache.load().records] == [True]
    # The same marker with an outcome from before it was written (another run's) is still a crash.
    marker.write_text(json.dumps({"pid": dead, "start": -1, "ts": time.time() + 1, "record": rec}))
    (got,) = inflight.recover_crashed(cache)
    assert got["crashed"] and not marker.exists() and len(cache.load().records) == 2


def test_cli_isolate(tmp_path, capsys):
    cache = tmp_path / "c.jsonl"
    common = ["tune", "--import", "test_autotune_isolate", "--op", OP, "--device", "cpu", "--cache", str(cache),
              "--strategy", "exhaustive"]  # fmt: skip
    assert (
        cli.main([*common, "--shape", "M=3,N=5,kind=1", "--isolate", "--json", str(tmp_path / "r.json")]) == 0
    )
    (res,) = json.loads((tmp_path / "r.json").read_text())
    assert res["best"] == BEST_OTHER and res["n_crashed"] == 1
    (crash,) = _records_of(TuningCache(cache), CRASH)
    assert crash["error"] == "crashed the tuning process: exit status 139"
    assert cli.main([*common, "--shape", "M=3,N=5,kind=0", "--isolate", "--engine", "ray"]) == 2
    assert cli.main([*common, "--shape", "M=3,N=5,kind=0", "--isolate", "--max-restarts", "-1"]) == 2
    assert cli.main([*common[:2], "no_such_module_xyz", "--list"]) == 2
    err = capsys.readouterr().err
    assert "--isolate works with --engine local only" in err and "--max-restarts must be >= 0" in err
    assert "--import no_such_module_xyz" in err
