"""Triton kernels for quantized GEMM: W4A16/W8A16 (split-K GEMV-style + tiled), W8A8 int8, FP8 W8A8, and the
one place each op's variant is chosen (ours: `triton_gemv` at the smallest M, split-K, tiled; for W8A8 / FP8
the activation quantizer fused into the GEMM at decode M, `triton_fusedq`, two launches, or on Hopper at large
M the persistent TMA-fed GEMM, `triton_tma`; or torch's own path where it is faster: `triton_dequant`,
`torch_mm`).

Y[M, N] = X[M, K] @ W[N, K]^T (+ bias), W in the native layout of `codesign.kernels.gemm.formats`
(codes packed 32/bits per int32 along K, K-major; per-group scales and optional zeros along K).

Launchers here assume validated, contiguous arguments (`codesign.kernels.gemm.ops` validates).
Launch parameters come from `codesign.autotune.lookup.lookup_config` (fixed defaults when no GPU:
the interpreter cannot time configs; the tiled variant's default tile has 256 rows once 128-row tiles would be more
than one wave of the GPU's SMs, `tiled_kind`). Activations are converted to fp32 right after loading
because bf16 arithmetic is wrong in Triton's interpreter. On a GPU the tiled variant casts the matmul
operands back to the activation dtype (exact for the activation; the dequantized weight rounds once; where the
scales are of that 16-bit type, fp16 or 4-bit bf16, it dequantizes by bit patterns and packed 16-bit arithmetic
to the same bits, `magic_dequant`);
split-K meets the codes as fp16 (c - z) / 1024 with bf16 activation rows scaled into fp16's range (exact both) and
applies each group's scale per output element (`_wq_kernel`).
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from codesign.autotune.lookup import forced_config_of, lookup_config, shape_key
from codesign.backend import DeviceView, device_view
from codesign.kernels.gemm import torch_mm, triton_tma
from codesign.kernels.gemm.splitk_join import join_buffers, join_splits
from codesign.kernels.gemm.triton_dequant import dequant_matmul
from codesign.kernels.gemm.triton_fusedq import fusedq_mm
from codesign.kernels.gemm.triton_gemv import wq_gemv
from codesign.kernels.gemm.triton_parts import (
    code_tile_nk,
    grouped_tile,
    int8_tile_nk,
    k_split,
    load_zeroed,
    quantize_codes,
    scaled_epilogue,
    split_range,
    w_strides,
    word_tile_nk,
)
from codesign.kernels.host_math import cdiv, next_pow2
from codesign.kernels.triton_codes import opaque_f16, pair_cols, pow2_scale, words_f16_less
from codesign.kernels.triton_div import div_rn_shared, recip_rn, shared_divisor_ok
from codesign.specs import CodesignError

# Without a tuned variant table, M at or below this runs the split-K kernel: decode batches read the
# whole weight for a few rows, so the work must be spread over K to fill the GPU (N / BLOCK_N programs
# alone are too few). A tuned "<op>_variant" table overrides it per shape (`choose_variant`).
SMALL_M_MAX = 16
# From this M the weight-only GEMMs default to dequantize-then-matmul (`triton_dequant`), and W8A8 / FP8 to
# torch's own matmuls (`torch_mm`): compute-bound sizes where cuBLAS's tiles win and the extra pass over the
# weight is small (an 8192 x 8192 layer: ~45 us of dequantization beside >= 0.19 ms of matmul on an H200,
# where our tiled W4A16 measured 0.33x bf16 at M = 4096 and W8A8 0.2-0.27x). A variant table overrides it.
TORCH_PATH_MIN_M = 1024
# At or below this M the weight-only GEMMs default to the CUDA-core GEMV (`triton_gemv`): each row of x adds an FFMA
# per weight, where split-K's 16-row tile costs the same at M = 1-16. Predicted on an H200 (`bench/gemm_predict.py`:
# sm_90 SASS through the warp-scheduler simulation, which the GEMM hindcast holds within 1.06-1.25x of the split-K
# kernels the H200 timed; untimed), N = K = 8192, GEMV against split-K: int4 11.7 / 19.7 us at M = 1, 16.3 / 20.6 at
# M = 2, 29.4 / 20.6 at M = 4; int8 16.7 / 19.9, 16.7 / 20.2, 24.9 / 20.2 (gate_up at M = 1: 87.9 / 140.5 int4,
# 113.1 / 135.9 int8). So both take the GEMV up to M = 2; a tuned table overrides it. (History: CHANGELOG.md.)
GEMV_MAX_M = {"w4a16_gemm": 2, "w8a16_gemm": 2}  # by op; other ops 0
WQ_VARIANTS = ("gemv", "splitk", "tiled", "dequant")
# At or below this M the W8A8 / FP8 GEMMs default to the fused-quantizer kernel (`triton_fusedq`): one launch
# instead of two and no M x K codes written and read back, against every N-tile program re-quantizing its rows
# of A (its SASS a K step grows with the rows; int8 at M = 16 is predicted slower than the two-launch path,
# `bench/gemm_predict.py`). Untimed prediction; the reasoning and numbers are in docs/kernels.md; a tuned variant
# table overrides it.
FUSEDQ_MAX_M = 8
SCALED_MM_VARIANTS = ("triton", "torch", "fusedq", "tma")

# Defaults are untuned starting points (the autotune issue fills per-GPU tables). Interpreter
# defaults use the largest blocks: the interpreter's cost is per program instance, not per flop.
_GPU_DEFAULTS: dict[str, dict[str, int]] = {
    # Split-K in 4 stages: with fp16 codes, 3 stages spilled 20 B at 80 registers on sm_90 for fp16 activations
    # at K = 1024 (ptxas); 4 stages take 86 and 45 KB of shared memory, no spill on the shapes sampled.
    # 128 columns: the activation tile's per-tile work (its row scale, the fp16 copy, the dot's A loads) and the
    # loop's fixed costs serve twice the weight: sm_90, N = K = 8192, M = 16, W4A16 g128 491 SASS a K tile for 128
    # columns against 353 for 64, predicted 11.0 us against 14.4 (memory-bound now), W8A16 517 / 352, 18.6 us
    # either way (memory-bound); 88-128 registers, no spills on sm_90 or sm_80 (`bench/gemm_predict.py`,
    # `bench/lowering_report.py --sections correctness quant_gemm`).
    "splitk": {"BLOCK_M": 16, "BLOCK_N": 128, "BLOCK_K": 128, "SPLIT_K": 4, "num_warps": 4, "num_stages": 4},
    # 4-bit weights on sm_90+ (`splitk_kind`): 8 warps a program, each a 16 x 16 slice of the tile. The loop is
    # latency-bound at 3 programs an SM either way; 8 warps put 6 a scheduler where 4 put 3. sm_90, N = K = 8192, bf16,
    # predicted (`bench/gemm_predict.py`, untimed): M = 1 23.6 -> 21.3 us (1.45x -> 1.60x bf16), M = 16 24.3 -> 21.7
    # (1.40x -> 1.58x); 72 registers, no spills. 8-bit codes keep 4 (predicted 21.1 against 22.5 us at M = 16).
    "splitk_w4": {"BLOCK_M": 16, "BLOCK_N": 128, "BLOCK_K": 128, "SPLIT_K": 4, "num_warps": 8, "num_stages": 4},
    # fp32 activations (the "ieee" correctness path on the FMA units, `splitk_kind`) keep 64 columns: at 128 their
    # spills doubled (sm_90: 448-7868 B a thread against 260-4264).
    "splitk_fp32": {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 128, "SPLIT_K": 4, "num_warps": 4, "num_stages": 4},
    # Packed weights are loaded as one int32 word per k, so a pipelined weight tile costs 4 B per element
    # in shared memory. Untuned defaults must launch on every GPU we target, the smallest opt-in limit
    # being sm_89's 101,376 B (L40S, RTX 4090): tiled 128 x 128 x 64 in 3 stages needs 115,200 B (ptxas),
    # at BLOCK_K 32 57,856 B; W8A8 128 x 128 x 128 in 3 stages 180,224 B (over the A100's 166,912 B too).
    # W8A8 / FP8 at 128 x 64 x 64, 8 warps, 4 stages: <= 86,016 B and 102-174 registers without spills on
    # sm_80 / sm_89 / sm_90, N aligned or not (128 x 128 tiles spill 36-668 B per thread when N = 1000)
    # (`bench/lowering_report.py --arch 80/89/90`). Tuned tables may go bigger.
    "tiled": {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 32, "GROUP_M": 8, "num_warps": 8, "num_stages": 3},
    # The tiled variant past one wave of 128-row tiles (`tiled_kind`): 256 rows, so each dequantized weight element
    # (its unpack and dequantization are most of a K step's SASS) feeds twice the MMA work. sm_90, N = K = 8192, bf16:
    # W4A16 g128 169 SASS a K step for 4 HGMMA (the 128-row tile: 155 for 2), 185 registers, 62,464 B of shared
    # memory; W8A16 188, 186, 66,048 B; no spills. sm_80 / sm_89 (mma.sync): 239-245 registers, 65,536 B, no spills
    # (W4A16 / W8A16, fp16 / bf16). Predicted tensor-core bound from M = 512 (`bench/gemm_predict.py`).
    "tiled_wide": {"BLOCK_M": 256, "BLOCK_N": 128, "BLOCK_K": 32, "GROUP_M": 8, "num_warps": 8, "num_stages": 3},
    # The 256-row tile on warpgroup-MMA GPUs (sm_90+, `tiled_kind`): 16 warps (four warpgroups of 64 rows) with K
    # steps of 64, where 8 warps left 2 a scheduler and the K loop latency-bound on the dequantization's chain.
    # sm_90, bf16, N = K = 8192, predicted (`bench/gemm_predict.py`, untimed): W4A16 g128 at M = 1024 238 -> 143 us
    # and W8A16 234 -> 143 us, from latency-bound to the tensor cores' peak (which cuBLAS's bf16 GEMM reaches 69 % of
    # there: read as "no longer latency-bound", not as 1.4x bf16); 16 warps at K steps of 32 stayed latency-bound
    # (275 us, forced through `forced_config` by hand). 122-123 registers, no spills, 123,904-131,584 B of shared
    # memory (over sm_89's 101,376 B: Hopper only).
    "tiled_wide_wg": {"BLOCK_M": 256, "BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 8, "num_warps": 16, "num_stages": 3},
    # 4-bit weights on warpgroup-MMA GPUs up to W4_TILE_MAX_M rows (`tiled_kind`): 64-row tiles with K steps of 128,
    # twice the programs of the 128-row tile (2 an SM: 4 warps a scheduler, where the loop is latency-bound at 2) and
    # a quarter of the steps. sm_90, bf16, predicted (`bench/gemm_predict.py`, untimed): N = K = 8192 at M = 256
    # 75.9 -> 61.2 us (0.75x -> 0.94x bf16), gate_up (N = 57344, past one wave: the 256-row tile before) 476 -> 429
    # us; 123 registers, 99,328 B of shared memory (sm_90's limit: 227 KiB), no spills. At M >= 1024 within 3 % of the
    # 256-row tile, which keeps those. Not on mma.sync GPUs (sm_80: 224 registers, predicted slower) nor for 8-bit
    # codes (115,200 B, and predicted slower: 103.1 against 80.3 us).
    "tiled_w4": {"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 128, "GROUP_M": 8, "num_warps": 8, "num_stages": 3},
    "scaled_mm": {
        "BLOCK_M": 128,
        "BLOCK_N": 64,
        "BLOCK_K": 64,
        "GROUP_M": 8,
        # No split: this default serves the rule's M 9-1023, where past M ~ 256 (N = 8192) the output tiles fill
        # the GPU and a split only adds M x N x 4 B of atomics and their read-back; tuned tables split per M bucket.
        "SPLIT_K": 1,
        "num_warps": 8,
        "num_stages": 4,
    },
    "act": {"BLOCK_K": 1024, "num_warps": 4},
    "dequant": {"BLOCK_K": 32, "BLOCK_N": 128, "num_warps": 4},
    # The GEMV: 512 columns on 2 warps (8 a thread, two 16-byte loads a word row), 64 K a step: 512 weights a thread
    # a step (sm_90: 96-168 registers, no spills; 1024 spilled), 12.5 us predicted at N = K = 8192, M = 1 (int4).
    "gemv": {"BLOCK_K": 64, "BLOCK_N": 512, "num_warps": 2},
    # The fused quantizer: 64 rows (a decode batch's, copied up), so sm_90 runs the dot on the warpgroup MMA with s8 /
    # e4m3 operands straight from shared memory (a 16-row tile takes mma.sync, which converts e4m3 to fp16 in
    # registers). BLOCK_N 64: N / 64 output tiles (128 at N = 8192, about one an SM), K split until the SMs hold 3
    # programs each (SPLIT_K 0: `triton_fusedq.auto_split_k`); 4 stages keep 32 KB of weight in flight a program,
    # ~96 KB an SM (6, the default before the split, held more shared memory a program, fewer resident: slower at
    # M = 8 by the same predictor with the config forced). Predictions, untimed: `bench/gemm_predict.py`,
    # docs/kernels.md.
    "fusedq": {
        "BLOCK_M": 64,
        "BLOCK_N": 64,
        "BLOCK_K": 128,
        "GROUP_M": 8,
        "SPLIT_K": 0,
        "num_warps": 4,
        "num_stages": 4,
    },
    # The persistent TMA kernel (sm_90, ptxas): 128 x 128 x 128 on 8 warps (two warpgroups, wgmma), 4 stages,
    # 163,872 B of shared memory, 127 registers for int8 and 159 for e4m3, no spills; e4m3 at 128 x 256 spilled
    # 168 B at 255 registers, and 32-row tiles or 2 warps fall back to mma.sync (wgmma takes 64 rows a warpgroup).
    "tma": {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 128, "GROUP_M": 8, "num_warps": 8, "num_stages": 4},
}
_INTERP_DEFAULTS: dict[str, dict[str, int]] = {
    # SPLIT_K 2 so the atomic reduction path is exercised by every small-M interpreter test.
    "splitk": {"BLOCK_M": 16, "BLOCK_N": 128, "BLOCK_K": 128, "SPLIT_K": 2, "num_warps": 4, "num_stages": 1},
    "tiled": {"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 128, "GROUP_M": 4, "num_warps": 4, "num_stages": 1},
    "scaled_mm": {
        "BLOCK_M": 64,
        "BLOCK_N": 128,
        "BLOCK_K": 128,
        "GROUP_M": 4,
        "SPLIT_K": 2,  # the atomic split-K path in every interpreter test that does not pin it
        "num_warps": 4,
        "num_stages": 1,
    },
    "act": {"BLOCK_K": 512, "num_warps": 4},
    "dequant": {"BLOCK_K": 128, "BLOCK_N": 128, "num_warps": 4},
    "gemv": {"BLOCK_K": 128, "BLOCK_N": 128, "num_warps": 4},
    "fusedq": {
        "BLOCK_M": 16,
        "BLOCK_N": 128,
        "BLOCK_K": 128,
        "GROUP_M": 4,
        "SPLIT_K": 2,
        "num_warps": 4,
        "num_stages": 1,
    },
    "tma": {"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 128, "GROUP_M": 4, "num_warps": 4, "num_stages": 1},
}

_TL_DTYPE = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}
ACT_TABLE_OP = "quantize_per_token"  # the activation quantizer's table (key `act_table_key`)


# ----------------------------------------------------------------------------- tuned tables
def wq_op(bits: int) -> str:
    """The weight-only GEMM's op name: "w4a16_gemm" or "w8a16_gemm"."""
    return f"w{bits}a16_gemm"


