"""A model's sibling projections as one GEMM (`merge.merge_projections_`, run by `fuse_layers_`): one GEMM a group
in every forward, the unmerged model's tokens, its state dict (save and reload through the quantizer, load into a
merged model), the modules back on unfuse, the kept outputs never stale, and what is not merged says why."""

from __future__ import annotations

import pytest
import torch
from hf_testing import prompts, saved_tiny_model, tiny_model
from torch import nn
from transformers import AutoModelForCausalLM

from codesign.backend import use_backend
from codesign.integrations.hf import CodesignQuantConfig, fuse_layers_, run_generate, unfuse_layers_
from codesign.integrations.hf import _kernels as K
from codesign.integrations.hf.merge import MergedProjections, ProjectionSlice, merge_projections_
from codesign.specs import CodesignError

GREEDY = dict(do_sample=False, pad_token_id=0, eos_token_id=None)
CONFIGS = {"unquantized": None, "w4a16": K.W4A16Config(group_size=32, symmetric=False), "w8a8": K.W8A8Config()}
NOT_HEAD = lambda m, fqn: "lm_head" not in fqn  # noqa: E731


def _model(name: str, family: str = "llama", seed: int = 0):
    model = tiny_model(family, seed=seed)
    if CONFIGS[name] is not None:
        K.quantize_(model, CONFIGS[name], NOT_HEAD)
    return model


class _Calls:
    """Forward calls of every linear (nn.Linear, QuantLinear) in a model, by module name."""

    def __init__(self, model) -> None:
        self.names: list[str] = []
        self.handles = [m.register_forward_hook(lambda m, a, o, n=n: self.names.append(n))
                        for n, m in model.named_modules() if isinstance(m, nn.Linear | K.QuantLinear)]  # fmt: skip

    def close(self) -> list[str]:
        for h in self.handles:
            h.remove()
        return self.names


@pytest.mark.parametrize("name", list(CONFIGS))
def test_one_gemm_a_group_and_the_unmerged_tokens(name):
    """Per layer 4 GEMMs where there were 7 (q / k / v one, gate / up one), in prefill and decode, eager and in a
    captured step (the tape); the tokens and logits of the unmerged model."""
    model = _model(name)
    ids, mask = prompts(2, 7, pads=(0, 2))
    kw = dict(attention_mask=mask, block_size=4, max_new_tokens=5, **GREEDY)
    calls = _Calls(model)
    want = run_generate(model, ids, None, **kw).sequences
    before = calls.close()
    with torch.no_grad():
        logits = model(ids).logits
    report = fuse_layers_(model)
    assert len(report.merged) == 4 and not report.unmerged, report.summary()
    assert "merged 4 projection groups" in report.summary()
    calls = _Calls(model)
    got = run_generate(model, ids, None, **kw).sequences
    after = calls.close()
    assert torch.equal(got, want)
    layers, forwards = model.config.num_hidden_layers, 5  # (a prefill and 4 decode steps)
    assert len(before) == (7 * layers + 1) * forwards and len(after) == (4 * layers + 1) * forwards
    assert sum(".merged_q_k_v." in n for n in after) == layers * forwards
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, logits, rtol=1e-5, atol=1e-5)
    tape = run_generate(model, ids, "int8", cuda_graph="tape", **kw).sequences
    assert torch.equal(tape, run_generate(model, ids, "int8", **kw).sequences)
    unfuse_layers_(model)


def test_through_the_triton_kernels():
    """W4A16 merged GEMMs in the interpreter inside generation: the unmerged model's logits to fp32 rounding."""
    model = _model("w4a16")
    ids, _ = prompts(1, 5)
    with torch.no_grad(), use_backend("triton", op="w4a16_gemm"):
        want = model(ids).logits
        fuse_layers_(model)
        got = model(ids).logits
    unfuse_layers_(model)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name", ["unquantized", "w4a16", "w8a8"])
