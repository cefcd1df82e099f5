"""The GPU model against published end-to-end measurements (measured_latencies.yaml), leave-one-source-out.

Each row is one published number (its source, engine and setting beside it). What is compared:

    ttft                      prefill(batch, input)                                    [+ client overhead]
    token_latency             decode(batch, input + output / 2) + step overhead
    generation_throughput     output / value: prefill + (output - 1) x (decode(mid) + step overhead)
    static_batch_throughput   output x batch / (value x tp): the same whole-batch generation time
    e2e                       the same generation time
    op                        one operator (LLMCompass), PyTorch eager, as the GPU model is calibrated

Steps are the GPU model (`gpu_model.gpu_op_time`, CUDA-graph launches for the engines, the interconnect's
collectives) summed over the step graph; decode is affine in the context, so (output - 1) steps at the mid
context are the sum over the generation. Four serving terms, each a physical effect, are fitted on the rows
of the *other* sources (leave-one-source-out: no row is judged by terms fitted on its own source):

- compute: achieved fraction of the calibrated GEMM compute rate, per GPU generation and dtype family
  (fp16/bf16 vs fp8): LLMCompass's square fp16 GEMMs are not an engine's prefill, and fp8 GEMMs reach less
  of their peak;
- memory: achieved fraction of the calibrated GEMM bandwidth per generation (decode weight streaming);
- step: host time per model step (scheduling, sampling, what CUDA graphs do not remove);
- client: per-request overhead of TTFTs measured at a client (streaming HTTP / tokenization: LMDeploy's
  FTL, NIM's AIPerf), zero for engine-side timers.

A generation or dtype family only the held-out source has keeps the calibrated rate (factor 1). The op rows
are the GPU model's own calibration source (LLMCompass): they are reported in-sample, apart.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from codesign.accel_model.collectives import gpu_interconnect
from codesign.catalog.gpus import GPUSpec, load_gpu
from codesign.catalog.models import ModelConfig, load_model
from codesign.dataflow.gpu_model import efficiencies, gpu_op_time
from codesign.dataflow.graph import build_step_graph
from codesign.specs import AllReduce, CodesignError, Gemm, OpSpec

DATA_FILE = Path(__file__).resolve().parent / "measured_latencies.yaml"
MEASURES = ("ttft", "token_latency", "generation_throughput", "static_batch_throughput", "e2e", "op")
GENERATION = {"a100-80gb": "ampere", "h100-sxm": "hopper", "h200": "hopper", "l40s": "ada", "mi300x": "cdna3"}
# Engines whose all-reduces are NCCL's ring (FasterTransformer 5, LMDeploy 0.1's TurboMind; LLMCompass times
# nccl-tests); the others run a one-shot all-reduce for small messages (accel_model/collectives.py).
RING_ENGINES = ("fastertransformer_gpt_a100", "lmdeploy_a100_v010a1", "llmcompass_a100")
# TTFTs timed at a client (streaming, HTTP, tokenization) rather than inside the engine.
CLIENT_TIMED = ("lmdeploy_a100_v010a1", "nim_llm_benchmark")
# Fit grids of the serving terms (coordinate descent on mean |log(predicted / measured)|).
FACTOR_GRID = np.linspace(0.5, 1.1, 25)
STEP_GRID = np.linspace(0.0, 4e-3, 17)
CLIENT_GRID = np.linspace(0.0, 20e-3, 21)


@dataclass(frozen=True)
class Row:
    """One measurement, with the step graphs it is predicted from: (kind, weight, {spec: count})."""

    id: str
    source: str
    measure: str
    seconds: float
    gpu: GPUSpec
    generation: str
    dtype: str  # "fp16" (fp16/bf16) or "fp8"
    parts: tuple[tuple[str, int, tuple[tuple[OpSpec, int], ...]], ...]
    setting: str


@dataclass(frozen=True)
class Terms:
    """The serving terms (module docstring); factors by ("compute", generation, dtype) / ("memory", generation)."""

    factors: tuple[tuple[tuple[str, ...], float], ...] = ()
    step_s: float = 0.0
    request_s: float = 0.0
    client_s: float = 0.0

    def factor(self, key: tuple[str, ...]) -> float:
        return dict(self.factors).get(key, 1.0)

    def replace(self, key: Any, value: float) -> Terms:
        if key in ("step_s", "request_s", "client_s"):
            return dataclasses.replace(self, **{key: value})
        return dataclasses.replace(self, factors=tuple(sorted({**dict(self.factors), key: value}.items())))


def _model(raw: Any, where: str) -> ModelConfig:
    if isinstance(raw, str):
        return load_model(raw)
    if not isinstance(raw, dict):
        raise CodesignError(f"{where}: model must be a catalogue name or a mapping of dimensions")
    fields = {k: v for k, v in raw.items() if k != "from"}
    try:
        return ModelConfig(**fields)
    except TypeError as e:
        raise CodesignError(f"{where}: model: {e}") from None


def _specs(m: ModelConfig, phase: str, batch: int, ctx: int, tp: int, fmt: dict) -> tuple[tuple[OpSpec, int], ...]:
    g = build_step_graph(m, phase, batch, ctx, fmt["weight"], fmt["kv"], tp, fmt["act"])
    return tuple(Counter(d["spec"] for _, d in g.nodes(data=True)).items())


def _measured_seconds(raw: dict) -> float:
    """The compared time of a row: its `seconds`, or a throughput's generation time (module docstring)."""
    if raw["measure"] == "generation_throughput":
        return raw["output"] / raw["value"]
    if raw["measure"] == "static_batch_throughput":
        return raw["output"] * raw["batch"] / (raw["value"] * raw["tp"])
    return float(raw["seconds"])


