"""Which torch CPU ops give other bits under AVX2 than under AVX-512: the premise of the `numerics` mark.

Run as a script (`python tests/cpu_width_probe.py`), it prints one JSON object: op name -> a hash of its result
on fixed data, under whatever ATEN_CPU_CAPABILITY the process was started with. `tests/test_cpu_vector_width.py`
runs it under both capabilities and compares.

WIDTH_FREE are the ops the suite's quantizers, writers, references and CPU paths use outside the `numerics` tests:
torch 2.13 gives them the same bits at both vector widths (its reductions keep a fixed order whatever the width;
elementwise ops and casts round exactly). WIDTH_BOUND are the ops found to differ (softmax's row reductions, CPU
sdpa): a test in which they decide a discrete outcome (a code, a token, a threshold) or meet a bound a few ulps
wide is marked `numerics` and rerun under AVX2 by `make test`, as are tests that compile with Inductor (its C++
is generated for the capability).
"""

from __future__ import annotations

import hashlib
import json

import torch
import torch.nn.functional as F


def _data() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(64, 1000, generator=g)
    return {
        "x": x,
        "y": torch.randn(64, 1000, generator=g),
        "w": torch.randn(300, 1000, generator=g),
        "t3": torch.randn(40, 4, 96, generator=g),  # [tokens, heads, head_dim], as a KV chunk
        "q": torch.randn(2, 8, 128, 64, generator=g),
        "big": torch.randn(512, 4096, generator=g),
    }


def _ops(d: dict[str, torch.Tensor]) -> dict[str, object]:
    x, y, w, t3, q, big = d["x"], d["y"], d["w"], d["t3"], d["q"], d["big"]
    scale = x.abs().amax(1, keepdim=True) / 127
    return {
        "randn": lambda: torch.randn(64, 1000, generator=torch.Generator().manual_seed(3)),
        "sum": lambda: x.sum(1),
        "sum_outer": lambda: t3.sum(0),
        "mean_outer": lambda: t3.mean(0),
        "sum_all": lambda: x.sum().reshape(1),
        "sum_bf16": lambda: x.bfloat16().sum(1),
        "sum_fp16": lambda: x.half().sum(1),
        "sum_sq": lambda: (x * x).sum(1),
        "mean_sq": lambda: x.pow(2).mean(-1),
        "var": lambda: x.var(1),
        "norm": lambda: torch.linalg.vector_norm(x, dim=1),
        "cosine": lambda: F.cosine_similarity(x, y),
        "amax": lambda: x.abs().amax(1),
        "cumsum": lambda: x.cumsum(1),
        "logsumexp": lambda: x.logsumexp(1),
        "linear": lambda: F.linear(x, w),
        "linear_bf16": lambda: F.linear(x.bfloat16(), w.bfloat16()),
        "linear_fp16": lambda: F.linear(x.half(), w.half()),
        "matmul_big": lambda: big @ big[:512].T,
        "bmm": lambda: torch.bmm(x.view(4, 16, 1000), w.T.reshape(4, 1000, 75)),
        "einsum": lambda: torch.einsum("nhd,chd->cnh", t3, t3[:5]),
        "mv": lambda: w @ x[0],
        "quantize": lambda: torch.clamp(torch.round(x / scale), -127, 127),
        "fp8": lambda: x.to(torch.float8_e4m3fn).view(torch.uint8),
        "exp": lambda: x.exp(),
        "log": lambda: x.abs().log(),
        "tanh": lambda: x.tanh(),
        "sigmoid_bf16": lambda: x.bfloat16().sigmoid(),
        "silu": lambda: F.silu(x),
        "gelu": lambda: F.gelu(x),
        "erf": lambda: x.erf(),
        "rms_norm": lambda: F.rms_norm(x, (1000,)),
        "layer_norm": lambda: F.layer_norm(x, (1000,)),
        "sort": lambda: x.sort(1).values,
        "topk": lambda: x.topk(50, 1).indices,
        "quantile": lambda: torch.quantile(x[:, :500], 0.9, dim=1),
        "index_add": lambda: torch.zeros(10, 1000).index_add_(0, torch.arange(64) % 10, x),
        # WIDTH_BOUND
        "softmax": lambda: x.softmax(1),
        "log_softmax": lambda: x.log_softmax(1),
        "softmax_bf16": lambda: x.bfloat16().softmax(1),
        "sdpa": lambda: F.scaled_dot_product_attention(q, q.flip(2), q, is_causal=True),
    }


WIDTH_BOUND = ("softmax", "log_softmax", "softmax_bf16", "sdpa")


def width_free() -> tuple[str, ...]:
    return tuple(name for name in _ops(_data()) if name not in WIDTH_BOUND)


def _digest(t: torch.Tensor) -> str:
    flat = t.contiguous().reshape(-1)
    raw = flat.view(torch.uint8) if flat.element_size() > 1 else flat
    return hashlib.sha1(raw.numpy().tobytes()).hexdigest()[:12]


def probe() -> dict[str, str]:
    """op name -> hash of its result under this process's CPU capability."""
    return {name: _digest(op()) for name, op in _ops(_data()).items()}


if __name__ == "__main__":
    print(json.dumps({"capability": torch.backends.cpu.get_cpu_capability(), "ops": probe()}))
