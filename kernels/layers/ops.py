"""The layer ops as torch ops ("codesign::<name>", each with a fake implementation, so `torch.compile` traces through
them). Per call the backend comes from `codesign.backend.resolve_backend`: "triton" runs the kernels of this family
(CUDA tensors, or CPU tensors through the interpreter), "torch" Hugging Face's own arithmetic op by op (so on a CPU
a patched model computes exactly what the unpatched one does).

    rms_norm(x, weight, eps, offset=0.0, cast_first=True)
        x `[..., n]` fp16 / bf16 / fp32, weight `[n]`. y = x * rsqrt(mean(x^2, -1) + eps) in fp32; cast_first (Llama,
        Mistral, Qwen; offset 0): weight * y.to(x.dtype), in the promoted dtype of the two; else (Gemma): (y *
        (offset + weight)).to(x.dtype).
    add_rms_norm(x, residual, weight, eps, offset=0.0, cast_first=True) -> (out, summed)
        summed = residual + x (x's dtype, as torch's add rounds it), out = rms_norm(summed, ...): a decoder layer's
        residual add and the norm after it in one launch; residual as x.
    rope(q, k, cos, sin) -> (q_out, k_out)
        q `[B, Hq, S, D]`, k `[B, Hk, S, D]` (any strides but the last), cos and sin `[B or 1, S, D]` (D even), all of
        one dtype: x * cos + rotate_half(x) * sin per head; the outputs keep the inputs' strides.
    silu_mul(gate, up), gelu_tanh_mul(gate, up)   (act_mul(gate, up, act))
        act(gate) * up, one shape and dtype; gate and up may be views whose last dim is contiguous (the two halves of
        one gate-and-up GEMM's output).

Bad input raises CodesignError naming the argument before any launch; no check reads the device. `dispatch=False`:
the op's body without torch's dispatcher (~15 us of host time a call less; a model's fused modules call it so), the
op itself while `torch.compile` traces.
"""

from __future__ import annotations

import math

import torch

from codesign.backend import resolve_backend
from codesign.specs import CodesignError

DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _tensor(name: str, t, dims: int | None = None) -> None:
    if not isinstance(t, torch.Tensor):
        raise CodesignError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in DTYPES:
        raise CodesignError(f"{name} must be fp16, bf16 or fp32, got {t.dtype}")
    if dims is not None and t.dim() != dims:
        raise CodesignError(f"{name} must have {dims} dims, got shape {tuple(t.shape)}")


def _same_device(**ts: torch.Tensor) -> None:
    devs = {t.device for t in ts.values()}
    if len(devs) > 1:
        raise CodesignError(f"{', '.join(ts)} must be on one device, got {sorted(map(str, devs))}")


# --- RMSNorm ----------------------------------------------------------------------------------------------------
def _check_norm_args(x, weight, eps, offset, cast_first) -> None:
    """What the op's schema cannot say (the Python wrapper checks it before the dispatcher refuses in its way)."""
    _tensor("x", x)
    _tensor("weight", weight, 1)
    for name, v in (("eps", eps), ("offset", offset)):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise CodesignError(f"{name} must be a finite number, got {v!r}")
    if eps < 0:
        raise CodesignError(f"eps must be >= 0, got {eps}")
    if cast_first and offset != 0:
        raise CodesignError(f"offset must be 0 with cast_first (the weight multiplies y rounded), got {offset}")


def _check_norm(x, weight, eps, offset, cast_first) -> torch.dtype:
    """The output dtype, after the checks."""
    _check_norm_args(x, weight, eps, offset, cast_first)
    if x.dim() == 0 or x.shape[-1] != weight.shape[0]:
        raise CodesignError(f"x must be [..., {weight.shape[0]}] (weight's size), got {tuple(x.shape)}")
    _same_device(x=x, weight=weight)
    return torch.promote_types(x.dtype, weight.dtype) if cast_first else x.dtype


def _norm_torch(x, weight, eps, offset, cast_first) -> torch.Tensor:
    y = x.to(torch.float32)
    y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + eps)
    if cast_first:
        return weight * y.to(x.dtype)
    return (y * (offset + weight.float())).to(x.dtype)


def _rms_norm_body(x, weight, eps, offset, cast_first) -> torch.Tensor:
    """The op's body: the backend's RMSNorm."""
    dt = _check_norm(x, weight, eps, offset, cast_first)
    if resolve_backend("rms_norm", x.device) == "torch" or x.numel() == 0:
        return _norm_torch(x, weight, eps, offset, cast_first)
    from codesign.kernels.layers.triton_rms_norm import rms_norm_triton

    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.empty(x2.shape, dtype=dt, device=x.device)
    rms_norm_triton(x2, weight.contiguous(), out, eps, offset, cast_first)
    return out.view(x.shape)


@torch.library.custom_op("codesign::rms_norm", mutates_args=())
def rms_norm_op(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float, cast_first: bool) -> torch.Tensor:
    return _rms_norm_body(x, weight, eps, offset, cast_first)


