"""GPU target cost model: the roofline corrected by per-family efficiencies calibrated on measured latencies.

    t(op) = overhead + max(padded_flops / (peak * compute_eff), in_bytes / (mem_bw * memory_eff),
                           sm_bytes) + out_bytes / (mem_bw * memory_eff)

per operator family (matmul, softmax, norm, elementwise); all-reduces take the
interconnect's collective model (accel_model/collectives.py: a latency per
collective and per ring step plus ring bytes over the achieved bus bandwidth,
figures cited per interconnect, not fitted here). Four physical
effects bend measured latency away from the plain roofline. Their parameters
are fitted on the single-operator LLMCompass A100 CSVs only (never on the GPT-3
layer rows, which are the validation):

- Wave quantization (matmul): `padded_flops` counts the work of whole output
  tiles in whole waves over the SMs (a 129-row GEMM pays for two 128-row tiles;
  109 tiles on 108 SMs take two waves), as the LLMCompass model does. GEMMs with
  at most half as many tiles as SMs split K to fill one wave (see `_tiles`).
- Per-SM bandwidth (matmul): an SM streams its tiles' inputs at no more than
  `sm_share` x (mem_bw / sms), so a GEMM with fewer tiles than SMs (a decode
  projection: M=8, N=9216 is 72 tiles on 108 SMs) cannot draw the whole HBM
  bandwidth: sm_bytes = in_bytes * (waves * sms / CTAs) / (mem_bw * sm_share).
- Serial epilogue (matmul, no parameter): a tile's output is stored after its
  K loop, not overlapped with it, so output bytes add to the time. This
  dominates a batched GEMM with a short K and a large output (prefill Q.K^T:
  K=head_dim=128 and a seq x seq score matrix per head); for K in the thousands
  it is noise. The CSVs cannot decide it: with it the A100 matmul rows fit to
  2.6% mean error (1.9% with a fully overlapped store), the MI210 rows to 2.8%
  (2.9% overlapped).
- Row re-read (norm): PyTorch's LayerNorm kernel reads each row twice (Welford
  statistics, then normalize); the second read hits the SM's L1 only while the
  row fits the L1 share of a resident block. The missed fraction
  max(0, 1 - row_cache_bytes / row_bytes) is read again from DRAM.

The overhead is the fixed cost per launch visible in the measurements (e.g.
~48 us for a 1024-element GELU in PyTorch on an A100). Known gap: a batched
GEMV with a long K and a narrow output (GPT-3 decode A.V: 192 x [1, 2048] @
[2048, 128]) is predicted at 0.61 of its measured time; the CSVs hold no
batched M=1 GEMM to calibrate a term for it. Efficiencies live in
gpu_efficiency.yaml; `--fit` re-derives them from the LLMCompass A100 data by
grid search on mean |log error|.

Run `python -m codesign.dataflow.gpu_model` for the per-row error report
(in-sample and leave-one-out, which is the honest number), the GPT-3 layer
rows (validation only, never fitted) and the measured end-to-end latencies
(validation.py: predicted / measured per row, leave-one-source-out).
`--suite REPORT.json` does the same for a GPU the suite timed (`bench/gpu_ops.py`: the LLMCompass operator set
fitted, a Llama-3-8B layer's operators validated).
"""

from __future__ import annotations

import argparse
import functools
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import yaml

from codesign.accel_model.collectives import gpu_interconnect
from codesign.catalog.gpus import GPUSpec
from codesign.specs import (
    COLLECTIVES,
    GatedDeltaRule,
    Gemm,
    Norm,
    OpSpec,
    PagedDecodeAttention,
    PagedExtendAttention,
    PrefillAttention,
    Softmax,
    SSDScan,
    TreeAttention,
    dtype_bytes,
)

EFFICIENCY_FILE = Path(__file__).resolve().parent / "gpu_efficiency.yaml"
FAMILIES = ("matmul", "softmax", "norm", "elementwise")
TILE = 128  # output tile edge used for wave quantization (cuBLAS's common 128x128 CTA tile)
# Fit grids. Memory efficiency stops at 0.90: HBM sustains ~90% of its pin rate at best (refresh, bus
# turnarounds), and once the per-SM cap is in, the matmul rows no longer pin it (mean error 2.7% at 0.86,
# 2.4% at 1.0), so an open grid would drift to an unphysical 100%.
COMPUTE_GRID = np.linspace(0.3, 1.0, 71)
MEMORY_GRID = np.linspace(0.2, 0.9, 71)
OVERHEAD_GRID_US = np.arange(0, 60.5, 0.5)
SM_SHARE_GRID = np.linspace(0.6, 1.6, 11)
ROW_CACHE_GRID = 2.0 ** np.arange(10, 17.01, 0.25)  # 1 KiB .. 128 KiB


