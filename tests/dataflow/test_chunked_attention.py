"""Llama 4 in the step graph: chunked attention (a query at p sees keys from p // C * C, C = 8192) on three layers of
four, global attention on every fourth; routed experts on every layer (Scout) or every other (Maverick, the others a
dense MLP of 16384).

Hand counts (Scout; 48 layers, hidden 5120, 40 / 8 heads of 128, 16 experts of 8192 top-1 plus a shared one):
per layer attention 5120 x (5120 + 2 x 1024) + 5120 x 5120 = 62,914,560 weights; experts 16 x 3 x 5120 x 8192 =
2,013,265,920, shared 125,829,120, router 81,920; embeddings and head 2 x 202,048 x 5,120 = 2,068,971,520; norms
(2 x 48 + 1) x 5120 = 496,640: 107,769,861,120 in all."""

from __future__ import annotations

import dataclasses

import pytest

from codesign.catalog.models import ModelConfig, chunk_pieces, load_model
from codesign.dataflow.graph import build_step_graph
from codesign.dataflow.reports import resident_bytes
from codesign.specs import CodesignError, PagedDecodeAttention, PrefillAttention

SCOUT, MAVERICK = load_model("llama-4-scout"), load_model("llama-4-maverick")


def test_scout_parameters_by_hand():
    assert SCOUT.param_count() == 107_769_861_120
    assert SCOUT.moe_layers == 48 and MAVERICK.moe_layers == 24
    assert [SCOUT.chunk_of(i) for i in range(8)] == [8192, 8192, 8192, None] * 2


def test_decode_a_chunked_layer_attends_within_its_chunk():
    g = build_step_graph("llama-4-scout", "decode", 3, (9000, 100, 8192))
    chunked, full = g.nodes["L0.attention"]["spec"], g.nodes["L3.attention"]["spec"]
    assert isinstance(chunked, PagedDecodeAttention)
    assert chunked.context_lens == (808, 100, 8192)  # (c - 1) % 8192 + 1: the chunk from 8192 holds 808 tokens
    assert full.context_lens == (9000, 100, 8192)
    # The KV a step needs resident: the chunked layers' chunks (engines free the past ones), the global layers' all.
    kv = resident_bytes(g)["kv_cache"]
    per_token = 2 * 8 * 128 * 2  # K and V of 8 heads of 128 in fp16, one layer
    assert kv == per_token * (36 * (808 + 100 + 8192) + 12 * (9000 + 100 + 8192))


def test_prefill_a_chunked_layer_is_causal_within_each_chunk():
    g = build_step_graph("llama-4-scout", "prefill", 2, (20000, 300))
    chunked, full = g.nodes["L0.attention"]["spec"], g.nodes["L3.attention"]["spec"]
    assert isinstance(chunked, PrefillAttention)
    assert chunked.seq_lens == (8192, 8192, 3616, 300) and full.seq_lens == (20000, 300)
    assert chunked.flops() < full.flops()
    # Teeth: the same graph without chunks attends causally over the whole prompt on every layer.
    plain = build_step_graph(dataclasses.replace(SCOUT, attention_chunk=None, full_attention_layers=()), "prefill", 2,
                             (20000, 300))  # fmt: skip
    assert plain.nodes["L0.attention"]["spec"].seq_lens == (20000, 300)


def test_maverick_interleaves_dense_and_routed_layers():
    g = build_step_graph("llama-4-maverick", "decode", 4, 1024)
    assert "L0.router" not in g and "L1.router" in g and "L2.router" not in g
    assert g.nodes["L0.up_proj"]["spec"].N == 2 * 16384  # a dense MLP of intermediate_size_mlp
    up = g.nodes["L1.up_proj"]
    assert up["spec"].N == 2 * 8192 and up["resident_weights"] == 128
    assert "L1.shared_up_proj" in g and "L0.shared_up_proj" not in g


def test_chunk_pieces():
    assert chunk_pieces(0, 12, 4) == [(0, 0, 4), (4, 4, 8), (8, 8, 12)]
    assert chunk_pieces(6, 1, 4) == [(4, 6, 7)]
    assert chunk_pieces(7, 3, 4) == [(4, 7, 8), (8, 8, 10)]
    assert chunk_pieces(8, 0, 4) == [(8, 8, 8)]


@pytest.mark.parametrize(
    "change, match",
    [
        (dict(sliding_window=128), "a sliding_window and an attention_chunk together"),
        (dict(attention_chunk=0), "attention_chunk"),
        (dict(moe_layer_step=2), "moe_layer_step=2 needs experts > 0 and dense_ffn > 0"),
        (dict(attention_chunk=None), "full_attention_layers need a sliding_window or an attention_chunk"),
    ],
)
def test_what_the_fields_cannot_hold_is_refused(change, match):
    with pytest.raises(CodesignError, match=match):
        ModelConfig(**{**dataclasses.asdict(SCOUT), **change})
