"""Roofline analysis of an operator graph on a GPU from the catalogue.

Per node: t = max(flops / peak(spec.peak_key()), bytes / mem_bw); all-reduces
their ring bytes and all-to-alls the bytes a rank sends over the link bandwidth, with no latency term. The sum
over nodes (no overlap between operators) is a lower bound on the step's time: a measured latency below it
means a wrong spec or a wrong catalogue figure.

DF11 (lossless BF16) weights: the bytes are the compressed ones (the spec's `min_bytes`
counts the format's bits per weight). A decoder throughput can be given as one more roof, overlapped
with the others as the fused kernels stream it: t = max(flops / peak, bytes / mem_bw, N K batch x 2 B /
decode_bw). It is off by default so the roofline stays a lower bound: no GPU has measured our decoder
yet, and the decoder's design target (DF11_DECODE_BW = 200 GB/s of decoded bf16) is a floor to meet, not a
ceiling; pass decode_bw=DF11_DECODE_BW (or a measured figure) to see its effect.
"""

from __future__ import annotations

import csv
import json
from collections import OrderedDict
from dataclasses import asdict, dataclass
from pathlib import Path

import networkx as nx

from codesign.catalog.gpus import GPUSpec
from codesign.specs import Gemm, OpSpec

DF11_DECODE_BW = 200e9  # bytes/s of decoded bf16: the decoder's target (module docstring), not a measurement


@dataclass(frozen=True)
class RooflineRow:
    """One operator role aggregated over the layers (e.g. all 32 `qkv_proj` nodes)."""

    op: str
    count: int
    flops: float
    bytes: float
    intensity: float
    bound: str  # "compute", "memory", "link" or "decode" (DF11 weights)
    time_s: float
    example: str


def df11_decode_s(spec: OpSpec, decode_bw: float | None) -> float:
    """Seconds to decode a GEMM's DF11 weights: batch x N x K x 2 B / decode_bw (0 for other ops, or
    when decode_bw is None: no decoder roof)."""
    if decode_bw is None or not isinstance(spec, Gemm) or spec.weight.dtype != "df11":
        return 0.0
    return spec.batch * spec.N * spec.K * 2 / decode_bw


def op_time(spec: OpSpec, gpu: GPUSpec, decode_bw: float | None = None) -> tuple[float, str]:
    """(roofline seconds, bound) of one operator on `gpu` (DF11 decode roof: module docstring)."""
    key = spec.peak_key()
    if key == "link":
        return spec.min_bytes() / gpu.link_bw, "link"
    t_c = spec.flops() / gpu.peak(key)
    t_m = spec.min_bytes() / gpu.mem_bw
    t_d = df11_decode_s(spec, decode_bw)
    if t_d > max(t_c, t_m):
        return t_d, "decode"
    return (t_c, "compute") if t_c >= t_m else (t_m, "memory")


@dataclass(frozen=True)
class RooflineReport:
    gpu: str
    model: str
    phase: str
    batch: int
    tokens: int
    layers: int
    rows: tuple[RooflineRow, ...]
    ranks: int = 1  # expert-parallel ranks, each running the step on its own batch

    @property
    def total_time_s(self) -> float:
        return sum(r.time_s for r in self.rows)

    @property
    def total_bytes(self) -> float:
        return sum(r.bytes for r in self.rows)

    @property
    def total_flops(self) -> float:
        return sum(r.flops for r in self.rows)

    def per_layer_time_s(self) -> float:
        """Time of the repeated blocks divided by the layer count (embedding/head excluded)."""
        block = sum(r.time_s for r in self.rows if r.op not in NON_LAYER_OPS)
        return block / self.layers

    def time_per_token_s(self) -> float:
        """Decode: the step time (each sequence gains one token). Prefill: step time / prompt tokens."""
        return self.total_time_s if self.phase == "decode" else self.total_time_s / self.tokens

    def tokens_per_s(self) -> float:
        """Tokens a second over all ranks (under EP each rank runs the step on its own batch)."""
        return (self.batch if self.phase == "decode" else self.tokens) * self.ranks / self.total_time_s

    def to_dict(self) -> dict:
        return {
            "gpu": self.gpu,
            "model": self.model,
            "phase": self.phase,
            "batch": self.batch,
            "tokens": self.tokens,
            "layers": self.layers,
            "ranks": self.ranks,
            "total_time_s": self.total_time_s,
            "per_layer_time_s": self.per_layer_time_s(),
            "time_per_token_s": self.time_per_token_s(),
            "tokens_per_s": self.tokens_per_s(),
            "total_flops": self.total_flops,
            "total_bytes": self.total_bytes,
            "rows": [asdict(r) for r in self.rows],
            "omits": list(OMITS),
        }


NON_LAYER_OPS = ("embedding", "pos_embedding", "embed_add", "final_norm", "lm_head", "sampling")

# What the bound leaves out, said with every report: each is a cost the GPU target (gpu_model.py) adds.
OMITS = (
    "achieved vs peak compute and bandwidth, wave quantization and per-SM bandwidth caps (gpu_model.py)",
    "kernel launch gaps (eager PyTorch: tens of us per operator; CUDA graphs: ~2 us)",
    "collective latency: per all-reduce a fixed latency plus one per ring step, per all-to-all a latency and one "
    "step (accel_model/collectives.py)",
    "expert-parallel load imbalance: routing is taken as uniform, every rank as busy as the average",
)


