"""Search strategies over a pruned list of candidate configs: exhaustive, random, and TPE (Optuna).

All three share one contract: `search(strategy, candidates, evaluate, budget)` calls
`evaluate(config) -> cost` (milliseconds; `math.inf` for a failed or incorrect candidate) on at
most `budget.max_evals` new candidates and within `budget.max_seconds`, and returns every trial.
Points already measured (`known`, e.g. from the durable cache after a kill) cost nothing: they
are skipped by exhaustive/random and given to TPE as prior observations.

TPE ("tpe"): Optuna's Tree-structured Parzen Estimator, multivariate, over each parameter's
*index* in its sorted value list, so it sees that BLOCK_N=64 lies between 32 and 128. A sampled
point that was pruned or already measured is told as failed and replaced by the nearest
(L1 in index space) unmeasured candidate, which is measured and added as a trial of its own:
every evaluation is a new point, and TPE never learns from a config it did not run.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from codesign.autotune.space import Config, config_id
from codesign.specs.errors import CodesignError, check_choice

STRATEGIES = ("exhaustive", "random", "tpe")


@dataclass(frozen=True)
class Budget:
    """Stop after max_evals new measurements or max_seconds of wall time (None: no limit)."""

    max_evals: int | None = None
    max_seconds: float | None = None

    def __post_init__(self) -> None:
        if self.max_evals is not None and self.max_evals < 1:
            raise CodesignError(f"budget max_evals must be >= 1, got {self.max_evals}")
        if self.max_seconds is not None and self.max_seconds <= 0:
            raise CodesignError(f"budget max_seconds must be > 0, got {self.max_seconds}")


@dataclass
class SearchResult:
    """trials: (config, cost ms) in evaluation order, known points first; n_new: new measurements."""

    trials: list[tuple[Config, float]] = field(default_factory=list)
    n_new: int = 0

    @property
    def best(self) -> tuple[Config, float] | None:
        """Lowest-cost finite trial, or None when nothing succeeded."""
        ok = [t for t in self.trials if math.isfinite(t[1])]
        return min(ok, key=lambda t: t[1]) if ok else None


class _Runner:
    """Budget bookkeeping shared by the strategies."""

    def __init__(self, evaluate: Callable[[Config], float], budget: Budget, result: SearchResult) -> None:
        self.evaluate, self.budget, self.result = evaluate, budget, result
        self.t0 = time.monotonic()

    def exhausted(self) -> bool:
        b = self.budget
        if b.max_evals is not None and self.result.n_new >= b.max_evals:
            return True
        return b.max_seconds is not None and time.monotonic() - self.t0 >= b.max_seconds

    def run(self, cfg: Config) -> float:
        cost = float(self.evaluate(cfg))
        if math.isnan(cost):
            cost = math.inf
        self.result.trials.append((cfg, cost))
        self.result.n_new += 1
        return cost


def search(
    strategy: str,
    candidates: list[Config],
    evaluate: Callable[[Config], float],
    budget: Budget | None = None,
    *,
    seed: int = 0,
    known: dict[str, float] | None = None,
) -> SearchResult:
    """Search `candidates` with `strategy` ("exhaustive", "random" or "tpe"); see the module docstring."""
    check_choice("strategy", strategy, STRATEGIES)
    if not candidates:
        raise CodesignError("candidates: no config left to try (all pruned for this shape and device)")
    budget = budget or Budget()
    known = dict(known or {})
    by_id = {config_id(c): c for c in candidates}
    result = SearchResult(trials=[(by_id[k], v) for k, v in known.items() if k in by_id])
    runner = _Runner(evaluate, budget, result)
    todo = [c for c in candidates if config_id(c) not in known]
    if strategy == "random":
        random.Random(seed).shuffle(todo)
    if strategy in ("exhaustive", "random"):
        for cfg in todo:
            if runner.exhausted():
                break
            runner.run(cfg)
        return result
    _tpe(candidates, known, runner, seed)
    return result


def _tpe(candidates: list[Config], known: dict[str, float], runner: _Runner, seed: int) -> None:
    by_id = {config_id(c): c for c in candidates}
    try:
        import optuna
    except ImportError as e:  # pragma: no cover - optuna is a dependency of the tuner
        raise CodesignError("strategy 'tpe' needs optuna (pip install optuna)") from e
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    names = sorted({k for c in candidates for k in c})
    if any(len(c) != len(names) for c in candidates):
        raise CodesignError("candidates: every config must set the same parameters for strategy 'tpe'")
    values = {n: sorted({c[n] for c in candidates}) for n in names}
    dists = {n: optuna.distributions.IntDistribution(0, len(values[n]) - 1) for n in names}

    def to_index(cfg: Config) -> dict[str, int]:
        return {n: values[n].index(cfg[n]) for n in names}

    point_of = {config_id(c): tuple(to_index(c)[n] for n in names) for c in candidates}
    index_of = {point_of[config_id(c)]: c for c in candidates}
    measured = set(known)
    sampler = optuna.samplers.TPESampler(
        seed=seed, multivariate=True, n_startup_trials=max(5, min(20, len(candidates) // 20))
    )
    study = optuna.create_study(direction="minimize", sampler=sampler)

    def add(cfg: Config, cost: float) -> None:
        # Failed configs are told as failed: an infinite value would distort the density model.
        state = optuna.trial.TrialState.COMPLETE if math.isfinite(cost) else optuna.trial.TrialState.FAIL
        study.add_trial(
            optuna.trial.create_trial(
                params=to_index(cfg),
                distributions=dists,
                value=cost if math.isfinite(cost) else None,
                state=state,
            )
        )

    for cid, cost in known.items():
        if cid in by_id:
            add(by_id[cid], cost)
    rng = random.Random(seed)
    while not runner.exhausted() and len(measured) < len(candidates):
        trial = study.ask(dists)
        point = tuple(trial.params[n] for n in names)
        cfg = index_of.get(point)
        if cfg is not None and config_id(cfg) not in measured:
            measured.add(config_id(cfg))
            cost = runner.run(cfg)
            if math.isfinite(cost):
                study.tell(trial, cost)
            else:
                study.tell(trial, state=optuna.trial.TrialState.FAIL)
            continue
        # Pruned or already measured: measure the nearest new candidate instead (ties broken at random).
        study.tell(trial, state=optuna.trial.TrialState.FAIL)
        free = [(cid, p) for cid, p in point_of.items() if cid not in measured]
        dist = [sum(abs(a - b) for a, b in zip(point, p)) for _, p in free]
        near = min(dist)
        cfg = by_id[rng.choice([cid for (cid, _), d in zip(free, dist) if d == near])]
        measured.add(config_id(cfg))
        add(cfg, runner.run(cfg))
