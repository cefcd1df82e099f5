"""GPU benchmark entry for the quantized KV cache (for the one GPU suite).

`run(report)` adds `report["kv_quant"]`: decode attention at context 32k, batch 16, Llama-3-8B layout
(32 q heads, 8 kv heads, head_dim 128, block size 32) over a bf16 cache and over INT8 / INT4 / INT2 /
FP8 per-token caches and INT4 / INT2 KIVI caches (G = R = 32; codes read and dequantized inside the
kernel), the speed-up of each over bf16 next to its ideal 16 / bits-per-element (metadata included)
and the issue's targets (INT4 KIVI >= 3.0x, INT8 >= 1.8x), plus the fused quantize-on-write time for
one decode step (16 new tokens; per-token formats). Also INT4 Oaken (dense + 4 % sparse outlier
slots, applied in the kernel) and a Cocktail-style mix (blocks INT8 / INT4 / INT4 / INT2 in turn).
The per-token and KIVI rows also check the kernel against the torch path (dequantize first) on a
short context, so a wrong kernel is never timed as a fast one (Oaken and mixed: unit tests only).

Smoke mode (`gpu_suite.py --smoke`): batch, context and heads shrunk by `gpu_suite.smoke_shape`
(head_dim, block size, KIVI G/R kept), float16 for bf16 (the interpreter computes bf16 wrongly), one
CPU-timed call per case.

Standalone: python bench/gpu_kvquant.py  (prints the report as JSON).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

HQ, HKV, DIM = 32, 8, 128
BATCH, CONTEXT, BLOCK_SIZE = 16, 32768, 32  # block 32: KIVI's G = 32 must divide it
FORMATS = ("int8", "int4", "int2", "fp8")
KIVI = {"int4-kivi": 4, "int2-kivi": 2}
KIVI_G = KIVI_R = 32
TARGETS = {"int4-kivi": 3.0, "int8": 1.8}
# ||kernel - torch path|| / ||torch path|| per output dtype: the same codes are read by both, so only
# the output rounding and the summation order differ; a wrong kernel is O(1).
REL_ERR_BOUND = {"torch.float16": 3e-3, "torch.bfloat16": 1.5e-2}


def _default_mode(mode: Any) -> Any:
    """The suite's run mode; standalone runs get the suite's GPU mode."""
    if mode is not None:
        return mode
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from gpu_suite import GPU

    return GPU


def _time_ms(fn, mode: Any = None) -> float:
    import triton.testing as tt

    if mode is not None and mode.smoke:
        return mode.time_ms(fn)
    return float(tt.do_bench(fn, warmup=10, rep=50, return_mode="median"))


def _tables(batch: int, ctx: int, device: str):
    """Fragmented block tables (a random permutation of the pool), as a long-running server has."""
    import torch

    need = -(-ctx // BLOCK_SIZE)
    perm = torch.randperm(batch * need, device=device).to(torch.int32)
    return perm.view(batch, need).contiguous(), torch.full((batch,), ctx, dtype=torch.int32, device=device)


def _quant_cache(fmt: str, nb: int, device: str, hkv: int = HKV):
    import torch

    from codesign.kernels.kvcache.kvq import QuantPagedKV

    hs = torch.full((hkv,), 4.0 / 448, device=device) if fmt == "fp8" else None
    c = QuantPagedKV.empty(nb, BLOCK_SIZE, hkv, DIM, fmt, device, hs, hs)
    c.k_codes.random_(0, 256)
    c.v_codes.random_(0, 256)
    if fmt == "fp8":  # keep the codes finite: clear the e4m3 NaN pattern (S.1111.111)
        c.k_codes &= 0x7E
        c.v_codes &= 0x7E
    else:
        c.k_meta[..., 0] = 0.01
        c.k_meta[..., 1] = -1.0
        c.v_meta.copy_(c.k_meta)
    return c


def _kivi_cache(bits: int, nb: int, device: str, hkv: int = HKV, batch: int = BATCH):
    from codesign.kernels.kvcache.kivi import KiviPagedKV

    c = KiviPagedKV.empty(nb, BLOCK_SIZE, hkv, DIM, bits, KIVI_G, KIVI_R, batch, device=device)
    c.k_codes.random_(0, 256)
    c.v_codes.random_(0, 256)
    c.k_meta[..., 0] = 0.01
    c.k_meta[..., 1] = -1.0
    c.v_meta[..., 0] = 0.01
    c.v_meta[..., 1] = -1.0
    c.k_res.normal_()
    c.v_res.normal_()
    return c


def _check_kivi(
    bits: int, dtype, device: str = "cuda", ctx: int = 300, hq: int = HQ, hkv: int = HKV
) -> float:
    """KIVI kernel vs the torch path on short contexts just below / at / above a group boundary."""
    import torch

    from codesign.backend import use_backend
    from codesign.kernels.attention.quantized import kivi_decode_attention
    from codesign.kernels.kvcache.kivi import KiviPagedKV

    lens = [ctx - 1, ctx, ctx + 1]
    bt, _ = _tables(3, ctx + 1, device)
    cl = torch.tensor(lens, dtype=torch.int32, device=device)
    c = KiviPagedKV.empty(bt.numel(), BLOCK_SIZE, hkv, DIM, bits, KIVI_G, KIVI_R, 3, device=device)
    for b, n in enumerate(lens):
        kv = torch.randn(2, n, hkv, DIM, device=device).to(torch.float16)
        c.append(b, bt[b], 0, kv[0], kv[1])
    q = torch.randn(3, hq, DIM, dtype=dtype, device=device)
    with use_backend("triton"):
        out = kivi_decode_attention(q, c, bt, cl)
    with use_backend("torch"):
        ref = kivi_decode_attention(q, c, bt, cl)
    return float((out.float() - ref.float()).norm() / ref.float().norm())


def _format_row(name: str, ms: float, bits: float, base_ms: float, **extra) -> dict:
    """One format's row: time, bits per element, speedup over the bf16 cache against the ideal 16 / bits,
    and the issue's target where it sets one."""
    speedup = base_ms / ms
    target = TARGETS.get(name)
    return dict(format=name, ms=ms, bits=bits, speedup=speedup, ideal=16.0 / bits, target=target,
                meets_target=None if target is None else speedup >= target, **extra)  # fmt: skip


