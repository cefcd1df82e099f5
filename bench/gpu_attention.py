"""GPU benchmark entries for paged decode, extend and tree attention (for the one GPU suite).

`run(report)` adds `report["paged_attention"]`: the measured device-to-device copy bandwidth, then
one row per case with the time, the achieved bandwidth (the spec's `min_bytes()` over the time) and
its percentage of the measured copy and of the catalogue's HBM figure, and FlashInfer / vLLM times
side by side when they import. Targets (issue 4): decode bf16, batch 64, context 4096, Llama-3-8B
layout >= 85 % of copy bandwidth; a 64-node tree over a 4k prefix at batch 16 <= 1.3x the causal
extend of 64 tokens over the same prefix. Times use CUDA graphs where capture works (it also
checks that `run()` is capturable), else `triton.testing.do_bench`.

Standalone: python bench/gpu_attention.py  (prints the report as JSON).
"""

from __future__ import annotations

import functools
import json
import random
from typing import Any

LAYOUTS = {"llama3-8b": (32, 8, 128), "llama2-70b": (64, 8, 128)}  # q heads, kv heads, head_dim
BATCHES = (1, 16, 64, 256)
CONTEXTS = (512, 4096, 32768)
BLOCK_SIZE = 16
MAX_KV_BYTES = 24 * 2**30  # skip cases whose K+V cache would exceed this (keeps the suite short)


def _time_ms(fn, graph: bool = True) -> tuple[float, bool]:
    import torch
    import triton.testing as tt

    if graph:
        try:
            return float(tt.do_bench_cudagraph(fn, rep=50)), True
        except Exception:  # noqa: BLE001 - capture may fail for third-party kernels; fall back
            torch.cuda.synchronize()
    return float(tt.do_bench(fn, warmup=10, rep=50)), False


