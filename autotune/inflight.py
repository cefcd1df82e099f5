"""In-flight markers: which candidate a tuning process is running, so a hard crash is recorded, not retried.

A Triton config can kill its process outright (a segfault or abort in the compiler, an illegal
memory access that takes the CUDA context down): no Python `except` runs and nothing is appended
to the cache, so a resumed run would try the same config again and die again, forever. So,
before each candidate is launched, the tuner writes a marker file beside the cache,

    <cache>.inflight.<host>.<pid>   {"v": 1, "host", "pid", "start", "ts", "record": {identity + config}}

(fsync'ed, file and folder), and deletes it once the candidate's outcome is in the cache. A
marker whose process is gone therefore names the config that killed it. `recover_crashed` (run
by every Tuner on start, and by the `--isolate` supervisor after a child dies) appends a failed
record for it ("crashed the tuning process: ...", `crashed: true`) and removes the marker; resume
then treats the config like any failed one and never launches it again.

A process counts as gone when its pid is not running, is a zombie, or now belongs to a process
started at another time (pid reuse: the start time from /proc is kept in the marker). Markers of
another host (a shared file system) cannot be checked from here and are left alone. Two
recovering processes cannot both record one marker: each first claims it by an atomic rename.
The cache record format is unchanged (the extra fields are optional), so old caches load as before.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import threading
import time
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from codesign.autotune.cache import TuningCache

MARKER_VERSION = 1
CRASH_PREFIX = "crashed the tuning process"


def process_start(pid: int) -> int | None:
    """Start time of process `pid` in clock ticks since boot (/proc/<pid>/stat field 22), or None."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # The command name (field 2) may hold spaces and parentheses: split after its closing ')'.
    fields = stat[stat.rfind(")") + 2 :].split()
    return int(fields[19]) if len(fields) > 19 else None


def process_alive(pid: int, start: int | None = None) -> bool:
    """True while `pid` runs (not a zombie) and, when `start` is given, is the process started then."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # someone else's process: it exists
    try:
        state = Path(f"/proc/{pid}/stat").read_text()
        if state[state.rfind(")") + 2 :].split()[:1] == ["Z"]:
            return False  # exited, not yet reaped by its parent
    except OSError:
        return True  # no /proc (not Linux): trust kill(0)
    return start is None or process_start(pid) in (None, start)


def _host() -> str:
    return socket.gethostname()


def marker_glob(cache_path: Path) -> str:
    """Glob pattern of every marker of the cache at `cache_path`."""
    return f"{cache_path.name}.inflight.*"


def marker_path(cache_path: Path, pid: int | None = None, host: str | None = None) -> Path:
    """<cache>.inflight.<host>.<pid> for this process (or the given pid/host)."""
    host = (host or _host()).replace("/", "_")
    return cache_path.with_name(f"{cache_path.name}.inflight.{host}.{pid or os.getpid()}")


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class InflightMarker:
    """This process's marker for `cache`: `set(record)` before a launch, `clear()` after the outcome."""

    def __init__(self, cache: TuningCache) -> None:
        self.path = marker_path(cache.path)
        self._start = process_start(os.getpid())

    def set(self, record: dict[str, Any]) -> None:
        """Durably record that `record` (identity + config) is about to run in this process."""
        body = {"v": MARKER_VERSION, "host": _host(), "pid": os.getpid(), "start": self._start,
                "ts": time.time(), "record": record}  # fmt: skip
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.write(fd, json.dumps(body, sort_keys=True).encode())
            os.fsync(fd)
        finally:
            os.close(fd)
        _fsync_dir(self.path.parent)  # the new name itself must survive a machine crash

    def clear(self) -> None:
        """Remove the marker (the candidate's outcome is in the cache, or it never started)."""
        self.path.unlink(missing_ok=True)


def _parse_name(path: Path, cache_path: Path) -> tuple[str, int, int | None] | None:
    """(host, pid, claimer pid or None) of a marker file name."""
    rest = path.name[len(cache_path.name) + len(".inflight.") :]
    rest, _, claimer = rest.partition(".claimed.")
    host, _, pid = rest.rpartition(".")
    if not host or not pid.isdigit() or (claimer and not claimer.isdigit()):
        return None
    return host, int(pid), int(claimer) if claimer else None


