"""Multi-head latent attention decode over a paged latent cache (DeepSeek-V2/V3): `latent_decode_attention`.

The cache holds one vector a token, `[num_blocks, block_size, latent + rope]` (vLLM's and FlashMLA's layout: the
kv_lora_rank-wide latent, then the rotary key); q is the absorbed query, `[batch, heads, latent + rope]` (each
head's non-rotary query taken through W_UK into the latent space, then its rotary part). Keys are the whole
vector, values its first `v_dim` = latent channels, so out is `[batch, heads, latent]`, still in the latent space
(W_UV takes it to the value heads). Its cost model is the dataflow graph's decode attention node
(`latent_decode_spec`: `PagedDecodeAttention(latent_kv=True)`). CUDA tensors run the Triton kernel
(`triton_latent`), CPU tensors the torch path; `codesign.backend.use_backend("triton")` forces the kernel (the
interpreter on CPU). Every check runs before anything launches.
"""

from __future__ import annotations

import math

import torch

from codesign.backend import device_view, resolve_backend
from codesign.kernels.attention.options import MAX_SPLITS
from codesign.kernels.kvcache.checks import MAX_BLOCK_SIZE, check_block_tables, check_int_tensor, has_data
from codesign.specs import CodesignError, KVFormat, PagedDecodeAttention

OP = "paged_attention"  # the backend choice's op name, shared with every attention op
DTYPES = (torch.float16, torch.bfloat16, torch.float32)
BLOCK_H = 16  # query heads a program (the dot's M; more heads take more programs)
BLOCK_N = 32  # cached tokens a tile


def _check(q, cache, block_tables, context_lens, v_dim, sm_scale, num_splits, check_data) -> None:
    b, nb, bs, d = _check_tensors(q, cache)
    _check_scalars(d, v_dim, sm_scale, num_splits)
    check_int_tensor("block_tables", block_tables, 2, cache.device)
    check_int_tensor("context_lens", context_lens, 1, cache.device)
    if block_tables.shape[0] != b:
        raise CodesignError(f"block_tables has {block_tables.shape[0]} rows for a batch of {b}")
    if check_data and has_data(q, block_tables, context_lens):
        check_block_tables(block_tables, context_lens, nb, bs)


def _check_tensors(q, cache) -> tuple[int, int, int, int]:
    """q and the cache: shapes, dtypes, devices; (batch, num_blocks, block_size, channels)."""
    if not isinstance(q, torch.Tensor) or q.dim() != 3:
        raise CodesignError("q must be a 3-D tensor [batch, heads, latent + rope]")
    if not isinstance(cache, torch.Tensor) or cache.dim() != 3:
        raise CodesignError("latent_cache must be a 3-D tensor [num_blocks, block_size, latent + rope]")
    for name, t in (("q", q), ("latent_cache", cache)):
        if t.dtype not in DTYPES:
            raise CodesignError(f"{name} dtype must be one of {DTYPES}, got {t.dtype}")
        if t.stride(-1) != 1:
            raise CodesignError(f"{name} must be contiguous along its last dimension")
    if q.dtype != cache.dtype:
        raise CodesignError(f"latent_cache dtype {cache.dtype} != q dtype {q.dtype}")
    if q.device != cache.device:
        raise CodesignError(f"latent_cache is on {cache.device} but q is on {q.device}")
    b, h, d = q.shape
    nb, bs, dc = cache.shape
    if dc != d:
        raise CodesignError(f"latent_cache's last dimension {dc} != q's {d} (latent + rope)")
    if h < 1 or d < 1:
        raise CodesignError(f"q must have heads and channels, got shape {tuple(q.shape)}")
    if not (1 <= bs <= MAX_BLOCK_SIZE):
        raise CodesignError(f"block_size (latent_cache.shape[1]) must be in [1, {MAX_BLOCK_SIZE}], got {bs}")
    return b, nb, bs, d


def _check_scalars(d: int, v_dim, sm_scale, num_splits) -> None:
    if isinstance(v_dim, bool) or not isinstance(v_dim, int) or not 0 < v_dim < d:
        raise CodesignError(f"v_dim (the latent's width) must be an int in [1, {d - 1}], got {v_dim!r}")
    if isinstance(sm_scale, bool) or not isinstance(sm_scale, int | float) or not (
        math.isfinite(sm_scale) and sm_scale > 0
    ):
        raise CodesignError(f"sm_scale must be a positive finite number, got {sm_scale!r}")
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
    num_splits: int | None = None,
    check_data: bool = True,
) -> torch.Tensor:
    """out[b, h] = sum_j softmax_j(sm_scale q[b, h] . c_j) c_j[:v_dim] over the context_lens[b] cached vectors c_j.

    sm_scale has no default: DeepSeek scales by 1 / sqrt(qk_nope_head_dim + qk_rope_head_dim) (192), not by the
    absorbed width. A sequence of length 0 gets zeros. `check_data` runs the block-table checks (one host sync).
    """
    _check(q, latent_cache, block_tables, context_lens, v_dim, sm_scale, num_splits, check_data)
    return torch.ops.codesign.latent_decode_attention(
        q, latent_cache, block_tables, context_lens, v_dim, float(sm_scale), num_splits or 0
    )