def roofline(graph: nx.DiGraph, gpu: GPUSpec, decode_bw: float | None = None) -> RooflineReport:
    """Aggregate the roofline time of every node of `graph` by operator role (decode_bw: DF11 weights)."""
    acc: OrderedDict[str, dict] = OrderedDict()
    layers = 0
    for _, data in graph.nodes(data=True):
        spec: OpSpec = data["spec"]
        t, bound = op_time(spec, gpu, decode_bw)
        a = acc.setdefault(
            data["op"],
            {"count": 0, "flops": 0.0, "bytes": 0.0, "time": 0.0, "bound_t": {}, "example": spec.describe()},
        )
        a["count"] += 1
        a["flops"] += spec.flops()
        a["bytes"] += spec.min_bytes()
        a["time"] += t
        a["bound_t"][bound] = a["bound_t"].get(bound, 0.0) + t
        if data.get("layer") is not None:
            layers = max(layers, data["layer"] + 1)
    rows = tuple(
        RooflineRow(
            op=op,
            count=a["count"],
            flops=a["flops"],
            bytes=a["bytes"],
            intensity=a["flops"] / a["bytes"] if a["bytes"] else float("inf"),
            bound=max(a["bound_t"], key=a["bound_t"].get),
            time_s=a["time"],
            example=a["example"],
        )
        for op, a in acc.items()
    )
    gattr = graph.graph
    return RooflineReport(
        gpu=gpu.key,
        model=gattr.get("model", "?"),
        phase=gattr.get("phase", "?"),
        batch=gattr.get("batch", 1),
        tokens=gattr.get("tokens", 1),
        layers=max(layers, 1),
        rows=rows,
        ranks=gattr.get("ep", 1),
    )


def format_table(rep: RooflineReport) -> str:
    """A fixed-width text table of the report, with totals."""
    head = (
        f"{'op':<16}{'count':>6}{'GFLOP':>12}{'MB':>12}{'FLOP/B':>9}  {'bound':<8}{'time us':>11}{'share':>7}"
    )
    lines = [
        f"{rep.model} {rep.phase}, batch {rep.batch}, {rep.tokens} tokens/step on {rep.gpu}"
        + (f" (each of {rep.ranks} expert-parallel ranks)" if rep.ranks > 1 else ""),
        head,
        "-" * len(head),
    ]
    total = rep.total_time_s
    for r in rep.rows:
        lines.append(
            f"{r.op:<16}{r.count:>6}{r.flops / 1e9:>12.3f}{r.bytes / 1e6:>12.2f}{r.intensity:>9.1f}  "
            f"{r.bound:<8}{r.time_s * 1e6:>11.1f}{100 * r.time_s / total:>6.1f}%"
        )
    lines.append("-" * len(head))
    lines.append(
        f"{'total':<16}{'':>6}{rep.total_flops / 1e9:>12.3f}{rep.total_bytes / 1e6:>12.2f}{'':>9}  {'':<8}"
        f"{total * 1e6:>11.1f}"
    )
    lines.append(
        f"per layer: {rep.per_layer_time_s() * 1e6:.1f} us; "
        f"per token: {rep.time_per_token_s() * 1e3:.3f} ms; "
        f"{rep.tokens_per_s():.1f} tokens/s{' over the ranks' if rep.ranks > 1 else ''}"
    )
    lines.append("a lower bound: leaves out " + "; ".join(OMITS))
    return "\n".join(lines)


def write_csv(rep: RooflineReport, path: Path) -> None:
    """Per-operator rows as CSV (written to a temp file, then renamed: never half a file)."""
    tmp = path.with_suffix(path.suffix + ".tmp")
    with open(tmp, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["op", "count", "flops", "bytes", "intensity", "bound", "time_s", "example"])
        for r in rep.rows:
            w.writerow([r.op, r.count, r.flops, r.bytes, r.intensity, r.bound, r.time_s, r.example])
    tmp.replace(path)


def write_json(rep: RooflineReport, path: Path) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(rep.to_dict(), indent=2))
    tmp.replace(path)


def plot(rep: RooflineReport, gpu: GPUSpec, path: Path) -> None:
    """Roofline plot (PNG): the GPU's memory and compute roofs and one point per operator role."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    xs = [10 ** (e / 10) for e in range(-20, 51)]
    for key, style in (("fp16", "-"), ("vector", "--")):
        peak = gpu.peak(key)
        ax.plot(
            xs,
            [min(peak, x * gpu.mem_bw) / 1e12 for x in xs],
            style,
            color="gray",
            label=f"roof ({'fp16 tensor' if key == 'fp16' else 'fp32 vector'})",
        )
    for r in rep.rows:
        if r.bound == "link" or r.flops == 0 or r.time_s == 0:
            continue
        ax.scatter(r.intensity, r.flops / r.time_s / 1e12, s=20)
        ax.annotate(r.op, (r.intensity, r.flops / r.time_s / 1e12), fontsize=7)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("arithmetic intensity (FLOP/byte)")
    ax.set_ylabel("attainable TFLOP/s")
    ax.set_title(f"{rep.model} {rep.phase} batch {rep.batch} on {gpu.name}")
    ax.legend(fontsize=7)
    fig.tight_layout()
    tmp = path.with_name(path.stem + ".tmp.png")
    fig.savefig(tmp, dpi=120)
    plt.close(fig)
    tmp.replace(path)
