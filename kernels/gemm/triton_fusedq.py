"""The W8A8 / FP8 GEMMs' small-M variant: the per-token activation quantizer fused into the GEMM, one launch.

The two-launch path (`triton_gemm.quantize_per_token`, then `triton_gemm.scaled_mm`) writes the M x K codes and
the M scales to memory and reads them back, and pays a second launch (~3-5 us on a GPU, a large share of a
decode-M GEMM of ~20-40 us). Here each program takes its rows of the fp16 / bf16 / fp32 activations directly
(BLOCK_M of them, or below BLOCK_M only the rows there are, copied up to the dot's 16): a prologue pass over all
of K finds each row's absmax (M is small, the rows stay in L2), the scale is derived exactly as
`_act_quant_kernel` derives it (`div_rn`, the same rounding helpers), and the main K loop quantizes each A tile
in registers and feeds the int8 / e4m3 tile to `tl.dot` (int32 / fp32 accumulation), with `_scaled_mm_kernel`'s
epilogue (a_scale[m] * w_scale[n] + bias). Codes, scales and the epilogue's arithmetic are those of the
two-launch path, so at the same tile config the output is the same bit for bit.

The price: every N-tile program re-reads and re-quantizes its rows of A (N / BLOCK_N times in all), so the
variant pays off only while A has few rows (`triton_gemm.FUSEDQ_MAX_M`; the numbers in docs/kernels.md).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from codesign.kernels.gemm.splitk_join import join_buffers
from codesign.kernels.gemm.triton_parts import (
    grouped_tile,
    int8_tile_nk,
    k_split,
    load_zeroed,
    quantize_codes,
    scaled_epilogue,
    split_range,
    w_strides,
)
from codesign.kernels.host_math import cdiv, next_pow2
from codesign.kernels.triton_codes import opaque_bytes
from codesign.kernels.triton_div import div_rn_shared, recip_rn, shared_divisor_ok


@triton.jit
def _rows_to_tile(t, BLOCK_M: tl.constexpr):
    """[ROWS, C] -> [BLOCK_M, C] with row r = t[r % ROWS] (ROWS divides BLOCK_M): the 16-row tile tl.dot needs,
    from the rows there are. Rows past M are never stored, so their copies cost nothing but the dot."""
    ROWS: tl.constexpr = t.shape[0]
    C: tl.constexpr = t.shape[1]
    if ROWS == BLOCK_M:
        tile = t
    else:
        tile = tl.reshape(tl.broadcast_to(t[None, :, :], (BLOCK_M // ROWS, ROWS, C)), (BLOCK_M, C))
    return tile


# M is not specialized: Triton's M == 1 variant of the e4m3 kernel spilled 8 B on sm_90 at the default config
# where M = 3 (the same 4-row tile) did not, and one compiled variant per ROWS is enough.
@triton.jit(do_not_specialize=["M"])
def _fusedq_kernel(
    x_ptr, w_ptr, ws_ptr, b_ptr, out_ptr, sum_ptr, cnt_ptr, M, N, K, K_PER_SPLIT, stride_wk, stride_wn,
    QMAX: tl.constexpr, IS_FP8: tl.constexpr, INTERPRETED: tl.constexpr, PER_TENSOR_W: tl.constexpr,
    HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, ROWS: tl.constexpr, SPLIT_K: tl.constexpr, W_PACKED: tl.constexpr = False,
):  # fmt: skip
    """out = (q(x) @ W) * s[m] * w_scale[n] (+ bias), s = absmax(x[m, :]) / QMAX, q = round(x / s), per tile.

    ROWS (a power of two dividing BLOCK_M) rows of A are loaded and quantized per tile: BLOCK_M, or, when M is
    below BLOCK_M (one row tile), M rounded up to a power of two, copied up to BLOCK_M rows for the dot. The
    quantizer's work per program is ROWS x K elements, so at M = 1 it is 1 / 16 of a full 16-row tile's.
    Split-K (grid axis 1, as `_scaled_mm_kernel`): the prologue still covers all of K (a row's scale is the whole
    row's), the main loop only this program's K range."""
    offs_m, offs_n = grouped_tile(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    offs_r = offs_m if ROWS == BLOCK_M else tl.arange(0, ROWS)  # ROWS < BLOCK_M: one row tile, rows 0 ..
    mask_r = offs_r < M
    mask_n = offs_n < N
    rows = x_ptr + offs_r[:, None] * K
    # Prologue: the rows' absmax over all of K (max is exact, so the tile order cannot change it).
    amax = tl.zeros((ROWS,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(rows + offs_k[None, :], mask=mask_r[:, None] & (offs_k < K)[None, :], other=0.0)
        amax = tl.maximum(amax, tl.max(tl.abs(x.to(tl.float32)), axis=1))
    # div_rn as in `_act_quant_kernel`: fp32 "/" lowers to an approximate divide on GPUs.
    s = tl.where(amax > 0, tl.math.div_rn(amax, QMAX), 1.0)
    shared = tl.min(shared_divisor_ok(s).to(tl.int32), axis=0) == 1  # every row's quotients by its reciprocal
    y = recip_rn(s)
    if IS_FP8:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
    k_start, k_end = split_range(K, K_PER_SPLIT, SPLIT_K)
    for k0 in range(k_start, k_end, BLOCK_K):  # whole tiles: masking at K is enough
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < K
        x = tl.load(rows + offs_k[None, :], mask=mask_r[:, None] & mask_k[None, :], other=0.0).to(tl.float32)
        # Masked lanes load 0 and quantize to code 0, so the dot needs no select on A.
        # `_act_quant_kernel`'s IEEE division, bit for bit (`triton_div`)
        v = tl.minimum(tl.maximum(div_rn_shared(x, s[:, None], y[:, None], shared), -QMAX), QMAX)
        a = _rows_to_tile(opaque_bytes(quantize_codes(v, IS_FP8, INTERPRETED), INTERPRETED), BLOCK_M)
        if W_PACKED:  # the native int8 words
            w = int8_tile_nk(w_ptr, k0, offs_n, N, K, BLOCK_K)  # [BLOCK_N, BLOCK_K], zero outside N and K
            acc += tl.dot(a, tl.trans(w), out_dtype=tl.int32)
        else:  # an 8-bit [K, N] (e4m3, or signed int8 codes), by strides
            w = load_zeroed(w_ptr + offs_k[:, None] * stride_wk + offs_n[None, :] * stride_wn,
                            mask_k[:, None] & mask_n[None, :], IS_FP8 and INTERPRETED)  # fmt: skip
            if IS_FP8:
                acc += tl.dot(a, w)
            else:
                acc += tl.dot(a, w, out_dtype=tl.int32)
    # `_scaled_mm_kernel`'s epilogue, the same function (the bit-identity depends on it).
    scaled_epilogue(acc, _rows_to_tile(s[:, None], BLOCK_M), ws_ptr, b_ptr, out_ptr, sum_ptr, cnt_ptr, offs_m, offs_n,
                    M, N, PER_TENSOR_W, HAS_BIAS, SPLIT_K)  # fmt: skip


# Shared memory the pipeline stages may take: under sm_89's 99 KB opt-in with room for the epilogue's layout change.
SMEM_BUDGET = 96 * 1024


def _stages(cfg: dict, rows: int, x_bytes: int) -> int:
    """The config's stages, fewer where rows of activations make a stage too big for SMEM_BUDGET (each stage holds
    ROWS x BLOCK_K activations and a BLOCK_K x BLOCK_N 8-bit weight tile): at 64 fp32 rows the 6 default stages took
    221 KB (sm_80: over its 163 KB), where decode's 2-8 rows take 10-14 KB a stage."""
    stage = rows * cfg["BLOCK_K"] * x_bytes + cfg["BLOCK_K"] * cfg["BLOCK_N"]
    return max(1, min(cfg["num_stages"], SMEM_BUDGET // stage))


# SPLIT_K 0 (the GPU default): split K until the output tiles give every SM at least AUTO_SPLIT_PROGRAMS programs (of
# 4 warps: 3 a scheduler), at most AUTO_SPLIT_MAX splits. At decode M one row tile is left, so N = K = 8192 makes 128
# programs for 132 SMs: one warp a scheduler, the loop latency-bound (sm_90, `bench/gemm_predict.py` with its wgmma
# loop simulated, untimed: 24.5 us int8 at M = 1, 35.4 at M = 8, against 18.1 / 19.5 over 4 splits, 1.89 / 1.75x
# bf16). Llama-2-70B's gate_up (896 tiles) keeps one. A tuned table's SPLIT_K (1 and up) is taken as it is.
AUTO_SPLIT_PROGRAMS = 3
AUTO_SPLIT_MAX = 4


def auto_split_k(tiles: int, sms: int | None) -> int:
    """The split count SPLIT_K 0 means: ceil(AUTO_SPLIT_PROGRAMS x sms / tiles) in [1, AUTO_SPLIT_MAX]; 1 with no
    SM count (CPU)."""
    if not sms or tiles <= 0:
        return 1
    return max(1, min(AUTO_SPLIT_MAX, -(-AUTO_SPLIT_PROGRAMS * sms // tiles)))


def fusedq_mm(
    x, w, w_scale, bias, out: torch.Tensor, fp8: bool, cfg: dict, interpreted: bool, sms: int | None = None
) -> None:
    """out [M, N] = quantize_per_token(x) @ W, scaled (+ bias), in one launch: x [M, K] fp16 / bf16 / fp32;
    w the native int32-packed int8 codes [K/4, N] or signed int8 codes [K, N], or float8_e4m3fn [K, N] when fp8 (8-bit
    weights in either layout, `w_strides`);
    w_scale [1, N] or [1, 1].
    cfg["SPLIT_K"] > 1 splits K as `triton_gemm.scaled_mm` does (its docstring states the error bound); 0 picks the
    count from the tiles and `sms` (`auto_split_k`) where x has one row tile, else 1."""
    m, k = x.shape
    n = w.shape[1]
    tiles = cdiv(m, cfg["BLOCK_M"]) * cdiv(n, cfg["BLOCK_N"])
    # SPLIT_K 0: split at decode M (one row tile) only; forced over more rows, fp32 activations spilled 4 B (sm_90)
    want = cfg["SPLIT_K"] or (auto_split_k(tiles, sms) if m <= cfg["BLOCK_M"] else 1)
    split, k_per_split = k_split(k, cfg["BLOCK_K"], want)
    grid = (tiles, split)
    sums, cnt = join_buffers(x.device, m * n, tiles) if split > 1 else (out, out)
    # At least 2 rows, and an element a thread (e4m3: two): on sm_90 a 1-row tile compiled to 1334 SASS
    # instructions a K step (and spilled) where 2 rows took 423 (int8, 16 x 64 x 128, 4 warps); 2 rows x 64 on 8
    # warps to 617 where 4 rows took 133; e4m3 at 2 rows x 128 on 8 warps spilled 4 B, at 4 rows none.
    per_thread = 2 if fp8 else 1
    rows = next_pow2(m)
    rows = min(max(2, rows, per_thread * 32 * cfg["num_warps"] // cfg["BLOCK_K"]), cfg["BLOCK_M"])
    _fusedq_kernel[grid](
        x, w, w_scale, w_scale if bias is None else bias, out, sums, cnt, m, n, k, k_per_split, *w_strides(w),
        QMAX=448.0 if fp8 else 127.0, IS_FP8=fp8, INTERPRETED=interpreted, PER_TENSOR_W=w_scale.numel() == 1 and n > 1,
        HAS_BIAS=bias is not None, BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"],
        GROUP_M=cfg["GROUP_M"], ROWS=rows, SPLIT_K=split, W_PACKED=w.dtype == torch.int32,
        num_warps=cfg["num_warps"],
        num_stages=_stages(cfg, rows, x.element_size()),
    )  # fmt: skip