@dataclass(frozen=True)
class FamilyEfficiency:
    compute: float
    memory: float
    overhead_s: float
    sm_share: float | None = None  # matmul: per-SM input stream cap in units of mem_bw / sms (None: no cap)
    row_cache_bytes: float | None = None  # norm: row bytes kept on chip between two passes (None: one pass)


@dataclass(frozen=True)
class Terms:
    """Roofline pieces of one operator before efficiencies (seconds at peak, bytes as counted)."""

    compute_s: float  # padded flops at peak
    in_s: float  # bytes streamed in (and, outside GEMMs, all bytes) at peak bandwidth
    out_s: float  # GEMM output stored by the epilogue, at peak bandwidth
    wave_pad: float = 1.0  # SM slots of whole waves / tiles: > 1 when tiles leave SMs idle
    row_bytes: float = 0.0  # norm row size, for the re-read term


def family(spec: OpSpec) -> str:
    """The efficiency family an operator is costed with."""
    if isinstance(
        spec, Gemm | PrefillAttention | PagedDecodeAttention | PagedExtendAttention | TreeAttention
    ):
        return "matmul"
    if isinstance(spec, GatedDeltaRule | SSDScan):  # a prompt's chunks: tensor-core products; the recurrence streams
        return "matmul" if spec.peak_key() != "vector" else "elementwise"
    if isinstance(spec, Softmax):
        return "softmax"
    if isinstance(spec, Norm):
        return "norm"
    if isinstance(spec, COLLECTIVES):
        return "link"  # not a fitted family: the interconnect's collective model (accel_model.collectives)
    return "elementwise"


def _tiles(spec: Gemm, sms: int) -> tuple[int, int, int]:
    """(CTAs, tile rows, K splits) of a GEMM: small M gets narrower tiles (cuBLAS's small-M kernels), and
    a GEMM with at most half as many tiles as SMs splits K over the idle SMs (split-K, as cuBLAS does for
    decode GEMVs) without exceeding one wave. No calibration row has so few tiles: this is an assumption,
    not a fit (without it a batch-1 N=4096 projection would stream on 32 of 132 H100 SMs)."""
    tm = TILE if spec.M >= TILE else 2 ** max(4, math.ceil(math.log2(spec.M)))
    tiles = spec.batch * math.ceil(spec.M / tm) * math.ceil(spec.N / TILE)
    split = max(1, min(sms // tiles, math.ceil(spec.K / 64)))  # at least one 64-deep K step per split
    return tiles * split, tm, split


def padded_flops(spec: OpSpec, gpu: GPUSpec) -> float:
    """Flops of whole tiles in whole waves for GEMMs; the plain count for everything else."""
    if not isinstance(spec, Gemm) or spec.M == 0:
        return spec.flops()
    ctas, tm, split = _tiles(spec, gpu.sms)
    # Each wave takes one tile's time on one SM, however few tiles it holds.
    return 2.0 * math.ceil(spec.K / split) * tm * TILE * math.ceil(ctas / gpu.sms) * gpu.sms


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
            float(raw[f]["compute"]),
            float(raw[f]["memory"]),
            float(raw[f]["overhead_us"]) * 1e-6,
            float(raw[f]["sm_share"]) if "sm_share" in raw[f] else None,
            float(raw[f]["row_cache_bytes"]) if "row_cache_bytes" in raw[f] else None,
        )
        for f in FAMILIES
    }


