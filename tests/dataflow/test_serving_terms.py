"""Serving terms (dataflow/serving_terms.py): the GEMV rule, the stored fitted terms, and GPUTarget's opt-in."""

from __future__ import annotations

import dataclasses

import pytest

from codesign.catalog.gpus import list_gpus, load_gpu
from codesign.dataflow.gpu_model import GRAPH_LAUNCH_S, efficiencies, gpu_op_time, terms
from codesign.dataflow.graph import build_step_graph
from codesign.dataflow.serving_terms import (
    GENERATION,
    Terms,
    fitted_terms,
    generation,
    parse_terms,
    serving_efficiencies,
    terms_yaml,
)
from codesign.dataflow.targets import GPUTarget
from codesign.specs import CodesignError, Gemm, WeightFormat


def _roofline_s(spec, gpu, compute, memory):
    """fp64 reference of a serving GEMM: graph launch + max(compute, stream) + epilogue, no per-SM cap."""
    t, mm = terms(spec, gpu), efficiencies(gpu)["matmul"]
    me = min(1.0, mm.memory * memory)
    return GRAPH_LAUNCH_S + max(t.compute_s / (mm.compute * compute), t.in_s / me) + t.out_s / me


@pytest.mark.parametrize("gpu_key", ["a100-80gb", "h100-sxm"])
@pytest.mark.parametrize(
    "m, n, k", [(1, 8192, 7168), (3, 2560, 8192), (2048, 14336, 4096), (129, 4608, 12288)]
)
def test_serving_gemms_stream_over_every_sm(gpu_key, m, n, k):
    gpu = load_gpu(gpu_key)
    spec = Gemm(M=m, N=n, K=k)
    eff = serving_efficiencies(gpu, 0.8, 0.9)
    assert eff["matmul"].sm_share is None and eff["norm"] == efficiencies(gpu)["norm"]
    assert gpu_op_time(spec, gpu, eff, "graph") == pytest.approx(_roofline_s(spec, gpu, 0.8, 0.9), rel=1e-12)
    if (gpu_key, m) == ("a100-80gb", 1):  # 64 tiles on 108 SMs: the calibrated per-SM cap streamed it on 64
        calibrated = gpu_op_time(spec, gpu, launch="graph")
        assert gpu_op_time(spec, gpu, serving_efficiencies(gpu, 1.0, 1.0), "graph") < 0.7 * calibrated


def test_every_catalogue_gpu_has_a_generation():
    assert set(list_gpus()) <= set(GENERATION)
    odd = dataclasses.replace(load_gpu("a100-80gb"), key="a100-80gb-custom")
    with pytest.raises(CodesignError, match="a100-80gb-custom"):
        generation(odd)


def test_stored_terms_parse_and_round_trip():
    t = fitted_terms()
    assert 0.3 <= t.factor(("memory", "ampere")) <= 1.1 and t.factor(("compute", "unseen", "fp16")) == 1.0
    assert parse_terms(terms_yaml(t, "# header\n")) == t
    with pytest.raises(CodesignError, match="expected version: 1"):
        parse_terms("version: 2\n")
    with pytest.raises(CodesignError, match="malformed"):
        parse_terms("version: 1\nfactors: {memory/ampere: 0.9}\n")
    assert Terms().replace("launch_s", 5e-6).launch_s == 5e-6


def test_gpu_target_default_is_the_calibrated_model():
    gpu = load_gpu("h100-sxm")
    g = build_step_graph("llama-3-8b", "decode", 8, 2048)
    plain = GPUTarget(gpu)
    for _, d in g.nodes(data=True):
        assert plain.candidates(d["spec"])[0].seconds == gpu_op_time(d["spec"], gpu, launch="graph")


@pytest.mark.parametrize(
    "gpu_key, spec, family",
    [
        ("a100-80gb", Gemm(M=2048, N=12288, K=4096), "fp16"),
        (
            "h100-sxm",
            Gemm(M=2048, N=12288, K=4096, weight=WeightFormat.parse("fp8_e4m3"), act_dtype="fp8_e4m3"),
            "fp8",
        ),
        ("h200", Gemm(M=1, N=8192, K=7168), "fp16"),
    ],
)
def test_gpu_target_serving_applies_the_fitted_terms(gpu_key, spec, family):
    gpu = load_gpu(gpu_key)
    t, gen = fitted_terms(), GENERATION[gpu_key]
    kc, km = t.factor(("compute", gen, family)), t.factor(("memory", gen))
    served = GPUTarget(gpu, serving=True).candidates(spec)[0].seconds
    assert served == pytest.approx(_roofline_s(spec, gpu, kc, km), rel=1e-12)
    assert served != GPUTarget(gpu).candidates(spec)[0].seconds
