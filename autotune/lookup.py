"""Run-time lookup of tuned kernel configs: the one place kernels get their launch parameters.

Tables are JSON files `<root>/<gpu-slug>/<op>.json`:

    {"version": 1, "op": "w4a16_gemm", "gpu": "NVIDIA H100 80GB HBM3",
     "triton": "3.9.0", "source_hash": "...",
     "entries": {"N=4096,K=4096": {"1": {...config...}, "16": {...}, "256": {...}}}}

Roots, highest precedence first: $CODESIGN_CONFIG_DIR (a user's own tuning
results), then the tables shipped in `codesign/autotune/configs/`. The shape key
is exact; the batch dimension M is bucketed to the nearest tuned M (vLLM's rule).
A missing table or entry returns the kernel's default, with one warning per
(op, gpu) so serving logs are not flooded. Nothing is ever timed here: tuning
happens offline (`codesign tune`), never inside an op call or a graph capture.
"""

from __future__ import annotations

import functools
import json
import os
import re
import warnings
from pathlib import Path
from typing import Any

SHIPPED_ROOT = Path(__file__).resolve().parent / "configs"
TABLE_VERSION = 1


def gpu_slug(name: str) -> str:
    """'NVIDIA H100 80GB HBM3' -> 'nvidia-h100-80gb-hbm3' (file-system safe)."""
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def shape_key(**dims: int) -> str:
    """Canonical key of the non-M dimensions, e.g. shape_key(N=4096, K=4096) -> 'K=4096,N=4096'."""
    return ",".join(f"{k}={int(v)}" for k, v in sorted(dims.items()))


def _roots() -> list[Path]:
    roots = []
    user = os.environ.get("CODESIGN_CONFIG_DIR")
    if user:
        roots.append(Path(user))
    roots.append(SHIPPED_ROOT)
    return roots


@functools.lru_cache(maxsize=256)
def _load_table(path: str, mtime_ns: int) -> dict[str, Any] | None:
    """Parse one table; a corrupt or wrong-version file is reported and ignored (returns None)."""
    try:
        with open(path) as f:
            data = json.load(f)
        if not isinstance(data, dict) or data.get("version") != TABLE_VERSION:
            raise ValueError(f"version {data.get('version') if isinstance(data, dict) else None!r}")
        if not isinstance(data.get("entries"), dict):
            raise ValueError("no 'entries' object")
        return data
    except (OSError, ValueError) as e:
        warnings.warn(f"ignoring config table {path}: {e}", stacklevel=3)
        return None


def _table(op: str, gpu: str) -> dict[str, Any] | None:
    for root in _roots():
        p = root / gpu_slug(gpu) / f"{op}.json"
        if p.is_file():
            t = _load_table(str(p), p.stat().st_mtime_ns)
            if t is not None:
                return t
    return None


@functools.lru_cache(maxsize=64)
def _warn_once(op: str, gpu: str) -> None:
    warnings.warn(f"no tuned config for {op} on {gpu!r}; using defaults (run `codesign tune`)", stacklevel=4)


def nearest_bucket(m: int, buckets: list[int]) -> int:
    """The tuned M closest to m (ties go to the larger, which over-provisions tiles safely)."""
    return min(buckets, key=lambda b: (abs(b - m), -b))


def lookup_config(op: str, gpu: str | None, m: int, key: str, default: dict[str, Any]) -> dict[str, Any]:
    """Config for `op` on `gpu` at batch `m` and shape `key`, else `default`.

    gpu None (CPU / interpreter runs) returns `default` silently: interpreter
    runs always use a fixed config. The returned dict is a fresh copy with the
    default's keys filled in where the table omits them.
    """
    if gpu is None:
        return dict(default)
    table = _table(op, gpu)
    entry = table["entries"].get(key) if table else None
    if not entry:
        _warn_once(op, gpu)
        return dict(default)
    try:
        buckets = sorted(int(b) for b in entry)
    except ValueError:
        warnings.warn(f"config table for {op} on {gpu!r}: non-integer M bucket in {key}", stacklevel=2)
        return dict(default)
    cfg = entry[str(nearest_bucket(m, buckets))]
    return {**default, **cfg}


def current_gpu_name(device: Any = None) -> str | None:
    """Name of the CUDA device `device` (or the current one), or None on CPU."""
    import torch

    if device is not None and getattr(device, "type", device) != "cuda":
        return None
    if not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_name(device)
