"""Triton kernel writing new tokens' K and V into their paged-cache slots (vLLM's `reshape_and_cache`).

    k_cache[slot // block_size, slot % block_size, h, :] = key[t, h, :]   for slot = slot_mapping[t] >= 0

A slot of -1 skips the token (padding in a batch). KV_FORMAT is a constexpr so the quantizing
writers (KV-quantization issue) add their branch here and keep one launch per layer.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

KV_FORMAT_PLAIN = 0  # fp16/bf16/fp32 cache, stored as is


@triton.jit
def _kv_write_kernel(
    key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_cb, stride_cs, stride_ch,
    stride_db, stride_ds, stride_dh,
    NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    HEADS_PAD: tl.constexpr, DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, KV_FORMAT: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot < 0:
        return
    blk = slot // BLOCK_SIZE
    off = slot % BLOCK_SIZE
    h = tl.arange(0, HEADS_PAD)[:, None]
    d = tl.arange(0, DIM_PAD)[None, :]
    m = (h < NUM_HEADS) & (d < HEAD_DIM)
    k = tl.load(key_ptr + t * stride_kt + h * stride_kh + d, mask=m)
    v = tl.load(value_ptr + t * stride_vt + h * stride_vh + d, mask=m)
    if KV_FORMAT == 0:
        kc = k_cache_ptr + blk * stride_cb + off * stride_cs + h * stride_ch + d
        vc = v_cache_ptr + blk * stride_db + off * stride_ds + h * stride_dh + d
        tl.store(kc, k.to(k_cache_ptr.dtype.element_ty), mask=m)
        tl.store(vc, v.to(v_cache_ptr.dtype.element_ty), mask=m)


def kv_write_triton(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Launch the writer; inputs are already validated by `codesign.kernels.kv_write.kv_write`."""
    t, h, d = key.shape
    if t == 0:
        return
    _kv_write_kernel[(t,)](
        key, value, k_cache, v_cache, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        NUM_HEADS=h, HEAD_DIM=d,
        HEADS_PAD=triton.next_power_of_2(h), DIM_PAD=triton.next_power_of_2(d),
        BLOCK_SIZE=k_cache.shape[1], KV_FORMAT=KV_FORMAT_PLAIN,
        num_warps=4 if h * d >= 2048 else 1,
    )  # fmt: skip