def terms(spec: OpSpec, gpu: GPUSpec) -> Terms:
    """The roofline pieces of `spec` on `gpu` that `gpu_op_time` weighs with a family's efficiencies."""
    tc = padded_flops(spec, gpu) / gpu.peak(spec.peak_key())
    if isinstance(spec, Gemm) and spec.M > 0:
        ctas, _, _ = _tiles(spec, gpu.sms)
        out = spec.batch * spec.M * spec.N * dtype_bytes(spec.out_dtype)
        pad = math.ceil(ctas / gpu.sms) * gpu.sms / ctas
        return Terms(tc, (spec.min_bytes() - out) / gpu.mem_bw, out / gpu.mem_bw, pad)
    if isinstance(spec, Norm):
        return Terms(tc, spec.min_bytes() / gpu.mem_bw, 0.0, row_bytes=spec.hidden * dtype_bytes(spec.dtype))
    return Terms(tc, spec.min_bytes() / gpu.mem_bw, 0.0)


def _reread_s(t: Terms) -> float:
    """Seconds at peak bandwidth to read a norm's input once more: half its bytes (as many go out as in)."""
    return t.in_s / 2.0


# Per-kernel cost inside a captured CUDA graph, which serving engines use for decode: replaces the
# eager-launch overhead the PyTorch-timed calibration data carries.
GRAPH_LAUNCH_S = 2e-6


def _time(t: Terms, e: FamilyEfficiency, overhead: float) -> float:
    stream = t.in_s
    if e.row_cache_bytes is not None and t.row_bytes > 0:
        stream += _reread_s(t) * max(0.0, 1.0 - e.row_cache_bytes / t.row_bytes)
    body = max(t.compute_s / e.compute, stream / e.memory)
    if e.sm_share is not None:
        body = max(body, stream * t.wave_pad / e.sm_share)
    return overhead + body + t.out_s / e.memory


def gpu_op_time(
    spec: OpSpec,
    gpu: GPUSpec,
    eff: dict[str, FamilyEfficiency] | None = None,
    launch: str = "eager",
    pieces: Terms | None = None,
) -> float:
    """Predicted seconds for one operator on `gpu` (see the module formula).

    launch: "eager" keeps the calibrated per-launch overhead (PyTorch eager, as measured) and NCCL's ring;
    "graph" uses GRAPH_LAUNCH_S instead and the engines' one-shot all-reduce where faster, for
    CUDA-graph-captured serving steps. pieces: `terms(spec, gpu)` when the caller keeps them (a fit weighs the
    same operators with many efficiencies).
    """
    if isinstance(spec, COLLECTIVES):  # a serving step ("graph") takes the engines' one-shot all-reduce when faster
        return gpu_interconnect(gpu.key).collective_s(spec, gpu.link_bw, engine=launch == "graph")
    e = (eff or efficiencies(gpu))[family(spec)]
    overhead = GRAPH_LAUNCH_S if launch == "graph" else e.overhead_s
    return _time(terms(spec, gpu) if pieces is None else pieces, e, overhead)


def _search(pred_err, grids: tuple[np.ndarray, ...], stride: int = 5) -> tuple[tuple[int, ...], float]:
    """Index of the least `pred_err(*axes)` on the product of `grids`: a coarse pass over every
    `stride`-th value, then the full-resolution grid within one coarse step of the coarse optimum
    (the error surfaces are smooth; this is ~60x cheaper than the full grid, with the same optimum
    on the calibration data)."""
    coarse = [np.arange(0, len(g), stride) for g in grids]
    err = pred_err(*np.ix_(*[g[c] for g, c in zip(grids, coarse)]))
    at = np.unravel_index(np.argmin(err), err.shape)
    fine = [
        np.arange(max(0, c[i] - stride), min(len(g), c[i] + stride + 1)) for g, c, i in zip(grids, coarse, at)
    ]
    err = pred_err(*np.ix_(*[g[f] for g, f in zip(grids, fine)]))
    at = np.unravel_index(np.argmin(err), err.shape)
    return tuple(int(f[i]) for f, i in zip(fine, at)), float(err[at])


