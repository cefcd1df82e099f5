"""Reports of a schedule: per-operator and per-unit tables, totals, Chrome-trace JSON, a Gantt PNG."""

from __future__ import annotations

import json
from collections import OrderedDict
from pathlib import Path

import networkx as nx

from codesign.dataflow.schedule import Schedule
from codesign.specs import (
    STATE_OPS,
    CodesignError,
    Gemm,
    KVWrite,
    PagedDecodeAttention,
    PagedExtendAttention,
)


def kept_tokens(total: int, new: int, window: int | None, block_size: int) -> int:
    """Tokens a sequence's paged cache holds in a layer during a step of `new` tokens that ends at `total`: all of
    them, or with a sliding window those from the block holding the first new token's earliest visible position on
    (the blocks before it are freed, as vLLM's hybrid allocator does; `CodesignCache` keeps a rollback margin more)."""
    if window is None:
        return total
    first = max(total - new + 1 - window, 0)
    return total - first // block_size * block_size


def resident_bytes(g: nx.DiGraph) -> dict[str, float]:
    """Bytes that must sit in device memory for the step: weights (each GEMM node once; a MoE projection
    with all its experts, `resident_weights`, not just the ones a batch reaches) and the KV cache (a sliding
    layer's: `kept_tokens`; a prefill's whole prompt, written before a window frees any of it; a linear-attention or
    state-space layer's fixed states a sequence, counted with it as vLLM's hybrid allocator pools them)."""
    weights = 0.0
    kv = 0.0
    for _, d in g.nodes(data=True):
        s = d["spec"]
        if isinstance(s, Gemm) and d["op"] != "attention":
            weights += d.get("resident_weights", s.batch) * s.weight.total_bytes(s.N, s.K)
        if isinstance(s, PagedDecodeAttention):
            kept = sum(kept_tokens(c, 1, s.window, s.block_size) for c in s.context_lens)
            kv += kept * s.kv_bytes_per_token()
        elif isinstance(s, PagedExtendAttention):
            kept = sum(kept_tokens(p + q, q, s.window, s.block_size) for p, q in zip(s.prefix_lens, s.q_lens))
            kv += kept * s.kv_bytes_per_token()
        elif isinstance(s, KVWrite) and g.graph.get("phase") == "prefill":
            kv += s.tokens * s.cache_bytes_per_token()
        elif isinstance(s, STATE_OPS):
            kv += s.state_bytes()
    return {"weights": weights, "kv_cache": kv}


def check_fits(g: nx.DiGraph, capacity: float, target: str) -> None:
    """Refuse a model/target pair whose weights and KV cache exceed device memory, with the sizes."""
    r = resident_bytes(g)
    need = r["weights"] + r["kv_cache"]
    if need > capacity:
        step = f"{g.graph.get('phase')}, batch {g.graph.get('batch')}, tp {g.graph.get('tp', 1)}"
        if g.graph.get("ep", 1) > 1:
            step += f", ep {g.graph['ep']}"
        hint = (
            "the weights alone exceed it at any batch: use --tp (--ep for MoE) or a quantized weight format"
            if r["weights"] > capacity
            else "use --tp, a smaller batch or context, or a quantized weight/KV format"
        )
        raise CodesignError(
            f"{g.graph.get('model')} ({step}) does not fit on {target}: weights {r['weights'] / 1e9:.1f} GB + "
            f"KV cache {r['kv_cache'] / 1e9:.1f} GB = {need / 1e9:.1f} GB > {capacity / 1e9:.1f} GB "
            f"of device memory ({hint})"
        )


def per_op(s: Schedule) -> list[dict]:
    """One row per operator role: count, busy time, share, units used, bound, traffic, energy."""
    acc: OrderedDict[str, dict] = OrderedDict()
    for sl in s.slots:
        a = acc.setdefault(
            sl.op,
            {
                "op": sl.op,
                "count": 0,
                "time_s": 0.0,
                "energy_j": 0.0,
                "dram_bytes": 0.0,
                "units": set(),
                "bounds": {},
            },
        )
        dur = sl.end - sl.start
        a["count"] += 1
        a["time_s"] += dur
        a["energy_j"] += sl.placement.energy_j
        a["dram_bytes"] += sl.placement.traffic.get("dram", 0.0)
        a["units"].add(sl.unit)
        a["bounds"][sl.placement.bound] = a["bounds"].get(sl.placement.bound, 0.0) + dur
    total = sum(a["time_s"] for a in acc.values()) or 1.0
    rows = []
    for a in acc.values():
        rows.append(
            {
                "op": a["op"],
                "count": a["count"],
                "time_s": a["time_s"],
                "share": a["time_s"] / total,
                "units": "+".join(sorted(a["units"])),
                "bound": max(a["bounds"], key=a["bounds"].get),
                "dram_bytes": a["dram_bytes"],
                "energy_j": a["energy_j"],
            }
        )
    return rows


