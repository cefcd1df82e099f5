"""`codesign tune`: tune kernel launch configs on this GPU, record them, export per-GPU tables.

    codesign tune --op w4a16_gemm --shape M=1,N=4096,K=4096,G=128 --shape M=16,N=4096,K=4096,G=128
    codesign tune --op w4a16_gemm --model llama-3-8b --batch 1 16 64 256 --strategy tpe --max-evals 60
    codesign tune --op paged_attention --model llama-3-8b --batch 1 32 --ctx 4096 --export
    codesign tune --op w4a16_gemm --model llama-3-8b --variants all --export   # + which variant per M
    codesign tune --export                      # tables from everything in the cache for this GPU
    codesign tune --list                        # tunable ops available here

Every measurement goes to the cache (--cache; default ~/.cache/codesign/tune-<gpu>.jsonl) as it is
made, so an interrupted run resumes. --isolate (the default on a GPU) tunes in a child process that a
supervisor restarts when a config crashes it (segfault, abort, illegal memory access): the crashing
config is recorded as failed from its in-flight marker and never tried again (see isolate.py).
--export writes `<out-dir>/<gpu-slug>/<op>.json` atomically (default out-dir: the tables shipped in
codesign/autotune/configs). --variants all tunes every kernel variant of an op that has several (the
weight-only GEMMs: split-K and tiled) at each shape, and --export then also writes the op's variant
table: per shape and M, the variant whose best config was fastest (the kernel reads it at run time).
--import MODULE registers extra tunable ops. Without a GPU, --device cpu tunes through the Triton
interpreter with a CPU timer (for testing the path, not for tables users ship).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
from pathlib import Path
from typing import TYPE_CHECKING

from codesign.specs.errors import CodesignError
from codesign.specs.paths import output_dir, output_file

if TYPE_CHECKING:
    from codesign.autotune.cache import TuningCache
    from codesign.autotune.ops import TunableOp

DEFAULT_BATCHES = (1, 16, 64, 256)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Options of `codesign tune` (see the module docstring)."""
    p.add_argument("--op", help="tunable op (see --list)")
    p.add_argument("--shape", action="append", default=[], help="NAME=INT,... (repeatable)")
    p.add_argument("--model", help="catalogue model (or HF config path) whose shapes to tune")
    p.add_argument(
        "--batch", type=int, nargs="+", default=list(DEFAULT_BATCHES), help="M values with --model"
    )
    p.add_argument("--group", type=int, default=128, help="quant group size with --model (0: per-channel)")
    p.add_argument("--ctx", type=int, default=None,
                   help="context length for paged_attention ops with --model (default 4096)")  # fmt: skip
    p.add_argument(
        "--block-size", type=int, default=16, help="KV block size for paged_attention with --model"
    )
    p.add_argument("--variants", default="default", choices=("default", "all"),
                   help="all: tune each kernel variant per shape (default: the default rule's variant)")  # fmt: skip
    p.add_argument("--strategy", default="tpe", choices=("exhaustive", "random", "tpe"))
    p.add_argument("--first", type=Path, default=None,
                   help="JSON {op: [partial configs]}: this op's configs to try first, in order (with --strategy "
                   "exhaustive; e.g. a shortlist ranked on a CPU machine by bench/attention_configs.py)")  # fmt: skip
    p.add_argument("--max-evals", type=int, default=None, help="new measurements per shape")
    p.add_argument("--max-seconds", type=float, default=None, help="wall-time budget per shape")
    p.add_argument("--dtype", default=None, choices=("float16", "bfloat16", "float32"),
                   help="activation dtype (default float16 on GPU, float32 on CPU)")  # fmt: skip
    p.add_argument("--device", default=None, choices=("cuda", "cpu"), help="default: cuda if present")
    p.add_argument("--cache", type=Path, default=None, help="JSON-lines cache of all measurements")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--export", action="store_true", help="write the per-GPU tables after tuning")
    p.add_argument("--out-dir", type=output_dir, default=None, help="table root (default: shipped configs)")
    p.add_argument("--engine", default="local", choices=("local", "ray"), help="ray: one actor per GPU")
    p.add_argument("--ray-address", default=None, help="Ray cluster address (default: start a local one)")
    p.add_argument("--isolate", action=argparse.BooleanOptionalAction, default=None,
                   help="tune in a child process restarted after a crash (default: on with a GPU)")  # fmt: skip
    p.add_argument("--max-restarts", type=int, default=None, help="with --isolate: child restarts allowed")
    p.add_argument("--import", dest="imports", action="append", default=[], metavar="MODULE",
                   help="import MODULE first (it may register extra tunable ops; repeatable)")  # fmt: skip
    p.add_argument("--list", action="store_true", help="list tunable ops and exit")
    p.add_argument("--json", type=output_file, default=None, help="also write the per-shape results here")


