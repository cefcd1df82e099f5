"""GPU catalogue: `GPUSpec` roofline records from gpus.yaml, looked up by key or by device name."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from codesign.specs.errors import CodesignError

CATALOG_FILE = Path(__file__).resolve().parent / "gpus.yaml"
PEAK_KEYS = ("fp32", "tf32", "fp16", "fp8", "int8")


@dataclass(frozen=True)
class GPUSpec:
    """Roofline figures of one GPU. Peaks in FLOP/s (or OP/s), bandwidths in bytes/s."""

    key: str
    name: str
    mem_bw: float
    mem_bytes: float
    peaks: dict[str, float]
    sms: int
    l2_bytes: float
    link_bw: float
    tdp_w: float
    die_mm2: float
    node: str
    match: tuple[str, ...] = ()
    sources: dict[str, str] = field(default_factory=dict)

    def peak(self, key: str) -> float:
        """Peak rate for a spec's `peak_key()`: a dtype key, "vector" (fp32 non-tensor) or "link"."""
        if key == "vector":
            return self.peaks["fp32"]
        if key == "link":
            return self.link_bw
        rate = self.peaks.get(key, 0.0)
        if rate <= 0:
            # No unit for this dtype (e.g. fp8 on A100): fall back to fp16 tensor cores, as kernels do.
            return self.peaks["fp16"]
        return rate


@functools.lru_cache(maxsize=1)
def _catalog() -> dict[str, GPUSpec]:
    with open(CATALOG_FILE) as f:
        data = yaml.safe_load(f)
    out = {}
    for key, raw in data["gpus"].items():
        out[key] = _parse(key, raw)
    return out


def _parse(key: str, raw: dict[str, Any]) -> GPUSpec:
    where = f"{CATALOG_FILE.name}:{key}"
    try:
        peaks = {k: float(raw["peak_tflops"][k]) * 1e12 for k in PEAK_KEYS}
        spec = GPUSpec(
            key=key,
            name=str(raw["name"]),
            mem_bw=float(raw["mem_bw_gbs"]) * 1e9,
            mem_bytes=float(raw["mem_gb"]) * 1e9,
            peaks=peaks,
            sms=int(raw["sms"]),
            l2_bytes=float(raw["l2_mb"]) * 2**20,
            link_bw=float(raw["link_gbs"]) * 1e9,
            tdp_w=float(raw["tdp_w"]),
            die_mm2=float(raw["die_mm2"]),
            node=str(raw["node"]),
            match=tuple(raw.get("match", ())),
            sources=dict(raw.get("sources", {})),
        )
    except (KeyError, TypeError, ValueError) as e:
        raise CodesignError(f"{where}: missing or malformed field {e}") from None
    if spec.mem_bw <= 0 or spec.peaks["fp16"] <= 0 or spec.peaks["fp32"] <= 0:
        raise CodesignError(f"{where}: mem_bw_gbs, peak fp16 and fp32 must be positive")
    return spec


def list_gpus() -> list[str]:
    """Keys of the catalogue's GPUs."""
    return sorted(_catalog())


def load_gpu(key: str) -> GPUSpec:
    """A catalogue GPU by key ("h100-sxm"), case-insensitive."""
    cat = _catalog()
    k = str(key).lower()
    if k not in cat:
        raise CodesignError(f"gpu {key!r} unknown; choose one of {', '.join(list_gpus())}")
    return cat[k]


def match_gpu_name(device_name: str) -> GPUSpec | None:
    """The catalogue entry whose `match` strings occur in a CUDA device name (longest match wins)."""
    best: tuple[int, GPUSpec] | None = None
    for spec in _catalog().values():
        for m in spec.match:
            if m.lower() in device_name.lower() and (best is None or len(m) > best[0]):
                best = (len(m), spec)
    return best[1] if best else None
