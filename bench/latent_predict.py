"""Predicted H200 times of latent attention decode (DeepSeek-V3's widths) from the sm_90 SASS of its kernel
(compile-only: no GPU, nothing timed).

    python bench/latent_predict.py [--out /tmp/p.json]

Each of `gpu_attention.LATENT_CASES` (16 or 128 query heads on one latent of 512 + 64, batch x context, a bf16 or
an e4m3 cache) is compiled under `codesign.autotune.compile_only` as `latent_decode_attention` launches it, and its
tile loop goes through `attention_predict.decode_prediction`, the model the other decode kernels are predicted with
(issue count, warp-scheduler simulation of one tile, byte floor at the bandwidth calibrated on the measured bf16
paged decode): predicted = max(floor, scheduled) + the split merge. The floor is the spec's bytes
(`latent_decode_spec(...).min_bytes()`: the latent read once, q and out). `floor_pct`: the floor's share of the
predicted time.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
import warnings
from pathlib import Path
from typing import Any

BENCH_DIR = Path(__file__).resolve().parent
if str(BENCH_DIR) not in sys.path:
    sys.path.insert(0, str(BENCH_DIR))
from attention_predict import BF16_MS, MERGE_MS, decode_prediction  # noqa: E402
from gpu_attention import LATENT, LATENT_CASES, ROPE  # noqa: E402
from sass_model import run_report  # noqa: E402

BLOCK = 64  # tokens a cache block


def predict(log=print) -> dict[str, Any]:
    """Compile every case for sm_90 and predict its time (module docstring)."""
    import gpu_kvquant as kvq
    import torch

    from codesign.autotune.compile_only import compile_only
    from codesign.backend import use_backend
    from codesign.kernels.attention.latent import latent_decode_attention, latent_decode_spec

    warnings.filterwarnings("ignore", message="TRITON_DEFAULT_FP_FUSION")
    bandwidth = kvq.floor_bytes("bf16", kvq.BATCH, kvq.CONTEXT) / ((BF16_MS - MERGE_MS) * 1e-3)
    rows = []
    with compile_only(90, "NVIDIA H200") as session, use_backend("triton"), torch.no_grad():
        for heads, batch, context, fp8 in LATENT_CASES:
            nb = batch * math.ceil(context / BLOCK)
            cache = torch.empty(nb, BLOCK, LATENT + ROPE, dtype=torch.float8_e4m3fn if fp8 else torch.bfloat16)
            bt = torch.arange(nb, dtype=torch.int32).reshape(batch, -1)
            cl = torch.full((batch,), context, dtype=torch.int32)
            q = torch.zeros(batch, heads, LATENT + ROPE, dtype=torch.bfloat16)
            n0 = len(session.launches)
            latent_decode_attention(q, cache, bt, cl, v_dim=LATENT, sm_scale=192**-0.5, kv_scale=0.01 if fp8 else None,
                                    check_data=False)  # fmt: skip
            launch, kernel = session.launches[n0], session.compiled[n0]
            launch = dataclasses.replace(launch, constexprs={**launch.constexprs, "NUM_SPLITS": launch.grid[2]})
            spec = latent_decode_spec(q, cache, cl, LATENT)
            p = decode_prediction(launch, kernel, spec.min_bytes(), bandwidth, context)
            row = {"heads": heads, "batch": batch, "context": context, "cache": "e4m3" if fp8 else "bf16",
                   "bytes": spec.min_bytes(), "floor_pct": 100 * p["floor_ms"] / p["predicted_ms"], **p}  # fmt: skip
            rows.append(row)
            log(f"  {row['cache']} {heads} heads, batch {batch}, context {context}: {p['predicted_ms'] * 1e3:.1f} us")
    return {"gpu": "NVIDIA H200 (compile-only sm_90; nothing timed)", "bandwidth_Bps": bandwidth, "rows": rows}


def table(report: dict[str, Any]) -> str:
    head = "cache  heads  batch  context   MB    regs  SASS/tile  floor us  sched us  predicted us  floor %  bound"
    lines = [head]
    for r in report["rows"]:
        lines.append(
            f"{r['cache']:<6} {r['heads']:>5} {r['batch']:>6} {r['context']:>8} {r['bytes'] / 1e6:>6.1f} "
            f"{r['registers']:>5} {r['sass_per_tile']:>10} {r['floor_ms'] * 1e3:>9.1f} {r['sched_ms'] * 1e3:>9.1f} "
            f"{r['predicted_ms'] * 1e3:>13.1f} {r['floor_pct']:>8.0f}  {r['bound']}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=None, help="write the report as JSON here")
    args = ap.parse_args(argv)
    return run_report("latent_predict", predict, table, args.out)


if __name__ == "__main__":
    sys.exit(main())
