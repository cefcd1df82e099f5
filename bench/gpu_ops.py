"""GPU benchmark entry (bench/gpu_suite.py): single operators timed the way the GPU model's calibration rows were.

`run(report)` adds `report["ops"]` (the contract is `codesign.dataflow.measured_ops`'s):
  * "calibration": the LLMCompass single-operator set the A100 efficiencies were fitted on
    (`llmcompass_ref.op_shapes`: 20 GEMMs, 22 softmax, 22 layernorm and 20 GELU shapes, fp16), each op
    called back to back in PyTorch eager between two synchronizes, launch overhead included, as those rows were;
  * "layers": Llama-3-8B's first layer at decode (batch 16, context 4096) and prefill (one 2048-token prompt),
    one row per operator of the step graph (`dataflow.graph`) timed the same way: torch's GEMMs, RMSNorm and
    elementwise ops, RMSNorm, the gated product and the rotary embedding both torch's (Hugging Face's ops) and ours
    (`kernels.layers`), and attention both ours (paged decode over an fp16 cache) and torch's `sdpa`; each row
    beside the GPU model's prediction with the catalogue's current efficiencies for that GPU.
`checks_ok`: every row timed and read back at its spec (`measured_ops`). Then
`python -m codesign.dataflow.gpu_model --suite REPORT.json` fits that GPU's efficiencies on the calibration
rows (in-sample and leave-one-out errors) and validates them on the layer rows, which it never fits on.

Smoke mode (`gpu_suite.py --smoke`): the two smallest shapes of each calibration op and a one-layer model of
Llama-3-8B's structure at width 256, on the CPU in float32 (the numbers mean nothing; the code and the JSON run).
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable
from typing import Any

DECODE = dict(phase="decode", batch=16, context=4096)
PREFILL = dict(phase="prefill", batch=1, context=2048)
MODEL = "llama-3-8b"
MIN_SECONDS = 0.05  # per op: reps until the timed loop lasts about this long (3 at least, 200 at most)
MAX_REPS = 200


def _time_s(fn: Callable[[], Any], mode: Any) -> float:
    """Seconds a call, back to back in eager mode: one synchronized call sizes the loop, then `reps` calls
    between two synchronizes (launch overhead included, as in the calibration data)."""
    if mode.smoke:
        return mode.time_ms(fn) * 1e-3
    import torch

    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    one = time.perf_counter() - t0
    reps = max(3, min(MAX_REPS, math.ceil(MIN_SECONDS / max(one, 1e-6))))
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / reps


def _calibration_call(op: str, dims: tuple[int, ...], dtype: Any, dev: str) -> Callable[[], Any]:
    import torch
    import torch.nn.functional as F

    if op == "matmul":
        m, n, k = dims
        a, b = torch.randn(m, k, dtype=dtype, device=dev), torch.randn(k, n, dtype=dtype, device=dev)
        return lambda: a @ b
    if op == "softmax":
        x = torch.randn(*dims, dtype=dtype, device=dev)
        return lambda: torch.softmax(x, dim=-1)
    if op == "layernorm":
        x = torch.randn(*dims, dtype=dtype, device=dev)
        w, bias = torch.ones(dims[1], dtype=dtype, device=dev), torch.zeros(dims[1], dtype=dtype, device=dev)
        return lambda: F.layer_norm(x, (dims[1],), w, bias)
    x = torch.randn(*dims, dtype=dtype, device=dev)
    return lambda: F.gelu(x)


def calibration(mode: Any) -> list[dict]:
    from codesign.dataflow.llmcompass_ref import op_shapes

    dtype, dev = _dtype(mode), mode.device
    rows = []
    for op, shapes in op_shapes().items():
        for dims in sorted(shapes, key=math.prod)[:2] if mode.smoke else shapes:
            row: dict[str, Any] = {"op": op, "dims": list(dims)}
            try:
                row["ms"] = _time_s(_calibration_call(op, dims, dtype, dev), mode) * 1e3
            except Exception as e:  # noqa: BLE001 - one shape's failure (e.g. memory) is its row's, not the section's
                row["error"] = f"{type(e).__name__}: {e}"[:300]
            rows.append(row)
            mode.empty_cache()
    return rows


def _dtype(mode: Any) -> Any:
    import torch

    return torch.float32 if mode.smoke else torch.float16  # fp16, as the specs (and LLMCompass) have it


def _model(mode: Any) -> str | dict:
    """The catalogue model (its name), or in smoke mode a one-layer stand-in of its structure (its fields)."""
    if not mode.smoke:
        return MODEL
    from codesign.catalog.models import load_model

    m = load_model(MODEL)
    tiny = dataclasses.replace(m, name=f"{MODEL}-smoke", layers=1, hidden=256, heads=4, kv_heads=2, head_dim=64,
                               ffn=512, vocab=1024)  # fmt: skip
    return dataclasses.asdict(tiny)


def _op_calls(spec: Any, dtype: Any, dev: str) -> list[tuple[str, Callable[[], Any]]]:
    """(impl, call) pairs that run one step-graph operator: torch's, and ours where the toolkit has one."""
    import torch
    import torch.nn.functional as F

    from codesign.kernels.layers import ops as L
    from codesign.specs import Elementwise, Gemm, Norm, PagedDecodeAttention, PrefillAttention, RoPE

    if isinstance(spec, Gemm):
        a = torch.randn(spec.M, spec.K, dtype=dtype, device=dev)
        w = torch.randn(spec.K, spec.N, dtype=dtype, device=dev)
        return [("torch.matmul", lambda: a @ w)]
    if isinstance(spec, Norm) and spec.norm == "rms":
        x = torch.randn(spec.rows, spec.hidden, dtype=dtype, device=dev)
        g = torch.ones(spec.hidden, dtype=dtype, device=dev)
        return [("torch rms_norm", lambda: F.rms_norm(x, (spec.hidden,), g)),
                ("codesign rms_norm", lambda: L.rms_norm(x, g, 1e-5, dispatch=False))]  # fmt: skip
    if isinstance(spec, Elementwise) and spec.op in ("add", "silu_mul"):  # (Llama's; Gemma's gelu_mul is not here)
        a, b = (torch.randn(spec.numel, dtype=dtype, device=dev) for _ in range(2))
        if spec.op == "add":
            return [("torch add", lambda: a + b)]
        return [("torch silu * up", lambda: F.silu(a) * b), ("codesign silu_mul", lambda: L.silu_mul(a, b, False))]
    if isinstance(spec, RoPE) and spec.tokens:  # (one token a row: decode's layout; a prompt's as one row)
        rows, seq = (spec.tokens, 1) if spec.tokens <= 64 else (1, spec.tokens)
        q = torch.randn(rows, seq, spec.q_heads, spec.head_dim, dtype=dtype, device=dev).transpose(1, 2)
        k = torch.randn(rows, seq, spec.kv_heads, spec.head_dim, dtype=dtype, device=dev).transpose(1, 2)
        cos, sin = (torch.randn(rows, seq, spec.head_dim, dtype=dtype, device=dev) for _ in range(2))
        return [("torch rotate_half", lambda: _hf_rope(q, k, cos, sin)),
                ("codesign rope", lambda: L.rope(q, k, cos, sin, dispatch=False))]  # fmt: skip
    if isinstance(spec, PagedDecodeAttention):
        return _decode_attention_calls(spec, dtype, dev)
    if isinstance(spec, PrefillAttention) and len(set(spec.seq_lens)) == 1:  # (equal prompts: one dense batch)
        b, n = len(spec.seq_lens), spec.seq_lens[0]
        q = torch.randn(b, spec.q_heads, n, spec.head_dim, dtype=dtype, device=dev)
        k, v = (torch.randn(b, spec.kv_heads, n, spec.head_dim, dtype=dtype, device=dev) for _ in range(2))
        return [("torch sdpa (causal)", lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                                               enable_gqa=True))]  # fmt: skip
    return []  # the KV write, embedding, sampling: no single torch call to set beside the spec


