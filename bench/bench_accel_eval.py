"""Benchmark: one whole Llama-2-7B decode step (32 layers' operators) evaluated on each built-in design.

Target (issue 6): < 50 ms per step on one core. Reports the median wall time and the median CPU time
of the process (time.process_time: the single-core cost, meaningful on a shared, loaded machine).
The spec list is built by hand here: per layer RMSNorm, QKV GEMM, RoPE, KV write, paged decode
attention, O GEMM, residual add, RMSNorm, gate+up GEMM, SiLU*mul, down GEMM, residual add; then the
final norm, the LM head and sampling.

Run: .venv/bin/python bench/bench_accel_eval.py [--batch 16] [--context 2048] [--repeat 20]
"""

from __future__ import annotations

import argparse
import statistics
import time

from codesign.accel_model.design import builtin_designs, load_design
from codesign.accel_model.evaluate import evaluate
from codesign.specs import (
    Elementwise,
    Embedding,
    Gemm,
    KVFormat,
    KVWrite,
    Norm,
    OpSpec,
    PagedDecodeAttention,
    RoPE,
    Sampling,
)

HIDDEN, HEADS, HEAD_DIM, FFN, LAYERS, VOCAB = 4096, 32, 128, 11008, 32, 32000


def llama2_7b_decode_step(batch: int, context: int, kv: KVFormat) -> list[OpSpec]:
    """All operators of one decode step of Llama-2-7B (MHA: 32 q and kv heads), `batch` sequences."""
    b = batch
    ops: list[OpSpec] = [Embedding(b, VOCAB, HIDDEN)]
    for _ in range(LAYERS):
        ops += [
            Norm(b, HIDDEN),
            Gemm(b, 3 * HIDDEN, HIDDEN),
            RoPE(b, HEADS, HEADS, HEAD_DIM),
            KVWrite(b, HEADS, HEAD_DIM, kv),
            PagedDecodeAttention(HEADS, HEADS, HEAD_DIM, context_lens=tuple([context] * b), kv_format=kv),
            Gemm(b, HIDDEN, HIDDEN),
            Elementwise("add", b * HIDDEN),
            Norm(b, HIDDEN),
            Gemm(b, 2 * FFN, HIDDEN),
            Elementwise("silu_mul", b * FFN),
            Gemm(b, HIDDEN, FFN),
            Elementwise("add", b * HIDDEN),
        ]
    ops += [Norm(b, HIDDEN), Gemm(b, VOCAB, HIDDEN), Sampling(b, VOCAB)]
    return ops


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--repeat", type=int, default=20)
    args = ap.parse_args()
    print(
        f"{'design':12s} {'kv':14s} {'ops':>5s} {'wall ms':>8s} {'cpu ms':>7s} "
        f"{'step ms (model)':>16s} {'energy mJ':>10s}"
    )
    for name in builtin_designs():
        design = load_design(name)
        for kv in (KVFormat(), KVFormat.parse("int4-oaken")):
            ops = llama2_7b_decode_step(args.batch, args.context, kv)
            times, cpu = [], []
            for _ in range(args.repeat):
                t0, c0 = time.perf_counter(), time.process_time()
                results = [evaluate(design, op) for op in ops]
                times.append(time.perf_counter() - t0)
                cpu.append(time.process_time() - c0)
            step = sum(r.seconds for r in results)
            energy = sum(r.energy_total_pj for r in results)
            print(
                f"{name:12s} {kv.name:14s} {len(ops):5d} {statistics.median(times) * 1e3:8.2f} "
                f"{statistics.median(cpu) * 1e3:7.2f} "
                f"{step * 1e3:16.3f} {energy * 1e-9:10.2f}"
            )


if __name__ == "__main__":
    main()
