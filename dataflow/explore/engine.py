"""Run a sweep: strategy -> engine (inline, process pool or Ray) -> durable store, with progress and resume.

The driver is the only writer of the store. Each task evaluates one design
point on the workloads it still lacks; each result is committed the moment it
arrives, so killing the driver (even with SIGKILL) loses at most the tasks in
flight, and rerunning the same command recomputes nothing that was stored.
"""

from __future__ import annotations

import math
import os
import sys
import time
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from dataclasses import dataclass
from typing import Any

from codesign.dataflow.explore.eval import EvalCache, evaluate_point, point_target
from codesign.dataflow.explore.search import Strategy
from codesign.dataflow.explore.space import Space, point_key
from codesign.dataflow.explore.store import ResultStore
from codesign.specs import CodesignError, check_choice

ENGINES = ("inline", "pool", "ray")
OBJECTIVES = ("throughput", "throughput_per_area", "energy")


def _eval_task(
    space: Space, point: dict[str, Any], workloads: list[str], model: str, cache: EvalCache
) -> list[tuple[str, dict]]:
    target = point_target(space, point, cache)  # one target for all of the point's workloads
    return [(w, evaluate_point(space, point, w, model, target)) for w in workloads]


# The EvalCache of a pool or Ray worker process, made on its first task: tasks of one worker share
# designs and operator costs as the inline engine's tasks share the driver's cache.
_worker_cache: EvalCache | None = None


def _worker_task(
    space: Space, point: dict[str, Any], workloads: list[str], model: str
) -> list[tuple[str, dict]]:
    global _worker_cache
    if _worker_cache is None:
        _worker_cache = EvalCache()
    return _eval_task(space, point, workloads, model, _worker_cache)


def _throughput(m: dict[str, Any]) -> float:
    return m.get("serve_throughput_tok_s", m.get("tokens_per_s", 0.0))


def score(metrics: dict[str, dict[str, Any]], objective: str, constraints: dict[str, float]) -> float:
    """Scalar score of a point over its workloads (higher is better; -inf when infeasible).

    throughput: geometric mean of tokens/s (serving throughput for traces); throughput_per_area: that per
    mm^2; energy: minus the geometric mean of energy per token (decode/prefill workloads).
    """
    if not metrics or any(not m.get("fits", False) for m in metrics.values()):
        return -math.inf
    area = next(iter(metrics.values()))["area_mm2"]
    if area > constraints.get("max_area_mm2", math.inf):
        return -math.inf
    if any(m.get("power_w", 0.0) > constraints.get("max_power_w", math.inf) for m in metrics.values()):
        return -math.inf
    if objective == "energy":
        e = [m["energy_per_token_j"] for m in metrics.values() if "energy_per_token_j" in m]
        return -math.exp(sum(math.log(x) for x in e) / len(e)) if e else -math.inf
    t = [_throughput(m) for m in metrics.values()]
    if min(t) <= 0:
        return -math.inf
    g = math.exp(sum(math.log(x) for x in t) / len(t))
    return g / area if objective == "throughput_per_area" else g


@dataclass
class SweepStats:
    points: int = 0
    evaluated: int = 0  # (point, workload) results computed in this run
    reused: int = 0  # found in the store
    seconds: float = 0.0


