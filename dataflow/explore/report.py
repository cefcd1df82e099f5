"""Exploration report: Pareto fronts with GPU reference points, best-design breakdowns, findings, HTML.

Fronts (over points that fit and meet the constraints):
  - decode tokens/s vs area (maximise tokens/s, minimise mm^2)
  - energy per token vs TPOT (minimise both)
The catalogue's A100/H100/H200 are evaluated on the same workload by the GPU
target model and drawn on the same axes (area = die area; energy = TDP x time,
an upper bound). `findings()` puts numbers on the effects the literature
reports: near-memory attention at long context, KV quantization raising the
batch that fits and the serving throughput.
"""

from __future__ import annotations

import base64
import html
import io
import json
import math
from pathlib import Path
from typing import Any

import numpy as np

from codesign.dataflow.explore.eval import Workload, gpu_reference

GPU_REFERENCES = ("a100-80gb", "h100-sxm", "h200")


def pareto(
    points: list[tuple[float, float, Any]], maximize_x: bool, maximize_y: bool
) -> list[tuple[float, float, Any]]:
    """Non-dominated (x, y, payload) points, sorted by x."""
    sx = -1 if maximize_x else 1
    sy = -1 if maximize_y else 1
    pts = sorted(points, key=lambda p: (sx * p[0], sy * p[1]))
    front, best_y = [], math.inf
    for p in pts:
        y = sy * p[1]
        if y < best_y:
            front.append(p)
            best_y = y
    return front


def _by_point(rows: list[dict]) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for r in rows:
        e = out.setdefault(r["point_key"], {"point": r["point"], "metrics": {}})
        e["metrics"][r["workload"]] = r["metrics"]
    return out


def _feasible(m: dict[str, Any], constraints: dict[str, float]) -> bool:
    return (
        bool(m.get("fits"))
        and m.get("area_mm2", 0) <= constraints.get("max_area_mm2", math.inf)
        and m.get("power_w", 0) <= constraints.get("max_power_w", math.inf)
    )


def primary_decode_workload(workloads: list[str]) -> str | None:
    dec = [w for w in workloads if w.startswith("decode:")]
    return max(dec, key=lambda w: Workload.parse(w).batch, default=None)


def fronts(rows: list[dict], workload: str, constraints: dict[str, float]) -> dict[str, list]:
    pts = [(e["metrics"][workload], e) for e in _by_point(rows).values() if workload in e["metrics"]]
    ok = [(m, e) for m, e in pts if _feasible(m, constraints)]
    thr = pareto([(m["area_mm2"], m["tokens_per_s"], e) for m, e in ok], maximize_x=False, maximize_y=True)
    en = pareto(
        [(m["tpot_s"], m["energy_per_token_j"], e) for m, e in ok if "tpot_s" in m],
        maximize_x=False,
        maximize_y=False,
    )
    return {"throughput_vs_area": thr, "energy_vs_tpot": en, "all": ok}


def _pairs(
    by: dict[str, dict[str, Any]],
    param: str,
    a: Any,
    b: Any,
    workload: str,
    metric: str,
    where: dict[str, Any] | None = None,
) -> list[float]:
    """Ratios metric(point with param=a) / metric(same point with param=b), over matched design pairs
    (optionally only points whose parameters equal `where`)."""
    index: dict[str, dict[Any, float]] = {}
    for e in by.values():
        if where and any(
            e["point"].get(k, "fp16" if k == "format.kv" else None) != v for k, v in where.items()
        ):
            continue
        m = e["metrics"].get(workload)
        if not m or not m.get("fits") or not m.get(metric):
            continue
        rest = json.dumps({k: v for k, v in e["point"].items() if k != param}, sort_keys=True, default=str)
        index.setdefault(rest, {})[json.dumps(e["point"].get(param), sort_keys=True)] = m[metric]
    ka, kb = json.dumps(a, sort_keys=True), json.dumps(b, sort_keys=True)
    return [v[ka] / v[kb] for v in index.values() if ka in v and kb in v]