def wq_table_op(bits: int, variant: str) -> str:
    """The table of one weight-only variant (WQ_VARIANTS): "w4a16_gemm_splitk", ..."""
    return f"{wq_op(bits)}_{variant}"


def wq_variant_op(bits: int) -> str:
    """The table `choose_variant` reads (`wq_variant_entry` per shape and M)."""
    return f"{wq_op(bits)}_variant"


def wq_variant_entry(variant: str) -> dict[str, int]:
    """A weight-only variant as its variant-table entry: {"SPLITK": 0/1, "DEQUANT": 0/1, "GEMV": 0/1}."""
    pins = (("SPLITK", "splitk"), ("DEQUANT", "dequant"), ("GEMV", "gemv"))
    return {name: int(variant == v) for name, v in pins}


def scaled_mm_variant_op(fp8: bool) -> str:
    """The table `choose_scaled_mm_variant` reads (`scaled_mm_variant_entry` per shape and M)."""
    return f"{scaled_mm_table_op(fp8)}_variant"


def scaled_mm_variant_entry(variant: str) -> dict[str, int]:
    """A W8A8 / FP8 variant (SCALED_MM_VARIANTS) as its variant-table entry: {"TORCH": 0/1, "FUSEDQ": 0/1,
    "TMA": 0/1} (all 0: our two-launch path, quantize_per_token then `scaled_mm`)."""
    return {name: int(variant == v) for name, v in _MM_FLAGS}


