"""The one GPU suite: correctness of every kernel on the GPU, timings vs baselines, a short tuning pass.

    python bench/gpu_suite.py [--out FILE] [--full] [--tune-seconds 90] [--skip NAME ...]

On one H100/H200-class GPU it runs, in this order, in under 8 minutes:
  1. ceilings: device-to-device copy bandwidth and a bf16 matmul rate, on random data (the two
     numbers every "% of roofline" below is read against);
  2. correctness: each tunable kernel (`codesign.autotune` adapters: W4A16, W8A16, W8A8, FP8 GEMM, paged
     decode attention) with its default launch config, at odd shapes, in float16, bfloat16 and
     float32, into NaN-poisoned outputs, against an fp64 reference (||out - ref||_F / ||ref||_F);
  3. the kernels' own benchmarks: every `bench/gpu_*.py` module with `run(report)` (quantized
     GEMM and attention vs torch / FlashInfer / vLLM where importable, ...), each in try/except so
     one failing section is recorded, not fatal;
  4. a short tuning pass (TPE, CUDA graphs, cold L2): a few decode and prefill shapes of W4A16 and
     paged attention, reporting the tuned time against the default config's, and the tables.
Writes one JSON file (default bench/results/<gpu-slug>-<date>.json) and prints a summary table.
Without a CUDA GPU it prints why and exits with status 2.
"""

from __future__ import annotations

import argparse
import datetime as dt
import importlib.util
import inspect
import json
import math
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

BENCH_DIR = Path(__file__).resolve().parent
CORRECTNESS_SHAPES = {
    "w4a16_gemm": ["M=1,N=4096,K=4096,G=128", "M=37,N=1000,K=4096,G=64", "M=300,N=4096,K=1024,G=0"],
    "w8a16_gemm": ["M=3,N=4096,K=4096,G=128", "M=129,N=1000,K=2048,G=0"],
    "w8a8_gemm": ["M=5,N=4096,K=4096", "M=257,N=1000,K=2048"],
    "fp8_gemm": ["M=9,N=4096,K=4096", "M=130,N=1000,K=2048"],
    "paged_attention": ["M=7,q_heads=32,kv_heads=8,head_dim=128,block_size=16,ctx=1000",
                        "M=3,q_heads=12,kv_heads=12,head_dim=64,block_size=32,ctx=333"],
}  # fmt: skip
TUNE_SHAPES = {
    "w4a16_gemm": ["M=1,N=4096,K=4096,G=128", "M=16,N=14336,K=4096,G=128", "M=256,N=4096,K=4096,G=128"],
    "paged_attention": ["M=16,q_heads=32,kv_heads=8,head_dim=128,block_size=16,ctx=4096"],
}


def _ceilings(report: dict) -> None:
    import torch

    n = 1 << 28  # 1 GiB of fp32 per buffer: far beyond L2
    a = torch.randn(n, device="cuda")
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    torch.cuda.synchronize()
    ms = _events(lambda: b.copy_(a), 20)
    x = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    y = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    mm = _events(lambda: x @ y, 20)
    report["ceilings"] = {
        "copy_GBps": 2 * a.numel() * 4 / (ms * 1e-3) / 1e9,  # bytes read + bytes written
        "bf16_matmul_TFLOPs": 2 * 8192**3 / (mm * 1e-3) / 1e12,
        "method": "median of 20 CUDA-event timings after 3 warm-ups; random data",
    }


