"""Evaluate one design point on one workload: the unit of work of an exploration.

Workloads (`Workload.key` strings, also used on the command line):
  decode:b16:c4096      one decode step, batch 16, 4096 KV tokens per sequence
  prefill:b1:c2048      one prefill step, batch 1, 2048-token prompts
  trace:synthetic:500:20   serving 500 synthetic requests arriving at 20/s
  trace:azure:PATH      serving an Azure-format trace CSV

Step cost uses the fast sequential evaluator: the operators of a step run one
after another, each on its cheapest unit (what the HEFT schedule gives for a
chain, minus cross-unit overlap); tests check it against the full schedule.
Costs are shared across the 32..80 identical layers, so one decode step costs
a few unique `evaluate` calls.
"""

from __future__ import annotations

import bisect
import copy
import functools
import itertools
import json
import math
from collections import Counter
from dataclasses import dataclass
from typing import Any

from codesign.accel_model.pim import area_mm2 as pim_area_mm2
from codesign.catalog.models import load_model
from codesign.dataflow.explore.space import point_key
from codesign.dataflow.graph import build_step_graph
from codesign.dataflow.reports import resident_bytes
from codesign.dataflow.serving import load_azure_trace, simulate, synthetic_trace
from codesign.dataflow.targets import CostCache, DesignTarget
from codesign.specs import CodesignError, KVFormat


@dataclass(frozen=True)
class Workload:
    kind: str
    batch: int = 1
    context: int = 2048
    trace: str = ""

    @property
    def key(self) -> str:
        if self.kind == "trace":
            return f"trace:{self.trace}"
        return f"{self.kind}:b{self.batch}:c{self.context}"

    @classmethod
    def parse(cls, text: str) -> Workload:
        parts = text.split(":")
        try:
            if parts[0] in ("decode", "prefill") and len(parts) == 3:
                return cls(parts[0], int(parts[1].lstrip("b")), int(parts[2].lstrip("c")))
            if parts[0] == "trace" and len(parts) >= 3 and parts[1] in ("synthetic", "azure"):
                if parts[1] == "synthetic":
                    int(parts[2]), float(parts[3])
                return cls("trace", trace=":".join(parts[1:]))
        except (ValueError, IndexError):
            pass
        raise CodesignError(
            f"workload {text!r}: expected decode:bB:cC, prefill:bB:cC, trace:synthetic:N:RATE or trace:azure:PATH"
        )


DEFAULT_WORKLOADS = (
    "decode:b1:c1024",
    "decode:b16:c4096",
    "decode:b64:c4096",
    "decode:b16:c8192",
    "prefill:b1:c2048",
    "trace:synthetic:1000:40",
)


def capacity_bytes(design) -> float:
    """Device memory of a design (its DRAM preset's capacity per unit x units)."""
    return design.memory.capacity_gb * 1e9


@functools.lru_cache(maxsize=256)
def _spec_counts(model: str, phase: str, batch: int, context: int, wf: str, kvf: str, act: str):
    g = build_step_graph(
        model, phase, batch=batch, context=context, weight_format=wf, kv_format=kvf, act_dtype=act
    )
    counts = Counter(d["spec"] for _, d in g.nodes(data=True))
    return tuple(counts.items()), resident_bytes(g), dict(g.graph)


def step_cost(
    target, model: str, phase: str, batch: int, context: int, fmt: dict[str, str]
) -> dict[str, float]:
    """Sequential step time, energy and the unit time split for one step."""
    counts, resident, _ = _spec_counts(model, phase, batch, context, fmt["weight"], fmt["kv"], fmt["act"])
    seconds = energy = 0.0
    by_unit: dict[str, float] = {}
    for spec, n in counts:
        p = min(target.candidates(spec), key=lambda c: (c.seconds, c.energy_j))
        seconds += n * p.seconds
        energy += n * p.energy_j
        by_unit[p.unit] = by_unit.get(p.unit, 0.0) + n * p.seconds
    return {
        "seconds": seconds,
        "energy_j": energy,
        "weights_bytes": resident["weights"],
        "kv_bytes": resident["kv_cache"],
        **{f"time_{u}": t for u, t in by_unit.items()},
    }


def _kv_bytes_per_token(model: str, kvf: str) -> float:
    m = load_model(model)
    vectors, width, latent = m.kv_cache_layout()
    return m.attention_layers * KVFormat.parse(kvf).bytes_per_token(vectors, width, latent=latent)  # (not linear)


