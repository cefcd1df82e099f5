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

import functools
import math
from collections import Counter
from dataclasses import dataclass
from typing import Any

import numpy as np

from codesign.dataflow.graph import build_step_graph
from codesign.dataflow.reports import resident_bytes
from codesign.dataflow.serving import load_azure_trace, simulate, synthetic_trace
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
    from codesign.catalog.models import load_model

    m = load_model(model)
    return m.layers * KVFormat.parse(kvf).bytes_per_token(m.kv_heads, m.head_dim)


def _interp(xs: list[int], ys: list[float], x: float) -> float:
    return float(np.interp(x, xs, ys)) if x <= xs[-1] else ys[-1] * x / xs[-1]


def _serve(
    target, model: str, fmt: dict[str, str], spec: str, capacity: float, weights: float
) -> dict[str, float]:
    kind, _, rest = spec.partition(":")
    if kind == "synthetic":
        n, rate = rest.split(":")[:2]
        from codesign.catalog.models import load_model

        trace = synthetic_trace(int(n), float(rate), max_context=load_model(model).max_context)
    else:
        trace = load_azure_trace(rest)
    kv_tok = max(0, int((capacity - weights) / _kv_bytes_per_token(model, fmt["kv"])))
    max_batch = 256
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

    def decode_time(b: int, ctx: int) -> float:
        return _interp(bs, fixed, b) + _interp(bs, per_tok, b) * ctx

    def prefill_time(tokens: int) -> float:
        return _interp(ps, pre, tokens)

    return simulate(trace, decode_time, prefill_time, kv_tok, max_batch).as_metrics() | {
        "kv_capacity_tokens": kv_tok
    }


def point_target(space, point: dict[str, Any]):
    """The DesignTarget of a point. Reuse it across a point's workloads: it caches operator costs."""
    from codesign.accel_model.design import design_from_dict
    from codesign.dataflow.targets import DesignTarget

    return DesignTarget(design_from_dict(space.design_dict(point), "point"))


def evaluate_point(space, point: dict[str, Any], workload: str, model: str, target=None) -> dict[str, Any]:
    """Metrics of one (design point, workload): throughput, latency, energy, area, power, fit."""
    target = target or point_target(space, point)
    design = target.design
    fmt = space.formats(point)
    area = sum(design.area_mm2().values())
    cap = capacity_bytes(design)
    out: dict[str, Any] = {"area_mm2": area, "capacity_gb": cap / 1e9}
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