def _hf_rope(q, k, cos, sin):
    """Hugging Face's apply_rotary_pos_emb, op for op (`kernels.layers.ops`' torch path)."""
    from codesign.kernels.layers.ops import _rope_torch

    return _rope_torch(q, k, cos, sin)


def _decode_attention_calls(spec: Any, dtype: Any, dev: str) -> list[tuple[str, Callable[[], Any]]]:
    import torch
    import torch.nn.functional as F

    from codesign.kernels.attention.wrappers import PagedDecodeWrapper

    batch, ctx, bs = len(spec.context_lens), max(spec.context_lens), spec.block_size
    per = -(-ctx // bs)
    k = torch.randn(batch * per, bs, spec.kv_heads, spec.head_dim, dtype=dtype, device=dev)
    v = torch.randn_like(k)
    bt = torch.randperm(batch * per, device=dev).to(torch.int32).view(batch, per)  # fragmented, as a server's
    cl = torch.tensor(spec.context_lens, dtype=torch.int32, device=dev)
    q = torch.randn(batch, spec.q_heads, spec.head_dim, dtype=dtype, device=dev)
    w = PagedDecodeWrapper(dev)
    w.plan(k, bt, cl, spec.q_heads)
    kc, vc = (torch.randn(batch, spec.kv_heads, ctx, spec.head_dim, dtype=dtype, device=dev) for _ in range(2))
    q4 = q.unsqueeze(2)
    sdpa = lambda: F.scaled_dot_product_attention(q4, kc, vc, enable_gqa=True)  # noqa: E731
    return [("codesign paged decode", lambda: w.run(q, k, v)), ("torch sdpa (contiguous cache)", sdpa)]


def layers(mode: Any) -> list[dict]:
    from codesign.catalog.gpus import match_gpu_name
    from codesign.catalog.models import ModelConfig
    from codesign.dataflow.gpu_model import gpu_op_time
    from codesign.dataflow.graph import build_step_graph

    dtype, dev = _dtype(mode), mode.device
    model = _model(mode)
    gpu = None if mode.smoke else match_gpu_name(mode.gpu_name())
    out = []
    for setting in (DECODE, PREFILL):
        if mode.smoke:
            setting = {**setting, "batch": min(setting["batch"], 2), "context": 32}
        cfg = ModelConfig(**model) if isinstance(model, dict) else model
        g = build_step_graph(cfg, setting["phase"], setting["batch"], setting["context"])
        rows = []
        for node, data in g.nodes(data=True):
            if not node.startswith("L0."):
                continue
            pred = gpu_op_time(data["spec"], gpu) * 1e3 if gpu is not None else None
            for impl, call in _op_calls(data["spec"], dtype, dev):
                row: dict[str, Any] = {"node": node, "impl": impl, "predicted_ms": pred}
                try:
                    row["ms"] = _time_s(call, mode) * 1e3
                except Exception as e:  # noqa: BLE001 - recorded per row
                    row["error"] = f"{type(e).__name__}: {e}"[:300]
                rows.append(row)
            mode.empty_cache()
        out.append({"model": model, **setting, "rows": rows})
    return out


def run(report: dict, mode: Any = None) -> None:
    """report["ops"]: the calibration set and the layer operators (module docstring)."""
    if mode is None:
        import sys
        from pathlib import Path

        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from gpu_suite import GPU as mode
    if not mode.available():
        report["ops"] = {"skipped": "no CUDA device"}
        return
    t0 = time.monotonic()
    report["ops"] = {
        "method": "PyTorch eager, back to back between two synchronizes, launch overhead included; fp16 "
                  f"({'float32 on the CPU: smoke' if mode.smoke else 'as the calibration data'})",  # fmt: skip
        "calibration": calibration(mode),
        "layers": layers(mode),
    }
    report["ops"]["seconds"] = round(time.monotonic() - t0, 1)
    report["ops"]["checks_ok"] = _checks_ok(report)


def _checks_ok(report: dict) -> bool:
    """Every row timed (a positive time, no error) and read back at its spec by `measured_ops`."""
    from codesign.dataflow.measured_ops import calibration_rows, layer_rows

    ops = report["ops"]
    rows = ops["calibration"] + [r for lay in ops["layers"] for r in lay["rows"]]
    timed = all(isinstance(r.get("ms"), float) and r["ms"] > 0 for r in rows)
    return timed and len(calibration_rows(report)) + len(layer_rows(report)) == len(rows) > 0
