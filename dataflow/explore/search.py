"""Search strategies over a design space: grid, random, and model-guided (Optuna's TPE).

Each strategy proposes batches of points; the driver evaluates them (all
workloads per point), stores them, and tells the strategy the scalar score of
each (higher is better; infeasible points score -inf). Grid and random need no
feedback; TPE uses Optuna's ask/tell interface so evaluation stays in our engine
and store.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterator
from typing import Any

from codesign.dataflow.explore.space import Space, point_key
from codesign.specs import CodesignError, check_choice

STRATEGIES = ("grid", "random", "tpe")


class Strategy:
    def batches(self, batch_size: int) -> Iterator[list[dict[str, Any]]]:
        raise NotImplementedError

    def tell(self, point: dict[str, Any], score: float) -> None:
        """Feedback for guided strategies (ignored by grid and random)."""


class GridSearch(Strategy):
    def __init__(self, space: Space, budget: int | None):
        self.points = space.grid()[: budget or None]

    def batches(self, batch_size: int) -> Iterator[list[dict[str, Any]]]:
        for i in range(0, len(self.points), batch_size):
            yield self.points[i : i + batch_size]


class RandomSearch(Strategy):
    """Distinct points in a seeded random order (sampling without replacement)."""

    def __init__(self, space: Space, budget: int | None, seed: int = 0):
        pts = space.grid()
        random.Random(seed).shuffle(pts)
        self.points = pts[: budget or None]

    def batches(self, batch_size: int) -> Iterator[list[dict[str, Any]]]:
        for i in range(0, len(self.points), batch_size):
            yield self.points[i : i + batch_size]


class TPESearch(Strategy):
    """Optuna's TPE sampler over the space's categorical parameters, driven by ask/tell."""

    def __init__(self, space: Space, budget: int | None, seed: int = 0):
        try:
            import optuna
        except ImportError:
            raise CodesignError("--search tpe needs Optuna: pip install optuna") from None
        optuna.logging.set_verbosity(optuna.logging.WARNING)
        self.optuna = optuna
        self.space = space
        self.budget = budget or min(space.size(), 64)
        self.study = optuna.create_study(
            direction="maximize", sampler=optuna.samplers.TPESampler(seed=seed, n_startup_trials=8)
        )
        # Choices as indices: Optuna's categorical values must be primitives, ours can be mappings.
        self.dists = {
            p.name: optuna.distributions.CategoricalDistribution(list(range(len(p.values))))
            for p in space.free_params
        }
        self.pending: dict[str, Any] = {}
        self.scores: dict[str, float] = {}

    def batches(self, batch_size: int) -> Iterator[list[dict[str, Any]]]:
        asked = 0
        seen: set[str] = set()
        while asked < self.budget:
            batch = []
            for _ in range(min(batch_size, self.budget - asked)):
                trial = self.study.ask(self.dists)
                free = {p.name: p.values[trial.params[p.name]] for p in self.space.free_params}
                point = self.space._complete(free)
                k = point_key(point)
                asked += 1
                if k in seen:  # TPE may re-propose a point: reuse its score, never re-evaluate
                    if k in self.scores:
                        self.study.tell(trial, self.scores[k])
                    else:  # still being evaluated in this batch
                        self.study.tell(trial, state=self.optuna.trial.TrialState.FAIL)
                    continue
                seen.add(k)
                self.pending[k] = trial
                batch.append(point)
            if batch:
                yield batch

    def tell(self, point: dict[str, Any], score: float) -> None:
        k = point_key(point)
        self.scores[k] = score if math.isfinite(score) else -1e30  # Optuna refuses inf
        trial = self.pending.pop(k, None)
        if trial is not None:
            self.study.tell(trial, self.scores[k])


def make_strategy(name: str, space: Space, budget: int | None, seed: int = 0) -> Strategy:
    check_choice("search", name, STRATEGIES)
    if budget is not None and budget <= 0:
        raise CodesignError(f"budget must be a positive integer, got {budget}")
    if name == "grid":
        return GridSearch(space, budget)
    if name == "random":
        return RandomSearch(space, budget, seed)
    return TPESearch(space, budget, seed)
