"""quant_method="codesign": quantize on load, save_pretrained, reload pre-quantized (same module types and
buffers, the same greedy tokens, the same logits bit for bit); lossless BF16 equal to the bf16 model; GPTQ
and AWQ tensors through the importers into a codesign checkpoint; quantized weights inside generate()."""

from __future__ import annotations

import json

import pytest
import torch
from hf_testing import assert_same_greedy_where_decisive, greedy, prompts, saved_tiny_model, tiny_model
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from codesign.integrations.hf import (
    CodesignQuantConfig,
    _compat,
    from_quantized_checkpoint,
    generate,
    load_gptq_awq,
)
from codesign.integrations.hf import _kernels as K
from codesign.kernels.gemm.formats import pack_int8_codes
from codesign.specs import CodesignError

FORMATS = {
    "w4a16": dict(group_size=32, symmetric=False),
    "w8a16": dict(group_size=None),
    "w8a8": {},
    "fp8": {},
    "lossless-bf16": {},
}


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory):
    return saved_tiny_model(tmp_path_factory, "llama", "base")


def _greedy(model, ids):
    return model.generate(ids, max_new_tokens=5, do_sample=False, pad_token_id=0, eos_token_id=None)


def _linears(model):
    return {n: (type(m).__name__, {b: (t.dtype, tuple(t.shape)) for b, t in m.named_buffers()})
            for n, m in model.named_modules() if K.is_codesign_linear(m)}  # fmt: skip


@pytest.mark.parametrize("weights", list(FORMATS))
def test_quantize_on_load_save_and_reload(weights, base_dir, tmp_path):
    dtype = torch.bfloat16 if weights == "lossless-bf16" else None
    cfg = CodesignQuantConfig(weights, **FORMATS[weights])
    q = AutoModelForCausalLM.from_pretrained(base_dir, quantization_config=cfg, dtype=dtype)
    assert len(_linears(q)) == 2 * 7 and type(q.lm_head) is torch.nn.Linear  # lm_head stays float
    ids, _ = prompts(2, 8)
    q.save_pretrained(tmp_path / weights)
    r = AutoModelForCausalLM.from_pretrained(tmp_path / weights)
    assert r.config.quantization_config.quant_method == "codesign"
    assert _linears(r) == _linears(q)
    with torch.no_grad():
        assert torch.equal(r(ids).logits, q(ids).logits)
    assert torch.equal(_greedy(r, ids), _greedy(q, ids))
    if weights == "lossless-bf16":
        plain = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.bfloat16)
        with torch.no_grad():
            assert torch.equal(r(ids).logits, plain(ids).logits)


def test_a_w8a8_checkpoint_saved_with_packed_words_still_loads(base_dir, tmp_path):
    """Before W8A8 kept signed [N, K] codes, its checkpoints held the packed int32 words [K / 4, N] and no
    "w8a8_codes" in the recorded layouts: they load (converted), and save again in the new layout."""
    q = AutoModelForCausalLM.from_pretrained(base_dir, quantization_config=CodesignQuantConfig("w8a8"))
    q.save_pretrained(tmp_path / "old")
    state = load_file(tmp_path / "old" / "model.safetensors")
    state = {k: pack_int8_codes(v.t()) if k.endswith(".qweight") else v for k, v in state.items()}
    save_file(state, tmp_path / "old" / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((tmp_path / "old" / "config.json").read_text())
    for layout in config["quantization_config"]["layers"].values():
        assert layout.pop("w8a8_codes") == "signed"
    (tmp_path / "old" / "config.json").write_text(json.dumps(config))
    ids, _ = prompts(2, 8)
    r = AutoModelForCausalLM.from_pretrained(tmp_path / "old")
    assert _linears(r) == _linears(q)  # int8 [N, K] again
    r.save_pretrained(tmp_path / "again")
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "again")
    with torch.no_grad():
        assert torch.equal(r(ids).logits, q(ids).logits) and torch.equal(again(ids).logits, q(ids).logits)


@pytest.mark.skipif(not _compat.CASTS_CHECKPOINT, reason="5.x keeps a checkpoint's dtypes")
def test_a_load_cast_that_loses_bits_is_refused(base_dir, tmp_path):
    """transformers 4.57 casts a quantized checkpoint's floating tensors to the load dtype: fp16 scales through
    float32 come back exactly (the test above), through bfloat16 they would not."""
    q = AutoModelForCausalLM.from_pretrained(
        base_dir, quantization_config=CodesignQuantConfig("w8a16", group_size=None)
    )
    assert {t.dtype for n, t in q.named_buffers() if n.endswith(".scales")} == {torch.float16}
    q.save_pretrained(tmp_path / "w8a16")
    with pytest.raises(CodesignError, match="float16 scales to dtype=torch.bfloat16, which loses bits"):
        AutoModelForCausalLM.from_pretrained(tmp_path / "w8a16", dtype=torch.bfloat16)


