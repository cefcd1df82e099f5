"""Multi-head latent attention decode over a paged latent cache (DeepSeek-V2/V3): `latent_decode_attention`.

The cache holds one vector a token, `[num_blocks, block_size, latent + rope]` (vLLM's and FlashMLA's layout: the
kv_lora_rank-wide latent, then the rotary key); q is the absorbed query, `[batch, heads, latent + rope]` (each
head's non-rotary query taken through W_UK into the latent space, then its rotary part). Keys are the whole
vector, values its first `v_dim` = latent channels, so out is `[batch, heads, latent]`, still in the latent space
(W_UV takes it to the value heads). The cache may be e4m3 (`torch.float8_e4m3fn`) with one scale for the
tensor, `kv_scale`, as vLLM keeps an MLA cache with kv_cache_dtype="fp8": stored value x kv_scale is the latent.
Its cost model is the dataflow graph's decode attention node (`latent_decode_spec`:
`PagedDecodeAttention(latent_kv=True)`). CUDA tensors run the Triton kernel (`triton_latent`), CPU tensors the
torch path; `codesign.backend.use_backend("triton")` forces the kernel (the interpreter on CPU). Every check runs
before anything launches.
"""

from __future__ import annotations

import math

import torch

from codesign.backend import device_view, resolve_backend
from codesign.kernels.attention.options import MAX_SPLITS
from codesign.kernels.attention.wrappers import SPEC_DTYPES
from codesign.kernels.kvcache.checks import (
    check_block_tables,
    check_int_tensor,
    check_positive_real,
    has_data,
)
from codesign.kernels.kvcache.latent import FP8, check_latent_cache, check_latent_scale, latent_kv_format
from codesign.kernels.kvcache.quantizers import FP16_MAX
from codesign.specs import CodesignError, PagedDecodeAttention

OP = "paged_attention"  # the backend choice's op name, shared with every attention op
DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def tiles(heads: int, fp8: bool, capability: tuple[int, int] | None = None) -> tuple[int, int, int]:
    """(query heads a program: the dot's M, cached tokens a tile, warps): the fastest the SASS model predicts without
    spills (`bench/latent_predict.py`, untimed). From 32 heads a program takes 32 (each tile serves twice the heads,
    so the latent is read by half as many programs); fewer heads keep 16 (a 32-row M would be half padding). A bf16
    cache on Hopper (227 KB of shared memory a block): 128-token tiles on 8 warps (171 / 194 KB staged; 184 / 252
    registers); elsewhere 64-token tiles (95 KB: sm_80 holds 163 KB), on 4 warps at 16 heads a program, 8 at 32. An
    e4m3 tile is decoded in registers: 32 tokens on 8 warps (188 registers at 16 heads, 254 at 32; 64 tokens spill,
    as 4 warps do)."""
    wide = heads >= 32
    if fp8:
        return (32 if wide else 16), 32, 8
    if capability is not None and capability >= (9, 0):
        return (32 if wide else 16), 128, 8
    return (32, 64, 8) if wide else (16, 64, 4)


def _check(q, cache, block_tables, context_lens, v_dim, sm_scale, kv_scale, num_splits, check_data) -> None:
    b, nb, bs, d = _check_tensors(q, cache)
    _check_scalars(d, v_dim, sm_scale, num_splits)
    check_latent_scale(cache.dtype, kv_scale)
    check_int_tensor("block_tables", block_tables, 2, cache.device)
    check_int_tensor("context_lens", context_lens, 1, cache.device)
    if block_tables.shape[0] != b:
        raise CodesignError(f"block_tables has {block_tables.shape[0]} rows for a batch of {b}")
    if check_data and has_data(q, block_tables, context_lens):
        check_block_tables(block_tables, context_lens, nb, bs)
        if cache.dtype == FP8 and q.dtype == torch.bfloat16 and q.numel():
            # the kernel dots an e4m3 cache in fp16 (one conversion of q, not one a cached element)
            big = float(q.abs().amax())
            if not big <= FP16_MAX:
                raise CodesignError(f"q holds {big:g}, past fp16's {FP16_MAX:g}: bf16 queries over an e4m3 cache "
                                    "are dotted in fp16 (scale them, or store the cache in bf16)")  # fmt: skip


