"""Config spaces for kernel tuning, and pruning of configs a device cannot launch.

A space is a grid: each parameter has an ordered list of values (block sizes, warps, stages,
split-K...). `candidates()` enumerates the grid, drops configs the op's own rule rejects (e.g.
BLOCK_K larger than K), then drops configs whose *estimated* resources exceed the device:

    shared memory = op estimate (e.g. GEMM: num_stages * (BLOCK_M*BLOCK_K*a_bytes + BLOCK_K*BLOCK_N*b_bytes))
                    <= limits.smem_per_block
    registers     = op estimate per thread (accumulator words + a fixed overhead)
                    <= limits.regs_per_thread, and * 32 * num_warps <= limits.regs_per_block
    threads       = 32 * num_warps <= limits.max_threads_per_block

These are estimates made before any launch (the compiler's real numbers come only after
compiling); they are deliberately a little generous so pruning never drops a config that fits.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from codesign.specs.errors import CodesignError

Config = dict[str, int]


def config_id(config: dict[str, Any]) -> str:
    """Canonical, order-independent text of a config (sorted-key JSON): the cache's identity of a point."""
    return json.dumps(config, sort_keys=True, separators=(",", ":"))


@dataclass(frozen=True)
class DeviceLimits:
    """Per-block resource limits of a GPU (defaults: Hopper, sm_90: 227 KiB opt-in shared memory)."""

    name: str = "sm_90"
    smem_per_block: int = 227 * 1024
    regs_per_thread: int = 255
    regs_per_block: int = 64 * 1024
    max_threads_per_block: int = 1024
    l2_bytes: int = 50 * 1024 * 1024
    sms: int = 132

    @staticmethod
    def from_torch(device: Any = None) -> DeviceLimits:
        """Limits read off a CUDA device (torch's device properties); Hopper defaults on CPU."""
        import torch

        if not torch.cuda.is_available():
            return DeviceLimits(name="cpu-interpreter")
        p = torch.cuda.get_device_properties(device)
        smem = int(getattr(p, "shared_memory_per_block_optin", 0) or getattr(p, "shared_memory_per_block", 0))
        return DeviceLimits(
            name=p.name,
            smem_per_block=smem or 48 * 1024,
            regs_per_block=int(getattr(p, "regs_per_multiprocessor", 64 * 1024)),
            max_threads_per_block=int(getattr(p, "max_threads_per_block", 1024)),
            l2_bytes=int(getattr(p, "L2_cache_size", 50 * 1024 * 1024)),
            sms=int(p.multi_processor_count),
        )


@dataclass(frozen=True)
class Resources:
    """Estimated per-block resources of one config: shared memory bytes and registers per thread."""

    smem_bytes: int
    regs_per_thread: int


@dataclass
class ConfigSpace:
    """A grid of launch parameters with a validity rule and a resource estimator.

    params: name -> ordered candidate values (ordered so model-guided search can treat them as
    ordinal). valid(config) -> bool drops configs the kernel cannot take for this shape.
    resources(config) -> Resources is compared against `DeviceLimits` by `fits`.
    """

    params: dict[str, list[int]]
    valid: Callable[[Config], bool] = lambda c: True
    resources: Callable[[Config], Resources] | None = None
    fixed: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.params:
            raise CodesignError("params: a config space needs at least one parameter")
        for name, values in self.params.items():
            if not values or len(set(values)) != len(values):
                raise CodesignError(
                    f"params[{name!r}]: expected a non-empty list of distinct values, got {values}"
                )

    @property
    def size(self) -> int:
        """Number of grid points before any pruning."""
        n = 1
        for v in self.params.values():
            n *= len(v)
        return n

    def grid(self) -> Iterator[Config]:
        """Every grid point, in a fixed order, with the fixed parameters added."""
        names = list(self.params)
        for values in itertools.product(*(self.params[n] for n in names)):
            yield {**self.fixed, **dict(zip(names, values))}

    def why_not(self, config: Config, limits: DeviceLimits) -> str | None:
        """Reason `config` cannot launch on `limits` (op rule, shared memory, registers, threads), or None."""
        if not self.valid(config):
            return "rejected by the op's rule for this shape"
        threads = 32 * int(config.get("num_warps", 4))
        if threads > limits.max_threads_per_block:
            return f"{threads} threads > {limits.max_threads_per_block}"
        if self.resources is not None:
            r = self.resources(config)
            if r.smem_bytes > limits.smem_per_block:
                return f"shared memory {r.smem_bytes} B > {limits.smem_per_block} B"
            if r.regs_per_thread > limits.regs_per_thread:
                return f"{r.regs_per_thread} registers/thread > {limits.regs_per_thread}"
            if r.regs_per_thread * threads > limits.regs_per_block:
                return f"{r.regs_per_thread * threads} registers/block > {limits.regs_per_block}"
        return None

    def candidates(self, limits: DeviceLimits) -> list[Config]:
        """The grid points that pass `why_not` (pruned before any launch)."""
        return [c for c in self.grid() if self.why_not(c, limits) is None]


def gemm_resources(a_bytes: float, b_bytes: float, acc_bytes: int = 4) -> Callable[[Config], Resources]:
    """Resource estimate of a tiled GEMM config (Triton's software pipeline keeps num_stages tiles).

    smem = num_stages * (BLOCK_M*BLOCK_K*a_bytes + BLOCK_K*BLOCK_N*b_bytes)
    regs/thread = BLOCK_M*BLOCK_N*acc_bytes/4 / (32*num_warps) + 32 (addresses, loop state)
    """

    def estimate(c: Config) -> Resources:
        bm, bn, bk = c["BLOCK_M"], c["BLOCK_N"], c["BLOCK_K"]
        stages = max(1, c.get("num_stages", 1))
        smem = stages * (bm * bk * a_bytes + bk * bn * b_bytes)
        acc_words = bm * bn * acc_bytes // 4
        regs = acc_words // (32 * c.get("num_warps", 4)) + 32
        return Resources(int(smem), int(regs))

    return estimate