def test_quantized_weights_compose_with_generate(base_dir):
    """W4A16 linears (loaded through the quantizer, or quantize_'d) under codesign_paged attention: the
    quantized model's own greedy tokens under sdpa."""
    q = AutoModelForCausalLM.from_pretrained(
        base_dir, quantization_config=CodesignQuantConfig("w4a16", group_size=32)
    )
    ids, _ = prompts(2, 8)
    want = greedy(q, ids, None, 5)
    got = generate(q, ids, max_new_tokens=5, do_sample=False, pad_token_id=0, eos_token_id=None)
    assert_same_greedy_where_decisive(got, want, ids.shape[1])
    m = K.quantize_(tiny_model("llama"), K.W8A16Config(), lambda m, fqn: "lm_head" not in fqn)
    want = greedy(m, ids, None, 5)
    got = generate(m, ids, max_new_tokens=5, do_sample=False, pad_token_id=0, eos_token_id=None)
    assert_same_greedy_where_decisive(got, want, ids.shape[1])


def _pack_along_n(x: torch.Tensor, bits: int, order=None) -> torch.Tensor:
    """int [R, N] -> int32 [R, N * bits / 32]: field j of word i holds column i * P + order[j]."""
    p = 32 // bits
    order = list(range(p)) if order is None else order
    words = torch.zeros(x.shape[0], x.shape[1] // p, dtype=torch.int64)
    for j in range(p):
        words |= x[:, order[j] :: p].to(torch.int64) << (bits * j)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


@pytest.mark.parametrize("method", ["gptq", "awq"])
def test_gptq_and_awq_checkpoints_through_the_importers(method, tmp_path):
    """Each linear quantized round-to-nearest (int4, group 32, asymmetric) and written in the checkpoint's own
    layout (a checkpoint folder, config.json naming the method): logits bit-identical to quantize_ with that
    config; saved and reloaded as a codesign checkpoint."""
    from safetensors.torch import save_file

    native = K.quantize_(tiny_model("llama"), K.W4A16Config(group_size=32, symmetric=False),
                         lambda m, fqn: "lm_head" not in fqn)  # fmt: skip
    state = {k: v for k, v in tiny_model("llama").state_dict().items() if "_proj." not in k}
    for fqn, m in native.named_modules():
        if isinstance(m, K.QuantLinear):
            w = m.quantized_weight()
            c, z = K.unpack_weight_codes(w.qweight, 4), w.zeros.to(torch.int64)  # [K, N], [G, N]
            if method == "gptq":
                state[f"{fqn}.qweight"] = w.qweight
                state[f"{fqn}.qzeros"] = _pack_along_n(z - 1, 4)  # v1 checkpoints store zero - 1
                state[f"{fqn}.g_idx"] = (torch.arange(w.K) // 32).to(torch.int32)
            else:
                order = [0, 2, 4, 6, 1, 3, 5, 7]
                state[f"{fqn}.qweight"] = _pack_along_n(c, 4, order)
                state[f"{fqn}.qzeros"] = _pack_along_n(z, 4, order)
            state[f"{fqn}.scales"] = w.scales
    folder = tmp_path / f"{method}-ckpt"
    cfg = tiny_model("llama").config
    cfg.quantization_config = {"quant_method": method, "bits": 4, "group_size": 32, "sym": False,
                               **({"version": "gemm"} if method == "awq" else {"desc_act": False})}  # fmt: skip
    cfg.save_pretrained(folder)
    save_file({k: v.contiguous() for k, v in state.items()}, folder / "model.safetensors")
    model = load_gptq_awq(folder)
    ids, _ = prompts(2, 8)
    with torch.no_grad():
        assert torch.equal(model(ids).logits, native(ids).logits)
    model.save_pretrained(tmp_path / method)
    r = AutoModelForCausalLM.from_pretrained(tmp_path / method)
    assert _linears(r) == _linears(model)
    assert torch.equal(_greedy(r, ids), _greedy(model, ids))


def test_bad_quantization_configs():
    with pytest.raises(CodesignError, match="unknown codesign weight format 'w3a16'"):
        CodesignQuantConfig("w3a16")
    with pytest.raises(CodesignError, match="no '<layer>.qweight' tensors"):
        from_quantized_checkpoint(tiny_model("llama"), {}, "gptq")