def _check_tensors(q, cache) -> tuple[int, int, int, int]:
    """q and the cache: shapes, dtypes, devices; (batch, num_blocks, block_size, channels)."""
    if not isinstance(q, torch.Tensor) or q.dim() != 3:
        raise CodesignError("q must be a 3-D tensor [batch, heads, latent + rope]")
    if q.dtype not in DTYPES:
        raise CodesignError(f"q dtype must be one of {DTYPES}, got {q.dtype}")
    if q.stride(-1) != 1:
        raise CodesignError("q must be contiguous along its last dimension")
    nb, bs, dc = check_latent_cache(cache, q.dtype, "q")
    if q.device != cache.device:
        raise CodesignError(f"latent_cache is on {cache.device} but q is on {q.device}")
    b, h, d = q.shape
    if dc != d:
        raise CodesignError(f"latent_cache's last dimension {dc} != q's {d} (latent + rope)")
    if h < 1 or d < 1:
        raise CodesignError(f"q must have heads and channels, got shape {tuple(q.shape)}")
    return b, nb, bs, d


def _check_scalars(d: int, v_dim, sm_scale, num_splits) -> None:
    if isinstance(v_dim, bool) or not isinstance(v_dim, int) or not 0 < v_dim < d:
        raise CodesignError(f"v_dim (the latent's width) must be an int in [1, {d - 1}], got {v_dim!r}")
    check_positive_real("sm_scale", sm_scale)
    if num_splits is not None and (
        isinstance(num_splits, bool) or not isinstance(num_splits, int) or not 1 <= num_splits <= MAX_SPLITS
    ):
        raise CodesignError(f"num_splits must be an int in [1, {MAX_SPLITS}] or None, got {num_splits!r}")


def latent_decode_attention(
    q: torch.Tensor,
    latent_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    *,
    v_dim: int,
    sm_scale: float,
    kv_scale: float | None = None,
    num_splits: int | None = None,
    check_data: bool = True,
) -> torch.Tensor:
    """out[b, h] = sum_j softmax_j(sm_scale q[b, h] . c_j) c_j[:v_dim] over the context_lens[b] cached vectors c_j.

    sm_scale has no default: DeepSeek scales by 1 / sqrt(qk_nope_head_dim + qk_rope_head_dim) (192), not by the
    absorbed width. kv_scale: an e4m3 cache's scale (required for one, refused otherwise); bf16 queries over one are
    dotted in fp16, so their magnitudes must stay within fp16's range. A sequence of length 0 gets zeros.
    `check_data` runs the block-table checks and that range check (one host sync).
    """
    _check(q, latent_cache, block_tables, context_lens, v_dim, sm_scale, kv_scale, num_splits, check_data)
    return torch.ops.codesign.latent_decode_attention(
        q, latent_cache, block_tables, context_lens, v_dim, float(sm_scale), float(kv_scale or 1.0), num_splits or 0
    )


@torch.library.custom_op("codesign::latent_decode_attention", mutates_args=())
def _latent_op(
    q: torch.Tensor,
    cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    v_dim: int,
    sm_scale: float,
    kv_scale: float,
    num_splits: int,
) -> torch.Tensor:
    return latent_decode_body(q, cache, block_tables, context_lens, v_dim, sm_scale, kv_scale, num_splits)


def latent_decode_body(q, cache, block_tables, context_lens, v_dim: int, sm_scale: float, kv_scale: float,
                       num_splits: int) -> torch.Tensor:  # fmt: skip
    """The op's body, without torch's dispatcher or any check: for an eager caller repeating a geometry it passed
    through `latent_decode_attention` already (the layers after a forward's first). kv_scale 1.0 and num_splits 0
    for none."""
    if resolve_backend(OP, q.device) == "torch":
        return latent_attention_torch(q, cache, block_tables, context_lens, v_dim, sm_scale, kv_scale)
    if q.dtype == torch.bfloat16 and not device_view(q.device).compiled:
        raise CodesignError(
            "bf16 latent attention with the Triton backend needs a GPU (the interpreter mishandles bf16)"
        )
    return latent_attention_triton(q, cache, block_tables, context_lens, v_dim, sm_scale, kv_scale, num_splits or None)


@_latent_op.register_fake
def _(q, cache, block_tables, context_lens, v_dim, sm_scale, kv_scale, num_splits):
    return q.new_empty(q.shape[0], q.shape[1], v_dim)


