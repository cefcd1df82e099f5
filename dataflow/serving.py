"""Serving traces and an iteration-level (continuous-batching) scheduler simulation.

Requests carry (arrival s, prompt tokens, output tokens). The scheduler follows
Orca/vLLM's iteration-level batching: at every iteration it admits waiting
requests first-come-first-served while the batch has room and the paged KV
cache can hold their prompt + output tokens (reserved at admission, so there
is no preemption — a conservative policy, stated here), prefills the admitted
prompts, and every running request then gains one token. A request's first
token comes at the end of its prefill iteration (TTFT); later tokens one per
iteration (TPOT). Iteration time = prefill time of the admitted prompts +
decode time of the running batch at its total context.

Traces: synthetic (Poisson arrivals, log-normal lengths) or a CSV in the public
Azure LLM inference trace format (TIMESTAMP, ContextTokens, GeneratedTokens).
"""

from __future__ import annotations

import csv
import heapq
import math
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import numpy as np

from codesign.specs import CodesignError, check_positive_int


@dataclass(frozen=True)
class Trace:
    arrival_s: np.ndarray  # sorted, float64
    prompt: np.ndarray  # int64 >= 1
    output: np.ndarray  # int64 >= 1
    name: str = "trace"

    def __len__(self) -> int:
        return len(self.arrival_s)


def synthetic_trace(
    n: int,
    rate_per_s: float,
    prompt_median: int = 512,
    output_median: int = 128,
    sigma: float = 0.8,
    max_context: int = 8192,
    seed: int = 0,
) -> Trace:
    """Poisson arrivals at `rate_per_s`; log-normal prompt and output lengths (medians given), capped."""
    check_positive_int("requests", n)
    if not rate_per_s > 0:
        raise CodesignError(f"rate_per_s must be > 0, got {rate_per_s!r}")
    rng = np.random.default_rng(seed)
    arrival = np.cumsum(rng.exponential(1.0 / rate_per_s, n))
    prompt = np.clip(np.round(rng.lognormal(math.log(prompt_median), sigma, n)), 1, max_context // 2).astype(
        np.int64
    )
    output = np.clip(np.round(rng.lognormal(math.log(output_median), sigma, n)), 1, max_context // 2).astype(
        np.int64
    )
    return Trace(arrival, prompt, output, f"synthetic-{n}-{rate_per_s:g}rps-seed{seed}")


def _parse_time(text: str) -> float:
    t = text.strip()
    try:
        return float(t)
    except ValueError:
        pass
    if "." in t:  # Azure's traces carry 7 fractional digits; datetime takes at most 6
        head, frac = t.rsplit(".", 1)
        t = f"{head}.{frac[:6]}"
    return datetime.fromisoformat(t).timestamp()


def load_azure_trace(path: str | Path) -> Trace:
    """Read an Azure LLM inference trace CSV (TIMESTAMP, ContextTokens, GeneratedTokens); times start at 0."""
    path = Path(path)
    try:
        f = open(path, newline="")
    except OSError as e:
        raise CodesignError(f"trace {path}: cannot read ({e})") from None
    with f:
        reader = csv.DictReader(f)
        need = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")
        missing = [c for c in need if c not in (reader.fieldnames or [])]
        if missing:
            raise CodesignError(f"trace {path}: missing column(s) {missing}; expected {', '.join(need)}")
        times, prompts, outputs = [], [], []
        for line, row in enumerate(reader, start=2):
            try:
                t = _parse_time(row["TIMESTAMP"])
                p, o = int(row["ContextTokens"]), int(row["GeneratedTokens"])
            except (TypeError, ValueError):
                raise CodesignError(f"trace {path}, line {line}: non-numeric field in {row}") from None
            if p < 0 or o < 0:
                raise CodesignError(f"trace {path}, line {line}: negative token count ({p}, {o})")
            times.append(t)
            prompts.append(max(p, 1))
            outputs.append(max(o, 1))
    if not times:
        raise CodesignError(f"trace {path}: no requests")
    order = np.argsort(times, kind="stable")
    arr = np.asarray(times, dtype=np.float64)[order]
    return Trace(
        arr - arr[0], np.asarray(prompts, np.int64)[order], np.asarray(outputs, np.int64)[order], path.stem
    )