class _Progress:
    """tqdm when available (with ETA), else a plain line every few seconds on stderr."""

    def __init__(self, total: int, enabled: bool):
        self.bar = None
        self.enabled = enabled
        self.total, self.n, self.t0, self.last = total, 0, time.time(), 0.0
        if enabled:
            try:
                from tqdm import tqdm

                self.bar = tqdm(total=total, unit="eval", file=sys.stderr, dynamic_ncols=True)
            except ImportError:
                pass

    def update(self, k: int) -> None:
        self.n += k
        if self.bar is not None:
            self.bar.update(k)
        elif self.enabled and time.time() - self.last > 2:
            self.last = time.time()
            rate = self.n / max(1e-9, self.last - self.t0)
            eta = (self.total - self.n) / rate if rate else float("inf")
            print(f"  {self.n}/{self.total} evaluations, ETA {eta:.0f} s", file=sys.stderr)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def run_sweep(
    space: Space,
    model: str,
    workloads: list[str],
    strategy: Strategy,
    store: ResultStore,
    engine: str = "pool",
    workers: int | None = None,
    objective: str = "throughput",
    progress: bool = True,
    ray_address: str | None = None,
    on_result: Callable[[str, str], None] | None = None,
) -> SweepStats:
    """Evaluate the strategy's points on every workload, storing each result as it completes."""
    check_choice("engine", engine, ENGINES)
    check_choice("objective", objective, OBJECTIVES)
    if not workloads:
        raise CodesignError("no workloads to evaluate")
    workers = workers or min(2, os.cpu_count() or 1)
    stats = SweepStats()
    # Connecting to (or starting) Ray is set-up, not sweep throughput: done before the clock starts.
    ray_fn = _ray_remote(ray_address) if engine == "ray" else None
    t0 = time.time()
    done = store.done_keys()
    stored = {(r["point_key"], r["workload"]): r["metrics"] for r in store.rows()} if done else {}
    bar = _Progress(0, progress)
    cache = EvalCache()  # the inline engine's; pool and Ray workers keep their own
    pool = ProcessPoolExecutor(max_workers=workers) if engine == "pool" else None
    try:
        for batch in strategy.batches(max(workers * 2, 4)):
            todo = []
            for point in batch:
                pk = point_key(point)
                missing = [w for w in workloads if (pk, w) not in done]
                stats.points += 1
                stats.reused += len(workloads) - len(missing)
                if missing:
                    todo.append((point, pk, missing))
                else:
                    strategy.tell(
                        point, score({w: stored[(pk, w)] for w in workloads}, objective, space.constraints)
                    )
            bar.total += sum(len(m) for *_, m in todo)
            if bar.bar is not None:
                bar.bar.total = bar.total
            for point, pk, results in _execute(todo, space, model, pool, ray_fn, cache):
                for w, metrics in results:
                    store.put(pk, w, point, metrics)
                    done.add((pk, w))
                    stored[(pk, w)] = metrics
                    stats.evaluated += 1
                    if on_result:
                        on_result(pk, w)
                bar.update(len(results))
                strategy.tell(
                    point, score({w: stored[(pk, w)] for w in workloads}, objective, space.constraints)
                )
    finally:
        bar.close()
        if pool is not None:
            pool.shutdown(cancel_futures=True)
    stats.seconds = time.time() - t0
    return stats


def _execute(todo, space, model, pool, ray_fn, cache: EvalCache):
    """Yield (point, key, results) as tasks finish, in completion order (inline tasks share `cache`)."""
    if pool is None and ray_fn is None:
        for point, pk, missing in todo:
            yield point, pk, _eval_task(space, point, missing, model, cache)
        return
    if ray_fn is not None:
        import ray

        refs = {ray_fn.remote(space, p, m, model): (p, pk) for p, pk, m in todo}
        pending = list(refs)
        while pending:
            ready, pending = ray.wait(pending, num_returns=1)
            p, pk = refs[ready[0]]
            yield p, pk, ray.get(ready[0])
        return
    futs = {pool.submit(_worker_task, space, p, m, model): (p, pk) for p, pk, m in todo}
    pending = set(futs)
    while pending:
        finished, pending = wait(pending, return_when=FIRST_COMPLETED)
        for f in finished:
            p, pk = futs[f]
            yield p, pk, f.result()


def _ray_remote(address: str | None):
    try:
        import ray
    except ImportError:
        raise CodesignError("--engine ray needs Ray: pip install 'codesign[dist]'") from None
    if not ray.is_initialized():
        if address:
            ray.init(address=address, include_dashboard=False, log_to_driver=False)
        else:
            ray.init(num_cpus=os.cpu_count() or 1, include_dashboard=False, log_to_driver=False)
    return ray.remote(_worker_task)