_MM_FLAGS = (("TORCH", "torch"), ("FUSEDQ", "fusedq"), ("TMA", "tma"))  # variant-table flag -> variant


def wq_table_key(n: int, k: int, group: int) -> str:
    """The weight-only tables' shape key (group = K for per-channel)."""
    return shape_key(N=n, K=k, G=group)


def scaled_mm_table_op(fp8: bool, variant: str = "triton") -> str:
    """The W8A8 / FP8 GEMM's table of one variant: "w8a8_gemm" or "fp8_gemm" for ours (two launches), with
    "_fusedq" for the fused quantizer, "_tma" for the persistent TMA kernel, "_torch" for torch's (one config,
    naming the variant)."""
    op = "fp8_gemm" if fp8 else "w8a8_gemm"
    return op if variant == "triton" else f"{op}_{variant}"


def scaled_mm_table_key(n: int, k: int) -> str:
    return shape_key(N=n, K=k)


def act_table_key(k: int) -> str:
    return shape_key(K=k)


def choose_variant(m: int, op: str = "w4a16_gemm", device: torch.device | None = None, key: str = "") -> str:
    """The one place the weight-only variant is chosen: "gemv", "splitk", "tiled" or "dequant".

    Reads the per-GPU variant table "<op>_variant" (`wq_variant_entry` per shape key `key` and M bucket;
    written by `codesign tune --variants all --export` from the fastest correct config of each variant at
    the same M), else the default rule: the GEMV up to the op's GEMV_MAX_M, split-K up to SMALL_M_MAX,
    dequantize-then-matmul from TORCH_PATH_MIN_M, tiled between. No device (or a CPU one) means no table:
    the default rule, unless the tuner forces a variant (`forced_config`).
    """
    gpu = device_view(device).gpu_name if device is not None else None
    rule = ("gemv" if m <= GEMV_MAX_M.get(op, 0) else "splitk" if m <= SMALL_M_MAX
            else "dequant" if m >= TORCH_PATH_MIN_M else "tiled")  # fmt: skip
    # An entry names its variant by the flags it sets (a missing flag is 0); no entry: the rule.
    cfg = lookup_config(f"{op}_variant", gpu, m, key, {}) or wq_variant_entry(rule)  # `wq_variant_op`
    flags = {name: cfg.get(name, 0) for name in ("DEQUANT", "GEMV", "SPLITK")}
    if flags["DEQUANT"] or flags["GEMV"]:
        return "dequant" if flags["DEQUANT"] else "gemv"
    return "splitk" if flags["SPLITK"] else "tiled"


