"""GPU benchmark entry for the quantized KV cache (for the one GPU suite).

`run(report, quick, mode)` adds `report["kv_quant"]`: decode attention at context 32k, batch 16, Llama-3-8B
layout (32 q heads, 8 kv heads, head_dim 128, block size 32) over a bf16 cache and over INT8 / INT4 / INT2 /
FP8 per-token caches and INT4 / INT2 KIVI caches (G = R = 32; codes read and dequantized inside the
kernel), the speed-up of each over bf16 next to its ideal 16 / bits-per-element (metadata included)
and issue 21's targets (TARGETS: INT8 / FP8 >= 1.6x, INT4 per-token >= 2.5x, KIVI INT4 >= 2.0x, Oaken
INT4 >= 1.5x, mixed >= 2.0x), plus the fused quantize-on-write time for one decode step (16 new tokens;
per-token formats). Also INT4 Oaken (dense + 4 % sparse outlier slots, applied in the kernel) and a
Cocktail-style mix (blocks INT8 / INT4 / INT4 / INT2 in turn).
The per-token and KIVI rows also check the kernel against the torch path (dequantize first) on a
short context, so a wrong kernel is never timed as a fast one (Oaken and mixed: unit tests only).

Shape sweep (issue 21 item 4, `report["kv_quant"]["sweep"]`): every format above at batch 1 / 16 / 64 x
context 1k / 8k / 32k (quick, what the suite runs: context 1k / 32k only; a point whose bf16 cache would
exceed SWEEP_MAX_BF16_BYTES is skipped; one cache allocated at a time). Each row: the time, the format's
byte floor (`codesign.specs.PagedDecodeAttention(...).min_bytes()` with the format's `KVFormat`: K and V
codes + metadata for every token, q and the output, the int32 block table; KIVI's fp16 residual window is
not counted, so the floor is a lower bound; mixed: the per-token INT8 / INT4 / INT2 floors weighted by the
blocks' 1 : 2 : 1 mix, since its rows are sized for INT8 but a narrow block reads fewer bytes), the
achieved bandwidth floor / time, the floor's time at the copy bandwidth (the suite's measured
`report["ceilings"]["copy_GBps"]`, else the catalogue GPU's `mem_bw`, else a copy measured here),
`pct_of_floor` = floor time / time x 100 and the speed-up over bf16 at the same point. The (16, 32k) point
reuses the main rows' times. `sweep_targets`: issue 21's targets with the measured value and `met`
(None where not measured): the speed-ups above at batch 16, context 32k; every format >= 70 % of its
floor at batch >= 16, context >= 8k; bf16 >= 95 % of the copy bandwidth there (the issue says context
>= 4k; the sweep's 8k and 32k points).

Timing: `triton.testing.do_bench_cudagraph` (median of rep = 50 ms), `do_bench` where capture fails
(`report["kv_quant"]["timing"]` counts those).

Smoke mode (`gpu_suite.py --smoke`): batch, context and heads shrunk by `gpu_suite.smoke_shape`
(head_dim, block size, KIVI G/R kept), float16 for bf16 (the interpreter computes bf16 wrongly), one
CPU-timed call per case; the sweep runs only SWEEP_SMOKE_POINTS, (batch 1, context 1k) and (16, 32k)
(the six quick points took ~27 s in the interpreter), shrunk the same way.

Standalone: python bench/gpu_kvquant.py [--full]  (prints the report as JSON).
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
# Issue 21's speed-ups over the bf16 cache at batch 16, context 32k (row format names).
TARGETS = {"int8": 1.6, "fp8": 1.6, "int4": 2.5, "int4-kivi": 2.0, "int4-oaken": 1.5, "mixed-8/4/4/2": 2.0}
SWEEP_BATCH = (1, 16, 64)
SWEEP_CONTEXT = (1024, 8192, 32768)
SWEEP_CONTEXT_QUICK = (1024, 32768)
# Smoke: the 6 quick points took ~27 s in the interpreter (CI budget ~15 s), so two: one timed fresh, and
# the main rows' point (reused, no extra calls).
SWEEP_SMOKE_POINTS = ((1, 1024), (16, 32768))
SWEEP_MAX_BF16_BYTES = 16 << 30  # a sweep point whose bf16 K + V cache would exceed this is skipped
FLOOR_PCT_TARGET = 70.0  # every format, at batch >= 16 and context >= 8k
BF16_COPY_PCT_TARGET = 95.0  # bf16's achieved bandwidth vs the copy bandwidth, same points
MIXED_BITS = (8, 4, 4, 2)  # the mixed cache's block widths, in turn
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


_TIMING = {"graph": 0, "fallback": 0}  # how the GPU timings ran (reported)


def _time_ms(fn, mode: Any = None) -> float:
    """CUDA-graph timing (median), plain do_bench where capture fails; smoke: the mode's one-call timer."""
    import torch
    import triton.testing as tt

    if mode is not None and mode.smoke:
        return mode.time_ms(fn)
    try:
        ms = float(tt.do_bench_cudagraph(fn, rep=50, return_mode="median"))
        _TIMING["graph"] += 1
        return ms
    except Exception:  # noqa: BLE001 - a kernel that cannot be captured is still timed
        torch.cuda.synchronize()
    _TIMING["fallback"] += 1
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