def recover_crashed(
    cache: TuningCache, how: dict[int, str] | None = None, log: Any = None
) -> list[dict[str, Any]]:
    """Turn the markers of dead processes on this host into failed cache records; returns those records.

    how: pid -> description of its death (e.g. {1234: "killed by signal 11 (SIGSEGV)"}), known to a
    supervisor that reaped the child; other pids get "exit status unknown (found on restart)".
    Markers of live processes, and of other hosts, are left alone. An unreadable marker (its process
    died while writing it, before launching anything) is removed with a warning.
    """
    how = how or {}
    folder = cache.path.parent
    if not folder.is_dir():
        return []
    done: list[dict[str, Any]] = []
    for path in sorted(folder.glob(marker_glob(cache.path))):
        parsed = _parse_name(path, cache.path)
        if parsed is None:
            continue
        host, pid, claimer = parsed
        if host != _host().replace("/", "_"):
            continue
        if claimer is not None and (claimer == os.getpid() or process_alive(claimer)):
            continue  # another recovering process is on it (a dead claimer's marker is taken over)
        try:
            body = json.loads(path.read_text())
        except (OSError, ValueError):
            body = None
        # (This process's own pid is alive too, unless the marker is from an earlier process that had it.)
        if process_alive(pid, body.get("start") if isinstance(body, dict) else None):
            continue
        claimed = path.with_name(f"{path.name.partition('.claimed.')[0]}.claimed.{os.getpid()}")
        try:
            os.rename(path, claimed)  # atomic: only one recovering process gets it
        except FileNotFoundError:
            continue
        rec = body.get("record") if isinstance(body, dict) else None
        if not isinstance(rec, dict) or "config" not in rec:
            warnings.warn(f"tuning: removed unreadable in-flight marker {path.name}", stacklevel=2)
            claimed.unlink(missing_ok=True)
            continue
        if _outcome_recorded(cache, rec, body.get("ts")):
            # Killed after the candidate's outcome reached the cache but before the marker was
            # removed: the config did not crash anything, and a second record would duplicate it.
            claimed.unlink(missing_ok=True)
            continue
        why = how.get(pid, f"pid {pid}, exit status unknown (found on restart)")
        failed = {**rec, "ok": False, "time_ms": None, "error": f"{CRASH_PREFIX}: {why}", "crashed": True,
                  "pid": pid}  # fmt: skip
        try:
            cache.append(failed)
        except ValueError as e:  # a marker whose record does not validate: report, drop
            warnings.warn(f"tuning: in-flight marker {path.name} holds a bad record ({e})", stacklevel=2)
        else:
            done.append(failed)
            if log is not None:
                log(f"recorded crashed config {json.dumps(rec['config'], sort_keys=True)} of {rec.get('op')} "
                    f"{rec.get('key')} M={rec.get('m')}: {why}")  # fmt: skip
        claimed.unlink(missing_ok=True)
    return done


def _outcome_recorded(cache: TuningCache, rec: dict[str, Any], since: float | None) -> bool:
    """True when the cache holds a record of `rec`'s identity and config written at or after `since`."""
    return since is not None and any(
        r.get("ts", 0.0) >= since and all(r.get(k) == v for k, v in rec.items())
        for r in cache.load(warn=False).records
    )


@contextmanager
def sigterm_exits() -> Iterator[None]:
    """Inside the block, SIGTERM raises SystemExit(143) in the main thread (entry points use this).

    A terminated run (a batch system's time limit, `kill`) then unwinds: the tuner's `finally`
    removes the in-flight marker, so the interrupted candidate is measured again on resume instead
    of being recorded as a crash. SIGKILL cannot be caught: its candidate is recorded as crashed.
    The previous handler is restored on exit; off the main thread this does nothing.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def _raise(signum: int, frame: Any) -> None:
        raise SystemExit(128 + signum)

    old = signal.signal(signal.SIGTERM, _raise)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)


def describe_exit(code: int | None) -> str:
    """'killed by signal 11 (SIGSEGV)' for a negative multiprocessing exit code, else 'exit status N'."""
    if code is None:
        return "exit status unknown"
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = "?"
        return f"killed by signal {-code} ({name})"
    return f"exit status {code}"
