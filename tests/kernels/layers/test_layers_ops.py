"""The layer ops (`codesign.kernels.layers`): the Triton kernels (the interpreter here, compiled on a GPU) against
fp64 references written independently of them, into NaN-poisoned outputs, at odd shapes; the torch paths equal to
Hugging Face's own modules bit for bit; the fake implementations; bad input."""

from __future__ import annotations

import pytest
import torch
from helpers import assert_rel_close, rel_fro_error

from codesign.backend import use_backend
from codesign.kernels.layers import ops
from codesign.kernels.layers.triton_act_mul import act_mul_triton
from codesign.kernels.layers.triton_rms_norm import rms_norm_triton
from codesign.kernels.layers.triton_rope import rope_triton
from codesign.specs import CodesignError

# relative Frobenius bound a dtype's one rounding allows (fp64 reference, the kernel rounds once or twice)
BOUND = {torch.float32: 1e-6, torch.float16: 1e-3, torch.bfloat16: 8e-3}
DEV = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
DTYPES = [torch.float32, torch.float16, pytest.param(torch.bfloat16, marks=pytest.mark.gpu)]  # (interpreter: no bf16)


def _norm_ref(x, w, eps, offset, cast_first):
    x64 = x.double()
    y = x64 / (x64.pow(2).mean(-1, keepdim=True) + eps).sqrt()
    return w.double() * y if cast_first else y * (offset + w.double())


def _rope_ref(x, cos, sin):
    """Rotation of each (i, i + D/2) pair by the angle whose cos and sin are given: complex multiplication."""
    h = x.shape[-1] // 2
    z = torch.complex(x[..., :h].double(), x[..., h:].double())
    c, s = cos.double().unsqueeze(1), sin.double().unsqueeze(1)
    # cos/sin rows hold each angle twice (HF: cat(freqs, freqs)); the first half's rotates the pair
    r = z * torch.complex(c[..., :h], s[..., :h])
    return torch.cat([r.real, r.imag], -1)


def _rope_inputs(b, hq, hk, s, d, dtype, device, shared_positions=False):
    q = torch.randn(b, s, hq, d, device=device).to(dtype).transpose(1, 2)  # HF's layout: a transposed view
    k = torch.randn(b, s, hk, d, device=device).to(dtype).transpose(1, 2)
    ang = torch.rand(1 if shared_positions else b, s, d // 2, device=device) * 6.3
    ang = torch.cat([ang, ang], -1)
    return q, k, ang.cos().to(dtype), ang.sin().to(dtype)


@pytest.mark.parametrize("device", DEV)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(7, 1000), (2, 3, 4096), (1, 37), (0, 64)])
@pytest.mark.parametrize("mode", [(0.0, True), (1.0, False)])
def test_rms_norm_vs_fp64(device, dtype, shape, mode):
    x = torch.randn(shape, device=device).to(dtype) * 3
    w = torch.randn(shape[-1], device=device).to(dtype)
    with use_backend("triton"):
        out = ops.rms_norm(x, w, 1e-5, *mode)
    assert out.dtype == dtype and out.shape == x.shape
    assert_rel_close(out, _norm_ref(x, w, 1e-5, *mode), BOUND[dtype])


@pytest.mark.parametrize("cast_first", [True, False])
def test_rms_norm_two_passes_into_poison(cast_first):
    """Rows wider than one block (two passes over the row) and narrower; every output written (NaN-poisoned)."""
    for n in (1000, 64, 5):
        x, w = torch.randn(3, n) * 2, torch.randn(n)
        out = torch.full((3, n), float("nan"))
        rms_norm_triton(x, w, out, 1e-6, 0.0 if cast_first else 1.0, cast_first, max_block=64)
        assert_rel_close(out, _norm_ref(x, w, 1e-6, 0.0 if cast_first else 1.0, cast_first), BOUND[torch.float32])


