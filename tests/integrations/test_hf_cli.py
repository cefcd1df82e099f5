"""`codesign generate` on a random-weight model folder: exit 0, the per-step table, a prediction for every step
with --design, the JSON record; bad input exits 2 with a clear message. Plus the GPU-suite hook at a tiny shape."""

from __future__ import annotations

import json

import pytest
import torch
from hf_testing import saved_tiny_model, tiny_model

from codesign.cli import main
from codesign.integrations.hf import _compat
from codesign.integrations.hf import _kernels as K
from codesign.integrations.hf.bench import VARIANTS, bench_decode
from codesign.integrations.hf.models import hf_config
from codesign.specs import CodesignError


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return saved_tiny_model(tmp_path_factory, "llama", "tiny-llama")


def _table(out: str) -> list[list[str]]:
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.split()[:2] == ["step", "kind"])
    return [line.split() for line in lines[start + 1 :] if line.strip()[:1].isdigit()]


def test_generate_with_a_design_predicts_every_step(folder, capsys, tmp_path):
    out_json = tmp_path / "run.json"
    rc = main(["generate", str(folder), "--max-new-tokens", "4", "--batch", "2", "--kv-format", "int8",
               "--design", "tpu_like", "--json", str(out_json)])  # fmt: skip
    out = capsys.readouterr().out
    assert rc == 0
    rows = _table(out)
    assert [r[1] for r in rows] == ["prefill", "decode", "decode", "decode"]
    assert all(len(r) == 7 and float(r[5]) > 0 and float(r[6]) > 0 for r in rows)  # measured, predicted ms
    assert "predicted on tpu_like" in out and "tokens/s" in out
    rec = json.loads(out_json.read_text())
    assert [s["context_lens"] for s in rec["steps"]] == [[16, 16], [17, 17], [18, 18], [19, 19]]
    assert all(s["predicted_s"] > 0 for s in rec["steps"])


def test_generate_speculative_and_quantized_weights(folder, capsys):
    rc = main(["generate", str(folder), "--max-new-tokens", "5", "--prompt-ids", "5,6,7,8,5,6,7,8",
               "--speculative", "ngram", "--weights", "w8a16", "--group-size", "32", "--design", "h200"])  # fmt: skip
    out = capsys.readouterr().out
    assert rc == 0
    kinds = [r[1] for r in _table(out)]
    assert kinds[0] == "prefill" and set(kinds[1:]) == {"tree"}
    assert "tokens accepted a step" in out


def test_generate_fused_prints_what_it_fused(folder, capsys):
    """--fuse: the same tokens as without (the torch paths are the modules' arithmetic), and the report line."""
    outs = []
    for extra in ([], ["--fuse"]):
        assert main(["generate", str(folder), "--max-new-tokens", "4", *extra]) == 0
        outs.append(capsys.readouterr().out)
    token = [next(line for line in out.splitlines() if line.startswith("tokens:")) for out in outs]
    assert token[0] == token[1]
    assert ("fused 5 RMSNorms, 2 gated MLPs, the residual add and norm of 2 decoder layers (2 with the next norm), "
            "rotary embedding in modeling_llama; merged 4 projection groups") in outs[1]


def test_generate_compiled(folder, capsys, monkeypatch):
    """--compile: the same tokens as without, every decode step through one compiled forward (a backend that records
    the graph and runs it as traced stands in for Inductor, which takes seconds on a CPU)."""
    from codesign.integrations.hf import graphs

    seen = []
    monkeypatch.setitem(graphs.COMPILE_DEFAULTS, "backend", lambda gm, inputs: seen.append(gm) or gm.forward)
    outs = []
    for extra in ([], ["--compile"]):
        assert main(["generate", str(folder), "--max-new-tokens", "4", "--kv-format", "int8", *extra]) == 0
        outs.append(capsys.readouterr().out)
    token = [next(line for line in out.splitlines() if line.startswith("tokens:")) for out in outs]
    assert token[0] == token[1] and len(seen) == 1
    assert len(_table(outs[1])) == 4
    seen.clear()
    outs = []
    for extra in ([], ["--compile"]):  # tree speculation: its tree forwards compiled
        args = ["--max-new-tokens", "8", "--kv-format", "int8", "--speculative", "ngram", *extra]
        assert main(["generate", str(folder), *args]) == 0
        outs.append(capsys.readouterr().out)
    token = [next(line for line in out.splitlines() if line.startswith("tokens:")) for out in outs]
    assert token[0] == token[1] and len(seen) == 1