def choose_scaled_mm_variant(
    m: int, n: int, k: int, fp8: bool, out_dtype: torch.dtype, device: torch.device
) -> str:
    """The W8A8 / FP8 variant: "fusedq" (ours, the quantizer fused: `triton_fusedq`), "triton" (ours, two
    launches), "tma" (ours, persistent and TMA-fed: `triton_tma`) or "torch" (`torch_mm`), from the table
    `scaled_mm_variant_op` (`scaled_mm_variant_entry`; a missing flag is 0), else the default rule: fused up to
    FUSEDQ_MAX_M; on sm_90 "tma" from `triton_tma.TMA_MIN_M` (e4m3: unless torch's takes the call at
    TORCH_PATH_MIN_M or more); torch's from TORCH_PATH_MIN_M; two launches between. Never "torch" or "tma"
    where it cannot take the call (`torch_mm.why_not`, `triton_tma.why_not`; the rule's own kernel then),
    unless forced, which then raises that reason."""
    op = scaled_mm_variant_op(fp8)
    view = device_view(device)
    torch_ok = not torch_mm.why_not(m, n, k, fp8, out_dtype, device)
    tma_ok = not triton_tma.why_not(m, n, k, view)
    ours = "fusedq" if m <= FUSEDQ_MAX_M else "triton"
    if tma_ok and triton_tma.wanted_by_default(m, view):
        ours = "tma"
    # TMA is predicted above torch's int8 path, not above cuBLASLt's e4m3 one (docs/kernels.md).
    rule = "torch" if m >= TORCH_PATH_MIN_M and torch_ok and (fp8 or ours != "tma") else ours
    cfg = lookup_config(op, view.gpu_name, m, scaled_mm_table_key(n, k), {})
    flags = {name: cfg.get(name, 0) for name, _ in _MM_FLAGS} if cfg else scaled_mm_variant_entry(rule)
    forced = forced_config_of(op) is not None
    for name, variant, ok in (("TORCH", "torch", torch_ok), ("TMA", "tma", tma_ok)):
        if flags[name]:
            return variant if forced or ok else ours
    return "fusedq" if flags["FUSEDQ"] else "triton"


def launch_config(table_op: str, kind: str, device: torch.device, m: int, key: str) -> dict[str, Any]:
    """Launch parameters for `table_op` at batch m and shape key `key` from the per-GPU table, else the
    `kind` defaults (tables: `wq_table_op` / `wq_table_key`, `scaled_mm_table_op` / `scaled_mm_table_key`,
    ACT_TABLE_OP / `act_table_key`).
    """
    view = device_view(device)
    defaults = _INTERP_DEFAULTS if view.interpreted and not view.gpu else _GPU_DEFAULTS
    return lookup_config(table_op, view.gpu_name, m, key, defaults[kind])


def tiled_kind(m: int, n: int, x_dtype: torch.dtype, view: DeviceView, bits: int = 8) -> str:
    """The tiled variant's defaults: "tiled_wide" (256-row tiles; on warpgroup-MMA GPUs, sm_90+, "tiled_wide_wg" on
    16 warps) for fp16 / bf16 activations on a GPU once the 128-row tiles are more than one wave (cdiv(M, 128) x
    cdiv(N, 128) programs > SMs, M > 128), else "tiled";
    4-bit weights on warpgroup-MMA GPUs (sm_90+) up to W4_TILE_MAX_M rows "tiled_w4" (64-row tiles, its comment).
    Within one wave the 128-row tile keeps more SMs busy (N = K = 8192, M = 256: 128 programs; 256 rows would leave
    68 of 132 SMs idle, predicted 71.7 against 40.5 us); past it, 256 rows halve the dequantization a flop. fp32
    activations (the correctness path, "ieee" dots) keep 128 rows: twice the shared memory and registers."""
    tile = _GPU_DEFAULTS["tiled"]["BLOCK_M"]
    if not view.compiled or not view.sms or x_dtype == torch.float32:
        return "tiled"
    hopper = (view.capability or (0, 0)) >= (9, 0)
    if bits == 4 and hopper and m <= W4_TILE_MAX_M:
        return "tiled_w4"
    if m <= tile:
        return "tiled"
    programs = cdiv(m, tile) * cdiv(n, _GPU_DEFAULTS["tiled"]["BLOCK_N"])
    if programs <= view.sms:
        return "tiled"
    return "tiled_wide_wg" if hopper else "tiled_wide"


W4_TILE_MAX_M = 256  # "tiled_w4" up to here (`tiled_kind`); past it the 256-row tile is as fast (predicted)


def splitk_kind(x_dtype: torch.dtype, view: DeviceView, bits: int = 8) -> str:
    """The split-K variant's defaults: "splitk", or on a GPU "splitk_fp32" (64 columns) for fp32 activations and, on
    sm_90+, "splitk_w4" (8 warps) for 4-bit weights."""
    if view.compiled and x_dtype == torch.float32:
        return "splitk_fp32"
    if view.compiled and bits == 4 and (view.capability or (0, 0)) >= (9, 0):
        return "splitk_w4"
    return "splitk"


