"""Timing one candidate: CUDA graphs with a cold L2 on a GPU, a plain CPU timer in the interpreter.

GPU method (FlashInfer's and vLLM's tuners do the same): warm up (compiles the config), then
capture `calls` launches in one CUDA graph, cycling through `len(fns)` independent input sets
whose total size is at least 2x the L2, so each launch reads its inputs from HBM, not from the
cache the previous launch warmed. The graph removes per-launch CPU overhead, which would
otherwise dominate microsecond kernels. Replays are timed with CUDA events; the result is the
median replay time / calls. When the input sets cannot cover the L2 (too few allowed), a flush
buffer of 2x L2 bytes is zeroed between launches inside the graph, and the same number of flushes
is timed in a graph of its own and subtracted.
If graph capture fails (a kernel that syncs), the same loop is timed with events, unrolled.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any


def input_sets_for_cold_l2(bytes_per_set: int, l2_bytes: int, max_sets: int = 32) -> int:
    """How many input sets to rotate through: ceil(2 * L2 / bytes_per_set), in [1, max_sets]."""
    if bytes_per_set <= 0:
        return 1
    return max(1, min(max_sets, -(-2 * l2_bytes // bytes_per_set)))


def cpu_time_ms(fn: Callable[[], Any], warmup: int = 1, reps: int = 3) -> float:
    """Median wall time of fn() in ms (perf_counter); for interpreter runs, where no GPU clock exists."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def gpu_time_ms(
    fns: list[Callable[[], Any]], l2_bytes: int, bytes_per_call: int, calls: int = 20, reps: int = 10
) -> tuple[float, dict[str, Any]]:
    """Median time of one call in ms, under a CUDA graph with a cold L2 (see module docstring).

    fns: one closure per input set (each launches the kernel once). Returns (ms, how) where `how`
    records the method used: graph or not, input sets, flush used.
    """
    import torch

    need_flush = len(fns) * bytes_per_call < 2 * l2_bytes
    flush = torch.empty(2 * l2_bytes // 4 if need_flush else 1, dtype=torch.int32, device="cuda")
    calls = max(calls, len(fns))

    def body(with_kernel: bool) -> None:
        for i in range(calls):
            if need_flush:
                flush.zero_()
            if with_kernel:
                fns[i % len(fns)]()

    def time_graph(with_kernel: bool) -> float:
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):  # warm-up on a side stream, as graph capture requires
            body(with_kernel)
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            body(with_kernel)
        return event_median(g.replay, reps)

    how: dict[str, Any] = {"input_sets": len(fns), "calls": calls, "l2_flush_buffer": need_flush}
    for f in fns:  # compile and warm every input set outside the graph
        f()
    torch.cuda.synchronize()
    try:
        total = time_graph(True)
        base = time_graph(False) if need_flush else 0.0
        how["cuda_graph"] = True
    except RuntimeError as e:  # capture not possible: time the unrolled loop instead
        how["cuda_graph"] = False
        how["graph_error"] = str(e).splitlines()[0][:200]
        total = event_median(lambda: body(True), reps)
        base = event_median(lambda: body(False), reps) if need_flush else 0.0
    return max(total - base, 0.0) / calls, how


def event_median(fn: Callable[[], Any], reps: int) -> float:
    """Median over `reps` runs of fn, each timed with CUDA events (ms); the GPU work must be queued by fn."""
    import torch

    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)