def test_random_weights_are_seeded(folder, capsys):
    runs = []
    for _ in range(2):
        assert main(["generate", str(folder), "--random-weights", "--seed", "5", "--max-new-tokens", "6"]) == 0
        runs.append(next(line for line in capsys.readouterr().out.splitlines() if line.startswith("tokens:")))
    assert runs[0] == runs[1]


@pytest.mark.parametrize("args, message", [
    (["--kv-format", "int5"], "unknown kv_format 'int5'"),
    (["--design", "no-such-design"], "is neither a GPU"),
    (["--weights", "w3a16"], "unknown codesign weight format 'w3a16'"),
    (["--prompt", "hello"], "--prompt needs a tokenizer"),
    (["--cuda-graph", "--device", "cpu"], "cuda_graph=True needs a model on a CUDA device"),
    (["--cuda-graph", "--kv-format", "int4-kivi", "--speculative", "ngram"], "tree forwards cannot be captured"),
    (["--compile", "--kv-format", "int4-kivi", "--speculative", "ngram"], "cannot be captured or compiled"),
])  # fmt: skip
def test_bad_options_exit_2(folder, capsys, args, message):
    assert main(["generate", str(folder), "--max-new-tokens", "2", *args]) == 2
    assert message in capsys.readouterr().err


def test_bad_models_exit_2(tmp_path, capsys):
    assert main(["generate", str(tmp_path / "missing")]) == 2
    assert "neither a folder with a config.json nor a catalogue model" in capsys.readouterr().err
    from transformers import GPT2Config

    GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64).save_pretrained(tmp_path / "gpt2")
    assert main(["generate", str(tmp_path / "gpt2"), "--random-weights"]) == 2
    assert "model family 'gpt2' is not supported" in capsys.readouterr().err
    assert main(["generate", "opt-6.7b"]) == 2  # learned positions, LayerNorm
    assert "not served" in capsys.readouterr().err
    # broken config.json files: a one-line refusal, not transformers' or our tracebacks
    good = json.loads((tmp_path / "gpt2" / "config.json").read_text()) | {"model_type": "llama"}
    broken = {"badjson": "{not json", "alist": "[1, 2]", "unknown": json.dumps({"model_type": "frobnicator"}),
              "neglayers": json.dumps(good | {"num_hidden_layers": -1}),
              "zeroheads": json.dumps(good | {"num_attention_heads": 0})}  # fmt: skip
    for name, text in broken.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(text)
        assert main(["generate", str(tmp_path / name), "--random-weights"]) == 2, name
        err = capsys.readouterr().err
        last = err.strip().splitlines()[-1]  # (transformers may log warnings before it)
        assert "Traceback" not in err and last.startswith("codesign generate: error: ") and "config.json" in last


@pytest.mark.parametrize("args, message", [
    (["--block-size", "0"], "--block-size must be >= 1"),
    (["--layers", "1"], "--layers keeps a catalogue model's first layers"),
    (["--device", "tpu"], "--device must be cpu, cuda or cuda:N"),
    (["--device", "cuda:9"], "CUDA devices"),
    (["--max-new-tokens", "100000"], "max_position_embeddings"),
    (["--speculative", "frob"], "--speculative: model 'frob'"),
    (["--group-size", "64"], "--group-size applies to --weights w4a16 or w8a16"),
    (["--weights", "w8a8", "--group-size", "64"], "--group-size applies to"),
    (["--tree-width", "4"], "--tree-width applies to --speculative"),
    (["--prompt-ids", "1,2", "--prompt-len", "5"], "--prompt-len applies to a random prompt"),
])  # fmt: skip
def test_bad_generate_options_exit_2(folder, capsys, args, message):
    """Each was taken silently (a block size or layer count of 0 as the default, --layers on a folder, a group size
    without grouped weights, a tree without speculation, a prompt length beside given ids: ignored), or raised from
    inside torch (a device, a pool sized for 100k tokens), or named no option."""
    assert main(["generate", str(folder), *args]) == 2
    assert message in capsys.readouterr().err


