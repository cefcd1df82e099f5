"""Triton kernel of the latent cache's writer (`latent.latent_write`): one program a token copies its latent and its
rotary key into its slot, one after the other, or stores their e4m3 codes of x / kv_scale (rounded half to even
by integer ops, `triton_write._fp8_e4m3_code`, so every GPU and the interpreter write the same bytes)."""

from __future__ import annotations

import triton
import triton.language as tl

from codesign.kernels.kvcache.triton_write import _fp8_e4m3_code


@triton.jit
def _store_part(src_ptr, dst_ptr, n, scale, N: tl.constexpr, FP8: tl.constexpr):
    cols = tl.arange(0, N)
    ok = cols < n
    x = tl.load(src_ptr + cols, mask=ok, other=0.0)
    if FP8:
        y = tl.minimum(tl.maximum(tl.math.div_rn(x.to(tl.float32), scale), -448.0), 448.0)  # torch's x / s
        tl.store(dst_ptr + cols, _fp8_e4m3_code(y).to(tl.uint8), mask=ok)
    else:
        tl.store(dst_ptr + cols, x, mask=ok)


@triton.jit
def _latent_write_kernel(
    kv_c_ptr, k_pe_ptr, cache_ptr, slot_ptr, scale,
    latent, rope, stride_ct, stride_pt, stride_cb, stride_cs,
    BLOCK_SIZE: tl.constexpr, LATENT_PAD: tl.constexpr, ROPE_PAD: tl.constexpr, FP8: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot >= 0:  # -1: a padding token, not written
        row = cache_ptr + (slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_cs
        _store_part(kv_c_ptr + t * stride_ct, row, latent, scale, LATENT_PAD, FP8)
        _store_part(k_pe_ptr + t * stride_pt, row + latent, rope, scale, ROPE_PAD, FP8)
