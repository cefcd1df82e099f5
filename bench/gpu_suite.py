"""The one GPU suite: correctness of every kernel on the GPU, timings vs baselines, a short tuning pass.

    python bench/gpu_suite.py [--out FILE] [--full] [--tune-seconds 90] [--skip NAME ...]

On one H100/H200-class GPU it runs, in this order, in under 8 minutes:
  1. ceilings: device-to-device copy bandwidth and a bf16 matmul rate, on random data (the two
     numbers every "% of roofline" below is read against);
  2. correctness: each tunable kernel (`codesign.autotune` adapters: W4A16, W8A16, W8A8, FP8 GEMM, the
     activation quantizer, the fused DF11 GEMM, paged decode attention over plain and
     int8/int4/int2/fp8/mixed/KIVI/Oaken caches) with its default launch config, at odd shapes, in float16,
     bfloat16 and float32, into NaN-poisoned outputs, against an fp64 reference;
  3. the kernels' own benchmarks: every `bench/gpu_*.py` module with `run(report)` (quantized
     GEMM and attention vs torch / FlashInfer / vLLM where importable, ...), each in try/except so
     one failing section is recorded, not fatal;
  4. a short tuning pass (TPE, CUDA graphs, cold L2): one small shape of every registered tunable op,
     the time budget split evenly, in an isolated child process (a config that crashes it is recorded
     and skipped, the child restarted: the suite itself never dies of a bad config), reporting the
     tuned time against the default config's, and the exported tables.
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
    "quantize_per_token": ["M=5,K=4096", "M=130,K=1000"],
    "df11_gemm": ["M=5,N=1000,K=4096", "M=16,N=4096,K=3000"],
    **{f"paged_attention_{f}": ["M=7,q_heads=32,kv_heads=8,head_dim=128,block_size=16,ctx=1000"]
       for f in ("int8", "int4", "int2", "fp8", "mixed", "kivi", "oaken")},
}  # fmt: skip
# One small shape per registered tunable op (Llama-3-8B sizes, decode batches): the tuning pass.
_ATT = "q_heads=32,kv_heads=8,head_dim=128,block_size=16"
TUNE_SHAPES = {
    "w4a16_gemm": "M=16,N=4096,K=4096,G=128",
    "w8a16_gemm": "M=16,N=4096,K=4096,G=128",
    "w8a8_gemm": "M=64,N=4096,K=4096",
    "fp8_gemm": "M=64,N=4096,K=4096",
    "quantize_per_token": "M=64,K=4096",
    "df11_gemm": "M=8,N=4096,K=4096",
    "paged_attention": f"M=16,{_ATT},ctx=4096",
    **{
        f"paged_attention_{f}": f"M=16,{_ATT},ctx=4096"
        for f in ("int8", "int4", "int2", "fp8", "mixed", "kivi", "oaken")
    },
}
TUNE_MAX_EVALS = 60


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
    from codesign.autotune.tuner import DTYPES, checked_output, rel_error

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
                        err = rel_error(checked_output(op, inputs, out), op.reference(inputs))
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
    report: dict,
    seconds: float,
    out_dir: Path,
    device: str = "cuda",
    dtype_name: str = "float16",
    shapes: dict[str, str] | None = None,
    imports: tuple[str, ...] = (),
) -> None:
    """Tune one shape of every registered op within `seconds` in all; rows and tables into report["tuning"].

    The search runs in an isolated child (`codesign.autotune.isolate`); this process only times the
    default configs (already checked by the correctness section) and exports the tables.
    """
    import torch

    from codesign.autotune.cache import TuningCache
    from codesign.autotune.export import export_table
    from codesign.autotune.isolate import TuneJob, run_isolated
    from codesign.autotune.ops import available_ops, get_op, parse_shape, registered_ops
    from codesign.autotune.strategies import Budget
    from codesign.autotune.tuner import Tuner

    t0 = time.monotonic()
    shapes = TUNE_SHAPES if shapes is None else shapes
    dtype = getattr(torch, dtype_name)
    rows: list[dict[str, Any]] = []
    avail = set(available_ops())
    tasks = []
    for name in registered_ops():
        if name not in shapes:
            if not name.startswith("test_"):
                rows.append({"op": name, "error": "no tuning shape in bench/gpu_suite.py TUNE_SHAPES"})
            continue
        if name not in avail:
            rows.append({"op": name, "error": "kernel not importable here"})
            continue
        tasks.append((name, [parse_shape(shapes[name])]))
    # The child's start-up (imports, CUDA init) and the default timings come out of the same budget.
    per_shape = max(2.0, 0.8 * seconds / max(1, len(tasks)))
    cache = TuningCache(out_dir / "tune-cache.jsonl")
    settings = dict(dtype=dtype, device=device, strategy="tpe",
                    budget=Budget(max_evals=TUNE_MAX_EVALS, max_seconds=per_shape))  # fmt: skip
    logs: list[str] = []
    results: list[dict[str, Any]] = []
    error = None
    try:
        results = run_isolated(TuneJob(tasks, str(cache.path), settings, imports), log=logs.append)
    except Exception as e:  # gave up restarting: the cache still holds what was measured
        error = f"{type(e).__name__}: {e}"[:600]
    tables = {}
    for (name, (shape,)), res in zip(tasks, results or [None] * len(tasks)):
        op = get_op(name)
        row: dict[str, Any] = {"op": name, "shape": shape}
        try:  # what the cache holds for this shape, even when the run stopped early
            p = export_table(cache, Tuner(op, cache, dtype=dtype, device=device, log=lambda s: None).gpu,
                             op.table_op(shape), op.source_modules, dtype_name, out_dir / "tables")  # fmt: skip
            if p:
                tables[op.table_op(shape)] = json.loads(p.read_text())
        except Exception as e:
            row["export_error"] = f"{type(e).__name__}: {e}"[:300]
        if res is None:
            rows.append({**row, "error": "tuning did not finish (see tuning.error)"})
            continue
        row.update({k: res[k] for k in ("table_op", "key", "m", "best", "best_ms", "n_candidates", "n_pruned",
                                        "n_new", "n_failed", "n_crashed")})  # fmt: skip
        row["failures"] = res["failures"][:5]
        try:  # the default config, timed the same way: the tuning gain
            tuner = Tuner(op, cache, dtype=dtype, device=device, log=lambda s: None)
            sets = [
                op.make_inputs(shape, dtype, device, 100 + i) for i in range(4 if device == "cuda" else 1)
            ]
            default_ms, _ = tuner.time_config(sets, {})
            row["default_ms"] = default_ms
            row["speedup_vs_default"] = default_ms / res["best_ms"] if res["best_ms"] else None
        except Exception as e:
            row["default_error"] = f"{type(e).__name__}: {e}"[:300]
        rows.append(row)
    report["tuning"] = {
        "rows": rows, "tables": tables, "strategy": "tpe", "seconds_per_shape": per_shape,
        "max_evals_per_shape": TUNE_MAX_EVALS, "isolated": True, "log": logs[-20:], "error": error,
        "seconds": time.monotonic() - t0,
    }  # fmt: skip


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
        if "table_op" not in r:
            lines.append(f"tune {r['op']}: {r.get('error')}")
            continue
        sp = r.get("speedup_vs_default")
        best = r["best_ms"] if r["best_ms"] is not None else math.nan
        gain = f" (x{sp:.2f} vs default)" if sp else ""
        lines.append(f"tune {r['table_op']} {r['key']} M={r['m']}: {best:.4f} ms{gain}")
    if report.get("tuning", {}).get("error"):
        lines.append(f"tuning stopped early: {report['tuning']['error'][:200]}")
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