def findings(rows: list[dict]) -> list[str]:
    """Sentences with numbers on the PIM and KV-quantization effects, from matched design pairs
    (the same design point differing only in the parameter under study)."""
    by = _by_point(rows)
    out = []
    workloads = {w for e in by.values() for w in e["metrics"]}
    decodes = sorted(
        (w for w in workloads if w.startswith("decode:")),
        key=lambda w: (Workload.parse(w).batch, Workload.parse(w).context),
    )
    pim_values = [e["point"].get("pim") for e in by.values() if e["point"].get("pim") is not None]
    plain = [v for v in pim_values if not (isinstance(v, dict) and v.get("dequant"))]
    deq = [v for v in pim_values if isinstance(v, dict) and v.get("dequant")]
    if pim_values:
        for w in decodes:
            # Plain PIM attention reads fp16/bf16 KV only (accel_model.evaluate): compare fp16-KV designs.
            r = _pairs(
                by, "pim", (plain or pim_values)[0], None, w, "tokens_per_s", where={"format.kv": "fp16"}
            )
            if r:
                out.append(
                    f"{w}: adding PIM units changes decode tokens/s by {np.median(r):.2f}x (median over "
                    f"{len(r)} matched fp16-KV designs; range {min(r):.2f}-{max(r):.2f}x)"
                )
    if plain and deq:
        fmts = sorted({e["point"].get("format.kv", "fp16") for e in by.values()} - {"fp16", "bf16"})
        for w in decodes:
            for fmt in fmts:
                # A dequantizing front end lets the PIM stream the quantized cache instead of the host.
                r = _pairs(by, "pim", deq[0], plain[0], w, "tokens_per_s", where={"format.kv": fmt})
                if r:
                    out.append(
                        f"{w}: a PIM dequant front end vs plain PIM with KV {fmt}: decode tokens/s "
                        f"{np.median(r):.2f}x (median over {len(r)} matched designs; range "
                        f"{min(r):.2f}-{max(r):.2f}x)"
                    )
    for w in sorted(x for x in workloads if x.startswith("trace:")):
        for fmt in ("int8", "int4-kivi"):
            thr = _pairs(by, "format.kv", fmt, "fp16", w, "serve_throughput_tok_s")
            cap = _pairs(by, "format.kv", fmt, "fp16", w, "kv_capacity_tokens")
            batch = _pairs(by, "format.kv", fmt, "fp16", w, "serve_max_batch")
            if thr:
                out.append(
                    f"{w}: KV {fmt} vs fp16 on the same design: KV capacity {np.median(cap):.2f}x, "
                    f"peak batch {np.median(batch):.2f}x (up to {max(batch):.2f}x), serving throughput "
                    f"{np.median(thr):.2f}x median (range {min(thr):.2f}-{max(thr):.2f}x, {len(thr)} designs)"
                )
    return out


def _plot(front_pts, all_pts, refs, xlab, ylab, xkey, ykey, logx=False) -> bytes:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    ax.scatter(
        [m[xkey] for m, _ in all_pts], [m[ykey] for m, _ in all_pts], s=8, color="lightgray", label="designs"
    )
    fx = [p[0] for p in front_pts]
    fy = [p[1] for p in front_pts]
    ax.plot(fx, fy, "o-", color="C0", ms=4, label="Pareto front")
    for name, m in refs.items():
        if m and m.get(xkey) and m.get(ykey) and not math.isnan(m[ykey]):
            ax.scatter([m[xkey]], [m[ykey]], marker="*", s=90, label=name)
    ax.set_xlabel(xlab)
    ax.set_ylabel(ylab)
    if logx:
        ax.set_xscale("log")
    ax.set_yscale("log")
    ax.legend(fontsize=7)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    plt.close(fig)
    return buf.getvalue()


def _point_text(p: dict[str, Any]) -> str:
    parts = []
    for k, v in sorted(p.items()):
        if isinstance(v, dict):
            v = "on"
        elif v is None:
            v = "off"
        parts.append(f"{k}={v}")
    return ", ".join(parts)