def test_catalogue_models_become_transformers_configs(tmp_path):
    from codesign.catalog.models import load_model

    cfg = hf_config(load_model("llama-3-8b"), layers=2)
    assert (cfg.model_type, cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.vocab_size) == (
        "llama",
        2,
        8,
        128256,
    )
    assert hf_config(load_model("mistral-7b")).model_type == "mistral"
    moe = hf_config(load_model("mixtral-8x7b"), layers=1)
    assert (moe.model_type, moe.num_local_experts, moe.num_experts_per_tok, moe.intermediate_size) == (
        "mixtral", 8, 2, 14336)  # fmt: skip
    qm = hf_config(load_model("qwen1.5-moe-a2.7b"))
    assert (qm.model_type, qm.num_experts, qm.num_experts_per_tok, qm.moe_intermediate_size) == (
        "qwen2_moe", 60, 4, 1408)  # fmt: skip
    assert (qm.shared_expert_intermediate_size, qm.norm_topk_prob, qm.decoder_sparse_step, qm.mlp_only_layers) == (
        5632, False, 1, [])  # fmt: skip
    oss = hf_config(load_model("gpt-oss-20b"), layers=3)
    assert (oss.model_type, oss.num_local_experts, oss.num_experts_per_tok, oss.sliding_window, oss.layer_types) == (
        "gpt_oss", 32, 4, 128, ["sliding_attention", "full_attention", "sliding_attention"])  # fmt: skip
    # and back: the catalogue's view of that config is the entry's (the mapper costs what was built)
    import dataclasses
    import json

    from codesign.catalog.models import load_hf_config

    path = tmp_path / "config.json"
    path.write_text(json.dumps(oss.to_dict()))
    back, want = load_hf_config(path), dataclasses.replace(load_model("gpt-oss-20b"), layers=3,
                                                            full_attention_layers=(1,))  # fmt: skip
    assert back.linear_shapes() == want.linear_shapes()
    assert [back.window_of(i) for i in range(3)] == [want.window_of(i) for i in range(3)] == [128, None, 128]
    assert (back.experts, back.top_k, back.qkv_bias, back.o_bias, back.mlp_bias) == (32, 4, True, True, True)
    # GLM-4.5: leading dense blocks, routed and shared experts, q/k/v biases; read back as the entry
    glm = hf_config(load_model("glm-4.5"))
    assert (glm.model_type, glm.first_k_dense_replace, glm.n_routed_experts, glm.n_shared_experts) == (
        "glm4_moe", 3, 160, 1)  # fmt: skip
    path.write_text(json.dumps(glm.to_dict()))
    back, want = load_hf_config(path), load_model("glm-4.5")
    assert back.linear_shapes() == want.linear_shapes() and back.param_count() == want.param_count()
    assert (back.dense_layers, back.dense_ffn, back.qkv_bias, back.o_bias) == (3, 12288, True, False)
    # Llama 4 Maverick: chunked attention, global layers without RoPE, experts every other layer; read back
    l4 = hf_config(load_model("llama-4-maverick"), layers=8)
    assert (l4.model_type, l4.attention_chunk_size, l4.interleave_moe_layer_step, l4.moe_layers) == (
        "llama4_text", 8192, 2, [1, 3, 5, 7])  # fmt: skip
    assert l4.layer_types == ["chunked_attention"] * 3 + ["full_attention"] + ["chunked_attention"] * 3 + [
        "full_attention"]  # fmt: skip
    path.write_text(json.dumps(l4.to_dict()))
    back, want = load_hf_config(path), dataclasses.replace(load_model("llama-4-maverick"), layers=8,
                                                           full_attention_layers=(3, 7))  # fmt: skip
    assert back.linear_shapes() == want.linear_shapes() and back.param_count() == want.param_count()
    assert [back.chunk_of(i) for i in range(8)] == [8192, 8192, 8192, None] * 2
    # Qwen3-Next: Gated DeltaNet layers, every fourth gated full attention, experts with a gated shared one
    qn = hf_config(load_model("qwen3-next-80b-a3b"), layers=8)
    assert (qn.model_type, qn.num_experts, qn.linear_num_value_heads, qn.layer_types[:4]) == (
        "qwen3_next", 512, 32, ["linear_attention"] * 3 + ["full_attention"])  # fmt: skip
    path.write_text(json.dumps(qn.to_dict()))
    back, want = load_hf_config(path), dataclasses.replace(load_model("qwen3-next-80b-a3b"), layers=8,
                                                           linear_attention_layers=(0, 1, 2, 4, 5, 6))  # fmt: skip
    assert back.linear_shapes() == want.linear_shapes() and back.param_count() == want.param_count()
    assert back.linear_attention_layers == want.linear_attention_layers and back.attention_output_gate
    dense = dataclasses.replace(want, name="dense", experts=0, top_k=0, shared_expert_ffn=0, shared_expert_gate=False,
                                ffn=5632)  # fmt: skip
    assert hf_config(dense).model_type == "qwen3_5_text"
    with pytest.raises(CodesignError, match="state-space layers and MoE blocks by index are served from a model"):
        hf_config(dataclasses.replace(load_model("llama-3-8b"), ssm_layers=(0,), ssm_heads=8, ssm_head_dim=64,
                                      ssm_state=16, ssm_groups=1, ssm_conv_kernel=4))  # fmt: skip
    with pytest.raises(CodesignError, match="gated attention outputs are served beside linear attention"):
        hf_config(dataclasses.replace(load_model("llama-3-8b"), attention_output_gate=True))


