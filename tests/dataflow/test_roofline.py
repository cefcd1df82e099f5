"""Step graphs and roofline analysis, checked against bandwidth arithmetic and measured A100 latencies."""

from __future__ import annotations

import csv
from pathlib import Path

import networkx as nx
import pytest

from codesign.catalog.gpus import load_gpu
from codesign.catalog.models import load_model
from codesign.dataflow.graph import build_step_graph
from codesign.dataflow.llmcompass_ref import (
    GPT3_DECODE_A100,
    GPT3_PREFILL_A100,
    LAYER_ROWS,
    MATMUL_A100,
    gpt3_layer_specs,
)
from codesign.dataflow.roofline import op_time, roofline
from codesign.specs import CodesignError, Gemm, KVFormat

SHARED = Path(__file__).resolve().parents[3] / "shared" / "reference-data" / "llmcompass-a100-mi210"


def test_llama2_7b_decode_is_weight_plus_kv_over_bandwidth():
    """The issue's acceptance check: within 15% of (weight bytes + KV bytes) / bandwidth on H100 SXM."""
    m = load_model("llama-2-7b")
    gpu = load_gpu("h100-sxm")
    rep = roofline(build_step_graph(m, "decode", batch=1, context=4096), gpu)
    weights = m.layers * m.weight_bytes_per_layer(16) + m.vocab * m.hidden * 2  # blocks + LM head
    kv = m.layers * 4096 * 2 * m.kv_dim * 2
    ideal = (weights + kv) / gpu.mem_bw
    assert rep.time_per_token_s() == pytest.approx(ideal, rel=0.15)
    assert 3.5e-3 < rep.time_per_token_s() < 5.5e-3  # ~13.5 GB weights + 2.1 GB KV over 3.35 TB/s


def test_graph_structure_is_a_dag_with_every_layer():
    g = build_step_graph("llama-3-8b", "decode", batch=3, context=[10, 20, 30], tp=2)
    assert nx.is_directed_acyclic_graph(g)
    layers = {d["layer"] for _, d in g.nodes(data=True) if d["layer"] is not None}
    assert layers == set(range(32))
    qkv = g.nodes["L0.qkv_proj"]["spec"]
    assert (qkv.M, qkv.N, qkv.K) == (3, (16 + 2 * 4) * 128, 4096)  # 32/2 q heads + 2 x 8/2 kv heads
    assert g.nodes["L5.attention"]["spec"].context_lens == (10, 20, 30)
    assert "L0.attn_all_reduce" in g and "L0.ffn_all_reduce" in g
    assert all("bytes" in d for _, _, d in g.edges(data=True))


def test_moe_and_formats_change_bytes():
    dense = roofline(build_step_graph("llama-2-7b", "decode", 1, 1024), load_gpu("h100-sxm"))
    int4 = roofline(
        build_step_graph("llama-2-7b", "decode", 1, 1024, weight_format="int4-g128"), load_gpu("h100-sxm")
    )
    ratio = dense.total_bytes / int4.total_bytes
    assert 3.0 < ratio < 4.0  # weights shrink 16/4.125; the fp16 KV cache and LM head do not
    g = build_step_graph("mixtral-8x7b", "decode", batch=1, context=128)
    up = g.nodes["L0.up_proj"]["spec"]
    assert up.batch == 2  # top-2 of 8 experts for one token
    kvq = build_step_graph("llama-3-8b", "decode", 8, 4096, kv_format="int4-kivi")
    kv_fp16 = build_step_graph("llama-3-8b", "decode", 8, 4096)
    a_q, a_f = kvq.nodes["L0.attention"]["spec"], kv_fp16.nodes["L0.attention"]["spec"]
    assert a_f.min_bytes() / a_q.min_bytes() == pytest.approx(
        16 / KVFormat.parse("int4-kivi").bits_per_element(128), rel=0.01
    )


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(model="llama-2-7b", context=5000), "maximum context"),
        (dict(model="llama-2-7b", batch=0), "batch"),
        (dict(model="llama-2-7b", tp=3), "tp=3 must divide"),
        (dict(model="llama-2-7b", phase="train"), "phase"),
        (dict(model="llama-2-7b", batch=2, context=[5]), "batch is 2"),
        (dict(model="llama-2-7b", weight_format="int3"), "weight format"),
    ],
)
def test_graph_bad_input(kwargs, match):
    with pytest.raises(CodesignError, match=match):
        build_step_graph(**kwargs)


@pytest.mark.parametrize("m, n, k, measured", MATMUL_A100)
def test_matmul_roofline_below_measured_a100(m, n, k, measured):
    """A roofline is a lower bound: every measured LLMCompass A100 matmul must take at least as long."""
    t, _ = op_time(Gemm(m, n, k), load_gpu("a100-80gb"))
    assert t <= measured
    if m * n * k >= 8192 * 4096 * 4096:
        assert t / measured > 0.8  # large GEMMs run close to the 312 TFLOP/s peak


@pytest.mark.parametrize("phase, measured", [("prefill", GPT3_PREFILL_A100), ("decode", GPT3_DECODE_A100)])
def test_gpt3_layer_rows_below_measured(phase, measured):
    specs = gpt3_layer_specs(phase)
    assert tuple(specs) == LAYER_ROWS
    gpu = load_gpu("a100-80gb")
    for (name, spec), meas in zip(specs.items(), measured):
        t, _ = op_time(spec, gpu)
        assert t <= meas, f"{name}: roofline {t:.3e} s above measured {meas:.3e} s"


@pytest.mark.skipif(not SHARED.is_dir(), reason="../shared reference data not present (users' clones)")
def test_copied_rows_match_shared_reference_files():
    with open(SHARED / "matmul_A100.csv") as f:
        rows = [[c.strip() for c in r] for r in csv.reader(f) if r]
    got = tuple((int(r[0]), int(r[1]), int(r[2]), float(r[3].removesuffix("ms")) * 1e-3) for r in rows)
    assert len(got) == len(MATMUL_A100)
    for g, want in zip(got, MATMUL_A100):
        assert g[:3] == want[:3] and g[3] == pytest.approx(want[3])
    text = (SHARED / "transformer_A100.csv").read_text().split()
    assert len(text) >= 11
    assert [float(x) for x in text[:10]] == pytest.approx(list(GPT3_PREFILL_A100[:10]))
