"""GPU benchmark: DF11 decode throughput and decode-then-GEMV at M = 1 against the plain BF16 GEMV.

Targets (issue 20, H100/H200 class): decode >= 250 GB/s of BF16 output; decode + GEMV at M = 1 within 1.5x the
uncompressed BF16 GEMV's time. Two decode-step paths are timed: decode into the shared buffer then
F.linear (bit-identical to the BF16 layer), and `df11_gemv` (weights decoded in registers, fp32 sums; its
relative error against fp64 is reported). Weights are synthetic N(0, 0.02) (a trained layer's exponent
histogram: ~2.6 bits of entropy). Every shape is checked bit-exact on the GPU (decoded bits, and the
buffered GEMV output against F.linear on the original weight). A small sweep over chunk size and chunks per
program (lanes) feeds the choice of defaults. Small M (2..16, batched decode / short prefill): the fused
tile GEMM (`df11_gemm`, no decompressed weight) against decode-into-buffer + F.linear and plain BF16
F.linear, with its error against fp64, for choosing `df11_linear.FUSED_MAX_M`.

Smoke mode (`gpu_suite.py --smoke`): N, K and M shrunk by `gpu_suite.smoke_shape` (chunking kept),
still bf16 (the kernels move bf16 as int16 bits, which the interpreter handles), one CPU-timed call each,
and only the first point of the chunking sweep (the interpreter decodes slowly; the others run the same code):
the defaults, so the main row's measurement at that shape stands for it (as in any run where they coincide).

Entry point for the GPU suite: `run(report)` adds report["df11"]. Standalone:
.venv/bin/python bench/gpu_df11.py [--quick] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from codesign.kernels.df11 import codec
from codesign.kernels.df11 import rows as df11_rows
from codesign.kernels.df11.linear import DecodeWorkspace, PackedDF11, df11_gemm, df11_gemv
from codesign.kernels.df11.packed_rows import PackedDF11Rows, df11_rows_gemv

TARGET_DECODE_GBPS = 250.0
TARGET_GEMV_SLOWDOWN = 1.5
# (N, K): Llama-2-7B's q/o projection, its MLP up and down projections.
SHAPES = [(4096, 4096), (11008, 4096), (4096, 11008)]
SMALL_M = (2, 4, 8, 16)
ROWS_M = (1, 2, 4)  # the rows GEMV's M (it takes up to 4 rows of x)
SWEEP = [(8, 128), (16, 128), (32, 64), (32, 128), (32, 256), (64, 128)]  # (chunk_bytes, chunks_per_group)
# Fused paths vs fp64: fp32 sums, one bf16 rounding of the output (2^-9); a wrong decode is O(1).
FUSED_REL_ERR_BOUND = 4e-3
_MODE: Any = None  # the suite's run mode while run() runs (None: standalone, the GPU)


def _default_mode(mode: Any) -> Any:
    """The suite's run mode; standalone runs get the suite's GPU mode."""
    if mode is not None:
        return mode
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from gpu_suite import GPU

    return GPU


def _bench_ms(fn) -> float:
    from triton.testing import do_bench

    if _MODE is not None and _MODE.smoke:
        return _MODE.time_ms(fn)
    return float(do_bench(fn, warmup=10, rep=50, return_mode="median"))


def _one(n: int, k: int, chunk_bytes: int, chunks_per_group: int, dev: torch.device) -> dict:
    w = (torch.randn(n, k, device=dev, dtype=torch.float32) * 0.02).to(torch.bfloat16)
    df = codec.compress(w.cpu(), chunk_bytes=chunk_bytes, chunks_per_group=chunks_per_group)
    packed = PackedDF11(df, dev)
    buf = DecodeWorkspace().get(n * k, dev)
    decoded = packed.decode_into(buf, check=True)
    exact = bool(torch.equal(decoded.view(torch.int16), w.view(torch.int16)))
    x = torch.randn(1, k, device=dev, dtype=torch.bfloat16)
    y_ref = F.linear(x, w)
    y = F.linear(x, packed.decode_into(buf, check=False))
    exact = exact and bool(torch.equal(y, y_ref))
    t_dec = _bench_ms(lambda: packed.decode_into(buf, check=False))
    t_gemv = _bench_ms(lambda: F.linear(x, w))
    t_buffered = _bench_ms(lambda: F.linear(x, packed.decode_into(buf, check=False)))
    y_fused = df11_gemv(packed, x)
    ref = (w.double() @ x.double().reshape(-1)).reshape(1, -1)
    fused_err = float((y_fused.double() - ref).norm() / ref.norm())
    t_fused = _bench_ms(lambda: df11_gemv(packed, x, check=False))
    return {
        "n": n, "k": k, "chunk_bytes": chunk_bytes, "chunks_per_group": chunks_per_group,
        "ratio": df.ratio, "bits_per_weight": df.bits_per_weight, "max_codes_per_chunk": df.max_codes_per_chunk,
        "bit_exact": exact, "decode_ms": t_dec, "decode_gbps": 2 * n * k / t_dec / 1e6,
        "gemv_bf16_ms": t_gemv, "decode_then_gemv_ms": t_buffered, "decode_then_gemv_slowdown": t_buffered / t_gemv,
        "fused_gemv_ms": t_fused, "fused_gemv_slowdown": t_fused / t_gemv, "fused_gemv_rel_err": fused_err,
        "gemv_slowdown": min(t_fused, t_buffered) / t_gemv,
    }  # fmt: skip


def _small_m(n: int, k: int, dev: torch.device, ms: tuple[int, ...]) -> list[dict]:
    """Fused tile GEMM vs decode-into-buffer + F.linear vs BF16 F.linear at small M (one weight)."""
    w = (torch.randn(n, k, device=dev, dtype=torch.float32) * 0.02).to(torch.bfloat16)
    df = codec.compress(w.cpu())
    packed = PackedDF11(df, dev, segment=1024)
    buf = DecodeWorkspace().get(n * k, dev)
    rows = []
    for m in ms:
        x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
        ref = x.double() @ w.double().T
        y = df11_gemm(packed, x)
        t_bf16 = _bench_ms(lambda x=x: F.linear(x, w))
        t_buf = _bench_ms(lambda x=x: F.linear(x, packed.decode_into(buf, check=False)))
        t_fused = _bench_ms(lambda x=x: df11_gemm(packed, x, check=False))
        rows.append({
            "n": n, "k": k, "m": m, "bits_per_weight": packed.bits_per_weight, "bf16_ms": t_bf16,
            "decode_then_gemm_ms": t_buf, "fused_gemm_ms": t_fused, "fused_slowdown": t_fused / t_bf16,
            "buffer_slowdown": t_buf / t_bf16, "fused_rel_err": float((y.double() - ref).norm() / ref.norm()),
        })  # fmt: skip
    return rows


def _rows_one(n: int, k: int, dev: torch.device, ms: tuple[int, ...]) -> dict:
    """The rows layout at [n, k]: bit-exact decode, decoder GB/s, fused GEMV per M against bf16 F.linear."""
    w = (torch.randn(n, k, device=dev, dtype=torch.float32) * 0.02).to(torch.bfloat16)
    df = df11_rows.compress_rows(w.cpu())
    packed = PackedDF11Rows(df, dev)
    buf = DecodeWorkspace().get(n * k, dev)
    exact = bool(torch.equal(packed.decode_into(buf, check=True).view(torch.int16), w.view(torch.int16)))
    x1 = torch.randn(1, k, device=dev, dtype=torch.bfloat16)
    exact = exact and bool(torch.equal(F.linear(x1, packed.decode_into(buf, check=False)), F.linear(x1, w)))
    t_dec = _bench_ms(lambda: packed.decode_into(buf, check=False))
    row = {"n": n, "k": k, "lanes": df.lanes, "ratio": df.ratio, "bits_per_weight": df.bits_per_weight,
           "index_bits_per_weight": df.index_bits_per_weight, "bit_exact": exact, "decode_ms": t_dec,
           "decode_gbps": 2 * n * k / t_dec / 1e6, "gemv": []}  # fmt: skip
    for m in ms:
        x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
        ref = x.double() @ w.double().T
        y = df11_rows_gemv(packed, x)
        t_bf16 = _bench_ms(lambda x=x: F.linear(x, w))
        t_fused = _bench_ms(lambda x=x: df11_rows_gemv(packed, x, check=False))
        row["gemv"].append({"m": m, "bf16_ms": t_bf16, "fused_ms": t_fused, "fused_slowdown": t_fused / t_bf16,
                            "fused_rel_err": float((y.double() - ref).norm() / ref.norm())})  # fmt: skip
    return row


def _side_by_side(flat: list[dict], rows: list[dict]) -> list[dict]:
    """Per shape: both layouts' bits/weight, decoder GB/s and M = 1 fused GEMV time over the bf16 GEMV."""
    return [{"n": f["n"], "k": f["k"], "flat_bits_per_weight": f["bits_per_weight"],
             "rows_bits_per_weight": r["bits_per_weight"], "flat_decode_gbps": f["decode_gbps"],
             "rows_decode_gbps": r["decode_gbps"], "flat_fused_gemv_slowdown": f["fused_gemv_slowdown"],
             "rows_fused_gemv_slowdown": r["gemv"][0]["fused_slowdown"]} for f, r in zip(flat, rows)]  # fmt: skip


