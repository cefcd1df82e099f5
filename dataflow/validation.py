"""The GPU model against published end-to-end measurements (measured_latencies.yaml), leave-one-source-out.

Each row is one published number (its source, engine and setting beside it). What is compared:

    ttft                      prefill(batch, input)
    token_latency             decode(batch, input + output / 2) + step overhead
    generation_throughput     output / value: prefill + (output - 1) x (decode(mid) + step overhead)
    static_batch_throughput   output x batch / (value x tp): the same whole-batch generation time
    e2e                       the same generation time
    op                        one operator (LLMCompass), PyTorch eager, as the GPU model is calibrated

plus the client overhead, once, on rows timed at a client of a server (`timer: client` in the data).

Steps are the GPU model (`gpu_model.gpu_op_time`, CUDA-graph launches for the engines, the interconnect's
collectives) summed over the step graph; decode is affine in the context, so (output - 1) steps at the mid
context are the sum over the generation. The serving terms (serving_terms.py: achieved compute per GPU
generation and dtype family, achieved bandwidth per generation, host time per step (shared by the CUDA
engines, apart for ROCm's) and per request, the client overhead, the per-kernel launch interval of engines
without CUDA graphs) are fitted
on the rows of the *other* sources (leave-one-source-out: no row is judged by terms fitted on its own
source). A generation or dtype family only the held-out source has keeps the calibrated rate (factor 1); a
software stack only it has takes the shared per-step term.
The op rows are the GPU model's own calibration source (LLMCompass): they are reported in-sample, apart.

Rows the model still misses by more than 25% carry a `known_miss:` reason in the data file (the report
prints it); `python -m codesign.dataflow.validation --write-terms` regenerates serving_terms.yaml, the
terms fitted on every serving row.
"""

from __future__ import annotations

import argparse
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
from codesign.dataflow.gpu_model import gpu_op_time
from codesign.dataflow.gpu_model import terms as gpu_terms
from codesign.dataflow.graph import build_step_graph
from codesign.dataflow.serving_terms import (
    STACK,
    TERMS_FILE,
    Terms,
    dtype_family,
    generation,
    serving_efficiencies,
    terms_yaml,
)
from codesign.specs import AllReduce, CodesignError, Gemm, OpSpec, PagedDecodeAttention

DATA_FILE = Path(__file__).resolve().parent / "measured_latencies.yaml"
MEASURES = ("ttft", "token_latency", "generation_throughput", "static_batch_throughput", "e2e", "op")
# Engines whose all-reduces are NCCL's ring (FasterTransformer 5, LMDeploy 0.1's TurboMind; LLMCompass times
# nccl-tests); the others run a one-shot all-reduce for small messages (accel_model/collectives.py).
RING_ENGINES = ("fastertransformer_gpt_a100", "lmdeploy_a100_v010a1", "llmcompass_a100")
# Engines that launch every kernel from the host, without CUDA graphs (the `launch_s` term): FasterTransformer
# and LMDeploy 0.1's TurboMind (derived from it) are C++ loops of kernel launches; TensorRT-LLM 0.5's CUDA
# graphs were an opt-in flag of gptSessionBenchmark only, unsupported in its serving path
# (NVIDIA/TensorRT-LLM issue #402, Nov 2023). TensorRT-LLM 0.9's performance doc does not say; it stays
# with the graph engines (vLLM, gpt-fast's torch.compile "reduce-overhead", NIM).
EAGER_ENGINES = ("fastertransformer_gpt_a100", "lmdeploy_a100_v010a1", "nvidia_blog_h100_trtllm")
# Fit grids of the serving terms (coordinate descent on mean |log(predicted / measured)|). Factors reach down
# to 0.3: with a floor of 0.5 three factors of the all-rows fit sat on it, which hides how far the rows pull.
FACTOR_GRID = np.linspace(0.3, 1.1, 33)
# The host terms stop at 4 ms, a prior (an engine's host work per step or request is ms-scale), not a fit:
# held out, TensorRT-LLM's TTFTs take the request term near this top (3.75 ms: other engines' short-prompt rows
# pull it up); with a 10 ms top they take 10 ms and the mean error goes from 10.6% to 13.1%.
STEP_GRID = np.linspace(0.0, 4e-3, 17)
CLIENT_GRID = np.linspace(0.0, 20e-3, 21)
LAUNCH_GRID = np.linspace(0.0, 20e-6, 21)
GRIDS = {"step_s": STEP_GRID, "request_s": STEP_GRID, "client_s": CLIENT_GRID, "launch_s": LAUNCH_GRID}
# Weak prior toward the calibrated rate: each factor's fit adds PRIOR x |log factor| to the summed |log error|
# of its rows, so a factor moves only as far as the rows pay for. Without it a factor the rows barely see
# drifts to the grid's floor (hopper/fp16 compute: only three H200 decode-bound rows, 0.3 vs 1.0 changes
# their summed |log error| by 0.025), and GPUTarget(serving=True) would slow every H100 BF16 prefill 3x.
PRIOR = 0.05
# Coordinate descent runs to a fixed point (4-6 passes on these rows): the step terms trade against the memory
# factors, so a value fitted before those settle does not stand.
MAX_PASSES = 10
MISS = 0.25  # |predicted / measured - 1| beyond which a row needs a known_miss reason


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
    known_miss: str = ""  # why the model misses the row by more than 25%, where it does
    client_timed: bool = False  # `timer: client`: timed at a client of a server (adds the client term once)


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