def magic_dequant(bits: int, scale_dtype: torch.dtype, dot_dtype: tl.dtype) -> bool:
    """Whether the tiled kernel dequantizes in the dot's 16-bit type by bit patterns (`_wq_kernel`, MAGIC_DQ) rather
    than in fp32 (an I2FP conversion per element). The same bits where: the scales are already of that type (so
    the fp32 product (c - z) s is exact and rounds once, as the 16-bit multiply does); BASE + c and BASE + z are
    exact (fp16, BASE 1024: codes and zeros <= 256; bf16, BASE 128, 7 mantissa bits: 4-bit codes only, zeros <= 16);
    zeros are integers (the format's, `formats.validate_quantized_weight`). bf16 runs it only where a GPU computes
    bf16 (the interpreter's dot is fp32 there: `_dot_dtype`)."""
    if dot_dtype == tl.float16:
        return scale_dtype == torch.float16
    return dot_dtype == tl.bfloat16 and scale_dtype == torch.bfloat16 and bits == 4


def group_shift(group: int, k: int) -> int:
    """s with k0 >> s the group of K offset k0 (0 <= k0 < k): log2 of a power-of-two group, else (the group is all
    of K, per-channel) 31, so every k0 < 2^31 is in group 0. A runtime `//` cost an integer division a K step
    (sm_90: 22 of the tiled kernel's 209 SASS a K step)."""
    if group & (group - 1) == 0:
        return group.bit_length() - 1
    if group != k:
        raise CodesignError(f"group {group} is neither a power of two nor K = {k}")
    return 31


def _dot_dtype(x_dtype: torch.dtype, view: DeviceView) -> tl.dtype:
    # In the interpreter bf16 arithmetic is wrong, so the matmul runs in fp32 there.
    if x_dtype == torch.bfloat16 and not view.bf16_dot:
        return tl.float32
    return _TL_DTYPE[x_dtype]


# ----------------------------------------------------------------------------- jit bodies


@triton.jit
def _wq_kernel(
    x_ptr,
    qw_ptr,
    s_ptr,
    z_ptr,
    b_ptr,
    out_ptr,
    sum_ptr,
    cnt_ptr,
    M,
    N,
    K,
    GROUP_SHIFT,
    K_PER_SPLIT,
    BITS: tl.constexpr,
    HAS_ZEROS: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    DOT_PREC: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    SPLITK: tl.constexpr,
    USE_ATOMIC: tl.constexpr,
    F16_CODES: tl.constexpr = False,
    MAGIC_DQ: tl.constexpr = False,
    INTERPRETED: tl.constexpr = False,
):
    """Weight-only GEMM: one [BLOCK_M, BLOCK_N] output tile over a K range per program.

    The variant is how programs map to work. Tiled (SPLITK False, large M): 1-D grid in grouped order,
    each program the whole of K. Split-K (small M, GEMV-style): program (n-tile, k-slice, m-tile) reduces
    K_PER_SPLIT of K, so few rows still fill the GPU. With USE_ATOMIC the fp32 partial sums meet in
    the launch (`splitk_join.join_splits` over sum_ptr, cnt_ptr; the split-0 program adds the bias);
    otherwise the program stores its tile. GROUP_SHIFT: the group of K offset k0 is k0 >> GROUP_SHIFT (`group_shift`).
    """
    if SPLITK:
        pid_k = tl.program_id(1)
        offs_m = tl.program_id(2) * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        k_start = pid_k * K_PER_SPLIT
        k_end = min(k_start + K_PER_SPLIT, K)
    else:
        offs_m, offs_n = grouped_tile(M, N, BLOCK_M, BLOCK_N, GROUP_M)
        k_start = 0
        k_end = K
    mask_m = offs_m < M
    mask_n = offs_n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        x16 = tl.load(x_ptr + offs_m[:, None] * K + offs_k[None, :], mask=mask_m[:, None] & (offs_k < k_end)[None, :],
                      other=0.0)  # fmt: skip
        x = x16.to(tl.float32)
        g = k0 >> GROUP_SHIFT  # one group per tile (`group_shift`: a shift, not an integer division a K step)
        scale = tl.load(s_ptr + g * N + offs_n, mask=mask_n, other=0.0).to(tl.float32)
        if HAS_ZEROS:
            zero = tl.load(z_ptr + g * N + offs_n, mask=mask_n, other=0.0).to(tl.float32)
        else:
            zero = tl.full(offs_n.shape, 1 << (BITS - 1), tl.float32)
        if F16_CODES:
            # Split-K with fp16 / bf16 activations (few rows, the weight tile dominates): x @ ((c - z) s) =
            # (x @ (c - z)) s per column, so the codes enter the product as c - z, made fp16 exactly by bit patterns
            # (`words_f16_less`: one mask-and-OR and one packed subtract per two codes, the zero riding in the
            # subtract), and the scale costs O(BLOCK_M x BLOCK_N) per tile instead of a multiply-add and two
            # conversions per weight element. The unpack's column order (`pair_order`) is folded into the activation
            # tile (`pair_cols`, in registers). Each activation row is scaled by a power of two into fp16's range
            # (bf16 rows beyond it included). With many rows (the tiled variant) the per-tile [BLOCK_M, BLOCK_N]
            # work costs more (sm_90, 128 x 128 x 32: 222 registers against 122): that variant dequantizes the
            # weight tile.
            words = word_tile_nk(qw_ptr, k0, offs_n, N, k_end, BITS, BLOCK_K)  # [BLOCK_N, BLOCK_K / P]
            w = tl.reshape(words_f16_less(words, zero, BITS, INTERPRETED), (BLOCK_N, BLOCK_K))  # (c - z) / 1024
            if DOT_DTYPE == tl.float16:  # fp16 rows as they are: exact products, fp32 sums, no scale to undo
                xc = tl.dot(pair_cols(opaque_f16(x16, INTERPRETED), BITS), tl.trans(opaque_f16(w, INTERPRETED)))
                acc += xc * (scale * 1024.0)[None, :]  # (`words_f16_less`)
            else:
                x_f, x_unf = pow2_scale(tl.max(tl.abs(x), 1), 14)
                xh = pair_cols((x * x_f[:, None]).to(tl.float16), BITS)
                xc = tl.dot(xh, tl.trans(opaque_f16(w, INTERPRETED))) * (x_unf * 1024.0)[:, None]
                acc += xc * scale[None, :]
        elif MAGIC_DQ:
            # The weight tile in the dot's 16-bit type without a conversion per element (`magic_dequant`): the code
            # OR'd into the exponent of BASE (fp16 1024, bf16 128) is BASE + c by its bit pattern, and BASE + z is
            # exact too (integer zeros <= 2^bits), so one packed subtract gives c - z exactly and one packed multiply
            # rounds (c - z) s once, as the fp32 path's single rounding of its exact product does: the same bits.
            # sm_90, 128 x 128 x 32, W4A16 bf16: 155 SASS a K step against 187 (16 I2FP, FADD, FMUL, 8 F2FP gone).
            BASE: tl.constexpr = 1024.0 if DOT_DTYPE == tl.float16 else 128.0
            codes = code_tile_nk(qw_ptr, k0, offs_n, N, k_end, BITS, BLOCK_K)  # [BLOCK_N, BLOCK_K]
            wq = (codes | (0x6400 if DOT_DTYPE == tl.float16 else 0x4300)).to(tl.int16).to(DOT_DTYPE, bitcast=True)
            wh = (wq - (zero + BASE).to(DOT_DTYPE)[:, None]) * scale.to(DOT_DTYPE)[:, None]
            acc += tl.dot(x.to(DOT_DTYPE), tl.trans(wh), input_precision=DOT_PREC)
        else:
            codes = code_tile_nk(qw_ptr, k0, offs_n, N, k_end, BITS, BLOCK_K)  # [BLOCK_N, BLOCK_K]
            w = (codes.to(tl.float32) - zero[:, None]) * scale[:, None]
            acc += tl.dot(x.to(DOT_DTYPE), tl.trans(w.to(DOT_DTYPE)), input_precision=DOT_PREC)
    if HAS_BIAS:
        bias = tl.load(b_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)
        if SPLITK:
            bias = tl.where(pid_k == 0, bias, 0.0)
        acc += bias[None, :]
    if USE_ATOMIC:
        join_splits(acc, sum_ptr, cnt_ptr, out_ptr, offs_m, offs_n, M, N)
    else:
        out_mask = mask_m[:, None] & (offs_n < N)[None, :]
        tl.store(out_ptr + offs_m[:, None] * N + offs_n[None, :], acc.to(out_ptr.dtype.element_ty), mask=out_mask)


