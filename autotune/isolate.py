"""`codesign tune --isolate`: tuning in a child process, restarted after a crash, resuming from the cache.

The supervisor (this process) never launches a kernel: it starts a child with multiprocessing's
"spawn" (a fresh interpreter; forking a process that holds a CUDA context is unsafe), which runs
the Tuner over every task and writes its results to a JSON file. When the child dies abnormally
(a signal, an unexpected exit status, or `DeviceLost`), the supervisor turns the child's in-flight
marker into a failed record (`inflight.recover_crashed`, with the signal or exit status) and starts
a new child, which resumes from the durable cache: the crashing config is tried once only.

Restarts are bounded: at most `max_restarts`, and two deaths in a row that left no new record (the
child died outside any candidate: importing, building inputs) stop at once, since a restart would die
the same way. A Python error in the child (e.g. a CodesignError for a bad shape) is not a crash: it is
raised here as a CodesignError, without restart. All children of one run share its start time
(`Tuner.since`), so the per-shape budget covers the whole run, not each child.
"""

from __future__ import annotations

import importlib
import json
import multiprocessing as mp
import os
import signal
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from codesign.specs.errors import CodesignError

DEFAULT_MAX_RESTARTS = 20
EXIT_ERROR = 2  # the child raised a Python error: reported, not restarted
EXIT_DEVICE_LOST = 3  # the child recorded a candidate that left the GPU unusable: restart


@dataclass
class TuneJob:
    """What a child tunes: (op name, shapes) tasks into one cache, with Tuner settings.

    settings: Tuner keyword arguments (dtype, device, strategy, budget, seed; picklable).
    imports: modules the child imports first (modules that register extra tunable ops).
    """

    tasks: list[tuple[str, list[dict[str, int]]]]
    cache_path: str
    settings: dict[str, Any] = field(default_factory=dict)
    imports: tuple[str, ...] = ()


def _child_main(job: TuneJob, since: float, result_path: str) -> None:
    # Runs in the spawned child. Exit statuses: 0 done (results written), EXIT_ERROR a Python error
    # (message written), EXIT_DEVICE_LOST the GPU context is gone, 143 terminated; else a crash.
    from codesign.autotune.inflight import sigterm_exits

    with sigterm_exits():  # terminated, not crashed: the in-flight candidate is retried on resume
        _child_body(job, since, result_path)


def _child_body(job: TuneJob, since: float, result_path: str) -> None:
    def finish(payload: dict[str, Any], code: int) -> None:
        tmp = f"{result_path}.tmp"
        with open(tmp, "w") as f:
            json.dump(payload, f, default=str)
        os.replace(tmp, result_path)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)  # no interpreter teardown: nothing left to run in this child

    try:
        if job.settings.get("device") == "cpu":
            from codesign.backend import enable_interpreter_if_no_gpu

            enable_interpreter_if_no_gpu()  # before any kernel module defines its kernels
        for name in job.imports:
            importlib.import_module(name)
        from codesign.autotune.cache import TuningCache
        from codesign.autotune.ops import get_op
        from codesign.autotune.tuner import DeviceLost, Tuner

        cache = TuningCache(job.cache_path)
        results = []
        for op_name, shapes in job.tasks:
            tuner = Tuner(get_op(op_name), cache, since=since, **job.settings)
            results += [tuner.tune_shape(s).__dict__ for s in shapes]
    except DeviceLost as e:
        print(f"[tune child {os.getpid()}] {e}", file=sys.stderr)
        finish({"device_lost": str(e)}, EXIT_DEVICE_LOST)
    except Exception as e:
        msg = str(e) if isinstance(e, CodesignError) else f"{type(e).__name__}: {e}"
        finish({"error": msg, "trace": traceback.format_exc(limit=6)[-2000:]}, EXIT_ERROR)
    finish({"results": results}, 0)


def run_isolated(
    job: TuneJob, max_restarts: int = DEFAULT_MAX_RESTARTS, log: Callable[[str], None] = print
) -> list[dict[str, Any]]:
    """Tune `job` in child processes (see the module docstring); returns one result dict per shape."""
    from codesign.autotune.cache import TuningCache
    from codesign.autotune.inflight import describe_exit, recover_crashed

    if max_restarts < 0:
        raise CodesignError(f"max_restarts must be >= 0, got {max_restarts}")
    cache = TuningCache(job.cache_path)
    ctx = mp.get_context("spawn")
    since = time.time()
    restarts = idle_deaths = 0
    with tempfile.TemporaryDirectory(prefix="codesign-tune-") as tmp:
        while True:
            result_path = os.path.join(tmp, f"result-{restarts}.json")
            n_before = len(cache.load(warn=False).records)
            child = ctx.Process(target=_child_main, args=(job, since, result_path), name="codesign-tune")
            child.start()
            child.join()
            code = child.exitcode
            payload = _read(result_path)
            if code == 0 and payload and "results" in payload:
                return payload["results"]
            if code == EXIT_ERROR and payload and "error" in payload:
                raise CodesignError(f"tuning failed in the child process: {payload['error']}")
            if code == 128 + signal.SIGTERM:  # the child was terminated (its marker is cleared)
                raise CodesignError("the tuning child was terminated (SIGTERM); rerun to resume")
            why = "the GPU context became unusable" if code == EXIT_DEVICE_LOST else describe_exit(code)
            crashed = recover_crashed(cache, how={child.pid: why}, log=log)
            progressed = len(cache.load(warn=False).records) > n_before
            idle_deaths = 0 if progressed else idle_deaths + 1
            where = (
                f"while running config {json.dumps(crashed[0]['config'], sort_keys=True)} of {crashed[0]['op']}"
                if crashed
                else "outside any candidate"
            )
            log(f"tuning child {child.pid} died ({why}) {where}")
            if idle_deaths >= 2:
                raise CodesignError(
                    f"the tuning child died twice in a row without recording anything (last: {why}); "
                    "it fails outside any candidate (imports, inputs, reference), so a restart cannot help"
                )
            if restarts >= max_restarts:
                raise CodesignError(
                    f"the tuning child died {restarts + 1} times (last: {why}); gave up after "
                    f"--max-restarts {max_restarts}. The cache keeps every result; rerun to continue"
                )
            restarts += 1
            log(f"restarting the tuning child ({restarts}/{max_restarts}); it resumes from {cache.path}")


def _read(path: str) -> dict[str, Any] | None:
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None
