"""Predicted H200 time of a Llama-3-8B layer's projections apart and merged into one GEMM each
(`kernels.gemm.merged`, `fuse_layers_`' default), per quantized format at decode's M: compile-only sm_90 through
`gemm_predict` (nothing timed: every number is a prediction).

    python bench/merge_predict.py [--ms 1 16] [--ops w4a16_g128 w8a8_int8] [--out F]

Apart, a layer runs q (N 4096), k and v (N 1024 each), gate and up (N 14336 each), K 4096: 5 launches; merged,
q / k / v (N 6144) and gate / up (N 28672): 2. Each launch is the default rule's variant at that shape and M
(`triton_gemm.choose_variant`, `choose_scaled_mm_variant` under the H200's device view), predicted as
`gemm_predict` predicts it (its launches, and `LAUNCH_GAP_MS` between launches in a captured step). The saving is
what the merged GEMMs do not repeat: each small launch's fixed part (its ramp, its tail, the split-K join's), which
a GEMV reading 2-8 MB cannot hide. JSON with --out.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import gemm_predict as gp  # noqa: E402
from sass_model import run_report  # noqa: E402

HIDDEN, KV, INTER = 4096, 1024, 14336  # Llama-3-8B: 32 query heads and 8 KV heads of 128, MLP 14336
SHAPES = {"8b-q": (HIDDEN, HIDDEN), "8b-kv": (KV, HIDDEN), "8b-qkv": (HIDDEN + 2 * KV, HIDDEN),
          "8b-gate": (INTER, HIDDEN), "8b-gate_up": (2 * INTER, HIDDEN)}  # fmt: skip
# (group, its launches apart, merged)
GROUPS = {"q / k / v": (("8b-q", "8b-kv", "8b-kv"), "8b-qkv"), "gate / up": (("8b-gate", "8b-gate"), "8b-gate_up")}
LAYERS = 32
OPS = ("w4a16_g128", "w8a16_pc", "w8a8_int8", "fp8")


def predict(ops=OPS, ms=(1, 16), log=print) -> dict[str, Any]:
    """Each (op, M): every group's launches apart and merged, their predicted times (ms), and the step's saving."""
    report = gp.predict(ops, ms, tuple(SHAPES), None, log, extra_shapes=SHAPES)
    by = {(r["shape"], r["op"], r["M"]): r for r in report["cases"] if r["default"]}
    gap = report["launch_gap_ms"]
    rows = []
    for op in ops:
        for m in ms:
            row: dict[str, Any] = {"op": op, "M": m, "groups": {}}
            for name, (apart, merged) in GROUPS.items():
                parts = [by[(s, op, m)] for s in apart]
                one = by[(merged, op, m)]
                t_apart = sum(p["predicted_ms"] for p in parts) + gap * (len(parts) - 1)
                row["groups"][name] = {
                    "apart_ms": t_apart, "merged_ms": one["predicted_ms"],
                    "apart_variants": [p["variant"] for p in parts], "merged_variant": one["variant"],
                    "saved_ms": t_apart - one["predicted_ms"],
                }  # fmt: skip
            apart = sum(g["apart_ms"] for g in row["groups"].values())
            merged = sum(g["merged_ms"] for g in row["groups"].values())
            row.update(apart_ms=apart, merged_ms=merged, speedup=apart / merged,
                       saved_ms_per_step=(apart - merged) * LAYERS)  # fmt: skip
            rows.append(row)
    return {"gpu": report["gpu"], "model": "Llama-3-8B projections (K = 4096)", "layers": LAYERS,
            "launch_gap_ms": gap, "rows": rows}  # fmt: skip


def table(report: dict[str, Any]) -> str:
    lines = ["op          M    group      apart (us)  merged (us)  variants apart -> merged"]
    for r in report["rows"]:
        for name, g in r["groups"].items():
            times = f"{g['apart_ms'] * 1e3:10.1f} {g['merged_ms'] * 1e3:12.1f}"
            lines.append(f"{r['op']:11s} {r['M']:<4d} {name:10s} {times}  {'+'.join(g['apart_variants'])} -> "
                         f"{g['merged_variant']}")  # fmt: skip
        lines.append(f"{'':16s} layer      {r['apart_ms'] * 1e3:10.1f} {r['merged_ms'] * 1e3:12.1f}  "
                     f"{r['speedup']:.2f}x; {r['saved_ms_per_step'] * 1e3:.0f} us a {report['layers']}-layer step")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ops", nargs="*", default=list(OPS), choices=list(OPS))
    ap.add_argument("--ms", nargs="*", type=int, default=[1, 16])
    ap.add_argument("--out", type=Path, default=None, help="write the report as JSON here")
    args = ap.parse_args(argv)
    return run_report("merge_predict", lambda: predict(tuple(args.ops), tuple(args.ms), log=lambda *a: None), table,
                      args.out)  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
