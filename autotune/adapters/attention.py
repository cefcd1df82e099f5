"""Tunable adapters for paged decode attention (`codesign.kernels.attention`), over a plain cache and over each
quantized cache type of `codesign.kernels.kvcache`.

Registered ops: paged_attention (`paged_decode_attention`, a plain cache); one per quantized format with a table
of its own (`kvcache.formats.ATTENTION_TABLE_FORMATS`): paged_attention_int8, _int4, _int2, _fp8
(`kvq_decode_attention`); paged_attention_mixed (`mixed_attention`: per-block 8/4/2-bit codes,
Cocktail-style, a third of the blocks at each width, placed at random); paged_attention_kivi
(`kivi_decode_attention`: 4-bit KIVI with its fp16 residual ring; reference from `dequantize_seq`);
paged_attention_oaken (`oaken_attention`: 4-bit Oaken with fp16 metadata, thresholds calibrated on
the data's first tokens, 4 % outliers and outlier slots).
Shape and config space are those of `paged_attention` (M decode sequences, q_heads, kv_heads,
head_dim, block_size, ctx; BLOCK_N, num_warps, num_stages): the same kernel runs, with the
dequantization of each K/V tile fused into its inner loop, which moves the best tile size (more
integer work per byte, fewer bytes per token). The cache is filled by the format's own writer, on
the device, and the fp64 reference is exact attention over the dequantized cache, so a candidate
is judged on the attention alone, not on the quantization error.

Table: the name and key the kernel reads, from `attention.launch_rules.table_op` / `table_key` (a quantized
cache reads `paged_attention_<fmt>`, else its format's own defaults, never the plain table).
"""

from __future__ import annotations

import dataclasses
import importlib
import math
from typing import Any

import torch

from codesign.autotune.adapters.common import TOL, need_dims, pow2_cap, seeded
from codesign.autotune.lookup import forced_config
from codesign.autotune.ops import Shape, register
from codesign.autotune.space import ConfigSpace, Resources
from codesign.kernels.kvcache.formats import (
    ATTENTION_TABLE_FORMATS,
    KV_FORMAT_INT,
    KV_FORMAT_KIVI,
    KV_FORMAT_MIXED,
    KV_FORMAT_OAKEN,
    KVQ_FORMATS,
    kernel_format,
)
from codesign.specs import KVFormat
from codesign.specs.errors import CodesignError


