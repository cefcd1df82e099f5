"""Fleet tuning on Ray: one actor per GPU (`num_gpus=1`), shapes spread over the actors, one cache.

Each actor runs a `Tuner` on its own GPU and appends every measurement to the cache path it is
given (safe for several writers: see `cache.py`), and returns its records. When the actors do not
share the driver's file system (a multi-node cluster), the driver merges the returned records
into its own cache, skipping points it already holds, so the result is the same single cache.
Ray is optional (the `[dist]` extra); it is imported only here.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from codesign.specs.errors import CodesignError


def _actor_class(gpus_per_actor: float) -> Any:
    import ray

    @ray.remote(num_gpus=gpus_per_actor)
    class TuneWorker:
        """Tunes shapes of one op on the GPU Ray assigned to this actor."""

        def tune(self, op_name: str, shapes: list[dict], cache_path: str, settings: dict) -> dict:
            import os

            from codesign.backend import enable_interpreter_if_no_gpu

            if settings.get("device") == "cpu":
                enable_interpreter_if_no_gpu()
            from codesign.autotune.cache import TuningCache
            from codesign.autotune.ops import get_op
            from codesign.autotune.tuner import Tuner

            cache = TuningCache(cache_path)
            before = len(cache.load(warn=False).records)
            tuner = Tuner(get_op(op_name), cache, log=lambda s: print(f"[pid {os.getpid()}] {s}"), **settings)
            results = [tuner.tune_shape(s).__dict__ for s in shapes]
            return {"results": results, "records": cache.load(warn=False).records[before:]}

    return TuneWorker


def tune_on_ray(
    op_name: str,
    shapes: list[dict],
    cache_path: str | Path,
    settings: dict,
    *,
    address: str | None = None,
    num_actors: int | None = None,
    gpus_per_actor: float = 1.0,
    init_kwargs: dict | None = None,
) -> list[dict]:
    """Tune `shapes` of `op_name` across a Ray cluster; returns one result dict per shape, in order.

    num_actors defaults to the cluster's GPU count (gpus_per_actor=1: one actor per GPU). Tests on
    CPU pass gpus_per_actor=0 and num_actors explicitly. Records are merged into `cache_path`.
    """
    try:
        import ray
    except ImportError as e:
        raise CodesignError("--engine ray needs Ray: pip install 'codesign[dist]'") from e
    from codesign.autotune.cache import TuningCache, point_id

    if not ray.is_initialized():
        ray.init(address=address, **(init_kwargs or {}))
    if num_actors is None:
        num_actors = int(ray.cluster_resources().get("GPU", 0) // max(gpus_per_actor, 1e-9))
    if num_actors < 1:
        raise CodesignError("engine ray: the cluster has no GPU for a tuning actor")
    num_actors = min(num_actors, len(shapes))
    worker = _actor_class(gpus_per_actor)
    actors = [worker.remote() for _ in range(num_actors)]
    # Round-robin keeps each actor's share of large and small shapes even.
    parts = [list(range(i, len(shapes), num_actors)) for i in range(num_actors)]
    futures = [
        a.tune.remote(op_name, [shapes[j] for j in idx], str(cache_path), settings)
        for a, idx in zip(actors, parts)
    ]
    outs = ray.get(futures)
    cache = TuningCache(cache_path)
    have = set(cache.measured())
    for out in outs:
        for rec in out["records"]:
            if point_id(rec) not in have:  # only records the actors wrote elsewhere
                have.add(point_id(rec))
                cache.append(rec)
    results: list[dict] = [{}] * len(shapes)
    for idx, out in zip(parts, outs):
        for j, r in zip(idx, out["results"]):
            results[j] = r
    for a in actors:
        ray.kill(a)
    return results
