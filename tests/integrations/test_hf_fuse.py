"""A model's per-layer ops on codesign's one-launch kernels (`fuse.fuse_layers_`): what each family fuses, the same
numbers on the torch paths, fewer launches, the Triton kernels inside generation (interpreter), a captured step, and
what stays unfused (a module that computes otherwise; a model not fused)."""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
from hf_testing import (
    REFERENCE_ATTN,
    assert_same_greedy_where_decisive,
    family_missing,
    family_params,
    greedy,
    prompts,
    tiny_model,
)
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

from codesign.backend import use_backend
from codesign.integrations.hf import fuse_layers_, run_generate, unfuse_layers_
from codesign.integrations.hf._compat import VERSION
from codesign.kernels.layers import ops as L
from codesign.specs import CodesignError

GREEDY = dict(do_sample=False, pad_token_id=0, eos_token_id=None)
BODIES = ("rms_norm", "rope", "act_mul", "add_rms_norm")
# family -> (RMSNorms: 2 a layer and the final one, plus per-head q / k norms; gated MLPs a layer)
FUSED = {"llama": (5, 2), "mistral": (5, 2), "qwen2": (5, 2), "qwen3": (9, 2), "olmo2": (9, 2), "granite": (5, 2),
         "gemma2": (9, 2), "gemma3_text": (13, 2), "phi3": (5, 2), "mixtral": (5, 0)}  # fmt: skip
# projection groups merged a layer (q / k / v; gate / up): Phi-3 has both merged already, Mixtral's experts are one
# weight
MERGED = {"phi3": 0, "mixtral": 1}
# decoder layers of another kind than the pre-norm one: OLMo2's (no input norm, the norms after the attention and the
# MLP and before their adds) not candidates; Gemma2's and Gemma3's (four norms a layer) are, as sandwich layers
OTHER_LAYERS = ("olmo2",)
# transformers 4.x: these families' decoder layers return tuples, which our forward does not: their probes keep them;
# Mixtral's layers there name their experts block_sparse_moe (no mlp): not candidates
TUPLE_LAYERS_4X = ("gemma2", "gemma3_text", "granite")
OTHER_LAYERS_4X = ("mixtral",)
# the ops the fused modules ran (HF's RMSNorm and rotary embedding; the activation where the MLPs are fused)
GONE = {"aten.pow.Tensor_Scalar", "aten.mean.dim", "aten.rsqrt.default", "aten.neg.default"}


