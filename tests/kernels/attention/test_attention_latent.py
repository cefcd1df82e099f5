"""Multi-head latent attention decode: the Triton kernel (interpreter on CPU) and the torch path against an fp64
reference, over latent caches whose unused slots and spare table entries are NaN; the call's spec against the
dataflow graph's node; bad input."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import assert_rel_close, assert_runs_without_interpreter
from paged_attention_ref import make_paged_kv

from codesign.backend import use_backend
from codesign.catalog.models import load_model
from codesign.dataflow.graph import build_step_graph
from codesign.kernels.attention.latent import (
    latent_attention_torch,
    latent_decode_attention,
    latent_decode_spec,
)
from codesign.specs import CodesignError

TOL = {torch.float32: 2e-5, torch.float16: 4e-3}


def _cache(ctx: list[int], width: int, bs: int, dtype: torch.dtype):
    k, _, bt, cl = make_paged_kv(ctx, 1, width, bs, dtype, share_blocks=1)
    return k[:, :, 0, :], bt, cl  # one vector a token: [num_blocks, block_size, latent + rope]


def _reference(q, cache, bt, cl, v_dim, scale):
    """float64, written out per sequence and head (independent of the torch path's gather)."""
    b, h, _ = q.shape
    out = torch.zeros(b, h, v_dim, dtype=torch.float64)
    bs = cache.shape[1]
    for i in range(b):
        n = int(cl[i])
        rows = torch.stack([cache[int(bt[i, t // bs]), t % bs] for t in range(n)]).double() if n else None
        for j in range(h):
            if n:
                p = torch.softmax(rows @ q[i, j].double() * scale, dim=0)
                out[i, j] = p @ rows[:, :v_dim]
    return out


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize(
    "ctx, heads, latent, rope, bs, dtype, splits",
    [
        ([1, 37, 70], 16, 32, 16, 16, torch.float32, 1),  # one head block, a context of 1
        ([5, 90], 20, 64, 16, 8, torch.float16, 3),  # 20 heads: a second, partial head block; splits
        ([3, 33, 2], 8, 32, 32, 7, torch.float32, 5),  # splits past a short sequence's end; odd block size
        ([40, 17], 16, 512, 64, 16, torch.float16, 2),  # DeepSeek's widths (TP 8: 16 heads a rank)
        ([9, 50], 40, 32, 16, 8, torch.float32, 2),  # from 32 heads, 32 a program: a second, partial block
    ],
)
def test_latent_decode_matches_fp64(backend, ctx, heads, latent, rope, bs, dtype, splits):
    cache, bt, cl = _cache(ctx, latent + rope, bs, dtype)
    q = torch.randn(len(ctx), heads, latent + rope).to(dtype)
    scale = 1 / math.sqrt(192)
    with use_backend(backend):
        out = latent_decode_attention(q, cache, bt, cl, v_dim=latent, sm_scale=scale, num_splits=splits)
    assert out.shape == (len(ctx), heads, latent) and out.dtype == dtype
    assert_rel_close(out, _reference(q, cache, bt, cl, latent, scale), TOL[dtype])


def test_a_sequence_with_no_tokens_gets_zeros_on_both_backends():
    cache, bt, cl = _cache([0, 20], 48, 16, torch.float32)
    q = torch.randn(2, 16, 48)
    for backend in ("triton", "torch"):
        with use_backend(backend):
            out = latent_decode_attention(q, cache, bt, cl, v_dim=32, sm_scale=0.1, num_splits=2)
        assert torch.equal(out[0], torch.zeros(16, 32)) and torch.isfinite(out[1]).all()


def test_the_values_are_the_latent_part_of_the_keys():
    """Teeth: with every cached vector's rotary part set to zero and q's too, out is softmax(q c) c[:v]; moving
    the rotary channels into the first v changes the answer (a kernel that read V elsewhere would not see it)."""
    cache, bt, cl = _cache([24], 48, 8, torch.float32)
    q = torch.randn(1, 16, 48)
    with use_backend("triton"):
        a = latent_decode_attention(q, cache, bt, cl, v_dim=32, sm_scale=0.2)
        rolled = cache.roll(16, dims=-1)
        b = latent_decode_attention(q.roll(16, dims=-1), rolled, bt, cl, v_dim=32, sm_scale=0.2)
    assert not torch.allclose(a, b, atol=1e-3)  # same scores, other values
    assert_rel_close(b, _reference(q.roll(16, dims=-1), rolled, bt, cl, 32, 0.2), TOL[torch.float32])


def test_the_call_is_the_graph_node_it_costs():
    """DeepSeek-V3's decode attention node at TP 8 (16 heads, 576 wide, values 512) is the kernel call's spec."""
    m = load_model("deepseek-v3")
    ctx = [100, 300]
    g = build_step_graph(m, "decode", batch=2, context=ctx, kv_format="fp16", tp=8)
    node = g.nodes["L7.attention"]["spec"]
    q = torch.empty(2, 16, 576, dtype=torch.float16)
    cache = torch.empty(30, 16, 576, dtype=torch.float16)
    spec = latent_decode_spec(q, cache, torch.tensor(ctx, dtype=torch.int32), m.kv_lora_rank)
    assert spec == node
    assert spec.min_bytes() == node.min_bytes() and spec.flops() == node.flops()


def test_torch_path_is_the_reference_in_float64():
    cache, bt, cl = _cache([9, 31], 48, 4, torch.float64)
    q = torch.randn(2, 3, 48, dtype=torch.float64)
    out = latent_attention_torch(q, cache, bt, cl, 32, 0.3)
    assert torch.allclose(out, _reference(q, cache, bt, cl, 32, 0.3), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize(
    "change, match",
    [
        (dict(q=torch.randn(2, 16, 40)), "last dimension"),
        (dict(q=torch.randn(2, 16, 48).half()), "dtype"),
        (dict(q=torch.randn(16, 48)), "3-D"),
        (dict(v_dim=48), "v_dim"),
        (dict(v_dim=0), "v_dim"),
        (dict(sm_scale=float("nan")), "sm_scale"),
        (dict(sm_scale=None), "sm_scale"),
        (dict(num_splits=65), "num_splits"),
        (dict(context_lens=torch.tensor([9, 400], dtype=torch.int32)), "context_lens"),
        (dict(context_lens=torch.tensor([9, 20])), "int32"),
        (dict(block_tables=torch.zeros(3, 4, dtype=torch.int32)), "rows"),
        (dict(block_tables=torch.full((2, 4), 99, dtype=torch.int32)), "block"),
    ],
)
def test_bad_input_is_refused_before_any_launch(change, match):
    cache, bt, cl = _cache([9, 20], 48, 8, torch.float32)
    args = dict(q=torch.randn(2, 16, 48), latent_cache=cache, block_tables=bt, context_lens=cl, v_dim=32,
                sm_scale=0.1, num_splits=None)  # fmt: skip
    args.update(change)
    for backend in ("triton", "torch"):
        with use_backend(backend), pytest.raises(CodesignError, match=match):
            latent_decode_attention(**args)


def test_the_kernel_refuses_widths_it_cannot_tile():
    cache, bt, cl = _cache([9], 56, 8, torch.float32)  # latent 40: not a power of two
    with use_backend("triton"), pytest.raises(CodesignError, match="power of two"):
        latent_decode_attention(torch.randn(1, 16, 56), cache, bt, cl, v_dim=40, sm_scale=0.1)
    with use_backend("torch"):  # the torch path takes any widths
        latent_decode_attention(torch.randn(1, 16, 56), cache, bt, cl, v_dim=40, sm_scale=0.1)


def test_the_op_traces_without_a_graph_break():
    cache, bt, cl = _cache([9, 20], 48, 8, torch.float32)
    q = torch.randn(2, 16, 48)

    def f(q):
        return latent_decode_attention(q, cache, bt, cl, v_dim=32, sm_scale=0.1, check_data=False) * 2

    with use_backend("torch"):
        got = torch.compile(f, fullgraph=True, backend="eager")(q)
        assert torch.equal(got, f(q))


@pytest.mark.lowering
def test_compiles_for_sm90_and_sm80_without_spills():
    """Compile-only at DeepSeek-V3's widths, bf16 queries: a bf16 cache and an e4m3 one (decoded in hardware on
    sm_90, by integer ops on sm_80), 16 and 128 heads (each of `tiles`' choices): registers, no spills; and the e4m3
    writer."""
    assert_runs_without_interpreter(
        """
import torch
from codesign.autotune.compile_only import compile_only
from codesign.kernels.attention.latent import latent_decode_attention, tiles
bt = torch.arange(64, dtype=torch.int32).reshape(16, 4)
cl = torch.full((16,), 256, dtype=torch.int32)
for arch, heads, dtype in ((90, 16, torch.bfloat16), (90, 128, torch.bfloat16), (90, 16, torch.float8_e4m3fn),
                           (90, 128, torch.float8_e4m3fn), (80, 16, torch.bfloat16), (80, 128, torch.bfloat16),
                           (80, 16, torch.float8_e4m3fn), (80, 128, torch.float8_e4m3fn)):
    cache = torch.zeros(64, 64, 576, dtype=dtype)
    q = torch.zeros(16, heads, 576, dtype=torch.bfloat16)
    scale = 0.01 if dtype == torch.float8_e4m3fn else None
    with compile_only(arch=arch, gpu_name="NVIDIA H200", sms=132) as s:
        latent_decode_attention(q, cache, bt, cl, v_dim=512, sm_scale=0.07, kv_scale=scale, check_data=False)
    l, merge = s.launches  # the attention, then the paged kernels' split merge
    assert merge.kernel == "_reduce_splits_kernel" and merge.error is None and merge.spill_stores == 0, merge
    assert l.kernel == "_latent_decode_kernel" and l.error is None, l
    assert l.spill_stores == 0 and l.spill_loads == 0 and 0 < l.registers <= 255, (arch, dtype, l)
    assert l.grid[1] == heads // tiles(heads, dtype == torch.float8_e4m3fn)[0] and l.grid[0] == 16, l
    # the tiles' staged shared memory fits a block: 227 KB on sm_90, 163 KB on sm_80 (compile-only does not check)
    assert l.shared_bytes <= (232448 if arch == 90 else 166912), (arch, dtype, l.shared_bytes)
    assert l.constexprs["BLOCK_N"] == (128 if arch == 90 and dtype == torch.bfloat16 else 64 if dtype == torch.bfloat16
                                       else 32), l
from codesign.kernels.kvcache.latent import latent_write
kv_c, k_pe = torch.zeros(16, 512, dtype=torch.bfloat16), torch.zeros(16, 64, dtype=torch.bfloat16)
with compile_only(arch=90, gpu_name="NVIDIA H200", sms=132) as s:  # its writer, quantizing to e4m3
    latent_write(kv_c, k_pe, torch.zeros(64, 64, 576, dtype=torch.float8_e4m3fn), torch.arange(16), kv_scale=0.1,
                 check_data=False)
(l,) = s.launches
assert l.kernel == "_latent_write_kernel" and l.error is None and l.spill_stores == 0, l
print("ok")
"""
    )


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize(("qdtype", "heads"), [(torch.float16, 16), (torch.float32, 16), (torch.float32, 33)])
def test_an_e4m3_cache_with_one_scale(backend, qdtype, heads):
    """vLLM's fp8 MLA cache: e4m3 codes and one scale; the reference attends over codes x scale in float64.
    Unused slots hold e4m3 NaN codes (0x7F). 33 heads: 32 a program, and a block of one."""
    latent, rope = 64, 16
    full, bt, cl = _cache([13, 50], latent + rope, 16, torch.float32)
    kv_scale = float(full.nan_to_num().abs().amax()) / 448
    codes = (full / kv_scale).to(torch.float8_e4m3fn)
    assert torch.isnan(codes.float()).any()  # the poison survived the cast
    q = torch.randn(2, heads, latent + rope).to(qdtype)
    with use_backend(backend):
        out = latent_decode_attention(q, codes, bt, cl, v_dim=latent, sm_scale=0.1, kv_scale=kv_scale, num_splits=2)
    ref = _reference(q, codes.double() * kv_scale, bt, cl, latent, 0.1)
    assert out.dtype == qdtype
    assert_rel_close(out, ref, TOL[qdtype])
    # Without the scale's fold the output is off by the scale (teeth for the folding).
    assert not torch.allclose(out.double(), ref / kv_scale, rtol=0.1)


def test_an_e4m3_call_is_the_graph_node_with_an_fp8_cache():
    m = load_model("deepseek-v3")
    g = build_step_graph(m, "decode", batch=1, context=[77], kv_format="fp8", tp=8)
    node = g.nodes["L3.attention"]["spec"]
    spec = latent_decode_spec(torch.empty(1, 16, 576, dtype=torch.float16),
                              torch.empty(8, 16, 576, dtype=torch.float8_e4m3fn),
                              torch.tensor([77], dtype=torch.int32), 512)  # fmt: skip
    assert spec == node and spec.kv_bytes_per_token() == 576


@pytest.mark.parametrize(
    "cache_dtype, kv_scale, match",
    [
        (torch.float8_e4m3fn, None, "kv_scale"),
        (torch.float8_e4m3fn, -1.0, "kv_scale"),
        (torch.float32, 0.5, "kv_scale is for an e4m3 cache"),
        (torch.float8_e5m2, 0.5, "latent_cache dtype"),
    ],
)
def test_kv_scale_goes_with_an_e4m3_cache_only(cache_dtype, kv_scale, match):
    cache, bt, cl = _cache([9], 48, 8, torch.float32)
    with pytest.raises(CodesignError, match=match):
        latent_decode_attention(torch.randn(1, 16, 48), cache.to(cache_dtype), bt, cl, v_dim=32, sm_scale=0.1,
                                kv_scale=kv_scale)  # fmt: skip


def test_bf16_queries_past_fp16_range_are_refused_over_an_e4m3_cache():
    """The kernel dots an e4m3 cache in fp16: a bf16 query it cannot hold is refused (before: inf scores, NaN out)."""
    cache, bt, cl = _cache([9], 48, 8, torch.float32)
    codes = cache.to(torch.float8_e4m3fn)
    q = torch.randn(1, 16, 48).to(torch.bfloat16)
    q[0, 3, 5] = 1e6
    with use_backend("torch"), pytest.raises(CodesignError, match="fp16"):
        latent_decode_attention(q, codes, bt, cl, v_dim=32, sm_scale=0.1, kv_scale=1.0)
    q[0, 3, 5] = 6e4  # within range: runs
    with use_backend("torch"):
        assert torch.isfinite(latent_decode_attention(q, codes, bt, cl, v_dim=32, sm_scale=1e-3, kv_scale=1.0)).all()
