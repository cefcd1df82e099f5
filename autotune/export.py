"""Export the durable cache as per-GPU tables `<root>/<gpu-slug>/<op>.json` (atomic writes).

The table of (gpu, op) holds, per shape key and tuned M, the fastest *correct* config measured
with the current Triton version and kernel source (records of other versions are left out, so
the table's key describes every entry). Entries of an existing table with the same key are kept
unless the cache has a result for the same (shape key, M); a stale existing table is replaced.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

from codesign.autotune.cache import TuningCache, best_by_shape
from codesign.autotune.lookup import gpu_slug, reload_tables, table_header, table_key_problem


def atomic_write_json(path: Path, data: Any) -> None:
    """Write JSON to a temp file beside `path`, fsync, rename over `path`, fsync the folder.

    A reader (or a crash) sees either the old file or the new one, never a partial one.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=1, sort_keys=True)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    dfd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)
    reload_tables()  # this process's lookups see the new table


def export_table(
    cache: TuningCache,
    gpu: str,
    table_op: str,
    source_modules: list[str] | tuple[str, ...],
    dtype: str,
    root: Path,
) -> Path | None:
    """Write the table for (gpu, table_op) from `cache`; returns its path, or None if nothing to export."""
    head = table_header(table_op, gpu, list(source_modules))
    best = best_by_shape(
        cache.load().records, gpu=gpu, triton=head["triton"], source_hash=head["source_hash"], op=table_op,
        dtype=dtype,
    )  # fmt: skip
    if not best:
        return None
    path = Path(root) / gpu_slug(gpu) / f"{table_op}.json"
    entries: dict[str, dict[str, Any]] = {}
    timings: dict[str, dict[str, float]] = {}
    if path.is_file():
        try:
            old = json.loads(path.read_text())
            if (
                isinstance(old, dict)
                and isinstance(old.get("entries"), dict)
                and table_key_problem(old) is None
            ):
                entries = old["entries"]
                timings = old.get("timings_ms", {}) if isinstance(old.get("timings_ms"), dict) else {}
        except (OSError, ValueError):
            pass  # a corrupt old table is simply replaced
    for key, per_m in best.items():
        for m, (cfg, ms) in sorted(per_m.items()):
            entries.setdefault(key, {})[str(m)] = cfg
            timings.setdefault(key, {})[str(m)] = round(ms, 6)
    atomic_write_json(path, {**head, "dtype": dtype, "entries": entries, "timings_ms": timings})
    return path
