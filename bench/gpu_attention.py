"""GPU benchmark entries for paged decode, extend and tree attention (for the one GPU suite).

`run(report)` adds `report["paged_attention"]`: the measured device-to-device copy bandwidth, then
one row per case with the time, the achieved bandwidth (the spec's `min_bytes()` over the time) and
its percentage of the measured copy and of the catalogue's HBM figure, and FlashInfer / vLLM times
side by side when they import. Targets (issue 4): decode bf16, batch 64, context 4096, Llama-3-8B
layout >= 85 % of copy bandwidth; a 64-node tree over a 4k prefix at batch 16 <= 1.3x the causal
extend of 64 tokens over the same prefix. Then multi-head latent attention decode (`latent_decode` rows,
DeepSeek-V3's widths: the latent cache's bytes over the time). Times use CUDA graphs where capture works (it also
checks that `run()` is capturable), else `triton.testing.do_bench`.

Smoke mode (`gpu_suite.py --smoke`): the same cases (chosen and skipped on their real sizes) shrunk
by `gpu_suite.smoke_shape`, bf16 rows skipped (the interpreter computes bf16 wrongly; extend and tree,
bf16 only, run float16), one CPU-timed call per case, no FlashInfer / vLLM.

Standalone: python bench/gpu_attention.py  (prints the report as JSON).
"""

from __future__ import annotations

import functools
import json
import math
import random
import sys
from pathlib import Path
from typing import Any

LAYOUTS = {"llama3-8b": (32, 8, 128), "llama2-70b": (64, 8, 128)}  # q heads, kv heads, head_dim
BATCHES = (1, 16, 64, 256)
CONTEXTS = (512, 4096, 32768)
BLOCK_SIZE = 16
MAX_KV_BYTES = 24 * 2**30  # skip cases whose K+V cache would exceed this (keeps the suite short)


def _default_mode(mode: Any) -> Any:
    """The suite's run mode; standalone runs get the suite's GPU mode."""
    if mode is not None:
        return mode
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from gpu_suite import GPU

    return GPU


def _time_ms(fn, graph: bool = True, mode: Any = None) -> tuple[float, bool]:
    import torch
    import triton.testing as tt

    if mode is not None and mode.smoke:
        return mode.time_ms(fn), False
    if graph:
        try:
            return float(tt.do_bench_cudagraph(fn, rep=50, return_mode="median")), True
        except Exception:  # noqa: BLE001 - capture may fail for third-party kernels; fall back
            torch.cuda.synchronize()
    return float(tt.do_bench(fn, warmup=10, rep=50, return_mode="median")), False


def copy_bandwidth(mode: Any = None) -> float:
    """Device-to-device copy bandwidth in bytes/s (read + write of a 2 GiB buffer)."""
    import torch

    mode = _default_mode(mode)
    n = mode.scale(copy=2**31)["copy"]
    src = torch.randint(0, 256, (n,), dtype=torch.uint8, device=mode.device)  # random data, not zeros
    dst = torch.empty_like(src)
    ms, _ = _time_ms(lambda: dst.copy_(src), graph=False, mode=mode)
    return 2 * src.numel() / (ms * 1e-3)