def _oaken_row(q, bt, cl, nb: int, base: float, mode: Any = None) -> dict:
    """INT4 Oaken decode; outlier words with valid positions so the kernel applies them."""
    import torch

    from codesign.kernels.attention.quantized import oaken_attention
    from codesign.kernels.kvcache import quantizers as kvq
    from codesign.kernels.kvcache.oaken import OakenPagedKV, default_capacity

    hkv, dev = q.shape[1] // (HQ // HKV), q.device
    cap = default_capacity(0.04, BLOCK_SIZE, DIM)
    thr = torch.tensor([[-1.0, 1.0]] * hkv).expand(2, hkv, 2).contiguous()
    c = OakenPagedKV.empty(nb, BLOCK_SIZE, hkv, DIM, 4, thr, cap, dev)
    c.k_codes.random_(0, 256)
    c.v_codes.random_(0, 256)
    c.k_meta[..., 0] = 0.01
    c.v_meta[..., 0] = 0.01
    pos = torch.randint(0, BLOCK_SIZE * DIM, c.k_out.shape, device=dev, dtype=torch.int32)
    c.k_out.copy_((pos << 16) | 0x3C00)  # fp16 1.0
    c.v_out.copy_(c.k_out)
    ms = _time_ms(lambda: oaken_attention(q, c, bt, cl, check_data=False), mode)
    bits = kvq.layout_bits_per_element("oaken", 4, DIM, block_size=BLOCK_SIZE, capacity=cap)
    return _format_row("int4-oaken", ms, bits, base, capacity=cap)


