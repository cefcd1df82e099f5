"""GEMM hindcast: the speed predictor of `bench/gemm_predict.py` applied to the quantized GEMMs the H200 timed on
2026-11-30 (commit 54daa75, Triton 3.6), beside what it measured; the GEMM half of `bench/hindcast.py`.

    python bench/hindcast_gemm.py --out bench/results/hindcast_gemm_sm90.json     # from the committed launches

    # collecting the launches again: the old checkout and Triton 3.6 venv of `bench/hindcast.py`'s docstring, then
    python bench/hindcast_gemm.py --old-root /tmp/old --old-python /tmp/old/.venv/bin/python \
        --raw bench/results/hindcast_gemm_sm90_launches.json.gz --out bench/results/hindcast_gemm_sm90.json

`collect` (under the old Python, through `hindcast.run_collect`) replays the old `lowering_report`'s quant_gemm cases
(the quick shapes N = K = 8192 and Llama-2-70B gate_up N = 57344, K = 8192, at the bench's M 1 ... 4096, bf16
activations) under that commit's `compile_only(90, "NVIDIA H200")`: the launches the timed `quant_matmul` calls
made then (no tuned tables existed: the defaults; W4A16 / W8A16 split-K for M <= 16, else tiled; W8A8 / FP8 the
activation quantizer, then the scaled GEMM). It keeps each launch's resources, constexprs and SASS (each distinct
SASS once: the tiled kernels compile alike at every M), committed as
`bench/results/hindcast_gemm_sm90_launches.json.gz`.

Then this Python predicts each timed call with today's `gemm_predict` as it is: per launch `launch_prediction`
(issue count, tensor peak, byte floor at COPY_BPS, the scheduler simulation of the main loop), the call's launches
summed by `variant_prediction` (split-K's zeroing and copy passes, the launch gaps), beside the measured time of
`bench/results/h200-2026-11-30-run2.json`'s `quant_gemm` rows, and the issue-count model alone beside it (each
launch max(issue, tensor, floor): the predictor before the simulation). The bf16 `torch.matmul` baseline and the
CuPy W4A16 rows are listed as not predicted (no Triton launch of ours). A diagnostic, not the model: the cycles a
main-loop iteration took on the H200 (`measured_cycles_per_iter`), to set beside the simulated ones.
`tests/bench/test_hindcast_gemm.py` reproduces the bands the docs quote.
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

BENCH_DIR = Path(__file__).resolve().parent
if str(BENCH_DIR) not in sys.path:
    sys.path.insert(0, str(BENCH_DIR))
import hindcast as hc  # noqa: E402  (stdlib-only at import: safe under the old Python too)

LAUNCHES = BENCH_DIR / "results" / "hindcast_gemm_sm90_launches.json.gz"  # what `collect` wrote for 54daa75
NOT_OURS = {"bf16_matmul": "torch.matmul baseline (cuBLAS): no Triton launch to predict",
            "w4a16_g128_cupy": "CuPy kernel (quant_gemm_w4a16.cu): not Triton, no SASS collected"}  # fmt: skip


# ----------------------------------------------------------------------------- collect (under the old Python)
def collect(out: Path) -> None:
    import warnings

    sys.path[:] = [
        p for p in sys.path if p and Path(p).resolve() != BENCH_DIR
    ]  # the old bench/, not this one
    import lowering_report as lr
    import torch

    from codesign.autotune import compile_only as co
    from codesign.backend import use_backend

    warnings.filterwarnings("ignore")
    mods = lr._suite_modules()
    kernels = hc._capture(co)
    rows: list[dict[str, Any]] = []
    sass: dict[str, str] = {}
    with co.compile_only(90, "NVIDIA H200") as s, use_backend("triton"), torch.no_grad():
        for _, label, call in lr._quant_gemm_cases(mods, 90):
            n0 = len(s.launches)
            try:
                call()
            except Exception as e:  # an old host path that no longer runs here: said, not fatal
                rows.append({"label": label, "error": repr(e)[:300]})
                continue
            for launch, kernel in zip(s.launches[n0:], kernels[n0:]):
                row = hc._row(launch, kernel)
                key = hashlib.sha1(row["sass"].encode()).hexdigest()[:12]
                sass[key] = row.pop("sass")
                rows.append({"label": label, **row, "sass_id": key})
    hc._write(out, {"commit": hc._git_head(), "rows": rows, "sass": sass})


# ----------------------------------------------------------------------------- predict (this Python)
def _case(label: str) -> dict[str, Any]:
    """'quant_gemm {model}/{layer} M= N= K= {op} bf16' -> its fields."""
    parts = label.split()
    model, layer = parts[1].split("/")
    m, n, k = (int(p.split("=")[1]) for p in parts[2:5])
    return {"model": model, "layer": layer, "M": m, "N": n, "K": k, "op": parts[5]}


def _variant(op: str, launches: list[dict[str, Any]]) -> str:
    """The old call's variant in `gemm_predict`'s names (its passes follow from them)."""
    if op in ("w4a16_g128", "w8a16_pc"):
        return "splitk" if launches[0]["constexprs"].get("SPLITK") else "tiled"
    return "triton"  # the activation quantizer, then the scaled GEMM


def _launch(row: dict[str, Any]) -> SimpleNamespace:
    keys = ("kernel", "num_warps", "num_stages", "registers", "spill_stores", "spill_loads", "shared_bytes",
            "constexprs")  # fmt: skip
    grid = list(row["grid"]) + [1] * (
        3 - len(row["grid"])
    )  # a 1-D grid is (x, 1, 1): the predictor reads grid[1]
    return SimpleNamespace(**{k: row[k] for k in keys}, grid=grid)


def predict_rows(raw: dict[str, Any]) -> list[dict[str, Any]]:
    import gemm_predict as gp

    meas = gp.measured()
    calls: dict[str, list[dict[str, Any]]] = {}
    for row in raw["rows"]:
        calls.setdefault(row["label"], []).append(row)
    out = []
    for label, rows in calls.items():
        c = _case(label)
        base = {"case": label, **c, "measured_ms": meas.get((c["layer"], c["M"], c["op"]))}
        if "error" in rows[0]:
            out.append({**base, "error": rows[0]["error"]})
            continue
        m, n, k, op = c["M"], c["N"], c["K"], c["op"]
        launches = [gp.launch_prediction(_launch(r), raw["sass"][r["sass_id"]], op, m, n, k) for r in rows]
        variant = _variant(op, launches)
        bf16 = gp.bf16_ms(meas, c["layer"], m)
        p = gp.variant_prediction(op, variant, m, n, k, launches, bf16, joined=False)
        # the issue-count model: each launch max(issue, tensor, floor), the same passes and gaps
        other = sum(x["ms"] for x in p["torch_passes"]) + p["gaps_ms"]
        issue = sum(max(x["issue_ms"], x["tensor_ms"], x["floor_ms"]) for x in launches) + other
        r = {**base, "variant": variant, "predicted_ms": p["predicted_ms"], "issue_model_ms": issue,
             "other_ms": other, "dominant": p["dominant"], "launches": [_brief(x) for x in launches]}  # fmt: skip
        if base["measured_ms"]:
            r["measured_over_predicted"] = base["measured_ms"] / p["predicted_ms"]
            r["measured_over_issue_model"] = base["measured_ms"] / issue
            r["measured_cycles_per_iter"] = _measured_cycles(base["measured_ms"] - other, launches)
        out.append(r)
    for (layer, m, kern), ms in sorted(meas.items()):
        if kern in NOT_OURS:
            out.append({"case": f"quant_gemm {layer} M={m} {kern}", "layer": layer, "M": m, "op": kern,
                        "measured_ms": ms, "not_predicted": NOT_OURS[kern]})  # fmt: skip
    return out


def _main(x: dict[str, Any]) -> int | None:
    """The main loop's index as `gemm_predict.per_program` picks it (the last with a matrix instruction)."""
    mma = [j for j, lp in enumerate(x["loops"]) if lp["hmma"]]
    return mma[-1] if mma else None


