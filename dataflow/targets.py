"""Mapping targets: where an operator can run and what each choice costs.

A target lists its units and, for an operator spec, the candidate placements:
(unit, seconds, seconds the shared DRAM channels are busy, energy, traffic).
The scheduler picks among candidates by cost unless the user pins a unit.

- `GPUTarget`: a catalogue GPU costed by the calibrated model in gpu_model.py;
  units "gpu" (SMs and HBM together) and "link" (NVLink/PCIe, so all-reduces can
  overlap compute). Energy is TDP x time: an upper bound, labelled as such.
  GEMMs with DF11 weights move their compressed bytes; with `df11_decode_bw` (bytes/s of decoded
  bf16) they also take at least the decode time (`roofline.df11_decode_s`, overlapped with the GEMM
  as the fused kernels do). Off by default until a GPU run measures the decoder.
  `serving=True` applies the serving terms fitted on published end-to-end measurements
  (serving_terms.py: achieved GEMM compute per GPU generation and dtype family, achieved GEMM
  bandwidth per generation, GEMV kernels over every SM); off by default, so the calibrated
  single-operator model stays what a plain `GPUTarget(gpu)` costs.
- `DesignTarget`: a simulated design costed by `accel_model.evaluate`. Where a
  design has optional units (PIM, KV-quant engines), the same operator is also
  costed on the design without them, which gives the alternative placement
  (e.g. decode attention on PIM vs on the systolic array + vector unit).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from dataclasses import dataclass, field

from codesign.catalog.gpus import GPUSpec, list_gpus, load_gpu
from codesign.dataflow.gpu_model import efficiencies, gpu_op_time
from codesign.dataflow.roofline import df11_decode_s
from codesign.dataflow.serving_terms import dtype_family, fitted_terms, generation, serving_efficiencies
from codesign.specs import (
    COLLECTIVES,
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


class _Target:
    """What both targets share: `candidates(spec)` computed once per spec and target."""

    def candidates(self, spec: OpSpec) -> tuple[Placement, ...]:
        memo = self.__dict__.setdefault("_candidates", {})
        hit = memo.get(spec)
        if hit is None:
            hit = memo[spec] = self._candidates_of(spec)
        return hit

    def _candidates_of(self, spec: OpSpec) -> tuple[Placement, ...]:
        raise NotImplementedError


class GPUTarget(_Target):
    """A catalogue GPU: one compute unit plus the interconnect."""

    kind = "gpu"

    def __init__(
        self, gpu: GPUSpec, launch: str = "graph", df11_decode_bw: float | None = None, serving: bool = False
    ):
        self.gpu = gpu
        self.df11_decode_bw = df11_decode_bw
        self.name = gpu.key
        self.launch = launch  # "graph" (serving with CUDA graphs) or "eager" (as the calibration measured)
        self.serving = serving
        self._eff = efficiencies(gpu)
        # serving: the efficiencies per dtype family of the GEMM (fp16/bf16 or fp8), scaled by the fitted terms
        self._eff_by_dtype = self._serving_efficiencies() if serving else None

    def _serving_efficiencies(self) -> dict[str, dict]:
        terms, gen = fitted_terms(), generation(self.gpu)
        memory = terms.factor(("memory", gen))
        return {
            d: serving_efficiencies(self.gpu, terms.factor(("compute", gen, d)), memory)
            for d in ("fp16", "fp8")
        }

    def _efficiencies_of(self, spec: OpSpec) -> dict:
        if self._eff_by_dtype is None:
            return self._eff
        return self._eff_by_dtype[dtype_family(spec.act_dtype) if isinstance(spec, Gemm) else "fp16"]

    def units(self) -> dict[str, int]:
        return {"gpu": 1, "link": 1}

    def memory_capacity_bytes(self) -> float:
        return self.gpu.mem_bytes

    def _candidates_of(self, spec: OpSpec) -> tuple[Placement, ...]:
        t = gpu_op_time(spec, self.gpu, self._efficiencies_of(spec), self.launch)
        t_decode = df11_decode_s(spec, self.df11_decode_bw)
        if t_decode > t:  # DF11 weights: the decode throughput, not the GEMM, sets the time
            dram = spec.min_bytes() / self.gpu.mem_bw
            return (Placement("gpu", t_decode, min(dram, t_decode), t_decode * self.gpu.tdp_w,
                              {"dram": spec.min_bytes()}, "decode"),)  # fmt: skip
        if isinstance(spec, COLLECTIVES):
            return (Placement("link", t, 0.0, t * self.gpu.tdp_w * 0.1, {"link": spec.min_bytes()}, "link"),)
        dram = spec.min_bytes() / self.gpu.mem_bw
        bound = "memory" if dram >= spec.flops() / self.gpu.peak(spec.peak_key()) else "compute"
        return (Placement("gpu", t, min(dram, t), t * self.gpu.tdp_w, {"dram": spec.min_bytes()}, bound),)


class DesignTarget(_Target):
    """A simulated accelerator design from accel_model.

    With a `CostCache`, placements are looked up there, keyed by the parts of the design `evaluate`
    reads for the operator (`accel_model.evaluate.design_fields_read`), so the targets sharing the cache
    whose designs differ only in units an operator never touches (PIM for a norm, the array for a KV
    write, the name) share its cost. The numbers are the same as without one (`cache=None`, the
    reference path: `evaluate` for every (variant, operator));
    tests/dataflow/explore/test_explore_speed.py checks equality.
    """

    kind = "design"

    def __init__(self, design, cache: CostCache | None = None, tokens: dict | None = None):
        self.design = design  # accel_model.design.Design
        self.name = design.name
        self.cache = cache
        # (variant index, fields read) -> interned cost key. Targets of designs equal in every field but
        # the name may pass one dict (explore.eval.EvalCache does), so keys are hashed once per design.
        self._tokens: dict[tuple, int] = {} if tokens is None else tokens

    @functools.cached_property
    def _no_pim(self):
        d = self.design
        return dataclasses.replace(d, pim=None, pim_gemv_max_batch=0) if d.pim else None

    @functools.cached_property
    def _no_kvq(self):
        d = self.design
        return dataclasses.replace(d, kv_quant=None) if d.kv_quant else None

    def units(self) -> dict[str, int]:
        # One slot per unit kind, not one per instance: the evaluator already spreads every op over all
        # instances (a GEMM's batches or N over the `count` arrays, vector work over lanes x count, KV
        # quantization over every engine), so a second op at the same time would use hardware the first
        # one's time already counts on.
        d = self.design
        u = {"systolic": 1, "vector": 1, "dram": 1, "link": 1}
        if d.pim is not None:
            u["pim"] = 1
        if d.kv_quant is not None:
            u["kv_quant"] = 1
        return u

    def memory_capacity_bytes(self) -> float:
        return self.design.memory.capacity_gb * 1e9

    def _variant_ids(self, spec: OpSpec) -> list[int]:
        """0: the design; 1: without PIM; 2: without KV-quant engines (for the operators those units take)."""
        d = self.design
        out = [0]
        if d.pim and isinstance(spec, _PIM_OPS):
            out.append(1)
        if d.kv_quant and isinstance(spec, _KVQ_OPS):
            out.append(2)
        return out

    def _variant(self, i: int):
        return (self.design, self._no_pim, self._no_kvq)[i]

    def _variants(self, spec: OpSpec) -> list:
        """The design, plus the design without PIM / KV-quant engines for the operators those units take."""
        return [self._variant(i) for i in self._variant_ids(spec)]

    def _token(self, i: int, spec: OpSpec) -> int:
        """Interned key of (the fields of variant i that evaluate(variant, spec) reads)."""
        from codesign.accel_model.evaluate import design_fields_read

        d = self.design
        # Variant fields without building the variant: 1 drops PIM, 2 drops the KV-quant engines.
        pim, gemv, kvq = d.pim, d.pim_gemv_max_batch, d.kv_quant
        if i == 1:
            pim, gemv = None, 0
        elif i == 2:
            kvq = None
        fields = design_fields_read(pim, gemv, spec)
        tk = self._tokens.get((i, fields))
        if tk is None:
            view = {"pim": pim, "pim_gemv_max_batch": gemv, "kv_quant": kvq}
            key = (fields, tuple(view[f] if f in view else getattr(d, f) for f in fields))
            tk = self._tokens[(i, fields)] = self.cache.token(key)
        return tk

    def _placement(self, v, spec: OpSpec) -> Placement:
        from codesign.accel_model.evaluate import evaluate

        r = evaluate(v, spec)
        unit = "dram" if r.unit in ("dram", "memory") else r.unit
        # PIM computes inside the DRAM: the channels are unavailable to others meanwhile.
        peak = self.design.memory.peak_gbps * 1e9
        dram_s = r.seconds if unit == "pim" else min(r.seconds, r.traffic.get("dram", 0.0) / peak)
        return Placement(
            unit,
            r.seconds,
            dram_s,
            r.energy_total_pj * 1e-12,
            dict(r.traffic),
            r.bound,
            {k: v * 1e-12 for k, v in r.energy_pj.items()},
        )

    def _candidates_of(self, spec: OpSpec) -> tuple[Placement, ...]:
        out: dict[str, Placement] = {}
        for i in self._variant_ids(spec):
            if self.cache is not None:
                key = (self._token(i, spec), spec)
                p = self.cache.placement(key, lambda i=i: self._placement(self._variant(i), spec))
            else:
                p = self._placement(self._variant(i), spec)
            if p.unit not in out or p.seconds < out[p.unit].seconds:
                out[p.unit] = p
        return tuple(out.values())


class CostCache:
    """Operator placements shared by the DesignTargets given it: cost key -> token, (token, spec) -> Placement.

    Placements are frozen and shared read-only. Tokens are never reused, so a target holding tokens from
    before a `clear` still gets its own design's costs.
    """

    def __init__(self, max_placements: int = 50_000):  # ~1-2 kB each (traffic and energy dicts)
        self.max_placements = max_placements
        self._keys: dict[tuple, int] = {}
        self._next = itertools.count()
        self._placements: dict[tuple, Placement] = {}

    def token(self, key: tuple) -> int:
        """The interned token of a cost key (the design fields an operator's cost reads, and their values)."""
        tk = self._keys.get(key)
        if tk is None:
            tk = self._keys[key] = next(self._next)
        return tk

    def placement(self, key: tuple, compute) -> Placement:
        """The placement stored under `key`, or `compute()` stored there (a full table is dropped whole)."""
        p = self._placements.get(key)
        if p is None:
            p = compute()
            if len(self._placements) >= self.max_placements:
                self._placements.clear()
            self._placements[key] = p
        return p

    def clear(self) -> None:
        """Forget every placement and cost key (benchmarks measure cold sweeps with it)."""
        self._placements.clear()
        self._keys.clear()


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