class Specs(tuple):
    """A step graph's (spec, count) pairs, hashed and compared by identity: the fit looks each one up in
    `_step`'s cache thousands of times, and hashing the specs themselves dominated its time."""

    __slots__ = ()

    def __hash__(self) -> int:
        return id(self)

    def __eq__(self, other: object) -> bool:
        return self is other


def _specs(
    m: ModelConfig, phase: str, batch: int, ctx: int, tp: int, fmt: dict
) -> tuple[tuple[OpSpec, int], ...]:
    g = build_step_graph(m, phase, batch, ctx, fmt["weight"], fmt["kv"], tp, fmt["act"])
    return Specs(Counter(d["spec"] for _, d in g.nodes(data=True)).items())


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
        return (("op", 1, Specs(((_op_spec(raw["op"]), 1),))),)
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


def _client_timed(raw: dict, where: str) -> bool:
    timer = raw.get("timer", "engine")
    if timer not in ("engine", "client") or (timer == "client" and not raw.get("timer_why")):
        raise CodesignError(
            f"{where}: timer must be engine or client (client with timer_why: the source's words)"
        )
    return timer == "client"


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
        dtype = dtype_family(raw.get("formats", {}).get("act", "fp16"))
        gpu = load_gpu(raw["gpu"])
        rows.append(Row(raw["id"], raw["source"], raw["measure"], _measured_seconds(raw), gpu, generation(gpu),
                        dtype, _parts(raw), raw.get("setting", ""), raw.get("known_miss", ""),
                        _client_timed(raw, where)))  # fmt: skip
    return rows, skipped


@functools.lru_cache(maxsize=1 << 16)
def _step(
    gpu_key: str, specs: tuple, kind: str, compute: float, memory: float, ring: bool, floor: float = 0.0
) -> float:
    """Seconds of one step graph: op rows as the GPU model is calibrated (PyTorch eager), serving steps with
    the matmul rates scaled and the serving GEMV rule (serving_terms.serving_efficiencies); `ring`: the
    engine's all-reduces are NCCL's ring (else the faster of it and a one-shot all-reduce); `floor`: the
    least seconds a kernel takes (an eager engine's launch interval, `launch_s`)."""
    gpu = load_gpu(gpu_key)
    link = gpu_interconnect(gpu.key)
    if kind == "op":
        return sum(n * gpu_op_time(spec, gpu) for spec, n in specs)
    eff = serving_efficiencies(gpu, compute, memory)
    return sum(
        n
        * (
            link.all_reduce_s(spec, gpu.link_bw, engine=not ring)
            if isinstance(spec, AllReduce)
            else max(floor, gpu_op_time(spec, gpu, eff, "graph", _pieces(spec, gpu_key)))
        )
        for spec, n in specs
    )


@functools.lru_cache(maxsize=1 << 14)
def _pieces(spec: OpSpec, gpu_key: str) -> Any:
    """`gpu_model.terms` of one operator on a catalogue GPU, kept across the fit's efficiencies."""
    return gpu_terms(spec, load_gpu(gpu_key))