def _interp(xs: list[int], ys: list[float], x: float) -> float:
    """Piecewise-linear in xs (increasing), linear through the origin beyond the last point.

    Up to xs[-1] this is `float(np.interp(x, xs, ys))` operation for operation (numpy's scalar
    kernel: y[j] at a knot or left of xs[0], else slope*(x - x[j]) + y[j] with slope from the segment
    and a retry from the right end on NaN), without numpy's per-call array overhead: the serving
    simulator calls it once per decode iteration. tests/dataflow/explore/test_explore_speed.py checks bit equality.
    """
    if x > xs[-1]:
        return ys[-1] * x / xs[-1]
    if x != x:
        return float(x)
    if x <= xs[0]:
        return float(ys[0])
    j = bisect.bisect_right(xs, x) - 1
    if j == len(xs) - 1 or x == xs[j]:
        return float(ys[j])
    x0, x1, y0, y1 = float(xs[j]), float(xs[j + 1]), float(ys[j]), float(ys[j + 1])
    slope = (y1 - y0) / (x1 - x0)
    r = slope * (float(x) - x0) + y0
    if r != r:  # NaN: numpy tries from the right end, then a flat segment's value
        r = slope * (float(x) - x1) + y1
        if r != r and y0 == y1:
            r = y0
    return r


def _serve(
    target, model: str, fmt: dict[str, str], spec: str, capacity: float, weights: float
) -> dict[str, float]:
    kind, _, rest = spec.partition(":")
    if kind == "synthetic":
        n, rate = rest.split(":")[:2]
        trace = synthetic_trace(int(n), float(rate), max_context=load_model(model).max_context)
    else:
        trace = load_azure_trace(rest)
    max_batch = 256
    # A linear-attention model's fixed states for as many sequences as can run, then the KV tokens that fit.
    cfg = load_model(model)
    left, kv_b = capacity - weights - max_batch * cfg.recurrent_state_bytes(), _kv_bytes_per_token(model, fmt["kv"])
    # (a model with no attention layer caches no token: only its states bound the batch)
    kv_tok = max(0, int(left / kv_b)) if kv_b else (max_batch * cfg.max_context if left >= 0 else 0)
    # Probe the step cost at a few batch sizes and prompt lengths; interpolate in between. Decode cost is
    # affine in the total context (attention reads every cached token once).
    bs = [1, 4, 16, 64, 256]
    ctx_ref = 1024
    fixed, per_tok = [], []
    for b in bs:
        c1 = step_cost(target, model, "decode", b, 1, fmt)["seconds"]
        c2 = step_cost(target, model, "decode", b, ctx_ref, fmt)["seconds"]
        per_tok.append(max(0.0, (c2 - c1) / (b * (ctx_ref - 1))))
        fixed.append(c1 - per_tok[-1] * b)
    ps = [128, 512, 2048, 8192]
    pre = [step_cost(target, model, "prefill", 1, min(p, 8192), fmt)["seconds"] for p in ps]

    coef: dict[int, tuple[float, float]] = {}  # batch -> (fixed, per-token): the simulator repeats batches

    def decode_time(b: int, ctx: int) -> float:
        c = coef.get(b)
        if c is None:
            c = coef[b] = (_interp(bs, fixed, b), _interp(bs, per_tok, b))
        return c[0] + c[1] * ctx

    def prefill_time(tokens: int) -> float:
        return _interp(ps, pre, tokens)

    return simulate(trace, decode_time, prefill_time, kv_tok, max_batch).as_metrics() | {
        "kv_capacity_tokens": kv_tok
    }


class EvalCache:
    """What the evaluations of a sweep share in one process: each distinct design built once, operator costs.

    Format parameters do not change a point's design, only its name, so points differing in formats share
    one validated design and its cost tokens; every target made here shares one `CostCache`
    (`DesignTarget` docstring). Holding the spaces it has seen keeps their ids unique.
    """

    def __init__(self, max_designs: int = 4096):
        self.costs = CostCache()
        self.max_designs = max_designs
        self._designs: dict[tuple[int, str], tuple[Any, dict]] = {}  # (space token, design params) -> design
        self._spaces: dict[int, tuple[Any, int]] = {}  # id(space) -> (space, token)
        self._space_ids = itertools.count()

    def _space_token(self, space) -> int:
        hit = self._spaces.get(id(space))
        if hit is None or hit[0] is not space:
            if len(self._spaces) >= 256:
                self._spaces.clear()  # tokens are never reused, so stale design entries just go unused
            hit = self._spaces[id(space)] = (space, next(self._space_ids))
        return hit[1]

    def target(self, space, point: dict[str, Any]):
        """The point's DesignTarget, its design built once per distinct design parameters."""
        from codesign.accel_model.design import design_from_dict

        dparams = {k: v for k, v in point.items() if not k.startswith("format.")}
        key = (self._space_token(space), json.dumps(dparams, sort_keys=True, default=str))
        hit = self._designs.get(key)
        if hit is None:
            if len(self._designs) >= self.max_designs:
                self._designs.clear()
            hit = self._designs[key] = (design_from_dict(space.design_dict(dparams), "point"), {})
        design, tokens = hit
        # The name is the one thing the format parameters change (Space.design_dict names by point key).
        name = f"{space.base.get('name', 'design')}-{point_key(point)[:8]}"
        if design.name != name:
            # A shallow copy keeps the validated sub-specs and cached properties (none depends on the name).
            design = copy.copy(design)
            object.__setattr__(design, "name", name)
        return DesignTarget(design, cache=self.costs, tokens=tokens)

    def clear(self) -> None:
        """Forget every design and operator cost (benchmarks measure cold sweeps with it)."""
        self._designs.clear()
        self.costs.clear()


