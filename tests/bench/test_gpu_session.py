"""bench/gpu_session.sh keeps to its deadline: a lent GPU runs one command of at most 600 s, so the script caps
every step by what is left, skips (and says so) what no longer fits, and leaves what finished in $OUT.

Run here with a stand-in Python that only sleeps and records its arguments: the script's own logic, no GPU."""

from __future__ import annotations

import os
import subprocess
import tarfile
import time
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "gpu_session.sh"


def _run(tmp_path: Path, session_seconds: int, suite_sleep: float) -> tuple[subprocess.CompletedProcess, float, Path]:
    """The script with a stand-in Python whose GPU suite takes `suite_sleep` seconds (everything else none)."""
    calls = tmp_path / "calls.txt"
    stub = tmp_path / "python"
    stub.write_text(f'#!/bin/sh\necho "$*" >> {calls}\ncase "$*" in *gpu_suite.py*) sleep {suite_sleep};; esac\n')
    stub.chmod(0o755)
    out = tmp_path / "out"
    env = {**os.environ, "OUT": str(out), "PYTHON": str(stub), "SESSION_SECONDS": str(session_seconds),
           "PACK_RESERVE": "1", "TUNE_SECONDS": "3"}  # fmt: skip
    t0 = time.monotonic()
    r = subprocess.run(["bash", str(SCRIPT)], env=env, capture_output=True, text=True, timeout=120,
                       cwd=SCRIPT.parents[1])  # fmt: skip
    return r, time.monotonic() - t0, out


def test_every_step_runs_when_there_is_time(tmp_path):
    r, _, out = _run(tmp_path, 300, 0)
    assert r.returncode == 0, r.stderr
    calls = (tmp_path / "calls.txt").read_text()
    assert "bench/gpu_suite.py --out" in calls and "-m pytest -q -m gpu" in calls
    # tuning needs 30 s of budget even when TUNE_SECONDS is smaller: the stand-in's 3 s limit skips it
    log = (out / "log.txt").read_text()
    assert "skipped tuning paged_attention_int8 (3 s for it, tuning needs 30)" in log and "gpu_session: done" in log
    with tarfile.open(out / "extra.tgz") as t:
        assert "./gpu_tests.txt" in t.getnames()


def test_a_step_past_the_deadline_is_cut_the_rest_skipped_and_what_finished_kept(tmp_path):
    r, wall, out = _run(tmp_path, 10, 60)
    assert r.returncode == 0, r.stderr
    assert wall < 10 + 4, wall  # the suite cut at the deadline (less the packing reserve), nothing after it
    calls = (tmp_path / "calls.txt").read_text()
    assert "pip install" in calls and "gpu_suite.py" in calls and "-m pytest" not in calls, calls
    log = (out / "log.txt").read_text()
    assert "skipped the gpu tests (session deadline" in log and "skipped tuning paged_attention_mixed" in log, log
    assert (out / "extra.tgz").is_file() and not (out / "extra.tgz.part").exists()