def predict(row: Row, terms: Terms) -> float:
    """Predicted seconds of the row's compared time (module docstring)."""
    if row.measure == "op":
        return _step(row.gpu.key, row.parts[0][2], "op", 1.0, 1.0, True)
    kc = terms.factor(("compute", row.generation, row.dtype))
    km = terms.factor(("memory", row.generation))
    ring = row.source in RING_ENGINES
    floor = terms.launch_s if row.source in EAGER_ENGINES else 0.0
    t = 0.0
    for kind, weight, specs in row.parts:
        extra = terms.step(row.generation) if kind == "decode" else terms.request_s
        t += weight * (_step(row.gpu.key, specs, kind, kc, km, ring, floor) + extra)
    if row.client_timed:
        t += terms.client_s
    return t


def _loss(rows: list[Row], terms: Terms) -> float:
    """Mean |log(predicted / measured)| plus the factors' prior (PRIOR), per row."""
    err = sum(abs(math.log(predict(r, terms) / r.seconds)) for r in rows)
    # No rows (a term no row depends on, `fit`): every value ties, and the fit keeps its grid's least.
    return (err + PRIOR * sum(abs(math.log(v)) for _, v in terms.factors)) / max(1, len(rows))


def _moves(key: Any, row: Row) -> bool:
    """Whether term `key` can change `row`'s prediction (`predict`): a factor its generation's (and dtype's) rows,
    a step term rows with decode steps (a stack's, that stack's), the request term rows with other parts, the
    client and launch terms the rows they apply to."""
    kinds = {kind for kind, _, _ in row.parts}
    if key == "client_s":
        return row.client_timed
    if key == "launch_s":
        return row.source in EAGER_ENGINES
    if key == "request_s":
        return bool(kinds - {"decode"})
    if key == "step_s":
        return "decode" in kinds
    if key[0] == "step":
        return STACK.get(row.generation) == key[1]
    return row.generation == key[1] and (key[0] == "memory" or row.dtype == key[2])


def fit(rows: list[Row], passes: int = MAX_PASSES) -> Terms:
    """Serving terms minimizing mean |log error| over `rows` with the factors' prior (coordinate descent on
    the grids, until a pass moves no term or after `passes`)."""
    keys: list[Any] = sorted(
        {("compute", r.generation, r.dtype) for r in rows} | {("memory", r.generation) for r in rows}
    )
    keys += sorted({("step", STACK[r.generation]) for r in rows if r.generation in STACK})
    keys += list(GRIDS)
    terms = Terms()
    # A term moves only its rows' errors (and the prior): the argmin over its grid needs those rows alone.
    affected = {k: [r for r in rows if _moves(k, r)] for k in keys}
    for _ in range(passes):
        start = terms
        for k in keys:
            grid = GRIDS.get(k, STEP_GRID if k[0] == "step" else FACTOR_GRID)
            _, best = min((_loss(affected[k], terms.replace(k, float(v))), float(v)) for v in grid)
            terms = terms.replace(k, best)
        if terms == start:
            break
    return terms


def serving_rows(rows: list[Row]) -> list[Row]:
    return [r for r in rows if r.measure != "op"]


def held_out_terms(rows: list[Row], fitter=fit) -> dict[str, Terms]:
    """Source -> the terms `fitter` (`fit` unless a test swaps it) gives on the other sources' serving rows."""
    serving = serving_rows(rows)
    return {
        src: fitter([r for r in serving if r.source != src]) for src in sorted({r.source for r in serving})
    }


def leave_one_source_out(
    rows: list[Row], fitter=fit, held_out: dict[str, Terms] | None = None
) -> dict[str, float]:
    """Row id -> predicted / measured, each source's rows predicted with terms fitted on the other sources
    (`held_out`, as `held_out_terms(rows, fitter)` gives it, when already computed)."""
    held_out = held_out_terms(rows, fitter) if held_out is None else held_out
    out = {r.id: predict(r, held_out[r.source]) / r.seconds for r in serving_rows(rows)}
    out.update({r.id: predict(r, Terms()) / r.seconds for r in rows if r.measure == "op"})
    return out


def summary(ratios: dict[str, float], rows: list[Row]) -> dict[str, float]:
    """Mean and max |error| of the serving rows, and how many are beyond 25%."""
    err = [abs(ratios[r.id] - 1) for r in serving_rows(rows)]
    return {"rows": len(err), "mean": float(np.mean(err)), "max": float(np.max(err)),
            "beyond_25": int(sum(e > MISS for e in err))}  # fmt: skip