# The design each default replaced, timed beside it: for the code-planes defaults (`launch_rules.reads_planes`)
# the fp16 code tile through shared memory, on the tile and occupancy it had (INT4 and INT2 64 x 128 on 2 warps); for
# KIVI's one-warp value-planes tile (`launch_rules.KIVI_PLANES_DECODE_TILE`) the 4-warp tile with joined values
# (INT2: joined keys too, as before its half-word planes);
# for the mixed cache's decode width by width (`attention.mixed_by_width`) the one launch over every width.
JOINED = {"int4": {"PLANES": 0, "BLOCK_N": 64, "num_warps": 2, "PROGRAMS_PER_SM": 4},
          "int2": {"PLANES": 0, "BLOCK_N": 64, "num_warps": 2, "PROGRAMS_PER_SM": 4},
          "int8": {"PLANES": 0, "PROGRAMS_PER_SM": 4},
          "int4-kivi": {"BLOCK_N": 32, "num_warps": 4, "VPLANES": 0, "PROGRAMS_PER_SM": 4},
          "int2-kivi": {"BLOCK_N": 32, "num_warps": 4, "PLANES": 0, "PROGRAMS_PER_SM": 4},
          "mixed-8/4/4/2": {"BY_WIDTH": 0}}  # fmt: skip


def uncapped() -> dict[str, dict]:
    """The register-capped default tiles (`launch_rules.PLANES_DECODE_CAP`, `KIVI_PLANES_CAP`) as configs of the same
    tile uncapped, at the programs an SM it then holds (the default before the caps), timed beside the default."""
    from codesign.kernels.attention import launch_rules as lr

    return {"int4": {"MAXNREG": 0, "PROGRAMS_PER_SM": lr.PLANES_DECODE_PROGRAMS_PER_SM[4]},
            "int4-kivi": {"MAXNREG": 0, "PROGRAMS_PER_SM": lr.KIVI_PLANES_PROGRAMS_PER_SM[4]}}  # fmt: skip


def _joined_ms(name: str, table: str, fn, mode: Any) -> dict:
    """{"joined_ms", "joined_config"}: `fn` timed under the format's JOINED config, and {"uncapped_ms",
    "uncapped_config"} under its `uncapped()` one (empty where none)."""
    from codesign.autotune.lookup import forced_config

    out: dict[str, Any] = {}
    for what, configs in (("joined", JOINED), ("uncapped", uncapped())):
        if name in configs:
            with forced_config(table, configs[name]):
                out |= {f"{what}_ms": _time_ms(fn, mode), f"{what}_config": configs[name]}
    return out


def _format_row(name: str, ms: float, bits: float, base_ms: float, **extra) -> dict:
    """One format's row: time, bits per element, speedup over the bf16 cache against the ideal 16 / bits,
    and the issue's target where it sets one."""
    speedup = base_ms / ms
    target = TARGETS.get(name)
    return dict(format=name, ms=ms, bits=bits, speedup=speedup, ideal=16.0 / bits, target=target,
                meets_target=None if target is None else speedup >= target, **extra)  # fmt: skip