class _Ops(TorchDispatchMode):
    """The ops a forward launches: each dispatched op, and each layer op's body as one (`codesign.rms_norm` ...: on a
    GPU its Triton kernel; its CPU path runs below the count)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []
        self.saved = {}

    def __enter__(self):
        for name in BODIES:
            body = self.saved[name] = getattr(L, f"_{name}_body")
            setattr(L, f"_{name}_body", self._one(name, body))
        return super().__enter__()

    def __exit__(self, *exc):
        for name, body in self.saved.items():
            setattr(L, f"_{name}_body", body)
        return super().__exit__(*exc)

    def _one(self, name, body):
        def call(*args):
            self.ops.append(f"codesign.{name}")
            with _disable_current_modes():
                return body(*args)

        return call

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def _forward_ops(model, ids) -> tuple[list[str], torch.Tensor]:
    with torch.no_grad(), _Ops() as seen:
        logits = model(ids).logits
    return seen.ops, logits


@pytest.mark.parametrize("family", family_params(list(FUSED)))
def test_fused_families_compute_what_they_computed(family):
    """Each family's norms (Llama's cast-then-weight, Gemma's 1 + weight, per-head q / k norms), rotary embedding
    and gated MLPs (SiLU; Gemma's GELU-tanh; Phi-3's one gate-and-up GEMM) are fused, Mixtral's experts are not
    candidates; on the torch paths the logits are the unfused model's bit for bit, from fewer ops: none of HF's RMSNorm,
    rotary or activation ops remain."""
    model = tiny_model(family)
    ids, _ = prompts(2, 6)
    before, want = _forward_ops(model, ids)
    report = fuse_layers_(model, merge=False)  # (merged GEMMs: test_hf_merge; a BLAS may block a wider N otherwise)
    assert (len(report.rms_norm), len(report.gated_mlp)) == FUSED[family]
    layers = model.config.num_hidden_layers
    v4 = VERSION < (5, 0)
    kept = layers if family in TUPLE_LAYERS_4X and v4 else 0
    other = family in OTHER_LAYERS or (family in OTHER_LAYERS_4X and v4)
    assert len(report.layers) == (0 if other else layers - kept)
    assert len(report.rope) == 1 and len(report.kept) == kept, report.kept
    after, got = _forward_ops(model, ids)
    assert torch.equal(got, want)
    gone = GONE | ({"aten.silu.default", "aten.gelu.default"} & set(before) if FUSED[family][1] else set())
    assert not gone & set(after) and gone <= set(before)
    assert after.count("codesign.rope") == layers
    assert report.linked == report.layers  # (every fused layer's next norm: the next input norm, the final norm)
    assert after.count("codesign.add_rms_norm") == 2 * len(report.layers)
    assert before.count("aten.add.Tensor") - after.count("aten.add.Tensor") >= 2 * len(report.layers)
    assert after.count("codesign.rms_norm") == FUSED[family][0] - 2 * len(report.layers)
    assert fuse_layers_(model) is report  # idempotent
    unfuse_layers_(model)
    again, logits = _forward_ops(model, ids)
    assert torch.equal(logits, want) and sorted(again) == sorted(before)
    merged = fuse_layers_(model).merged  # q / k / v a layer, and gate / up where the MLP has them apart
    assert len(merged) == MERGED.get(family, 2) * model.config.num_hidden_layers, merged
    torch.testing.assert_close(_forward_ops(model, ids)[1], want, rtol=1e-5, atol=1e-5)
    unfuse_layers_(model)


@pytest.mark.parametrize("family", family_params(["gpt_oss"]))
def test_gpt_oss_rotates_with_half_head_angles_through_our_rope(family):
    """GPT-OSS's rotary function takes cos and sin of half the head (each half rotated by one angle: our op with them
    repeated, bit for bit on the torch paths): fused, once a layer, the repeat made once a forward; its norms too, and
    its decoder layers' residual adds with the norms after them, though its MLP returns the router's scores beside
    its output."""
    model = tiny_model(family)
    ids, _ = prompts(2, 6)
    before, want = _forward_ops(model, ids)
    report = fuse_layers_(model, merge=False)
    layers = model.config.num_hidden_layers
    assert report.rope == ["modeling_gpt_oss"] and len(report.rms_norm) == 2 * layers + 1 and not report.kept
    assert report.layers == report.linked == [f"model.layers.{i}" for i in range(layers)]
    after, got = _forward_ops(model, ids)
    assert torch.equal(got, want)
    assert after.count("codesign.rope") == layers and after.count("aten.cat.default") == before.count(
        "aten.cat.default") - 2 * layers + 2  # (HF's q and k cats a layer gone; cos and sin repeated once)
    assert after.count("codesign.add_rms_norm") == 2 * layers and after.count("codesign.rms_norm") == 1
    unfuse_layers_(model)
    assert torch.equal(_forward_ops(model, ids)[1], want)


def test_fused_llama_launches_fewer_ops():
    """Per decoder layer at least 20 fewer ops (fp32: 2 norms of 6 ops, rotary 10, SiLU and product 2, against 4
    launches), counted over a decode step through codesign's cache."""
    model = tiny_model("llama")
    ids, _ = prompts(1, 5)
    counts = []
    for fuse in (False, True):
        if fuse:
            fuse_layers_(model)  # (its probes outside the count)
        with _Ops() as seen:
            run_generate(model, ids, None, block_size=4, max_new_tokens=2, fuse=fuse, **GREEDY)
        counts.append(len(seen.ops))
    assert counts[0] - counts[1] >= 20 * model.config.num_hidden_layers * 2  # (two forwards: prefill, one decode)
    unfuse_layers_(model)