def fit_family(rows: list[tuple[OpSpec, float]], gpu: GPUSpec, fam: str | None = None) -> FamilyEfficiency:
    """Grid-search the family's parameters minimizing mean |log(predicted / measured)|.

    All families fit (compute, memory, overhead); matmul also `sm_share`, norm also `row_cache_bytes`
    (the family is taken from the first row unless given).
    """
    fam = fam or family(rows[0][0])
    ts = [terms(s, gpu) for s, _ in rows]
    tc, tin, tout, pad, rb = (np.array([getattr(t, f) for t in ts]) for f in Terms.__dataclass_fields__)
    meas = np.array([t for _, t in rows])
    extra: np.ndarray = {"matmul": SM_SHARE_GRID, "norm": ROW_CACHE_GRID}.get(fam, np.array([np.nan]))

    def mean_log_err(ce, me, t0, x):
        ce, me, t0, x = (a[..., None] for a in (ce, me, t0, x))  # rows on the last axis
        stream = tin + (tin / 2.0 * np.maximum(0.0, 1.0 - x / rb) if fam == "norm" else 0.0)
        body = np.maximum(tc / ce, stream / me)
        if fam == "matmul":
            body = np.maximum(body, stream * pad / x)
        return np.abs(np.log((t0 + body + tout / me) / meas)).mean(axis=-1)

    grids = (COMPUTE_GRID, MEMORY_GRID, OVERHEAD_GRID_US * 1e-6, extra)
    (i, j, k, m), _ = _search(mean_log_err, grids)
    c, mem, o, x = float(grids[0][i]), float(grids[1][j]), float(grids[2][k]), float(grids[3][m])
    return FamilyEfficiency(
        c, mem, o, sm_share=x if fam == "matmul" else None, row_cache_bytes=x if fam == "norm" else None
    )


def error_report(
    rows_by_family: dict[str, list[tuple[OpSpec, float]]],
    gpu: GPUSpec,
    eff: dict[str, FamilyEfficiency] | None = None,
) -> dict[str, dict]:
    """Per family: mean and max |error| in-sample (`eff`, default the stored fit) and leave-one-out
    (refit without the row)."""
    eff = eff or efficiencies(gpu)
    out = {}
    for fam, rows in rows_by_family.items():
        ins = [abs(gpu_op_time(s, gpu, eff) / t - 1) for s, t in rows]
        loo = []
        for i, (s, t) in enumerate(rows):
            e_i = fit_family(rows[:i] + rows[i + 1 :], gpu, fam)
            loo.append(abs(gpu_op_time(s, gpu, {**eff, fam: e_i}) / t - 1))
        out[fam] = {
            "rows": len(rows),
            "mean_err": float(np.mean(ins)),
            "max_err": float(np.max(ins)),
            "loo_mean_err": float(np.mean(loo)),
            "loo_max_err": float(np.max(loo)),
        }
    return out


def by_family(rows: list[tuple[OpSpec, float]]) -> dict[str, list[tuple[OpSpec, float]]]:
    """Measured rows grouped by the family that costs them."""
    out: dict[str, list[tuple[OpSpec, float]]] = {}
    for spec, t in rows:
        out.setdefault(family(spec), []).append((spec, t))
    return out


def a100_rows_by_family() -> dict[str, list[tuple[OpSpec, float]]]:
    from codesign.dataflow.llmcompass_ref import measured_a100

    return by_family(measured_a100())


def _yaml_line(fam: str, e: FamilyEfficiency) -> str:
    extra = f", sm_share: {e.sm_share:.2f}" if e.sm_share is not None else ""
    extra += f", row_cache_bytes: {e.row_cache_bytes:.0f}" if e.row_cache_bytes is not None else ""
    return (
        f"    {fam}: {{compute: {e.compute:.2f}, memory: {e.memory:.3f}, "
        f"overhead_us: {e.overhead_s * 1e6:.1f}{extra}}}"
    )


def _print_report(rep: dict[str, dict]) -> None:
    for fam, r in rep.items():
        print(
            f"{fam:<12} rows {r['rows']:>3}  mean |err| {100 * r['mean_err']:5.1f}%  "
            f"max {100 * r['max_err']:5.1f}%"
            f"  leave-one-out mean {100 * r['loo_mean_err']:5.1f}%  max {100 * r['loo_max_err']:5.1f}%"
        )


