"""Expert parallelism in the step graph (`ep`): the routed experts sharded over ranks that each run attention on
their own batch, with the MoE dispatch and combine as all-to-alls, costed on the link.

Hand counts for DeepSeek-V3 (61 blocks, the first 3 dense; hidden 7168; 256 routed experts of FFN 2048, top 8):
routed expert weights 58 x 256 x 3 x 2048 x 7168 = 653,908,770,816, in fp16 1,307,817,541,632 B; at ep 8 a rank
holds 32 experts of each block, 1/8 of them.
"""

from __future__ import annotations

import itertools
import json
import math

import pytest

from codesign.accel_model.collectives import gpu_interconnect, interconnect
from codesign.accel_model.design import load_design
from codesign.accel_model.evaluate import evaluate
from codesign.catalog.gpus import load_gpu
from codesign.catalog.models import expected_active_experts, load_model
from codesign.cli import main
from codesign.dataflow.gpu_model import gpu_op_time
from codesign.dataflow.graph import build_step_graph, remote_ranks
from codesign.dataflow.reports import check_fits, resident_bytes
from codesign.dataflow.roofline import op_time, roofline
from codesign.specs import AllReduce, AllToAll, CodesignError

H200 = load_gpu("h200")
V3 = load_model("deepseek-v3")
ROUTED_FP16_BYTES = 1_307_817_541_632