def _cache(ctx: list[int], hkv: int, dim: int, dtype, device: str = "cuda"):
    import torch

    need = [-(-c // BLOCK_SIZE) for c in ctx]
    nb = sum(need)
    k = torch.randn(nb, BLOCK_SIZE, hkv, dim, dtype=dtype, device=device)
    v = torch.randn_like(k)
    perm = torch.randperm(nb, device=device).to(torch.int32)  # fragmented, like a long-running server
    bt = torch.zeros(len(ctx), max(need), dtype=torch.int32, device=device)
    offs = [0]
    for n in need:
        offs.append(offs[-1] + n)
    for b, n in enumerate(need):
        bt[b, :n] = perm[offs[b] : offs[b + 1]]
    return k, v, bt, torch.tensor(ctx, dtype=torch.int32, device=device), perm, offs


def _flashinfer_decode_ms(q, k, v, perm, offs, ctx, hq, hkv, dim) -> float | str:
    try:
        import flashinfer
        import torch

        ws = torch.empty(256 * 2**20, dtype=torch.uint8, device="cuda")
        w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD")
        indptr = torch.tensor(offs, dtype=torch.int32, device="cuda")
        last = torch.tensor([(c - 1) % BLOCK_SIZE + 1 for c in ctx], dtype=torch.int32, device="cuda")
        w.plan(indptr, perm, last, hq, hkv, dim, BLOCK_SIZE, q_data_type=q.dtype, kv_data_type=k.dtype)
        return _time_ms(lambda: w.run(q, (k, v)), graph=False)[0]
    except Exception as e:  # noqa: BLE001 - optional competitor
        return f"unavailable: {type(e).__name__}: {e}"[:200]


def _vllm_decode_ms(q, k, v, bt, cl) -> float | str:
    try:
        from vllm.vllm_flash_attn import flash_attn_with_kvcache

        q4 = q.unsqueeze(1)
        return _time_ms(
            lambda: flash_attn_with_kvcache(q4, k, v, cache_seqlens=cl, block_table=bt), graph=False
        )[0]
    except Exception as e:  # noqa: BLE001 - optional competitor
        return f"unavailable: {type(e).__name__}: {e}"[:200]


def _row(kind: str, spec, ms: float, copy_bw: float, hbm_bw: float | None, **extra: Any) -> dict:
    gbs = spec.min_bytes() / (ms * 1e-3)
    return dict(
        kind=kind,
        ms=ms,
        achieved_gbs=gbs / 1e9,
        pct_of_copy=100 * gbs / copy_bw,
        pct_of_catalog=None if hbm_bw is None else 100 * gbs / hbm_bw,
        tflops=spec.flops() / (ms * 1e-3) / 1e12,
        **extra,
    )


# ||kernel - torch path||_F / ||torch path||_F bounds per output dtype (one rounding of the output,
# fp32 accumulation in another order); a wrong kernel (a missed block, a stray read) is O(1).
REL_ERR_BOUND = {"torch.float16": 3e-3, "torch.bfloat16": 1.5e-2, "torch.float32": 1e-3}


def _check_vs_torch(w, q, k, v, out) -> dict[str, Any]:
    """Kernel output `out` vs the torch implementation for the planned batch (guards against timing a
    wrong kernel): max |difference|, relative Frobenius error, its bound and whether it holds."""
    from codesign.backend import use_backend

    with use_backend("torch"):
        ref = w.run(q, k, v)
    return _compare(out, ref)


def _compare(out, ref) -> dict[str, Any]:
    """out against the torch path's `ref`: max |difference|, relative Frobenius error, its bound, whether it holds."""
    import torch

    diff = out.float() - ref.float()
    rel = float(torch.linalg.vector_norm(diff) / torch.linalg.vector_norm(ref.float()))
    bound = REL_ERR_BOUND[str(out.dtype)]
    return dict(max_err_vs_torch=float(diff.abs().max()), rel_err_vs_torch=rel, rel_err_bound=bound,
                check_ok=rel <= bound)  # fmt: skip


def _decode_rows(copy_bw: float, hbm_bw: float | None, dtype, mode: Any = None) -> list[dict]:
    import torch

    from codesign.kernels.attention.wrappers import PagedDecodeWrapper

    mode = _default_mode(mode)
    dev = mode.device
    rows = []
    seen = set()
    for model, (hq0, hkv0, dim) in LAYOUTS.items():
        for batch0 in BATCHES:
            for ctx0 in CONTEXTS:
                kv_bytes = 2 * batch0 * ctx0 * hkv0 * dim * 2  # decided on the real sizes, also in smoke
                case = dict(model=model, batch=batch0, context=ctx0, dtype=str(dtype))
                if kv_bytes > MAX_KV_BYTES:
                    rows.append(dict(kind="decode", skipped=f"cache {kv_bytes / 2**30:.0f} GiB", **case))
                    continue
                d = mode.scale(batch=batch0, ctx=ctx0, q_heads=hq0, kv_heads=hkv0)
                batch, ctx_len, hq, hkv = d["batch"], d["ctx"], d["q_heads"], d["kv_heads"]
                if mode.smoke:  # several real cases share one stand-in: run it once
                    if (model, batch, ctx_len) in seen:
                        continue
                    seen.add((model, batch, ctx_len))
                    case.update(smoke_batch=batch, smoke_context=ctx_len, smoke_heads=(hq, hkv))
                ctx = [ctx_len] * batch
                k, v, bt, cl, perm, offs = _cache(ctx, hkv, dim, dtype, dev)
                q = torch.randn(batch, hq, dim, dtype=dtype, device=dev)
                w = PagedDecodeWrapper(dev)
                w.plan(k, bt, cl, hq)
                out = torch.full_like(q, float("nan"))  # poisoned: an unwritten element fails the check
                ms, graphed = _time_ms(functools.partial(w.run, q, k, v, out=out), mode=mode)
                extra = dict(graphed=graphed, num_splits=w._plan.launch.num_splits, **case)
                if batch0 * ctx0 <= 16 * 4096:
                    extra.update(_check_vs_torch(w, q, k, v, out))
                if mode.smoke:
                    extra["flashinfer_ms"] = extra["vllm_ms"] = "skipped in smoke mode (needs CUDA)"
                else:
                    extra["flashinfer_ms"] = _flashinfer_decode_ms(q, k, v, perm, offs, ctx, hq, hkv, dim)
                    extra["vllm_ms"] = _vllm_decode_ms(q, k, v, bt, cl)
                rows.append(_row("decode", w.spec(), ms, copy_bw, hbm_bw, **extra))
                k = v = None  # free the cache before the next case
                mode.empty_cache()
    return rows


EXTEND_CASES = ((16, 64, 4096), (8, 512, 4096), (4, 2048, 0))  # (batch, new tokens, prefix); tree: the first


def _extend_and_tree_rows(copy_bw: float, hbm_bw: float | None, dtype, mode: Any = None) -> list[dict]:
    import torch

    from codesign.kernels.attention.wrappers import PagedExtendWrapper, TreeAttentionWrapper

    mode = _default_mode(mode)
    dev = mode.device
    hq0, hkv0, dim = LAYOUTS["llama3-8b"]
    rows = []
    for case0 in EXTEND_CASES:
        d = mode.scale(batch=case0[0], q_len=case0[1], prefix=case0[2], q_heads=hq0, kv_heads=hkv0)
        batch, q_len, prefix, hq, hkv = d["batch"], d["q_len"], d["prefix"], d["q_heads"], d["kv_heads"]
        case = dict(batch=batch, q_len=q_len, prefix=prefix, dtype=str(dtype))
        if mode.smoke:
            case["real"] = case0
        k, v, bt, cl, _, _ = _cache([prefix + q_len] * batch, hkv, dim, dtype, dev)
        cu = torch.arange(0, (batch + 1) * q_len, q_len, dtype=torch.int32, device=dev)
        w = PagedExtendWrapper(dev)
        w.plan(k, bt, cl, cu, hq)
        q = torch.randn(batch * q_len, hq, dim, dtype=dtype, device=dev)
        out = torch.full_like(q, float("nan"))
        ms, graphed = _time_ms(functools.partial(w.run, q, k, v, out=out), mode=mode)
        chk = _check_vs_torch(w, q, k, v, out)
        rows.append(_row("extend", w.spec(), ms, copy_bw, hbm_bw, graphed=graphed, **chk, **case))
        if case0 == EXTEND_CASES[0]:
            rng = random.Random(0)
            parents = [[-1] + [rng.randrange(i) for i in range(1, q_len)] for _ in range(batch)]
            tw = TreeAttentionWrapper(dev)
            tw.plan(k, bt, parents, [prefix] * batch, hq)
            out = torch.full_like(q, float("nan"))
            tms, tgraphed = _time_ms(functools.partial(tw.run, q, k, v, out=out), mode=mode)
            tchk = _check_vs_torch(tw, q, k, v, out)
            rows.append(
                _row("tree", tw.spec(), tms, copy_bw, hbm_bw, graphed=tgraphed, **tchk,
                     nodes=q_len, vs_extend=tms / ms, target_vs_extend=1.3, **case)
            )  # fmt: skip
        k = v = None  # free the cache before the next case
        mode.empty_cache()
    return rows


# Multi-head latent attention decode (DeepSeek-V3: latent 512 + rotary 64, its softmax scale): (query heads, batch,
# context, e4m3 cache); 16 heads is a rank of tensor-parallel 8, 128 the whole model on one GPU.
LATENT_CASES = ((16, 16, 4096, False), (16, 64, 4096, False), (16, 16, 32768, False), (128, 16, 4096, False),
                (16, 16, 4096, True), (128, 16, 4096, True))  # fmt: skip
LATENT, ROPE = 512, 64


def _latent_rows(copy_bw: float, hbm_bw: float | None, dtype, mode: Any = None) -> list[dict]:
    """`latent_decode_attention` over a fragmented latent cache; bandwidth over the latent's bytes (read once)."""
    import torch

    from codesign.backend import use_backend
    from codesign.kernels.attention.latent import latent_decode_attention, latent_decode_spec

    mode = _default_mode(mode)
    rows, seen = [], set()
    for hq0, batch0, ctx0, fp8 in LATENT_CASES:
        d = mode.scale(batch=batch0, ctx=ctx0, q_heads=hq0, kv_heads=1)
        batch, ctx_len, hq = d["batch"], d["ctx"], d["q_heads"]
        if (batch, ctx_len, hq, fp8) in seen:
            continue
        seen.add((batch, ctx_len, hq, fp8))
        k, _, bt, cl, _, _ = _cache([ctx_len] * batch, 1, LATENT + ROPE, dtype, mode.device)
        cache, kv_scale = k[:, :, 0, :], None
        if fp8:  # vLLM's fp8 MLA cache: e4m3 codes, one scale
            kv_scale = float(cache.abs().amax()) / 448
            cache = (cache.float() / kv_scale).to(torch.float8_e4m3fn)
        q = torch.randn(batch, hq, LATENT + ROPE, dtype=dtype, device=mode.device)
        scale = 1 / math.sqrt(192)
        call = functools.partial(latent_decode_attention, q, cache, bt, cl, v_dim=LATENT, sm_scale=scale,
                                 kv_scale=kv_scale, check_data=False)  # fmt: skip
        ms, graphed = _time_ms(call, mode=mode)
        extra: dict[str, Any] = dict(q_heads=hq0, batch=batch0, context=ctx0, dtype=str(dtype), graphed=graphed,
                                     cache="fp8_e4m3" if fp8 else str(dtype))  # fmt: skip
        if batch0 * ctx0 <= 16 * 4096:
            out = call()
            with use_backend("torch"):
                extra.update(_compare(out, call()))
        rows.append(_row("latent_decode", latent_decode_spec(q, cache, cl, LATENT), ms, copy_bw, hbm_bw, **extra))
        k = cache = None
        mode.empty_cache()
    return rows


def run(report: dict, mode: Any = None) -> None:
    """Time paged decode / extend / tree attention on this GPU; results go to report["paged_attention"]."""
    import torch

    mode = _default_mode(mode)
    if not mode.available():
        report["paged_attention"] = {"skipped": "no CUDA device"}
        return
    from codesign.catalog.gpus import match_gpu_name

    name = mode.gpu_name()
    cat = match_gpu_name(name)
    hbm_bw = cat.mem_bw if cat else None
    copy_bw = copy_bandwidth(mode)
    rows = []
    for dtype in (torch.bfloat16, torch.float16):
        if mode.smoke and dtype == torch.bfloat16:
            rows.append(
                dict(kind="decode", dtype=str(dtype), skipped="smoke mode: interpreter bf16 is wrong")
            )
            continue
        rows += _decode_rows(copy_bw, hbm_bw, dtype, mode)
    rows += _extend_and_tree_rows(copy_bw, hbm_bw, mode.dtype(torch.bfloat16), mode)
    rows += _latent_rows(copy_bw, hbm_bw, mode.dtype(torch.bfloat16), mode)
    target = next(
        (
            r
            for r in rows
            if r["kind"] == "decode"
            and r.get("model") == "llama3-8b"
            and r.get("batch") == 64
            and r.get("context") == 4096
            and "bfloat16" in r.get("dtype", "")
            and "ms" in r
        ),
        None,
    )
    report["paged_attention"] = dict(
        gpu=name,
        copy_gbs=copy_bw / 1e9,
        catalog_gbs=None if hbm_bw is None else hbm_bw / 1e9,
        rows=rows,
        decode_target=dict(pct_of_copy=target["pct_of_copy"] if target else None, want=85.0),
        checks_ok=all(r["check_ok"] for r in rows if "check_ok" in r),
    )


if __name__ == "__main__":
    rep: dict = {}
    run(rep)
    print(json.dumps(rep, indent=1, default=str))