@pytest.mark.parametrize("family", family_params(["llama", "gemma2", "gpt_oss"]))
def test_fused_generation_through_the_triton_kernels(family):
    """The Triton kernels (interpreter) inside generation: greedy tokens the unfused model's where its lead is
    decisive (they round once where the modules round each op), logits within fp32 rounding."""
    model = tiny_model(family)
    ids, mask = prompts(2, 7, pads=(0, 2))
    kw = dict(attention_mask=mask, block_size=4, max_new_tokens=8, **GREEDY)
    model.set_attn_implementation(REFERENCE_ATTN.get(family, "sdpa"))
    want = greedy(model, ids, mask, 8)  # (transformers' own, with its logits: where a lead is decisive)
    with use_backend("triton", op="rms_norm"), use_backend("triton", op="rope"), use_backend("triton", op="silu_mul"), \
            use_backend("triton", op="add_rms_norm"):
        got = run_generate(model, ids, None, fuse=True, **kw).sequences
        logits = model(ids[:, :5]).logits
    unfuse_layers_(model)
    assert_same_greedy_where_decisive(got, want, ids.shape[1])
    torch.testing.assert_close(logits, model(ids[:, :5]).logits, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_captured_decode_of_a_fused_model(backend):
    """The fused ops inside a captured step (the tape; their Triton kernels in the interpreter too, each one recorded
    node): the tokens of eager fused decoding."""
    model = tiny_model("qwen2")
    ids, mask = prompts(2, 7, pads=(0, 3))
    kw = dict(attention_mask=mask, block_size=4, max_new_tokens=8, fuse=True, **GREEDY)
    ops = ("rms_norm", "add_rms_norm", "rope", "silu_mul")
    with contextlib.ExitStack() as stack:
        for op in ops:
            stack.enter_context(use_backend(backend, op=op))
        eager = run_generate(model, ids, "int8", **kw)
        assert torch.equal(run_generate(model, ids, "int8", cuda_graph="tape", **kw).sequences, eager.sequences)
    unfuse_layers_(model)


def test_fused_mlps_with_quantized_projections():
    """The MLP probe runs stand-in linears, so quantized projections (whose GEMV may sum in another order each call
    on a GPU) do not decide it: W4A16 MLPs are fused, and the tokens are the unfused quantized model's."""
    from codesign.integrations.hf import _kernels as K

    model = tiny_model("llama")
    K.quantize_(model, K.W4A16Config(group_size=32), lambda m, fqn: "lm_head" not in fqn)
    ids, _ = prompts(2, 6)
    want = run_generate(model, ids, None, block_size=4, max_new_tokens=6, **GREEDY).sequences
    report = fuse_layers_(model)
    assert len(report.gated_mlp) == 2 and not report.kept
    assert torch.equal(run_generate(model, ids, None, block_size=4, max_new_tokens=6, **GREEDY).sequences, want)
    unfuse_layers_(model)


def test_a_module_that_computes_otherwise_keeps_its_forward():
    """Teeth for the probe: a norm whose forward differs from every mode (here: scaled by 1.001) is kept, and so is a
    module whose forward someone wrapped on the instance (accelerate's offload hooks do)."""
    model = tiny_model("llama")
    norm = model.model.layers[1].input_layernorm

    class ScaledRMSNorm(type(norm)):
        def forward(self, x):
            return super().forward(x) * (1 + 1e-3)

    norm.__class__ = ScaledRMSNorm
    wrapped = model.model.layers[0].mlp
    wrapped.forward = type(wrapped).forward.__get__(wrapped)
    report = fuse_layers_(model)
    assert "model.layers.1.input_layernorm (ScaledRMSNorm)" in report.kept
    assert "model.layers.0.mlp (LlamaMLP: its forward is wrapped)" in report.kept
    assert "model.layers.1.input_layernorm" not in report.rms_norm and len(report.rms_norm) == 4
    assert report.gated_mlp == ["model.layers.1.mlp"]
    unfuse_layers_(model)


def test_decoder_layers_that_compute_otherwise_keep_their_forward():
    """Teeth for the layer probe: a layer whose output differs (scaled by 1.001) and one that passes its attention
    other arguments than its forward's (position_ids dropped) keep their forwards; a layer in training mode is not
    fused, and a fused one put in training mode runs its own forward (dropout, where a layer has it)."""
    model = tiny_model("llama")
    layers = model.model.layers

    class Scaled(type(layers[0])):
        def forward(self, hidden_states, **kw):
            return super().forward(hidden_states, **kw) * (1 + 1e-3)

    class Dropping(type(layers[1])):
        def forward(self, hidden_states, position_ids=None, **kw):
            return super().forward(hidden_states, **kw)

    layers[0].__class__, layers[1].__class__ = Scaled, Dropping
    report = fuse_layers_(model)
    assert not report.layers
    assert {"model.layers.0 (Scaled: its residual add and norm)",
            "model.layers.1 (Dropping: its residual add and norm)"} <= set(report.kept)  # fmt: skip
    unfuse_layers_(model)
    if not family_missing("gemma2") and VERSION >= (5, 0):  # a sandwich layer (Gemma2) that computes otherwise: kept
        gemma = tiny_model("gemma2")
        g0 = gemma.model.layers[0]

        class ScaledSandwich(type(g0)):
            def forward(self, hidden_states, **kw):
                return super().forward(hidden_states, **kw) * (1 + 1e-3)

        g0.__class__ = ScaledSandwich
        assert fuse_layers_(gemma).layers == ["model.layers.1"]
    if not family_missing("granite") and VERSION >= (5, 0):  # Granite scales the residual branch unless by 1
        granite = tiny_model("granite", residual_multiplier=0.25)
        assert not fuse_layers_(granite).layers
        assert fuse_layers_(tiny_model("granite")).layers
    training = tiny_model("llama").train()
    assert not fuse_layers_(training).layers
    fused = tiny_model("llama")
    fuse_layers_(fused)
    layer = fused.model.layers[0]
    seen = []
    own = type(layer).forward
    try:
        type(layer).forward = lambda self, *a, **k: (seen.append(1), own(self, *a, **k))[1]
        fused.train()
        with torch.no_grad():
            fused(prompts(1, 4)[0])
    finally:
        type(layer).forward = own
    assert seen == [1, 1]
    unfuse_layers_(fused)


def test_a_layer_leaves_the_next_norm_its_normed_sum_for_that_sum_only():
    """A fused layer ends in one add_rms_norm with the next norm and returns the sum; that norm returns the normed
    sum only when called on that same tensor unchanged. Teeth: a hook on layer 0 that changes its output in place (the
    version counter moves) or returns a new tensor: the logits are still the unfused model's with the same hook, bit
    for bit; in inference mode (no version counters) the layers add and the norms compute; nothing is left behind."""
    want_model, model = tiny_model("llama"), tiny_model("llama")
    report = fuse_layers_(model, merge=False)
    assert report.linked == ["model.layers.0", "model.layers.1"] and "2 with the next norm" in report.summary()
    ids, _ = prompts(2, 6)
    hooks = {"in place": lambda mod, args, out: out.mul_(1.001), "new": lambda mod, args, out: out * 1.001}
    for kind, hook in hooks.items():
        handles = [m.model.layers[0].register_forward_hook(hook) for m in (want_model, model)]
        for mode in (torch.no_grad, torch.inference_mode):
            with mode():
                want, (ops, got) = want_model(ids).logits, _forward_ops(model, ids)
            assert torch.equal(got, want), (kind, mode)
            linked = mode is torch.no_grad
            assert ops.count("codesign.add_rms_norm") == (4 if linked else 2)
            assert ops.count("codesign.rms_norm") == (2 if linked else 3)  # (layer 1's input norm computes)
        for h in handles:
            h.remove()
    norms = [model.model.layers[1].input_layernorm, model.model.norm]
    assert not any("_codesign_ready" in vars(n) for n in norms)
    twin = copy.deepcopy(model)  # (links to its own norms)
    assert [layer._codesign_next_norm[0] for layer in twin.model.layers] == [twin.model.layers[1].input_layernorm,
                                                                           twin.model.norm]  # fmt: skip
    assert list(twin._codesign_linked_norms) == [twin.model.layers[1].input_layernorm, twin.model.norm]
    with torch.no_grad():
        assert torch.equal(twin(ids).logits, model(ids).logits)
    with torch.no_grad(), use_backend("triton", op="rms_norm"), use_backend("triton", op="add_rms_norm"):
        linked = model(ids).logits  # (the Triton kernels, interpreter: the sum stored, then normed, as unlinked)
        links = [layer.__dict__.pop("_codesign_next_norm") for layer in model.model.layers]
        assert torch.equal(linked, model(ids).logits)
    for layer, link in zip(model.model.layers, links):
        layer._codesign_next_norm = link
    unfuse_layers_(model)
    assert not any("_codesign_next_norm" in vars(layer) for layer in model.model.layers)
    assert torch.equal(model(ids).logits, want_model(ids).logits)


def test_a_compiled_fused_model():
    """torch.compile of a fused model traces one graph, no break, with our layer ops in it (the rotary function
    knows a fused forward is traced without the context variable Dynamo cannot trace; the cross-layer link steps
    aside, Inductor fuses that add and norm itself), computing the eager fused model's logits bit for bit (the graph
    run as traced); an unfused model of the family compiled beside it has none of our ops."""
    import torch._dynamo

    graphs = []

    def record(gm, example_inputs):
        graphs.append([str(n.target) for n in gm.graph.nodes if n.op == "call_function"])
        return gm.forward

    model, plain = tiny_model("llama"), tiny_model("llama", seed=1)
    ids, _ = prompts(2, 6)
    fuse_layers_(model)
    layers = model.config.num_hidden_layers
    with torch.no_grad():
        want = model(ids).logits
        torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()
        got = torch.compile(model, backend=record)(ids).logits
        assert not torch._dynamo.utils.counters["graph_break"], dict(torch._dynamo.utils.counters["graph_break"])
        (ops,) = graphs
        assert ops.count("codesign.rope") == layers and ops.count("codesign.add_rms_norm") == layers
        assert torch.equal(got, want)
        graphs.clear()
        torch.compile(plain, backend=record)(ids)
    assert graphs and not any("codesign" in op for g in graphs for op in g)
    unfuse_layers_(model)


def test_the_rotary_function_serves_fused_models_only():
    """The modeling module's apply_rotary_pos_emb is ours for the process, but an unfused model of the family
    dispatches HF's ops, and a fused one ours."""
    fused, plain = tiny_model("llama"), tiny_model("llama", seed=1)
    fuse_layers_(fused)
    ids, _ = prompts(1, 4)
    assert "codesign.rope" in _forward_ops(fused, ids)[0]
    ops = _forward_ops(plain, ids)[0]
    assert "codesign.rope" not in ops and "aten.neg.default" in ops
    unfuse_layers_(fused)
    assert "codesign.rope" not in _forward_ops(fused, ids)[0]


@pytest.mark.gpu
def test_fused_bf16_generation_on_a_gpu():
    """bf16 on a GPU (the compiled kernels): greedy tokens the unfused model's where its lead is decisive."""
    model = tiny_model("llama").to("cuda", torch.bfloat16)
    ids, mask = prompts(2, 7, pads=(0, 2))
    kw = dict(attention_mask=mask.cuda(), block_size=4, max_new_tokens=8, **GREEDY)
    model.set_attn_implementation("sdpa")
    want = greedy(model, ids.cuda(), mask.cuda(), 8)
    got = run_generate(model, ids.cuda(), None, fuse=True, cuda_graph=True, **kw).sequences
    assert_same_greedy_where_decisive(got, want, ids.shape[1], decisive=5e-2)


def test_bad_input():
    with pytest.raises(CodesignError, match="needs a torch.nn.Module"):
        fuse_layers_("llama")
    with pytest.raises(CodesignError, match="fuse must be True or False"):
        run_generate(tiny_model(), prompts(1, 4)[0], fuse="yes", max_new_tokens=2, **GREEDY)