def copy_bandwidth() -> float:
    """Device-to-device copy bandwidth in bytes/s (read + write of a 2 GiB buffer)."""
    import torch

    src = torch.empty(2**31, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms, _ = _time_ms(lambda: dst.copy_(src), graph=False)
    return 2 * src.numel() / (ms * 1e-3)


def _cache(ctx: list[int], hkv: int, dim: int, dtype):
    import torch

    need = [-(-c // BLOCK_SIZE) for c in ctx]
    nb = sum(need)
    k = torch.randn(nb, BLOCK_SIZE, hkv, dim, dtype=dtype, device="cuda")
    v = torch.randn_like(k)
    perm = torch.randperm(nb, device="cuda").to(torch.int32)  # fragmented, like a long-running server
    bt = torch.zeros(len(ctx), max(need), dtype=torch.int32, device="cuda")
    offs = [0]
    for n in need:
        offs.append(offs[-1] + n)
    for b, n in enumerate(need):
        bt[b, :n] = perm[offs[b] : offs[b + 1]]
    return k, v, bt, torch.tensor(ctx, dtype=torch.int32, device="cuda"), perm, offs


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


def _check_vs_torch(w, q, k, v, out) -> float:
    """Max |kernel - torch implementation| for the planned batch (guards against timing a wrong kernel)."""
    from codesign.backend import use_backend

    with use_backend("torch"):
        ref = w.run(q, k, v)
    return float((out.float() - ref.float()).abs().max())


def _decode_rows(copy_bw: float, hbm_bw: float | None, dtype) -> list[dict]:
    import torch

    from codesign.kernels.paged_attention import PagedDecodeWrapper

    rows = []
    for model, (hq, hkv, dim) in LAYOUTS.items():
        for batch in BATCHES:
            for ctx_len in CONTEXTS:
                kv_bytes = 2 * batch * ctx_len * hkv * dim * 2
                case = dict(model=model, batch=batch, context=ctx_len, dtype=str(dtype))
                if kv_bytes > MAX_KV_BYTES:
                    rows.append(dict(kind="decode", skipped=f"cache {kv_bytes / 2**30:.0f} GiB", **case))
                    continue
                ctx = [ctx_len] * batch
                k, v, bt, cl, perm, offs = _cache(ctx, hkv, dim, dtype)
                q = torch.randn(batch, hq, dim, dtype=dtype, device="cuda")
                w = PagedDecodeWrapper("cuda")
                w.plan(k, bt, cl, hq)
                out = torch.empty_like(q)
                ms, graphed = _time_ms(functools.partial(w.run, q, k, v, out=out))
                extra = dict(graphed=graphed, num_splits=w._plan["num_splits"], **case)
                if batch * ctx_len <= 16 * 4096:
                    extra["max_err_vs_torch"] = _check_vs_torch(w, q, k, v, out)
                extra["flashinfer_ms"] = _flashinfer_decode_ms(q, k, v, perm, offs, ctx, hq, hkv, dim)
                extra["vllm_ms"] = _vllm_decode_ms(q, k, v, bt, cl)
                rows.append(_row("decode", w.spec(), ms, copy_bw, hbm_bw, **extra))
                k = v = None  # free the cache before the next case
                torch.cuda.empty_cache()
    return rows


def _extend_and_tree_rows(copy_bw: float, hbm_bw: float | None, dtype) -> list[dict]:
    import torch

    from codesign.kernels.paged_attention import PagedExtendWrapper
    from codesign.kernels.tree_attention import TreeAttentionWrapper

    hq, hkv, dim = LAYOUTS["llama3-8b"]
    rows = []
    for batch, q_len, prefix in ((16, 64, 4096), (8, 512, 4096), (4, 2048, 0)):
        case = dict(batch=batch, q_len=q_len, prefix=prefix, dtype=str(dtype))
        k, v, bt, cl, _, _ = _cache([prefix + q_len] * batch, hkv, dim, dtype)
        cu = torch.arange(0, (batch + 1) * q_len, q_len, dtype=torch.int32, device="cuda")
        w = PagedExtendWrapper("cuda")
        w.plan(k, bt, cl, cu, hq)
        q = torch.randn(batch * q_len, hq, dim, dtype=dtype, device="cuda")
        out = torch.empty_like(q)
        ms, graphed = _time_ms(functools.partial(w.run, q, k, v, out=out))
        err = _check_vs_torch(w, q, k, v, out)
        rows.append(
            _row("extend", w.spec(), ms, copy_bw, hbm_bw, graphed=graphed, max_err_vs_torch=err, **case)
        )
        if (batch, q_len, prefix) == (16, 64, 4096):
            rng = random.Random(0)
            parents = [[-1] + [rng.randrange(i) for i in range(1, q_len)] for _ in range(batch)]
            tw = TreeAttentionWrapper("cuda")
            tw.plan(k, bt, parents, [prefix] * batch, hq)
            tms, tgraphed = _time_ms(functools.partial(tw.run, q, k, v, out=out))
            terr = _check_vs_torch(tw, q, k, v, out)
            rows.append(
                _row("tree", tw.spec(), tms, copy_bw, hbm_bw, graphed=tgraphed, max_err_vs_torch=terr,
                     nodes=q_len, vs_extend=tms / ms, target_vs_extend=1.3, **case)
            )  # fmt: skip
        k = v = None  # free the cache before the next case
        torch.cuda.empty_cache()
    return rows


def run(report: dict) -> None:
    """Time paged decode / extend / tree attention on this GPU; results go to report["paged_attention"]."""
    import torch

    if not torch.cuda.is_available():
        report["paged_attention"] = {"skipped": "no CUDA device"}
        return
    from codesign.catalog.gpus import match_gpu_name

    name = torch.cuda.get_device_name()
    cat = match_gpu_name(name)
    hbm_bw = cat.mem_bw if cat else None
    copy_bw = copy_bandwidth()
    rows = []
    for dtype in (torch.bfloat16, torch.float16):
        rows += _decode_rows(copy_bw, hbm_bw, dtype)
    rows += _extend_and_tree_rows(copy_bw, hbm_bw, torch.bfloat16)
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
    )


if __name__ == "__main__":
    rep: dict = {}
    run(rep)
    print(json.dumps(rep, indent=1, default=str))