def _oaken_cache(nb: int, dev, hkv: int):
    """An INT4 Oaken cache; outlier words with valid positions so the kernel applies them (filled by hand: the
    first attention call rebuilds the cache's outlier index once, the timed ones read it, as decode does)."""
    import torch

    from codesign.kernels.kvcache.oaken import OakenPagedKV

    cap = _oaken_capacity()
    thr = torch.tensor([[-1.0, 1.0]] * hkv).expand(2, hkv, 2).contiguous()
    c = OakenPagedKV.empty(nb, BLOCK_SIZE, hkv, DIM, 4, thr, cap, dev)
    c.k_codes.random_(0, 256)
    c.v_codes.random_(0, 256)
    c.k_meta[..., 0] = 0.01
    c.v_meta[..., 0] = 0.01
    c.k_out.copy_(oaken_slots(tuple(c.k_out.shape), dev, 0))
    c.v_out.copy_(oaken_slots(tuple(c.v_out.shape), dev, 1))
    return c


def oaken_slots(shape: tuple[int, int, int], dev, seed: int):
    """Full outlier slots `[blocks, kv_heads, CAP]` of fp16 1.0 at distinct positions in token order, as the
    writers leave them: slot i at a random position of its own stretch of BLOCK_SIZE * DIM / CAP positions."""
    import torch

    cap = shape[2]
    span = BLOCK_SIZE * DIM // cap
    g = torch.Generator(device=dev).manual_seed(seed)
    pos = torch.arange(cap, device=dev, dtype=torch.int32) * span
    pos = pos + torch.randint(0, span, shape, device=dev, dtype=torch.int32, generator=g)
    return (pos << 16) | 0x3C00  # fp16 1.0


def _oaken_capacity() -> int:
    from codesign.kernels.kvcache.oaken import default_capacity

    return default_capacity(0.04, BLOCK_SIZE, DIM)


