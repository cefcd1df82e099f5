"""GPU benchmark entry for the quantized GEMM kernels (for the one GPU suite, bench/gpu_suite.py).

`run(report)` adds `report["quant_gemm"]`: one row per (model layer, M, kernel) with the time, TFLOP/s,
GB/s (the `Gemm` spec's `min_bytes()` over the time), percent of the spec's roofline on this GPU
(from `codesign.catalog`), speedup over bf16 `torch.matmul` on the same shape, and the relative
error against a dequantize-then-matmul fp32 reference (checked once per layer and kernel, at M=16).
Kernels: W4A16 g128 asym (Triton; also CuPy for M <= 16 when cupy imports), W8A16 per-channel,
W8A8 int8 (dynamic per-token activations included in the time), FP8 (sm_89+ only); each as the op runs it
(the variant table or the default rule) and with each variant pinned ("w4a16_g128@dequant", "fp8@torch",
"w8a8_int8@fusedq" beside "w8a8_int8@triton", the quantizer fused or in its own launch, ...: a pinned variant
torch cannot take at that shape is an error row saying why).

Peers (bench/peers.py: gemlite, torchao, installed offline from the suite's `--peers-dir`) are timed on
the same x and weight as rows "<peer>:<format>", their error checked once per layer against the
unquantized product (they quantize with their own rules); `report["quant_gemm"]["peers"]` says which
ran and why not, `["compare"]` gives ours/bf16 and ours/best peer per (layer, M, format).

Targets (issue 20, `TARGETS`): W4A16 g128 at N = K = 8192 >= 2.0x bf16 at M = 1, >= 1.5x at M = 16, >= 0.9x at
M >= 256 and at least gemlite's speed at every M; W8A8 int8 and FP8 >= 1.4x at M >= 1024 and >= 1.0x at M = 16.
`report["quant_gemm"]["targets"]` gives each one's worst measured speed-up, where, and whether it was met.
Times use CUDA graphs where capture works, else `triton.testing.do_bench`.

Smoke mode (`gpu_suite.py --smoke`): the same tables shrunk by `gpu_suite.smoke_shape`, float16 for
bf16 (the interpreter computes bf16 wrongly), one CPU-timed call per case, each pinned `@variant` at the first
shape only (the second adds no code path, only interpreter time), no CuPy (needs CUDA tensors), and the stand-in
peer `peers.SMOKE_PEERS` in place of the real ones (they run CUDA kernels only).

Standalone: python bench/gpu_quant_gemm.py [--quick]  (prints the report as JSON).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

MS = (1, 4, 16, 64, 256, 1024, 4096)
# (N, K) of each linear layer; fused QKV and gate+up as serving engines run them. From the Hugging
# Face configs: Llama-3-8B hidden 4096, intermediate 14336, 32 q / 8 kv heads of 128;
# Llama-2-70B hidden 8192, intermediate 28672, 64 q / 8 kv heads of 128.
SHAPES: dict[str, dict[str, tuple[int, int]]] = {
    "llama3-8b": {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)},
    "llama2-70b": {"qkv": (10240, 8192), "o": (8192, 8192), "gate_up": (57344, 8192), "down": (8192, 28672)},
    "square": {"8192": (8192, 8192)},
}
QUICK_SHAPES = {"square": {"8192": (8192, 8192)}, "llama2-70b": {"gate_up": (57344, 8192)}}


BENCH_DIR = Path(__file__).resolve().parent


def _default_mode(mode: Any) -> Any:
    """The suite's run mode; standalone runs get the suite's GPU mode."""
    if mode is not None:
        return mode
    sys.path.insert(0, str(BENCH_DIR))
    from gpu_suite import GPU

    return GPU


def _peers_module():
    if str(BENCH_DIR) not in sys.path:
        sys.path.insert(0, str(BENCH_DIR))
    import peers

    return peers


def _peer_setup(mode: Any) -> tuple[Any, dict, tuple]:
    """(the peers module, {peer: PeerStatus}, the peers to time): the real ones on the GPU, the stand-in in smoke."""
    import atexit
    import shutil
    import tempfile

    peers = _peers_module()
    cast = peers.SMOKE_PEERS if mode.smoke else peers.PEERS
    target = Path(tempfile.mkdtemp(prefix="codesign-peers-"))
    atexit.register(shutil.rmtree, target, True)  # the peers stay importable for the run, then go
    return peers, peers.install_peers(getattr(mode, "peers_dir", None), target, cast), cast


def _time_ms(fn, mode: Any = None) -> tuple[float, bool]:
    import torch
    import triton.testing as tt

    if mode is not None and mode.smoke:
        return mode.time_ms(fn), False
    try:
        return float(tt.do_bench_cudagraph(fn, rep=30, return_mode="median")), True
    except Exception:  # noqa: BLE001 - capture can fail (e.g. a third-party kernel); time without it
        torch.cuda.synchronize()
    return float(tt.do_bench(fn, warmup=10, rep=30, return_mode="median")), False


def _kernels(weight, fp8_ok: bool, cupy_ok: bool, act: str = "bf16") -> dict[str, Any]:
    """name -> (weight format, act dtype, callable(x) or None when unavailable, QuantizedWeight).

    `act`: the activation / scale dtype of the weight-only kernels ("bf16"; "fp16" in smoke mode)."""
    from codesign.backend import use_backend
    from codesign.kernels.gemm import formats as qf
    from codesign.kernels.gemm import ops as qg
    from codesign.specs import WeightFormat

    w4 = qf.quantize_rtn(weight, "int4", 128, False, torch_dtype(act))
    w8 = qf.quantize_rtn(weight, "int8", None, True, torch_dtype(act))
    w8a8 = qf.quantize_rtn(weight, "int8", None, True, torch_dtype("fp32"))
    w8a8_kn = qf.int8_codes_nk(w8a8.qweight).t()  # signed codes, K contiguous: what `QuantLinear` keeps
    out: dict[str, Any] = {
        "w4a16_g128": (
            WeightFormat("int4", 128, False, act),
            act,
            lambda x: qg.quant_matmul(x, w4),
            w4,
        ),
        "w8a16_pc": (WeightFormat("int8", None, True, act), act, lambda x: qg.quant_matmul(x, w8), w8),
        "w8a8_int8": (
            WeightFormat("int8", None, True, "fp32"),
            "int8",
            lambda x: qg.w8a8_gemm(x, w8a8_kn, w8a8.scales, None),
            w8a8,
        ),
    }
    if fp8_ok:
        wf = qf.quantize_rtn(weight, "fp8_e4m3", None)
        out["fp8"] = (
            WeightFormat("fp8_e4m3", None, True, "fp32"),
            "fp8_e4m3",
            lambda x: qg.quant_matmul(x, wf),
            wf,
        )
    out.update(_forced_variants(out))
    if cupy_ok:
        w4h = qf.quantize_rtn(weight, "int4", 128, False, torch_dtype("fp16"))

        def cupy_call(x):
            with use_backend("cupy", op="w4a16_gemm"):
                return qg.quant_matmul(x.half(), w4h)

        out["w4a16_g128_cupy"] = (WeightFormat("int4", 128, False, "fp16"), "fp16", cupy_call, w4h)
    return out


def _forced_variants(kernels: dict[str, Any]) -> dict[str, Any]:
    """Each variant of an op pinned, as rows "<kernel>@<variant>", so one run shows the crossovers the variant
    table and the default rule should follow (the unpinned row is what a user gets)."""
    from codesign.autotune.lookup import forced_config
    from codesign.kernels.gemm import triton_gemm as qt

    def pinned(fn, op, entry):
        def call(x):
            with forced_config(op, entry):
                return fn(x)

        return call

    out = {}
    for name, bits in (("w4a16_g128", 4), ("w8a16_pc", 8)):
        wf, act, fn, qw = kernels[name]
        for v in qt.WQ_VARIANTS:
            out[f"{name}@{v}"] = (wf, act, pinned(fn, qt.wq_variant_op(bits), qt.wq_variant_entry(v)), qw)
    for name, fp8 in (("w8a8_int8", False), ("fp8", True)):
        if name in kernels:
            wf, act, fn, qw = kernels[name]
            for v in qt.SCALED_MM_VARIANTS:  # "@triton" two launches, "@fusedq" the quantizer fused, "@torch"
                entry = qt.scaled_mm_variant_entry(v)
                out[f"{name}@{v}"] = (wf, act, pinned(fn, qt.scaled_mm_variant_op(fp8), entry), qw)
    return out


def torch_dtype(name: str):
    import torch

    return {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[name]


def _rel_err(out, ref) -> float:
    import torch

    o, r = out.float(), ref.float()
    if not torch.isfinite(o).all():
        return float("inf")
    return float(torch.linalg.vector_norm(o - r) / torch.linalg.vector_norm(r))


def run(report: dict, quick: bool = False, mode: Any = None) -> None:
    """Time every quantized kernel vs bf16 torch.matmul; adds report["quant_gemm"] (see module doc)."""
    import torch

    from codesign.catalog.gpus import match_gpu_name
    from codesign.specs import Gemm, WeightFormat

    mode = _default_mode(mode)
    if not mode.available():
        report["quant_gemm"] = {"skipped": "no CUDA device"}
        return
    dev, act = mode.device, "fp16" if mode.smoke else "bf16"
    name = mode.gpu_name()
    spec_gpu = match_gpu_name(name)
    fp8_ok = mode.smoke or torch.cuda.get_device_capability() >= (8, 9)  # the interpreter runs e4m3 too
    cupy_ok = False
    if not mode.smoke:  # CuPy kernels need CUDA tensors
        try:
            import cupy  # noqa: F401

            cupy_ok = True
        except ImportError:
            pass
    peers, peer_status, cast = _peer_setup(mode)
    rows: list[dict[str, Any]] = []
    torch.manual_seed(0)
    ms_of: dict[int, list[int]] = {}  # M to run -> the table's Ms it stands for (smoke merges some)
    for m_real in MS:
        ms_of.setdefault(mode.scale(M=m_real)["M"], []).append(m_real)
    for i, (model, layer, (n_real, k_real)) in enumerate(
        (mo, la, nk) for mo, layers in (QUICK_SHAPES if quick else SHAPES).items() for la, nk in layers.items()
    ):
        first = i == 0  # the run's first shape
        d = mode.scale(N=n_real, K=k_real)
        n, k = d["N"], d["K"]
        weight = torch.randn(n, k, device=dev, dtype=torch_dtype(act)) * 0.02
        kernels = _kernels(weight, fp8_ok=fp8_ok, cupy_ok=cupy_ok, act=act)
        peer_fns = _peer_kernels(peers, peer_status, cast, weight, kernels, rows, (model, layer, n, k))
        for m, reals in ms_of.items():
            x = torch.randn(m, k, device=dev, dtype=torch_dtype(act))
            base_ms, _ = _time_ms(lambda x=x, w=weight: torch.matmul(x, w.t()), mode)
            base_spec = Gemm(m, n, k, WeightFormat(act), act, act)
            rows.append(
                _row(model, layer, m, n, k, f"{act}_matmul", base_ms, base_ms, None, base_spec, spec_gpu)
            )
            for kname, (wfmt, kact, fn, qw) in kernels.items():
                # The smallest-M variants (the GEMV launches once per 4 rows of x), decided on the table's M
                # (smoke's M 8 and 16 stand for 64 and 256, which the real run does not give the GEMV).
                if (kname.endswith("cupy") or kname.endswith("@gemv")) and min(reals) > 16:
                    continue
                if mode.smoke and "@" in kname and not first:  # smoke: each pinned variant at one shape
                    continue
                try:
                    err = None
                    if 16 in reals:  # correctness once per layer and kernel, at M = 16
                        ref = x.float() @ qw.dequantize(torch.float32).t()
                        err = _rel_err(fn(x), ref)
                    ms, _ = _time_ms(lambda fn=fn, x=x: fn(x), mode)
                    spec = Gemm(m, n, k, wfmt, kact, act if kact != "fp16" else "fp16")
                    rows.append(_row(model, layer, m, n, k, kname, ms, base_ms, err, spec, spec_gpu))
                except Exception as e:  # one kernel failing (CuPy's compiler, say) keeps the others' rows
                    if mode.smoke:
                        raise
                    mode.sync()  # a sticky CUDA error resurfaces here and ends the section instead
                    rows.append(dict(model=model, layer=layer, M=m, N=n, K=k, kernel=kname,
                                     error=f"{type(e).__name__}: {e}"[:300]))  # fmt: skip
            for (peer, fmt), fn in peer_fns.items():
                wfmt = kernels[peers.OURS[fmt]][0]
                rows.append(_peer_row(mode, (model, layer, m, n, k), peer, fmt, fn, x, weight,
                                      16 in reals, base_ms, wfmt, act, spec_gpu))  # fmt: skip
        del weight, kernels, peer_fns
        mode.empty_cache()
    report["quant_gemm"] = {
        "gpu": name,
        "catalog_gpu": spec_gpu.key if spec_gpu else None,
        "rows": rows,
        "targets": _targets(rows, peers.compare(rows)),
        "checks_ok": all(r["rel_err_ok"] for r in rows if r.get("rel_err") is not None and "peer" not in r)
        and not any("error" in r for r in rows if "peer" not in r and not _refused(r)),
        "peers": {name: vars(st) for name, st in peer_status.items()},
        "peers_checks_ok": all(r.get("rel_err_ok", True) and "error" not in r for r in rows if "peer" in r),
        "compare": peers.compare(rows),
    }


def _refused(row: dict[str, Any]) -> bool:
    """A pinned variant that cannot take this shape (torch's alignment or M rules): a row, not a failure."""
    return "@" in row["kernel"] and "cannot run" in row.get("error", "")


# A peer's error is measured against x @ W^T with the unquantized W (it quantizes by its own rules): int4
# g128 on Gaussian weights is ~10 %, int8 per channel ~1 %, e4m3 ~5 %; a misused adapter (W transposed,
# scales dropped) is O(1).
PEER_REL_ERR_BOUND = {"w4a16_g128": 0.15, "w8a8_int8": 3e-2, "fp8": 8e-2}


def _peer_kernels(peers, status, cast, weight, kernels, rows, where) -> dict[tuple[str, str], Any]:
    """{(peer, format): fn} for every peer that builds each format we time; a peer that cannot is one error
    row per layer (M None), so the table says why its column is empty."""
    model, layer, n, k = where
    out = {}
    for fmt in peers.FORMATS:
        if peers.OURS[fmt] not in kernels:
            continue
        for peer, fn in peers.peer_kernels(status, fmt, weight, cast).items():
            if callable(fn):
                out[(peer, fmt)] = fn
            else:
                rows.append(dict(model=model, layer=layer, M=None, N=n, K=k, kernel=f"{peer}:{fmt}", peer=peer,
                                 error=fn))  # fmt: skip
    return out


def _peer_row(mode, where, peer, fmt, fn, x, weight, check, base_ms, wfmt, act, spec_gpu) -> dict[str, Any]:
    """One timed row of a peer's kernel on ours' spec (same bytes and flops), checked when `check`."""
    from codesign.specs import Gemm

    model, layer, m, n, k = where
    name = f"{peer}:{fmt}"
    try:
        err = None
        if check:
            err = _rel_err(fn(x), x.float() @ weight.float().t())
        ms, _ = _time_ms(lambda: fn(x), mode)
        kact = {"w4a16_g128": act, "w8a8_int8": "int8", "fp8": "fp8_e4m3"}[fmt]
        row = _row(model, layer, m, n, k, name, ms, base_ms, err, Gemm(m, n, k, wfmt, kact, act), spec_gpu,
                   bound=PEER_REL_ERR_BOUND[fmt])  # fmt: skip
    except Exception as e:  # noqa: BLE001 - a peer failing on this GPU is its row, not the section's end
        mode.sync()
        row = dict(model=model, layer=layer, M=m, N=n, K=k, kernel=name, error=f"{type(e).__name__}: {e}"[:300])
    row["peer"] = peer
    return row


# ||out - ref|| / ||ref|| bounds of the M = 16 check against x @ dequant(W)^T in fp32: the output is
# rounded once to bf16 (2^-9); W8A8 / FP8 also quantize x per token (int8: ~0.5 %, e4m3: ~3 %).
# A wrong kernel (unwritten tile, bad split) is O(1).
REL_ERR_BOUND = {"w8a8_int8": 2e-2, "fp8": 8e-2}
REL_ERR_BOUND_DEFAULT = 1e-2


def _row(model, layer, m, n, k, kernel, ms, base_ms, err, spec, gpu, bound: float | None = None) -> dict[str, Any]:
    t = ms * 1e-3
    row = {
        "model": model,
        "layer": layer,
        "M": m,
        "N": n,
        "K": k,
        "kernel": kernel,
        "ms": ms,
        "tflops": spec.flops() / t / 1e12,
        "gbs": spec.min_bytes() / t / 1e9,
        "speedup_vs_bf16": base_ms / ms,
        "rel_err": err,
    }
    if err is not None:
        own = kernel.split("@")[0]  # a pinned variant has its op's bound
        row["rel_err_bound"] = bound if bound is not None else REL_ERR_BOUND.get(own, REL_ERR_BOUND_DEFAULT)
        row["rel_err_ok"] = err <= row["rel_err_bound"]
    if gpu is not None:
        roof = max(spec.flops() / gpu.peak(spec.peak_key()), spec.min_bytes() / gpu.mem_bw)
        row["pct_roofline"] = 100.0 * roof / t
    return row


# Issue 20's targets, as (kernel, the Ms, the least speed-up over bf16): W4A16 g128 at N = K = 8192; the 8-bit ops
# at every shape of the run.
TARGETS = {
    "w4a16_m1": ("w4a16_g128", lambda m: m == 1, 2.0),
    "w4a16_m16": ("w4a16_g128", lambda m: m == 16, 1.5),
    "w4a16_m256_up": ("w4a16_g128", lambda m: m >= 256, 0.9),
    "w8a8_int8_m1024_up": ("w8a8_int8", lambda m: m >= 1024, 1.4),
    "w8a8_int8_m16": ("w8a8_int8", lambda m: m == 16, 1.0),
    "fp8_m1024_up": ("fp8", lambda m: m >= 1024, 1.4),
    "fp8_m16": ("fp8", lambda m: m == 16, 1.0),
}
W4A16_SHAPE = ("square", "8192")


def _targets(rows: list[dict[str, Any]], compare: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """Issue 20's targets against the rows: the worst measured speed-up over bf16 of each, the target, met (None
    where nothing was timed); and W4A16 against gemlite at every M timed beside it (ours / gemlite >= 1)."""

    def res(measured, target, **extra):
        return dict(measured=measured, target=target, met=None if measured is None else measured >= target, **extra)

    out: dict[str, Any] = {}
    for name, (kernel, ms, target) in TARGETS.items():
        got = [r for r in rows if r["kernel"] == kernel and ms(r["M"]) and "ms" in r
               and (kernel != "w4a16_g128" or (r["model"], r["layer"]) == W4A16_SHAPE)]  # fmt: skip
        worst = min(got, key=lambda r: r["speedup_vs_bf16"], default=None)
        out[name] = res(None if worst is None else worst["speedup_vs_bf16"], target,
                        at=None if worst is None else f"{worst['model']} {worst['layer']} M={worst['M']}")  # fmt: skip
    vs = [c for c in compare or [] if c["format"] == "w4a16_g128" and (c["model"], c["layer"]) == W4A16_SHAPE
          and c["ours_ms"] and "gemlite" in c["peers_ms"]]  # fmt: skip
    worst = min(vs, key=lambda c: c["peers_ms"]["gemlite"] / c["ours_ms"], default=None)
    out["w4a16_vs_gemlite"] = res(None if worst is None else worst["peers_ms"]["gemlite"] / worst["ours_ms"], 1.0,
                                  at=None if worst is None else f"M={worst['M']}")  # fmt: skip
    return out


if __name__ == "__main__":
    rep: dict = {}
    run(rep, quick="--quick" in sys.argv)
    print(json.dumps(rep, indent=1))
