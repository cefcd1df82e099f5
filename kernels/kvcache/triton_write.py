"""Triton kernel writing new tokens' K and V into their paged-cache slots (vLLM's `reshape_and_cache`).

    k_cache[slot // block_size, slot % block_size, h, :] = key[t, h, :]   for slot = slot_mapping[t] >= 0

A slot of -1 skips the token (padding in a batch). KV_FORMAT is a constexpr (`kvcache.formats`), one launch
per layer for every format; the quantized ones (`codesign.kernels.kvcache.quantizers`) store codes, never fp16 copies:

  KV_FORMAT_INT: per token per head over head_dim, BITS in {8, 4, 2}, the engine's rule
      scale = fp16((max - min) / (2^b - 1)), zero = fp16(min), code = clamp(rint((x - zero) / scale)),
      codes packed (element k*i + j in bits [j*b, (j+1)*b) of byte i), (scale, zero) into meta
      `[num_blocks, block_size, kv_heads, 2]` fp16. True division (div_rn) and round half to even
      (the 1.5 * 2^23 trick) keep the codes bit-identical to the reference on GPUs too.
  KV_FORMAT_FP8: e4m3 codes of clamp(x / s_h, +-448) with per-head fp32 scales in meta
      `[kv_heads]`, rounded half to even by hand (the interpreter's fp8 cast rounds ties away).

num_warps is the one launch parameter (one program per token); it comes from `lookup_config` (table
ops `table_op(kv_format, bits)`, key (kv_heads, head_dim), M = tokens), default by row size.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from codesign.autotune.lookup import lookup_config, shape_key
from codesign.backend import device_view
from codesign.kernels.host_math import next_pow2
from codesign.kernels.kvcache.formats import KV_FORMAT_INT, KV_FORMAT_PLAIN, table_suffix

OP = "kv_write"
# Elements of K (and of V) a program writes at most: a token's heads split over programs past it (Llama-3-8B's 8 x
# 128 stay one program; DeepSeek's expanded 128 x 192 prefill takes 8).
HEAD_ELEMENTS = 4096
RINT_MAGIC = 12582912.0  # 1.5 * 2^23: (y + M) - M rounds |y| < 2^22 to the nearest even integer in fp32
_RINT_MAGIC = tl.constexpr(RINT_MAGIC)
_PLAIN = tl.constexpr(KV_FORMAT_PLAIN)
_INT = tl.constexpr(KV_FORMAT_INT)


@triton.jit
def rint_half_even(y):
    return (y + _RINT_MAGIC) - _RINT_MAGIC


@triton.jit
def _fp8_e4m3_code(y):
    """The e4m3fn byte (int32 0..255) of fp32 y, |y| <= 448, rounded half to even, built with integer ops
    (no fp8 conversion instruction: works on every GPU and in the interpreter, whose fp8 cast rounds
    ties away). Quantum 2^(e - 3) for binade e = max(floor(log2 |y|), -6) (-6: the subnormal range)."""
    a = tl.abs(y)
    e = tl.maximum(((a.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127, -6)
    inv_quantum = ((127 - (e - 3)) << 23).to(tl.float32, bitcast=True)
    quantum = ((e - 3 + 127) << 23).to(tl.float32, bitcast=True)
    r = tl.minimum(rint_half_even(a * inv_quantum) * quantum, 448.0)  # scaling by 2^k is exact
    rb = r.to(tl.int32, bitcast=True)
    re = ((rb >> 23) & 0xFF) - 127  # binade after rounding (it may have carried into the next one)
    normal = (((re + 7) << 3) | ((rb >> 20) & 7)) & 0x7F
    sub = (r * 512.0).to(tl.int32)  # |r| < 2^-6: r = m * 2^-9, m in 0..7
    mag = tl.where(r < 0.015625, sub, normal)
    return tl.where(y.to(tl.int32, bitcast=True) < 0, mag | 0x80, mag)  # the sign bit: -0.0 stays negative


@triton.jit
def _kv_write_kernel(
    key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_cb, stride_cs, stride_ch,
    stride_db, stride_ds, stride_dh,
    k_meta_ptr, v_meta_ptr, stride_mb, stride_ms, stride_mh,
    NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    HEADS_PAD: tl.constexpr, DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, KV_FORMAT: tl.constexpr, BITS: tl.constexpr = 16,
):  # fmt: skip
    # A program writes one token's HEADS_PAD heads from head program_id(1) * HEADS_PAD (the launcher splits a token
    # of many heads over programs, so that a program's K and V fit its registers).
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot < 0:
        return
    blk = slot // BLOCK_SIZE
    off = slot % BLOCK_SIZE
    hs = tl.program_id(1) * HEADS_PAD + tl.arange(0, HEADS_PAD)
    h = hs[:, None]
    d = tl.arange(0, DIM_PAD)[None, :]
    m = (h < NUM_HEADS) & (d < HEAD_DIM)
    k = tl.load(key_ptr + t * stride_kt + h * stride_kh + d, mask=m)
    v = tl.load(value_ptr + t * stride_vt + h * stride_vh + d, mask=m)
    # Each head's row of the slot, [HEADS_PAD, 1]: + d addresses elements, + i packed code bytes.
    kc = k_cache_ptr + blk * stride_cb + off * stride_cs + h * stride_ch
    vc = v_cache_ptr + blk * stride_db + off * stride_ds + h * stride_dh
    if KV_FORMAT == _PLAIN:
        tl.store(kc + d, k.to(k_cache_ptr.dtype.element_ty), mask=m)
        tl.store(vc + d, v.to(v_cache_ptr.dtype.element_ty), mask=m)
    elif KV_FORMAT == _INT:
        mrow = blk * stride_mb + off * stride_ms + hs * stride_mh
        _quant_int_store(k.to(tl.float32), m, kc, k_meta_ptr + mrow, hs < NUM_HEADS, HEAD_DIM, BITS)
        _quant_int_store(v.to(tl.float32), m, vc, v_meta_ptr + mrow, hs < NUM_HEADS, HEAD_DIM, BITS)
    else:
        ks = tl.load(k_meta_ptr + hs, mask=hs < NUM_HEADS, other=1.0)
        vs = tl.load(v_meta_ptr + hs, mask=hs < NUM_HEADS, other=1.0)
        kq = _fp8_e4m3_code(
            tl.minimum(tl.maximum(tl.math.div_rn(k.to(tl.float32), ks[:, None]), -448.0), 448.0)
        )
        vq = _fp8_e4m3_code(
            tl.minimum(tl.maximum(tl.math.div_rn(v.to(tl.float32), vs[:, None]), -448.0), 448.0)
        )
        tl.store(kc + d, kq.to(tl.uint8), mask=m)
        tl.store(vc + d, vq.to(tl.uint8), mask=m)


@triton.jit
def _quant_int_store(x, m, code_row_ptr, meta_ptr, h_ok, HEAD_DIM: tl.constexpr, BITS: tl.constexpr):
    """Quantize rows x [HEADS_PAD, DIM_PAD] (m: live elements, h_ok: live rows) per row; store packed codes and
    (scale, zero)."""
    HEADS_PAD: tl.constexpr = x.shape[0]
    DIM_PAD: tl.constexpr = x.shape[1]
    PER: tl.constexpr = 8 // BITS
    mn = tl.min(tl.where(m, x, float("inf")), 1)
    mx = tl.max(tl.where(m, x, float("-inf")), 1)
    mn = tl.where(h_ok, mn, 0.0)
    mx = tl.where(h_ok, mx, 0.0)
    scale = tl.math.div_rn(mx - mn, (2**BITS - 1) * 1.0).to(tl.float16)
    zero = mn.to(tl.float16)
    s32 = scale.to(tl.float32)
    safe = tl.where(s32 > 0.0, s32, 1.0)
    q = rint_half_even(tl.math.div_rn(x - zero.to(tl.float32)[:, None], safe[:, None]))
    q = tl.minimum(tl.maximum(q, 0.0), (2**BITS - 1) * 1.0)
    q = tl.where((s32 > 0.0)[:, None] & m, q, 0.0).to(tl.int32)
    # Pack PER codes per byte: element PER*i + j at bit j*BITS of byte i.
    q3 = tl.reshape(q, (HEADS_PAD, DIM_PAD // PER, PER))
    sh = tl.arange(0, PER) * BITS
    byte = tl.sum(q3 << sh[None, None, :], 2)
    hh = tl.arange(0, HEADS_PAD)[:, None]
    i = tl.arange(0, DIM_PAD // PER)[None, :]
    # code_row_ptr is [HEADS_PAD, 1] (one row per head); byte i of a head row at offset i.
    tl.store(code_row_ptr + i, byte.to(tl.uint8), mask=(hh >= 0) & h_ok[:, None] & (i < HEAD_DIM // PER))
    tl.store(meta_ptr, scale, mask=h_ok)
    tl.store(meta_ptr + 1, zero, mask=h_ok)


def kv_write_triton(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_meta: torch.Tensor | None = None,
    v_meta: torch.Tensor | None = None,
    kv_format: int = KV_FORMAT_PLAIN,
    bits: int = 16,
) -> None:
    """Launch the writer; inputs are already validated (`kvcache.write.kv_write`, `kvcache.kvq.kvq_write`).

    Quantized formats: k_cache/v_cache are the uint8 code tensors, k_meta/v_meta the (contiguous)
    scale arrays (see the module docstring)."""
    t, h, d = key.shape
    if t == 0:
        return
    if kv_format == KV_FORMAT_INT:
        ms = (k_meta.stride(0), k_meta.stride(1), k_meta.stride(2))
    else:
        ms = (0, 0, 0)
    if k_meta is None:
        k_meta = v_meta = slot_mapping  # unused
    cfg = launch_config(kv_format, bits, t, h, d, key.device)
    heads_pad = min(next_pow2(h), max(1, HEAD_ELEMENTS // next_pow2(d)))
    _kv_write_kernel[(t, -(-h // heads_pad))](
        key, value, k_cache, v_cache, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        k_meta, v_meta, *ms,
        NUM_HEADS=h, HEAD_DIM=d,
        HEADS_PAD=heads_pad, DIM_PAD=next_pow2(d),
        BLOCK_SIZE=k_cache.shape[1], KV_FORMAT=kv_format, BITS=bits,
        num_warps=int(cfg["num_warps"]),
    )  # fmt: skip


def table_op(kv_format: int, bits: int) -> str:
    """The writer's tuned-table name for a cache format: "kv_write", "kv_write_int<bits>" or "kv_write_fp8"."""
    suffix = table_suffix(kv_format, bits)
    return OP if suffix is None else f"{OP}_{suffix}"


def table_key(heads: int, head_dim: int) -> str:
    """The writer tables' shape key (M: the tokens written)."""
    return shape_key(kv_heads=heads, head_dim=head_dim)


def launch_config(
    kv_format: int, bits: int, tokens: int, heads: int, head_dim: int, device: torch.device
) -> dict:
    """num_warps for writing `tokens` tokens of [heads, head_dim]: the tuned table (M = tokens, key (kv_heads,
    head_dim)) on a GPU, else the default: 4 warps for rows of >= 2048 elements, 1 below (one program per
    token; a small row leaves extra warps idle)."""
    default = {"num_warps": 4 if heads * head_dim >= 2048 else 1}
    gpu = device_view(device).gpu_name
    return lookup_config(table_op(kv_format, bits), gpu, tokens, table_key(heads, head_dim), default)