def test_the_state_dict_keeps_the_projections(name):
    """A merged model's state dict is the unmerged one's (names, dtypes, bits); a merged model loads an unmerged
    state dict into its merged tensors; unfuse gives the projection modules (the same objects) their tensors."""
    model = _model(name)
    want = model.state_dict()
    projections = {n: m for n, m in model.named_modules() if n.endswith(("_proj",))}
    fuse_layers_(model)
    got = model.state_dict()
    assert sorted(got) == sorted(want)
    for k, t in want.items():
        assert got[k].dtype == t.dtype and torch.equal(got[k], t), k
    other = _model(name, seed=1)
    ids, _ = prompts(2, 6)
    with torch.no_grad():
        other_logits = other(ids).logits
        missing, unexpected = model.load_state_dict(other.state_dict())
        assert not missing and not unexpected
        torch.testing.assert_close(model(ids).logits, other_logits, rtol=1e-5, atol=1e-5)
    unfuse_layers_(model)
    assert not [m for m in model.modules() if isinstance(m, MergedProjections | ProjectionSlice)]
    assert {n: m for n, m in model.named_modules() if n.endswith("_proj")} == projections
    for k, t in other.state_dict().items():
        assert torch.equal(model.state_dict()[k], t), k


def test_save_and_reload_a_merged_quantized_model(tmp_path_factory, tmp_path):
    """save_pretrained of a fused model loaded through the quantizer writes the unmerged checkpoint: it reloads
    with the same module types and logits."""
    base = saved_tiny_model(tmp_path_factory, "llama", "base")
    q = AutoModelForCausalLM.from_pretrained(base, quantization_config=CodesignQuantConfig("w4a16", group_size=32))
    ids, _ = prompts(2, 6)
    with torch.no_grad():
        want = q(ids).logits
    fuse_layers_(q)
    q.save_pretrained(tmp_path / "q")
    r = AutoModelForCausalLM.from_pretrained(tmp_path / "q")
    assert sum(isinstance(m, K.QuantLinear) for m in r.modules()) == 2 * 7
    assert set(r.config.quantization_config.layers) == set(q.config.quantization_config.layers)
    with torch.no_grad():
        assert torch.equal(r(ids).logits, want)
    unfuse_layers_(q)


def test_kept_outputs_are_never_stale():
    """A sibling called on another tensor computes it; any order of the siblings; a taken output is computed again;
    the parent's forward starts clean: an output kept from before the input changed in place is not used."""
    model = _model("w4a16")
    att = model.model.layers[0].self_attn
    fuse_layers_(model)
    x, y = torch.randn(1, 3, 64), torch.randn(1, 3, 64)
    pe = (torch.ones(1, 3, 16), torch.zeros(1, 3, 16))  # (cos, sin: no rotation)
    with torch.no_grad():
        full = att.merged_q_k_v(x)
        q = att.q_proj(x)
        assert torch.equal(att.k_proj(y), att.merged_q_k_v(y)[1])  # another tensor: its own GEMM
        assert torch.equal(att.v_proj(x), full[2]) and torch.equal(q, full[0])
        assert torch.equal(att.v_proj(x), full[2])  # (taken already: computed again)
        att.k_proj(x)  # keeps x's q and v
        x.mul_(2)
        first = att(hidden_states=x, position_embeddings=pe, attention_mask=None)[0]
        assert att.merged_q_k_v._pending is None
        second = att(hidden_states=x, position_embeddings=pe, attention_mask=None)[0]
        assert torch.equal(first, second)
    unfuse_layers_(model)


