"""Triton KIVI group flush: quantize whole groups of G tokens straight into the paged codes (one program per
group and kv head): keys per channel over the G tokens, values per token over GV-element groups, with the
engine's rule (div_rn, round half to even, fp16 scale/zero first), so the codes equal the torch writer's.

    pending `[P, kv_heads, D]` fp32, fp16 (or bf16 on a GPU); group i's token t is pending row
    base_i + (first_i + t) % ring, and the group lands at slot slot_i (= block * block_size + offset,
    offset % G == 0; a slot of -1 skips the group). `KiviPagedKV.append_rows` passes the residual rings
    themselves (base: the sequence's ring, ring G + R), whose rows already hold the new tokens, or, for a forward
    longer than a ring holds, each row's unflushed ring tokens and new tokens staged together (base 0, ring P: no
    wrap); `append_step` (a decode step deciding on the device) one group a row, -1 where the row flushes none.

Needs G, GV and D powers of two (tl.arange / reshape); `KiviPagedKV.append` falls back to torch otherwise.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from codesign.kernels.kvcache.host_ints import device_ints
from codesign.kernels.kvcache.triton_write import rint_half_even


@triton.jit
def _asym(x, m, mn, mx, BITS: tl.constexpr):
    """Codes (int32) of x given broadcastable min/max; returns (codes, scale fp16, zero fp16)."""
    qmax = (2**BITS - 1) * 1.0
    scale = tl.math.div_rn(mx - mn, qmax).to(tl.float16)
    zero = mn.to(tl.float16)
    s32 = scale.to(tl.float32)
    safe = tl.where(s32 > 0.0, s32, 1.0)
    q = rint_half_even(tl.math.div_rn(x - zero.to(tl.float32), safe))
    q = tl.minimum(tl.maximum(q, 0.0), qmax)
    return tl.where((s32 > 0.0) & m, q, 0.0).to(tl.int32), scale, zero


@triton.jit
def _pack(q, ROWS: tl.constexpr, D: tl.constexpr, BITS: tl.constexpr):
    """[ROWS, D] codes -> [ROWS, D * BITS / 8] bytes, element PER*i + j at bit j*BITS of byte i."""
    PER: tl.constexpr = 8 // BITS
    q3 = tl.reshape(q, (ROWS, D // PER, PER))
    return tl.sum(q3 << (tl.arange(0, PER) * BITS)[None, None, :], 2).to(tl.uint8)


@triton.jit
def _kivi_flush_kernel(
    pk_ptr, pv_ptr, groups_ptr, kc_ptr, vc_ptr, km_ptr, vm_ptr,
    stride_pt, stride_ph, ring,
    H: tl.constexpr, D: tl.constexpr, G: tl.constexpr, GV: tl.constexpr, BS: tl.constexpr, BITS: tl.constexpr,
):  # fmt: skip
    g = tl.program_id(0)
    h = tl.program_id(1)
    base = tl.load(groups_ptr + 3 * g)  # int64 (base, first, slot) a group
    first = tl.load(groups_ptr + 3 * g + 1)
    slot0 = tl.load(groups_ptr + 3 * g + 2)
    t = tl.arange(0, G)
    d = tl.arange(0, D)
    m = (t[:, None] >= 0) & (d[None, :] >= 0)
    src = (base + (first + t) % ring)[:, None] * stride_pt + h * stride_ph + d[None, :]
    W: tl.constexpr = D * BITS // 8
    i = tl.arange(0, W)
    gi = tl.arange(0, D // GV)
    # every store masked by slot0 >= 0 (a group decided on the device may be none), as a tile of each store's shape
    ok_codes = (slot0 + 0 * t[:, None] + 0 * i[None, :]) >= 0
    ok_keys = (slot0 + 0 * d) >= 0
    ok_vmeta = (slot0 + 0 * t[:, None] + 0 * gi[None, :]) >= 0
    # keys: one (scale, zero) per channel over the G tokens
    k = tl.load(pk_ptr + src).to(tl.float32)  # exact from fp16 / bf16
    kq, ks, kz = _asym(k, m, tl.min(k, 0)[None, :], tl.max(k, 0)[None, :], BITS)
    tl.store(kc_ptr + ((slot0 + t) * H + h)[:, None] * W + i[None, :], _pack(kq, G, D, BITS), mask=ok_codes)
    blk = slot0 // BS
    grp = (slot0 % BS) // G
    kmeta = km_ptr + (((blk * (BS // G) + grp) * H + h) * D + d) * 2
    tl.store(kmeta, tl.reshape(ks, (D,)), mask=ok_keys)
    tl.store(kmeta + 1, tl.reshape(kz, (D,)), mask=ok_keys)
    # values: one (scale, zero) per token per GV elements
    v = tl.load(pv_ptr + src).to(tl.float32)
    v3 = tl.reshape(v, (G, D // GV, GV))
    vq, vs, vz = _asym(v3, v3 == v3, tl.min(v3, 2)[:, :, None], tl.max(v3, 2)[:, :, None], BITS)
    tl.store(
        vc_ptr + ((slot0 + t) * H + h)[:, None] * W + i[None, :],
        _pack(tl.reshape(vq, (G, D)), G, D, BITS),
        mask=ok_codes,
    )
    vmeta = vm_ptr + (((slot0 + t) * H + h)[:, None] * (D // GV) + gi[None, :]) * 2
    tl.store(vmeta, tl.reshape(vs, (G, D // GV)), mask=ok_vmeta)
    tl.store(vmeta + 1, tl.reshape(vz, (G, D // GV)), mask=ok_vmeta)


def triton_flush_supported(group: int, value_group: int, head_dim: int) -> bool:
    """G, GV and D powers of two (tl.arange and the reshapes need them)."""
    return all(x & (x - 1) == 0 for x in (group, value_group, head_dim))


def kivi_flush_triton(cache, pk: torch.Tensor, pv: torch.Tensor, groups: list[tuple[int, int, int]] | torch.Tensor,
                      ring: int, memo: dict | None = None) -> None:  # fmt: skip
    """Quantize the groups (base, first, slot) of pending `pk`, `pv` (module docstring; validated by the
    caller) into their slots: host tuples, or an int64 device tensor `[groups, 3]`; `memo`: `host_ints.device_ints`'."""
    if len(groups) == 0:
        return
    bs, h, d = cache.k_codes.shape[1], cache.k_codes.shape[2], cache.head_dim
    if isinstance(groups, torch.Tensor):
        g = groups.contiguous()
    else:
        g = device_ints([x for grp in groups for x in grp], cache.k_codes.device, memo)
    if pk.stride() != pv.stride() or pk.stride(2) != 1:
        pk, pv = pk.contiguous(), pv.contiguous()
    _kivi_flush_kernel[(len(groups), h)](
        pk, pv, g, cache.k_codes, cache.v_codes, cache.k_meta, cache.v_meta,
        pk.stride(0), pk.stride(1), ring,
        H=h, D=d, G=cache.group, GV=cache.value_group, BS=bs, BITS=cache.bits,
        num_warps=4 if cache.group * d >= 4096 else 1,
    )  # fmt: skip