def point_target(space, point: dict[str, Any], cache: EvalCache | None = None):
    """The DesignTarget of a point. Reuse it across a point's workloads: it caches operator costs.

    With an `EvalCache` the design and operator costs are shared with the cache's other points; without
    one, the reference path: validate the point's design mapping and evaluate every operator.
    """
    if cache is not None:
        return cache.target(space, point)
    from codesign.accel_model.design import design_from_dict

    return DesignTarget(design_from_dict(space.design_dict(point), "point"))


def evaluate_point(space, point: dict[str, Any], workload: str, model: str, target=None) -> dict[str, Any]:
    """Metrics of one (design point, workload): throughput, latency, energy, area, power, fit."""
    target = target or point_target(space, point)
    design = target.design
    fmt = space.formats(point)
    area = sum(design.area_mm2().values())
    cap = capacity_bytes(design)
    # PIM logic sits on the DRAM dies, not the accelerator die: its own metric, not in area_mm2.
    pim_logic = sum(pim_area_mm2(design.pim).values()) if design.pim is not None else 0.0
    out: dict[str, Any] = {"area_mm2": area, "pim_logic_mm2": pim_logic, "capacity_gb": cap / 1e9}
    w = Workload.parse(workload)
    if w.kind == "trace":
        weights = step_cost(target, model, "decode", 1, 1, fmt)["weights_bytes"]
        out["fits"] = weights < cap
        if out["fits"]:
            out.update(_serve(target, model, fmt, w.trace, cap, weights))
        return out
    c = step_cost(target, model, w.kind, w.batch, w.context, fmt)
    fits = c["weights_bytes"] + c["kv_bytes"] <= cap
    tokens = w.batch if w.kind == "decode" else w.batch * w.context
    out.update(
        {
            "fits": fits,
            "step_s": c["seconds"],
            "tokens_per_s": tokens / c["seconds"] if fits else 0.0,
            "energy_per_token_j": c["energy_j"] / tokens,
            "power_w": c["energy_j"] / c["seconds"],
            **{k: v for k, v in c.items() if k.startswith("time_")},
        }
    )
    if w.kind == "decode":
        out["tpot_s"] = c["seconds"]
    else:
        out["ttft_s"] = c["seconds"]
    return out


def gpu_reference(
    gpu_key: str, workload: str, model: str, fmt: dict[str, str] | None = None
) -> dict[str, Any]:
    """The same metrics for a catalogue GPU (reference points on the Pareto plots)."""
    from codesign.catalog.gpus import load_gpu
    from codesign.dataflow.targets import GPUTarget

    gpu = load_gpu(gpu_key)
    fmt = fmt or {"weight": "fp16", "kv": "fp16", "act": "fp16"}
    w = Workload.parse(workload)
    if w.kind == "trace":
        return {}
    c = step_cost(GPUTarget(gpu), model, w.kind, w.batch, w.context, fmt)
    tokens = w.batch if w.kind == "decode" else w.batch * w.context
    fits = c["weights_bytes"] + c["kv_bytes"] <= gpu.mem_bytes
    return {
        "area_mm2": gpu.die_mm2,
        "fits": fits,
        "step_s": c["seconds"],
        "tokens_per_s": tokens / c["seconds"] if fits else 0.0,
        "energy_per_token_j": gpu.tdp_w * c["seconds"] / tokens,
        "power_w": gpu.tdp_w,
        "tpot_s": c["seconds"] if w.kind == "decode" else math.nan,
    }
