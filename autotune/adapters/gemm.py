"""Tunable adapters for the quantized GEMMs of `codesign.kernels.gemm.triton_gemm` (registered on import,
kernels imported lazily).

Each adapter launches the kernel's own public launcher inside `lookup.forced_config(table_op, cfg)`, with the
table name and shape key the kernel defines (`wq_table_op`, `wq_table_key`, `scaled_mm_table_op`, ...), so
the tuner times exactly the code path a serving call takes, with the config the table would hand it. Shapes:
    w4a16_gemm / w8a16_gemm: M, N, K, G (group size along K; G = K or 0 for per-channel), optional
                             SPLITK (1 split-K, 0 tiled), DEQUANT (1: dequantize, then torch.matmul) and
                             GEMV (1: the CUDA-core GEMV) pinning the variant; without them the default
                             rule's (`choose_variant`); `expand` gives all four
    w8a8_gemm / fp8_gemm:    M, N, K (per-token int8 / e4m3 activations, per-channel weights), optional
                             TORCH (1: torch._int_mm / torch._scaled_mm, 0: ours), FUSEDQ (1: ours with
                             the quantizer fused, one launch) and TMA (1: ours, persistent and TMA-fed)
                             pinning the variant; without them the default rule's (`choose_scaled_mm_variant`);
                             `expand` gives all four (TMA only where K % 16 == 0). The fused and two-launch
                             variants' spaces include SPLIT_K (K cut into that many ranges of whole BLOCK_K
                             tiles, no empty one)
Candidate spaces are the GPU grids below; interpreter runs (no GPU) get a few large-block configs,
since the interpreter's cost is per program instance.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from codesign.autotune.adapters.common import TOL, need_dims, pow2_cap, seeded
from codesign.autotune.lookup import forced_config
from codesign.autotune.ops import Shape, register
from codesign.autotune.space import ConfigSpace, Resources, gemm_resources
from codesign.specs.errors import CodesignError


def _weight_only_resources(a_bytes: int, bits: int) -> Callable[[dict[str, int]], Resources]:
    """The weight-only GEMM kernel's shared memory, as ptxas reports it for sm_90 (never under it on the
    sampled configs, `bench/results/lowering_estimates_sm90.json`): the packed weight words are loaded once
    (a [BLOCK_N, BLOCK_K / P] int32 tile, BK x BN x bits / 8 bytes), and num_stages - 1 buffers of (x tile,
    weight words, scale row) are pipelined plus one weight tile on its way to the dot and, since split-K
    meets fp16 codes with an fp16 copy of the activation tile, one more BM x BK x 2:
        (stages - 1) x (BM x BK x a + BK x BN x bits / 8 + BN x a) + BK x BN x a + BM x BK x 2.
    Registers: the accumulator estimate of `gemm_resources`."""
    regs = gemm_resources(a_bytes, 4)

    def estimate(c: dict[str, int]) -> Resources:
        bm, bn, bk, st = c["BLOCK_M"], c["BLOCK_N"], c["BLOCK_K"], max(2, c.get("num_stages", 2))
        smem = (
            (st - 1) * (bm * bk * a_bytes + bk * bn * bits // 8 + bn * a_bytes)
            + bk * bn * a_bytes
            + bm * bk * 2
        )
        return Resources(int(smem), regs(c).regs_per_thread)

    return estimate


def _scaled_mm_resources(fp8: bool) -> Callable[[dict[str, int]], Resources]:
    """W8A8 / FP8 GEMM shared memory, as ptxas reports it for sm_90 (`lowering_estimates_sm90.json`): fp8
    operands go from the pipelined loads straight to the dot, (stages - 1) x (BM x BK + BK x BN) plus one
    weight tile (exact on 64 x 32 x 128, over on the other sampled configs); int8 weights are unpacked from
    their words through one more tile, within stages x (BM x BK + BK x BN) (exact on 1 of 6, over on the
    others)."""
    base = gemm_resources(1, 1)

    def estimate(c: dict[str, int]) -> Resources:
        r = base(c)
        if fp8:
            per_stage = c["BLOCK_M"] * c["BLOCK_K"] + c["BLOCK_K"] * c["BLOCK_N"]
            return Resources(r.smem_bytes - per_stage + c["BLOCK_K"] * c["BLOCK_N"], r.regs_per_thread)
        return r

    return estimate


class WeightOnlyGemm:
    """w4a16_gemm / w8a16_gemm: Y = X @ dequant(W)^T by the GEMV, split-K, tiled or dequantize-then-matmul
    variant.

    Each variant has its own table ("<name>_gemv", "<name>_splitk", ...) and space; which
    variant runs is the table "<name>_variant" (`variant_op`), exported from the variants' best times at
    the same (shape key, M) (`export.export_variant_table`; `variant_configs` maps each variant's table to
    its entry there). A shape with SPLITK / DEQUANT / GEMV tunes that variant; `expand` turns a shape into all.
    """

    default_trial = True  # run(inputs, {}) is the untuned default (forced_config merges over it)

    source_modules = ("codesign.kernels.gemm.triton_gemm", "codesign.kernels.gemm.triton_dequant",
                      "codesign.kernels.gemm.triton_gemv")  # fmt: skip

    def __init__(self, bits: int) -> None:
        from codesign.kernels.gemm import triton_gemm  # unavailable kernel -> ImportError

        self.kernel = triton_gemm
        self.bits = bits
        self.name = triton_gemm.wq_op(bits)
        self.variant_op = triton_gemm.wq_variant_op(bits)
        self.variant_configs = {triton_gemm.wq_table_op(bits, v): triton_gemm.wq_variant_entry(v)
                                for v in triton_gemm.WQ_VARIANTS}  # fmt: skip

    def _group(self, shape: Shape) -> int:
        return shape["K"] if shape["G"] in (0, shape["K"]) else shape["G"]

    def check_shape(self, shape: Shape) -> None:
        need_dims(shape, ("M", "N", "K", "G", *(d for d in _PINS if d in shape)), self.name)
        if shape.get("SPLITK", 0) not in (0, 1):
            raise CodesignError(
                f"shape for {self.name}: SPLITK must be 1 (split-K) or 0 (tiled), got {shape}"
            )
        if any(shape.get(d, 0) not in (0, 1) for d in _PINS) or sum(shape.get(d, 0) for d in _PINS) > 1:
            raise CodesignError(
                f"shape for {self.name}: DEQUANT and GEMV must be 0 or 1, one pin at most; got {shape}"
            )
        g = self._group(shape)
        if g not in (32, 64, 128, shape["K"]) or shape["K"] % g or shape["K"] % (32 // self.bits):
            raise CodesignError(
                f"shape for {self.name}: G must be 32, 64, 128 or K (0 = per-channel) and divide K, "
                f"K a multiple of {32 // self.bits}; got {shape}"
            )

    def _variant(self, shape: Shape) -> str:
        if shape.get("DEQUANT"):
            return "dequant"
        if shape.get("GEMV"):
            return "gemv"
        if "SPLITK" in shape:
            return "splitk" if shape["SPLITK"] else "tiled"
        return self.kernel.choose_variant(shape["M"])  # the default rule (no device: no table)

    def expand(self, shape: Shape) -> list[Shape]:
        """`shape` once per variant (split-K, tiled, dequantize-then-matmul, GEMV), so all are timed at the same M."""
        if any(d in shape for d in _PINS):
            return [shape]
        return [{**shape, "SPLITK": 1}, {**shape, "SPLITK": 0}, {**shape, "SPLITK": 0, "DEQUANT": 1},
                {**shape, "SPLITK": 0, "GEMV": 1}]  # fmt: skip

    def table_op(self, shape: Shape) -> str:
        return self.kernel.wq_table_op(self.bits, self._variant(shape))

    def table_key(self, shape: Shape) -> str:
        return self.kernel.wq_table_key(shape["N"], shape["K"], self._group(shape))

    def m(self, shape: Shape) -> int:
        return shape["M"]

    def space(self, shape: Shape, dtype: torch.dtype, on_gpu: bool) -> ConfigSpace:
        g, n, k, m = self._group(shape), shape["N"], shape["K"], shape["M"]
        a_bytes = torch.finfo(dtype).bits // 8
        res = _weight_only_resources(a_bytes, self.bits)
        if self._variant(shape) == "dequant":
            return _dequant_space(on_gpu)
        if self._variant(shape) == "gemv":
            return _gemv_space(on_gpu, g, k)
        if self._variant(shape) == "splitk":
            params = (
                {"BLOCK_N": [32, 64, 128, 256], "BLOCK_K": [32, 64, 128, 256], "SPLIT_K": [1, 2, 4, 8, 16],
                 "num_warps": [2, 4, 8], "num_stages": [2, 3, 4]}
                if on_gpu
                else {"BLOCK_N": [64, 128], "BLOCK_K": [64, 128], "SPLIT_K": [1, 2], "num_warps": [4],
                      "num_stages": [1]}
            )  # fmt: skip
            fixed = {"BLOCK_M": 16}
        else:
            params = (
                {"BLOCK_M": [32, 64, 128, 256], "BLOCK_N": [32, 64, 128, 256], "BLOCK_K": [32, 64, 128],
                 "num_warps": [4, 8], "num_stages": [2, 3, 4, 5]}
                if on_gpu
                else {"BLOCK_M": [32, 64], "BLOCK_N": [64, 128], "BLOCK_K": [64, 128], "num_warps": [4],
                      "num_stages": [1]}
            )  # fmt: skip
            fixed = {"GROUP_M": 8}

        def valid(c: dict[str, int]) -> bool:
            # The kernel clamps BLOCK_K to the group and SPLIT_K to the K blocks: larger values would
            # only duplicate smaller configs; tiles far beyond the problem only waste programs.
            return (
                c["BLOCK_K"] <= g
                and c.get("SPLIT_K", 1) * c["BLOCK_K"] <= k
                and c["BLOCK_N"] <= max(pow2_cap(n, 32), min(params["BLOCK_N"]))
                and c.get("BLOCK_M", 16) <= max(pow2_cap(m), min(params.get("BLOCK_M", [16])))
            )

        return ConfigSpace(params=params, valid=valid, resources=res, fixed=fixed)

    def make_inputs(self, shape: Shape, dtype: torch.dtype, device: Any, seed: int) -> dict[str, Any]:
        from codesign.kernels.gemm import formats as qf

        gen = seeded(seed)
        g = self._group(shape)
        w = torch.randn(shape["N"], shape["K"], generator=gen)
        qw = qf.quantize_rtn(
            w, "int4" if self.bits == 4 else "int8", None if g == shape["K"] else g, True, dtype
        )
        x = torch.randn(shape["M"], shape["K"], generator=gen).to(dtype)
        return {
            "x": x.to(device), "qweight": qw.qweight.to(device), "scales": qw.scales.to(device),
            "out": torch.empty(shape["M"], shape["N"], dtype=dtype, device=device),
            "group": qw.group, "table_op": self.table_op(shape), "qw_cpu": qw, "x_cpu": x,
            "variant": self.kernel.wq_variant_entry(self._variant(shape)),
        }  # fmt: skip

    def input_bytes(self, inputs: dict[str, Any]) -> int:
        return sum(inputs[k].numel() * inputs[k].element_size() for k in ("x", "qweight", "scales"))

    def poison(self, inputs: dict[str, Any]) -> None:
        inputs["out"].fill_(float("nan"))

    def run(self, inputs: dict[str, Any], config: dict[str, int]) -> torch.Tensor:
        i = inputs
        # The variant is forced too: a variant table on this GPU must not send the candidate elsewhere.
        with forced_config(self.variant_op, i["variant"]), forced_config(i["table_op"], config):
            self.kernel.wq_gemm(
                i["x"], i["qweight"], i["scales"], None, None, self.bits, i["group"], i["out"]
            )
        return i["out"]

    def reference(self, inputs: dict[str, Any]) -> torch.Tensor:
        return inputs["x_cpu"].double() @ inputs["qw_cpu"].dequantize(torch.float64).t()

    def tolerance(self, dtype: torch.dtype) -> float:
        return TOL[dtype]


_PINS = ("SPLITK", "DEQUANT", "GEMV")  # shape dims that pin a weight-only variant


def _gemv_space(on_gpu: bool, group: int, k: int) -> ConfigSpace:
    """The GEMV's column tiles and K steps: at least one column a thread, at most 512 weights a thread a K step
    (1024 spilled on sm_90 in two of four sampled tiles), BLOCK_K within the group (or K). The K split follows
    from the grid (`triton_gemv.gemv_splits`)."""
    params = (
        {"BLOCK_K": [16, 32, 64, 128], "BLOCK_N": [128, 256, 512, 1024, 2048], "num_warps": [1, 2, 4, 8]}
        if on_gpu
        else {"BLOCK_K": [64, 128], "BLOCK_N": [128, 256], "num_warps": [2]}
    )
    return ConfigSpace(
        params=params,
        valid=lambda c: (
            c["BLOCK_K"] <= max(group, min(params["BLOCK_K"])) and c["BLOCK_K"] <= max(pow2_cap(k), 32)
            and c["BLOCK_N"] >= 32 * c["num_warps"] and c["BLOCK_N"] * c["BLOCK_K"] <= 512 * 32 * c["num_warps"]
        ),
        resources=_gemv_resources,
    )


def _gemv_resources(c: dict[str, int]) -> Resources:
    """The GEMV's shared memory (its atomics' staging: ptxas reported 1 KiB a warp on sm_90) and registers: ptxas
    allots 48-255 to one tile depending on how far it hoists the unrolled K step's loads, so the estimate is the
    floor (it never prunes a config that fits)."""
    return Resources(1024 * c["num_warps"], 48)


def _dequant_space(on_gpu: bool) -> ConfigSpace:
    """The dequantize kernel's tiles (then torch.matmul, which has no parameters of ours): registers hold one
    BLOCK_K x BLOCK_N tile of fp32 values, no shared memory."""
    params = (
        {"BLOCK_K": [8, 16, 32, 64], "BLOCK_N": [64, 128, 256, 512], "num_warps": [2, 4, 8]}
        if on_gpu
        else {"BLOCK_K": [64, 128], "BLOCK_N": [128], "num_warps": [4]}
    )
    return ConfigSpace(params=params, resources=lambda c: Resources(0, 32 + 2 * c["BLOCK_K"] * c["BLOCK_N"]
                                                                     // (32 * c["num_warps"])))  # fmt: skip


class W8A8Gemm:
    """w8a8_gemm / fp8_gemm from unquantized activations: out = (q(x) @ q_w) * s_x[m] * s_w[n] (int8 -> int32, or
    e4m3 -> fp32), by one of four variants (`triton_gemm.SCALED_MM_VARIANTS`): ours in two launches (the
    per-token quantizer, then the "<name>" table's GEMM), ours with the quantizer fused ("<name>_fusedq",
    `triton_fusedq`), the quantizer then ours persistent and TMA-fed ("<name>_tma", `triton_tma`), or torch's
    ("<name>_torch": one config, TORCH = 1, naming the variant: torch's matmul takes no parameters of ours); the
    variant table "<name>_variant" says which runs. Every variant is timed from x,
    quantizer included, so their times compare as a serving call sees them."""

    default_trial = True  # run(inputs, {}) is the untuned default (forced_config merges over it)

    source_modules = ("codesign.kernels.gemm.triton_gemm", "codesign.kernels.gemm.torch_mm",
                      "codesign.kernels.gemm.triton_fusedq", "codesign.kernels.gemm.triton_parts",
                      "codesign.kernels.gemm.triton_tma")  # fmt: skip

    def __init__(self, fp8: bool = False) -> None:
        from codesign.kernels.gemm import triton_gemm  # unavailable kernel -> ImportError

        self.kernel = triton_gemm
        self.fp8 = fp8
        self.name = triton_gemm.scaled_mm_table_op(fp8)
        self.fmt = "fp8_e4m3" if fp8 else "int8"
        self.variant_op = triton_gemm.scaled_mm_variant_op(fp8)
        self.variant_configs = {triton_gemm.scaled_mm_table_op(fp8, v): triton_gemm.scaled_mm_variant_entry(v)
                                for v in triton_gemm.SCALED_MM_VARIANTS}  # fmt: skip

    def check_shape(self, shape: Shape) -> None:
        need_dims(shape, ("M", "N", "K", *(d for d in _MM_PINS if d in shape)), self.name)
        if shape["K"] % 4:
            raise CodesignError(f"shape for {self.name}: K must be a multiple of 4, got {shape}")
        if any(shape.get(d, 0) not in (0, 1) for d in _MM_PINS) or sum(shape.get(d, 0) for d in _MM_PINS) > 1:
            raise CodesignError(
                f"shape for {self.name}: TORCH must be 1 (torch's matmul) or 0 (ours), FUSEDQ 1 (the quantizer "
                f"fused) or 0, TMA 1 (persistent, TMA-fed) or 0, one pin at most; got {shape}"
            )
        if shape.get("TMA") and shape["K"] % 16:
            raise CodesignError(
                f"shape for {self.name}: TMA needs K a multiple of 16 (16-byte rows), got {shape}"
            )

    def expand(self, shape: Shape) -> list[Shape]:
        """`shape` once per variant (ours in two launches, torch's, ours fused, ours TMA-fed where K % 16 == 0),
        so all are timed at the same M."""
        if any(d in shape for d in _MM_PINS):
            return [shape]
        tma = [{**shape, "TORCH": 0, "TMA": 1}] if shape["K"] % 16 == 0 else []
        return [{**shape, "TORCH": 0}, {**shape, "TORCH": 1}, {**shape, "TORCH": 0, "FUSEDQ": 1}, *tma]

    def _variant(self, shape: Shape) -> str:
        if shape.get("TORCH"):
            return "torch"
        if shape.get("FUSEDQ"):
            return "fusedq"
        if shape.get("TMA"):
            return "tma"
        if any(d in shape for d in _MM_PINS):
            return "triton"
        return self.kernel.choose_scaled_mm_variant(
            shape["M"], shape["N"], shape["K"], self.fp8, torch.float32, torch.device("cpu")
        )  # the default rule (a CPU device: no table)

    def table_op(self, shape: Shape) -> str:
        return self.kernel.scaled_mm_table_op(self.fp8, self._variant(shape))

    def table_key(self, shape: Shape) -> str:
        return self.kernel.scaled_mm_table_key(shape["N"], shape["K"])

    def m(self, shape: Shape) -> int:
        return shape["M"]

    def space(self, shape: Shape, dtype: torch.dtype, on_gpu: bool) -> ConfigSpace:
        variant = self._variant(shape)
        if variant == "torch":
            return ConfigSpace(params={"TORCH": [1]}, resources=lambda c: Resources(0, 0))
        if variant == "fusedq":  # 16-row tiles and up: the decode M it is for, and the tl.dot minimum
            params = (
                {"BLOCK_M": [16, 32, 64], "BLOCK_N": [32, 64, 128, 256], "BLOCK_K": [64, 128, 256],
                 "SPLIT_K": [1, 2, 4, 8], "num_warps": [4, 8], "num_stages": [2, 3, 4, 5]}
                if on_gpu
                else {"BLOCK_M": [16, 32], "BLOCK_N": [64, 128], "BLOCK_K": [128], "SPLIT_K": [1, 2], "num_warps": [4],
                      "num_stages": [1]}
            )  # fmt: skip
            res = _fusedq_resources(torch.finfo(dtype).bits // 8, self.fp8)
        elif variant == "tma":  # wgmma needs 64-row tiles and whole warpgroups (below: mma.sync)
            params = (
                {"BLOCK_M": [64, 128, 256], "BLOCK_N": [64, 128, 256], "BLOCK_K": [64, 128], "num_warps": [4, 8],
                 "num_stages": [2, 3, 4, 5]}
                if on_gpu
                else {"BLOCK_M": [64], "BLOCK_N": [64, 128], "BLOCK_K": [64, 128], "num_warps": [4], "num_stages": [1]}
            )  # fmt: skip
            res = _tma_resources(self.fp8, torch.finfo(dtype).bits // 8)
        else:
            params = (
                {"BLOCK_M": [16, 32, 64, 128, 256], "BLOCK_N": [32, 64, 128, 256], "BLOCK_K": [64, 128, 256],
                 "SPLIT_K": [1, 2, 4, 8], "num_warps": [4, 8], "num_stages": [2, 3, 4, 5]}
                if on_gpu
                else {"BLOCK_M": [32, 64], "BLOCK_N": [64, 128], "BLOCK_K": [128], "SPLIT_K": [1, 2], "num_warps": [4],
                      "num_stages": [1]}
            )  # fmt: skip
            res = _scaled_mm_resources(self.fp8)
        from codesign.kernels.gemm.triton_parts import k_split

        n, m, k = shape["N"], shape["M"], shape["K"]
        return ConfigSpace(
            params=params,
            valid=lambda c: (
                c["BLOCK_N"] <= max(pow2_cap(n, 32), min(params["BLOCK_N"]))
                and c["BLOCK_M"] <= max(pow2_cap(m), min(params["BLOCK_M"]))
                # A SPLIT_K the launcher would cut down (more splits than K has tiles, or an empty last one) only
                # repeats a smaller config.
                and k_split(k, c["BLOCK_K"], c.get("SPLIT_K", 1))[0] == c.get("SPLIT_K", 1)  # tma: no split
            ),
            resources=res,
            fixed={"GROUP_M": 8},
        )

    def make_inputs(self, shape: Shape, dtype: torch.dtype, device: Any, seed: int) -> dict[str, Any]:
        from codesign.kernels.gemm import formats as qf

        gen = seeded(seed)
        qw = qf.quantize_rtn(
            torch.randn(shape["N"], shape["K"], generator=gen), self.fmt, None, True, torch.float32
        )
        x = torch.randn(shape["M"], shape["K"], generator=gen).to(dtype)
        aq, a_s = qf.quantize_per_token(x, self.fmt)
        w64 = qw.dequantize(torch.float64).t()  # int8 and e4m3 codes are exact in fp64
        # int8: the signed K-contiguous codes `QuantLinear` runs (a config tuned on packed words would tune another
        # kernel: the tile is unpacked, not streamed)
        w = qw.qweight if self.fp8 else qf.int8_codes_nk(qw.qweight).t()
        return {
            "x": x.to(device), "w": w.to(device), "w_s": qw.scales.to(device),
            "out": torch.empty(shape["M"], shape["N"], dtype=dtype, device=device),
            "ref": (aq.double() * a_s.double()[:, None]) @ w64,
            "table_op": self.table_op(shape), "variant": self.kernel.scaled_mm_variant_entry(self._variant(shape)),
        }  # fmt: skip

    def input_bytes(self, inputs: dict[str, Any]) -> int:
        return sum(inputs[k].numel() * inputs[k].element_size() for k in ("x", "w", "w_s"))

    def poison(self, inputs: dict[str, Any]) -> None:
        inputs["out"].fill_(float("nan"))

    def run(self, inputs: dict[str, Any], config: dict[str, int]) -> torch.Tensor:
        i = inputs
        # The variant is forced too: a variant table on this GPU must not send the candidate elsewhere.
        with forced_config(self.variant_op, i["variant"]), forced_config(i["table_op"], config):
            self.kernel.w8a8_mm(i["x"], self.fp8, i["w"], i["w_s"], None, i["out"])
        return i["out"]

    def reference(self, inputs: dict[str, Any]) -> torch.Tensor:
        return inputs["ref"]

    def tolerance(self, dtype: torch.dtype) -> float:
        return TOL[dtype]


_MM_PINS = ("TORCH", "FUSEDQ", "TMA")  # shape dims that pin a W8A8 / FP8 variant


def _tma_resources(fp8: bool, out_bytes: int) -> Callable[[dict[str, int]], Resources]:
    """The persistent TMA kernel (`triton_tma`): shared memory holds num_stages (A, W) tile pairs of 1-byte codes
    and the epilogue's tile of at most 128 x 128 outputs (ptxas for sm_90: 32,800 B at 128 x 128 and 128 x 256 on
    8 warps with bf16 outputs, 65,568 with fp32, 8,224 on 4 warps), plus barriers; registers 40 (int8) or 70
    (e4m3) plus 1.5 per accumulator element of a thread:
        smem = stages x (BM + BN) x BK + min(BM x BN, 16384) x out_bytes + 64,
        regs = 40 / 70 + 1.5 x BM x BN / (32 x num_warps).
    Shared memory at or over ptxas on the configs sampled. Registers move with the output dtype, bias and N's
    alignment (int8 128 x 128 x 128 on 8 warps: 127-198, e4m3 153-170, no spills): the estimate is a floor there,
    and over ptxas where e4m3 spilled (128 x 256 on 8 warps, 128 x 128 on 4)."""

    def estimate(c: dict[str, int]) -> Resources:
        bm, bn, bk, st = c["BLOCK_M"], c["BLOCK_N"], c["BLOCK_K"], max(1, c.get("num_stages", 1))
        regs = (70 if fp8 else 40) + 3 * bm * bn // (2 * 32 * c.get("num_warps", 4))
        return Resources(st * (bm + bn) * bk + min(bm * bn, 16384) * out_bytes + 64, regs)

    return estimate


def _fusedq_resources(a_bytes: int, fp8: bool) -> Callable[[dict[str, int]], Resources]:
    """The fused-quantizer kernel: shared memory as `gemm_resources` counts it with the activation tile in its
    own dtype (a_bytes an element, not the codes' 1); registers hold the accumulator, the A tile twice (fp32
    values, then codes) and the weight tile on its way to mma.sync (int8: half a register an element, e4m3: one):
        40 + BM x BN / T + 2 x BM x BK / T + (1/2 or 1) x BK x BN / T, T = 32 x num_warps.
    Bounds over what ptxas reported for sm_90 on 16 sampled configs (fp16 / fp32 activations; 16 x 128 x 64 on
    4 warps: fp8 136 of 136, int8 104 for 64; the ones estimated over 255 all spilled)."""
    smem = gemm_resources(a_bytes, 1)

    def estimate(c: dict[str, int]) -> Resources:
        bm, bn, bk, t = c["BLOCK_M"], c["BLOCK_N"], c["BLOCK_K"], 32 * c.get("num_warps", 4)
        regs = 40 + (bm * bn + 2 * bm * bk + (bk * bn if fp8 else bk * bn // 2)) // t
        return Resources(smem(c).smem_bytes, regs)

    return estimate


register("w4a16_gemm", lambda: WeightOnlyGemm(4))
register("w8a16_gemm", lambda: WeightOnlyGemm(8))
register("w8a8_gemm", W8A8Gemm)
register("fp8_gemm", lambda: W8A8Gemm(fp8=True))
