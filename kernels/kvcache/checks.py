"""The input checks every paged kernel and KV cache runs before it launches (all raise CodesignError).

Plain caches: `check_kv_cache`, the block tables and lengths (`check_block_tables`, one host sync), the
writer's slots (`check_kv_write`). Quantized caches: their pool geometry and tensors (`check_pool_dims`,
`check_cache_tensors`), what their writers take (`check_quant_write`, `check_writer_dtype`), and a
`geometry_probe` that lets the plain checks run on a quantized cache's shape without a dequantized copy.
"""

from __future__ import annotations

import math
import numbers

import torch

from codesign.backend import device_view
from codesign.specs import CodesignError, check_positive_int

KV_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
IN_DTYPES = KV_DTYPES  # what the quantizing writers take
MAX_BLOCK_SIZE = 256


def check_kv_cache(k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple[int, int, int, int]:
    """Validate the two cache tensors; return (num_blocks, block_size, num_kv_heads, head_dim)."""
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            raise CodesignError(f"{name} must be a 4-D tensor [num_blocks, block_size, kv_heads, head_dim]")
        if t.dtype not in KV_DTYPES:
            raise CodesignError(f"{name} dtype must be one of {KV_DTYPES}, got {t.dtype}")
        if t.stride(-1) != 1:
            raise CodesignError(f"{name} must be contiguous along head_dim")
    if k_cache.shape != v_cache.shape:
        raise CodesignError(f"v_cache shape {tuple(v_cache.shape)} != k_cache shape {tuple(k_cache.shape)}")
    if k_cache.dtype != v_cache.dtype:
        raise CodesignError(f"v_cache dtype {v_cache.dtype} != k_cache dtype {k_cache.dtype}")
    if k_cache.device != v_cache.device:
        raise CodesignError(f"v_cache device {v_cache.device} != k_cache device {k_cache.device}")
    nb, bs, h, d = k_cache.shape
    if not (1 <= bs <= MAX_BLOCK_SIZE):
        raise CodesignError(f"block_size (k_cache.shape[1]) must be in [1, {MAX_BLOCK_SIZE}], got {bs}")
    if h < 1 or d < 1:
        raise CodesignError(f"kv_heads and head_dim (k_cache.shape[2:]) must be positive, got {h} and {d}")
    return nb, bs, h, d


def check_positive_real(name: str, x, what: str = "") -> None:
    """x is a positive finite real number (not a bool); `what` qualifies `name` in the message."""
    if isinstance(x, bool) or not isinstance(x, numbers.Real) or not (math.isfinite(x) and x > 0):
        label = f"{name} {what}" if what else name
        raise CodesignError(f"{label} must be a positive finite number, got {x!r}")


def check_int_tensor(name: str, t: torch.Tensor, dim: int, device: torch.device) -> None:
    """`t` must be an int32 tensor of `dim` dimensions on `device`."""
    if not isinstance(t, torch.Tensor) or t.dtype != torch.int32 or t.dim() != dim:
        got = f"{t.dtype} {t.dim()}-D" if isinstance(t, torch.Tensor) else type(t).__name__
        raise CodesignError(f"{name} must be an int32 {dim}-D tensor, got {got}")
    if t.device != device:
        raise CodesignError(f"{name} is on {t.device} but the cache is on {device}")
    if t.shape[-1] > 1 and t.stride(-1) != 1:  # (the kernels step a row's entries by one; rows by their stride)
        raise CodesignError(f"{name} must be contiguous along its last dimension, got stride {t.stride()}")


def has_data(*tensors: torch.Tensor) -> bool:
    """False if any tensor is on the meta device (no data for a data check to read)."""
    return not any(isinstance(t, torch.Tensor) and t.is_meta for t in tensors)


def check_block_tables(
    block_tables: torch.Tensor, context_lens: torch.Tensor, num_blocks: int, block_size: int
) -> None:
    """Data checks (one host sync): lengths >= 0, rows long enough, used block ids inside the pool.

    Entries past a sequence's last block are never read, so they may hold anything.
    """
    b = block_tables.shape[0]
    if context_lens.shape != (b,):
        raise CodesignError(f"context_lens must have shape ({b},), got {tuple(context_lens.shape)}")
    if b == 0 or not has_data(block_tables, context_lens):
        return
    lens = context_lens.cpu()
    if (lens < 0).any():
        i = int(torch.nonzero(lens < 0)[0])
        raise CodesignError(f"context_lens[{i}]={int(lens[i])} is negative")
    used = (lens.to(torch.int64) + block_size - 1) // block_size
    too_long = used > block_tables.shape[1]
    if too_long.any():
        i = int(torch.nonzero(too_long)[0])
        raise CodesignError(
            f"context_lens[{i}]={int(lens[i])} needs {int(used[i])} blocks but block_tables rows hold "
            f"{block_tables.shape[1]}"
        )
    cols = torch.arange(block_tables.shape[1])
    live = cols[None, :] < used[:, None]
    bt = block_tables.cpu()
    bad = live & ((bt < 0) | (bt >= num_blocks))
    if bad.any():
        i, j = (int(x) for x in torch.nonzero(bad)[0])
        raise CodesignError(f"block_tables[{i}, {j}]={int(bt[i, j])} is outside the pool [0, {num_blocks})")


def check_kv_write(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    check_data: bool = True,
) -> None:
    """Shapes, dtypes and devices; with `check_data`, also slot ranges and duplicates (one host sync)."""
    nb, bs, h, d = check_kv_cache(k_cache, v_cache)
    for name, t in (("key", key), ("value", value), ("slot_mapping", slot_mapping)):
        if not isinstance(t, torch.Tensor):
            raise CodesignError(f"{name} must be a tensor, got {type(t).__name__}")
    for name, t in (("key", key), ("value", value)):
        if t.dim() != 3 or tuple(t.shape[1:]) != (h, d):
            raise CodesignError(f"{name} must have shape [tokens, {h}, {d}], got {tuple(t.shape)}")
        if t.dtype != k_cache.dtype:
            raise CodesignError(f"{name} dtype {t.dtype} != cache dtype {k_cache.dtype}")
        if t.device != k_cache.device:
            raise CodesignError(f"{name} is on {t.device} but the cache is on {k_cache.device}")
        if t.stride(-1) != 1:
            raise CodesignError(f"{name} must be contiguous along head_dim")
    if value.shape != key.shape:
        raise CodesignError(f"value shape {tuple(value.shape)} != key shape {tuple(key.shape)}")
    check_slot_mapping(slot_mapping, key.shape[0], nb * bs, k_cache.device, check_data)


def check_slot_mapping(
    slot_mapping: torch.Tensor, tokens: int, num_slots: int, device: torch.device, check_data: bool
) -> None:
    """A writer's slots: int32/int64 `[tokens]`, contiguous, on the cache's device; with `check_data` (one host
    sync) each in [-1, num_slots) (-1 skips a token) and no slot twice."""
    if slot_mapping.dtype not in (torch.int32, torch.int64) or slot_mapping.shape != (tokens,):
        raise CodesignError(
            f"slot_mapping must be int32/int64 of shape ({tokens},), "
            f"got {slot_mapping.dtype} {tuple(slot_mapping.shape)}"
        )
    if slot_mapping.device != device:
        raise CodesignError(f"slot_mapping is on {slot_mapping.device} but the cache is on {device}")
    if slot_mapping.numel() > 1 and slot_mapping.stride(0) != 1:  # (the kernels read it as one contiguous row)
        raise CodesignError(f"slot_mapping must be contiguous, got stride {slot_mapping.stride()}")
    if check_data and slot_mapping.numel() and has_data(slot_mapping):
        s = slot_mapping.cpu().to(torch.int64)
        bad = (s < -1) | (s >= num_slots)
        if bad.any():
            i = int(torch.nonzero(bad)[0])
            raise CodesignError(f"slot_mapping[{i}]={int(s[i])} is outside [-1, {num_slots}) (-1 skips)")
        live = s[s >= 0]
        if live.unique().numel() != live.numel():
            raise CodesignError("slot_mapping writes the same slot twice")


def geometry_probe(shape: tuple[int, int, int, int], dtype: torch.dtype, device) -> torch.Tensor:
    """A stand-in for a cache of `shape` (num_blocks, block_size, kv_heads, head_dim) in `dtype` for the
    shared shape checks: no memory (stride 0 except along head_dim), so no dequantized copy is made."""
    return torch.empty(shape[3], dtype=dtype, device=device).as_strided(tuple(shape), (0, 0, 0, 1))


def check_pool_dims(num_blocks: int, block_size: int, kv_heads: int, head_dim: int) -> None:
    """A quantized cache's pool geometry: four positive ints (`empty()` of every format)."""
    for n, v in (("num_blocks", num_blocks), ("block_size", block_size), ("kv_heads", kv_heads)):
        check_positive_int(n, v)
    check_positive_int("head_dim", head_dim)


def check_cache_tensors(
    label: str, cache, want: dict[str, tuple[torch.dtype, tuple]], device: torch.device | None = None
) -> None:
    """Each `cache.<name>` is a contiguous tensor of the dtype and shape `want[name]` (and on `device`,
    if given); errors name the format (`label`) and the tensor (`check()` of every format)."""
    for name, (dt, shape) in want.items():
        t = getattr(cache, name)
        if (
            not isinstance(t, torch.Tensor)
            or t.dtype != dt
            or tuple(t.shape) != shape
            or not t.is_contiguous()
        ):
            raise CodesignError(
                f"{label} {name} must be a contiguous {dt} tensor of shape {shape}, got "
                f"{getattr(t, 'dtype', type(t))} {tuple(getattr(t, 'shape', ()))}"
            )
        if device is not None and t.device != device:
            raise CodesignError(f"{name} is on {t.device}, the codes on {device}")


def check_quant_write(
    key: torch.Tensor,
    value: torch.Tensor,
    cache_shape: tuple[int, int, int, int],
    device: torch.device,
    slot_mapping: torch.Tensor,
    check_data: bool,
    check_finite: bool,
) -> None:
    """The quantizing writers' shared checks: key / value dtypes, the plain writer's checks
    (`check_kv_write`, slots with `check_data`) against a `geometry_probe` of the cache, and with
    `check_finite` (one host sync) that key and value are finite."""
    for name, t in (("key", key), ("value", value)):
        if not isinstance(t, torch.Tensor) or t.dtype not in IN_DTYPES:
            raise CodesignError(
                f"{name} dtype must be one of {IN_DTYPES}, got {getattr(t, 'dtype', type(t))}"
            )
    probe = geometry_probe(cache_shape, key.dtype, device)
    check_kv_write(key, value, probe, probe, slot_mapping, check_data)
    if check_finite and not (torch.isfinite(key).all() and torch.isfinite(value).all()):
        raise CodesignError("key and value must be finite to be quantized (NaN or inf found)")


def check_writer_dtype(key: torch.Tensor) -> None:
    """bf16 keys only on a GPU for the Triton writers: the interpreter computes bf16 on raw bits."""
    if key.dtype == torch.bfloat16 and not device_view(key.device).compiled:
        raise CodesignError("bf16 keys need a GPU for the Triton writer (the interpreter mishandles bf16)")