def _mixed_row(q, bt, cl, nb: int, base: float, mode: Any = None) -> dict:
    """Cocktail-style mix over one launch: block widths 8 / 4 / 4 / 2 in turn."""
    import torch

    from codesign.kernels.attention.quantized import mixed_attention
    from codesign.kernels.kvcache.mixed import MixedPagedKV

    hkv, dev = q.shape[1] // (HQ // HKV), q.device
    c = MixedPagedKV.empty(nb, BLOCK_SIZE, hkv, DIM, dev)
    c.block_bits.copy_(torch.tensor([8, 4, 4, 2], dtype=torch.uint8, device=dev).repeat(-(-nb // 4))[:nb])
    c.k_codes.random_(0, 256)
    c.v_codes.random_(0, 256)
    c.k_meta[..., 0] = 0.01
    c.v_meta[..., 0] = 0.01
    ms = _time_ms(lambda: mixed_attention(q, c, bt, cl, check_data=False), mode)
    bits = 4.5 + 32 / DIM
    return _format_row("mixed-8/4/4/2", ms, bits, base)


def _check(fmt: str, dtype, device: str = "cuda", ctx: int = 1000, hq: int = HQ, hkv: int = HKV) -> float:
    """Relative error of the kernel vs the torch path (dequantize, then attention) on a short context."""
    import torch

    from codesign.backend import use_backend
    from codesign.kernels.attention.quantized import kvq_decode_attention
    from codesign.kernels.kvcache.kvq import kvq_write

    bt, cl = _tables(4, ctx, device)
    c = _quant_cache(fmt, bt.numel(), device, hkv)
    key = torch.randn(8, hkv, DIM, dtype=dtype, device=device)
    kvq_write(key, -key, c, torch.arange(8, dtype=torch.int32, device=device) * 3)
    q = torch.randn(4, hq, DIM, dtype=dtype, device=device)
    with use_backend("triton"):
        out = kvq_decode_attention(q, c, bt, cl)
    with use_backend("torch"):
        ref = kvq_decode_attention(q, c, bt, cl)
    return float((out.float() - ref.float()).norm() / ref.float().norm())


def _checked(err: float, dtype) -> dict[str, Any]:
    bound = REL_ERR_BOUND[str(dtype)]
    return dict(rel_err_vs_torch=err, rel_err_bound=bound, check_ok=err <= bound)


def run(report: dict, mode: Any = None) -> None:
    """Decode over bf16 vs quantized caches; results in report["kv_quant"]."""
    import torch

    mode = _default_mode(mode)
    if not mode.available():
        report["kv_quant"] = {"skipped": "no CUDA device"}
        return
    from codesign.kernels.attention.paged import paged_decode_attention
    from codesign.kernels.attention.quantized import kivi_decode_attention, kvq_decode_attention
    from codesign.kernels.kvcache import quantizers as kvq
    from codesign.kernels.kvcache.kvq import kvq_write

    dev, dtype = mode.device, mode.dtype(torch.bfloat16)
    d = mode.scale(batch=BATCH, ctx=CONTEXT, q_heads=HQ, kv_heads=HKV)
    batch, ctx, hq, hkv = d["batch"], d["ctx"], d["q_heads"], d["kv_heads"]
    check_ctx = mode.scale(ctx=1000)["ctx"]
    bt, cl = _tables(batch, ctx, dev)
    nb = bt.numel()
    q = torch.randn(batch, hq, DIM, dtype=dtype, device=dev)
    k = torch.randn(nb, BLOCK_SIZE, hkv, DIM, dtype=dtype, device=dev)
    v = torch.randn_like(k)
    base = _time_ms(lambda: paged_decode_attention(q, k, v, bt, cl, check_data=False), mode)
    rows = [dict(format=str(dtype).removeprefix("torch.").replace("bfloat16", "bf16"), ms=base, bits=16.0,
                 speedup=1.0)]  # fmt: skip
    k = v = None
    mode.empty_cache()
    slots = torch.arange(batch, dtype=torch.int32, device=dev) * BLOCK_SIZE * 7
    new = torch.randn(batch, hkv, DIM, dtype=dtype, device=dev)
    for fmt in FORMATS:
        c = _quant_cache(fmt, nb, dev, hkv)
        ms = _time_ms(lambda c=c: kvq_decode_attention(q, c, bt, cl, check_data=False), mode)
        wms = _time_ms(lambda c=c: kvq_write(new, new, c, slots, check_data=False), mode)
        bits = kvq.layout_bits_per_element("fp8" if fmt == "fp8" else "per_token", c.bits, DIM)
        checked = _checked(_check(fmt, dtype, dev, check_ctx, hq, hkv), dtype)
        rows.append(_format_row(fmt, ms, bits, base, write_ms_16_tokens=wms, **checked))
        c = None
        mode.empty_cache()
    for name, b in KIVI.items():
        c = _kivi_cache(b, nb, dev, hkv, batch)
        ms = _time_ms(lambda c=c: kivi_decode_attention(q, c, bt, cl, check_data=False), mode)
        bits = kvq.layout_bits_per_element("kivi", b, DIM, group=KIVI_G)
        checked = _checked(_check_kivi(b, dtype, dev, 2 * KIVI_G + KIVI_R, hq, hkv), dtype)
        rows.append(_format_row(name, ms, bits, base, **checked))
        c = None
        mode.empty_cache()
    rows.append(_oaken_row(q, bt, cl, nb, base, mode))
    rows.append(_mixed_row(q, bt, cl, nb, base, mode))
    report["kv_quant"] = dict(
        gpu=mode.gpu_name(),
        case=dict(batch=batch, context=ctx, q_heads=hq, kv_heads=hkv, head_dim=DIM, block_size=BLOCK_SIZE),
        rows=rows,
        checks_ok=all(r["check_ok"] for r in rows if "check_ok" in r),
    )


if __name__ == "__main__":
    rep: dict = {}
    run(rep)
    print(json.dumps(rep, indent=1, default=str))
