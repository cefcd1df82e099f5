"""The one GPU suite: correctness of every kernel on the GPU, timings vs baselines, a short tuning pass.

    python bench/gpu_suite.py [--out FILE] [--full] [--tune-seconds 90] [--budget 420] [--skip NAME ...]
                              [--peers-dir DIR]
    python bench/gpu_suite.py --smoke [--out FILE]     (or CODESIGN_GPU_SUITE_SMOKE=1): CPU dry run

On one H100/H200-class GPU it runs, in this order, in under 8 minutes:
  1. ceilings: device-to-device copy bandwidth and a bf16 matmul rate, on random data (the two
     numbers every "% of roofline" below is read against);
  2. correctness: each tunable kernel (`codesign.autotune` adapters: W4A16, W8A16, W8A8, FP8 GEMM, the
     activation quantizer, the DF11 decoder, GEMV and fused GEMM, the DF11 rows layout's decoder and GEMV,
     the (quantizing) KV-cache writers, paged decode attention over plain and
     int8/int4/int2/fp8/mixed/KIVI/Oaken caches) with its default launch config, at odd shapes, in float16,
     bfloat16 and float32, into NaN-poisoned outputs, against an fp64 reference;
  3. the kernels' own benchmarks: every `bench/gpu_*.py` module with `run(report)` (quantized
     GEMM and attention vs torch / FlashInfer / vLLM where importable, ...), most needed first
     (`BENCH_ORDER`), each in try/except so one failing section is recorded, not fatal;
  4. a short tuning pass (TPE, or random search where optuna is missing; CUDA graphs, cold L2): one
     small shape of every registered tunable op, the time budget split evenly, in an isolated child
     process (a config that crashes it is recorded and skipped, the child restarted: the suite itself
     never dies of a bad config), reporting the tuned time against the default config's, and the
     exported tables. It gets what is left of --budget (default 420 s) after sections 1-3, at most
     --tune-seconds.
Writes one JSON file (default bench/results/<gpu-slug>-<date>.json), rewritten after every section and
every kernel benchmark (`"finished": false` until the end; a SIGTERM, e.g. from `timeout`, writes what
is done and exits 124), and prints a summary table. Without a CUDA GPU it prints why and exits with status 2.

Smoke mode runs every section on the CPU through Triton's interpreter, exercising the same code: the
same tables, each shape shrunk by `smoke_shape` (the one scaling function), one timed call per case
(a CPU timer), correctness checks included. bfloat16 correctness rows are skipped with the reason (the
interpreter computes bf16 wrongly); benchmark sections that only run bf16 run float16 instead (DF11
keeps bf16: it moves bf16 as int16 bits). Its JSON has the same structure plus `"smoke": {...}`,
`env.gpu == "cpu-interpreter"`, and goes to a temp folder (never bench/results/). Exit status 0 when
every section ran and every correctness check passed, 1 otherwise (the GPU run exits 0 once it ran).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import importlib.util
import inspect
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from codesign.kernels.kvcache.formats import ATTENTION_TABLE_FORMATS, WRITE_TABLE_FORMATS

BENCH_DIR = Path(__file__).resolve().parent
KV_WRITE_OPS = ("kv_write", *(f"kv_write_{f}" for f in WRITE_TABLE_FORMATS))
RESULTS_DIR = BENCH_DIR / "results"
SMOKE_ENV = "CODESIGN_GPU_SUITE_SMOKE"
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
       for f in ATTENTION_TABLE_FORMATS},
    "df11_decode": ["N=1000,K=4096"],
    "df11_gemv": ["N=1000,K=4096"],
    # rows layout, its own lanes (auto_lanes): 32 at 4096 x 4096; 64 at 300 x 3001, so the default LANES = 32
    # splits each row in two (the GEMV's atomics), and K = 3001 ends in a masked step
    "df11_rows_decode": ["N=4096,K=4096", "N=300,K=3001"],
    "df11_rows_gemv": ["M=1,N=4096,K=4096", "M=4,N=300,K=3001"],
    **{op: ["M=37,kv_heads=8,head_dim=128"]  # one shape: 5 writers x 3 dtypes are 15 compiles already
       for op in KV_WRITE_OPS},
}  # fmt: skip
CORRECTNESS_DTYPES = ("float16", "bfloat16", "float32")
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
        for f in ATTENTION_TABLE_FORMATS
    },
    "df11_decode": "N=4096,K=4096",
    "df11_gemv": "N=4096,K=4096",
    "df11_rows_decode": "N=4096,K=4096",
    "df11_rows_gemv": "M=1,N=4096,K=4096",
    **{
        op: "M=64,kv_heads=8,head_dim=128"
        for op in KV_WRITE_OPS
    },
}
TUNE_MAX_EVALS = 60
# The whole suite's target wall time on the GPU (a lease's command runs at most 10 min); tuning gets what
# sections 1-3 leave of it, less TUNE_RESERVE_S for its exports. Paper estimate
# for one H200 (2026-11-30; a Triton compile ~1-1.5 s per kernel specialisation, do_bench_cudagraph ~0.6 s
# a case, CPU-side inputs on 16 cores):
#   start-up, CUDA init ~10 s | ceilings ~2 s | correctness 30 shapes x 3 dtypes x 2 seeds = 180 checks,
#   ~90 compiles, fp64 references ~150 s | quant_gemm quick: 2 shapes x 7 M x 5 kernels + 6 CuPy ~70 s |
#   attention: 44 decode + 3 extend + 1 tree ~50 s | kv_quant: 13 timings + 6 checks ~25 s | df11 quick:
#   3 containers (CPU compress of 4096^2, ~2 s each) + 2 small-M ~30 s | tuning ~60-90 s + ~15 s
#   = ~420-450 s (7-7.5 min). Added since, not yet timed: the peers in quant_gemm (up to 6 more kernels per
#   case, ~40 s), hf_generate (an 8B model built on the GPU, 5 variants x 2 batches x 16 tokens, ~60 s) and
#   hf_generate_mla (DeepSeek-V3's first 3 blocks, 3.6B, 3 variants x 2 batches x 16 tokens, a 2048-token
#   prefill each, ~20 s);
#   the tuning pass absorbs them (it gets what is left). A SIGTERM (timeout 560) writes what finished.
DEFAULT_BUDGET_S = 420.0
TUNE_RESERVE_S = 20.0

# ----------------------------------------------------------------------------- smoke scaling
# dim name -> (divisor, alignment cap); divisor 0 means "square root". Dims not listed (head_dim, block_size,
# G, KIVI group and residual, DF11 chunking) are structural: the kernels accept only some values, so they
# keep the real ones. Counts of rows / sequences / tokens shrink by a square root (a spread of small,
# often odd sizes that keeps their order: M > 16 still takes the tiled GEMM variant); widths divide.
SMOKE_RULES: dict[str, tuple[int, int]] = {
    "M": (0, 1), "batch": (0, 1), "q_len": (0, 1), "ctx": (0, 1), "prefix": (0, 1),
    "N": (256, 1), "K": (32, 128),  # K keeps its power-of-two factor up to 128: K % G and packing hold
    "q_heads": (8, 1), "kv_heads": (8, 1),  # q_heads is then rounded up to a multiple of kv_heads
    "copy": (4096, 1), "matmul": (32, 1),  # the ceilings' buffer elements and matmul side
}  # fmt: skip
SMOKE_SEEDS = (1,)
SMOKE_TUNE_SECONDS = 24.0
SMOKE_TUNE_MAX_EVALS = 1
BF16_REASON = "bfloat16 skipped in smoke mode: the Triton interpreter computes bf16 wrongly (TOOLCHAIN.md)"


def smoke_shape(shape: dict[str, int]) -> dict[str, int]:
    """The smoke run's stand-in for a real shape: the one function every smoke size comes from.

    Each listed dim v becomes ceil(sqrt(v)) (divisor 0) or ceil(v / divisor) rounded up to a multiple of
    u = min(cap, v & -v) (the largest power of two dividing v, capped); other dims are unchanged.
    So M = 300 -> 18, M = 4096 -> 64, ctx = 32768 -> 182, K = 4096 -> 128, K = 1000 -> 32,
    N = 57344 -> 224, heads 32/8 -> 4/1.
    """
    out: dict[str, int] = {}
    for name, v in shape.items():
        rule = SMOKE_RULES.get(name)
        if rule is None or v <= 0:
            out[name] = v
            continue
        div, cap = rule
        if div == 0:
            out[name] = math.isqrt(v - 1) + 1  # ceil(sqrt(v))
            continue
        unit = min(cap, v & -v)
        q = -(-v // div)  # ceil(v / div)
        out[name] = max(unit, -(-q // unit) * unit)
    if "q_heads" in out and "kv_heads" in out:  # keep the GQA ratio whole
        kv = out["kv_heads"]
        out["q_heads"] = -(-out["q_heads"] // kv) * kv
    return out


def _shape_text(shape: dict[str, int]) -> str:
    return ",".join(f"{k}={v}" for k, v in shape.items())


class Mode:
    """How the suite and its bench modules run: on the GPU (real) or on the CPU interpreter (smoke).

    Bench modules take it as `run(report, ..., mode=mode)` and ask it for their device, their shapes
    (`scale`: identity on the GPU, `smoke_shape` in smoke mode), dtypes and one-call timings.
    """

    def __init__(self, smoke: bool = False) -> None:
        # (No dataclass: test loaders exec this file without registering it in sys.modules.)
        self.smoke = smoke
        self.peers_dir: Path | None = None  # --peers-dir: peer packages as files (bench/peers.py)

    def __repr__(self) -> str:
        return f"Mode(smoke={self.smoke})"

    @property
    def device(self) -> str:
        return "cpu" if self.smoke else "cuda"

    def scale(self, **dims: int) -> dict[str, int]:
        """The dims to run for these real dims (unchanged on the GPU)."""
        return smoke_shape(dims) if self.smoke else dict(dims)

    def dtype(self, dtype: Any) -> Any:
        """The dtype to run for a benchmark written for `dtype`: bf16 becomes fp16 in smoke mode."""
        import torch

        return torch.float16 if self.smoke and dtype == torch.bfloat16 else dtype

    def time_ms(self, fn: Callable[[], Any]) -> float:
        """Smoke mode's timing: one call on a CPU timer (the numbers mean nothing; the code path runs)."""
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3

    def available(self) -> bool:
        """Whether this mode can run here (a CUDA device, or the interpreter for smoke)."""
        if self.smoke:
            from codesign.backend import interpreter_enabled

            return interpreter_enabled()
        import torch

        return torch.cuda.is_available()

    def gpu_name(self) -> str:
        import torch

        return "cpu-interpreter" if self.smoke else torch.cuda.get_device_name()

    def sync(self) -> None:
        if not self.smoke:
            import torch

            torch.cuda.synchronize()

    def empty_cache(self) -> None:
        if not self.smoke:
            import torch

            torch.cuda.empty_cache()

    def kernels(self) -> contextlib.AbstractContextManager:
        """Smoke: force the Triton backend (CPU tensors would take the torch path); GPU: no change."""
        from codesign.backend import use_backend

        return use_backend("triton") if self.smoke else contextlib.nullcontext()