@pytest.mark.parametrize("device", DEV)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(7, 1000), (2, 3, 4096), (1, 37), (0, 64)])
@pytest.mark.parametrize("mode", [(0.0, True), (1.0, False)])
def test_add_rms_norm_vs_fp64(device, dtype, shape, mode):
    """The sum is torch's add bit for bit (one rounding to the dtype); the norm of that sum against fp64."""
    x, r = (torch.randn(shape, device=device).to(dtype) * 3 for _ in range(2))
    w = torch.randn(shape[-1], device=device).to(dtype)
    with use_backend("triton"):
        out, summed = ops.add_rms_norm(x, r, w, 1e-5, *mode)
    assert torch.equal(summed, r + x) and out.dtype == dtype and out.shape == x.shape
    assert_rel_close(out, _norm_ref(r + x, w, 1e-5, *mode), BOUND[dtype])


@pytest.mark.parametrize("cast_first", [True, False])
def test_add_rms_norm_two_passes_into_poison(cast_first):
    """Rows wider than one block: the second pass reads the sums the first stored; both outputs fully written
    (NaN-poisoned), from strided rows. Teeth: the norm of x alone (no residual) is not it."""
    offset = 0.0 if cast_first else 1.0
    for n in (1000, 64, 5):
        x, r = torch.randn(3, 2 * n)[:, ::2] * 2, torch.randn(3, n)
        w = torch.randn(n)
        out, summed = torch.full((3, n), float("nan")), torch.full((3, n), float("nan"))
        rms_norm_triton(x.contiguous(), w, out, 1e-6, offset, cast_first, max_block=64, residual=r, summed=summed)
        assert torch.equal(summed, r + x)
        assert_rel_close(out, _norm_ref(r + x, w, 1e-6, offset, cast_first), BOUND[torch.float32])
        assert rel_fro_error(out, _norm_ref(x, w, 1e-6, offset, cast_first)) > 0.1
    with use_backend("triton"):
        got = ops.add_rms_norm(x, r, w, 1e-6, offset, cast_first)  # (a strided x through the op)
    assert torch.equal(got[1], r + x)


def test_rms_norm_weight_dtype_promotes():
    """fp16 x with an fp32 weight: fp32 out, as Hugging Face's `weight * y.to(x.dtype)`."""
    x, w = torch.randn(4, 96).half(), torch.randn(96)
    with use_backend("triton"):
        out = ops.rms_norm(x, w, 1e-6)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, ops.rms_norm(x, w, 1e-6), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("device", DEV)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("b,hq,hk,s,d", [(2, 4, 2, 7, 16), (1, 5, 1, 1, 80), (3, 8, 8, 2, 128)])
def test_rope_vs_fp64(device, dtype, b, hq, hk, s, d):
    """Odd head counts (tiles padded to a power of two), head dims whose half is not a power of two, transposed
    inputs; the outputs keep the inputs' strides; positions shared by the batch (cos batch 1) and per row."""
    for shared in (False, True):
        q, k, cos, sin = _rope_inputs(b, hq, hk, s, d, dtype, device, shared)
        with use_backend("triton"):
            qo, ko = ops.rope(q, k, cos, sin)
        assert qo.stride() == q.stride() and ko.stride() == k.stride()
        assert_rel_close(qo, _rope_ref(q, cos, sin), BOUND[dtype], "q")
        assert_rel_close(ko, _rope_ref(k, cos, sin), BOUND[dtype], "k")


def test_rope_with_no_k_heads():
    """k (or q) with no heads: the Triton path rotates the other and leaves the empty one, as the torch path (its tile
    was sized 0: Triton refused the launch)."""
    q, k, cos, sin = _rope_inputs(2, 3, 1, 4, 16, torch.float32, "cpu")
    for qq, kk in ((q, k[:, :0]), (q[:, :0], k)):
        with use_backend("triton"):
            qo, ko = ops.rope(qq, kk, cos, sin)
        assert qo.shape == qq.shape and ko.shape == kk.shape
        for name, got, x in (("q", qo, qq), ("k", ko, kk)):
            if x.shape[1]:
                assert_rel_close(got, _rope_ref(x, cos, sin), 1e-6, name)