def _measured_cycles(ms: float, launches: list[dict[str, Any]]) -> float | None:
    """Cycles one main-loop iteration took on the H200 (a wave's programs side by side): the measured time less the
    call's other launches (as predicted) over the GEMM launch's waves x trips; what the simulated cycles compare to."""
    from sass_model import CLOCK_HZ

    gemm = launches[-1]
    j = _main(gemm)
    if j is None:
        return None
    left = ms - sum(x["predicted_ms"] for x in launches[:-1])
    return left * 1e-3 * CLOCK_HZ / (gemm["waves"] * gemm["trips"][j])


def _brief(x: dict[str, Any]) -> dict[str, Any]:
    keep = ("kernel", "grid", "num_warps", "num_stages", "registers", "spill_stores", "shared_bytes", "constexprs",
            "loops", "trips", "sass_per_iter", "mma", "programs_per_sm", "resident", "waves", "warps_per_scheduler",
            "resident_warps_per_scheduler",
            "issue_ms", "tensor_ms", "floor_ms", "bound", "predicted_ms")  # fmt: skip
    out = {k: x[k] for k in keep if k in x}
    if x["sched"]:
        out["sched"] = {
            k: x["sched"][k] for k in ("warps_per_scheduler", "cycles_per_iter", "single_warp", "ms")
        }
    return out


def summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Measured / predicted of both models per kernel (op), per op and variant, per dominant bound, and overall."""
    timed = [x for x in rows if x.get("measured_ms") and "predicted_ms" in x]
    out: dict[str, Any] = {"all": hc.band(timed)}
    for op in sorted({x["op"] for x in timed}):
        out[f"op {op}"] = hc.band([x for x in timed if x["op"] == op])
        for v in sorted({x["variant"] for x in timed if x["op"] == op}):
            out[f"op {op} {v}"] = hc.band([x for x in timed if x["op"] == op and x["variant"] == v])
    for b in sorted({x["dominant"] for x in timed}):
        out[f"dominant {b}"] = hc.band([x for x in timed if x["dominant"] == b])
    out["not_predicted"] = {r["op"]: sum(1 for x in rows if x["op"] == r["op"] and "not_predicted" in x)
                            for r in rows if "not_predicted" in r}  # fmt: skip
    return out


def table(report: dict[str, Any]) -> str:
    lines = [
        f"{'case':52} {'variant':7} {'meas ms':>8} {'pred ms':>8} {'m/p':>5} {'issue':>8} {'m/i':>5}  dominant"
    ]
    for r in report["rows"]:
        if "predicted_ms" not in r:
            why = r.get("not_predicted") or r.get("error", "")
            lines.append(f"{r['case'][:52]:52} {'-':7} {r.get('measured_ms') or 0:8.3f} {'-':>8}  {why[:60]}")
            continue
        lines.append(f"{r['case'][:52]:52} {r['variant']:7} {r.get('measured_ms') or 0:8.3f} "
                     f"{r['predicted_ms']:8.3f} {r.get('measured_over_predicted', 0):5.2f} {r['issue_model_ms']:8.3f} "
                     f"{r.get('measured_over_issue_model', 0):5.2f}  {r['dominant']}")  # fmt: skip
    lines.append(json.dumps(report["summary"], indent=1))
    return "\n".join(lines)


def report(raw: dict[str, Any]) -> dict[str, Any]:
    rows = predict_rows(raw)
    return {"what": "gemm_predict's model on the quantized GEMMs timed on the H200 on 2026-11-30 (compile-only "
            "sm_90 of the measured commit's code under Triton 3.6), beside the times measured then",
            "kernel_commit": raw["commit"], "rows": rows, "summary": summary(rows)}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    return hc.cli(argv, "hindcast_gemm", __doc__, LAUNCHES, collect, report, table, Path(__file__).resolve())


if __name__ == "__main__":
    sys.exit(main())