GPU = Mode(False)
SMOKE = Mode(True)


# ----------------------------------------------------------------------------- sections
def _ceilings(report: dict, mode: Mode = GPU) -> None:
    import torch

    d = mode.scale(copy=1 << 28, matmul=8192)  # GPU: 1 GiB of fp32 per buffer, far beyond L2
    n, side = d["copy"], d["matmul"]
    a = torch.randn(n, device=mode.device)
    b = torch.empty_like(a)
    x = torch.randn(side, side, device=mode.device, dtype=mode.dtype(torch.bfloat16))
    y = torch.randn(side, side, device=mode.device, dtype=mode.dtype(torch.bfloat16))
    if mode.smoke:
        ms, mm = mode.time_ms(lambda: b.copy_(a)), mode.time_ms(lambda: x @ y)
    else:
        for _ in range(3):  # warm-up: allocator, cuBLAS handle and kernel selection stay out of the numbers
            b.copy_(a)
            x @ y
        torch.cuda.synchronize()
        from codesign.autotune.timing import event_median

        ms = event_median(lambda: b.copy_(a), 20)
        mm = event_median(lambda: x @ y, 20)
    report["ceilings"] = {
        "copy_GBps": 2 * a.numel() * 4 / (ms * 1e-3) / 1e9,  # bytes read + bytes written
        "bf16_matmul_TFLOPs": 2 * side**3 / (mm * 1e-3) / 1e12,
        "method": "one CPU-timed call (smoke)"
        if mode.smoke
        else "median of 20 CUDA-event timings after 3 warm-ups; random data",
    }