def breakdown(row: Row, terms: Terms) -> str:
    """The parts of a serving row's prediction: per step graph its seconds (weight x one step), the GEMM
    weight and KV bytes it streams, the all-reduce seconds inside it and what the launch floor adds."""
    kc = terms.factor(("compute", row.generation, row.dtype))
    km = terms.factor(("memory", row.generation))
    ring = row.source in RING_ENGINES
    out = []
    for kind, weight, specs in row.parts:
        step = _step(
            row.gpu.key, specs, kind, kc, km, ring, terms.launch_s if row.source in EAGER_ENGINES else 0.0
        )
        w = sum(n * s.weight.total_bytes(s.N, s.K) * s.batch for s, n in specs if isinstance(s, Gemm))
        kv = sum(n * s.min_bytes() for s, n in specs if isinstance(s, PagedDecodeAttention))
        ar = sum(
            n * _step(row.gpu.key, ((s, 1),), kind, kc, km, ring)
            for s, n in specs
            if isinstance(s, AllReduce)
        )
        gaps = step - _step(row.gpu.key, specs, kind, kc, km, ring)
        out.append(f"{kind} {weight} x {1e3 * step:.2f} ms (weights {w / 1e9:.1f} GB, KV {kv / 1e9:.2f} GB, "
                   f"all-reduce {1e3 * ar:.2f} ms, launch floor {1e3 * gaps:.2f} ms)")  # fmt: skip
    return "; ".join(out)


def _fmt_terms(t: Terms) -> str:
    factors = ", ".join(f"{'/'.join(k)} {v:.3f}" for k, v in t.factors)
    steps = "".join(f" ({k} {v * 1e3:.2f} ms)" for k, v in t.steps)
    return (f"{factors}; step {t.step_s * 1e3:.2f} ms{steps}, request {t.request_s * 1e3:.2f} ms, "
            f"client {t.client_s * 1e3:.1f} ms, launch floor {t.launch_s * 1e6:.1f} us")  # fmt: skip


def print_report(path: Path = DATA_FILE, detail: bool = False) -> None:
    """Every row's predicted / measured (leave-one-source-out), the misses' reasons and the summary;
    `detail`: each serving row's seconds and parts under the terms it was judged by."""
    rows, skipped = load_rows(path)
    serving = serving_rows(rows)
    held_out = held_out_terms(rows)
    loso = leave_one_source_out(rows, held_out=held_out)
    print(f"Measured-latency validation ({path.name}): predicted / measured, leave-one-source-out")
    for r in rows:
        tag = "  (calibration source, in-sample)" if r.measure == "op" else ""
        if r.measure != "op" and abs(loso[r.id] - 1) > MISS:
            tag = f"  MISS: {r.known_miss or '(no known_miss reason in the data file)'}"
        print(f"  {r.id:<20} {r.source:<27} {r.measure:<24} {loso[r.id]:6.3f}{tag}")
        if detail and r.measure != "op":
            t = held_out[r.source]
            print(
                f"      measured {r.seconds:.4g} s, predicted {predict(r, t):.4g} s, tp {_tp(r)}: {breakdown(r, t)}"
            )
    for rid, why in skipped:
        print(f"  {rid:<20} not predicted: {why}")
    s = summary(loso, rows)
    print(f"serving rows {s['rows']}: mean |err| {100 * s['mean']:.1f}%, max {100 * s['max']:.1f}%, "
          f"{s['beyond_25']} beyond 25%")  # fmt: skip
    print("terms fitted on every serving row:", _fmt_terms(fit(serving)))


def _tp(row: Row) -> int:
    return max(
        (s.world_size for _, _, specs in row.parts for s, _ in specs if isinstance(s, AllReduce)), default=1
    )


def write_terms(path: Path = TERMS_FILE, terms: Terms | None = None) -> Terms:
    """Write `terms` (default: fitted on every serving row) to `path` (serving_terms.yaml)."""
    if terms is None:
        terms = fit(serving_rows(load_rows()[0]))
    header = ("# Serving terms fitted on every serving row of measured_latencies.yaml (serving_terms.py says what\n"
              "# each stands for). Generated: python -m codesign.dataflow.validation --write-terms\n")  # fmt: skip
    path.write_text(terms_yaml(terms, header))
    return terms


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--detail", action="store_true", help="each serving row's seconds and parts")
    ap.add_argument(
        "--write-terms", action="store_true", help=f"refit on every serving row, write {TERMS_FILE.name}"
    )
    args = ap.parse_args(argv)
    if args.write_terms:
        print(f"wrote {TERMS_FILE.name}:", _fmt_terms(write_terms()))
        return
    print_report(detail=args.detail)


if __name__ == "__main__":
    main()