def test_remote_ranks_is_the_enumerated_mean():
    # 8 experts over 4 ranks (2 each), top 2: every pick of two experts equally likely; rank 0's view.
    pairs = list(itertools.combinations(range(8), 2))
    mean = sum(len({e // 2 for e in p} - {0}) for p in pairs) / len(pairs)
    assert remote_ranks(8, 2, 4) == pytest.approx(mean, rel=1e-12) == pytest.approx(39 / 28, rel=1e-12)
    assert remote_ranks(8, 2, 1) == 0.0
    assert remote_ranks(8, 8, 4) == pytest.approx(3.0)  # every expert picked: every rank reached
    # DeepSeek-V3 at ep 8: 7 x (1 - C(224, 8) / C(256, 8)).
    assert remote_ranks(256, 8, 8) == pytest.approx(7 * (1 - math.comb(224, 8) / math.comb(256, 8)), rel=1e-12)
    assert 4.5 < remote_ranks(256, 8, 8) < 4.7


def test_all_to_all_spec():
    assert AllToAll(1000, 8).min_bytes() == 2000 and AllToAll(1000, 8, "fp8_e4m3").min_bytes() == 1000
    assert AllToAll(1000, 1).min_bytes() == 0 and AllToAll(1000, 8).flops() == 0
    assert AllToAll(1000, 8).peak_key() == "link"
    for bad, match in (({"numel": -1}, "numel"), ({"world_size": 0}, "world_size"), ({"dtype": "int4"}, "dtype")):
        with pytest.raises(CodesignError, match=match):
            AllToAll(**{"numel": 10, "world_size": 2, **bad})


def _graph(ep: int, batch: int = 32, phase: str = "decode", **kw):
    return build_step_graph("deepseek-v3", phase, batch, 4096, "fp8_e4m3", "fp8", act_dtype="fp8_e4m3", ep=ep, **kw)


def test_the_moe_blocks_exchange_their_tokens_and_hold_an_eighth_of_the_experts():
    g = _graph(8)
    assert g.graph["ep"] == 8
    ops = [d["op"] for _, d in g.nodes(data=True)]
    assert ops.count("moe_dispatch") == ops.count("moe_combine") == 58  # the MoE blocks, not the 3 dense ones
    assert "all_reduce" not in ops  # tp 1: nothing sharded, nothing reduced
    assert "L2.moe_dispatch" not in g and "L3.moe_dispatch" in g
    r = remote_ranks(256, 8, 8)
    disp, comb = g.nodes["L3.moe_dispatch"]["spec"], g.nodes["L3.moe_combine"]["spec"]
    # fp8 rows with their fp32 scale out, fp16 sums back: one row per (token, remote rank holding its experts).
    assert disp == AllToAll(round(32 * r * (7168 + 4)), 8, "fp8_e4m3")
    assert comb == AllToAll(round(32 * r * 7168), 8, "fp16")
    up = g.nodes["L3.up_proj"]
    assert up["resident_weights"] == 32
    # A rank's experts run as many picks as its tokens make (balanced routing): 32 x 8 rows over 32 experts.
    active = expected_active_experts(32, 32 * 8)
    assert up["spec"].batch == active and up["spec"].M == math.ceil(256 / active)
    assert set(g.predecessors("L3.up_proj")) == {"L3.moe_dispatch"}
    assert set(g.predecessors("L3.moe_combine")) == {"L3.down_proj", "L3.router"}
    assert set(g.successors("L3.moe_combine")) == {"L3.shared_combine"}
    # Attention is the rank's own: all 128 heads over its 32 sequences.
    attn = g.nodes["L3.attention"]["spec"]
    assert attn.q_heads == 128 and attn.context_lens == (4096,) * 32


def test_a_rank_holds_its_share_of_the_routed_weights_and_all_the_rest():
    fp16 = {"weight_format": "fp16", "kv_format": "fp16"}
    one = resident_bytes(build_step_graph("deepseek-v3", "decode", 4, 1024, ep=1, **fp16))
    eight = resident_bytes(build_step_graph("deepseek-v3", "decode", 4, 1024, ep=8, **fp16))
    assert one["weights"] - eight["weights"] == ROUTED_FP16_BYTES * 7 // 8
    assert one["kv_cache"] == eight["kv_cache"]  # the rank's own sequences, whole


def test_expert_parallel_fits_where_one_gpu_cannot_and_says_ep_when_it_does_not():
    with pytest.raises(CodesignError, match="weights alone exceed it"):
        check_fits(_graph(1), H200.mem_bytes, "h200")
    check_fits(_graph(8), H200.mem_bytes, "h200")  # ~99 GB of weights a rank, 32 x 4k of latent cache
    with pytest.raises(CodesignError, match=r"\(decode, batch 2048, tp 1, ep 8\) does not fit on h200"):
        check_fits(_graph(8, batch=2048), H200.mem_bytes, "h200")


@pytest.mark.parametrize(
    "model, kw, match",
    [
        ("llama-2-7b", {"ep": 2}, "ep=2 needs a mixture-of-experts model; llama-2-7b has a dense FFN"),
        ("deepseek-v3", {"ep": 2, "tp": 2}, "ep=2 with tp=2: expert parallelism is modelled with data-parallel"),
        ("deepseek-v3", {"ep": 3}, r"ep=3 must divide the model's routed experts \(256\)"),
        ("deepseek-v3", {"ep": 0}, "ep"),
        ("mixtral-8x7b", {"ep": 16}, r"ep=16 must divide the model's routed experts \(8\)"),
    ],
)
def test_what_expert_parallelism_cannot_take_is_refused(model, kw, match):
    with pytest.raises(CodesignError, match=match):
        build_step_graph(model, "decode", 4, 512, **kw)


def test_mixtral_one_expert_a_rank():
    g = build_step_graph("mixtral-8x7b", "prefill", 1, 512, ep=8)
    up = g.nodes["L0.up_proj"]
    assert up["resident_weights"] == 1 and up["spec"].batch == 1 and up["spec"].M == 512 * 2
    # top 2 of 8, one a rank: 7 x (1 - C(7, 2) / C(8, 2)) = 1.75 remote ranks a token.
    assert g.nodes["L0.moe_dispatch"]["spec"] == AllToAll(round(512 * 1.75 * 4096), 8, "fp16")


def test_the_exchange_costs_on_each_target():
    spec = AllToAll(1_000_000, 8, "fp8_e4m3")
    assert op_time(spec, H200) == (1e6 / H200.link_bw, "link")  # the roofline: bytes over the link alone
    link = gpu_interconnect("h200")
    want = link.latency_s + link.hop_s + 1e6 / (H200.link_bw * link.bus_efficiency)
    assert gpu_op_time(spec, H200) == pytest.approx(want, rel=1e-12)
    assert gpu_op_time(spec, H200, launch="graph") == pytest.approx(want, rel=1e-12)  # no one-shot variant
    assert gpu_op_time(AllToAll(1_000_000, 1), H200) == 0.0
    d = load_design("tpu_like")
    r = evaluate(d, spec)
    chip = interconnect(d.links.interconnect)
    assert r.seconds == pytest.approx(chip.all_to_all_s(spec, d.links.chip_link_gbps * 1e9), rel=1e-9)
    assert r.energy_pj["link.transfer"] == pytest.approx(1e6 * 8 * d.links.link_pj_per_bit)
    # No adds: an all-reduce of as many bytes does vector work an exchange does not.
    assert "vector" not in r.utilisation or r.utilisation["vector"] == 0
    assert evaluate(d, AllReduce(500_000, 8)).seconds > r.seconds


def test_nvlink_exchange_is_deepep_s_measured_bandwidth():
    """Checked, not fitted: DeepEP V1's intranode EP 8 on H800 (~200 GB/s a direction of NVLink), 4096 tokens of
    DeepSeek-V3 (FP8 dispatch, BF16 combine): 153 GB/s dispatch, 158 GB/s combine (deepseek-ai/DeepEP
    docs/legacy.md). NVLink 4's bus efficiency (NCCL's ring figure) gives 164 GB/s for messages this size."""
    nvlink = interconnect("nvlink4")
    g = build_step_graph("deepseek-v3", "prefill", 1, 4096, "fp8_e4m3", "fp8", act_dtype="fp8_e4m3", ep=8)
    for node, measured in (("L3.moe_dispatch", 153e9), ("L3.moe_combine", 158e9)):
        spec = g.nodes[node]["spec"]
        achieved = spec.min_bytes() / nvlink.all_to_all_s(spec, 200e9)
        assert achieved / measured == pytest.approx(1.0, abs=0.08), node


def test_roofline_counts_the_ranks_tokens():
    g = _graph(8)
    rep = roofline(g, H200)
    assert rep.ranks == 8
    assert rep.tokens_per_s() == pytest.approx(32 * 8 / rep.total_time_s, rel=1e-12)
    assert rep.to_dict()["ranks"] == 8
    # Teeth: the same step at ep 1 is one rank's batch.
    assert roofline(_graph(1), H200).tokens_per_s() == pytest.approx(32 / roofline(_graph(1), H200).total_time_s)


def test_data_parallel_attention_beats_tensor_parallel_at_the_same_global_batch():
    """8 H200s, fp8, 256 sequences of 4k: TP 8 makes each rank read every sequence's latent cache for its 16
    heads; EP 8 gives each rank 32 sequences read once by all 128 heads, and trades two all-reduces a block for the
    MoE exchange. The roofline's attention falls 3x and the step ~19 %."""
    tp = roofline(build_step_graph("deepseek-v3", "decode", 256, 4096, "fp8_e4m3", "fp8", 8, "fp8_e4m3"), H200)
    ep = roofline(_graph(8), H200)
    rows = {r.op: r for r in tp.rows}, {r.op: r for r in ep.rows}
    assert rows[0]["attention"].time_s > 3 * rows[1]["attention"].time_s
    assert rows[0]["all_reduce"].time_s > 4 * (rows[1]["moe_dispatch"].time_s + rows[1]["moe_combine"].time_s)
    assert 0.75 < ep.total_time_s / tp.total_time_s < 0.85
    assert ep.tokens_per_s() > tp.tokens_per_s()


def test_the_commands_take_ep(capsys, tmp_path):
    common = ["--model", "deepseek-v3", "--weight-format", "fp8_e4m3", "--act-dtype", "fp8_e4m3", "--kv-format",
              "fp8", "--ep", "8", "--batch", "32", "--context", "4096"]  # fmt: skip
    assert main(["roofline", "--gpu", "h200", *common, "--json", str(tmp_path / "r.json")]) == 0
    out = capsys.readouterr().out
    assert "(each of 8 expert-parallel ranks)" in out and "tokens/s over the ranks" in out
    assert "moe_dispatch" in out and "expert-parallel load imbalance" in out
    r = json.loads((tmp_path / "r.json").read_text())
    assert r["ranks"] == 8 and r["tokens_per_s"] == pytest.approx(256 / r["total_time_s"])
    assert main(["map", "--design", "h200", *common, "--json", str(tmp_path / "m.json")]) == 0
    out = capsys.readouterr().out
    assert "moe_combine" in out and "tokens/s over the ranks" in out
    t = json.loads((tmp_path / "m.json").read_text())["totals"]
    assert t["ranks"] == 8 and t["tokens_per_s"] == pytest.approx(256 / t["latency_s"])
    assert main(["roofline", "--model", "llama-2-7b", "--ep", "2"]) == 2
    assert "needs a mixture-of-experts model" in capsys.readouterr().err


def test_with_grouped_kv_heads_data_parallel_attention_gains_little():
    """GLM-4.5 (8 KV heads): under TP 8 each rank holds one KV head's cache, nothing read twice, so EP 8 with its
    replicated attention weights lands within 2 % of TP 8 at the same global batch; the latent cache of DeepSeek's
    MLA, replicated on every TP rank, is what made EP win by ~19 % (the test above)."""
    kw = dict(weight_format="fp8_e4m3", kv_format="fp8", act_dtype="fp8_e4m3")
    tp = roofline(build_step_graph("glm-4.5", "decode", 256, 4096, tp=8, **kw), H200)
    ep = roofline(build_step_graph("glm-4.5", "decode", 32, 4096, ep=8, **kw), H200)
    assert ep.total_time_s / tp.total_time_s == pytest.approx(1.0, abs=0.02)