def shapes_from_model(
    op: str, model: str, batches: list[int], group: int, ctx: int, block_size: int
) -> list[dict]:
    """Shapes of `op` in one block of `model` at each batch size (linear layers, or decode attention)."""
    from codesign.catalog.models import load_model

    cfg = load_model(model)
    if op == "paged_attention" or op.startswith("paged_attention_"):  # plain and quantized-KV decode
        return [{"M": b, "q_heads": cfg.heads, "kv_heads": cfg.kv_heads, "head_dim": cfg.head_dim,
                 "block_size": block_size, "ctx": ctx} for b in batches]  # fmt: skip
    # Qwen2-MoE's shared-expert gate (hidden x 1) stays an fp16 GEMV: not a quantized-GEMM shape to tune.
    nk = sorted({v for k, v in cfg.linear_shapes().items() if k != "shared_gate"})
    if op == "quantize_per_token":  # the activations entering each linear layer: one row length K each
        return [{"M": b, "K": k} for k in sorted({k for _, k in nk}) for b in batches]
    if op == "kv_write" or op.startswith("kv_write_"):  # a layer's new K/V: M tokens of [kv_heads, head_dim]
        return [{"M": b, "kv_heads": cfg.kv_heads, "head_dim": cfg.head_dim} for b in batches]
    if op in ("df11_decode", "df11_gemv", "df11_rows_decode"):  # one container per weight (default geometry)
        return [{"N": n, "K": k} for n, k in nk]
    if op == "df11_rows_gemv":  # M = the batches capped at the GEMV's limit (larger M takes the buffer path)
        from codesign.kernels.df11.triton_rows import GEMV_MAX_M

        return [
            {"M": m, "N": n, "K": k} for n, k in nk for m in sorted({min(b, GEMV_MAX_M) for b in batches})
        ]
    extra = {"G": group} if op in ("w4a16_gemm", "w8a16_gemm") else {}
    return [{"M": b, "N": n, "K": k, **extra} for n, k in nk for b in batches]


def _isolate(args: argparse.Namespace, device: str) -> bool:
    """--isolate as given; by default on for a GPU with the local engine.

    Why on by default on a GPU: a tuning space holds configs that crash the process (compiler aborts,
    illegal memory accesses that poison the CUDA context); without isolation one of them ends the
    run and, on resume, is tried again. The price is one child start (imports and CUDA init, seconds)
    per run and per crash, small against minutes of tuning. Off on CPU: interpreter runs are tests.
    """
    if args.max_restarts is not None and args.max_restarts < 0:
        raise CodesignError(f"--max-restarts must be >= 0, got {args.max_restarts}")
    if args.ray_address and args.engine != "ray":
        raise CodesignError(f"--ray-address is for --engine ray, not {args.engine}")
    if args.engine == "ray":
        if args.isolate:
            raise CodesignError(
                "--isolate works with --engine local only (with Ray, rerun: a crashed actor's config is "
                "recorded from its in-flight marker)"
            )
        return False
    return device == "cuda" if args.isolate is None else bool(args.isolate)