@rms_norm_op.register_fake
def _(x, weight, eps, offset, cast_first):
    return x.new_empty(x.shape, dtype=_check_norm(x, weight, eps, offset, cast_first))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float = 0.0, cast_first: bool = True,
             dispatch: bool = True) -> torch.Tensor:  # fmt: skip
    """RMSNorm over x's last dim (module docstring)."""
    _check_norm_args(x, weight, eps, offset, cast_first)  # (the rest inside the op: promote_types is an op)
    if dispatch or torch.compiler.is_compiling():
        return torch.ops.codesign.rms_norm(x, weight, float(eps), float(offset), bool(cast_first))
    return _rms_norm_body(x, weight, float(eps), float(offset), bool(cast_first))


# --- residual add and RMSNorm ----------------------------------------------------------------------------------
def _check_add_norm(x, residual, weight, eps, offset, cast_first) -> torch.dtype:
    dt = _check_norm(x, weight, eps, offset, cast_first)
    _tensor("residual", residual)
    if residual.shape != x.shape or residual.dtype != x.dtype:
        raise CodesignError(f"residual must match x ({tuple(x.shape)} {x.dtype}), got {tuple(residual.shape)} "
                            f"{residual.dtype}")  # fmt: skip
    _same_device(x=x, residual=residual)
    return dt


def _add_rms_norm_body(x, residual, weight, eps, offset, cast_first) -> tuple[torch.Tensor, torch.Tensor]:
    """The op's body: (RMSNorm of residual + x, residual + x) by the backend."""
    dt = _check_add_norm(x, residual, weight, eps, offset, cast_first)
    if resolve_backend("add_rms_norm", x.device) == "torch" or x.numel() == 0:
        summed = residual + x
        return _norm_torch(summed, weight, eps, offset, cast_first), summed
    from codesign.kernels.layers.triton_rms_norm import rms_norm_triton

    n = x.shape[-1]
    x2, r2 = (t.reshape(-1, n) for t in (x, residual))
    x2, r2 = (t if t.stride(-1) == 1 else t.contiguous() for t in (x2, r2))
    out = torch.empty(x2.shape, dtype=dt, device=x.device)
    summed = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    rms_norm_triton(x2, weight.contiguous(), out, eps, offset, cast_first, residual=r2, summed=summed)
    return out.view(x.shape), summed.view(x.shape)


@torch.library.custom_op("codesign::add_rms_norm", mutates_args=())
def add_rms_norm_op(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, offset: float,
                    cast_first: bool) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    return _add_rms_norm_body(x, residual, weight, eps, offset, cast_first)


@add_rms_norm_op.register_fake
def _(x, residual, weight, eps, offset, cast_first):
    dt = _check_add_norm(x, residual, weight, eps, offset, cast_first)
    return x.new_empty(x.shape, dtype=dt), torch.empty_like(x)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, offset: float = 0.0,
                 cast_first: bool = True, dispatch: bool = True) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """(RMSNorm of residual + x, residual + x) in one launch (module docstring)."""
    _check_norm_args(x, weight, eps, offset, cast_first)
    _tensor("residual", residual)
    if dispatch or torch.compiler.is_compiling():
        return torch.ops.codesign.add_rms_norm(x, residual, weight, float(eps), float(offset), bool(cast_first))
    return _add_rms_norm_body(x, residual, weight, float(eps), float(offset), bool(cast_first))


# --- rotary position embedding ---------------------------------------------------------------------------------
def _check_rope(q, k, cos, sin) -> None:
    for name, t in (("q", q), ("k", k)):
        _tensor(name, t, 4)
    for name, t in (("cos", cos), ("sin", sin)):
        _tensor(name, t, 3)
    b, _, s, d = q.shape
    if k.shape[0] != b or k.shape[2:] != q.shape[2:]:
        raise CodesignError(f"k must be [{b}, heads, {s}, {d}] as q, got {tuple(k.shape)}")
    if d % 2:
        raise CodesignError(f"the head dim must be even, got {d}")
    for name, t in (("cos", cos), ("sin", sin)):
        if t.shape[0] not in (1, b) or t.shape[1:] != (s, d):
            raise CodesignError(f"{name} must be [{b} or 1, {s}, {d}], got {tuple(t.shape)}")
    if len({q.dtype, k.dtype, cos.dtype, sin.dtype}) > 1:
        got = ", ".join(str(t.dtype) for t in (q, k, cos, sin))
        raise CodesignError(f"q, k, cos and sin must have one dtype, got {got}")
    _same_device(q=q, k=k, cos=cos, sin=sin)