def _correctness(
    report: dict,
    device: str = "cuda",
    dtypes: tuple[str, ...] = CORRECTNESS_DTYPES,
    mode: Mode = GPU,
    save: Callable[[], None] = lambda: None,
) -> None:
    """Every available op at every CORRECTNESS_SHAPES entry (scaled by `mode`) and dtype, default config.

    A row is ok when both seeds' ||out - ref||_F / ||ref||_F <= the op's bound; smoke-mode bf16 rows
    are `skipped` (with the reason) and do not count. Rows are saved after each op.
    """
    import torch

    from codesign.autotune.ops import available_ops, get_op, parse_shape, registered_ops
    from codesign.autotune.tuner import DTYPES, checked_output, rel_error

    device = mode.device if mode.smoke else device
    # GPU: fresh data twice, a race shows as a moving error. Smoke: one seed (the interpreter runs the
    # programs one after another, so there is no race to see; the same loop runs).
    seeds = SMOKE_SEEDS if mode.smoke else (1, 2)
    rows: list[dict[str, Any]] = []
    report["correctness"] = {"rows": rows, "all_ok": False, "n": 0}
    avail = set(available_ops())
    for name in registered_ops():
        if name.startswith("test_"):
            continue
        if name not in avail:
            rows.append({"op": name, "ok": False, "error": "kernel not importable here"})
            continue
        op = get_op(name)
        seen: set[str] = set()
        for real in CORRECTNESS_SHAPES.get(name, []):
            shape = mode.scale(**parse_shape(real))
            text = _shape_text(shape)
            if text in seen:  # two real shapes with one smoke stand-in: run it once
                continue
            seen.add(text)
            for dname in dtypes:
                dtype = DTYPES[dname]
                row: dict[str, Any] = {"op": name, "shape": text, "dtype": dname}
                if mode.smoke:
                    row["real_shape"] = real
                    if dtype == torch.bfloat16:
                        rows.append({**row, "ok": None, "skipped": BF16_REASON})
                        continue
                try:
                    for seed in seeds:
                        inputs = op.make_inputs(shape, dtype, device, seed)
                        if hasattr(op, "poison"):
                            op.poison(inputs)
                        out = op.run(inputs, {})  # {}: the kernel's default config
                        if device == "cuda":
                            torch.cuda.synchronize()
                        err = rel_error(checked_output(op, inputs, out), op.reference(inputs))
                        row[f"rel_error_seed{seed}"] = err
                    row["bound"] = op.tolerance(dtype)
                    row["ok"] = all(row[f"rel_error_seed{s}"] <= row["bound"] for s in seeds)
                except Exception as e:
                    row.update(ok=False, error=f"{type(e).__name__}: {e}"[:400])
                rows.append(row)
        if not seen:
            rows.append(
                {"op": name, "ok": False, "error": "no shape in bench/gpu_suite.py CORRECTNESS_SHAPES"}
            )
        checked = [r for r in rows if not r.get("skipped")]
        report["correctness"].update(all_ok=all(r["ok"] for r in checked), n=len(checked))
        save()