def test_rope_into_poison():
    q, k, cos, sin = _rope_inputs(2, 3, 1, 5, 24, torch.float32, "cpu")
    qo, ko = torch.full(q.shape, float("nan")), torch.full(k.shape, float("nan"))
    rope_triton(q, k, cos, sin, qo, ko)
    assert_rel_close(qo, _rope_ref(q, cos, sin), 1e-6, "q")
    assert_rel_close(ko, _rope_ref(k, cos, sin), 1e-6, "k")


def _act_ref(g, act):
    """fp64 SiLU, or GELU's tanh approximation (with tanh itself, not the kernel's exp form)."""
    g = g.double()
    if act == "silu":
        return g * torch.sigmoid(g)
    return 0.5 * g * (1 + torch.tanh((2 / torch.pi) ** 0.5 * (g + 0.044715 * g**3)))


@pytest.mark.parametrize("device", DEV)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1,), (1023,), (3, 2000), (2, 1, 1025), (0, 8)])
@pytest.mark.parametrize("act", ["silu", "gelu_tanh"])
def test_act_mul_vs_fp64(device, dtype, shape, act):
    """Gates up to +-16 (GELU's tanh saturates both ways). GELU in fp32 within 1e-5: where its result is tiny (a gate
    near -5) the exponent's argument y ~ -9 carries its own rounding, which exp(-2y) multiplies by 2|y|."""
    g = (torch.randn(shape, device=device) * 4).to(dtype)
    u = torch.randn(shape, device=device).to(dtype)
    with use_backend("triton"):
        out = ops.act_mul(g, u, act)
    assert out.dtype == dtype and out.shape == g.shape
    assert_rel_close(out, _act_ref(g, act) * u.double(), max(BOUND[dtype], 1e-5 if act == "gelu_tanh" else 0))


