"""Every expert of a MoE model is resident whatever the batch (issue 23): the fit checks of the mapper, the
roofline and the explorer count all experts; the experts a batch reaches only set the traffic.

Hand count for Mixtral-8x7B in fp16 (32 layers, hidden 4096, 32 / 8 heads of 128, 8 experts of FFN 14336,
vocab 32000), weights of the GEMM nodes (the router's 8 x 4096 and the embedding table are not GEMMs):
    per layer  qkv 6144 x 4096 + o 4096 x 4096 + 8 experts x 3 x 14336 x 4096 = 1,451,229,184 weights
    32 layers x 2 B + lm_head 32000 x 4096 x 2 B = 92,878,667,776 + 262,144,000 = 93,140,811,776 B
KV cache at context 1024, per sequence: 32 layers x 1024 tokens x 2 x 8 x 128 x 2 B = 134,217,728 B.
"""

from __future__ import annotations

import dataclasses

import pytest

from codesign.accel_model.design import load_design
from codesign.catalog.gpus import load_gpu
from codesign.catalog.models import expected_active_experts
from codesign.cli import main
from codesign.dataflow.explore.eval import evaluate_point
from codesign.dataflow.explore.space import space_from_dict
from codesign.dataflow.graph import build_step_graph
from codesign.dataflow.reports import check_fits, resident_bytes
from codesign.dataflow.targets import DesignTarget
from codesign.specs import CodesignError

MIXTRAL_WEIGHTS = 93_140_811_776
KV_PER_SEQ_1024 = 134_217_728


@pytest.mark.parametrize("batch", [1, 16])
def test_all_experts_resident_at_any_batch(batch):
    g = build_step_graph("mixtral-8x7b", "decode", batch, 1024)
    r = resident_bytes(g)
    assert r["weights"] == MIXTRAL_WEIGHTS
    assert r["kv_cache"] == batch * KV_PER_SEQ_1024
    # The traffic is still the active experts': at batch 1 two of the eight.
    up = g.nodes["L0.up_proj"]
    assert up["resident_weights"] == 8 and up["spec"].batch == expected_active_experts(8, 2 * batch)
    assert up["spec"].batch == (2 if batch == 1 else 8)


@pytest.mark.parametrize("command", ["map --design a100-80gb", "roofline --gpu a100-80gb"])
@pytest.mark.parametrize("batch", ["1", "16"])
def test_mixtral_refused_on_one_a100_with_the_sizes(command, batch, capsys):
    rc = main([*command.split(), "--model", "mixtral-8x7b", "--batch", batch, "--context", "1024"])
    err = capsys.readouterr().err
    assert rc == 2
    kv = int(batch) * KV_PER_SEQ_1024 / 1e9
    assert f"(decode, batch {batch}, tp 1) does not fit on a100-80gb: weights 93.1 GB + KV cache {kv:.1f} GB" in err
    assert "> 80.0 GB" in err and "the weights alone exceed it at any batch" in err


def test_prefill_is_refused_too(capsys):
    assert main(["map", "--model", "mixtral-8x7b", "--design", "a100-80gb", "--phase", "prefill", "--batch", "1",
                 "--context", "512"]) == 2  # fmt: skip
    assert "(prefill, batch 1, tp 1) does not fit" in capsys.readouterr().err


def test_a_memory_just_large_enough_is_accepted():
    g = build_step_graph("mixtral-8x7b", "decode", 1, 1024)
    need = MIXTRAL_WEIGHTS + KV_PER_SEQ_1024
    check_fits(g, need, "exact")
    with pytest.raises(CodesignError, match=r"93\.3 GB > 93\.3 GB"):
        check_fits(g, need - 1, "one byte short")
    # A design: 6 HBM2e stacks of 16 GB hold it (96 GB), 5 do not (80 GB), at batch 1 as at batch 16.
    base = load_design("tpu_like")
    for units, fits in ((6, True), (5, False)):
        d = dataclasses.replace(base, memory=dataclasses.replace(base.memory, units=units))
        cap = DesignTarget(d).memory_capacity_bytes()
        assert cap == units * 16e9
        for batch in (1, 16):
            graph = build_step_graph("mixtral-8x7b", "decode", batch, 1024)
            if fits:
                check_fits(graph, cap, f"tpu_like x{units}")
            else:
                with pytest.raises(CodesignError, match="weights 93.1 GB"):
                    check_fits(graph, cap, f"tpu_like x{units}")


def test_a_gpu_with_room_still_maps_mixtral():
    h200 = load_gpu("h200")  # 141 GB
    assert main(["map", "--model", "mixtral-8x7b", "--design", "h200", "--batch", "1", "--context", "1024"]) == 0
    assert resident_bytes(build_step_graph("mixtral-8x7b", "decode", 64, 1024))["weights"] < h200.mem_bytes


def test_explorer_capacity_and_kv_budget_count_every_expert():
    space = space_from_dict({"base": "tpu_like", "params": {"memory.units": [5, 6]}})
    small, large = space.grid()
    for w in ("decode:b1:c1024", "trace:synthetic:20:5"):
        assert evaluate_point(space, small, w, "mixtral-8x7b")["fits"] is False
        assert evaluate_point(space, large, w, "mixtral-8x7b")["fits"] is True
    m = evaluate_point(space, large, "trace:synthetic:20:5", "mixtral-8x7b")
    # KV tokens left after all experts: (96e9 - 93,140,811,776) / (32 x 4096 B) = 21,813 (not 550k: 25 GB).
    assert m["kv_capacity_tokens"] == (96_000_000_000 - MIXTRAL_WEIGHTS) // (32 * 4096) == 21_813