# Kernel benches in the order a short lease needs them (a deadline's SIGTERM keeps what finished): the quantized
# GEMMs, the quantized KV caches, paged and tree attention, DF11, then the end-to-end and single-operator rows;
# any other bench module after these, by name.
BENCH_ORDER = ("gpu_quant_gemm", "gpu_kvquant", "gpu_attention", "gpu_df11", "gpu_hf", "gpu_ops")


def _bench_modules() -> list[Path]:
    rank = {name: i for i, name in enumerate(BENCH_ORDER)}
    found = [p for p in BENCH_DIR.glob("gpu_*.py") if p.stem != "gpu_suite"]
    return sorted(found, key=lambda p: (rank.get(p.stem, len(rank)), p.stem))


def _kernel_benches(
    report: dict, quick: bool, skip: set[str], mode: Mode = GPU, save: Callable[[], None] = lambda: None
) -> None:
    done: dict[str, Any] = {}
    report["kernel_benches"] = done
    for path in _bench_modules():
        name = path.stem
        if name in skip:
            continue
        t0 = time.monotonic()
        try:
            spec = importlib.util.spec_from_file_location(f"_bench_{name}", path)
            mod = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(mod)
            if not hasattr(mod, "run"):
                continue
            params = inspect.signature(mod.run).parameters
            kwargs: dict[str, Any] = {"quick": quick} if "quick" in params else {}
            if "mode" in params:
                kwargs["mode"] = mode
            elif mode.smoke:
                raise TypeError(f"{name}.run takes no `mode`: it cannot run in smoke mode")
            with mode.kernels():
                mod.run(report, **kwargs)
            done[name] = {"ok": True, "seconds": time.monotonic() - t0}
        except Exception as e:
            done[name] = {"ok": False, "seconds": time.monotonic() - t0, "error": f"{type(e).__name__}: {e}"[:400],
                          "trace": traceback.format_exc(limit=4)[-1500:]}  # fmt: skip
        save()