def latent_attention_torch(
    q, cache, block_tables, context_lens, v_dim: int, sm_scale: float, kv_scale: float = 1.0
) -> torch.Tensor:
    """The torch path (and the kernel's reference at float64): each sequence's vectors gathered, one softmax."""
    b, h, _ = q.shape
    bs = cache.shape[1]
    out = q.new_zeros(b, h, v_dim)
    lens = context_lens.tolist()
    for i in range(b):
        n = lens[i]
        if n == 0:
            continue
        blocks = block_tables[i, : -(-n // bs)].long()
        acc = torch.float64 if q.dtype == torch.float64 else torch.float32
        c = cache.index_select(0, blocks).reshape(-1, cache.shape[2])[:n].to(acc) * kv_scale
        p = torch.softmax((q[i].to(acc) @ c.T) * sm_scale, dim=-1)
        out[i] = (p @ c[:, :v_dim]).to(q.dtype)
    return out


def _splits(q: torch.Tensor, num_splits: int | None, block_h: int) -> int:
    """Splits of each sequence: enough programs for two a streaming multiprocessor. Chosen without reading the
    lengths (no host sync: the call stays capturable in a CUDA graph); a short sequence's spare splits exit."""
    if num_splits is not None:
        return num_splits
    programs = q.shape[0] * -(-q.shape[1] // block_h)
    sms = device_view(q.device).sms or 1
    return max(1, min(MAX_SPLITS, -(-2 * sms // max(programs, 1))))


def latent_attention_triton(
    q, cache, block_tables, context_lens, v_dim: int, sm_scale: float, kv_scale: float, num_splits: int | None
) -> torch.Tensor:
    """Launch `_latent_decode_kernel` over (sequence, head block, split), then merge the splits (`reduce_splits`)."""
    from codesign.kernels.attention.triton_attention import reduce_splits
    from codesign.kernels.attention.triton_latent import _latent_decode_kernel

    b, h, d = q.shape
    rope = d - v_dim
    for name, w in (("v_dim", v_dim), ("rope width (channels past v_dim)", rope)):
        if w < 16 or w & (w - 1):
            raise CodesignError(f"the Triton kernel needs a power of two >= 16 for the {name}, got {w}")
    fp8 = cache.dtype == FP8
    block_h, block_n, warps = tiles(h, fp8, device_view(q.device).capability)
    splits = _splits(q, num_splits, block_h)
    part = torch.empty(b, h, splits, v_dim, device=q.device, dtype=torch.float32)
    lse2 = torch.empty(b, h, splits, device=q.device, dtype=torch.float32)
    out = torch.empty(b, h, v_dim, device=q.device, dtype=q.dtype)
    if b:
        grid = (b, -(-h // block_h), splits)
        _latent_decode_kernel[grid](
            q, cache.view(torch.uint8) if fp8 else cache, block_tables, context_lens, part, lse2,
            sm_scale * kv_scale * math.log2(math.e), kv_scale, h, splits,
            q.stride(0), q.stride(1), cache.stride(0), cache.stride(1), block_tables.stride(0),
            part.stride(0), part.stride(1), part.stride(2), lse2.stride(0), lse2.stride(1),
            LATENT=v_dim, ROPE=rope, BLOCK_SIZE=cache.shape[1], BLOCK_H=block_h, BLOCK_N=block_n, num_warps=warps,
            FP8=fp8, HW_FP8=device_view(q.device).hw_fp8, DOT_PREC="ieee" if q.dtype == torch.float32 else "tf32",
        )  # fmt: skip
        reduce_splits(part, lse2, out, None)
    return out


def latent_decode_spec(
    q: torch.Tensor, latent_cache: torch.Tensor, context_lens: torch.Tensor, v_dim: int
) -> PagedDecodeAttention:
    """The call's operator spec: what the dataflow graph's decode attention node of an MLA model holds."""
    return PagedDecodeAttention(
        q.shape[1], 1, q.shape[2], context_lens=tuple(int(n) for n in context_lens.tolist()),
        block_size=latent_cache.shape[1], kv_format=latent_kv_format(latent_cache), dtype=SPEC_DTYPES[q.dtype],
        v_head_dim=v_dim, latent_kv=True,
    )  # fmt: skip
