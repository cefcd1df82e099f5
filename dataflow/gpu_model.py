"""GPU target cost model: the roofline corrected by per-family efficiencies calibrated on measured latencies.

    t(op) = overhead + max(padded_flops / (peak * compute_eff), bytes / (mem_bw * memory_eff))

per operator family (matmul, softmax, norm, elementwise, link). `padded_flops`
counts the work of whole output tiles in whole waves over the SMs (a 129-row
GEMM pays for two 128-row tiles; 109 tiles on 108 SMs take two waves), which is
what bends measured GEMM throughput below the roofline at awkward shapes
(the LLMCompass model does the same). The overhead is the fixed cost per
launch visible in the measurements (e.g. ~48 us for a 1024-element GELU in
PyTorch on an A100). Efficiencies live in gpu_efficiency.yaml; `--fit`
re-derives them from the LLMCompass A100 data by grid search on mean |log error|.

Run `python -m codesign.dataflow.gpu_model` for the per-row error report
(in-sample and leave-one-out, which is the honest number).
"""

from __future__ import annotations

import argparse
import functools
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import yaml

from codesign.catalog.gpus import GPUSpec
from codesign.specs import (
    AllReduce,
    Gemm,
    Norm,
    OpSpec,
    PagedDecodeAttention,
    PagedExtendAttention,
    PrefillAttention,
    Softmax,
    TreeAttention,
)

EFFICIENCY_FILE = Path(__file__).resolve().parent / "gpu_efficiency.yaml"
FAMILIES = ("matmul", "softmax", "norm", "elementwise", "link")
TILE = 128  # output tile edge used for wave quantization (cuBLAS's common 128x128 CTA tile)


@dataclass(frozen=True)
class FamilyEfficiency:
    compute: float
    memory: float
    overhead_s: float


def family(spec: OpSpec) -> str:
    """The efficiency family an operator is costed with."""
    if isinstance(
        spec, Gemm | PrefillAttention | PagedDecodeAttention | PagedExtendAttention | TreeAttention
    ):
        return "matmul"
    if isinstance(spec, Softmax):
        return "softmax"
    if isinstance(spec, Norm):
        return "norm"
    if isinstance(spec, AllReduce):
        return "link"
    return "elementwise"


def padded_flops(spec: OpSpec, gpu: GPUSpec) -> float:
    """Flops of whole tiles in whole waves for GEMMs; the plain count for everything else."""
    if not isinstance(spec, Gemm) or spec.M == 0:
        return spec.flops()
    tm = TILE if spec.M >= TILE else 2 ** max(4, math.ceil(math.log2(spec.M)))  # small M: narrower tiles
    tiles = spec.batch * math.ceil(spec.M / tm) * math.ceil(spec.N / TILE)
    # Each wave takes one tile's time on one SM, however few tiles it holds.
    return 2.0 * spec.K * tm * TILE * math.ceil(tiles / gpu.sms) * gpu.sms


@functools.lru_cache(maxsize=1)
def _table() -> dict:
    with open(EFFICIENCY_FILE) as f:
        return yaml.safe_load(f)["gpus"]


def efficiencies(gpu: GPUSpec) -> dict[str, FamilyEfficiency]:
    """Calibrated efficiencies of `gpu`, or the default set (A100-calibrated) for uncalibrated GPUs."""
    t = _table()
    raw = t.get(gpu.key, t["default"])
    return {
        f: FamilyEfficiency(
            float(raw[f]["compute"]), float(raw[f]["memory"]), float(raw[f]["overhead_us"]) * 1e-6
        )
        for f in FAMILIES
    }


def _terms(spec: OpSpec, gpu: GPUSpec) -> tuple[float, float]:
    """(seconds at peak compute, seconds at peak bandwidth) before efficiencies."""
    if isinstance(spec, AllReduce):
        return 0.0, spec.min_bytes() / gpu.link_bw
    return padded_flops(spec, gpu) / gpu.peak(spec.peak_key()), spec.min_bytes() / gpu.mem_bw


# Per-kernel cost inside a captured CUDA graph, which serving engines use for decode: replaces the
# eager-launch overhead the PyTorch-timed calibration data carries (NCCL all-reduce latency is kept).
GRAPH_LAUNCH_S = 2e-6