@triton.jit
def _act_quant_kernel(
    x_ptr,
    q_ptr,
    s_ptr,
    K,
    QMAX: tl.constexpr,
    IS_FP8: tl.constexpr,
    BLOCK_K: tl.constexpr,
    INTERPRETED: tl.constexpr,
):
    """Per-token dynamic quantizer, one row per program: s = absmax / QMAX, q = round(x / s)."""
    row = tl.program_id(0).to(tl.int64)
    amax = tl.zeros((BLOCK_K,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + row * K + offs, mask=offs < K, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(x))
    m = tl.max(amax, axis=0)
    # div_rn, not "/": on GPUs Triton lowers fp32 "/" to an approximate divide (off by an ulp), which
    # moved scales and flipped codes at rounding ties against torch (measured on an H200).
    s = tl.where(m > 0, tl.math.div_rn(m, QMAX), 1.0)
    shared = shared_divisor_ok(s)
    y = recip_rn(s)
    for k0 in range(0, K, BLOCK_K):
        offs = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + row * K + offs, mask=offs < K, other=0.0).to(tl.float32)
        # IEEE division (bit-exact codes), by the row's reciprocal where that is exact (`triton_div`)
        v = tl.minimum(tl.maximum(div_rn_shared(x, s, y, shared), -QMAX), QMAX)
        tl.store(q_ptr + row * K + offs, quantize_codes(v, IS_FP8, INTERPRETED), mask=offs < K)
    tl.store(s_ptr + row, s)


