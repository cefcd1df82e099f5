"""Small host lists of indices as device tensors without a host sync: a writer's per-layer metadata.

`torch.tensor(values, device="cuda")` copies from pageable memory and then waits for the stream (a host sync,
which in a decode step at every layer serializes the host with the GPU). `device_ints` copies from pinned memory
without waiting, and with a `memo` (a dict the caller keeps for one step) builds each distinct list once for
all the layers that share it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def device_ints(values: Sequence[int], device: torch.device, memo: dict | None = None) -> torch.Tensor:
    """int64 tensor of `values` on `device` (CUDA: from pinned memory, non-blocking; the caching host allocator
    keeps the staging buffer until the copy is done); the memo's tensor where it holds this list already
    (callers must not write into it)."""
    key = (tuple(values), device)
    hit = None if memo is None else memo.get(key)
    if hit is not None:
        return hit
    t = _build(key[0], device)
    if memo is not None:
        memo[key] = t
    return t


def _build(values: tuple[int, ...], device: torch.device) -> torch.Tensor:
    t = torch.tensor(values, dtype=torch.int64)
    return t.pin_memory().to(device, non_blocking=True) if torch.device(device).type == "cuda" else t.to(device)