def gpu_op_time(
    spec: OpSpec, gpu: GPUSpec, eff: dict[str, FamilyEfficiency] | None = None, launch: str = "eager"
) -> float:
    """Predicted seconds for one operator on `gpu` (see the module formula).

    launch: "eager" keeps the calibrated per-launch overhead (PyTorch eager, as measured);
    "graph" uses GRAPH_LAUNCH_S instead, for CUDA-graph-captured serving steps.
    """
    fam = family(spec)
    e = (eff or efficiencies(gpu))[fam]
    if isinstance(spec, AllReduce) and spec.world_size == 1:
        return 0.0
    tc, tm = _terms(spec, gpu)
    overhead = GRAPH_LAUNCH_S if launch == "graph" and fam != "link" else e.overhead_s
    return overhead + max(tc / e.compute, tm / e.memory)


def fit_family(rows: list[tuple[OpSpec, float]], gpu: GPUSpec) -> FamilyEfficiency:
    """Grid-search (compute, memory, overhead) minimizing mean |log(predicted / measured)|."""
    tc = np.array([_terms(s, gpu)[0] for s, _ in rows])
    tm = np.array([_terms(s, gpu)[1] for s, _ in rows])
    meas = np.array([t for _, t in rows])
    ce = np.linspace(0.3, 1.0, 71)[:, None, None, None]
    me = np.linspace(0.2, 1.0, 81)[None, :, None, None]
    t0 = (np.arange(0, 60.5, 0.5) * 1e-6)[None, None, :, None]
    pred = t0 + np.maximum(tc / ce, tm / me)
    err = np.abs(np.log(pred / meas)).mean(axis=-1)
    i, j, k = np.unravel_index(np.argmin(err), err.shape)
    return FamilyEfficiency(float(ce[i, 0, 0, 0]), float(me[0, j, 0, 0]), float(t0[0, 0, k, 0]))


def error_report(rows_by_family: dict[str, list[tuple[OpSpec, float]]], gpu: GPUSpec) -> dict[str, dict]:
    """Per family: mean and max |error| in-sample (stored fit) and leave-one-out (refit without the row)."""
    eff = efficiencies(gpu)
    out = {}
    for fam, rows in rows_by_family.items():
        ins = [abs(gpu_op_time(s, gpu, eff) / t - 1) for s, t in rows]
        loo = []
        for i, (s, t) in enumerate(rows):
            e_i = fit_family(rows[:i] + rows[i + 1 :], gpu)
            loo.append(abs(gpu_op_time(s, gpu, {**eff, fam: e_i}) / t - 1))
        out[fam] = {
            "rows": len(rows),
            "mean_err": float(np.mean(ins)),
            "max_err": float(np.max(ins)),
            "loo_mean_err": float(np.mean(loo)),
            "loo_max_err": float(np.max(loo)),
        }
    return out


def a100_rows_by_family() -> dict[str, list[tuple[OpSpec, float]]]:
    from codesign.dataflow.llmcompass_ref import measured_a100

    out: dict[str, list[tuple[OpSpec, float]]] = {}
    for spec, t in measured_a100():
        out.setdefault(family(spec), []).append((spec, t))
    return out


def _main() -> None:
    from codesign.catalog.gpus import load_gpu
    from codesign.dataflow.llmcompass_ref import GPT3_DECODE_A100, GPT3_PREFILL_A100, gpt3_layer_specs

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--fit", action="store_true", help="print freshly fitted A100 efficiencies (YAML)")
    args = ap.parse_args()
    gpu = load_gpu("a100-80gb")
    rows = a100_rows_by_family()
    if args.fit:
        for fam, r in rows.items():
            e = fit_family(r, gpu)
            print(
                f"    {fam}: {{compute: {e.compute:.2f}, memory: {e.memory:.3f}, "
                f"overhead_us: {e.overhead_s * 1e6:.1f}}}"
            )
        return
    for fam, r in error_report(rows, gpu).items():
        print(
            f"{fam:<12} rows {r['rows']:>3}  mean |err| {100 * r['mean_err']:5.1f}%  "
            f"max {100 * r['max_err']:5.1f}%"
            f"  leave-one-out mean {100 * r['loo_mean_err']:5.1f}%  max {100 * r['loo_max_err']:5.1f}%"
        )
    for phase, measured in (("prefill", GPT3_PREFILL_A100), ("decode", GPT3_DECODE_A100)):
        print(f"GPT-3 175B layer ({phase}, TP=4): predicted / measured")
        for (name, spec), meas in zip(gpt3_layer_specs(phase).items(), measured):
            print(f"  {name:<14} {gpu_op_time(spec, gpu) / meas:6.3f}")


if __name__ == "__main__":
    _main()