def _tuning(
    report: dict,
    seconds: float,
    out_dir: Path,
    device: str = "cuda",
    dtype_name: str = "float16",
    shapes: dict[str, str] | None = None,
    imports: tuple[str, ...] = (),
    max_evals: int = TUNE_MAX_EVALS,
) -> None:
    """Tune one shape of every registered op within `seconds` in all; rows and tables into report["tuning"].

    The search runs in an isolated child (`codesign.autotune.isolate`); this process only times the
    default configs (already checked by the correctness section) and exports the tables.
    """
    import torch

    from codesign.autotune.cache import TuningCache
    from codesign.autotune.space import DeviceLimits
    from codesign.autotune.strategies import Budget

    t0 = time.monotonic()
    limits = DeviceLimits.from_torch(device if device == "cuda" else None)
    shapes = TUNE_SHAPES if shapes is None else shapes
    dtype = getattr(torch, dtype_name)
    tasks, rows = _tuning_tasks(shapes, dtype, device, limits)
    # The child's start-up (imports, CUDA init) and the defaults' timings come out of the same budget.
    per_shape = max(2.0, 0.8 * seconds / max(1, len(tasks)))
    cache = TuningCache(out_dir / "tune-cache.jsonl")
    # The lent H200's image has no optuna (and nothing can be installed there): random search then.
    strategy = "tpe" if importlib.util.find_spec("optuna") is not None else "random"
    # default_trial: the tuner times each kernel's own default beside its search (also in smoke mode), so
    # the rows' tuning gain is measured side by side, in the same harness, with no second timing here.
    settings = dict(dtype=dtype, device=device, strategy=strategy, default_trial=True,
                    budget=Budget(max_evals=max_evals, max_seconds=per_shape))  # fmt: skip
    logs: list[str] = []
    results, error, task_errors = _tune_isolated(tasks, cache, settings, imports, logs.append, t0 + seconds)
    tables: dict[str, Any] = {}
    for (name, (shape,)), res in zip(tasks, results or [None] * len(tasks)):
        row = _tuning_row(name, shape, cache, settings, dtype_name, out_dir / "tables", tables)
        if res is None:
            rows.append({**row, "error": task_errors.get(name, "tuning did not finish (see tuning.error)")})
            continue
        row.update({k: res[k] for k in ("table_op", "key", "m", "best", "best_ms", "n_candidates", "n_pruned",
                                        "n_new", "n_failed", "n_crashed")})  # fmt: skip
        row["failures"] = res["failures"][:5]
        default_ms = res.get("default_ms")
        row["default_ms"] = default_ms
        row["speedup_vs_default"] = default_ms / res["best_ms"] if default_ms and res["best_ms"] else None
        rows.append(row)
    report["tuning"] = {
        "rows": rows, "tables": tables, "strategy": strategy, "seconds_per_shape": per_shape,
        "max_evals_per_shape": max_evals, "isolated": True, "log": logs[-20:], "error": error,
        "seconds": time.monotonic() - t0,
    }  # fmt: skip


def _tuning_tasks(
    shapes: dict[str, str], dtype: Any, device: str, limits: Any
) -> tuple[list[tuple[str, list[dict[str, int]]]], list[dict[str, Any]]]:
    """The tuning pass's (op, [shape]) tasks, and a row with the reason for each registered op left out
    (no shape, kernel not importable, shape rejected or every config pruned on this device)."""
    from codesign.autotune.ops import available_ops, get_op, parse_shape, registered_ops
    from codesign.specs.errors import CodesignError

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
        shape = parse_shape(shapes[name])
        try:  # checked here, not in the child: one op's bad shape would stop every op's tuning there
            op = get_op(name)
            op.check_shape(shape)
            if not op.space(shape, dtype, device == "cuda").candidates(limits):
                raise CodesignError(f"every config of {name} is pruned at {shape} on this device")
        except CodesignError as e:
            rows.append({"op": name, "shape": shape, "error": f"not tunable here: {e}"[:400]})
            continue
        tasks.append((name, [shape]))
    return tasks, rows


def _tune_isolated(
    tasks: list, cache: Any, settings: dict, imports: tuple[str, ...], log: Callable[[str], None], deadline: float
) -> tuple[list[dict[str, Any] | None], str | None, dict[str, str]]:
    """All tasks in one isolated child; if it gives up, each task alone (resuming from the cache) until
    `deadline` (time.monotonic()). Returns (results, the first failure or None, per-task errors)."""
    from codesign.autotune.isolate import TuneJob, run_isolated

    results: list[dict[str, Any] | None] = []
    error = None
    task_errors: dict[str, str] = {}
    try:
        results = run_isolated(TuneJob(tasks, str(cache.path), settings, imports), log=log)
    except Exception as e:  # gave up restarting: the cache still holds what was measured
        error = f"{type(e).__name__}: {e}"[:600]
        if len(tasks) > 1:  # one op's failure stopped all: each op alone (resuming), while time is left
            results = []
            for task in tasks:
                if time.monotonic() > deadline:
                    results.append(None)
                    task_errors[task[0]] = "skipped: the tuning budget ran out after the failure above"
                    continue
                try:
                    results += run_isolated(TuneJob([task], str(cache.path), settings, imports), log=log)
                except Exception as e1:
                    results.append(None)
                    task_errors[task[0]] = f"{type(e1).__name__}: {e1}"[:400]
    return results, error, task_errors