@torch.library.custom_op("codesign::latent_decode_attention", mutates_args=())
def _latent_op(
    q: torch.Tensor,
    cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    v_dim: int,
    sm_scale: float,
    num_splits: int,
) -> torch.Tensor:
    if resolve_backend(OP, q.device) == "torch":
        return latent_attention_torch(q, cache, block_tables, context_lens, v_dim, sm_scale)
    if q.dtype == torch.bfloat16 and not device_view(q.device).compiled:
        raise CodesignError(
            "bf16 latent attention with the Triton backend needs a GPU (the interpreter mishandles bf16)"
        )
    return latent_attention_triton(q, cache, block_tables, context_lens, v_dim, sm_scale, num_splits or None)


@_latent_op.register_fake
def _(q, cache, block_tables, context_lens, v_dim, sm_scale, num_splits):
    return q.new_empty(q.shape[0], q.shape[1], v_dim)


def latent_attention_torch(q, cache, block_tables, context_lens, v_dim: int, sm_scale: float) -> torch.Tensor:
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
        c = cache.index_select(0, blocks).reshape(-1, cache.shape[2])[:n]
        acc = torch.float64 if q.dtype == torch.float64 else torch.float32
        p = torch.softmax((q[i].to(acc) @ c.to(acc).T) * sm_scale, dim=-1)
        out[i] = (p @ c[:, :v_dim].to(acc)).to(q.dtype)
    return out


def _splits(q: torch.Tensor, num_splits: int | None) -> int:
    """Splits of each sequence: enough programs for two a streaming multiprocessor. Chosen without reading the
    lengths (no host sync: the call stays capturable in a CUDA graph); a short sequence's spare splits exit."""
    if num_splits is not None:
        return num_splits
    programs = q.shape[0] * -(-q.shape[1] // BLOCK_H)
    sms = device_view(q.device).sms or 1
    return max(1, min(MAX_SPLITS, -(-2 * sms // max(programs, 1))))


def latent_attention_triton(
    q, cache, block_tables, context_lens, v_dim: int, sm_scale: float, num_splits: int | None
) -> torch.Tensor:
    """Launch `_latent_decode_kernel` over (sequence, head block, split), then merge the splits."""
    from codesign.kernels.attention.triton_latent import _latent_decode_kernel

    b, h, d = q.shape
    rope = d - v_dim
    for name, w in (("v_dim", v_dim), ("rope width (channels past v_dim)", rope)):
        if w < 16 or w & (w - 1):
            raise CodesignError(f"the Triton kernel needs a power of two >= 16 for the {name}, got {w}")
    splits = _splits(q, num_splits)
    out = torch.empty(b, h, splits, v_dim, device=q.device, dtype=torch.float32)
    lse = torch.empty(b, h, splits, device=q.device, dtype=torch.float32)
    if b:
        grid = (b, -(-h // BLOCK_H), splits)
        _latent_decode_kernel[grid](
            q, cache, block_tables, context_lens, out, lse, sm_scale * math.log2(math.e), h, splits,
            q.stride(0), q.stride(1), cache.stride(0), cache.stride(1), block_tables.stride(0),
            out.stride(0), out.stride(1), out.stride(2), lse.stride(0), lse.stride(1),
            LATENT=v_dim, ROPE=rope, BLOCK_SIZE=cache.shape[1], BLOCK_H=BLOCK_H, BLOCK_N=BLOCK_N,
        )  # fmt: skip
    return merge_splits(out, lse).to(q.dtype)


def merge_splits(out: torch.Tensor, lse2: torch.Tensor) -> torch.Tensor:
    """Each split's normalised output weighted by its share of the softmax: out `[b, h, s, d]`, lse2 (base 2)
    `[b, h, s]`; a sequence with no tokens (every lse2 -inf) gives zeros."""
    top = lse2.amax(dim=2, keepdim=True)
    w = torch.exp2(lse2 - torch.where(torch.isinf(top), 0.0, top))
    total = w.sum(dim=2, keepdim=True)
    w = w / torch.where(total == 0, 1.0, total)
    return (w.unsqueeze(-1) * out).sum(dim=2)


def latent_decode_spec(
    q: torch.Tensor, latent_cache: torch.Tensor, context_lens: torch.Tensor, v_dim: int
) -> PagedDecodeAttention:
    """The call's operator spec: what the dataflow graph's decode attention node of an MLA model holds."""
    dtype = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}[latent_cache.dtype]
    return PagedDecodeAttention(
        q.shape[1], 1, q.shape[2], context_lens=tuple(int(n) for n in context_lens.tolist()),
        block_size=latent_cache.shape[1], kv_format=KVFormat(dtype=dtype), dtype=dtype, v_head_dim=v_dim,
        latent_kv=True,
    )  # fmt: skip