def _op_spec(op: dict) -> OpSpec:
    from codesign.dataflow.llmcompass_ref import gpt3_layer_specs

    if "gemm" in op:
        return Gemm(*op["gemm"])
    return gpt3_layer_specs(op["phase"])[op["gpt3_layer"]]


def _parts(raw: dict) -> tuple:
    """The step graphs a row's time is made of (module docstring's table)."""
    if raw["measure"] == "op":
        return (("op", 1, ((_op_spec(raw["op"]), 1),)),)
    m, fmt = _model(raw["model"], raw["id"]), raw["formats"]
    tp, b, i, o = raw["tp"], raw["batch"], raw["input"], raw["output"]
    decode_specs = _specs(m, "decode", b, i + o // 2, tp, fmt)
    if raw["measure"] == "token_latency":
        return (("decode", 1, decode_specs),)
    decode = ("decode", max(1, o - 1), decode_specs)
    prefill = ("prefill", 1, _specs(m, "prefill", b, i, tp, fmt))
    if raw["measure"] == "ttft":
        return (prefill,)
    return (prefill, decode) if o > 1 else (prefill,)


def load_rows(path: Path = DATA_FILE) -> tuple[list[Row], list[tuple[str, str]]]:
    """(predictable rows, [(id, why not predicted)]) of the validation set, validated."""
    data = yaml.safe_load(path.read_text())
    if not isinstance(data, dict) or data.get("version") != 1 or not isinstance(data.get("rows"), list):
        raise CodesignError(f"{path.name}: expected version: 1, sources and rows")
    rows, skipped = [], []
    for raw in data["rows"]:
        where = f"{path.name}: {raw.get('id', '?')}"
        if raw.get("source") not in data["sources"] or raw.get("measure") not in MEASURES:
            raise CodesignError(f"{where}: unknown source or measure (measures: {', '.join(MEASURES)})")
        if raw.get("not_predicted"):
            skipped.append((raw["id"], raw["not_predicted"]))
            continue
        dtype = "fp8" if raw.get("formats", {}).get("act", "fp16").startswith("fp8") else "fp16"
        gpu = load_gpu(raw["gpu"])
        rows.append(Row(raw["id"], raw["source"], raw["measure"], _measured_seconds(raw), gpu,
                        GENERATION[gpu.key], dtype, _parts(raw), raw.get("setting", "")))  # fmt: skip
    return rows, skipped


@functools.lru_cache(maxsize=1 << 16)
def _step(gpu_key: str, specs: tuple, kind: str, compute: float, memory: float, ring: bool) -> float:
    """Seconds of one step graph with the matmul family's rates scaled (op rows: the GPU model as calibrated);
    `ring`: the engine's all-reduces are NCCL's ring (else the faster of it and a one-shot all-reduce)."""
    gpu = load_gpu(gpu_key)
    eff = efficiencies(gpu)
    mm = eff["matmul"]
    eff = {**eff, "matmul": dataclasses.replace(mm, compute=mm.compute * compute, memory=min(1.0, mm.memory * memory))}
    launch = "eager" if kind == "op" else "graph"
    link = gpu_interconnect(gpu.key)
    return sum(
        n * (link.all_reduce_s(spec, gpu.link_bw, engine=not ring) if isinstance(spec, AllReduce)
             else gpu_op_time(spec, gpu, eff, launch))  # fmt: skip
        for spec, n in specs
    )


def predict(row: Row, terms: Terms) -> float:
    """Predicted seconds of the row's compared time (module docstring)."""
    if row.measure == "op":
        return _step(row.gpu.key, row.parts[0][2], "op", 1.0, 1.0, True)
    kc = terms.factor(("compute", row.generation, row.dtype))
    km = terms.factor(("memory", row.generation))
    ring = row.source in RING_ENGINES
    t = 0.0
    for kind, weight, specs in row.parts:
        extra = terms.step_s if kind == "decode" else terms.request_s
        t += weight * (_step(row.gpu.key, specs, kind, kc, km, ring) + extra)
    if row.measure == "ttft" and row.source in CLIENT_TIMED:
        t += terms.client_s
    return t


def _loss(rows: list[Row], terms: Terms) -> float:
    return float(np.mean([abs(math.log(predict(r, terms) / r.seconds)) for r in rows]))


def fit(rows: list[Row], passes: int = 2) -> Terms:
    """Serving terms minimizing mean |log error| over `rows` (coordinate descent on the grids)."""
    keys: list[Any] = sorted(
        {("compute", r.generation, r.dtype) for r in rows} | {("memory", r.generation) for r in rows}
    )
    keys += ["step_s", "request_s", "client_s"]
    grids = {"step_s": STEP_GRID, "request_s": STEP_GRID, "client_s": CLIENT_GRID}
    terms = Terms()
    for _ in range(passes):
        for k in keys:
            _, best = min((_loss(rows, terms.replace(k, float(v))), float(v)) for v in grids.get(k, FACTOR_GRID))
            terms = terms.replace(k, best)
    return terms


def leave_one_source_out(rows: list[Row]) -> dict[str, float]:
    """Row id -> predicted / measured, each source's rows predicted with terms fitted on the other sources."""
    serving = [r for r in rows if r.measure != "op"]
    out = {}
    for src in sorted({r.source for r in serving}):
        terms = fit([r for r in serving if r.source != src])
        out.update({r.id: predict(r, terms) / r.seconds for r in serving if r.source == src})
    out.update({r.id: predict(r, Terms()) / r.seconds for r in rows if r.measure == "op"})
    return out


def summary(ratios: dict[str, float], rows: list[Row]) -> dict[str, float]:
    """Mean and max |error| of the serving rows, and how many are beyond 25%."""
    err = [abs(ratios[r.id] - 1) for r in rows if r.measure != "op"]
    return {"rows": len(err), "mean": float(np.mean(err)), "max": float(np.max(err)),
            "beyond_25": int(sum(e > 0.25 for e in err))}  # fmt: skip


def print_report(path: Path = DATA_FILE) -> None:
    rows, skipped = load_rows(path)
    loso = leave_one_source_out(rows)
    print(f"Measured-latency validation ({path.name}): predicted / measured, leave-one-source-out")
    for r in rows:
        tag = "  (calibration source, in-sample)" if r.measure == "op" else ""
        print(f"  {r.id:<20} {r.source:<27} {r.measure:<24} {loso[r.id]:6.3f}{tag}")
    for rid, why in skipped:
        print(f"  {rid:<20} not predicted: {why}")
    s = summary(loso, rows)
    print(f"serving rows {s['rows']}: mean |err| {100 * s['mean']:.1f}%, max {100 * s['max']:.1f}%, "
          f"{s['beyond_25']} beyond 25%")  # fmt: skip
    t = fit([r for r in rows if r.measure != "op"])
    print("terms fitted on every serving row:", ", ".join(f"{'/'.join(k)} {v:.3f}" for k, v in t.factors),
          f"step {t.step_s * 1e3:.2f} ms, request {t.request_s * 1e3:.2f} ms, client {t.client_s * 1e3:.1f} ms")
