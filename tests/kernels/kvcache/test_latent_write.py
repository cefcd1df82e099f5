"""The latent cache's writer (`latent_write`): both backends against the definition, e4m3 codes bit for bit between
them (ties and clamping included), slots -1 skipped and the rest untouched, a write-then-decode round trip, the
graph's node, bad input."""

from __future__ import annotations

import pytest
import torch

from codesign.backend import use_backend
from codesign.catalog.models import load_model
from codesign.dataflow.graph import build_step_graph
from codesign.kernels.attention.latent import latent_attention_torch, latent_decode_attention
from codesign.kernels.kvcache.latent import latent_write, latent_write_spec
from codesign.specs import CodesignError

BACKENDS = ["triton", "torch"]
E4M3 = torch.float8_e4m3fn


def _setup(tokens: int, latent: int, rope: int, dtype, cache_dtype, nb: int = 6, bs: int = 4):
    kv_c, k_pe = torch.randn(tokens, latent).to(dtype), torch.randn(tokens, rope).to(dtype)
    cache = torch.full((nb, bs, latent + rope), float("nan")).to(cache_dtype)
    slots = torch.randperm(nb * bs)[:tokens].to(torch.int32)
    return kv_c, k_pe, cache, slots


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    "latent, rope, dtype", [(32, 16, torch.float32), (40, 8, torch.float16), (512, 64, torch.float16)]
)
def test_writes_each_token_at_its_slot_and_nothing_else(backend, latent, rope, dtype):
    kv_c, k_pe, cache, slots = _setup(7, latent, rope, dtype, dtype)
    slots[3] = -1  # a padding token
    with use_backend(backend):
        latent_write(kv_c, k_pe, cache, slots)
    flat = cache.view(-1, latent + rope)
    for t in range(7):
        if t == 3:
            continue
        assert torch.equal(flat[int(slots[t])], torch.cat([kv_c[t], k_pe[t]]))
    written = {int(s) for s in slots if s >= 0}
    untouched = [i for i in range(flat.shape[0]) if i not in written]
    assert torch.isnan(flat[untouched]).all()


def test_e4m3_codes_are_the_same_bytes_on_both_backends():
    """Random values, exact ties between neighbouring e4m3 codes (rounded half to even), values past 448 x scale
    (clamped), subnormals and -0.0."""
    kv_c, k_pe, _, slots = _setup(9, 32, 16, torch.float32, E4M3, nb=4, bs=4)
    scale = 0.5
    ties = torch.tensor([1.0625, 1.1875, 0.28125, 17.0, 19.0, 300.0, 500.0, -1000.0, 2.0**-9 * 1.5, -0.0]) * scale
    kv_c[0, : len(ties)] = ties
    kv_c[1, :4] = torch.tensor([2.0**-10, 2.0**-7, -(2.0**-8) * 3, 448.0]) * scale
    out = {}
    for backend in BACKENDS:
        cache = torch.full((4, 4, 48), float("nan")).to(E4M3)
        with use_backend(backend):
            latent_write(kv_c, k_pe, cache, slots, kv_scale=scale)
        out[backend] = cache.view(torch.uint8)
    assert torch.equal(out["triton"], out["torch"])
    row = out["torch"].view(-1, 48)[int(slots[0])].view(E4M3).float()
    # 1.0625 lies halfway between 1.0 and 1.125: to even (1.0); 1.1875 -> 1.25; 17 -> 16; 19 -> 20; past 448: 448.
    assert row[:9].tolist() == [1.0, 1.25, 0.28125, 16.0, 20.0, 288.0, 448.0, -448.0, 2.0**-9 * 2]
    assert row[9].item() == 0.0 and torch.signbit(row[9])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("cache_dtype", [torch.float32, E4M3])
def test_written_then_decoded(backend, cache_dtype):
    """Prefill writes two sequences' latents, decode attends over them: the fp64 reference over what was stored."""
    latent, rope, bs = 32, 16, 8
    lens = [13, 21]
    nb = 8
    bt = torch.randperm(nb).to(torch.int32).reshape(2, 4)
    slots = torch.cat([bt[b, torch.arange(n) // bs] * bs + torch.arange(n) % bs for b, n in enumerate(lens)])
    kv_c, k_pe = torch.randn(sum(lens), latent), torch.randn(sum(lens), rope)
    cache = torch.full((nb, bs, latent + rope), float("nan")).to(cache_dtype)
    scale = 0.02 if cache_dtype == E4M3 else None
    q = torch.randn(2, 16, latent + rope)
    cl = torch.tensor(lens, dtype=torch.int32)
    with use_backend(backend):
        latent_write(kv_c, k_pe, cache, slots.to(torch.int64), kv_scale=scale)
        out = latent_decode_attention(q, cache, bt, cl, v_dim=latent, sm_scale=0.15, kv_scale=scale)
    stored = cache.double() * (scale or 1.0)
    ref = latent_attention_torch(q.double(), stored, bt, cl, latent, 0.15)
    assert torch.allclose(out.double(), ref, rtol=1e-4, atol=1e-5)
    if cache_dtype == E4M3:  # the codes, not the inputs: e4m3 rounding moved the answer
        exact = torch.cat([kv_c, k_pe], 1).double()
        assert not torch.allclose(stored.view(-1, latent + rope)[slots.long()], exact, atol=1e-3)


def test_the_call_is_the_graph_node_it_costs():
    g = build_step_graph(load_model("deepseek-v3"), "decode", batch=5, context=64, kv_format="fp8", tp=8)
    node = g.nodes["L0.kv_write"]["spec"]
    spec = latent_write_spec(torch.empty(5, 512, dtype=torch.float16), torch.empty(5, 64, dtype=torch.float16),
                             torch.empty(4, 16, 576, dtype=E4M3))  # fmt: skip
    assert spec == node and spec.min_bytes() == node.min_bytes()


@pytest.mark.parametrize(
    "change, match",
    [
        (dict(k_pe=torch.randn(5, 8)), "channels"),
        (dict(k_pe=torch.randn(4, 16)), "one row a token"),
        (dict(kv_c=torch.randn(5, 32).half()), "dtype"),
        (dict(kv_scale=0.5), "kv_scale is for an e4m3 cache"),
        (dict(slot_mapping=torch.tensor([0, 1, 2, 3, 96], dtype=torch.int32)), "outside"),
        (dict(slot_mapping=torch.tensor([0, 1, 2, 1, -1], dtype=torch.int32)), "twice"),
        (dict(slot_mapping=torch.tensor([0, 1, 2, 3], dtype=torch.int32)), "shape"),
        (dict(latent_cache=torch.zeros(6, 4, 48, dtype=E4M3)), "kv_scale"),
        (dict(latent_cache=torch.zeros(6, 4, 48, dtype=torch.float16)), "latent_cache dtype"),
    ],
)
def test_bad_input_is_refused_before_any_write(change, match):
    args = dict(kv_c=torch.randn(5, 32), k_pe=torch.randn(5, 16), latent_cache=torch.zeros(6, 4, 48),
                slot_mapping=torch.arange(5, dtype=torch.int32), kv_scale=None)  # fmt: skip
    args.update(change)
    before = args["latent_cache"].clone()
    for backend in BACKENDS:
        with use_backend(backend), pytest.raises(CodesignError, match=match):
            latent_write(**args)
    assert torch.equal(args["latent_cache"].view(torch.uint8), before.view(torch.uint8))
