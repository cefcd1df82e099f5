"""Argument checks the recurrent layers' CPU references share (`gated_delta`, `ssd`, `selective_scan`): any dtype,
fp64 included, unlike the torch ops' checks (`ops._tensor`), which take the dtypes the kernels store."""

from __future__ import annotations

import torch

from codesign.specs import CodesignError


def check_rank(name: str, x: torch.Tensor, rank: int) -> None:
    """CodesignError naming `name` unless x is a tensor of `rank` dims."""
    if not isinstance(x, torch.Tensor) or x.dim() != rank:
        got = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
        raise CodesignError(f"{name} must be a rank-{rank} tensor, got {got}")


def check_shape(name: str, x: torch.Tensor, rank: int, shape: tuple[int, ...], dims: str) -> None:
    """CodesignError naming `name` unless x is a tensor of exactly `shape` (`dims` spells it)."""
    check_rank(name, x, rank)
    if tuple(x.shape) != shape:
        raise CodesignError(f"{name} must have shape {dims} {shape}, got {tuple(x.shape)}")