def _events(fn, reps: int) -> float:
    import torch

    times = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e))
    return sorted(times)[len(times) // 2]


def _correctness(
    report: dict, device: str = "cuda", dtypes: tuple[str, ...] = ("float16", "bfloat16", "float32")
) -> None:
    import torch

    from codesign.autotune.ops import available_ops, get_op, parse_shape
    from codesign.autotune.tuner import DTYPES, rel_error

    rows = []
    for name in available_ops():
        op = get_op(name)
        for text in CORRECTNESS_SHAPES.get(name, []):
            shape = parse_shape(text)
            for dname in dtypes:
                dtype = DTYPES[dname]
                row: dict[str, Any] = {"op": name, "shape": text, "dtype": dname}
                try:
                    for seed in (1, 2):  # fresh data twice: a race shows as a moving error
                        inputs = op.make_inputs(shape, dtype, device, seed)
                        if hasattr(op, "poison"):
                            op.poison(inputs)
                        out = op.run(inputs, {})  # {}: the kernel's default config
                        if device == "cuda":
                            torch.cuda.synchronize()
                        err = rel_error(out, op.reference(inputs))
                        row[f"rel_error_seed{seed}"] = err
                    row["bound"] = op.tolerance(dtype)
                    row["ok"] = all(row[f"rel_error_seed{s}"] <= row["bound"] for s in (1, 2))
                except Exception as e:
                    row.update(ok=False, error=f"{type(e).__name__}: {e}"[:400])
                rows.append(row)
    report["correctness"] = {"rows": rows, "all_ok": all(r["ok"] for r in rows), "n": len(rows)}


def _kernel_benches(report: dict, quick: bool, skip: set[str]) -> None:
    done = {}
    for path in sorted(BENCH_DIR.glob("gpu_*.py")):
        name = path.stem
        if name == "gpu_suite" or name in skip:
            continue
        t0 = time.monotonic()
        try:
            spec = importlib.util.spec_from_file_location(f"_bench_{name}", path)
            mod = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(mod)
            if not hasattr(mod, "run"):
                continue
            kwargs = {"quick": quick} if "quick" in inspect.signature(mod.run).parameters else {}
            mod.run(report, **kwargs)
            done[name] = {"ok": True, "seconds": time.monotonic() - t0}
        except Exception as e:
            done[name] = {"ok": False, "seconds": time.monotonic() - t0, "error": f"{type(e).__name__}: {e}"[:400],
                          "trace": traceback.format_exc(limit=4)[-1500:]}  # fmt: skip
    report["kernel_benches"] = done


def _tuning(
    report: dict, seconds: float, out_dir: Path, device: str = "cuda", dtype_name: str = "float16"
) -> None:
    import torch

    from codesign.autotune.cache import TuningCache
    from codesign.autotune.export import export_table
    from codesign.autotune.ops import available_ops, get_op, parse_shape
    from codesign.autotune.strategies import Budget
    from codesign.autotune.tuner import Tuner

    dtype = getattr(torch, dtype_name)
    shapes = [(n, parse_shape(s)) for n in TUNE_SHAPES if n in available_ops() for s in TUNE_SHAPES[n]]
    per_shape = max(10.0, seconds / max(1, len(shapes)))
    cache = TuningCache(out_dir / "tune-cache.jsonl")
    rows, tables = [], {}
    for name, shape in shapes:
        op = get_op(name)
        tuner = Tuner(op, cache, dtype=dtype, device=device, strategy="tpe",
                      budget=Budget(max_evals=60, max_seconds=per_shape))  # fmt: skip
        res = tuner.tune_shape(shape)
        row = {"op": name, "shape": shape, **{k: getattr(res, k) for k in ("table_op", "key", "m", "best", "best_ms",
               "n_candidates", "n_pruned", "n_new", "n_failed")}}  # fmt: skip
        # The default config, timed the same way: the tuning gain.
        try:
            sets = [op.make_inputs(shape, dtype, device, 100 + i) for i in range(4)]
            default_ms, _ = tuner.time_config(sets, {})
            row["default_ms"] = default_ms
            row["speedup_vs_default"] = default_ms / res.best_ms if res.best_ms else None
        except Exception as e:
            row["default_error"] = str(e)[:300]
        rows.append(row)
        p = export_table(cache, tuner.gpu, res.table_op, op.source_modules, dtype_name, out_dir / "tables")
        if p:
            tables[res.table_op] = json.loads(p.read_text())
    report["tuning"] = {"rows": rows, "tables": tables, "strategy": "tpe", "seconds_per_shape": per_shape}


def _env(report: dict) -> None:
    import torch
    import triton

    p = torch.cuda.get_device_properties(0)
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=BENCH_DIR,
                                timeout=5).stdout.strip()  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        commit = ""
    report["env"] = {
        "gpu": p.name, "sms": p.multi_processor_count, "memory_GiB": p.total_memory / 2**30,
        "capability": f"{p.major}.{p.minor}", "torch": torch.__version__, "triton": triton.__version__,
        "cuda": torch.version.cuda, "date_utc": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "commit": commit,
    }  # fmt: skip