@pytest.mark.skipif(_compat.VERSION < (5, 0), reason="transformers 4.x keeps experts as nn.Linear MLPs")
def test_a_mixture_of_experts_is_costed_with_its_experts_and_refused_half_quantized():
    """The mapper sees a Mixtral's experts (all resident, top-k active). `quantize_model_` converts the experts
    with the linears, and the model is costed in their format; `quantize_` alone (linears only) or lossless BF16
    (which leaves the experts) keeps float stacked expert tensors, which one weight format would undercount:
    refused by name."""
    from codesign.integrations.hf.costing import model_config, run_shape
    from codesign.integrations.hf.experts import quantize_model_
    from codesign.integrations.hf.kv_formats import parse_kv_format
    from codesign.specs import CodesignError

    model = tiny_model("mixtral")
    mc = model_config(model)
    assert (mc.experts, mc.top_k) == (model.config.num_local_experts, model.config.num_experts_per_tok)
    kv = parse_kv_format("bf16", torch.float32)
    run_shape(model, kv, 16)
    K.quantize_(model, K.W4A16Config(group_size=32))
    with pytest.raises(CodesignError, match="stacked expert weights"):
        run_shape(model, kv, 16)
    quantize_model_(model, K.W4A16Config(group_size=32))  # the experts now (the linears are done)
    w = run_shape(model, kv, 16).weights
    assert (w.dtype, w.group_size) == ("int4", 32)
    bf16 = quantize_model_(tiny_model("mixtral").to(torch.bfloat16), K.LosslessBF16Config())
    with pytest.raises(CodesignError, match="stacked expert weights"):
        run_shape(bf16, parse_kv_format("bf16", torch.bfloat16), 16)
    mixed = quantize_model_(K.quantize_(tiny_model("mixtral"), K.W8A16Config()), K.W4A16Config(group_size=32))
    with pytest.raises(CodesignError, match=r"2 formats \(int4/g32/a:fp16, int8/gNone/a:fp16\)"):
        run_shape(mixed, kv, 16)  # experts int4, linears int8: no one format


def test_each_recorded_step_is_costed_as_what_it_ran():
    """Decode, extend (prompt-lookup verification) and tree steps become the mapper's decode, extend and tree
    attention over their prefix, with logits for every verified token; more work predicts more time."""
    from codesign.integrations.hf import chain_tree
    from codesign.integrations.hf.cache import StepRecord
    from codesign.integrations.hf.costing import StepCoster, run_shape, step_graph
    from codesign.integrations.hf.kv_formats import parse_kv_format
    from codesign.specs import PagedDecodeAttention, PagedExtendAttention, TreeAttention

    model = tiny_model("llama")
    shape = run_shape(model, parse_kv_format("int4", torch.float32), 16)
    parents = tuple(chain_tree(2, 3))
    steps = {"decode": StepRecord("decode", (1, 1), (20, 30)), "extend": StepRecord("extend", (4,), (24,)),
             "tree": StepRecord("tree", (7, 7), (27, 37), parents)}  # fmt: skip
    specs = {k: step_graph(shape, s).nodes["L1.attention"]["spec"] for k, s in steps.items()}
    assert isinstance(specs["decode"], PagedDecodeAttention) and specs["decode"].context_lens == (20, 30)
    assert isinstance(specs["extend"], PagedExtendAttention) and specs["extend"].prefix_lens == (20,)
    tree = specs["tree"]
    assert isinstance(tree, TreeAttention) and (tree.tree_sizes, tree.prefix_lens) == ((7, 7), (20, 30))
    assert tree.ancestor_pairs == (1 + 2 * (2 + 3 + 4),) * 2  # root 1, each chain node depth + 1
    assert step_graph(shape, steps["tree"]).nodes["lm_head"]["spec"].M == 14
    assert shape.kv_format.name == "int4-per_token"
    c = StepCoster("tpu_like", shape)
    assert c.seconds(steps["tree"]) > c.seconds(steps["decode"])