@dataclass(frozen=True)
class ServingResult:
    requests: int
    served: int
    makespan_s: float
    throughput_tok_s: float
    ttft_p50_s: float
    ttft_p99_s: float
    tpot_p50_s: float
    tpot_p99_s: float
    max_batch: int
    rejected: int  # requests larger than the whole KV cache

    def as_metrics(self) -> dict[str, float]:
        return {f"serve_{k}": float(v) for k, v in self.__dict__.items()}


def simulate(
    trace: Trace,
    decode_time: Callable[[int, int], float],
    prefill_time: Callable[[int], float],
    kv_capacity_tokens: int,
    max_batch: int = 256,
) -> ServingResult:
    """Run the iteration-level scheduler over `trace`.

    decode_time(batch, total_context_tokens) and prefill_time(prompt_tokens) give iteration costs in seconds.
    """
    n = len(trace)
    arrival, prompt, output = trace.arrival_s, trace.prompt, trace.output
    need = prompt + output
    rejected = int((need > kv_capacity_tokens).sum())
    ttft = np.full(n, np.nan)
    finish_t = np.full(n, np.nan)
    waiting = 0  # index of the next not-yet-admitted request (FCFS)
    running: list[tuple[int, int]] = []  # heap of (finish iteration, request)
    ctx_sum = 0
    kv_used = 0
    t = 0.0
    it = 0
    peak = 0
    while waiting < n or running:
        if not running and waiting < n and arrival[waiting] > t:
            t = float(arrival[waiting])  # idle until the next arrival
        admitted_tokens = 0
        admitted: list[int] = []
        while waiting < n and arrival[waiting] <= t and len(running) + len(admitted) < max_batch:
            r = waiting
            if need[r] > kv_capacity_tokens:
                waiting += 1  # can never fit: rejected
                continue
            if kv_used + need[r] > kv_capacity_tokens:
                break
            kv_used += int(need[r])
            admitted.append(r)
            admitted_tokens += int(prompt[r])
            waiting += 1
        if not running and not admitted:
            if waiting < n:
                t = max(t, float(arrival[waiting]))
                continue
            break
        # Requests already running decode one token each; the admitted ones are prefilled (first token).
        prev = len(running)
        step = prefill_time(admitted_tokens) if admitted else 0.0
        step += decode_time(prev, ctx_sum) if prev else 0.0
        t += step
        ctx_sum += prev
        for r in admitted:
            ttft[r] = t
            ctx_sum += int(prompt[r]) + 1
            heapq.heappush(running, (it + int(output[r]) - 1, r))
        peak = max(peak, len(running))
        while running and running[0][0] <= it:
            _, r = heapq.heappop(running)
            finish_t[r] = t
            ctx_sum -= int(prompt[r] + output[r])
            kv_used -= int(need[r])
        it += 1
    served = ~np.isnan(finish_t)
    if not served.any():
        return ServingResult(n, 0, 0.0, 0.0, math.inf, math.inf, math.inf, math.inf, 0, rejected)
    ttfts = ttft[served] - arrival[served]
    multi = served & (output > 1)
    tpot = (finish_t[multi] - ttft[multi]) / (output[multi] - 1) if multi.any() else np.array([0.0])
    makespan = float(np.nanmax(finish_t) - arrival[0])
    return ServingResult(
        requests=n,
        served=int(served.sum()),
        makespan_s=makespan,
        throughput_tok_s=float(output[served].sum() / makespan) if makespan > 0 else 0.0,
        ttft_p50_s=float(np.percentile(ttfts, 50)),
        ttft_p99_s=float(np.percentile(ttfts, 99)),
        tpot_p50_s=float(np.percentile(tpot, 50)),
        tpot_p99_s=float(np.percentile(tpot, 99)),
        max_batch=peak,
        rejected=rejected,
    )
