"""Tunable-op adapters for the kernels in `codesign.kernels` (registered on import, kernels imported lazily).

Each adapter launches the kernel's own public launcher inside `lookup.forced_config(table_op, cfg)`,
so the tuner times exactly the code path a serving call takes, with the config the table would
hand it. Shapes:
    w4a16_gemm / w8a16_gemm: M, N, K, G (group size along K; G = K or 0 for per-channel), optional
                             SPLITK (1 split-K, 0 tiled) pinning the kernel variant; without it the
                             default rule's variant (M <= 16: split-K); `expand` gives both
    w8a8_gemm / fp8_gemm:    M, N, K (per-token int8 / e4m3 activations, per-channel weights)
    (more: adapters_kvq.py quantized-KV decode attention, adapters_act.py the activation quantizer,
    adapters_df11.py the fused DF11 GEMM)
    paged_attention:         M (batch of decode sequences), q_heads, kv_heads, head_dim, block_size, ctx
Candidate spaces are the GPU grids below; interpreter runs (no GPU) get a few large-block configs,
since the interpreter's cost is per program instance.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from codesign.autotune.lookup import forced_config, shape_key
from codesign.autotune.ops import Shape, register
from codesign.autotune.space import ConfigSpace, Resources, gemm_resources
from codesign.specs.errors import CodesignError

# ||out - ref|| / ||ref|| bounds per output dtype: fp32 accumulation everywhere; fp16/bf16 round the
# output (and the dequantized weight) once. A wrong config (bad split, unwritten tile) is O(1).
_TOL = {torch.float32: 1e-4, torch.float16: 3e-3, torch.bfloat16: 1.5e-2}


def _need(shape: Shape, names: tuple[str, ...], op: str) -> None:
    missing = [n for n in names if n not in shape]
    extra = [n for n in shape if n not in names]
    if missing or extra:
        raise CodesignError(f"shape for {op}: expected dims {', '.join(names)}; got {shape}")
    bad = [n for n in names if shape[n] < (0 if n in ("G", "SPLITK") else 1)]
    if bad:
        raise CodesignError(f"shape for {op}: dims {bad} must be positive, got {shape}")


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _pow2_cap(n: int, lo: int = 16) -> int:
    return max(lo, 1 << max(0, math.ceil(math.log2(max(n, 1)))))


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
        smem = (st - 1) * (bm * bk * a_bytes + bk * bn * bits // 8 + bn * a_bytes) + bk * bn * a_bytes + bm * bk * 2
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
    """w4a16_gemm / w8a16_gemm: Y = X @ dequant(W)^T by the split-K or the tiled kernel variant.

    Each variant has its own table ("<name>_splitk", "<name>_tiled") and space; which variant runs is
    the table "<name>_variant" (`variant_op`), exported from the two variants' best times at the same
    (shape key, M) (`export.export_variant_table`; `variant_configs` maps each variant's table to its
    entry there). A shape with SPLITK tunes that variant; `expand` turns a shape into both.
    """

    default_trial = True  # run(inputs, {}) is the untuned default (forced_config merges over it)

    source_modules = ("codesign.kernels.gemm.triton_gemm",)

    def __init__(self, bits: int) -> None:
        from codesign.kernels.gemm import triton_gemm  # noqa: F401  (unavailable kernel -> ImportError)

        self.bits = bits
        self.name = f"w{bits}a16_gemm"
        self.variant_op = f"{self.name}_variant"
        self.variant_configs = {f"{self.name}_splitk": {"SPLITK": 1}, f"{self.name}_tiled": {"SPLITK": 0}}

    def _group(self, shape: Shape) -> int:
        return shape["K"] if shape["G"] in (0, shape["K"]) else shape["G"]

    def check_shape(self, shape: Shape) -> None:
        _need(shape, ("M", "N", "K", "G", "SPLITK") if "SPLITK" in shape else ("M", "N", "K", "G"), self.name)
        if shape.get("SPLITK", 0) not in (0, 1):
            raise CodesignError(
                f"shape for {self.name}: SPLITK must be 1 (split-K) or 0 (tiled), got {shape}"
            )
        g = self._group(shape)
        if g not in (32, 64, 128, shape["K"]) or shape["K"] % g or shape["K"] % (32 // self.bits):
            raise CodesignError(
                f"shape for {self.name}: G must be 32, 64, 128 or K (0 = per-channel) and divide K, "
                f"K a multiple of {32 // self.bits}; got {shape}"
            )

    def _variant(self, shape: Shape) -> str:
        from codesign.kernels.gemm.triton_gemm import choose_variant

        if "SPLITK" in shape:
            return "splitk" if shape["SPLITK"] else "tiled"
        return choose_variant(shape["M"])  # the default rule (no device: no table)

    def expand(self, shape: Shape) -> list[Shape]:
        """`shape` once per kernel variant (SPLITK 1, then 0), so both are timed at the same M."""
        return [shape] if "SPLITK" in shape else [{**shape, "SPLITK": 1}, {**shape, "SPLITK": 0}]

    def table_op(self, shape: Shape) -> str:
        return f"{self.name}_{self._variant(shape)}"

    def table_key(self, shape: Shape) -> str:
        return shape_key(N=shape["N"], K=shape["K"], G=self._group(shape))

    def m(self, shape: Shape) -> int:
        return shape["M"]

    def space(self, shape: Shape, dtype: torch.dtype, on_gpu: bool) -> ConfigSpace:
        g, n, k, m = self._group(shape), shape["N"], shape["K"], shape["M"]
        a_bytes = torch.finfo(dtype).bits // 8
        res = _weight_only_resources(a_bytes, self.bits)
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
                and c["BLOCK_N"] <= max(_pow2_cap(n, 32), min(params["BLOCK_N"]))
                and c.get("BLOCK_M", 16) <= max(_pow2_cap(m), min(params.get("BLOCK_M", [16])))
            )

        return ConfigSpace(params=params, valid=valid, resources=res, fixed=fixed)

    def make_inputs(self, shape: Shape, dtype: torch.dtype, device: Any, seed: int) -> dict[str, Any]:
        from codesign.kernels.gemm import formats as qf

        gen = _gen(seed)
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
            "variant": {"SPLITK": int(self._variant(shape) == "splitk")},
        }  # fmt: skip

    def input_bytes(self, inputs: dict[str, Any]) -> int:
        return sum(inputs[k].numel() * inputs[k].element_size() for k in ("x", "qweight", "scales"))

    def poison(self, inputs: dict[str, Any]) -> None:
        inputs["out"].fill_(float("nan"))

    def run(self, inputs: dict[str, Any], config: dict[str, int]) -> torch.Tensor:
        from codesign.kernels.gemm.triton_gemm import wq_gemm

        i = inputs
        # The variant is forced too: a variant table on this GPU must not send the candidate elsewhere.
        with forced_config(self.variant_op, i["variant"]), forced_config(i["table_op"], config):
            wq_gemm(i["x"], i["qweight"], i["scales"], None, None, self.bits, i["group"], i["out"])
        return i["out"]

    def reference(self, inputs: dict[str, Any]) -> torch.Tensor:
        return inputs["x_cpu"].double() @ inputs["qw_cpu"].dequantize(torch.float64).t()

    def tolerance(self, dtype: torch.dtype) -> float:
        return _TOL[dtype]


class W8A8Gemm:
    """w8a8_gemm / fp8_gemm matmul: out = (q_x @ q_w) * s_x[m] * s_w[n] (int8 -> int32, or e4m3 -> fp32)."""

    default_trial = True  # run(inputs, {}) is the untuned default (forced_config merges over it)

    source_modules = ("codesign.kernels.gemm.triton_gemm",)

    def __init__(self, fp8: bool = False) -> None:
        from codesign.kernels.gemm import triton_gemm  # noqa: F401

        self.fp8 = fp8
        self.name = "fp8_gemm" if fp8 else "w8a8_gemm"
        self.fmt = "fp8_e4m3" if fp8 else "int8"

    def check_shape(self, shape: Shape) -> None:
        _need(shape, ("M", "N", "K"), self.name)
        if shape["K"] % 4:
            raise CodesignError(f"shape for {self.name}: K must be a multiple of 4, got {shape}")

    def table_op(self, shape: Shape) -> str:
        return self.name  # what `scaled_mm` looks up: "w8a8_gemm" or "fp8_gemm"

    def table_key(self, shape: Shape) -> str:
        return shape_key(N=shape["N"], K=shape["K"])

    def m(self, shape: Shape) -> int:
        return shape["M"]

    def space(self, shape: Shape, dtype: torch.dtype, on_gpu: bool) -> ConfigSpace:
        params = (
            {"BLOCK_M": [16, 32, 64, 128, 256], "BLOCK_N": [32, 64, 128, 256], "BLOCK_K": [64, 128, 256],
             "num_warps": [4, 8], "num_stages": [2, 3, 4, 5]}
            if on_gpu
            else {"BLOCK_M": [32, 64], "BLOCK_N": [64, 128], "BLOCK_K": [128], "num_warps": [4], "num_stages": [1]}
        )  # fmt: skip
        n, m = shape["N"], shape["M"]
        return ConfigSpace(
            params=params,
            valid=lambda c: (
                c["BLOCK_N"] <= max(_pow2_cap(n, 32), min(params["BLOCK_N"]))
                and c["BLOCK_M"] <= max(_pow2_cap(m), min(params["BLOCK_M"]))
            ),
            resources=_scaled_mm_resources(self.fp8),
            fixed={"GROUP_M": 8},
        )

    def make_inputs(self, shape: Shape, dtype: torch.dtype, device: Any, seed: int) -> dict[str, Any]:
        from codesign.kernels.gemm import formats as qf

        gen = _gen(seed)
        qw = qf.quantize_rtn(
            torch.randn(shape["N"], shape["K"], generator=gen), self.fmt, None, True, torch.float32
        )
        x = torch.randn(shape["M"], shape["K"], generator=gen)
        aq, a_s = qf.quantize_per_token(x, self.fmt)
        w64 = qw.dequantize(torch.float64).t()  # int8 and e4m3 codes are exact in fp64
        return {
            "aq": aq.to(device), "a_s": a_s.to(device), "w": qw.qweight.to(device), "w_s": qw.scales.to(device),
            "out": torch.empty(shape["M"], shape["N"], dtype=dtype, device=device),
            "ref": (aq.double() * a_s.double()[:, None]) @ w64,
        }  # fmt: skip

    def input_bytes(self, inputs: dict[str, Any]) -> int:
        return sum(inputs[k].numel() * inputs[k].element_size() for k in ("aq", "a_s", "w", "w_s"))

    def poison(self, inputs: dict[str, Any]) -> None:
        inputs["out"].fill_(float("nan"))

    def run(self, inputs: dict[str, Any], config: dict[str, int]) -> torch.Tensor:
        from codesign.kernels.gemm.triton_gemm import scaled_mm

        i = inputs
        with forced_config(self.table_op({}), config):
            scaled_mm(i["aq"], i["a_s"], i["w"], i["w_s"], None, i["out"])
        return i["out"]

    def reference(self, inputs: dict[str, Any]) -> torch.Tensor:
        return inputs["ref"]

    def tolerance(self, dtype: torch.dtype) -> float:
        return _TOL[dtype]


class PagedDecodeAttention:
    """paged_attention (decode): one query token per sequence over a paged K/V cache."""

    default_trial = True  # run(inputs, {}) is the untuned default (forced_config merges over it)

    name = "paged_attention"
    source_modules = ("codesign.kernels.attention.triton_attention",)
    _DIMS = ("M", "q_heads", "kv_heads", "head_dim", "block_size", "ctx")

    def __init__(self) -> None:
        from codesign.kernels.attention import paged  # noqa: F401

    def check_shape(self, shape: Shape) -> None:
        _need(shape, self._DIMS, self.name)
        if shape["q_heads"] % shape["kv_heads"]:
            raise CodesignError(f"shape for {self.name}: q_heads must be a multiple of kv_heads, got {shape}")

    def table_op(self, shape: Shape) -> str:
        return "paged_attention"

    def table_key(self, shape: Shape) -> str:
        s = shape
        return shape_key(q_heads=s["q_heads"], kv_heads=s["kv_heads"], head_dim=s["head_dim"],
                         block_size=s["block_size"])  # fmt: skip

    def m(self, shape: Shape) -> int:
        return shape["M"]

    def space(self, shape: Shape, dtype: torch.dtype, on_gpu: bool) -> ConfigSpace:
        params = (
            {"BLOCK_N": [16, 32, 64, 128, 256], "num_warps": [2, 4, 8], "num_stages": [1, 2, 3, 4]}
            if on_gpu
            else {"BLOCK_N": [32, 64], "num_warps": [4], "num_stages": [1]}
        )
        dpad = _pow2_cap(shape["head_dim"], 16)
        rows = max(16, _pow2_cap(shape["q_heads"] // shape["kv_heads"], 1))
        elt = torch.finfo(dtype).bits // 8

        def resources(c: dict[str, int]) -> Resources:
            smem = self.smem_estimate(c, dpad, rows, elt)
            regs = (rows * dpad + rows * c["BLOCK_N"]) // (32 * c["num_warps"]) + 40
            return Resources(smem, regs)

        # BLOCK_M only shapes extend/prefill programs; decode ignores it, so it is fixed here.
        cap_n = max(_pow2_cap(shape["ctx"]), min(params["BLOCK_N"]))
        return ConfigSpace(
            params=params, resources=resources, fixed={"BLOCK_M": 64}, valid=lambda c: c["BLOCK_N"] <= cap_n
        )

    @staticmethod
    def smem_estimate(c: dict[str, int], dpad: int, rows: int, elt: int) -> int:
        """Shared memory of one decode program: Triton keeps at most two K/V tile buffers whatever
        num_stages (compiled for sm_90: 74,240 B at BLOCK_N 128, head_dim 128 with 3 and with 4 stages),
        plus fp32 score rows: (2 if stages > 1 else 1) x BLOCK_N x dpad x elt + 2 x rows x BLOCK_N x 4.
        At or above the compiler's number on every sampled config (`autotune/compile_check.py`;
        `bench/results/lowering_estimates_sm90.json`), and below the old stages x 2 x BLOCK_N x dpad x elt,
        which pruned configs that fit."""
        bufs = 2 if c["num_stages"] > 1 else 1
        return bufs * c["BLOCK_N"] * dpad * elt + 2 * rows * c["BLOCK_N"] * 4

    def make_inputs(self, shape: Shape, dtype: torch.dtype, device: Any, seed: int) -> dict[str, Any]:
        gen = _gen(seed)
        b, hq, hkv, d, bs, ctx = (shape[n] for n in self._DIMS)
        per_seq = -(-ctx // bs)
        nblocks = b * per_seq + 1
        lens = torch.randint(max(1, ctx // 2), ctx + 1, (b,), generator=gen, dtype=torch.int32)
        lens[0] = ctx  # the longest sequence is always present
        tables = torch.randperm(nblocks, generator=gen)[: b * per_seq].reshape(b, per_seq).to(torch.int32)
        q = torch.randn(b, hq, d, generator=gen).to(dtype)
        k = torch.randn(nblocks, bs, hkv, d, generator=gen).to(dtype)
        v = torch.randn(nblocks, bs, hkv, d, generator=gen).to(dtype)
        dev = {n: t.to(device) for n, t in (("q", q), ("k", k), ("v", v), ("tables", tables), ("lens", lens))}
        return {**dev, "ref": dev, "lens_cpu": lens}

    def input_bytes(self, inputs: dict[str, Any]) -> int:
        lens, bs = inputs["lens_cpu"], inputs["k"].shape[1]
        kv_row = inputs["k"].shape[2] * inputs["k"].shape[3] * inputs["k"].element_size()
        return int(2 * sum(-(-int(n) // bs) * bs for n in lens) * kv_row + inputs["q"].numel() * 2)

    def run(self, inputs: dict[str, Any], config: dict[str, int]) -> torch.Tensor:
        from codesign.backend import use_backend
        from codesign.kernels.attention.paged import paged_decode_attention

        i = inputs
        with use_backend("triton", op="paged_attention"), forced_config("paged_attention", config):
            return paged_decode_attention(i["q"], i["k"], i["v"], i["tables"], i["lens"], check_data=False)

    def reference(self, inputs: dict[str, Any]) -> torch.Tensor:
        """Exact softmax attention in fp64, one sequence at a time, on the inputs' device; returned on the CPU.

        Reads inputs["ref"] (q, k, v as the cache holds them, block tables) and inputs["lens_cpu"]; only
        each sequence's own blocks are converted to fp64 (the whole pool in fp64 would be GBs).
        """
        c = inputs["ref"]
        q, k, v, tables = c["q"], c["k"], c["v"], c["tables"]
        b, hq, d = q.shape
        bs, hkv = k.shape[1], k.shape[2]
        out = torch.empty(b, hq, d, dtype=torch.float64, device=q.device)
        for s in range(b):
            n = int(inputs["lens_cpu"][s])
            blocks = tables[s, : -(-n // bs)].long()
            ks = k[blocks].reshape(-1, hkv, d)[:n].double().repeat_interleave(hq // hkv, dim=1)  # [n, hq, d]
            vs = v[blocks].reshape(-1, hkv, d)[:n].double().repeat_interleave(hq // hkv, dim=1)
            p = torch.softmax(torch.einsum("hd,nhd->hn", q[s].double(), ks) / math.sqrt(d), dim=-1)
            out[s] = torch.einsum("hn,nhd->hd", p, vs)
        return out.cpu()

    def tolerance(self, dtype: torch.dtype) -> float:
        return _TOL[dtype]


register("w4a16_gemm", lambda: WeightOnlyGemm(4))
register("w8a16_gemm", lambda: WeightOnlyGemm(8))
register("w8a8_gemm", W8A8Gemm)
register("fp8_gemm", lambda: W8A8Gemm(fp8=True))
register("paged_attention", PagedDecodeAttention)
