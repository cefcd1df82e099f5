"""Tunable adapters for decode attention over a quantized paged KV cache (`kv_quant_paged`, `_mixed`, `_kivi`).

Registered ops: paged_attention_int8, paged_attention_int4, paged_attention_int2, paged_attention_fp8
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

Table: the kernel's `launch_config` reads the per-format table `paged_attention_<fmt>` these adapters
export (`paged_attention_triton.table_op`), else the format's own defaults (not the plain table: its best
tile can spill once codes are unpacked). Each candidate is forced under both names, so a measurement never
depends on which table the kernel asks.
"""

from __future__ import annotations

import dataclasses
import importlib
import math
from contextlib import ExitStack
from typing import Any

import torch

from codesign.autotune.adapters import PagedDecodeAttention, _gen
from codesign.autotune.lookup import forced_config
from codesign.autotune.ops import Shape, register
from codesign.autotune.space import ConfigSpace
from codesign.kernels.kvcache.formats import ATTENTION_TABLE_FORMATS, KVQ_FORMATS
from codesign.specs.errors import CodesignError

KERNEL_TABLE_OP = "paged_attention"  # the plain table, also forced: no candidate may depend on the lookup
# The quantized formats with an attention table of their own (`kvcache.formats`); KIVI has its own adapter below.
FORMATS = tuple(f for f in ATTENTION_TABLE_FORMATS if f != "kivi")
# format -> (module of its cache, writer and attention entry point, attention function name)
_ENTRY = {
    **{
        f: ("codesign.kernels.attention.quantized", "kvq_decode_attention")
        for f in KVQ_FORMATS
    },
    "mixed": ("codesign.kernels.attention.quantized", "mixed_attention"),
    "oaken": ("codesign.kernels.attention.quantized", "oaken_attention"),
}
OAKEN_BITS = 4
OAKEN_OUTLIERS = 0.04  # fraction of elements outside the thresholds, and of outlier slots (Oaken's 4 %)


class QuantKVDecodeAttention(PagedDecodeAttention):
    """paged_attention_<fmt>: decode attention over a quantized cache of format `fmt` (module docstring)."""

    def __init__(self, fmt: str) -> None:
        self.module, self.entry = _ENTRY[fmt]
        importlib.import_module(self.module)  # unavailable kernel -> ImportError
        self.source_modules = ("codesign.kernels.attention.triton_attention", self.module)
        self.fmt = fmt
        self.name = f"paged_attention_{fmt}"
        self.forced_ops = (KERNEL_TABLE_OP, self.name)

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

    def table_op(self, shape: Shape) -> str:
        return self.name

    def space(self, shape: Shape, dtype: torch.dtype, on_gpu: bool) -> ConfigSpace:
        """The decode space; INT8 on GPUs also tries reading its codes as int32 words (WORDS8 1: 16-byte copies,
        a shift and a mask per element) against bytes (0, the default)."""
        sp = super().space(shape, dtype, on_gpu)
        if self.fmt == "int8" and on_gpu and shape["head_dim"] % 4 == 0:
            sp = dataclasses.replace(sp, params={**sp.params, "WORDS8": [0, 1]})
        return sp

    def make_inputs(self, shape: Shape, dtype: torch.dtype, device: Any, seed: int) -> dict[str, Any]:
        gen = _gen(seed)
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
        # float32, exact: code * fp16 scale + fp16 zero (Oaken: outliers written back), or e4m3 * scale.
        kd, vd = _dequantize_mixed(cache) if self.fmt == "mixed" else cache.dequantize()
        tables, lens = tables.to(dev), lens.to(dev)
        ref = {"q": q, "k": kd, "v": vd, "tables": tables}
        return {"q": q, "cache": cache, "tables": tables, "lens": lens, "ref": ref, "lens_cpu": lens.cpu()}

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
        attend = getattr(importlib.import_module(self.module), self.entry)
        with ExitStack() as stack:
            stack.enter_context(use_backend("triton", op="paged_attention"))
            for name in self.forced_ops:
                stack.enter_context(forced_config(name, config))
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
        from codesign.kernels.attention import quantized  # noqa: F401  (unavailable kernel -> ImportError)

        self.fmt = "kivi"
        self.name = "paged_attention_kivi"
        self.forced_ops = (KERNEL_TABLE_OP, self.name)
        self.source_modules = (
            "codesign.kernels.attention.triton_attention",
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

        gen = _gen(seed)
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
        seqs = []
        for s in range(b):  # each sequence's whole context, appended at once (the ring keeps the newest)
            n = int(lens[s])
            k = torch.randn(n, hkv, d, generator=g_dev, device=dev)
            v = torch.randn(n, hkv, d, generator=g_dev, device=dev)
            cache.append(s, tables_d[s], 0, k, v)
            seqs.append(cache.dequantize_seq(s, tables_d[s], n))  # float32 [n, kv_heads, D], exact
        return {
            "q": q,
            "cache": cache,
            "tables": tables_d,
            "lens": lens.to(dev),
            "lens_cpu": lens,
            "seqs": seqs,
        }

    def input_bytes(self, inputs: dict[str, Any]) -> int:
        c = inputs["cache"]
        h, w = c.k_codes.shape[2:]
        # codes + per-token value (scale, zero) + per-group key (scale, zero), fp16
        row = h * w + c.v_meta[0, 0].numel() * 2 + c.k_meta[0, 0].numel() * 2 // c.group
        return int(2 * sum(int(n) for n in inputs["lens_cpu"]) * row + inputs["q"].numel() * 2)

    def reference(self, inputs: dict[str, Any]) -> torch.Tensor:
        q = inputs["q"]
        b, hq, d = q.shape
        out = torch.empty(b, hq, d, dtype=torch.float64, device=q.device)
        for s, (k, v) in enumerate(inputs["seqs"]):
            ks = k.double().repeat_interleave(hq // k.shape[1], dim=1)  # [n, hq, d]
            vs = v.double().repeat_interleave(hq // k.shape[1], dim=1)
            p = torch.softmax(torch.einsum("hd,nhd->hn", q[s].double(), ks) / math.sqrt(d), dim=-1)
            out[s] = torch.einsum("hn,nhd->hd", p, vs)
        return out.cpu()

    def run(self, inputs: dict[str, Any], config: dict[str, int]) -> torch.Tensor:
        from codesign.backend import use_backend
        from codesign.kernels.attention.quantized import kivi_decode_attention

        i = inputs
        with ExitStack() as stack:
            stack.enter_context(use_backend("triton", op="paged_attention"))
            for name in self.forced_ops:
                stack.enter_context(forced_config(name, config))
            return kivi_decode_attention(i["q"], i["cache"], i["tables"], i["lens"], check_data=False)


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


for _fmt in FORMATS:
    register(f"paged_attention_{_fmt}", lambda f=_fmt: QuantKVDecodeAttention(f))
register("paged_attention_kivi", KiviDecodeAttention)
