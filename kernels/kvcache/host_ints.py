"""Small host lists of indices as device tensors without a host sync: a writer's per-layer metadata.

`torch.tensor(values, device="cuda")` copies from pageable memory and then waits for the stream (a host sync,
which in a decode step at every layer serializes the host with the GPU). `device_ints` (and `device_rows`, for a
table) copies from pinned memory without waiting, and with a `memo` (a dict the caller keeps for one step) builds
each distinct list once for all the layers that share it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def device_ints(values: Sequence[int], device: torch.device, memo: dict | None = None,
                dtype: torch.dtype = torch.int64) -> torch.Tensor:  # fmt: skip
    """Tensor of `values` (int64, or `dtype`) on `device` (CUDA: from pinned memory, non-blocking; the caching host
    allocator keeps the staging buffer until the copy is done); the memo's tensor where it holds this list already
    (callers must not write into it)."""
    key = (tuple(values), device, dtype)
    hit = None if memo is None else memo.get(key)
    if hit is not None:
        return hit
    t = _build(key[0], device, dtype)
    if memo is not None:
        memo[key] = t
    return t


def device_rows(rows: Sequence[Sequence[int]], device: torch.device, dtype: torch.dtype = torch.int32) -> torch.Tensor:
    """`[len(rows), longest]` tensor of the rows, each padded with zeros, on `device` (as `device_ints`: one copy
    from pinned memory, non-blocking): a step's block tables."""
    width = max([len(r) for r in rows] + [1])
    return _to_device(torch.tensor([[*r, *[0] * (width - len(r))] for r in rows], dtype=dtype), device)


def _build(values: tuple[int, ...], device: torch.device, dtype: torch.dtype = torch.int64) -> torch.Tensor:
    return _to_device(torch.tensor(values, dtype=dtype), device)


def _to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    return t.pin_memory().to(device, non_blocking=True) if torch.device(device).type == "cuda" else t.to(device)