def _summary(report: dict) -> str:
    lines = [f"GPU {report['env']['gpu']}  ({report['wall_seconds']:.0f} s)"]
    c = report.get("ceilings", {})
    if "copy_GBps" in c:
        lines.append(f"copy {c['copy_GBps']:.0f} GB/s   bf16 matmul {c['bf16_matmul_TFLOPs']:.0f} TFLOP/s")
    cor = report.get("correctness", {})
    if cor:
        bad = [r for r in cor["rows"] if not r["ok"]]
        lines.append(f"correctness: {cor['n'] - len(bad)}/{cor['n']} ok")
        lines += [f"  FAIL {r['op']} {r['shape']} {r['dtype']}: {r.get('error') or r.get('rel_error_seed1')}"
                  for r in bad[:8]]  # fmt: skip
    for name, b in report.get("kernel_benches", {}).items():
        lines.append(
            f"bench {name}: {'ok' if b['ok'] else 'FAILED ' + b['error'][:100]} ({b['seconds']:.0f} s)"
        )
    for r in report.get("tuning", {}).get("rows", []):
        sp = r.get("speedup_vs_default")
        best = r["best_ms"] if r["best_ms"] is not None else math.nan
        gain = f" (x{sp:.2f} vs default)" if sp else ""
        lines.append(f"tune {r['table_op']} {r['key']} M={r['m']}: {best:.4f} ms{gain}")
    for k, err in report.get("errors", {}).items():
        lines.append(f"section {k} FAILED: {err[:160]}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Run the suite (see the module docstring); 0 when it ran, 2 without a GPU."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--out", type=Path, default=None, help="JSON report (default bench/results/<gpu>-<date>.json)"
    )
    ap.add_argument(
        "--full", action="store_true", help="kernel benchmarks in full (default quick=True: < 8 min)"
    )
    ap.add_argument("--tune-seconds", type=float, default=90.0, help="total wall time of the tuning pass")
    ap.add_argument("--skip", nargs="*", default=[], help="sections or bench modules to skip")
    args = ap.parse_args(argv)
    try:
        import torch

        has_gpu = torch.cuda.is_available()
    except ImportError:
        has_gpu = False
    if not has_gpu:
        print("gpu_suite: no CUDA GPU found; this suite needs an NVIDIA GPU (H100/H200-class). Nothing was run.",
              file=sys.stderr)  # fmt: skip
        return 2
    from codesign.autotune.export import atomic_write_json
    from codesign.autotune.lookup import gpu_slug

    t0 = time.monotonic()
    report: dict[str, Any] = {"suite_version": 1, "errors": {}}
    _env(report)
    skip = set(args.skip)
    with tempfile.TemporaryDirectory() as tmp:
        sections = [("ceilings", lambda: _ceilings(report)), ("correctness", lambda: _correctness(report)),
                    ("kernel_benches", lambda: _kernel_benches(report, not args.full, skip)),
                    ("tuning", lambda: _tuning(report, args.tune_seconds, Path(tmp)))]  # fmt: skip
        for name, fn in sections:
            if name in skip:
                continue
            s0 = time.monotonic()
            try:
                fn()
            except Exception as e:
                report["errors"][name] = f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=4)[-1500:]}"
            report.setdefault("section_seconds", {})[name] = time.monotonic() - s0
    report["wall_seconds"] = time.monotonic() - t0
    day = dt.date.today().isoformat()
    out = args.out or BENCH_DIR / "results" / f"{gpu_slug(report['env']['gpu'])}-{day}.json"
    atomic_write_json(out, json.loads(json.dumps(report, default=str)))
    print(_summary(report))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