def _oaken_row(q, bt, cl, nb: int, base: float, mode: Any = None) -> dict:
    """INT4 Oaken decode on its default path (`oaken_split.split_default` without a table), and each path forced
    beside it: the one-launch kernel (`one_launch_ms`, SPLIT 0) and the three launches (`split_ms`:
    `attention.oaken_split`, SPLIT 1), with their outputs' relative difference on a GPU (`split_rel_diff`; smoke:
    None, the CPU tests hold both paths against fp64)."""
    from codesign.autotune.lookup import forced_key
    from codesign.kernels.attention.quantized import oaken_attention
    from codesign.kernels.kvcache import quantizers as kvq

    c, cap = _oaken_cache(nb, q.device, q.shape[1] // (HQ // HKV)), _oaken_capacity()
    ms = _time_ms(lambda: oaken_attention(q, c, bt, cl, check_data=False), mode)
    smoke = mode is not None and mode.smoke
    paths: dict[int, tuple[float, Any]] = {}
    for split in (0, 1):
        with forced_key("paged_attention_oaken", "SPLIT", split):
            t = _time_ms(lambda: oaken_attention(q, c, bt, cl, check_data=False), mode)
            paths[split] = (t, None if smoke else oaken_attention(q, c, bt, cl, check_data=False).float())
    (one_ms, ref), (split_ms, out) = paths[0], paths[1]
    diff = None if ref is None else float((out - ref).norm() / ref.norm())
    bits = kvq.layout_bits_per_element("oaken", 4, DIM, block_size=BLOCK_SIZE, capacity=cap)
    # stored_bits: the format's and the outlier index the kernels read (`OakenPagedKV.stored_bits_per_element`)
    return _format_row("int4-oaken", ms, bits, base, capacity=cap, split_ms=split_ms, split_speedup=base / split_ms,
                       one_launch_ms=one_ms, one_launch_speedup=base / one_ms, split_rel_diff=diff,
                       stored_bits=c.stored_bits_per_element)  # fmt: skip


def _mixed_cache(nb: int, dev, hkv: int):
    """A Cocktail-style mixed cache: block widths MIXED_BITS (8 / 4 / 4 / 2) in turn."""
    import torch

    from codesign.kernels.kvcache.mixed import MixedPagedKV

    c = MixedPagedKV.empty(nb, BLOCK_SIZE, hkv, DIM, dev)
    n = len(MIXED_BITS)
    c.block_bits.copy_(torch.tensor(MIXED_BITS, dtype=torch.uint8, device=dev).repeat(-(-nb // n))[:nb])
    c.k_codes.random_(0, 256)
    c.v_codes.random_(0, 256)
    c.k_meta[..., 0] = 0.01
    c.v_meta[..., 0] = 0.01
    return c


def _mixed_row(q, bt, cl, nb: int, base: float, mode: Any = None) -> dict:
    """Cocktail-style mix: width by width (the default), and in one launch (joined_ms)."""
    from codesign.kernels.attention.quantized import mixed_attention

    c = _mixed_cache(nb, q.device, q.shape[1] // (HQ // HKV))
    call = lambda: mixed_attention(q, c, bt, cl, check_data=False)  # noqa: E731
    ms = _time_ms(call, mode)
    bits = 4.5 + 32 / DIM
    joined = _joined_ms("mixed-8/4/4/2", "paged_attention_mixed", call, mode)
    return _format_row("mixed-8/4/4/2", ms, bits, base, **joined)


SWEEP_FORMATS = ("bf16", *FORMATS, *KIVI, "int4-oaken", "mixed-8/4/4/2")


def _decode_case(name: str, q, bt, cl, hkv: int):
    """One sweep format's decode call over a fresh cache (the main rows' builders); the cache is freed
    with the returned closure."""
    import torch

    from codesign.kernels.attention import quantized as qa
    from codesign.kernels.attention.paged import paged_decode_attention

    nb, dev = bt.numel(), q.device
    if name == "bf16":
        k = torch.randn(nb, BLOCK_SIZE, hkv, DIM, dtype=q.dtype, device=dev)
        v = torch.randn_like(k)
        return lambda: paged_decode_attention(q, k, v, bt, cl, check_data=False)
    if name in FORMATS:
        c = _quant_cache(name, nb, dev, hkv)
        return lambda: qa.kvq_decode_attention(q, c, bt, cl, check_data=False)
    if name in KIVI:
        c = _kivi_cache(KIVI[name], nb, dev, hkv, q.shape[0])
        return lambda: qa.kivi_decode_attention(q, c, bt, cl, check_data=False)
    if name == "int4-oaken":
        c = _oaken_cache(nb, dev, hkv)
        return lambda: qa.oaken_attention(q, c, bt, cl, check_data=False)
    c = _mixed_cache(nb, dev, hkv)
    return lambda: qa.mixed_attention(q, c, bt, cl, check_data=False)


def floor_bytes(name: str, batch: int, ctx: int, hq: int = HQ, hkv: int = HKV) -> float:
    """The fewest bytes one decode step over format `name` must move: `PagedDecodeAttention.min_bytes()`
    (K and V codes + metadata of every token, q and the output in bf16, the int32 block table).
    Oaken: the spec's outlier fraction set to the cache's real slot capacity. Mixed: the per-token
    INT8 / INT4 / INT2 floors averaged over MIXED_BITS (the bytes a block of each width reads)."""
    from codesign.specs import KVFormat, PagedDecodeAttention

    def spec(fmt: KVFormat) -> float:
        return PagedDecodeAttention(q_heads=hq, kv_heads=hkv, head_dim=DIM, context_lens=(ctx,) * batch,
                                    block_size=BLOCK_SIZE, kv_format=fmt, dtype="bf16").min_bytes()  # fmt: skip

    if name == "mixed-8/4/4/2":
        return sum(spec(KVFormat(dtype=f"int{b}", scheme="per_token")) for b in MIXED_BITS) / len(MIXED_BITS)
    if name == "int4-oaken":
        return spec(
            KVFormat(dtype="int4", scheme="oaken", outlier_fraction=_oaken_capacity() / (BLOCK_SIZE * DIM))
        )
    return spec(KVFormat.parse(name))


def _copy_bandwidth(report: dict, mode: Any) -> tuple[float, str]:
    """Bytes/s the floors are timed at: the suite's measured copy, else the catalogue's mem_bw, else a
    copy measured here (read + write of 1 GiB of fp32; smoke: shrunk)."""
    import torch

    from codesign.catalog.gpus import match_gpu_name

    copy = (report.get("ceilings") or {}).get("copy_GBps")
    if copy:
        return float(copy) * 1e9, "ceilings.copy_GBps"
    gpu = match_gpu_name(mode.gpu_name())
    if gpu is not None and gpu.mem_bw > 0:
        return gpu.mem_bw, f"catalog mem_bw ({gpu.name})"
    a = torch.randn(mode.scale(copy=1 << 28)["copy"], device=mode.device)
    b = torch.empty_like(a)
    ms = _time_ms(lambda: b.copy_(a), mode)
    return 2 * a.numel() * 4 / (ms * 1e-3), "copy measured in gpu_kvquant"


def _sweep(report: dict, quick: bool, mode: Any, hq: int, hkv: int, dtype, main: dict[str, float]) -> dict:
    """Every format at each (batch, context) point; rows with time, floor and speed-up over bf16."""
    import torch

    bw, bw_source = _copy_bandwidth(report, mode)
    rows: list[dict[str, Any]] = []
    contexts = SWEEP_CONTEXT_QUICK if quick else SWEEP_CONTEXT
    points = SWEEP_SMOKE_POINTS if mode.smoke else tuple((b, c) for b in SWEEP_BATCH for c in contexts)
    for real_b, real_c in points:
        d = mode.scale(batch=real_b, ctx=real_c)
        batch, ctx = d["batch"], d["ctx"]
        point = dict(batch=real_b, context=real_c, run_batch=batch, run_context=ctx)
        bf16_bytes = 2 * batch * -(-ctx // BLOCK_SIZE) * BLOCK_SIZE * hkv * DIM * 2
        if bf16_bytes > SWEEP_MAX_BF16_BYTES:
            rows.append({**point, "skipped": f"bf16 cache {bf16_bytes / 2**30:.1f} GiB > budget"})
            continue
        reuse = (real_b, real_c) == (BATCH, CONTEXT)  # the main rows timed this very point
        bt, cl = _tables(batch, ctx, mode.device)
        q = torch.randn(batch, hq, DIM, dtype=dtype, device=mode.device)
        base = None
        for name in SWEEP_FORMATS:
            if reuse:
                ms = main[name]
            else:
                fn = _decode_case(name, q, bt, cl, hkv)
                ms = _time_ms(fn, mode)
                fn = None
                mode.empty_cache()
            base = ms if name == "bf16" else base
            fb = floor_bytes(name, batch, ctx, hq, hkv)
            floor_ms = fb / bw * 1e3
            rows.append(dict(format=name, **point, ms=ms, floor_bytes=fb, achieved_GBps=fb / (ms * 1e-3) / 1e9,
                             floor_ms=floor_ms, pct_of_floor=100 * floor_ms / ms, speedup_vs_bf16=base / ms,
                             reused_main_row=reuse))  # fmt: skip
        bt = cl = q = None
        mode.empty_cache()
    return dict(rows=rows, points=[list(p) for p in points], bandwidth_GBps=bw / 1e9, bandwidth_source=bw_source,
                quick=quick)  # fmt: skip


def sweep_targets(rows: list[dict]) -> dict[str, dict]:
    """Issue 21's targets against the sweep: measured value, target, met (None where not measured)."""

    def res(measured, target, **extra):
        return dict(
            measured=measured, target=target, met=None if measured is None else measured >= target, **extra
        )

    timed = [r for r in rows if "ms" in r]
    out: dict[str, dict] = {}
    for name, target in TARGETS.items():
        r = next(
            (r for r in timed if r["format"] == name and (r["batch"], r["context"]) == (BATCH, CONTEXT)), None
        )
        out[f"{name}_speedup_b16_c32k"] = res(None if r is None else r["speedup_vs_bf16"], target)
    big = [r for r in timed if r["batch"] >= 16 and r["context"] >= 8192]
    worst = min(big, key=lambda r: r["pct_of_floor"], default=None)
    out["all_formats_pct_of_floor_b16_c8k"] = res(
        None if worst is None else worst["pct_of_floor"], FLOOR_PCT_TARGET,
        worst=None if worst is None else f"{worst['format']} b{worst['batch']} c{worst['context']}",
    )  # fmt: skip
    bf = [r for r in big if r["format"] == "bf16"]
    out["bf16_pct_of_copy_b16_c8k"] = res(
        min((r["pct_of_floor"] for r in bf), default=None), BF16_COPY_PCT_TARGET,
        points=[f"b{r['batch']} c{r['context']}" for r in bf],
    )  # fmt: skip
    return out


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


def run(report: dict, quick: bool = True, mode: Any = None) -> None:
    """Decode over bf16 vs quantized caches, then the shape sweep; results in report["kv_quant"]."""
    import time

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
    # GPT-OSS's attention sinks (one logit a head): the rescale of the output after the kernel (`attention.sinks`)
    sinks = torch.randn(hq, device=dev)
    sinks_ms = _time_ms(lambda: paged_decode_attention(q, k, v, bt, cl, sinks=sinks, check_data=False), mode)
    rows = [dict(format=str(dtype).removeprefix("torch.").replace("bfloat16", "bf16"), ms=base, bits=16.0,
                 speedup=1.0, sinks_ms=sinks_ms, sinks_overhead_pct=100 * (sinks_ms / base - 1))]  # fmt: skip
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
        call = lambda c=c: kvq_decode_attention(q, c, bt, cl, check_data=False)  # noqa: E731
        joined = _joined_ms(fmt, f"paged_attention_{fmt}", call, mode)
        rows.append(_format_row(fmt, ms, bits, base, write_ms_16_tokens=wms, **checked, **joined))
        c = None
        mode.empty_cache()
    for name, b in KIVI.items():
        c = _kivi_cache(b, nb, dev, hkv, batch)
        ms = _time_ms(lambda c=c: kivi_decode_attention(q, c, bt, cl, check_data=False), mode)
        bits = kvq.layout_bits_per_element("kivi", b, DIM, group=KIVI_G)
        checked = _checked(_check_kivi(b, dtype, dev, 2 * KIVI_G + KIVI_R, hq, hkv), dtype)
        call = lambda c=c: kivi_decode_attention(q, c, bt, cl, check_data=False)  # noqa: E731
        joined = _joined_ms(name, "paged_attention_kivi", call, mode)
        rows.append(_format_row(name, ms, bits, base, **checked, **joined))
        c = None
        mode.empty_cache()
    rows.append(_oaken_row(q, bt, cl, nb, base, mode))
    rows.append(_mixed_row(q, bt, cl, nb, base, mode))
    q = new = bt = cl = None
    mode.empty_cache()
    main = {"bf16": base, **{r["format"]: r["ms"] for r in rows[1:]}}
    t0 = time.monotonic()
    sweep = _sweep(report, quick, mode, hq, hkv, dtype, main)
    report["kv_quant"] = dict(
        gpu=mode.gpu_name(),
        case=dict(batch=batch, context=ctx, q_heads=hq, kv_heads=hkv, head_dim=DIM, block_size=BLOCK_SIZE),
        rows=rows,
        checks_ok=all(r["check_ok"] for r in rows if "check_ok" in r),
        sweep=sweep.pop("rows"),
        sweep_targets=None,
        sweep_info={**sweep, "seconds": time.monotonic() - t0},
        timing="one CPU-timed call (smoke)" if mode.smoke else
               f"do_bench_cudagraph median rep=50 ({_TIMING['graph']}), do_bench fallback ({_TIMING['fallback']})",
    )  # fmt: skip
    report["kv_quant"]["sweep_targets"] = sweep_targets(report["kv_quant"]["sweep"])


if __name__ == "__main__":
    rep: dict = {}
    run(rep, quick="--full" not in sys.argv)
    print(json.dumps(rep, indent=1, default=str))
