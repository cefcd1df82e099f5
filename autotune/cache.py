"""Durable tuning cache: one JSON line per measured config, appended and fsync'ed as it is measured.

Why JSON lines: a killed tuner loses at most the line it was writing, the file stays readable
by people and `jq`, and appending needs no rewrite. Each append takes an exclusive `flock` on the
file, writes the whole line with one `write`, then `fsync`s, so two tuning processes (or Ray
actors on one host's file system) writing the same cache interleave whole lines, never bytes.
If the file's last byte is not a newline (a writer was killed mid-line), the next append starts
a fresh line so the truncated fragment stays one bad line instead of corrupting a good one.

On load, lines that are not valid JSON or lack the record fields are reported (line numbers in
`LoadResult.problems`, and one warning) and skipped; every valid line is kept.

A point's identity (what resume skips) is (gpu, triton, source_hash, op, key, m, dtype, config):
a new Triton or a changed kernel source re-measures everything.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from codesign.autotune.space import config_id
from codesign.specs.errors import CodesignError

RECORD_VERSION = 1
# field -> accepted types; time_ms is None for a failed candidate.
_FIELDS: dict[str, tuple[type, ...]] = {
    "v": (int,),
    "gpu": (str,),
    "triton": (str, type(None)),
    "source_hash": (str,),
    "op": (str,),
    "key": (str,),
    "m": (int,),
    "dtype": (str,),
    "config": (dict,),
    "ok": (bool,),
    "time_ms": (float, int, type(None)),
}


def point_id(rec: dict[str, Any]) -> tuple:
    """Identity of a measured point: what `measured()` returns and resume skips."""
    return (
        rec["gpu"],
        rec["triton"],
        rec["source_hash"],
        rec["op"],
        rec["key"],
        rec["m"],
        rec["dtype"],
        config_id(rec["config"]),
    )


def _check_record(rec: Any) -> str | None:
    if not isinstance(rec, dict):
        return "not a JSON object"
    for name, types in _FIELDS.items():
        if name not in rec:
            return f"missing field {name!r}"
        if not isinstance(rec[name], types) or (isinstance(rec[name], bool) and bool not in types):
            return f"field {name!r} has type {type(rec[name]).__name__}"
    if rec["v"] != RECORD_VERSION:
        return f"record version {rec['v']} (expected {RECORD_VERSION})"
    if rec["ok"] and rec["time_ms"] is None:
        return "ok record without time_ms"
    return None


@dataclass
class LoadResult:
    """Valid records in file order, and one line per skipped bad line ('line N: why')."""

    records: list[dict[str, Any]] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)


class TuningCache:
    """Append-only JSON-lines cache at `path` (created on first append, parent folders too)."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        if self.path.exists() and not self.path.is_file():
            raise CodesignError(f"cache: {self.path} exists and is not a file")

    def append(self, rec: dict[str, Any]) -> None:
        """Validate `rec`, add host/pid/timestamp, append it as one line, fsync. Safe across processes."""
        rec = {"v": RECORD_VERSION, **rec}
        problem = _check_record(rec)
        if problem:
            raise CodesignError(f"cache record: {problem}")
        rec.setdefault("ts", time.time())
        rec.setdefault("host", socket.gethostname())
        rec.setdefault("pid", os.getpid())
        line = (json.dumps(rec, sort_keys=True) + "\n").encode()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            size = os.fstat(fd).st_size
            if size and os.pread(fd, 1, size - 1) != b"\n":
                line = b"\n" + line  # a killed writer left a partial line: do not glue onto it
            os.write(fd, line)
            os.fsync(fd)
        finally:
            os.close(fd)  # closing releases the lock

    def load(self, warn: bool = True) -> LoadResult:
        """Every valid record; bad lines (corrupt, truncated, wrong fields) are reported and skipped."""
        res = LoadResult()
        if not self.path.exists():
            return res
        with open(self.path, "rb") as f:
            data = f.read()
        for i, raw in enumerate(data.split(b"\n"), 1):
            if not raw.strip():
                continue
            try:
                rec = json.loads(raw)
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                res.problems.append(f"line {i}: not valid JSON ({e.msg if hasattr(e, 'msg') else e})")
                continue
            problem = _check_record(rec)
            if problem:
                res.problems.append(f"line {i}: {problem}")
                continue
            res.records.append(rec)
        if res.problems and warn:
            shown = "; ".join(res.problems[:3]) + (" ..." if len(res.problems) > 3 else "")
            warnings.warn(
                f"tuning cache {self.path}: skipped {len(res.problems)} bad line(s), kept "
                f"{len(res.records)}: {shown}",
                stacklevel=2,
            )
        return res

    def measured(self, records: list[dict[str, Any]] | None = None) -> dict[tuple, dict[str, Any]]:
        """point_id -> record for every measured point (the first measurement of a point wins)."""
        out: dict[tuple, dict[str, Any]] = {}
        for rec in self.load().records if records is None else records:
            out.setdefault(point_id(rec), rec)
        return out


def best_by_shape(
    records: list[dict[str, Any]], *, gpu: str, triton: str | None, source_hash: str, op: str, dtype: str
) -> dict[str, dict[int, tuple[dict[str, Any], float]]]:
    """key -> m -> (fastest correct config, its time in ms), over records matching the given identity.

    Records from another GPU, Triton version, kernel source or dtype are left out: the table's key
    must describe every entry in it. A (key, m) whose fastest record is the kernel's own default (the
    tuner's default trial, config {}) gets no entry: an untuned lookup already runs it.
    """
    best: dict[str, dict[int, tuple[dict[str, Any], float]]] = {}
    for r in records:
        if not r["ok"] or (r["gpu"], r["triton"], r["source_hash"], r["op"], r["dtype"]) != (
            gpu,
            triton,
            source_hash,
            op,
            dtype,
        ):
            continue
        slot = best.setdefault(r["key"], {})
        t = float(r["time_ms"])
        if r["m"] not in slot or t < slot[r["m"]][1]:
            slot[r["m"]] = (r["config"], t)
    for key in list(best):
        best[key] = {m: ct for m, ct in best[key].items() if ct[0]}
        if not best[key]:
            del best[key]
    return best