class PagedDecodeAttention:
    """paged_attention (decode): one query token per sequence over a paged K/V cache."""

    default_trial = True  # run(inputs, {}) is the untuned default (forced_config merges over it)

    name = "paged_attention"
    # the kernel and its launch rules (a table is merged over their defaults)
    source_modules = ("codesign.kernels.attention.triton_attention", "codesign.kernels.attention.launch_rules")
    _DIMS = ("M", "q_heads", "kv_heads", "head_dim", "block_size", "ctx")

    kv_format = KVFormat()  # the cache the kernel reads (its table name)

    def __init__(self) -> None:
        from codesign.kernels.attention import launch_rules, triton_attention  # noqa: F401  (unavailable kernel -> ImportError)

        self.rules = launch_rules

    def check_shape(self, shape: Shape) -> None:
        need_dims(shape, self._DIMS, self.name)
        if shape["q_heads"] % shape["kv_heads"]:
            raise CodesignError(f"shape for {self.name}: q_heads must be a multiple of kv_heads, got {shape}")

    def table_op(self, shape: Shape) -> str:
        return self.rules.table_op(*kernel_format(self.kv_format))

    def table_key(self, shape: Shape) -> str:
        s = shape
        return self.rules.table_key(s["q_heads"], s["kv_heads"], s["head_dim"], s["block_size"])

    def m(self, shape: Shape) -> int:
        return shape["M"]

    def space(self, shape: Shape, dtype: torch.dtype, on_gpu: bool) -> ConfigSpace:
        params = (
            {"BLOCK_N": [16, 32, 64, 128, 256], "num_warps": [2, 4, 8], "num_stages": [1, 2, 3, 4]}
            if on_gpu
            else {"BLOCK_N": [32, 64], "num_warps": [4], "num_stages": [1]}
        )
        dpad = pow2_cap(shape["head_dim"], 16)
        rows = max(16, pow2_cap(shape["q_heads"] // shape["kv_heads"], 1))
        elt = torch.finfo(dtype).bits // 8

        def resources(c: dict[str, int]) -> Resources:
            smem = self.smem_estimate(c, dpad, rows, elt)
            regs = (rows * dpad + rows * c["BLOCK_N"]) // (32 * c["num_warps"]) + 40
            return Resources(smem, regs)

        # BLOCK_M only shapes extend/prefill programs; decode ignores it, so it is fixed here.
        cap_n = max(pow2_cap(shape["ctx"]), min(params["BLOCK_N"]))
        return ConfigSpace(
            params=params, resources=resources, fixed={"BLOCK_M": 64}, valid=lambda c: c["BLOCK_N"] <= cap_n
        )

    @staticmethod
    def smem_estimate(c: dict[str, int], dpad: int, rows: int, elt: int) -> int:
        """Shared memory of one decode program: Triton keeps at most two K/V tile buffers whatever
        num_stages (compiled for sm_90: 74,240 B at BLOCK_N 128, head_dim 128 with 3 and with 4 stages),
        plus fp32 score rows: (2 if stages > 1 else 1) x BLOCK_N x dpad x elt + 2 x rows x BLOCK_N x 4.
        At or above the compiler's number on every sampled config (`autotune/compile_check.py`;
        `bench/results/lowering_estimates_sm90.json`)."""
        bufs = 2 if c["num_stages"] > 1 else 1
        return bufs * c["BLOCK_N"] * dpad * elt + 2 * rows * c["BLOCK_N"] * 4

    def make_inputs(self, shape: Shape, dtype: torch.dtype, device: Any, seed: int) -> dict[str, Any]:
        gen = seeded(seed)
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
        with use_backend("triton", op="paged_attention"), forced_config(self.table_op({}), config):
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
        return TOL[dtype]


# The quantized formats with an attention table of their own (`kvcache.formats`); KIVI has its own adapter below.
FORMATS = tuple(f for f in ATTENTION_TABLE_FORMATS if f != "kivi")
OAKEN_BITS = 4
OAKEN_OUTLIERS = 0.04  # fraction of elements outside the thresholds, and of outlier slots (Oaken's 4 %)
# format -> (its spec format at the width tuned, the attention entry point of `attention.quantized`)
_ENTRY = {
    **{f: (KVQ_FORMATS[f], "kvq_decode_attention") for f in KVQ_FORMATS},
    "mixed": (KVFormat.parse("mixed"), "mixed_attention"),
    "oaken": (KVFormat(dtype=f"int{OAKEN_BITS}", scheme="oaken"), "oaken_attention"),
}
QUANTIZED = "codesign.kernels.attention.quantized"


class QuantKVDecodeAttention(PagedDecodeAttention):
    """paged_attention_<fmt>: decode attention over a quantized cache of format `fmt` (module docstring)."""

    def __init__(self, fmt: str) -> None:
        super().__init__()
        self.kv_format, self.entry = _ENTRY[fmt]
        importlib.import_module(QUANTIZED)  # unavailable kernel -> ImportError
        # the decode paths a config key chooses (BY_WIDTH, SPLIT) run kernels of their own modules
        path = {"mixed": ("codesign.kernels.attention.mixed_by_width",),
                "oaken": ("codesign.kernels.attention.oaken_split",)}.get(fmt, ())  # fmt: skip
        self.source_modules = (*PagedDecodeAttention.source_modules, QUANTIZED, *path)
        self.fmt = fmt
        self.name = f"paged_attention_{fmt}"

    def check_shape(self, shape: Shape) -> None:
        super().check_shape(shape)
        d = shape["head_dim"]
        per = {"int2": 4, "mixed": 4, "int4": 2, "oaken": 8 // OAKEN_BITS}.get(self.fmt, 1)
        if d % per or (self.fmt == "oaken" and shape["block_size"] * d >= 2**15):
            raise CodesignError(
                f"shape for {self.name}: head_dim must fill whole bytes of codes (a multiple of {per})"
                + (" and block_size * head_dim < 32768" if self.fmt == "oaken" else "")
                + f"; got {shape}"
            )

    def space(self, shape: Shape, dtype: torch.dtype, on_gpu: bool) -> ConfigSpace:
        """The decode space; INT8 on GPUs also tries reading its codes as int32 words (WORDS8 1: 16-byte copies,
        a shift and a mask per element) against bytes (0); INT8 / INT4 / INT2 (and KIVI's keys) with 16-bit queries
        where the kernel can dot code planes (`launch_rules.reads_planes`) try them against the joined tile (PLANES
        1 / 0), and one warp a program (the planes' default tile for INT4 / INT2 at head_dim 128), KIVI's value planes
        on tiles of few enough warps (VPLANES 1 / 0, `reads_value_planes`, at the shape's bits); the mixed cache decodes
        width by width (BY_WIDTH 1, on its default tile: the tile is then the INT launches') or in one launch (0), and
        the Oaken cache in three launches (SPLIT 1, `attention.oaken_split`, likewise on its default tile) or in one
        (0)."""
        sp = super().space(shape, dtype, on_gpu)
        params, valid = dict(sp.params), sp.valid
        if self.fmt == "int8" and on_gpu and shape["head_dim"] % 4 == 0:
            params["WORDS8"] = [0, 1]
        lr = importlib.import_module("codesign.kernels.attention.launch_rules")
        kivi_bits = self._format(shape)[0] if self.fmt == "kivi" else 0
        kf, bits = {"int4": (KV_FORMAT_INT, 4), "int8": (KV_FORMAT_INT, 8), "int2": (KV_FORMAT_INT, 2),
                    "kivi": (KV_FORMAT_KIVI, kivi_bits)}.get(self.fmt, (None, 0))  # fmt: skip
        d = shape["head_dim"]
        if on_gpu and bits and dtype != torch.float32 and lr.reads_planes(kf, bits, d, {"BLOCK_N": 64}):
            params["PLANES"] = [0, 1]
            params["num_warps"] = [1, *params["num_warps"]]

            def valid(c, v=sp.valid, kf=kf, bits=bits, d=d):  # PLANES 1 where the kernel takes it (else a duplicate)
                planes = c.get("WORDS8", 1) == 1 and lr.reads_planes(kf, bits, d, c)
                return v(c) and (c["PLANES"] == 0 or planes)
        if self.fmt == "kivi" and "PLANES" in params:  # value planes too, where the tile's warps allow them
            params["VPLANES"] = [0, 1]

            def valid(c, v=valid, d=d, bits=bits):
                vplanes = c["PLANES"] == 1 and lr.reads_value_planes(KV_FORMAT_KIVI, bits, d, c)
                return v(c) and (c["VPLANES"] == 0 or vplanes)
        if self.fmt == "mixed" and on_gpu:  # decode width by width (its INT launches read their own tables) or in one
            params["BY_WIDTH"] = [0, 1]
            base = lr.default_config(d, torch.finfo(dtype).bits // 8, KV_FORMAT_MIXED, 8, shape["block_size"])
            tile = ("BLOCK_N", "num_warps", "num_stages")

            def valid(c, v=sp.valid, base=base, tile=tile):  # BY_WIDTH 1 ignores the tile: one config of it
                return v(c) and (c["BY_WIDTH"] == 0 or all(c[k] == base[k] for k in tile))
        if self.fmt == "oaken" and on_gpu:  # three launches (the INT launch reads its own table) or one
            params["SPLIT"] = [0, 1]
            base = lr.default_config(d, torch.finfo(dtype).bits // 8, KV_FORMAT_OAKEN, 4, shape["block_size"])
            tile = ("BLOCK_N", "num_warps", "num_stages")

            def valid(c, v=sp.valid, base=base, tile=tile):  # SPLIT 1 ignores the tile: one config of it
                return v(c) and (c["SPLIT"] == 0 or all(c[k] == base[k] for k in tile))
        return dataclasses.replace(sp, params=params, valid=valid)

    def make_inputs(self, shape: Shape, dtype: torch.dtype, device: Any, seed: int) -> dict[str, Any]:
        gen = seeded(seed)
        b, hq, hkv, d, bs, ctx = (shape[n] for n in self._DIMS)
        per_seq = -(-ctx // bs)
        nblocks = b * per_seq + 1
        lens = torch.randint(max(1, ctx // 2), ctx + 1, (b,), generator=gen, dtype=torch.int32)
        lens[0] = ctx
        tables = torch.randperm(nblocks, generator=gen)[: b * per_seq].reshape(b, per_seq).to(torch.int32)
        q = torch.randn(b, hq, d, generator=gen).to(dtype).to(device)
        # K/V are drawn and quantized on the device (the writer kernel on a GPU: a full-size cache
        # quantized on the CPU takes tens of seconds); the codes are what the attention reads.
        dev = torch.device(device)
        g = torch.Generator(dev).manual_seed(seed)
        k = torch.randn(nblocks * bs, hkv, d, generator=g, device=dev)
        v = torch.randn(nblocks * bs, hkv, d, generator=g, device=dev)
        cache = _write_cache(self.fmt, k, v, nblocks, bs, gen)
        del k, v
        tables, lens = tables.to(dev), lens.to(dev)
        # The reference's dequantized pool is built when `reference` first asks (compile-only runs never do).
        return {"q": q, "cache": cache, "tables": tables, "lens": lens, "lens_cpu": lens.cpu()}

    def reference(self, inputs: dict[str, Any]) -> torch.Tensor:
        """The parent's fp64 attention over the pool as the cache holds it (float32, exact: code * fp16 scale +
        fp16 zero, Oaken's outliers written back, or e4m3 * scale), dequantized once, on first use."""
        if "ref" not in inputs:
            c = inputs["cache"]
            kd, vd = _dequantize_mixed(c) if self.fmt == "mixed" else c.dequantize()
            inputs["ref"] = {"q": inputs["q"], "k": kd, "v": vd, "tables": inputs["tables"]}
        return super().reference(inputs)

    def input_bytes(self, inputs: dict[str, Any]) -> int:
        c, lens = inputs["cache"], inputs["lens_cpu"]
        bs, h, w = c.k_codes.shape[1:]
        if self.fmt == "mixed":  # rows are D bytes apart, but a block of b bits reads D * b / 8 of them
            w = w * float(c.block_bits.float().mean()) / 8
        row = h * w + (h * 4 if c.k_meta.dim() == 4 else 0)  # codes + fp16 (scale, zero) per token
        if self.fmt == "oaken":  # + the block's outlier slots (int32 each), per token
            row += h * c.k_out.shape[2] * 4 / bs
        return int(2 * sum(-(-int(n) // bs) * bs for n in lens) * row + inputs["q"].numel() * 2)

    def run(self, inputs: dict[str, Any], config: dict[str, int]) -> torch.Tensor:
        from codesign.backend import use_backend

        i = inputs
        attend = getattr(importlib.import_module(QUANTIZED), self.entry)
        with use_backend("triton", op="paged_attention"), forced_config(self.table_op({}), config):
            return attend(i["q"], i["cache"], i["tables"], i["lens"], check_data=False)


def _write_cache(
    fmt: str, k: torch.Tensor, v: torch.Tensor, nblocks: int, bs: int, gen: torch.Generator
) -> Any:
    """A cache of format `fmt` holding k, v `[nblocks * bs, kv_heads, D]` in slot order, by its own writer."""
    from codesign.kernels.kvcache import quantizers as kvq

    _, hkv, d = k.shape
    dev = k.device
    slots = torch.arange(nblocks * bs, dtype=torch.int64, device=dev)
    if fmt == "mixed":
        from codesign.kernels.kvcache.mixed import MIXED_BITS, MixedPagedKV, mixed_write

        cache = MixedPagedKV.empty(nblocks, bs, hkv, d, dev)
        order = torch.randperm(nblocks, generator=gen).tolist()  # a third of the blocks per width
        cache.set_block_bits(order, [MIXED_BITS[i % len(MIXED_BITS)] for i in range(nblocks)])
        mixed_write(k, v, cache, slots, check_data=False)
        return cache
    if fmt == "oaken":
        from codesign.kernels.kvcache.oaken import OakenPagedKV, default_capacity

        # Thresholds calibrated offline, as Oaken does: here on the first 4096 tokens of the data.
        thr = kvq.calibrate_kv_thresholds([(k[:4096].cpu(), v[:4096].cpu())], OAKEN_OUTLIERS)[0]
        cap = default_capacity(OAKEN_OUTLIERS, bs, d)
        cache = OakenPagedKV.empty(nblocks, bs, hkv, d, OAKEN_BITS, thr, cap, dev)
        cache.write(k, v, slots)
        return cache
    from codesign.kernels.kvcache.kvq import QuantPagedKV, kvq_write

    scales = (kvq.fp8_head_scales(k), kvq.fp8_head_scales(v)) if fmt == "fp8" else (None, None)
    cache = QuantPagedKV.empty(nblocks, bs, hkv, d, fmt, dev, *scales)
    kvq_write(k, v, cache, slots, check_data=False)
    return cache


class KiviDecodeAttention(QuantKVDecodeAttention):
    """paged_attention_kivi: `kivi_decode_attention` (4-bit KIVI: keys per channel over groups of G
    tokens, values per token; the newest tokens in an fp16 residual ring). Optional shape dims bits
    (default 4), group (default min(32, block_size)) and residual (default 4 * group) set the format;
    they do not enter the table key (the kernel's key does not hold them)."""

    _KIVI = ("bits", "group", "residual")

    def __init__(self) -> None:
        PagedDecodeAttention.__init__(self)
        from codesign.kernels.attention import quantized  # noqa: F401  (unavailable kernel -> ImportError)

        self.kv_format = KVFormat.parse("int4-kivi")  # the table does not depend on the width
        self.entry = "kivi_decode_attention"
        self.fmt = "kivi"
        self.name = "paged_attention_kivi"
        self.source_modules = (
            *PagedDecodeAttention.source_modules,
            "codesign.kernels.attention.quantized",
            "codesign.kernels.kvcache.kivi",
            "codesign.kernels.kvcache.triton_kivi_flush",
        )

    @staticmethod
    def smem_estimate(c: dict[str, int], dpad: int, rows: int, elt: int) -> int:
        """KIVI with its codes read as int32 words (compiled for sm_90): 123,392 B at BLOCK_N 128 in 3 or 4
        stages, 241,664 B at 256 in 2, so at most two buffers: min(stages, 2) x 2 x BLOCK_N x dpad x elt,
        above every sampled config. (The byte-gather kernel before grew with stages: 237,568 B at 128 in 4.)"""
        return min(max(1, c["num_stages"]), 2) * 2 * c["BLOCK_N"] * dpad * elt

    def _format(self, shape: Shape) -> tuple[int, int, int]:
        g = shape.get("group", min(32, shape["block_size"]))
        return shape.get("bits", 4), g, shape.get("residual", 4 * g)

    def check_shape(self, shape: Shape) -> None:
        PagedDecodeAttention.check_shape(self, {n: v for n, v in shape.items() if n not in self._KIVI})
        bits, g, r = self._format(shape)
        d, bs = shape["head_dim"], shape["block_size"]
        if bits not in (2, 4, 8) or g < 1 or r < 0 or bs % g or d % min(g, d) or d % (8 // bits):
            raise CodesignError(
                f"shape for {self.name}: bits in (2, 4, 8), a group dividing block_size, head_dim a multiple "
                f"of min(group, head_dim) and of 8 / bits, residual >= 0; got {shape}"
            )

    def table_key(self, shape: Shape) -> str:
        return super().table_key({n: v for n, v in shape.items() if n not in self._KIVI})

    def make_inputs(self, shape: Shape, dtype: torch.dtype, device: Any, seed: int) -> dict[str, Any]:
        from codesign.kernels.kvcache.kivi import KiviPagedKV

        gen = seeded(seed)
        b, hq, hkv, d, bs, ctx = (shape[n] for n in self._DIMS)
        bits, g, r = self._format(shape)
        per_seq = -(-ctx // bs)
        nblocks = b * per_seq + 1
        lens = torch.randint(max(1, ctx // 2), ctx + 1, (b,), generator=gen, dtype=torch.int32)
        lens[0] = ctx
        tables = torch.randperm(nblocks, generator=gen)[: b * per_seq].reshape(b, per_seq).to(torch.int32)
        dev = torch.device(device)
        q = torch.randn(b, hq, d, generator=gen).to(dtype).to(dev)
        tables_d = tables.to(dev)
        cache = KiviPagedKV.empty(nblocks, bs, hkv, d, bits, g, r, b, device=dev)
        g_dev = torch.Generator(dev).manual_seed(seed)
        for s in range(b):  # each sequence's whole context, appended at once (the ring keeps the newest)
            n = int(lens[s])
            k = torch.randn(n, hkv, d, generator=g_dev, device=dev)
            v = torch.randn(n, hkv, d, generator=g_dev, device=dev)
            cache.append(s, tables_d[s], 0, k, v)
        return {"q": q, "cache": cache, "tables": tables_d, "lens": lens.to(dev), "lens_cpu": lens}

    def input_bytes(self, inputs: dict[str, Any]) -> int:
        c = inputs["cache"]
        h, w = c.k_codes.shape[2:]
        # codes + per-token value (scale, zero) + per-group key (scale, zero), fp16
        row = h * w + c.v_meta[0, 0].numel() * 2 + c.k_meta[0, 0].numel() * 2 // c.group
        return int(2 * sum(int(n) for n in inputs["lens_cpu"]) * row + inputs["q"].numel() * 2)

    def reference(self, inputs: dict[str, Any]) -> torch.Tensor:
        """fp64 attention over each sequence as the cache holds it (float32 [n, kv_heads, D], exact)."""
        q, c = inputs["q"], inputs["cache"]
        b, hq, d = q.shape
        if "seqs" not in inputs:  # dequantized once, on first use (compile-only runs never ask)
            tables = inputs["tables"]
            inputs["seqs"] = [c.dequantize_seq(s, tables[s], int(n)) for s, n in enumerate(inputs["lens_cpu"])]
        out = torch.empty(b, hq, d, dtype=torch.float64, device=q.device)
        for s, (k, v) in enumerate(inputs["seqs"]):
            ks = k.double().repeat_interleave(hq // k.shape[1], dim=1)  # [n, hq, d]
            vs = v.double().repeat_interleave(hq // k.shape[1], dim=1)
            p = torch.softmax(torch.einsum("hd,nhd->hn", q[s].double(), ks) / math.sqrt(d), dim=-1)
            out[s] = torch.einsum("hn,nhd->hd", p, vs)
        return out.cpu()


def _dequantize_mixed(cache: Any) -> tuple[torch.Tensor, torch.Tensor]:
    # MixedPagedKV.dequantize() fails when a width has no block (unpack of an empty selection).
    from codesign.kernels.kvcache import quantizers as kvq
    from codesign.kernels.kvcache.mixed import MIXED_BITS

    out = []
    for codes, meta in ((cache.k_codes, cache.k_meta), (cache.v_codes, cache.v_meta)):
        x = torch.empty(codes.shape, dtype=torch.float32, device=codes.device)
        for b in MIXED_BITS:
            sel = cache.block_bits == b
            if bool(sel.any()):
                c = kvq.unpack_codes(codes[sel][..., : cache.head_dim * b // 8], b)
                x[sel] = kvq.dequantize_asym(c, meta[sel][..., 0].float(), meta[sel][..., 1].float())
        out.append(x)
    return out[0], out[1]


register("paged_attention", PagedDecodeAttention)
for _fmt in FORMATS:
    register(f"paged_attention_{_fmt}", lambda f=_fmt: QuantKVDecodeAttention(f))
register("paged_attention_kivi", KiviDecodeAttention)
