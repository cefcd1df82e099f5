"""Mapping targets: where an operator can run and what each choice costs.

A target lists its units and, for an operator spec, the candidate placements:
(unit, seconds, seconds the shared DRAM channels are busy, energy, traffic).
The scheduler picks among candidates by cost unless the user pins a unit.

- `GPUTarget`: a catalogue GPU costed by the calibrated model in gpu_model.py;
  units "gpu" (SMs and HBM together) and "link" (NVLink/PCIe, so all-reduces can
  overlap compute). Energy is TDP x time: an upper bound, labelled as such.
- `DesignTarget`: a simulated design costed by `accel_model.evaluate`. Where a
  design has optional units (PIM, KV-quant engines), the same operator is also
  costed on the design without them, which gives the alternative placement
  (e.g. decode attention on PIM vs on the systolic array + vector unit).
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field

from codesign.catalog.gpus import GPUSpec, list_gpus, load_gpu
from codesign.dataflow.gpu_model import efficiencies, gpu_op_time
from codesign.specs import (
    AllReduce,
    CodesignError,
    Gemm,
    KVDequantize,
    KVWrite,
    MoERouter,
    OpSpec,
    PagedDecodeAttention,
    PagedExtendAttention,
    TreeAttention,
)

# Operators accel_model.evaluate may place on PIM units / KV-quant engines (see its docstring).
_PIM_OPS = (Gemm, MoERouter, PagedDecodeAttention)
_KVQ_OPS = (KVWrite, KVDequantize, PagedDecodeAttention, PagedExtendAttention, TreeAttention)


@dataclass(frozen=True)
class Placement:
    """One way to run one operator."""

    unit: str
    seconds: float
    dram_seconds: float  # time the shared DRAM/HBM channels are occupied (<= seconds)
    energy_j: float
    traffic: dict[str, float] = field(default_factory=dict)
    bound: str = ""
    energy_by_action: dict[str, float] = field(default_factory=dict)


class GPUTarget:
    """A catalogue GPU: one compute unit plus the interconnect."""

    kind = "gpu"

    def __init__(self, gpu: GPUSpec, launch: str = "graph"):
        self.gpu = gpu
        self.name = gpu.key
        self.launch = launch  # "graph" (serving with CUDA graphs) or "eager" (as the calibration measured)
        self._eff = efficiencies(gpu)

    def units(self) -> dict[str, int]:
        return {"gpu": 1, "link": 1}

    def memory_capacity_bytes(self) -> float:
        return self.gpu.mem_bytes

    @functools.lru_cache(maxsize=4096)  # noqa: B019 - specs are hashable; targets live as long as a mapping
    def candidates(self, spec: OpSpec) -> tuple[Placement, ...]:
        t = gpu_op_time(spec, self.gpu, self._eff, self.launch)
        if isinstance(spec, AllReduce):
            return (Placement("link", t, 0.0, t * self.gpu.tdp_w * 0.1, {"link": spec.min_bytes()}, "link"),)
        dram = spec.min_bytes() / self.gpu.mem_bw
        bound = "memory" if dram >= spec.flops() / self.gpu.peak(spec.peak_key()) else "compute"
        return (Placement("gpu", t, min(dram, t), t * self.gpu.tdp_w, {"dram": spec.min_bytes()}, bound),)


class DesignTarget:
    """A simulated accelerator design from accel_model."""

    kind = "design"

    def __init__(self, design):  # accel_model.design.Design
        self.design = design
        self.name = design.name
        self._no_pim = dataclasses.replace(design, pim=None, pim_gemv_max_batch=0) if design.pim else None
        self._no_kvq = dataclasses.replace(design, kv_quant=None) if design.kv_quant else None

    def units(self) -> dict[str, int]:
        d = self.design
        u = {"systolic": d.systolic.count, "vector": d.vector.count, "dram": 1, "link": 1}
        if d.pim is not None:
            u["pim"] = 1
        if d.kv_quant is not None:
            u["kv_quant"] = d.kv_quant.count
        return u

    def memory_capacity_bytes(self) -> float:
        return self.design.memory.capacity_gb * 1e9

    def _variants(self, spec: OpSpec) -> list:
        """The design, plus the design without PIM / KV-quant engines for the operators those units take."""
        out = [self.design]
        if self._no_pim is not None and isinstance(spec, _PIM_OPS):
            out.append(self._no_pim)
        if self._no_kvq is not None and isinstance(spec, _KVQ_OPS):
            out.append(self._no_kvq)
        return out

    @functools.lru_cache(maxsize=4096)  # noqa: B019
    def candidates(self, spec: OpSpec) -> tuple[Placement, ...]:
        from codesign.accel_model.evaluate import evaluate

        peak = self.design.memory.peak_gbps * 1e9
        out: dict[str, Placement] = {}
        for v in self._variants(spec):
            r = evaluate(v, spec)
            unit = "dram" if r.unit in ("dram", "memory") else r.unit
            # PIM computes inside the DRAM: the channels are unavailable to others meanwhile.
            dram_s = r.seconds if unit == "pim" else min(r.seconds, r.traffic.get("dram", 0.0) / peak)
            p = Placement(
                unit,
                r.seconds,
                dram_s,
                r.energy_total_pj * 1e-12,
                dict(r.traffic),
                r.bound,
                {k: v * 1e-12 for k, v in r.energy_pj.items()},
            )
            if unit not in out or p.seconds < out[unit].seconds:
                out[unit] = p
        return tuple(out.values())


def make_target(name: str):
    """A GPUTarget for a catalogue GPU key, else a DesignTarget for a built-in design name or YAML path."""
    if name.lower() in list_gpus():
        return GPUTarget(load_gpu(name))
    from codesign.accel_model.design import builtin_designs, load_design

    try:
        return DesignTarget(load_design(name))
    except CodesignError as e:
        raise CodesignError(
            f"target {name!r} is neither a GPU ({', '.join(list_gpus())}) nor a design "
            f"({', '.join(builtin_designs())} or a YAML path): {e}"
        ) from None