def default_cache(gpu: str) -> Path:
    """~/.cache/codesign/tune-<gpu-slug>.jsonl (or $CODESIGN_TUNE_CACHE)."""
    from codesign.autotune.lookup import gpu_slug

    env = os.environ.get("CODESIGN_TUNE_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "codesign" / f"tune-{gpu_slug(gpu)}.jsonl"


def run(args: argparse.Namespace) -> int:
    """Tune, then (with --export) write tables. Returns 0, or 2 for bad input (CodesignError)."""
    from codesign.autotune.inflight import sigterm_exits

    with sigterm_exits():  # a terminated run unwinds: its in-flight candidate is not taken for a crash
        return _run(args)


def _run(args: argparse.Namespace) -> int:
    """`run` without the SIGTERM guard: pick the device, import --import modules, then list, tune, export."""
    from codesign.backend import cuda_available, enable_interpreter_if_no_gpu

    device = args.device or ("cuda" if cuda_available() else "cpu")
    if device == "cpu":
        enable_interpreter_if_no_gpu()  # before any kernel module is imported
    import torch

    from codesign.autotune import lookup
    from codesign.autotune.cache import TuningCache
    from codesign.autotune.tuner import CPU_GPU_NAME

    _import_extras(args.imports)
    if args.list:
        _list_ops()
        return 0
    if device == "cuda" and not cuda_available():
        raise CodesignError("--device cuda: torch sees no CUDA device")
    gpu = lookup.current_gpu_name(torch.device("cuda")) if device == "cuda" else CPU_GPU_NAME
    dtype_name = args.dtype or ("float16" if device == "cuda" else "float32")
    cache = TuningCache(args.cache or default_cache(gpu))
    if not args.op and not args.export:
        raise CodesignError("give --op (with --shape or --model), --export, or --list")
    ops_touched: dict[str, tuple[str, ...]] = {}
    # Ops with kernel variants whose tables were touched (their variant table follows).
    variant_owners: list[TunableOp] = []
    if args.op:
        ops_touched, variant_owners = _tune_op(args, device, gpu, dtype_name, cache)
    if args.export:
        _export(args, cache, gpu, dtype_name, ops_touched, variant_owners)
    return 0


def _import_extras(imports: list[str]) -> None:
    """--import: import each module (it may register tunable ops); an ImportError is bad input."""
    for name in imports:
        try:
            importlib.import_module(name)
        except ImportError as e:
            raise CodesignError(f"--import {name}: {e}") from e


def _list_ops() -> None:
    """--list: every registered tunable op and whether its kernel imports here."""
    from codesign.autotune.ops import available_ops, registered_ops

    avail = set(available_ops())
    for name in registered_ops():
        print(f"{name}\t{'available' if name in avail else 'kernel not importable here'}")


def _tune_op(
    args: argparse.Namespace, device: str, gpu: str, dtype_name: str, cache: TuningCache
) -> tuple[dict[str, tuple[str, ...]], list[TunableOp]]:
    """--op: tune its shapes, warn about shapes without a correct config, write --json. Returns the table
    ops touched (with the kernel's source modules) and the op itself when it has kernel variants."""
    from codesign.autotune.ops import get_op
    from codesign.autotune.strategies import Budget
    from codesign.autotune.tuner import DTYPES

    op = get_op(args.op)
    shapes = _shapes(args, op)
    variant_owners = [op] if hasattr(op, "variant_op") else []
    budget = Budget(args.max_evals, args.max_seconds)
    settings = dict(dtype=DTYPES[dtype_name], device=device, strategy=args.strategy, budget=budget,
                    seed=args.seed)  # fmt: skip
    if args.first is not None:
        settings["first"] = _first(args.first, args.op, args.strategy)
    print(
        f"tuning {args.op} on {gpu} ({dtype_name}, {args.strategy}), {len(shapes)} shape(s), cache {cache.path}"
    )
    results = _tune_shapes(args, op, shapes, cache, settings, device)
    ops_touched: dict[str, tuple[str, ...]] = {}
    for r, s in zip(results, shapes):
        ops_touched[r["table_op"]] = op.source_modules
        if r["best"] is None:
            print(f"warning: no correct config for {s}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=1, default=str))
    return ops_touched, variant_owners


def _first(path: Path, op: str, strategy: str) -> list[dict]:
    """--first: the op's list from the file (none listed: an empty list, said on stdout)."""
    if strategy != "exhaustive":
        raise CodesignError(f"--first: a try-first order needs --strategy exhaustive, not {strategy!r}")
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise CodesignError(f"--first: cannot read {path}: {e}") from e
    first = data.get(op, []) if isinstance(data, dict) else None
    if not isinstance(first, list) or not all(isinstance(c, dict) for c in first):
        raise CodesignError(f"--first: {path} must map op names to lists of configs (objects)")
    if not first:
        print(f"--first: {path} lists no configs for {op}; the space's own order")
    return first


def _shapes(args: argparse.Namespace, op: TunableOp) -> list[dict]:
    """--shape and --model's shapes (each variant's with --variants all), all checked before any launch."""
    from codesign.autotune.ops import expand_variants, parse_shape

    shapes = [parse_shape(s) for s in args.shape]
    if args.ctx is not None and not (args.model and args.op.startswith("paged_attention")):
        raise CodesignError("--ctx applies to a paged_attention op's shapes from --model")
    if args.model:
        ctx = 4096 if args.ctx is None else args.ctx
        shapes += shapes_from_model(args.op, args.model, args.batch, args.group, ctx, args.block_size)
    if not shapes:
        raise CodesignError("--op needs --shape or --model")
    if args.variants == "all":
        shapes = expand_variants(op, shapes)
    for s in shapes:
        op.check_shape(s)  # all shapes checked before anything is launched
    return shapes


def _tune_shapes(
    args: argparse.Namespace,
    op: TunableOp,
    shapes: list[dict],
    cache: TuningCache,
    settings: dict,
    device: str,
) -> list[dict]:
    """One result dict per shape, from the engine asked for: Ray actors, an isolated child, or this process."""
    isolate = _isolate(args, device)
    if args.engine == "ray":
        from codesign.autotune.fleet import tune_on_ray

        return tune_on_ray(args.op, shapes, cache.path, settings, address=args.ray_address)
    if isolate:
        from codesign.autotune.isolate import DEFAULT_MAX_RESTARTS, TuneJob, run_isolated

        job = TuneJob(tasks=[(args.op, shapes)], cache_path=str(cache.path), settings=settings,
                      imports=tuple(args.imports))  # fmt: skip
        limit = DEFAULT_MAX_RESTARTS if args.max_restarts is None else args.max_restarts
        return run_isolated(job, max_restarts=limit)
    from codesign.autotune.tuner import DeviceLost, Tuner

    tuner = Tuner(op, cache, **settings)
    try:
        return [tuner.tune_shape(s).__dict__ for s in shapes]
    except DeviceLost as e:
        raise CodesignError(str(e)) from e


def _export(
    args: argparse.Namespace,
    cache: TuningCache,
    gpu: str,
    dtype_name: str,
    ops_touched: dict[str, tuple[str, ...]],
    variant_owners: list[TunableOp],
) -> None:
    """--export: write the tables of `ops_touched` (none: of everything the cache holds for `gpu`), then
    the variant tables of `variant_owners`."""
    from codesign.autotune import lookup
    from codesign.autotune.export import export_table, export_variant_table

    if not ops_touched:  # export everything this cache holds for this GPU
        found, owners = _cached_table_ops(cache, gpu)
        ops_touched.update(found)
        variant_owners += owners
    root = args.out_dir or lookup.SHIPPED_ROOT
    for table_op, modules in sorted(ops_touched.items()):
        if not modules:
            print(f"skipping {table_op}: its kernel is not importable here")
            continue
        path = export_table(cache, gpu, table_op, modules, dtype_name, root)
        print(f"wrote {path}" if path else f"nothing to export for {table_op} ({dtype_name})")
    for o in variant_owners:  # written only where every variant was timed at the same shape and M
        path = export_variant_table(
            cache, gpu, o.variant_op, o.variant_configs, o.source_modules, dtype_name, root
        )
        if path:
            print(f"wrote {path}")


def _cached_table_ops(cache: TuningCache, gpu: str) -> tuple[dict[str, tuple[str, ...]], list[TunableOp]]:
    """The table ops the cache holds records of for `gpu`, each with its kernel's source modules (() when
    no importable op owns it), and the ops with kernel variants among their owners."""
    from codesign.autotune.ops import available_ops, get_op

    ops_touched: dict[str, tuple[str, ...]] = {}
    variant_owners: list[TunableOp] = []
    for r in cache.load().records:
        if r["gpu"] == gpu:
            ops_touched.setdefault(r["op"], ())
    # Table ops are an op's name or its name plus a variant suffix: the longest match wins.
    for name in sorted(available_ops(), key=len):
        o = get_op(name)
        for t in list(ops_touched):
            if t == name or t.startswith(name + "_"):
                ops_touched[t] = o.source_modules
        if set(getattr(o, "variant_configs", ())) & set(ops_touched):
            variant_owners.append(o)
    return ops_touched, variant_owners