def per_unit(s: Schedule) -> list[dict]:
    """Busy time and utilisation (busy / makespan) of each unit."""
    busy: dict[str, float] = {}
    energy: dict[str, float] = {}
    for sl in s.slots:
        busy[sl.unit] = busy.get(sl.unit, 0.0) + sl.end - sl.start
        energy[sl.unit] = energy.get(sl.unit, 0.0) + sl.placement.energy_j
    mk = s.makespan or 1.0
    return [{"unit": u, "busy_s": b, "utilisation": b / mk, "energy_j": energy[u]} for u, b in busy.items()]


def totals(s: Schedule) -> dict:
    g = s.graph_attrs
    phase, batch, tokens, ranks = g.get("phase"), g.get("batch", 1), g.get("tokens", 1), g.get("ep", 1)
    out_tokens = batch if phase == "decode" else tokens  # one rank's; under EP each of `ranks` runs its own batch
    return {
        "target": s.target,
        "model": g.get("model"),
        "phase": phase,
        "batch": batch,
        "ranks": ranks,
        "latency_s": s.makespan,
        "tokens_per_s": out_tokens * ranks / s.makespan if s.makespan else 0.0,
        "energy_j": s.energy_j,
        "energy_per_token_j": s.energy_j / out_tokens,
    }


def _ranks(ep: int) -> str:
    return f" (each of {ep} expert-parallel ranks)" if ep > 1 else ""


def format_report(s: Schedule) -> str:
    t = totals(s)
    lines = [
        f"{t['model']} {t['phase']} batch {t['batch']} on {t['target']}" + _ranks(t["ranks"]),
        f"{'op':<16}{'count':>6}{'time us':>12}{'share':>8}  {'units':<18}{'bound':<10}{'energy mJ':>10}",
    ]
    for r in per_op(s):
        lines.append(
            f"{r['op']:<16}{r['count']:>6}{r['time_s'] * 1e6:>12.1f}{100 * r['share']:>7.1f}%  "
            f"{r['units']:<18}{r['bound']:<10}{r['energy_j'] * 1e3:>10.3f}"
        )
    lines.append("units: " + ", ".join(f"{u['unit']} {100 * u['utilisation']:.0f}%" for u in per_unit(s)))
    lines.append(
        f"latency {t['latency_s'] * 1e3:.3f} ms/step, {t['tokens_per_s']:.1f} tokens/s"
        f"{' over the ranks' if t['ranks'] > 1 else ''}, "
        f"{t['energy_per_token_j'] * 1e3:.2f} mJ/token"
    )
    return "\n".join(lines)


def chrome_trace(s: Schedule) -> dict:
    """Chrome-trace / Perfetto JSON: one track per unit, one complete ("X") event per operator, in us."""
    tids = {u: i for i, u in enumerate(sorted({sl.unit for sl in s.slots}))}
    events: list[dict] = [{"name": "process_name", "ph": "M", "pid": 0, "args": {"name": s.target}}]
    events += [
        {"name": "thread_name", "ph": "M", "pid": 0, "tid": i, "args": {"name": u}} for u, i in tids.items()
    ]
    for sl in s.slots:
        events.append(
            {
                "name": sl.node,
                "cat": sl.op,
                "ph": "X",
                "pid": 0,
                "tid": tids[sl.unit],
                "ts": sl.start * 1e6,
                "dur": (sl.end - sl.start) * 1e6,
                "args": {"bound": sl.placement.bound, "energy_uj": sl.placement.energy_j * 1e6},
            }
        )
    return {"traceEvents": events, "displayTimeUnit": "ns"}


def write_json_atomic(obj: dict, path: Path) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(obj))
    tmp.replace(path)


def gantt_png(s: Schedule, path: Path, max_slots: int = 4000) -> None:
    """A Gantt chart of the schedule (first `max_slots` operators)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    units = sorted({sl.unit for sl in s.slots})
    ops = sorted({sl.op for sl in s.slots})
    cmap = plt.get_cmap("tab20")
    fig, ax = plt.subplots(figsize=(10, 1 + 0.5 * len(units)))
    for sl in s.slots[:max_slots]:
        ax.barh(
            units.index(sl.unit),
            (sl.end - sl.start) * 1e3,
            left=sl.start * 1e3,
            color=cmap(ops.index(sl.op) % 20),
            edgecolor="none",
        )
    ax.set_yticks(range(len(units)), units)
    ax.set_xlabel("time (ms)")
    handles = [plt.Rectangle((0, 0), 1, 1, color=cmap(i % 20)) for i in range(len(ops))]
    ax.legend(handles, ops, fontsize=6, ncol=4, loc="upper right")
    ax.set_title(f"{s.graph_attrs.get('model')} {s.graph_attrs.get('phase')} on {s.target}")
    fig.tight_layout()
    tmp = path.with_name(path.stem + ".tmp.png")
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    tmp.replace(path)