def _rope_torch(q, k, cos, sin) -> tuple[torch.Tensor, torch.Tensor]:
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)

    def rotate_half(x):
        return torch.cat((-x[..., x.shape[-1] // 2 :], x[..., : x.shape[-1] // 2]), dim=-1)

    return (q * cos) + (rotate_half(q) * sin), (k * cos) + (rotate_half(k) * sin)


def _rope_body(q, k, cos, sin) -> tuple[torch.Tensor, torch.Tensor]:
    """The op's body: the backend's rotary embedding."""
    _check_rope(q, k, cos, sin)
    if resolve_backend("rope", q.device) == "torch" or q.numel() == 0:
        return _rope_torch(q, k, cos, sin)
    from codesign.kernels.layers.triton_rope import rope_triton

    b, _, s, d = q.shape
    q, k = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k))
    cos, sin = (x.expand(b, s, d) for x in (cos, sin))
    if cos.stride() != sin.stride() or cos.stride(-1) != 1:
        cos, sin = cos.contiguous(), sin.contiguous()
    q_out, k_out = torch.empty_like(q), torch.empty_like(k)  # (the inputs' strides, as torch's elementwise ops)
    rope_triton(q, k, cos, sin, q_out, k_out)
    return q_out, k_out


@torch.library.custom_op("codesign::rope", mutates_args=())
def rope_op(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    return _rope_body(q, k, cos, sin)


@rope_op.register_fake
def _(q, k, cos, sin):
    _check_rope(q, k, cos, sin)
    return torch.empty_like(q), torch.empty_like(k)


def rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
         dispatch: bool = True) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """Rotary position embedding of q and k (module docstring)."""
    for name, t in (("q", q), ("k", k), ("cos", cos), ("sin", sin)):
        _tensor(name, t)  # (before the dispatcher, which refuses a non-tensor its own way; the rest in the op)
    if dispatch or torch.compiler.is_compiling():
        return torch.ops.codesign.rope(q, k, cos, sin)
    return _rope_body(q, k, cos, sin)


# --- gated products --------------------------------------------------------------------------------------------
def _check_act_mul(gate, up) -> None:
    _tensor("gate", gate)
    _tensor("up", up)
    if gate.shape != up.shape or gate.dtype != up.dtype:
        raise CodesignError(f"gate and up must match in shape and dtype, got {tuple(gate.shape)} {gate.dtype} and "
                            f"{tuple(up.shape)} {up.dtype}")  # fmt: skip
    if gate.dim() == 0:
        raise CodesignError("gate and up must have at least one dim")
    _same_device(gate=gate, up=up)


_ACT_TORCH = {"silu": torch.nn.functional.silu,
              "gelu_tanh": lambda x: torch.nn.functional.gelu(x, approximate="tanh")}  # fmt: skip
ACTS = tuple(_ACT_TORCH)


def _act_mul_body(gate, up, act: str) -> torch.Tensor:
    """The ops' body: the backend's act(gate) * up (`silu_mul`, `gelu_tanh_mul`)."""
    _check_act_mul(gate, up)
    op = f"{act}_mul"
    if resolve_backend(op, gate.device) == "torch":
        return _ACT_TORCH[act](gate) * up
    from codesign.kernels.layers.triton_act_mul import act_mul_triton

    n = gate.shape[-1]
    g2, u2 = (x.reshape(-1, n) for x in (gate, up))  # (a view where the rows have one stride: a GEMM's halves)
    g2, u2 = (x if x.stride(-1) == 1 else x.contiguous() for x in (g2, u2))
    out = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    act_mul_triton(g2, u2, out.view(-1, n), act)
    return out


@torch.library.custom_op("codesign::silu_mul", mutates_args=())
def silu_mul_op(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return _act_mul_body(gate, up, "silu")


@torch.library.custom_op("codesign::gelu_tanh_mul", mutates_args=())
def gelu_tanh_mul_op(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return _act_mul_body(gate, up, "gelu_tanh")


def _act_mul_fake(gate, up):
    _check_act_mul(gate, up)
    return torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)


silu_mul_op.register_fake(_act_mul_fake)
gelu_tanh_mul_op.register_fake(_act_mul_fake)


def act_mul(gate: torch.Tensor, up: torch.Tensor, act: str = "silu", dispatch: bool = True) -> torch.Tensor:
    """act(gate) * up, act "silu" (`codesign::silu_mul`) or "gelu_tanh" (`codesign::gelu_tanh_mul`: GELU's tanh
    approximation, Gemma's); gate and up may be views whose last dim is contiguous (module docstring)."""
    if act not in _ACT_TORCH:
        raise CodesignError(f"act must be one of {tuple(_ACT_TORCH)}, got {act!r}")
    _tensor("gate", gate)
    _tensor("up", up)
    if dispatch or torch.compiler.is_compiling():
        return getattr(torch.ops.codesign, f"{act}_mul")(gate, up)
    return _act_mul_body(gate, up, act)


def silu_mul(gate: torch.Tensor, up: torch.Tensor, dispatch: bool = True) -> torch.Tensor:
    """silu(gate) * up (module docstring)."""
    return act_mul(gate, up, "silu", dispatch)