def _tuning_row(
    name: str, shape: dict[str, int], cache: Any, settings: dict, dtype_name: str, root: Path, tables: dict
) -> dict[str, Any]:
    """The start of an op's tuning row; exports what the cache holds for its shape (even when the run
    stopped early) under `root` and adds the table to `tables`, or the export's error to the row."""
    from codesign.autotune.export import export_table
    from codesign.autotune.ops import get_op
    from codesign.autotune.tuner import Tuner

    op = get_op(name)
    row: dict[str, Any] = {"op": name, "shape": shape}
    try:
        gpu = Tuner(op, cache, dtype=settings["dtype"], device=settings["device"], log=lambda s: None).gpu
        p = export_table(cache, gpu, op.table_op(shape), op.source_modules, dtype_name, root)
        if p:
            tables[op.table_op(shape)] = json.loads(p.read_text())
    except Exception as e:
        row["export_error"] = f"{type(e).__name__}: {e}"[:300]
    return row


def _env(report: dict, mode: Mode = GPU) -> None:
    import torch
    import triton

    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=BENCH_DIR,
                                timeout=5).stdout.strip()  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        commit = ""
    report["env"] = {
        "torch": torch.__version__, "triton": triton.__version__, "cuda": torch.version.cuda,
        "date_utc": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"), "commit": commit,
    }  # fmt: skip
    if mode.smoke:
        report["env"].update(gpu="cpu-interpreter", cpus=os.cpu_count())
        return
    p = torch.cuda.get_device_properties(0)
    report["env"].update(gpu=p.name, sms=p.multi_processor_count, memory_GiB=p.total_memory / 2**30,
                         capability=f"{p.major}.{p.minor}")  # fmt: skip


def _summary(report: dict) -> str:
    lines = [
        f"GPU {report['env']['gpu']}  ({report['wall_seconds']:.0f} s)"
        + ("  SMOKE" if report.get("smoke") else "")
    ]
    c = report.get("ceilings", {})
    if "copy_GBps" in c:
        lines.append(f"copy {c['copy_GBps']:.0f} GB/s   bf16 matmul {c['bf16_matmul_TFLOPs']:.0f} TFLOP/s")
    cor = report.get("correctness", {})
    if cor:
        bad = [r for r in cor["rows"] if not r.get("skipped") and not r["ok"]]
        n_skip = sum(bool(r.get("skipped")) for r in cor["rows"])
        lines.append(
            f"correctness: {cor['n'] - len(bad)}/{cor['n']} ok" + (f", {n_skip} skipped" if n_skip else "")
        )
        lines += [f"  FAIL {r['op']} {r.get('shape')} {r.get('dtype')}: {r.get('error') or r.get('rel_error_seed1')}"
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
    lines += target_lines(report)
    for k, err in report.get("errors", {}).items():
        lines.append(f"section {k} FAILED: {err[:160]}")
    return "\n".join(lines)


def target_lines(report: dict) -> list[str]:
    """The issues' targets as the benches measured them, a line each (what a short GPU lease's log must show): the
    GEMM and KV-decode targets (`{measured, target, met}`), DF11's, tree verification against the extend."""
    lines = []
    for sec, key in (("quant_gemm", "targets"), ("kv_quant", "sweep_targets")):
        for name, t in (report.get(sec, {}).get(key) or {}).items():
            if not isinstance(t, dict) or "met" not in t:
                continue
            got = "not measured" if t["measured"] is None else f"{t['measured']:.3g}"
            verdict = {True: "met", False: "MISSED", None: "-"}[t["met"]]
            where = t.get("at") or t.get("worst")
            lines.append(f"target {name}: {got} (>= {t['target']}) {verdict}" + (f" at {where}" if where else ""))
    df = report.get("df11", {})
    for name in ("decode_target_met", "rows_decode_target_met", "gemv_target_met"):
        if name in df:
            lines.append(f"target df11 {name.removesuffix('_met')}: {'met' if df[name] else 'MISSED'}")
    for r in report.get("paged_attention", {}).get("rows", []):
        if "vs_extend" in r:
            met = r["vs_extend"] <= r["target_vs_extend"]
            lines.append(f"target tree vs extend ({r.get('nodes')} nodes): {r['vs_extend']:.2f}x "
                         f"(<= {r['target_vs_extend']}x) {'met' if met else 'MISSED'}")  # fmt: skip
    return lines


def smoke_problems(report: dict) -> list[str]:
    """What makes a (smoke) report a failure: a section error, a failed bench module, a failed or
    unexplained correctness row, an op without a tuning result. Empty when all is well."""
    bad = [f"section {k}: {v.splitlines()[0]}" for k, v in report.get("errors", {}).items()]
    bad += [
        f"bench {k}: {b.get('error')}" for k, b in report.get("kernel_benches", {}).items() if not b["ok"]
    ]
    for r in report.get("correctness", {}).get("rows", []):
        if r.get("skipped") != BF16_REASON and r.get("ok") is not True:
            bad.append(f"correctness {r['op']} {r.get('shape')} {r.get('dtype')}: {r.get('error') or r}")
    for r in report.get("tuning", {}).get("rows", []):
        if r.get("best") is None or r.get("default_ms") is None:
            bad.append(f"tuning {r['op']}: {r.get('error') or 'no correct config, or the default was not timed'}")
    return bad


class Terminated(BaseException):
    """SIGTERM arrived (a `timeout`): stop, write what is done, exit 124. Not an Exception on purpose:
    the sections' `except Exception` must not swallow it."""


# Set by the SIGTERM handler while `_sigterm_raises` is active. The handler's raise can be lost: one that lands
# in a finalizer (`__del__`, a weakref callback run by the garbage collector) is printed and dropped by Python,
# and the suite would run to its end; every save checks the flag and raises again (`raise_if_terminated`).
_SIGTERM_SEEN = {"active": False, "seen": False}


@contextlib.contextmanager
def _sigterm_raises() -> Iterator[None]:
    def handler(signum, frame):
        _SIGTERM_SEEN["seen"] = True
        raise Terminated()

    old = signal.signal(signal.SIGTERM, handler)
    _SIGTERM_SEEN.update(active=True, seen=False)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)
        _SIGTERM_SEEN.update(active=False, seen=False)


