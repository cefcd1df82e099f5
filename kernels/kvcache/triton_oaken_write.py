"""Triton quantize-on-write for the Oaken paged cache (`kvcache.oaken.OakenPagedKV`, both metadata
variants): the same online rule as the torch writer, bit for bit, including the order in which outliers
claim a block's slots and the overflow count, parallel over (token, kv head, K/V).

The serial rule (the torch writer), per token in slot order (-1 skips): a token at offset 0 starts its
block afresh (slots -1, count 0); its outliers (outside the offline [lo, hi]) are ranked farthest beyond
the threshold first (ties: lower position first) and the first `capacity - count` take slots, stored in
position order from slot `count` as (offset * D + d) << 16 | fp16 bits; the rest are counted in `overflow`
and, for the "token" variant, clamped into [lo, hi] (the "offline" variant keeps them dense). The dense
codes follow `quantizers._asym` (fp16 scale and lower bound) or `quantizers.offline_meta` (8-bit z, r on the
grid) with true division (div_rn) and round half to even, as the other writers.

Why it parallelizes: with n_out(u) a token's outlier count, a block's count evolves as
count <- min(CAP, count + n_out(u)), and min(CAP, min(CAP, a + b) + c) = min(CAP, a + b + c) for b, c >= 0,
so the count a token t finds is n0(t) = min(CAP, start + sum of n_out(u) over the earlier tokens u of its
block in this call since its reset), start = 0 after a reset in this call, else the stored count. (A
stored count above CAP, which the torch writer leaves unchanged, stays: n0 = max(start, ...); a negative
one, only from a corrupt cache, is not mirrored, but no store leaves its row.) Slots are unique (the
caller checks), so a block has at most `block_size` tokens and at most one reset per call.

Three steps, no host sync, launch count independent of the number of tokens:
1. `_oaken_count_kernel`, grid (tokens, heads, K/V): n_out and the stored count of the token's block
   (read before anything is written), and the token's block as a sort key (skips last).
2. `torch.sort(stable=True)` of the keys: each block's tokens become one run, in call order.
3. `_oaken_write_kernel`, grid (tokens, heads, K/V), program p on the p-th sorted token: a window of
   2 * block_size sorted neighbours holds its whole run, from which it sums n0 (segmented prefix sum),
   finds the reset and whether it is the run's last token. Then the serial per-token body: codes, meta,
   outlier words at n0 + rank. Tokens written before their block's reset in call order (a revisited
   block) keep their codes but not their words (the reset wiped them in the serial walk); the run's last
   token writes the block's count and, for a reset block, -1 into the slots past it (the slots below are
   all rewritten by the tokens since the reset). Overflow: one integer atomic add per (token, head).
Every store goes to a place no other program writes. Needs head_dim a power of two (tl.arange). The written
tensors' version counters are bumped as a torch op's would be, and the caller (`OakenPagedKV.write`) rebuilds the
written blocks' rows of the kept outlier index, as for the torch writer.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch.autograd.graph import increment_version

from codesign.kernels.host_math import next_pow2
from codesign.kernels.kvcache.triton_write import rint_half_even

_SKIP_KEY = tl.constexpr(2**31 - 1)  # sort key of a skipped token (slot -1): after every block


@triton.jit
def _oaken_count_kernel(
    k_ptr, k_st, k_sh, v_ptr, v_st, v_sh, slot_ptr, n_tokens, k_thr_ptr, v_thr_ptr, k_cnt_ptr, v_cnt_ptr,
    key_ptr, scratch_ptr, H: tl.constexpr, D: tl.constexpr, BS: tl.constexpr,
):  # fmt: skip
    """scratch `[2, n, 2 (K, V), H]` int32 = (n_out, stored count of the block); key[t] = block or skip."""
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    kv = tl.program_id(2)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    valid = slot >= 0
    blk = tl.where(valid, slot // BS, 0)
    # Pick K or V by pointer (one body: nested jit calls cost ms each in the interpreter).
    if kv == 0:
        x_ptr = k_ptr + t * k_st + h * k_sh
        thr_ptr = k_thr_ptr + h * 2
        cnt_ptr = k_cnt_ptr + blk * H + h
    else:
        x_ptr = v_ptr + t * v_st + h * v_sh
        thr_ptr = v_thr_ptr + h * 2
        cnt_ptr = v_cnt_ptr + blk * H + h
    x = tl.load(x_ptr + tl.arange(0, D)).to(tl.float32)
    lo = tl.load(thr_ptr)
    hi = tl.load(thr_ptr + 1)
    beyond = tl.maximum(x - hi, lo - x)  # the write kernel's outlier test, the same expression
    n_out = tl.sum((beyond > 0.0).to(tl.int32), 0)
    tl.store(scratch_ptr + (t * 2 + kv) * H + h, tl.where(valid, n_out, 0))
    tl.store(scratch_ptr + ((n_tokens + t) * 2 + kv) * H + h, tl.load(cnt_ptr, mask=valid, other=0))
    tl.store(key_ptr + t, tl.where(valid, blk, _SKIP_KEY).to(tl.int32), mask=(h == 0) & (kv == 0))


# Allow-listed (pyproject.toml): a Triton kernel is one program; jit helpers change inlining and registers.
@triton.jit
def _oaken_write_kernel(  # noqa: C901, PLR0915
    k_ptr, k_st, k_sh, v_ptr, v_st, v_sh, slot_ptr, perm_ptr, n_tokens, scratch_ptr, k_thr_ptr, v_thr_ptr,
    grid_ptr, k_codes_ptr, v_codes_ptr, k_meta_ptr, v_meta_ptr, k_out_ptr, v_out_ptr, k_cnt_ptr, v_cnt_ptr,
    over_ptr, H: tl.constexpr, D: tl.constexpr, BS: tl.constexpr, BS_PAD: tl.constexpr, BITS: tl.constexpr,
    CAP: tl.constexpr, CAP_PAD: tl.constexpr, OFFLINE: tl.constexpr,
):  # fmt: skip
    """Program (p, h, kv): the p-th token in block-sorted order (perm), module docstring step 3."""
    p = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    kv = tl.program_id(2)
    t = tl.load(perm_ptr + p)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot >= 0:
        blk = slot // BS
        off = slot % BS
        # --- n0: the segmented prefix sum over p's run (within block_size places of p) ---
        j = p - (BS_PAD - 1) + tl.arange(0, 2 * BS_PAD)
        inw = (j >= 0) & (j < n_tokens)
        tj = tl.load(perm_ptr + j, mask=inw, other=0)
        sj = tl.load(slot_ptr + tj, mask=inw, other=-1).to(tl.int64)
        same = inw & (sj >= 0) & (sj // BS == blk)
        nj = tl.load(scratch_ptr + (tj * 2 + kv) * H + h, mask=same, other=0)
        rs = tl.max(tl.where(same & (sj % BS == 0), j, -1), 0)  # the block's reset token, -1: none
        after_reset = (rs >= 0) & (rs <= p)
        seg = same & (j < p) & (j >= tl.where(after_reset, rs, 0))
        excl = tl.sum(tl.where(seg, nj, 0), 0)  # outliers of the block's tokens before p since the reset
        start = tl.where(after_reset, 0, tl.load(scratch_ptr + ((n_tokens + t) * 2 + kv) * H + h))
        n0 = tl.where(start >= CAP, start, tl.minimum(start + excl, CAP))
        live = (rs < 0) | (rs <= p)  # words of a token before its block's reset would be wiped by it
        t_next = tl.load(perm_ptr + p + 1, mask=p + 1 < n_tokens, other=0)
        s_next = tl.load(slot_ptr + t_next, mask=p + 1 < n_tokens, other=-1).to(tl.int64)
        last = (s_next < 0) | (s_next // BS != blk)  # the run's last token: writes the block's count
        fill = last & (rs >= 0)  # ... and clears the slots past it if the block was reset
        n_out = tl.load(scratch_ptr + (t * 2 + kv) * H + h)
        n_keep = tl.minimum(n_out, tl.maximum(CAP - n0, 0))
        tl.atomic_add(over_ptr + kv * H + h, (n_out - n_keep).to(tl.int64), mask=n_out > n_keep)
        # --- the serial writer's per-token body, K or V picked by pointer ---
        if kv == 0:
            x_ptr = k_ptr + t * k_st + h * k_sh
            thr_ptr = k_thr_ptr + h * 2
            codes_ptr = k_codes_ptr
            meta_ptr = k_meta_ptr
            out_ptr = k_out_ptr
            cnt_ptr = k_cnt_ptr
        else:
            x_ptr = v_ptr + t * v_st + h * v_sh
            thr_ptr = v_thr_ptr + h * 2
            codes_ptr = v_codes_ptr
            meta_ptr = v_meta_ptr
            out_ptr = v_out_ptr
            cnt_ptr = v_cnt_ptr
        d = tl.arange(0, D)
        c = tl.arange(0, CAP_PAD)
        PER: tl.constexpr = 8 // BITS
        W: tl.constexpr = D // PER
        QMAX: tl.constexpr = (2**BITS - 1) * 1.0
        lo = tl.load(thr_ptr)
        hi = tl.load(thr_ptr + 1)
        x = tl.load(x_ptr + d).to(tl.float32)
        row = out_ptr + (blk * H + h) * CAP
        earlier = d[:, None] < d[None, :]  # [i, j]: position i before j
        beyond = tl.maximum(x - hi, lo - x)  # the count kernel's outlier test, the same expression
        is_out = beyond > 0.0
        bi = beyond[:, None]
        bj = beyond[None, :]
        ahead = is_out[:, None] & ((bi > bj) | ((bi == bj) & earlier))
        rank = tl.sum(ahead.to(tl.int32), 0)  # outliers ranked before j: farthest first
        keep = is_out & (rank < CAP - n0)
        idx = n0 + tl.sum((keep[:, None] & earlier).to(tl.int32), 0)  # slots in position order
        bits16 = x.to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
        word = (((off * D + d) << 16) | bits16).to(tl.int32)
        # Scalar flags enter vector masks as bounds: the interpreter mistypes vector & scalar-bool.
        # idx >= 0 only matters for a corrupt stored count (< 0): never write outside the row.
        tl.store(row + idx, word, mask=keep & (idx >= 0) & (idx < tl.where(live, CAP, 0)))
        n1 = n0 + n_keep
        tl.store(cnt_ptr + blk * H + h, n1, mask=last)
        tl.store(row + c, tl.full([CAP_PAD], -1, tl.int32), mask=(c >= n1) & (c < tl.where(fill, CAP, 0)))
        mrow = meta_ptr + ((blk * BS + off) * H + h) * 2
        if OFFLINE:
            base = tl.load(grid_ptr + (kv * H + h) * 2)
            step = tl.load(grid_ptr + (kv * H + h) * 2 + 1)
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
        q = rint_half_even(tl.math.div_rn(xd - zero, safe))
        q = tl.minimum(tl.maximum(q, 0.0), QMAX)
        q = tl.where(keep, 0.0, tl.where(s32 > 0.0, q, 0.0)).to(tl.int32)
        q2 = tl.reshape(q, (W, PER))
        byte = tl.sum(q2 << (tl.arange(0, PER) * BITS)[None, :], 1)
        tl.store(codes_ptr + ((blk * BS + off) * H + h) * W + tl.arange(0, W), byte.to(tl.uint8))


def triton_writer_supported(head_dim: int) -> bool:
    """head_dim a power of two (tl.arange and the packing reshape need it)."""
    return head_dim & (head_dim - 1) == 0


def oaken_write_triton(cache, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Quantize tokens `[n, kv_heads, D]` into the Oaken cache as if written one by one in slot order
    (validated by the caller: shapes, devices, finite data, slots in range and unique). Two launches and
    one sort on the device, no host sync (module docstring)."""
    n = key.shape[0]
    if n == 0:
        return
    bs, h = cache.k_codes.shape[1:3]
    d = cache.head_dim
    cap = cache.capacity
    dev = key.device
    slots = slot_mapping.contiguous()
    k_thr, v_thr = cache.k_thresholds.contiguous(), cache.v_thresholds.contiguous()
    sort_key = torch.empty(n, dtype=torch.int32, device=dev)
    scratch = torch.empty(2, n, 2, h, dtype=torch.int32, device=dev)
    warps = 4 if d >= 64 else 1
    _oaken_count_kernel[(n, h, 2)](
        key, key.stride(0), key.stride(1), value, value.stride(0), value.stride(1), slots, n, k_thr, v_thr,
        cache.k_count, cache.v_count, sort_key, scratch, H=h, D=d, BS=bs, num_warps=warps,
    )  # fmt: skip
    perm = torch.sort(sort_key, stable=True).indices
    grid = cache.grid if cache.grid is not None else k_thr  # unused by the "token" variant
    _oaken_write_kernel[(n, h, 2)](
        key, key.stride(0), key.stride(1), value, value.stride(0), value.stride(1), slots, perm, n, scratch,
        k_thr, v_thr, grid, cache.k_codes, cache.v_codes, cache.k_meta, cache.v_meta, cache.k_out,
        cache.v_out, cache.k_count, cache.v_count, cache.overflow,
        H=h, D=d, BS=bs, BS_PAD=next_pow2(bs), BITS=cache.bits, CAP=cap,
        CAP_PAD=next_pow2(max(cap, 1)), OFFLINE=cache.grid is not None, num_warps=warps,
    )  # fmt: skip
    # Written through pointers: bump the version counters torch would have (the kept index's validity rule).
    increment_version([cache.k_codes, cache.v_codes, cache.k_meta, cache.v_meta, cache.k_out, cache.v_out,
                       cache.k_count, cache.v_count, cache.overflow])  # fmt: skip