def suite_fit(report: dict, gpu: GPUSpec) -> dict:
    """A GPU suite report's single operators (`measured_ops`) against the model on `gpu`: each family refitted on
    the calibration rows (`efficiencies`, the fit; `calibration`, in-sample and leave-one-out errors) and the layer
    rows predicted with that fit and with the catalogue's current efficiencies (`layers`: validation, never fitted)."""
    from codesign.dataflow.measured_ops import calibration_rows, layer_rows

    rows = {fam: r for fam, r in by_family(calibration_rows(report)).items() if len(r) > 1}  # (one row: no fit)
    now = efficiencies(gpu)
    fitted = {**now, **{fam: fit_family(r, gpu, fam) for fam, r in rows.items()}}
    layers = [
        {"phase": r.phase, "node": r.node, "impl": r.impl, "ms": r.seconds * 1e3,
         "fitted_ratio": gpu_op_time(r.spec, gpu, fitted) / r.seconds,
         "current_ratio": gpu_op_time(r.spec, gpu, now) / r.seconds}
        for r in layer_rows(report)
    ]  # fmt: skip
    return {"efficiencies": fitted, "calibration": error_report(rows, gpu, fitted), "layers": layers}


def _print_suite(path: str, device: str | None) -> None:
    import json

    from codesign.catalog.gpus import load_gpu, match_gpu_name

    report = json.loads(Path(path).read_text())
    name = report.get("env", {}).get("gpu", "")
    gpu = load_gpu(device) if device else match_gpu_name(name)
    if gpu is None:
        raise SystemExit(f"{path}: no catalogue GPU matches the report's device {name!r}; pass --device")
    fit = suite_fit(report, gpu)
    print(f"{gpu.key}: fitted on {path} ({name})")
    for fam, e in fit["efficiencies"].items():
        if fam in fit["calibration"]:
            print(_yaml_line(fam, e))
    _print_report(fit["calibration"])
    print("layer operators (validation, never fitted): predicted / measured, with the fit | with the catalogue's now")
    for r in fit["layers"]:
        print(f"  {r['phase']:<8} {r['node']:<16} {r['impl']:<30} {r['ms']:9.4f} ms"
              f"  {r['fitted_ratio']:6.3f} | {r['current_ratio']:6.3f}")  # fmt: skip


def _main() -> None:
    from codesign.catalog.gpus import load_gpu
    from codesign.dataflow.llmcompass_ref import GPT3_DECODE_A100, GPT3_PREFILL_A100, gpt3_layer_specs

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--fit", action="store_true", help="print freshly fitted A100 efficiencies (YAML)")
    ap.add_argument(
        "--csv-dir",
        help="fit and check the model on another device's LLMCompass CSVs in this folder (with --device)",
    )
    ap.add_argument("--device", dest="device_given", default=None,
                    help="catalogue GPU of --csv-dir (default mi210; its CSV tag: --tag) or of --suite")  # fmt: skip
    ap.add_argument("--tag", default="MI210", help="device tag in the CSV file names")
    ap.add_argument(
        "--no-validation", action="store_true", help="skip the measured-latency set (validation.py, ~10 s)"
    )
    ap.add_argument(
        "--suite",
        help="fit and check the model on a GPU suite report's single-operator timings (bench/gpu_ops.py), on the "
        "report's GPU (or --device)",
    )
    args = ap.parse_args()
    if args.suite:
        _print_suite(args.suite, args.device_given)
        return
    if args.csv_dir:
        from codesign.dataflow.llmcompass_ref import load_llmcompass_csvs

        other = load_gpu(args.device_given or "mi210")
        rows = by_family(load_llmcompass_csvs(args.csv_dir, args.tag))
        fitted = {**efficiencies(other), **{fam: fit_family(r, other, fam) for fam, r in rows.items()}}
        for fam in rows:
            print(_yaml_line(fam, fitted[fam]))
        _print_report(error_report(rows, other, fitted))
        return
    gpu = load_gpu("a100-80gb")
    rows = a100_rows_by_family()
    if args.fit:
        for fam, r in rows.items():
            print(_yaml_line(fam, fit_family(r, gpu, fam)))
        return
    _print_report(error_report(rows, gpu))
    for phase, measured in (("prefill", GPT3_PREFILL_A100), ("decode", GPT3_DECODE_A100)):
        print(f"GPT-3 175B layer ({phase}, TP=4): predicted / measured")
        for (name, spec), meas in zip(gpt3_layer_specs(phase).items(), measured):
            print(f"  {name:<14} {gpu_op_time(spec, gpu) / meas:6.3f}")
    if not args.no_validation:
        from codesign.dataflow.validation import print_report

        print_report()


if __name__ == "__main__":
    _main()
