"""Export the durable cache as per-GPU tables `<root>/<gpu-slug>/<op>.json` (atomic writes).

The table of (gpu, op) holds, per shape key and tuned M, the fastest *correct* config measured
with the current Triton version and kernel source (records of other versions are left out, so
the table's key describes every entry). Entries of an existing table with the same key are kept
unless the cache has a result for the same (shape key, M); a stale existing table is replaced.
For a kernel with variants, `export_variant_table` writes which variant is faster per (shape key, M).
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
    best = _best(cache, gpu, table_op, head, dtype)
    if not best:
        return None
    entries = {key: {str(m): cfg for m, (cfg, _) in per_m.items()} for key, per_m in best.items()}
    timings = {key: {str(m): round(ms, 6) for m, (_, ms) in per_m.items()} for key, per_m in best.items()}
    return _merge_write(Path(root) / gpu_slug(gpu) / f"{table_op}.json", head, dtype, entries, timings)


def export_variant_table(
    cache: TuningCache,
    gpu: str,
    variant_op: str,
    variant_configs: dict[str, dict[str, Any]],
    source_modules: list[str] | tuple[str, ...],
    dtype: str,
    root: Path,
) -> Path | None:
    """Write the kernel-variant table `variant_op` for `gpu`; returns its path, or None if nothing to export.

    variant_configs: each variant's table op -> its entry in this table (e.g. {"SPLITK": 1}). Entry at
    (shape key, M) = the entry of the variant whose fastest correct config is fastest, only where every
    variant was measured at that (key, M): a variant never timed there has not lost. timings_ms keeps
    each variant's best time, so a reader sees the margin.
    """
    head = table_header(variant_op, gpu, list(source_modules))
    per_variant = {
        t: _best(cache, gpu, t, table_header(t, gpu, list(source_modules)), dtype) for t in variant_configs
    }
    entries: dict[str, dict[str, Any]] = {}
    timings: dict[str, dict[str, Any]] = {}
    for key, per_m in next(iter(per_variant.values())).items():
        for m in per_m:
            times = {t: best[key][m][1] for t, best in per_variant.items() if m in best.get(key, {})}
            if len(times) < len(per_variant):
                continue
            winner = min(times, key=lambda t: (times[t], t))
            entries.setdefault(key, {})[str(m)] = dict(variant_configs[winner])
            timings.setdefault(key, {})[str(m)] = {t: round(ms, 6) for t, ms in sorted(times.items())}
    if not entries:
        return None
    return _merge_write(Path(root) / gpu_slug(gpu) / f"{variant_op}.json", head, dtype, entries, timings)


def _best(cache: TuningCache, gpu: str, table_op: str, head: dict[str, Any], dtype: str) -> dict:
    # Only records of this Triton version and kernel source: the table's key must describe every entry.
    return best_by_shape(
        cache.load().records, gpu=gpu, triton=head["triton"], source_hash=head["source_hash"], op=table_op,
        dtype=dtype,
    )  # fmt: skip


def _merge_write(
    path: Path, head: dict[str, Any], dtype: str, entries: dict[str, dict], timings: dict[str, dict]
) -> Path:
    """Write `entries` over those of an existing table at `path` with the same key (atomically)."""
    old_entries: dict[str, dict[str, Any]] = {}
    old_timings: dict[str, dict[str, Any]] = {}
    if path.is_file():
        try:
            old = json.loads(path.read_text())
            if (
                isinstance(old, dict)
                and isinstance(old.get("entries"), dict)
                and table_key_problem(old) is None
            ):
                old_entries = old["entries"]
                old_timings = old.get("timings_ms", {}) if isinstance(old.get("timings_ms"), dict) else {}
        except (OSError, ValueError):
            pass  # a corrupt old table is simply replaced
    for new, merged in ((entries, old_entries), (timings, old_timings)):
        for key, per_m in new.items():
            merged.setdefault(key, {}).update(per_m)
    atomic_write_json(path, {**head, "dtype": dtype, "entries": old_entries, "timings_ms": old_timings})
    return path