def test_what_is_not_merged_says_why():
    """Different formats in a group, a per-tensor FP8 scale each, lossless BF16 layers and a hooked projection
    keep their modules; the report names each group and the reason; merge is a bool."""
    model = tiny_model("llama")
    K.quantize_(model, K.W4A16Config(group_size=32), lambda m, fqn: fqn.endswith(("q_proj", "gate_proj")))
    K.quantize_(model, K.W8A16Config(), lambda m, fqn: fqn.endswith(("k_proj", "v_proj", "up_proj")))
    report = fuse_layers_(model)
    assert not report.merged and len(report.unmerged) == 4
    assert "model.layers.0.self_attn (q_proj, k_proj, v_proj: dtype_name: ['int4', 'int8'])" in report.unmerged
    unfuse_layers_(model)

    fp8 = tiny_model("llama")
    K.quantize_(fp8, K.FP8Config(per_tensor=True), NOT_HEAD)
    merged, kept = merge_projections_(fp8)
    assert not merged and all("scales: one tensor for the merged GEMM, but not equal" in k for k in kept)

    df11 = tiny_model("llama").to(torch.bfloat16)
    K.compress_model_(df11, NOT_HEAD)
    merged, kept = merge_projections_(df11)
    assert not merged and all("LosslessBF16Linear" in k for k in kept)

    hooked = tiny_model("llama")
    hooked.model.layers[1].mlp.up_proj.register_forward_hook(lambda *a: None)
    merged, kept = merge_projections_(hooked)
    assert len(merged) == 3 and kept == ["model.layers.1.mlp (gate_proj, up_proj: a projection's forward is wrapped "
                                         "or hooked)"]  # fmt: skip
    with pytest.raises(CodesignError, match="merge must be True or False"):
        fuse_layers_(tiny_model("llama"), merge="yes")
    assert not fuse_layers_(tiny_model("llama"), merge=False).merged


def test_a_module_with_both_groups_merges_and_unmerges_both():
    """One parent holding q / k / v and gate / up (a parallel block): two merged GEMMs, each undone."""
    from codesign.integrations.hf.merge import unmerge_projections_

    block = nn.Module()
    for n, out in (("q_proj", 32), ("k_proj", 16), ("v_proj", 16), ("gate_proj", 48), ("up_proj", 48)):
        setattr(block, n, nn.Linear(24, out))
    want = {k: t.clone() for k, t in block.state_dict().items()}
    x = torch.randn(2, 24)
    with torch.no_grad():
        ref = [getattr(block, n)(x) for n in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")]
        merged, kept = merge_projections_(block)
        assert merged == [": q_proj, k_proj, v_proj", ": gate_proj, up_proj"] and not kept
        got = [getattr(block, n)(x) for n in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")]
    assert all(torch.allclose(g, r, rtol=1e-6, atol=1e-6) for g, r in zip(got, ref))
    unmerge_projections_(block)
    assert sorted(n for n, _ in block.named_children()) == ["gate_proj", "k_proj", "q_proj", "up_proj", "v_proj"]
    assert "_codesign_merge_hooks" not in vars(block) and not block._forward_pre_hooks
    assert all(torch.equal(block.state_dict()[k], t) for k, t in want.items())


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["w4a16", "w8a8"])
def test_merged_quantized_decoding_on_a_gpu(name):
    """bf16 on a GPU (compiled kernels; the merged GEMV / split-K splits K by its own N): a captured step's tokens
    the unmerged model's where their lead is decisive, and one GEMM a group."""
    from hf_testing import assert_same_greedy_where_decisive, greedy

    model = tiny_model("llama").to("cuda", torch.bfloat16)
    K.quantize_(model, CONFIGS[name], NOT_HEAD)
    ids, mask = prompts(2, 7, pads=(0, 2))
    kw = dict(attention_mask=mask.cuda(), block_size=4, max_new_tokens=8, **GREEDY)
    model.set_attn_implementation("sdpa")
    want = greedy(model, ids.cuda(), mask.cuda(), 8)
    report = fuse_layers_(model)
    assert len(report.merged) == 4
    got = run_generate(model, ids.cuda(), None, cuda_graph=True, **kw).sequences
    assert_same_greedy_where_decisive(got, want, ids.shape[1], decisive=5e-2)
    unfuse_layers_(model)