def test_gpu_suite_hook_at_a_tiny_shape():
    model = tiny_model("llama")
    rows = bench_decode(model, batches=(1, 2), prompt_len=6, new_tokens=3, device="cpu", dtype=torch.float32,
                        group_size=32)  # fmt: skip
    assert [(r["variant"], r["batch"]) for r in rows] == [(v[0], b) for v in VARIANTS for b in (1, 2)]
    for r in rows:
        assert r["tokens"] == 3 and r["decode_tokens_per_s"] > 0 and r["predicted_decode_tokens_per_s"] > 0
        assert r["steps"] == 3 if "tree" not in r["variant"] else 2 <= r["steps"] <= 3, r  # a tree step: 1-4 tokens
    assert any(isinstance(m, K.QuantLinear) for m in model.modules())  # the W4A16 variant ran last, in place


@pytest.mark.skipif(_compat.VERSION < (5, 25), reason="GLM-4.5 and AFMoE are served from transformers 5.25")
def test_later_families_generate_and_are_costed(tmp_path_factory, capsys):
    """GLM-4.5 (a dense block, then routed experts with a shared one) runs from its folder with quantized experts
    and is costed on a design; so is AFMoE, whose attention output is gated (`attn_gate` in the step graph)."""
    path = saved_tiny_model(tmp_path_factory, "glm4_moe", "tiny-glm")
    assert main(["generate", str(path), "--max-new-tokens", "3", "--weights", "w8a16", "--group-size", "32",
                 "--kv-format", "int8", "--design", "tpu_like"]) == 0  # fmt: skip
    out = capsys.readouterr().out
    assert "tokens/s" in out and "predicted on tpu_like" in out
    afmoe = saved_tiny_model(tmp_path_factory, "afmoe", "tiny-afmoe")
    assert main(["generate", str(afmoe), "--max-new-tokens", "3", "--design", "tpu_like"]) == 0
    assert "predicted on tpu_like" in capsys.readouterr().out


@pytest.mark.skipif(_compat.VERSION < (5, 25), reason="Llama 4 and Qwen3.5 are served from transformers 5.25")
def test_llama4_and_qwen3_5_folders_generate_and_cost_or_refuse(tmp_path_factory, capsys):
    """A Llama 4 folder (chunked attention: a chunk of 16, the default block) runs and is costed on a design with
    its chunks; a Qwen3.5 folder (linear-attention layers) runs, with --speculative too (tree steps over its Gated
    DeltaNet layers), and --design costs those layers (the recurrence at decode, a state carried into an extend)."""
    llama4 = saved_tiny_model(tmp_path_factory, "llama4_text", "tiny-llama4")
    assert main(["generate", str(llama4), "--max-new-tokens", "6", "--prompt-len", "14", "--kv-format", "int8",
                 "--design", "h100-sxm"]) == 0  # fmt: skip
    out = capsys.readouterr().out
    assert "predicted on h100-sxm" in out and "tokens/s" in out
    qwen = saved_tiny_model(tmp_path_factory, "qwen3_5_text", "tiny-qwen3.5")
    assert main(["generate", str(qwen), "--max-new-tokens", "4", "--kv-format", "fp8"]) == 0
    capsys.readouterr()
    assert main(["generate", str(qwen), "--max-new-tokens", "4", "--design", "tpu_like"]) == 0
    assert "predicted on tpu_like" in capsys.readouterr().out
    assert main(["generate", str(qwen), "--max-new-tokens", "6", "--speculative", "ngram", "--design",
                 "tpu_like"]) == 0  # fmt: skip
    out = capsys.readouterr().out
    assert "tree" in out and "predicted on tpu_like" in out
    from codesign.integrations.hf.cache import StepRecord
    from codesign.integrations.hf.costing import run_shape, step_graph
    from codesign.integrations.hf.kv_formats import parse_kv_format
    from codesign.specs import GatedDeltaRule

    shape = run_shape(tiny_model("qwen3_5_text"), parse_kv_format("bf16", torch.float32), 16)
    rules = {k: step_graph(shape, StepRecord(k, q, c, p)).nodes["L0.gated_delta_rule"]["spec"]
             for k, q, c, p in (("prefill", (5,), (5,), ()), ("decode", (1, 1), (9, 12), ()),
                                ("extend", (3,), (12,), ()), ("tree", (3, 3), (12, 9), (-1, 0, 0)))}  # fmt: skip
    assert all(isinstance(r, GatedDeltaRule) for r in rules.values())
    # (an extend's tokens: the recurrence one at a time, each token's state kept for the rollback; a tree's nodes
    # one chunk a row from its state)
    assert [(r.new_tokens, r.initial_state) for r in rules.values()] == [((5,), False), ((1, 1), True),
                                                                         ((1, 1, 1), True), ((3, 3), True)]  # fmt: skip