def raise_if_terminated() -> None:
    """Terminated when a SIGTERM arrived inside `_sigterm_raises` (its own raise may have been dropped)."""
    if _SIGTERM_SEEN["active"] and _SIGTERM_SEEN["seen"]:
        raise Terminated()


def _default_out(mode: Mode, gpu: str) -> Path:
    from codesign.autotune.lookup import gpu_slug

    if mode.smoke:
        return Path(tempfile.mkdtemp(prefix="gpu-suite-smoke-")) / "smoke.json"
    return RESULTS_DIR / f"{gpu_slug(gpu)}-{dt.date.today().isoformat()}.json"


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The suite's command line (see the module docstring)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--out", type=Path, default=None, help="JSON report (default bench/results/<gpu>-<date>.json)"
    )
    ap.add_argument(
        "--full", action="store_true", help="kernel benchmarks in full (default quick=True: < 8 min)"
    )
    ap.add_argument("--tune-seconds", type=float, default=90.0, help="most wall time of the tuning pass")
    ap.add_argument("--budget", type=float, default=DEFAULT_BUDGET_S,
                    help="target wall seconds of the whole suite: tuning gets what is left (>= 20 s)")  # fmt: skip
    ap.add_argument("--skip", nargs="*", default=[], help="sections or bench modules to skip")
    ap.add_argument("--smoke", action="store_true", default=os.environ.get(SMOKE_ENV, "") not in ("", "0"),
                    help=f"CPU dry run through the Triton interpreter (also {SMOKE_ENV}=1)")  # fmt: skip
    ap.add_argument("--peers-dir", type=Path, default=None,
                    help="folder of peer wheels / sdists (gemlite, torchao) to install offline and time beside ours")
    return ap.parse_args(argv)


def _cannot_run(args: argparse.Namespace, mode: Mode) -> bool:
    """Whether the suite must stop before it starts (the reason printed to stderr): smoke mode after a
    kernel module was imported or with --out in bench/results/, or no GPU (interpreter) for `mode`.
    Smoke mode sets TRITON_INTERPRET=1 here, before any kernel module defines its kernels."""
    if mode.smoke:
        from codesign.backend import kernel_modules_imported

        if kernel_modules_imported():
            print(
                "gpu_suite --smoke: codesign.kernels was imported before TRITON_INTERPRET=1", file=sys.stderr
            )
            return True
        os.environ["TRITON_INTERPRET"] = "1"  # before any kernel module defines its kernels
        from codesign.interpreter_speed import speed_up_interpreter

        speed_up_interpreter()  # the interpreter's work that changes no result, skipped
        if args.out is not None and RESULTS_DIR in args.out.resolve().parents:
            print(f"gpu_suite --smoke: refusing to write a smoke report into {RESULTS_DIR}", file=sys.stderr)
            return True
    try:
        available = mode.available()
    except ImportError:
        available = False
    if not available:
        print("gpu_suite: no CUDA GPU found; this suite needs an NVIDIA GPU (H100/H200-class). Nothing was run.",
              file=sys.stderr)  # fmt: skip
        return True
    return False


