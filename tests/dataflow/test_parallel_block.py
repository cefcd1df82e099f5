"""Parallel blocks (Cohere, Command-R / A): attention and MLP read one normed input and join the residual stream in
one add; under tensor parallelism the two row-parallel outputs are summed first and all-reduced once a layer."""

from __future__ import annotations

import dataclasses

from codesign.catalog.gpus import load_gpu
from codesign.catalog.models import ModelConfig
from codesign.dataflow.graph import build_step_graph
from codesign.dataflow.roofline import roofline

COHERE = ModelConfig(name="cohere-like", layers=4, hidden=1024, heads=8, kv_heads=2, ffn=4096, vocab=32000,
                     norm="layer", parallel_block=True, tied_embeddings=True)  # fmt: skip
SEQUENTIAL = dataclasses.replace(COHERE, parallel_block=False)


def test_both_branches_read_one_norm_and_join_once():
    g = build_step_graph(COHERE, "decode", 2, 512)
    assert set(g.successors("L1.attn_norm")) == {"L1.qkv_proj", "L1.up_proj"}
    assert "L1.ffn_norm" not in g and "L1.attn_residual" not in g
    assert set(g.predecessors("L1.branch_add")) == {"L1.o_proj", "L1.down_proj"}
    assert set(g.predecessors("L1.block_residual")) == {"L1.branch_add", "L0.block_residual"}
    assert COHERE.param_count() == SEQUENTIAL.param_count() - 4 * 2 * 1024  # one LayerNorm a layer, not two


def test_tensor_parallel_all_reduces_once_a_layer():
    ops = [d["op"] for _, d in build_step_graph(COHERE, "decode", 2, 512, tp=2).nodes(data=True)]
    seq = [d["op"] for _, d in build_step_graph(SEQUENTIAL, "decode", 2, 512, tp=2).nodes(data=True)]
    assert ops.count("all_reduce") == 4 and seq.count("all_reduce") == 8
    # The same weights and attention: the roofline differs by the norm, one all-reduce and one add a layer.
    h100 = load_gpu("h100-sxm")
    a = roofline(build_step_graph(COHERE, "decode", 2, 512, tp=2), h100)
    b = roofline(build_step_graph(SEQUENTIAL, "decode", 2, 512, tp=2), h100)
    assert a.total_bytes < b.total_bytes and a.total_time_s < b.total_time_s


def test_a_gated_attention_output_is_a_gemm_and_a_sigmoid_mul():
    """AFMoE: the attention's output times sigmoid(x W_g) before o_proj; W_g hidden x q_dim, sharded as q."""
    from codesign.specs import Elementwise, Gemm

    gated = dataclasses.replace(SEQUENTIAL, attention_output_gate=True)
    g = build_step_graph(gated, "decode", 3, 256, tp=2)
    assert g.nodes["L0.attn_gate"]["spec"] == Gemm(M=3, N=4 * 128, K=1024)
    assert g.nodes["L0.attn_gate_mul"]["spec"] == Elementwise("sigmoid_mul", 3 * 4 * 128)
    assert set(g.predecessors("L0.attn_gate_mul")) == {"L0.attention", "L0.attn_gate"}
    assert set(g.predecessors("L0.o_proj")) == {"L0.attn_gate_mul"}
    assert gated.param_count() == SEQUENTIAL.param_count() + 4 * 1024 * 1024
