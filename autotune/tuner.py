"""Tuning one op over shapes: prune, search, check each candidate against the reference, time, record.

For each shape: the op's config space is pruned against the device's limits; the strategy picks
candidates; each candidate is (1) run once into a NaN-poisoned output and compared with the fp64
reference (||out - ref||_F / ||ref||_F <= op.tolerance(dtype), NaN never passes) and (2) only if
correct, timed (CUDA graph + cold L2 on a GPU; CPU timer in the interpreter). Every outcome,
failures included, is appended to the durable cache as soon as it is known, so a killed run
resumes where it stopped: measured points are passed to the strategy as known and not re-run.
Nothing here is called from an op: tuning is offline only.

Crashes: each candidate runs under an in-flight marker (`inflight.py`), so a config that kills the
process is recorded as failed by the next Tuner on this cache and never launched again. On a GPU,
a candidate that raises and leaves the CUDA context unusable (an illegal memory access is sticky:
every later launch fails too) is recorded as failed and `DeviceLost` is raised, since no later
candidate could be measured in this process; `codesign tune --isolate` restarts a fresh child.
"""

from __future__ import annotations

import math
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from codesign.autotune.cache import TuningCache
from codesign.autotune.inflight import InflightMarker, recover_crashed
from codesign.autotune.lookup import current_gpu_name, kernel_source_hash, triton_version
from codesign.autotune.ops import Shape, TunableOp
from codesign.autotune.space import Config, DeviceLimits, config_id
from codesign.autotune.strategies import Budget, SearchResult, search
from codesign.autotune.timing import cpu_time_ms, gpu_time_ms, input_sets_for_cold_l2
from codesign.specs.errors import CodesignError

CPU_GPU_NAME = "cpu-interpreter"  # the "GPU" of interpreter runs (tables for it are only for tests)
DEFAULT_MIN_EVALS = 20  # random/tpe budget when none is given: max(this, candidates / 4)
DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


DEFAULT_CONFIG: dict[str, Any] = {}  # the trial that launches the kernel's own untuned default
DEFAULT_ID = config_id(DEFAULT_CONFIG)

@dataclass
class ShapeResult:
    """Outcome of tuning one shape: best config and time (None when nothing was correct)."""

    op: str
    table_op: str
    key: str
    m: int
    best: Config | None
    best_ms: float | None
    n_candidates: int
    n_pruned: int
    n_new: int
    n_known: int
    n_failed: int
    failures: list[str] = field(default_factory=list)
    n_crashed: int = 0  # configs of this run that killed their process (recorded from markers)
    # The kernel's untuned default, measured beside the candidates (ops with `default_trial`; not counted
    # in n_new / n_known); inf when it failed, None when not measured.
    default_ms: float | None = None


class DeviceLost(RuntimeError):
    """The GPU context cannot launch anything more in this process (the candidate was recorded)."""


def rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref||_F / ||ref||_F in fp64 on the CPU; inf when out has a NaN/inf or the wrong shape."""
    o = out.detach().to("cpu", torch.float64)
    if o.shape != ref.shape or not torch.isfinite(o).all():
        return math.inf
    den = torch.linalg.vector_norm(ref).item()
    return torch.linalg.vector_norm(o - ref).item() / (den or 1.0)


def checked_output(op: TunableOp, inputs: Any, out: Any) -> torch.Tensor:
    """What is compared with `op.reference(inputs)`: `op.checked_output(inputs, out)` if defined, else out."""
    view = getattr(op, "checked_output", None)
    return view(inputs, out) if view is not None else out


def _poison_allocator(shape: torch.Size, dtype: torch.dtype, device: str) -> None:
    # For ops that allocate their own output: fill a same-sized block on the device with NaN and
    # free it, so the caching allocator hands that block back and a config that writes nothing shows NaN.
    if dtype.is_floating_point:
        torch.full(shape, float("nan"), dtype=dtype, device=device)


@dataclass
class Tuner:
    """Tunes `op` on `device` with `dtype`, recording into `cache`. `gpu` defaults to the device's name."""

    op: TunableOp
    cache: TuningCache
    dtype: torch.dtype = torch.float16
    device: str = "cuda"
    strategy: str = "tpe"
    budget: Budget = field(default_factory=Budget)
    seed: int = 0
    limits: DeviceLimits | None = None
    gpu: str | None = None
    log: Callable[[str], None] = print
    # Start (time.time()) of a run that spans several processes (the --isolate supervisor restarts
    # its child): records of this shape since then count against the budget, as if one process ran.
    since: float | None = None
    # Measure the kernel's default beside the search (ops with `default_trial`): None = on GPUs only (the
    # interpreter's timings say nothing about speed), True / False = always / never.
    default_trial: bool | None = None
    # Configs to try first, in this order (strategy "exhaustive" only): each a partial config, standing for every
    # candidate that sets its keys to its values (e.g. a shortlist ranked by a CPU-side predictor); the rest follow.
    first: list[dict[str, Any]] | None = None

    def __post_init__(self) -> None:
        if self.first and self.strategy != "exhaustive":
            raise CodesignError(f"first: a try-first order needs strategy 'exhaustive', not {self.strategy!r}")
        self.on_gpu = torch.device(self.device).type == "cuda"
        if self.on_gpu and not torch.cuda.is_available():
            raise CodesignError("device: 'cuda' requested but torch sees no CUDA device")
        if not self.on_gpu:
            from codesign.backend import interpreter_enabled

            if not interpreter_enabled():
                raise CodesignError("device 'cpu' needs Triton's interpreter (TRITON_INTERPRET=1)")
            if self.dtype == torch.bfloat16:
                raise CodesignError(
                    "dtype bfloat16 needs a GPU (the Triton interpreter computes bf16 wrongly)"
                )
        self.gpu = self.gpu or (current_gpu_name(torch.device(self.device)) if self.on_gpu else CPU_GPU_NAME)
        self.limits = self.limits or DeviceLimits.from_torch(self.device if self.on_gpu else None)
        self.identity = {
            "gpu": self.gpu,
            "triton": triton_version(),
            "source_hash": kernel_source_hash(self.op.source_modules),
            "dtype": str(self.dtype).removeprefix("torch."),
        }
        self.marker = InflightMarker(self.cache)
        recover_crashed(self.cache, log=self.log)  # configs that killed an earlier run are failures now

    def tune_shape(self, shape: Shape) -> ShapeResult:
        """Search the pruned space of one shape; see the module docstring."""
        op = self.op
        op.check_shape(shape)
        cands, pruned = self._candidates(shape)
        base = {**self.identity, "op": op.table_op(shape), "key": op.table_key(shape), "m": op.m(shape)}
        known, this_run, known_default = self._cached(base)
        failures: list[str] = []
        evaluate = self._evaluator(shape, base, failures)
        res = self._search(cands, evaluate, known, this_run)
        default_ms = None
        if getattr(op, "default_trial", False) and (
            self.on_gpu if self.default_trial is None else self.default_trial
        ):
            # The kernel's untuned default is measured beside the search (config {}: the adapter's
            # forced_config merges it over the default) and recorded; the export leaves out an entry whose
            # fastest record is the default, so a short search never ships a config slower than an
            # untuned lookup (the first H200 run exported DF11 configs at 0.47-0.60x of the default).
            default_ms = known_default if known_default is not None else evaluate(dict(DEFAULT_CONFIG))
        best = res.best
        failures = [f"{config_id(r['config'])}: {r.get('error')}" for r in this_run if not r["ok"]] + failures
        out = ShapeResult(
            op=op.name, table_op=base["op"], key=base["key"], m=base["m"],
            best=best[0] if best else None, best_ms=best[1] if best else None,
            n_candidates=len(cands), n_pruned=pruned, n_new=res.n_new + len(this_run),
            n_known=len(known) - len(this_run), n_failed=len(failures), failures=failures,
            n_crashed=sum(bool(r.get("crashed")) for r in this_run), default_ms=default_ms,
        )  # fmt: skip
        self._log_result(shape, out)
        return out

    def _candidates(self, shape: Shape) -> tuple[list[Config], int]:
        """The configs of `shape` that fit the device, and how many were pruned; an error when none fits."""
        space = self.op.space(shape, self.dtype, self.on_gpu)
        cands = space.candidates(self.limits)
        if not cands:
            reasons = sorted({space.why_not(c, self.limits) or "" for c in space.grid()})
            raise CodesignError(
                f"shape {shape}: every config of {self.op.name} was pruned ({'; '.join(reasons[:3])})"
            )
        return self._first_ordered(cands), space.size - len(cands)

    def _first_ordered(self, cands: list[Config]) -> list[Config]:
        """`cands` with those matching `first` in front, in its order (a parameter it names that the space lacks:
        an error naming it)."""
        if not self.first:
            return cands
        names = {k for c in cands for k in c}
        lead: list[Config] = []
        for part in self.first:
            unknown = sorted(set(part) - names)
            if unknown:
                raise CodesignError(f"first: {unknown[0]!r} is not a parameter of {self.op.name} ({sorted(names)})")
            lead += [c for c in cands if c not in lead and all(c.get(k) == v for k, v in part.items())]
        return lead + [c for c in cands if c not in lead]

    def _cached(self, base: dict[str, Any]) -> tuple[dict[str, float], list[dict[str, Any]], float | None]:
        """What the cache holds for the shape `base` names: (known time per config id, inf for a failure;
        this run's records, for the budget; the default trial's earlier time, kept apart from `known`)."""
        known: dict[str, float] = {}
        this_run: list[dict[str, Any]] = []  # records of this (multi-process) run, for the budget
        known_default: float | None = None
        for r in self.cache.load().records:
            if not all(r[k] == v for k, v in base.items()):
                continue
            if config_id(r["config"]) == DEFAULT_ID:
                known_default = (
                    (r["time_ms"] if r["ok"] else math.inf) if known_default is None else known_default
                )
            elif config_id(r["config"]) not in known:
                known[config_id(r["config"])] = r["time_ms"] if r["ok"] else math.inf
                if self.since is not None and r.get("ts", 0.0) >= self.since:
                    this_run.append(r)
        return known, this_run, known_default

    def _evaluator(self, shape: Shape, base: dict[str, Any], failures: list[str]) -> Callable[[Config], float]:
        """The search's objective for `shape`: a config's time in ms, inf when it fails (appended to
        `failures`); every outcome is recorded. Builds the inputs, reference and timing sets once."""
        op = self.op
        inputs = op.make_inputs(shape, self.dtype, self.device, self.seed)
        ref = op.reference(inputs)
        tol = op.tolerance(self.dtype)
        timing_sets = [inputs]
        if self.on_gpu:
            n_sets = input_sets_for_cold_l2(op.input_bytes(inputs), self.limits.l2_bytes)
            timing_sets += [
                op.make_inputs(shape, self.dtype, self.device, self.seed + i) for i in range(1, n_sets)
            ]

        def evaluate(cfg: Config) -> float:
            rec = self._measure(cfg, base, inputs, ref, tol, timing_sets)
            if rec.get("device_lost"):
                raise DeviceLost(
                    f"{op.name} {shape}: config {config_id(cfg)} left the GPU unusable ({rec['error']}); "
                    "it is recorded as failed, rerun to resume (or use --isolate)"
                )
            if not rec["ok"]:
                failures.append(f"{config_id(cfg)}: {rec['error']}")
                return math.inf
            return rec["time_ms"]

        return evaluate

    def _measure(
        self, cfg: Config, base: dict[str, Any], inputs: Any, ref: torch.Tensor, tol: float, timing_sets: list[Any]
    ) -> dict[str, Any]:
        """Check `cfg` against the reference, time it if correct, append the record to the cache and
        return it; runs under the in-flight marker (a failure is a result; `device_lost` when sticky)."""
        rec: dict[str, Any] = {**base, "config": cfg, "ok": False, "time_ms": None}
        try:
            # Inside the try: a SIGTERM that lands while the marker is being written (its fsyncs) must
            # still remove it; a half-written marker names a candidate that never started.
            self.marker.set({**base, "config": cfg})  # cleared below unless the process dies
            try:
                err = self._check(inputs, cfg, ref)
                rec["rel_error"] = err
                if err > tol:
                    rec["error"] = f"incorrect: relative error {err:.3e} > {tol:.1e}"
                else:
                    ms, how = self.time_config(timing_sets, cfg)
                    rec.update(ok=True, time_ms=ms, timing=how)
            except Exception as e:  # a config that fails to compile or launch is a result, not a crash
                rec["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
                if not isinstance(e, RuntimeError | ValueError):
                    rec["trace"] = traceback.format_exc(limit=3)[-600:]
                if not self.device_usable():
                    rec["device_lost"] = True
            self.cache.append(rec)
        finally:  # also on Ctrl-C: an interrupted candidate did not crash anything
            self.marker.clear()
        return rec

    def _search(
        self,
        cands: list[Config],
        evaluate: Callable[[Config], float],
        known: dict[str, float],
        this_run: list[dict[str, Any]],
    ) -> SearchResult:
        """Run the strategy over `cands` within what the budget leaves (`known` points are not re-run)."""
        budget = self.budget
        if self.strategy != "exhaustive" and budget.max_evals is None and budget.max_seconds is None:
            # Unbounded sampling would be exhaustive search in a random order: default to a quarter.
            budget = Budget(max_evals=max(DEFAULT_MIN_EVALS, len(cands) // 4))
        budget = _remaining(budget, this_run)
        if budget is None:  # an earlier process of this run used the whole budget
            by_id = {config_id(c): c for c in cands}
            return SearchResult(trials=[(by_id[k], v) for k, v in known.items() if k in by_id])
        return search(self.strategy, cands, evaluate, budget, seed=self.seed, known=known)

    def _log_result(self, shape: Shape, out: ShapeResult) -> None:
        """One log line per tuned shape: counts, the best config and time, the default's time."""
        self.log(
            f"{self.op.name} {shape}: {out.n_new} new + {out.n_known} cached of {out.n_candidates} candidates "
            f"({out.n_pruned} pruned), {out.n_failed} failed; best "
            + (f"{out.best_ms:.4f} ms {config_id(out.best)}" if out.best is not None else "none (no correct config)")
            + (f" (default {out.default_ms:.4f} ms)" if out.default_ms is not None else "")
        )

    def device_usable(self) -> bool:
        """After a candidate raised: can this process still launch? (CPU: always; GPU: a sync succeeds.)

        CUDA errors such as an illegal memory access are sticky: the context fails every later call,
        so a sync that raises means every further candidate would fail for a reason not its own.
        """
        if not self.on_gpu:
            return True
        try:
            torch.cuda.synchronize()
        except RuntimeError:
            return False
        return True

    def _check(self, inputs: Any, cfg: Config, ref: torch.Tensor) -> float:
        poison = getattr(self.op, "poison", None)
        if poison is not None:
            poison(inputs)
        else:
            _poison_allocator(ref.shape, self.dtype, self.device)
        out = self.op.run(inputs, cfg)
        if self.on_gpu:
            torch.cuda.synchronize()
        return rel_error(checked_output(self.op, inputs, out), ref)

    def time_config(self, sets: list[Any], cfg: Config) -> tuple[float, dict[str, Any]]:
        """Time `cfg` over the input sets `sets` (GPU: graph + cold L2; CPU: timer); returns (ms, method)."""
        if not self.on_gpu:  # one call: the check run was the warm-up; an interpreter's time says nothing of a GPU's
            return cpu_time_ms(lambda: self.op.run(sets[0], cfg), warmup=0, reps=1), {"timer": "cpu"}
        fns = [lambda s=s: self.op.run(s, cfg) for s in sets]
        ms, how = gpu_time_ms(fns, self.limits.l2_bytes, self.op.input_bytes(sets[0]))
        return ms, {"timer": "cuda_events", **how}


def _remaining(budget: Budget, this_run: list[dict[str, Any]]) -> Budget | None:
    """`budget` less what earlier processes of this run spent on the shape; None when nothing is left.

    Evaluations are counted; time is the span of their timestamps (a lower bound of what they took).
    """
    if not this_run:
        return budget
    evals, secs = budget.max_evals, budget.max_seconds
    if evals is not None:
        evals -= len(this_run)
    if secs is not None:
        ts = [r.get("ts", 0.0) for r in this_run]
        secs -= max(ts) - min(ts)
    if (evals is not None and evals < 1) or (secs is not None and secs <= 0):
        return None
    return Budget(evals, secs)


def tune(op: TunableOp, shapes: list[Shape], **settings: Any) -> list[ShapeResult]:
    """Tune every shape of `op` with one `Tuner(op, **settings)`; returns one result per shape."""
    tuner = Tuner(op, **settings)
    return [tuner.tune_shape(s) for s in shapes]