def _new_report(mode: Mode) -> dict[str, Any]:
    """An unfinished report with its environment (and, in smoke mode, how the smoke run scales)."""
    report: dict[str, Any] = {"suite_version": 2, "errors": {}, "finished": False}
    _env(report, mode)
    if mode.smoke:
        report["smoke"] = {
            "rules": {k: list(v) for k, v in SMOKE_RULES.items()}, "device": "cpu",
            "timing": "one CPU-timed call per case", "correctness_seeds": list(SMOKE_SEEDS),
            "bf16": BF16_REASON + "; bf16-only benchmarks run float16",
        }  # fmt: skip
    return report


def _tuning_section(report: dict, args: argparse.Namespace, mode: Mode, tune_dir: Path, t0: float) -> None:
    """Section 4: smoke mode tunes the smoke shapes on the CPU; the GPU run gets what the budget has left."""
    from codesign.autotune.ops import parse_shape as parse

    if mode.smoke:
        shapes = {k: _shape_text(smoke_shape(parse(v))) for k, v in TUNE_SHAPES.items()}
        _tuning(report, SMOKE_TUNE_SECONDS, tune_dir, "cpu", "float16", shapes, max_evals=SMOKE_TUNE_MAX_EVALS)
    else:  # whatever the budget has left, at least 20 s, at most --tune-seconds
        left = args.budget - (time.monotonic() - t0) - TUNE_RESERVE_S
        _tuning(report, max(20.0, min(args.tune_seconds, left)), tune_dir)


def _run_sections(
    report: dict, sections: list[tuple[str, Callable[[], None]]], skip: set[str], save: Callable[[], None]
) -> int:
    """Each section not in `skip`, in order, its error recorded and the report saved after it; 0, or 124
    after a SIGTERM (the sections so far kept, a tuning child terminated)."""
    with _sigterm_raises():
        try:
            for name, fn in sections:
                if name in skip:
                    continue
                s0 = time.monotonic()
                try:
                    fn()
                except Exception as e:
                    report["errors"][name] = (
                        f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=4)[-1500:]}"
                    )
                report.setdefault("section_seconds", {})[name] = time.monotonic() - s0
                save()
            report["finished"] = True
        except Terminated:
            report["errors"]["terminated"] = (
                "SIGTERM (timeout?) before the suite finished; sections so far kept"
            )
            import multiprocessing

            for child in multiprocessing.active_children():  # a tuning child: do not wait for it at exit
                child.terminate()
            return 124
    return 0


def main(argv: list[str] | None = None) -> int:
    """Run the suite (see the module docstring); 0 when it ran, 2 without a GPU (or the interpreter),
    smoke: 1 when `smoke_problems` found something, 124 after a SIGTERM."""
    args = _parse_args(argv)
    mode = SMOKE if args.smoke else GPU
    mode.peers_dir = args.peers_dir
    if _cannot_run(args, mode):
        return 2
    from codesign.autotune.export import atomic_write_json

    t0 = time.monotonic()
    report = _new_report(mode)
    out = args.out or _default_out(mode, report["env"]["gpu"])

    def save() -> None:
        report["wall_seconds"] = time.monotonic() - t0
        atomic_write_json(out, json.loads(json.dumps(report, default=str)))
        raise_if_terminated()  # the sections save after every op: a SIGTERM stops the suite by the next one

    skip = set(args.skip)
    tune_dir = Path(tempfile.mkdtemp(prefix="gpu-suite-tune-"))
    sections = [("ceilings", lambda: _ceilings(report, mode)),
                ("correctness", lambda: _correctness(report, mode=mode, save=save)),
                ("kernel_benches", lambda: _kernel_benches(report, not args.full, skip, mode, save)),
                ("tuning", lambda: _tuning_section(report, args, mode, tune_dir, t0))]  # fmt: skip
    code = _run_sections(report, sections, skip, save)
    save()
    shutil.rmtree(tune_dir, ignore_errors=True)  # its tables are in the report
    print(_summary(report))
    if mode.smoke and code == 0:
        problems = smoke_problems(report)
        for p in problems:
            print(f"SMOKE PROBLEM: {p[:300]}")
        code = 1 if problems else 0
    print(f"wrote {out}")
    return code


if __name__ == "__main__":
    sys.exit(main())
