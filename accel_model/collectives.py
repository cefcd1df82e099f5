"""Collective cost per interconnect: a fixed latency, a per-ring-step latency, and ring bytes over the bus.

    t(all-reduce of n ranks) = latency + 2 (n - 1) hop + ring_bytes / (link_bw x bus_efficiency)
    t(all-to-all)            = latency + hop + sent_bytes / (link_bw x bus_efficiency)

ring_bytes = 2 (n - 1) / n x buffer (`AllReduce.min_bytes`); an all-to-all (MoE dispatch / combine) is one direct
step in which every rank sends its rows to the others at once over a switch (`AllToAll.min_bytes`). The figures
per interconnect and their sources are in designs/presets/interconnects.yaml (validated on load);
`gpu_interconnect` maps catalogue GPUs to them. The roofline keeps bytes / link_bw alone (a lower bound); the GPU
and design targets use this.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

import yaml

from codesign.specs import AllReduce, AllToAll, CodesignError

INTERCONNECT_FILE = Path(__file__).resolve().parent / "designs" / "presets" / "interconnects.yaml"


@dataclass(frozen=True)
class Interconnect:
    key: str
    name: str
    latency_s: float  # per collective
    hop_s: float  # per ring step
    bus_efficiency: float  # achieved bus bandwidth / per-direction line rate

    def all_reduce_s(self, spec: AllReduce, link_bw: float, engine: bool = False) -> float:
        """Seconds of a ring all-reduce of `spec` over links of `link_bw` bytes/s per direction; `engine`: a
        serving engine's, the faster of the ring and its one-shot all-reduce (interconnects.yaml)."""
        n = spec.world_size
        if n == 1:
            return 0.0
        if not link_bw > 0:
            raise CodesignError(f"an all-reduce over {n} ranks needs a link bandwidth > 0, got {link_bw!r}")
        ring = self.latency_s + 2 * (n - 1) * self.hop_s + spec.min_bytes() / (link_bw * self.bus_efficiency)
        if not engine:
            return ring
        latency_s, bus_bw = one_shot()
        return min(ring, latency_s + spec.min_bytes() / bus_bw)


    def all_to_all_s(self, spec: AllToAll, link_bw: float) -> float:
        """Seconds of an all-to-all in which each rank sends `spec.min_bytes()` over links of `link_bw` bytes/s."""
        if spec.world_size == 1 or spec.numel == 0:
            return 0.0
        if not link_bw > 0:
            n = spec.world_size
            raise CodesignError(f"an all-to-all over {n} ranks needs a link bandwidth > 0, got {link_bw!r}")
        return self.latency_s + self.hop_s + spec.min_bytes() / (link_bw * self.bus_efficiency)

    def collective_s(self, spec: AllReduce | AllToAll, link_bw: float, engine: bool = False) -> float:
        """Seconds of either collective (`engine`: the serving engines' all-reduce, `all_reduce_s`)."""
        if isinstance(spec, AllToAll):
            return self.all_to_all_s(spec, link_bw)
        return self.all_reduce_s(spec, link_bw, engine)


def _parse(key: str, raw: object, where: str) -> Interconnect:
    if not isinstance(raw, dict) or set(raw) != {"name", "latency_us", "hop_us", "bus_efficiency"}:
        raise CodesignError(f"{where}: interconnects.{key}: needs exactly name, latency_us, hop_us, bus_efficiency")
    nums = [raw[f] for f in ("latency_us", "hop_us", "bus_efficiency")]
    if any(isinstance(v, bool) or not isinstance(v, int | float) or v < 0 for v in nums) or not 0 < nums[2] <= 1:
        raise CodesignError(f"{where}: interconnects.{key}: latencies must be >= 0 and bus_efficiency in (0, 1]")
    return Interconnect(key, str(raw["name"]), nums[0] * 1e-6, nums[1] * 1e-6, float(nums[2]))


@functools.lru_cache(maxsize=4)
def load_interconnects(path: Path = INTERCONNECT_FILE) -> tuple[dict[str, Interconnect], dict[str, str]]:
    """(interconnects by key, catalogue GPU key -> interconnect key) from the YAML file, validated."""
    try:
        data = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as e:
        raise CodesignError(f"interconnect file {path}: {e}") from None
    where = path.name
    if not isinstance(data, dict) or data.get("version") != 1:
        raise CodesignError(f"{where}: expected a mapping with version: 1, interconnects and gpus")
    links = {str(k): _parse(str(k), v, where) for k, v in (data.get("interconnects") or {}).items()}
    gpus = {str(k): str(v) for k, v in (data.get("gpus") or {}).items()}
    unknown = sorted(v for v in gpus.values() if v not in links)
    if unknown or "chip_link" not in links:
        raise CodesignError(f"{where}: gpus name unknown interconnects {unknown}, or chip_link is missing")
    return links, gpus


@functools.lru_cache(maxsize=1)
def one_shot() -> tuple[float, float]:
    """(latency s, bus bytes/s) of the serving engines' one-shot all-reduce (interconnects.yaml)."""
    raw = yaml.safe_load(INTERCONNECT_FILE.read_text()).get("one_shot") or {}
    try:
        return float(raw["latency_us"]) * 1e-6, float(raw["bus_gbs"]) * 1e9
    except (KeyError, TypeError, ValueError):
        raise CodesignError(f"{INTERCONNECT_FILE.name}: one_shot needs latency_us and bus_gbs") from None



def interconnect(key: str) -> Interconnect:
    """The interconnect `key` (nvlink3, nvlink4, pcie, infinity_fabric, chip_link)."""
    links, _ = load_interconnects()
    if key not in links:
        raise CodesignError(f"interconnect {key!r} unknown; choose one of {', '.join(links)}")
    return links[key]


def gpu_interconnect(gpu_key: str) -> Interconnect:
    """The interconnect of a catalogue GPU; CodesignError naming the GPU when it has none listed."""
    _, gpus = load_interconnects()
    if gpu_key not in gpus:
        listed = ", ".join(gpus)
        raise CodesignError(f"GPU {gpu_key!r} has no interconnect in {INTERCONNECT_FILE.name} (listed: {listed})")
    return interconnect(gpus[gpu_key])