@triton.jit
def _scaled_mm_kernel(
    a_ptr,
    as_ptr,
    w_ptr,
    ws_ptr,
    b_ptr,
    out_ptr,
    sum_ptr,
    cnt_ptr,
    M,
    N,
    K,
    K_PER_SPLIT,
    stride_wk,
    stride_wn,
    IS_FP8: tl.constexpr,
    INTERPRETED: tl.constexpr,
    PER_TENSOR_W: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    SPLIT_K: tl.constexpr,
    W_PACKED: tl.constexpr = False,
):
    """W8A8 GEMM: int8 x int8 -> int32 (or fp8 x fp8 -> fp32), scales applied in the epilogue.

    out = acc * a_scale[m] * w_scale[n] (+ bias[n]). The weight: an 8-bit [K, N], e4m3 or signed int8 codes
    (strides: K contiguous pipelines on sm_90, `triton_parts.w_strides`), or (W_PACKED) the native int32 words of
    offset-binary int8 codes (zero 128).
    Grid (output tiles in grouped order, SPLIT_K): program (t, j) sums K range j (K_PER_SPLIT, a multiple of
    BLOCK_K; `k_split`) and `scaled_epilogue` joins its scaled partial with the others' in the launch (SPLIT_K > 1,
    `splitk_join` over sum_ptr, cnt_ptr) or stores the tile (SPLIT_K 1). The split result's error bound: `scaled_mm`.
    """
    offs_m, offs_n = grouped_tile(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    mask_m = offs_m < M
    mask_n = offs_n < N
    if IS_FP8:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
    k_start, k_end = split_range(K, K_PER_SPLIT, SPLIT_K)
    # Ranges are whole tiles, so masking at K (not k_end) is enough: a tile never crosses into the next range.
    for k0 in range(k_start, k_end, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < K
        amask = mask_m[:, None] & mask_k[None, :]
        wmask = mask_k[:, None] & mask_n[None, :]
        if W_PACKED:  # the native int8 words
            a = tl.load(a_ptr + offs_m[:, None] * K + offs_k[None, :], mask=amask, other=0)
            w = int8_tile_nk(w_ptr, k0, offs_n, N, K, BLOCK_K)  # [BLOCK_N, BLOCK_K], zero outside N and K
            acc += tl.dot(a, tl.trans(w), out_dtype=tl.int32)
        else:  # an 8-bit [K, N] (e4m3, or signed int8 codes), by strides: operands from the load to the dot
            a = load_zeroed(a_ptr + offs_m[:, None] * K + offs_k[None, :], amask, IS_FP8 and INTERPRETED)
            w = load_zeroed(w_ptr + offs_k[:, None] * stride_wk + offs_n[None, :] * stride_wn, wmask,
                            IS_FP8 and INTERPRETED)  # fmt: skip
            if IS_FP8:
                acc += tl.dot(a, w)
            else:
                acc += tl.dot(a, w, out_dtype=tl.int32)
    a_s = tl.load(as_ptr + offs_m, mask=mask_m, other=0.0)
    scaled_epilogue(
        acc, a_s[:, None], ws_ptr, b_ptr, out_ptr, sum_ptr, cnt_ptr, offs_m, offs_n, M, N, PER_TENSOR_W, HAS_BIAS,
        SPLIT_K,
    )


# ----------------------------------------------------------------------------- host launchers


def wq_gemm(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None,
    bias: torch.Tensor | None,
    bits: int,
    group: int,
    out: torch.Tensor,
) -> torch.Tensor:
    """Weight-only quantized GEMM into `out` [M, N]: out = x @ ((code - zero) * scale)^T (+ bias).

    x [M, K] contiguous fp16/bf16/fp32; group = K for per-channel. The variant comes from
    `choose_variant` (tuned table, else M <= 16); split-K's fp32 partials meet in the launch, the last split
    casting their sum into `out` (`splitk_join`).
    """
    m, k = x.shape
    n = qweight.shape[1]
    key = wq_table_key(n, k, group)
    variant = choose_variant(m, wq_op(bits), x.device, key)
    view = device_view(x.device)
    kinds = {"tiled": tiled_kind(m, n, x.dtype, view, bits), "splitk": splitk_kind(x.dtype, view, bits)}
    kind = kinds.get(variant, variant)
    cfg = launch_config(wq_table_op(bits, variant), kind, x.device, m, key)
    if variant == "dequant":
        dequant_matmul(x, qweight, scales, zeros, bias, bits, group, out, cfg)
        return out
    if variant == "gemv":
        wq_gemv(x, qweight, scales, zeros, bias, bits, group, out, cfg)
        return out
    # A K tile must not straddle a group: its single scale row is loaded once per tile.
    block_k = cfg["BLOCK_K"] if group == k else min(cfg["BLOCK_K"], group)
    if variant == "tiled":
        grid = (cdiv(m, cfg["BLOCK_M"]) * cdiv(n, cfg["BLOCK_N"]),)
        split, k_per_split = 1, k
    else:
        split, k_per_split = k_split(k, block_k, cfg["SPLIT_K"])
        grid = (cdiv(n, cfg["BLOCK_N"]), split, cdiv(m, cfg["BLOCK_M"]))
    # K slices meet in the launch (`splitk_join`); a single slice stores its tile directly.
    sums, cnt = join_buffers(x.device, m * n, grid[0] * grid[2]) if split > 1 else (out, out)
    dot_dtype = _dot_dtype(x.dtype, device_view(x.device))
    # zeros / bias stand-ins (scales) are never read when HAS_ZEROS / HAS_BIAS is False.
    _wq_kernel[grid](
        x, qweight, scales, scales if zeros is None else zeros, scales if bias is None else bias, out, sums, cnt,
        m, n, k, group_shift(group, k), k_per_split,
        BITS=bits, HAS_ZEROS=zeros is not None, HAS_BIAS=bias is not None, DOT_DTYPE=dot_dtype,
        # fp32 activations get fp32 products, as torch's fp32 matmul does: Triton's default (tf32) gave
        # 7.7e-4 relative error at K = 4096 on an H200; "ieee" passed there. It runs on the FMA units and
        # spills 1.8-3.3 KB per thread (sm_90 ptxas): fp32 is the correctness path, not the fast one.
        # ("tf32x3" keeps the tensor cores and spills <= 92 B; not yet checked on a GPU.)
        DOT_PREC="ieee" if x.dtype == torch.float32 else "tf32",
        # Split-K with fp16 / bf16 activations meets the codes in fp16 (not bf16 in the interpreter: its bf16
        # arithmetic is wrong).
        F16_CODES=variant == "splitk" and dot_dtype in (tl.float16, tl.bfloat16),
        BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], BLOCK_K=block_k, GROUP_M=cfg.get("GROUP_M", 1),
        SPLITK=variant == "splitk", USE_ATOMIC=split > 1, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
        MAGIC_DQ=variant == "tiled" and magic_dequant(bits, scales.dtype, dot_dtype),
        INTERPRETED=device_view(x.device).interpreted,
        # The tiled kernel may take every register: with only `.reqntid 256` ptxas aimed at 128 registers (two programs
        # an SM) on sm_80 and spilled 20 B for the symmetric W4A16 tile (150 registers, no spill with the limit).
        maxnreg=255 if variant == "tiled" else None,
    )  # fmt: skip
    return out


def quantize_per_token(x: torch.Tensor, fp8: bool, q: torch.Tensor, s: torch.Tensor) -> None:
    """Fill q [M, K] (int8 or float8_e4m3fn) and s [M] fp32 with the per-token quantization of x [M, K]."""
    m, k = x.shape
    cfg = launch_config(ACT_TABLE_OP, "act", x.device, m, act_table_key(k))
    block_k = min(cfg["BLOCK_K"], next_pow2(k))
    _act_quant_kernel[(m,)](
        x, q, s, k, QMAX=448.0 if fp8 else 127.0, IS_FP8=fp8, BLOCK_K=block_k,
        INTERPRETED=device_view(x.device).interpreted, num_warps=cfg["num_warps"],
    )  # fmt: skip


def w8a8_mm(
    x: torch.Tensor,
    fp8: bool,
    w: torch.Tensor,
    w_scale: torch.Tensor,
    bias: torch.Tensor | None,
    out: torch.Tensor,
) -> torch.Tensor:
    """out[M, N] = (q(x) @ w_codes) * s[:, None] * w_scale[None, :] (+ bias), (q, s) the per-token quantization
    of x [M, K] (fp16 / bf16 / fp32) to int8, or e4m3 when fp8, as `quantize_per_token` computes it.

    The variant comes from `choose_scaled_mm_variant`: "fusedq" quantizes inside the GEMM (`triton_fusedq`, one
    launch); "triton" and "torch" run `quantize_per_token` into a scratch buffer, then `scaled_mm`.
    """
    m, k = x.shape
    n = w.shape[1]
    variant = choose_scaled_mm_variant(m, n, k, fp8, out.dtype, x.device)
    if variant == "fusedq":
        table = scaled_mm_table_op(fp8, "fusedq")
        cfg = launch_config(table, "fusedq", x.device, m, scaled_mm_table_key(n, k))
        view = device_view(x.device)
        fusedq_mm(x, w, w_scale, bias, out, fp8, cfg, view.interpreted, view.sms)
        return out
    aq = torch.empty(x.shape, dtype=torch.float8_e4m3fn if fp8 else torch.int8, device=x.device)
    a_s = torch.empty(m, dtype=torch.float32, device=x.device)
    quantize_per_token(x, fp8, aq, a_s)
    return scaled_mm(aq, a_s, w, w_scale, bias, out, variant)


def scaled_mm(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    w: torch.Tensor,
    w_scale: torch.Tensor,
    bias: torch.Tensor | None,
    out: torch.Tensor,
    variant: str | None = None,
) -> torch.Tensor:
    """out[M, N] = (a @ w_codes) * a_scale[:, None] * w_scale[None, :] (+ bias).

    a: int8 [M, K] with w the native int32-packed int8 codes [K/4, N] or signed int8 codes [K, N], or a:
    float8_e4m3fn [M, K] with w float8_e4m3fn [K, N] (8-bit [K, N] weights by strides: `w_strides`). w_scale
    [1, N] per channel or [1, 1] per tensor. `variant` ("triton", "tma" or "torch") as `w8a8_mm` chose it, else
    chosen here; codes already quantized leave nothing to fuse, so a chosen "fusedq" runs ours ("triton"), and a
    forced one raises.

    Split-K (the config's SPLIT_K, here and in `triton_fusedq`; S splits of `k_split`, S > 1): every split adds its
    scaled partial into an fp32 sum that the last split to finish rounds into `out` (`splitk_join`). Error bound, u =
    2^-24, g_n = n u / (1 - n u), before the final rounding to out's dtype: |y - y_exact| <= g_(S+3) (|a_scale[m]
    w_scale[n]| sum_k |a[m, k] w[k, n]| + |bias[n]|). int8: each partial is an exact int32 (|P| <= 127 * 128 * K < 2^31
    for K < 2^17), then rounded at most 3 times (to fp32, exact while |P| < 2^24; x a_scale; x w_scale), the bias add
    once (split 0), the S - 1 atomic additions once each, in any order. SPLIT_K 1 is S = 1 (today's kernel, a direct
    store). e4m3: products are exact in fp32 and each partial is the dot's fp32 sum of <= K / S (rounded up to BLOCK_K)
    of them: g_(K/S + S + 3) for a sequential sum (the interpreter's); a GPU's fp8 MMA accumulates at its own precision.
    S = 2 is deterministic (0 + p0 + p1 = 0 + p1 + p0); from S = 3 on a GPU the atomics' order is not, so neither are
    the output's last bits.
    """
    m, k = a.shape
    fp8 = a.dtype == torch.float8_e4m3fn
    n = w.shape[1]
    variant = variant or choose_scaled_mm_variant(m, n, k, fp8, out.dtype, a.device)
    if variant == "fusedq":
        if forced_config_of(scaled_mm_variant_op(fp8)) is not None:
            raise CodesignError(
                f"the fusedq variant of the {'fp8' if fp8 else 'w8a8'} GEMM cannot run in scaled_mm: it quantizes "
                "the activations itself and was given codes; call w8a8_mm (or the op) with the activations"
            )
        variant = "triton"
    if variant == "torch":
        torch_mm.torch_scaled_mm(a, a_scale, w, w_scale, bias, out, fp8)
        return out
    if variant == "tma":
        view = device_view(a.device)
        # Codes given here may sit unaligned for TMA: then ours takes them, unless forced (which raises why).
        if forced_config_of(scaled_mm_variant_op(fp8)) is not None or not triton_tma.why_not(
            m, n, k, view, a
        ):
            cfg = launch_config(scaled_mm_table_op(fp8, "tma"), "tma", a.device, m, scaled_mm_table_key(n, k))
            triton_tma.tma_scaled_mm(a, a_scale, w, w_scale, bias, out, cfg, view)
            return out
    cfg = launch_config(scaled_mm_table_op(fp8), "scaled_mm", a.device, m, scaled_mm_table_key(n, k))
    split, k_per_split = k_split(k, cfg["BLOCK_K"], cfg["SPLIT_K"])
    grid = (cdiv(m, cfg["BLOCK_M"]) * cdiv(n, cfg["BLOCK_N"]), split)
    sums, cnt = join_buffers(a.device, m * n, grid[0]) if split > 1 else (out, out)
    _scaled_mm_kernel[grid](
        a,
        a_scale,
        w,
        w_scale,
        bias if bias is not None else w_scale,
        out,
        sums,
        cnt,
        m,
        n,
        k,
        k_per_split,
        *w_strides(w),
        IS_FP8=fp8,
        W_PACKED=w.dtype == torch.int32,
        INTERPRETED=device_view(a.device).interpreted,
        PER_TENSOR_W=w_scale.numel() == 1 and n > 1,
        HAS_BIAS=bias is not None,
        BLOCK_M=cfg["BLOCK_M"],
        BLOCK_N=cfg["BLOCK_N"],
        BLOCK_K=cfg["BLOCK_K"],
        GROUP_M=cfg["GROUP_M"],
        SPLIT_K=split,
        num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"],
    )
    return out
