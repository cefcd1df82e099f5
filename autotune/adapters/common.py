"""What the tunable adapters share: tolerances, the shape check, seeded generators, power-of-two caps."""

from __future__ import annotations

import math

import torch

from codesign.autotune.ops import Shape
from codesign.specs.errors import CodesignError

# ||out - ref|| / ||ref|| bounds per output dtype: fp32 accumulation everywhere; fp16/bf16 round the
# output (and the dequantized weight) once. A wrong config (bad split, unwritten tile) is O(1).
TOL = {torch.float32: 1e-4, torch.float16: 3e-3, torch.bfloat16: 1.5e-2}


def need_dims(shape: Shape, names: tuple[str, ...], op: str) -> None:
    missing = [n for n in names if n not in shape]
    extra = [n for n in shape if n not in names]
    if missing or extra:
        raise CodesignError(f"shape for {op}: expected dims {', '.join(names)}; got {shape}")
    bad = [
        n for n in names if shape[n] < (0 if n in ("G", "SPLITK", "DEQUANT", "TORCH", "FUSEDQ", "TMA") else 1)
    ]
    if bad:
        raise CodesignError(f"shape for {op}: dims {bad} must be positive, got {shape}")


def seeded(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def pow2_cap(n: int, lo: int = 16) -> int:
    return max(lo, 1 << max(0, math.ceil(math.log2(max(n, 1)))))