@pytest.mark.parametrize("act", ["silu", "gelu_tanh"])
def test_act_mul_of_a_gemms_halves_into_poison(act):
    """gate and up as the two halves of one `[rows, 2n]` output (views with a row stride, as Phi-3's chunk gives):
    no copy needed, every output written (NaN-poisoned)."""
    gu = torch.randn(3, 5, 2 * 700) * 3
    gate, up = gu.chunk(2, dim=-1)
    out = torch.full((15, 700), float("nan"))
    act_mul_triton(gate.reshape(-1, 700), up.reshape(-1, 700), out, act)
    assert_rel_close(out.view(3, 5, 700), _act_ref(gate, act) * up.double(), 1e-6)
    with use_backend("triton"):
        assert_rel_close(ops.act_mul(gate, up, act), _act_ref(gate, act) * up.double(), 1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_torch_paths_are_hugging_face_bit_for_bit(dtype):
    """The torch backend computes what Hugging Face's modules compute, op for op: a patched model on a CPU runs the
    unpatched model's numbers (`integrations.hf.fuse`)."""
    from transformers.models.gemma2.modeling_gemma2 import Gemma2RMSNorm
    from transformers.models.llama.modeling_llama import LlamaRMSNorm, apply_rotary_pos_emb

    x = torch.randn(3, 5, 64).to(dtype)
    llama, gemma = LlamaRMSNorm(64, eps=1e-5).to(dtype), Gemma2RMSNorm(64, eps=1e-6).to(dtype)
    with torch.no_grad():
        llama.weight.normal_()
        gemma.weight.normal_()
        assert torch.equal(ops.rms_norm(x, llama.weight, 1e-5), llama(x))
        assert torch.equal(ops.rms_norm(x, gemma.weight, 1e-6, 1.0, False), gemma(x))
        r = torch.randn(3, 5, 64).to(dtype)
        out, summed = ops.add_rms_norm(x, r, llama.weight, 1e-5)
        assert torch.equal(summed, r + x) and torch.equal(out, llama(r + x))  # (a decoder layer's add, then norm)
    q, k, cos, sin = _rope_inputs(2, 4, 2, 5, 16, dtype, "cpu")
    assert all(torch.equal(a, b) for a, b in zip(ops.rope(q, k, cos, sin), apply_rotary_pos_emb(q, k, cos, sin)))
    from transformers.activations import ACT2FN

    g, u = torch.randn(4, 40).to(dtype), torch.randn(4, 40).to(dtype)
    assert torch.equal(ops.silu_mul(g, u), ACT2FN["silu"](g) * u)
    assert torch.equal(ops.act_mul(g, u, "gelu_tanh"), ACT2FN["gelu_pytorch_tanh"](g) * u)


def test_fake_implementations():
    """Shapes, dtypes and strides under FakeTensorMode (what torch.compile traces)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        x, w = torch.empty(3, 8, dtype=torch.float16), torch.empty(8)
        assert ops.rms_norm(x, w, 1e-6).dtype == torch.float32
        assert ops.rms_norm(x, w.half(), 1e-6, 1.0, False).dtype == torch.float16
        q = torch.empty(2, 5, 4, 16).transpose(1, 2)
        k = torch.empty(2, 5, 1, 16).transpose(1, 2)
        qo, ko = ops.rope(q, k, torch.empty(2, 5, 16), torch.empty(2, 5, 16))
        assert qo.shape == q.shape and qo.stride() == q.stride() and ko.shape == k.shape
        assert ops.silu_mul(torch.empty(3, 7), torch.empty(3, 7)).shape == (3, 7)
        out, summed = ops.add_rms_norm(x, torch.empty_like(x), w, 1e-6)
        assert out.dtype == torch.float32 and summed.dtype == torch.float16 and summed.shape == x.shape
        assert ops.act_mul(torch.empty(3, 7).half(), torch.empty(3, 7).half(), "gelu_tanh").dtype == torch.float16


def test_bad_input():
    x, w = torch.randn(2, 8), torch.randn(8)
    cases = [
        (lambda: ops.rms_norm(x, torch.randn(7), 1e-6), "weight's size"),
        (lambda: ops.rms_norm(x.int(), w, 1e-6), "x must be fp16, bf16 or fp32"),
        (lambda: ops.rms_norm(x, w, float("nan")), "eps must be a finite number"),
        (lambda: ops.rms_norm(x, w, -1.0), "eps must be >= 0"),
        (lambda: ops.rms_norm(x, w, 1e-6, 1.0, True), "offset must be 0 with cast_first"),
        (lambda: ops.rms_norm(x, torch.randn(2, 8), 1e-6), "weight must have 1 dims"),
        (lambda: ops.add_rms_norm(x, x[:1], w, 1e-6), "residual must match x"),
        (lambda: ops.add_rms_norm(x, x.half(), w, 1e-6), "residual must match x"),
        (lambda: ops.add_rms_norm(x, "r", w, 1e-6), "residual must be a torch.Tensor"),
    ]
    q, k, cos, sin = _rope_inputs(2, 4, 2, 3, 16, torch.float32, "cpu")
    cases += [
        (lambda: ops.rope(q[..., :15], k[..., :15], cos[..., :15], sin[..., :15]), "head dim must be even"),
        (lambda: ops.rope(q, k[:1], cos, sin), "k must be"),
        (lambda: ops.rope(q, k, cos[:, :2], sin), "cos must be"),
        (lambda: ops.rope(q, k, cos, sin.half()), "one dtype"),
        (lambda: ops.rope(q[0], k, cos, sin), "q must have 4 dims"),
        (lambda: ops.silu_mul(x, x[:1]), "gate and up must match"),
        (lambda: ops.silu_mul(x, x.half()), "gate and up must match"),
        (lambda: ops.silu_mul([1.0], x), "gate must be a torch.Tensor"),
        (lambda: ops.act_mul(x, x, "relu"), "act must be one of"),
        (lambda: ops.act_mul(x[0, 0], x[0, 0], "gelu_tanh"), "at least one dim"),
    ]
    for backend in ("torch", "triton"):
        with use_backend(backend):
            for call, match in cases:
                with pytest.raises(CodesignError, match=match):
                    call()
