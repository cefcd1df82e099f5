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
  * "states": the recurrent-state steps of hybrid models at decode and over a prompt (Gated DeltaNet, Mamba-2's
    and Mamba-1's state updates and scans),
    transformers' torch functions and ours (`kernels.layers.state_ops`), bf16 with fp32 states, each with its
    spec's bytes and the GPU model's prediction (not part of the fit: no calibration row has these ops).
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


def _timed(row: dict[str, Any], call: Callable[[], Any], mode: Any) -> dict[str, Any]:
    """row with the call's milliseconds ("ms"), or the error it raised ("error")."""
    try:
        row["ms"] = _time_s(call, mode) * 1e3
    except Exception as e:  # noqa: BLE001 - recorded per row
        row["error"] = f"{type(e).__name__}: {e}"[:300]
    return row


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
                rows.append(_timed({"node": node, "impl": impl, "predicted_ms": pred}, call, mode))
            mode.empty_cache()
        out.append({"model": model, **setting, "rows": rows})
    return out


def _state_cases(mode: Any) -> list[tuple[str, Any, Callable[[], Any], Callable[[], Any]]]:
    """(label, spec, transformers' torch function, ours) at decode over 16 sequences: Qwen3-Next's Gated DeltaNet
    (16 key / 32 value heads of 128; one token, and 4, a speculative step's; a tree step's 15 nodes; a prompt), a
    Mamba-2 mixer as Granite 4.0-H's (128 heads of 64, state 128, one group; a tree step's 15 nodes; and its scan over
    a prompt) and Jamba's Mamba-1 mixer (`_mamba1_cases`), fp32 states, the model's dtype elsewhere (smoke: small and
    fp32)."""
    import torch

    from codesign.kernels.layers import state_ops as S
    from codesign.specs import GatedDeltaRule, SSDScan

    dtype, dev = (torch.float32, "cpu") if mode.smoke else (torch.bfloat16, mode.device)
    b, hk, hv, d, heads, p, n = (2, 2, 4, 16, 4, 8, 16) if mode.smoke else (16, 16, 32, 128, 128, 64, 128)
    name = "float32" if mode.smoke else "bfloat16"
    dt_name = {"float32": "fp32", "bfloat16": "bf16"}[name]
    cases = []
    recurrent = _transformers_fn("qwen3_next", "torch_recurrent_gated_delta_rule")
    for t in (1, 4):
        q, k = (torch.randn(b, t, hk, d, dtype=dtype, device=dev) for _ in range(2))
        v = torch.randn(b, t, hv, d, dtype=dtype, device=dev)
        g = -torch.rand(b, t, hv, device=dev)
        beta = torch.rand(b, t, hv, device=dev).to(dtype)
        h0 = torch.randn(b, hv, d, d, device=dev)
        spec = GatedDeltaRule(key_heads=hk, value_heads=hv, key_dim=d, value_dim=d, new_tokens=(t,) * b,
                              dtype=dt_name, state_dtype="fp32")  # fmt: skip
        cases.append((f"gated_delta_rule B={b} T={t} heads={hk}/{hv} d={d}", spec,
                      lambda a=(q, k, v, g, beta, h0): recurrent(*a[:3], g=a[3], beta=a[4], initial_state=a[5],
                                                                 output_final_state=True,
                                                                 use_qk_l2norm_in_kernel=True),
                      lambda a=(q, k, v, g, beta, h0): S.gated_delta_rule(*a, dispatch=False)))  # fmt: skip
    cases.append(_tree_case(recurrent, (b, hk, hv, d), dtype, dev, dt_name))
    cases.append(_ssd_tree_case((b, heads, p, n), dtype, dev, dt_name))
    cases.append(_prompt_case(mode, dtype, dev, dt_name))
    cases.append(_scan_case(mode, dtype, dev, dt_name))
    cases.extend(_mamba1_cases(mode, dtype, dev, dt_name))
    st = torch.randn(b, heads, p, n, device=dev)
    x, z = (torch.randn(b, heads, p, dtype=dtype, device=dev) for _ in range(2))
    dt, a = torch.randn(b, heads, dtype=dtype, device=dev), -torch.rand(heads, device=dev)
    bc = torch.randn(b, 1, n, dtype=dtype, device=dev)
    spec = SSDScan(heads=heads, head_dim=p, state=n, groups=1, new_tokens=(1,) * b, dtype=dt_name,
                   state_dtype="fp32")  # fmt: skip
    args = (x, dt, a, bc, bc, a, a, True, None)
    update = _transformers_fn("bamba", "mamba2_selective_state_update")
    # transformers' call: dt, A, D and dt_bias one value a head, expanded over the head dim (A over the state too)
    theirs = (x, dt[..., None].expand(-1, -1, p), a[:, None, None].expand(-1, p, n), bc, bc, a[:, None].expand(-1, p))
    cases.append((f"ssd_update B={b} heads={heads} P={p} N={n}", spec,
                  lambda: update(st, *theirs, dt_bias=theirs[-1], dt_softplus=True),
                  lambda: S.ssd_update(st, *args, dispatch=False)))  # fmt: skip
    return cases


def _tree_case(recurrent: Callable, shape: tuple[int, ...], dtype: Any, dev: str,
               dt_name: str) -> tuple[str, Any, Callable, Callable]:  # fmt: skip
    """Gated DeltaNet over a tree step's 15 nodes (a binary tree of depth 3) from each sequence's state: transformers,
    which has no tree form, over each leaf's path (8 calls of 4 tokens, the paths gathered outside the timed call),
    beside ours (`gated_delta_tree`, one launch)."""
    import torch

    from codesign.kernels.layers import tree_state_ops as TS
    from codesign.kernels.parents import path_to
    from codesign.specs import GatedDeltaRule

    b, hk, hv, d = shape
    parents = [-1] + [(i - 1) // 2 for i in range(1, 15)]
    q, k = (torch.randn(b, 15, hk, d, dtype=dtype, device=dev) for _ in range(2))
    v = torch.randn(b, 15, hv, d, dtype=dtype, device=dev)
    g, beta = -torch.rand(b, 15, hv, device=dev), torch.rand(b, 15, hv, device=dev).to(dtype)
    h0 = torch.randn(b, hv, d, d, device=dev)
    paths = []
    for leaf in range(7, 15):
        at = torch.tensor(path_to(parents, leaf), device=dev)
        paths.append(tuple(x[:, at] for x in (q, k, v, g, beta)))

    def theirs():
        return [recurrent(*p[:3], g=p[3], beta=p[4], initial_state=h0, output_final_state=False,
                          use_qk_l2norm_in_kernel=True) for p in paths]  # fmt: skip

    spec = GatedDeltaRule(key_heads=hk, value_heads=hv, key_dim=d, value_dim=d, new_tokens=(15,) * b, dtype=dt_name,
                          state_dtype="fp32")  # fmt: skip
    return (f"gated_delta_tree B={b} N=15 heads={hk}/{hv} d={d}", spec, theirs,
            lambda: TS.gated_delta_tree(q, k, v, g, beta, parents, h0, dispatch=False))


def _ssd_tree_case(shape: tuple[int, ...], dtype: Any, dev: str, dt_name: str) -> tuple[str, Any, Callable, Callable]:
    """Mamba-2 (Granite 4.0-H's heads) over a tree step's 15 nodes from each sequence's state: transformers' one-token
    update down each leaf's path (8 paths of 4 tokens, the state copied at each path's start, the views made outside
    the timed call), beside ours (`ssd_tree`, one launch)."""
    import torch

    from codesign.kernels.layers import tree_state_ops as TS
    from codesign.kernels.parents import path_to
    from codesign.specs import SSDScan

    b, heads, p, n = shape
    parents = [-1] + [(i - 1) // 2 for i in range(1, 15)]
    x = torch.randn(b, 15, heads, p, dtype=dtype, device=dev)
    dt, a = torch.randn(b, 15, heads, dtype=dtype, device=dev), -torch.rand(heads, device=dev)
    bc, st = torch.randn(b, 15, 1, n, dtype=dtype, device=dev), torch.randn(b, heads, p, n, device=dev)
    update = _transformers_fn("bamba", "mamba2_selective_state_update")
    # transformers' call: dt, A, D and dt_bias one value a head, expanded over the head dim (A over the state too)
    av, dv = a[:, None, None].expand(-1, p, n), a[:, None].expand(-1, p)
    steps = []
    for leaf in range(7, 15):
        steps.append([(x[:, j], dt[:, j, :, None].expand(-1, -1, p), bc[:, j], bc[:, j])
                      for j in path_to(parents, leaf)])  # fmt: skip

    def theirs():
        for path in steps:
            state = st.clone()
            for xj, dtj, bj, cj in path:
                update(state, xj, dtj, av, bj, cj, dv, dt_bias=dv, dt_softplus=True)

    spec = SSDScan(heads=heads, head_dim=p, state=n, groups=1, new_tokens=(15,) * b, dtype=dt_name,
                   state_dtype="fp32")  # fmt: skip
    return (f"ssd_tree B={b} N=15 heads={heads} P={p} N={n}", spec, theirs,
            lambda: TS.ssd_tree(x, dt, a, bc, bc, parents, a, a, True, st, dispatch=False))


def _transformers_fn(model: str, name: str) -> Callable:
    """A function of transformers' modeling module for `model` (imported here, not in a timed call), or one that
    raises why it is missing (the row records it)."""
    import importlib

    try:
        return getattr(importlib.import_module(f"transformers.models.{model}.modeling_{model}"), name)
    except Exception as e:  # noqa: BLE001 - recorded by the row that calls it
        missing = f"transformers' {model}.{name} is not importable: {type(e).__name__}: {e}"

        def raises(*args, **kwargs):
            raise RuntimeError(missing)

        return raises


def _prompt_case(mode: Any, dtype: Any, dev: str, dt_name: str) -> tuple[str, Any, Callable, Callable]:
    """Gated DeltaNet over one 2048-token prompt (smoke: 80), Qwen3-Next's heads: transformers' chunked torch function
    beside ours (its chunked Triton form)."""
    import torch

    from codesign.kernels.layers import state_ops as S
    from codesign.specs import GatedDeltaRule

    t, hk, hv, d = (80, 2, 4, 16) if mode.smoke else (2048, 16, 32, 128)
    q, k = (torch.randn(1, t, hk, d, dtype=dtype, device=dev) for _ in range(2))
    v = torch.randn(1, t, hv, d, dtype=dtype, device=dev)
    g, beta = -torch.rand(1, t, hv, device=dev) * 0.1, torch.rand(1, t, hv, device=dev).to(dtype)
    spec = GatedDeltaRule(key_heads=hk, value_heads=hv, key_dim=d, value_dim=d, new_tokens=(t,), initial_state=False,
                          dtype=dt_name, state_dtype="fp32")  # fmt: skip

    chunked = _transformers_fn("qwen3_next", "torch_chunk_gated_delta_rule")
    theirs = lambda: chunked(q, k, v, g=g, beta=beta, output_final_state=True, use_qk_l2norm_in_kernel=True)  # noqa: E731
    return (f"gated_delta_rule (prompt) B=1 T={t} heads={hk}/{hv} d={d}", spec, theirs,
            lambda: S.gated_delta_rule(q, k, v, g, beta, dispatch=False))


def _scan_case(mode: Any, dtype: Any, dev: str, dt_name: str) -> tuple[str, Any, Callable, Callable]:
    """Mamba-2's scan over one 2048-token prompt (smoke: 80), Granite 4.0-H's shapes: transformers' chunked torch
    function (chunks of 256, the model's) beside ours (its chunked Triton form)."""
    import torch

    from codesign.kernels.layers import state_ops as S
    from codesign.specs import SSDScan

    t, h, p, n = (80, 4, 8, 16) if mode.smoke else (2048, 128, 64, 128)
    x = torch.randn(1, t, h, p, dtype=dtype, device=dev)
    dt = torch.randn(1, t, h, dtype=dtype, device=dev)
    a, bias = -torch.rand(h, device=dev), torch.randn(h, device=dev)
    bc = torch.randn(1, t, 1, n, dtype=dtype, device=dev)
    spec = SSDScan(heads=h, head_dim=p, state=n, groups=1, new_tokens=(t,), initial_state=False, dtype=dt_name,
                   state_dtype="fp32")  # fmt: skip
    chunked = _transformers_fn("bamba", "mamba2_chunk_scan")
    theirs = lambda: chunked(x, dt, a, bc, bc, 256, D=a, dt_bias=bias, dt_softplus=True, return_final_states=True)  # noqa: E731
    return (f"ssd_scan (prompt) B=1 T={t} heads={h} P={p} N={n}", spec, theirs,
            lambda: S.ssd_scan(x, dt, a, bc, bc, a, bias, True, dispatch=False))


def _mamba1_cases(mode: Any, dtype: Any, dev: str, dt_name: str) -> list[tuple[str, Any, Callable, Callable]]:
    """Jamba's Mamba-1 mixer (8192 channels, state 16; smoke: 32 and 8): its step at 16 sequences and its scan over one
    2048-token prompt (smoke: 80), with the views, the fp32 A, D and dt bias and the gate transformers' module passes;
    transformers' torch functions (the scan's a loop over the tokens on `[1, D, T, N]` fp32 tensors) beside ours."""
    import torch

    from codesign.kernels.layers import state_ops as S
    from codesign.specs import SelectiveScan

    b, d, n, t = (2, 32, 8, 80) if mode.smoke else (16, 8192, 16, 2048)
    a, dd, bias = -torch.rand(d, n, device=dev), torch.randn(d, device=dev), torch.randn(d, device=dev)
    st = torch.randn(b, d, n, device=dev)
    x, dt, z = (torch.randn(b, d, dtype=dtype, device=dev) for _ in range(3))
    bc = torch.randn(b, n, dtype=dtype, device=dev)
    step = _transformers_fn("jamba", "mamba_selective_state_update")
    cases = [(f"selective_state_update B={b} D={d} N={n}",
              SelectiveScan(channels=d, state=n, new_tokens=(1,) * b, dtype=dt_name, state_dtype="fp32"),
              lambda: step(st, x, dt, a, bc, bc, dd, dt_bias=bias, dt_softplus=True, z=z),
              lambda: S.selective_state_update(st, x, dt, a, bc, bc, dd, bias, True, z, dispatch=False))]  # fmt: skip
    proj = torch.randn(1, t, 2 * d, dtype=dtype, device=dev)  # (in_proj's output: x's half, the gate's half)
    xs, gate = proj[..., :d].transpose(1, 2).contiguous(), proj[..., d:].transpose(1, 2)
    dts = torch.randn(1, d, t, dtype=dtype, device=dev)  # (dt_proj's weight times dt's rank: contiguous)
    bcs = torch.randn(1, t, n, dtype=dtype, device=dev).transpose(1, 2)  # (B's norm's output, transposed)
    scan = _transformers_fn("jamba", "mamba_selective_scan")
    cases.append((f"selective_scan (prompt) B=1 D={d} T={t} N={n}",
                  SelectiveScan(channels=d, state=n, new_tokens=(t,), initial_state=False, dtype=dt_name,
                                state_dtype="fp32"),
                  lambda: scan(xs, dts, a, bcs, bcs, D=dd, z=gate, delta_bias=bias, delta_softplus=True,
                               return_last_state=True),
                  lambda: S.selective_scan(xs, dts, a, bcs, bcs, dd, bias, True, gate, None, torch.float32,
                                           dispatch=False)))  # fmt: skip
    return cases


def states(mode: Any) -> list[dict]:
    """The recurrent-state steps of hybrid models at decode: transformers' torch functions (op for op, as a model
    runs them without FLA / mamba_ssm) and ours, each beside its byte floor (the spec's bytes at the measured copy
    bandwidth, when the suite measured it) and the GPU model's prediction."""
    from codesign.catalog.gpus import match_gpu_name
    from codesign.dataflow.gpu_model import gpu_op_time

    gpu = None if mode.smoke else match_gpu_name(mode.gpu_name())
    rows = []
    for label, spec, theirs, ours in _state_cases(mode):
        pred = gpu_op_time(spec, gpu) * 1e3 if gpu is not None else None
        for impl, call in (("transformers torch", theirs), ("codesign", ours)):
            row = {"op": label, "impl": impl, "bytes": spec.min_bytes(), "predicted_ms": pred}
            rows.append(_timed(row, call, mode))
        mode.empty_cache()
    return rows


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
        "states": states(mode),
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
