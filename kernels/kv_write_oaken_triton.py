"""Triton quantize-on-write for the Oaken paged cache (`kv_quant_oaken.OakenPagedKV`, both metadata
variants): the same online rule as the torch writer, bit for bit, including the order in which outliers
claim a block's slots and the overflow count.

Per token in slot order (-1 skips): a token at offset 0 starts its block afresh (slots -1, count 0); its
outliers (outside the offline [lo, hi]) are ranked farthest beyond the threshold first (ties: lower
position first) and the first `capacity - count` take slots, stored in position order from slot `count`
as (offset * D + d) << 16 | fp16 bits; the rest are counted in `overflow` and, for the "token" variant,
clamped into [lo, hi] (the "offline" variant keeps them dense). The dense codes follow
`kv_quant._asym` (fp16 scale and lower bound) or `kv_quant.offline_meta` (8-bit z, r on the grid) with
true division (div_rn) and round half to even, as the other writers.

One program per kv head (one launch for K, one for V) walks the tokens in order, because a token's free
slots depend on the earlier tokens of its block; per token it ranks the D elements with a D x D compare.
Fine for decode (one token per sequence); a long prefill is serial per head (a segmented prefix sum over
per-token outlier counts would parallelize it; not done). Needs head_dim a power of two (tl.arange).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from codesign.kernels.kv_write_triton import _rint


@triton.jit
def _oaken_write_kernel(
    x_ptr, stride_t, stride_h, slot_ptr, n_tokens, thr_ptr, grid_ptr,
    codes_ptr, meta_ptr, out_ptr, cnt_ptr, over_ptr,
    H: tl.constexpr, D: tl.constexpr, BS: tl.constexpr, BITS: tl.constexpr, CAP: tl.constexpr,
    CAP_PAD: tl.constexpr, OFFLINE: tl.constexpr,
):  # fmt: skip
    h = tl.program_id(0)
    d = tl.arange(0, D)
    c = tl.arange(0, CAP_PAD)
    PER: tl.constexpr = 8 // BITS
    W: tl.constexpr = D // PER
    QMAX: tl.constexpr = (2**BITS - 1) * 1.0
    lo = tl.load(thr_ptr + h * 2)
    hi = tl.load(thr_ptr + h * 2 + 1)
    over = tl.load(over_ptr + h)
    earlier = d[:, None] < d[None, :]  # [i, j]: position i before j
    for t in range(0, n_tokens):
        slot = tl.load(slot_ptr + t).to(tl.int64)
        if slot >= 0:
            blk = slot // BS
            off = slot % BS
            x = tl.load(x_ptr + t * stride_t + h * stride_h + d).to(tl.float32)
            cnt_p = cnt_ptr + blk * H + h
            row = out_ptr + (blk * H + h) * CAP
            if off == 0:  # a fresh block
                tl.store(row + c, tl.full([CAP_PAD], -1, tl.int32), mask=c < CAP)
                tl.store(cnt_p, 0)
            tl.debug_barrier()
            n0 = tl.load(cnt_p)
            beyond = tl.maximum(x - hi, lo - x)
            is_out = beyond > 0.0
            bi = beyond[:, None]
            bj = beyond[None, :]
            ahead = is_out[:, None] & ((bi > bj) | ((bi == bj) & earlier))
            rank = tl.sum(ahead.to(tl.int32), 0)  # outliers ranked before j: farthest first
            keep = is_out & (rank < CAP - n0)
            n_keep = tl.sum(keep.to(tl.int32), 0)
            over += tl.sum(is_out.to(tl.int32), 0) - n_keep
            idx = n0 + tl.sum((keep[:, None] & earlier).to(tl.int32), 0)  # slots in position order
            bits16 = x.to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
            word = (((off * D + d) << 16) | bits16).to(tl.int32)
            tl.store(row + idx, word, mask=keep)
            tl.store(cnt_p, n0 + n_keep)
            mrow = meta_ptr + ((blk * BS + off) * H + h) * 2
            if OFFLINE:
                base = tl.load(grid_ptr + h * 2)
                step = tl.load(grid_ptr + h * 2 + 1)
                xd = tl.minimum(tl.maximum(x, base), base + 255.0 * step)
                mn = tl.min(tl.where(keep, float("inf"), xd), 0)
                mx = tl.max(tl.where(keep, float("-inf"), xd), 0)
                mn = tl.where(n_keep == D, base, mn)
                mx = tl.where(n_keep == D, base, mx)
                z = tl.minimum(tl.maximum(tl.floor(tl.math.div_rn(mn - base, step)), 0.0), 255.0)
                r = tl.minimum(tl.maximum(tl.ceil(tl.math.div_rn(mx - base, step)), 0.0), 255.0) - z
                zero = base + z * step  # z * step is exact (step a power of two): no fma difference
                s32 = tl.math.div_rn(r * step, QMAX)
                tl.store(mrow, z.to(tl.uint8))
                tl.store(mrow + 1, r.to(tl.uint8))
            else:
                xd = tl.where(keep, x, tl.minimum(tl.maximum(x, lo), hi))
                mn = tl.min(tl.where(keep, float("inf"), xd), 0)
                mx = tl.max(tl.where(keep, float("-inf"), xd), 0)
                mn = tl.where(n_keep == D, 0.0, mn)
                mx = tl.where(n_keep == D, 0.0, mx)
                scale = tl.math.div_rn(mx - mn, QMAX).to(tl.float16)
                zero16 = mn.to(tl.float16)
                s32 = scale.to(tl.float32)
                zero = zero16.to(tl.float32)
                tl.store(mrow, scale)
                tl.store(mrow + 1, zero16)
            safe = tl.where(s32 > 0.0, s32, 1.0)
            q = _rint(tl.math.div_rn(xd - zero, safe))
            q = tl.minimum(tl.maximum(q, 0.0), QMAX)
            q = tl.where(keep, 0.0, tl.where(s32 > 0.0, q, 0.0)).to(tl.int32)
            q2 = tl.reshape(q, (W, PER))
            byte = tl.sum(q2 << (tl.arange(0, PER) * BITS)[None, :], 1)
            tl.store(codes_ptr + ((blk * BS + off) * H + h) * W + tl.arange(0, W), byte.to(tl.uint8))
            tl.debug_barrier()
    tl.store(over_ptr + h, over)


def triton_writer_supported(head_dim: int) -> bool:
    """head_dim a power of two (tl.arange and the packing reshape need it)."""
    return head_dim & (head_dim - 1) == 0


def oaken_write_triton(cache, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Quantize tokens `[n, kv_heads, D]` into the Oaken cache in slot order (validated by the caller)."""
    n = key.shape[0]
    if n == 0:
        return
    bs, h = cache.k_codes.shape[1:3]
    d = cache.head_dim
    cap = cache.capacity
    slots = slot_mapping.contiguous()
    for kv, (x, thr, codes, meta, out, cnt) in enumerate(
        (
            (key, cache.k_thresholds, cache.k_codes, cache.k_meta, cache.k_out, cache.k_count),
            (value, cache.v_thresholds, cache.v_codes, cache.v_meta, cache.v_out, cache.v_count),
        )
    ):
        grid = cache.grid[kv] if cache.grid is not None else thr
        over = cache.overflow[kv]  # a contiguous row: the kernel adds this launch's count to it
        _oaken_write_kernel[(h,)](
            x, x.stride(0), x.stride(1), slots, n, thr.contiguous(), grid.contiguous(),
            codes, meta, out, cnt, over,
            H=h, D=d, BS=bs, BITS=cache.bits, CAP=cap, CAP_PAD=triton.next_power_of_2(max(cap, 1)),
            OFFLINE=cache.grid is not None, num_warps=4 if d >= 64 else 1,
        )  # fmt: skip