def run(report: dict, quick: bool = False, mode: Any = None) -> None:
    """Measure on the current CUDA device and store results under report["df11"] (needs a GPU)."""
    global _MODE
    mode = _default_mode(mode)
    if not mode.available():
        report["df11"] = {"skipped": "needs a CUDA GPU"}
        return
    dev = torch.device(mode.device)
    _MODE = mode
    try:
        out: dict = {"gpu": mode.gpu_name(), "targets": {
            "decode_gbps_min": TARGET_DECODE_GBPS, "gemv_slowdown_max": TARGET_GEMV_SLOWDOWN}}  # fmt: skip
        shapes = [tuple(mode.scale(N=n, K=k).values()) for n, k in (SHAPES[:1] if quick else SHAPES)]
        rows = [_one(n, k, codec.DEFAULT_CHUNK_BYTES, codec.DEFAULT_CHUNKS_PER_GROUP, dev) for n, k in shapes]
        out["shapes"] = rows
        n, k = mode.scale(N=4096, K=4096).values()
        sweep = SWEEP[:2] if quick else SWEEP
        if mode.smoke:  # every point runs the same code; in the interpreter each costs ~20 s of decoding
            sweep = sweep[:1]
        # A sweep point at a main row's shape and chunking (the defaults (8, 128) are the sweep's first point)
        # is that row's very measurement: reused, not decoded and timed a second time.
        done = {(r["n"], r["k"], r["chunk_bytes"], r["chunks_per_group"]): r for r in rows}
        out["sweep_4096x4096"] = [dict(done[(n, k, cb, cpg)]) if (n, k, cb, cpg) in done else _one(n, k, cb, cpg, dev)
                                  for cb, cpg in sweep]  # fmt: skip
        small = SMALL_M[:2] if quick else SMALL_M
        ms = tuple(dict.fromkeys(mode.scale(M=m)["M"] for m in small))  # smoke may merge some: run once
        out["small_m_4096x4096"] = _small_m(n, k, dev, ms)
        rows_ms = (1,) if quick or mode.smoke else ROWS_M
        out["rows_layout"] = [_rows_one(n_, k_, dev, rows_ms) for n_, k_ in shapes]
        out["layouts_side_by_side"] = _side_by_side(rows, out["rows_layout"])
        out["all_bit_exact"] = all(r["bit_exact"] for r in rows + out["sweep_4096x4096"] + out["rows_layout"])
        out["decode_target_met"] = all(r["decode_gbps"] >= TARGET_DECODE_GBPS for r in rows)
        out["rows_decode_target_met"] = all(
            r["decode_gbps"] >= TARGET_DECODE_GBPS for r in out["rows_layout"]
        )
        out["gemv_target_met"] = all(r["gemv_slowdown"] <= TARGET_GEMV_SLOWDOWN for r in rows)
        errs = [r["fused_gemv_rel_err"] for r in rows + out["sweep_4096x4096"]]
        errs += [r["fused_rel_err"] for r in out["small_m_4096x4096"]]
        errs += [g["fused_rel_err"] for r in out["rows_layout"] for g in r["gemv"]]
        out["fused_rel_err_bound"] = FUSED_REL_ERR_BOUND
        out["checks_ok"] = out["all_bit_exact"] and all(e <= FUSED_REL_ERR_BOUND for e in errs)
        report["df11"] = out
    finally:
        _MODE = None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="one shape, two sweep points")
    ap.add_argument("--json", help="write the report to this file")
    args = ap.parse_args()
    report: dict = {}
    run(report, quick=args.quick)
    text = json.dumps(report, indent=1)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