def write_report(
    rows: list[dict], workloads: list[str], model: str, constraints: dict[str, float], out_dir: Path
) -> dict[str, Any]:
    """Write pareto_*.png and report.html into out_dir; return a summary dict."""
    out_dir.mkdir(parents=True, exist_ok=True)
    w = primary_decode_workload(workloads)
    summary: dict[str, Any] = {
        "model": model,
        "points": len(_by_point(rows)),
        "results": len(rows),
        "findings": findings(rows),
    }
    imgs: dict[str, bytes] = {}
    tables = ""
    if w:
        f = fronts(rows, w, constraints)
        refs = {g: gpu_reference(g, w, model) for g in GPU_REFERENCES}
        imgs["throughput_vs_area"] = _plot(
            f["throughput_vs_area"],
            f["all"],
            refs,
            "area (mm²)",
            f"tokens/s ({w})",
            "area_mm2",
            "tokens_per_s",
            logx=True,
        )
        imgs["energy_vs_tpot"] = _plot(
            f["energy_vs_tpot"],
            f["all"],
            refs,
            "TPOT (s)",
            "energy per token (J)",
            "tpot_s",
            "energy_per_token_j",
            logx=True,
        )
        summary["workload"] = w
        summary["pareto_throughput_vs_area"] = [
            {
                "area_mm2": x,
                "pim_logic_mm2": e["metrics"][w].get("pim_logic_mm2", 0.0),
                "tokens_per_s": y,
                "point": e["point"],
            }
            for x, y, e in f["throughput_vs_area"]
        ]
        summary["gpu_references"] = refs
        rowsx = "".join(
            f"<tr><td>{x:.1f}</td><td>{e['metrics'][w].get('pim_logic_mm2', 0.0):.0f}</td><td>{y:.1f}</td>"
            f"<td>{html.escape(_point_text(e['point']))}</td>"
            f"<td>{html.escape(_breakdown(e['metrics'][w]))}</td></tr>"
            for x, y, e in f["throughput_vs_area"]
        )
        rowsg = "".join(
            f"<tr><td>{g}</td><td>{m.get('area_mm2', 0):.0f}</td><td>{m.get('tokens_per_s', 0):.1f}</td>"
            f"<td>{m.get('energy_per_token_j', 0):.3f}</td></tr>"
            for g, m in refs.items()
            if m
        )
        tables = (
            f"<h2>Pareto front: tokens/s vs area ({html.escape(w)})</h2><table><tr><th>area mm²</th>"
            f"<th>PIM logic mm² (DRAM dies)</th><th>tokens/s</th><th>design point</th><th>time by unit</th></tr>"
            f"{rowsx}</table>"
            f"<h2>GPU reference points (same workload)</h2><table><tr><th>GPU</th><th>die mm²</th>"
            f"<th>tokens/s</th><th>J/token (TDP bound)</th></tr>{rowsg}</table>"
        )
    for name, data in imgs.items():
        tmp = out_dir / f"pareto_{name}.tmp.png"
        tmp.write_bytes(data)
        tmp.replace(out_dir / f"pareto_{name}.png")
    figs = "".join(
        f'<h2>{html.escape(n.replace("_", " "))}</h2><img src="data:image/png;base64,'
        f'{base64.b64encode(d).decode()}"/>'
        for n, d in imgs.items()
    )
    finds = "".join(f"<li>{html.escape(s)}</li>" for s in summary["findings"])
    page = (
        f"<!doctype html><html><head><meta charset='utf-8'><title>codesign explore: {html.escape(model)}</title>"
        "<style>body{font-family:sans-serif;max-width:1100px;margin:auto}table{border-collapse:collapse}"
        "td,th{border:1px solid #ccc;padding:3px 6px;font-size:12px}</style></head><body>"
        f"<h1>Design-space exploration: {html.escape(model)}</h1>"
        f"<p>{summary['points']} design points, {summary['results']} results; workloads: "
        f"{html.escape(', '.join(workloads))}; constraints: {html.escape(str(constraints))}</p>"
        "<p><i>Areas: a design's area counts its arrays, SRAM buffers and vector/KV-quant lanes only (no PHY, "
        "I/O or controllers; 45 nm figures scaled by (node/45)^2, optimistic at 7 nm), while the GPU points "
        "use the whole die: compare shapes of fronts, not absolute mm^2. GPU energy is TDP x time, an upper "
        "bound.</i></p>"
        f"<h2>Findings</h2><ul>{finds}</ul>{figs}{tables}</body></html>"
    )
    tmp = out_dir / "report.html.tmp"
    tmp.write_text(page)
    tmp.replace(out_dir / "report.html")
    return summary


def _breakdown(m: dict[str, Any]) -> str:
    times = {k[5:]: v for k, v in m.items() if k.startswith("time_") and v > 0}
    tot = sum(times.values()) or 1.0
    return ", ".join(f"{k} {100 * v / tot:.0f}%" for k, v in sorted(times.items(), key=lambda kv: -kv[1]))
