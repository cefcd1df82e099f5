"""DeepSeek-V2/V3 (multi-head latent attention) inside transformers' generate on CodesignLatentCache: logits and
greedy tokens as HF's own attention over its latent DynamicCache, through the torch path and the Triton kernels
(interpreter) over scrambled pools; an e4m3 cache against HF over the same codes; padding, beam search (forks,
copy-on-write) and prompt lookup (crop); the pool really read (teeth); `codesign generate` on a DeepSeek folder
(catalogue models as configs); the refusals."""

from __future__ import annotations

import pytest
import torch
import transformers
from hf_testing import (
    DECISIVE_QUANT,
    NO_EOS,
    assert_same_greedy_where_decisive,
    greedy,
    prompts,
    scramble_pool,
)
from transformers import DynamicCache

from codesign.backend import use_backend
from codesign.cli import main
from codesign.integrations.hf import ATTN_NAME, CodesignCache, _compat, generate, run_generate
from codesign.integrations.hf import _kernels as K
from codesign.integrations.hf.latent import SINCE, CodesignLatentCache
from codesign.specs import CodesignError

pytestmark = [
    pytest.mark.numerics,  # HF's sdpa decides the reference tokens: rerun under AVX2 (Makefile)
    pytest.mark.skipif(_compat.VERSION < SINCE, reason=f"MLA is served from transformers {SINCE}"),
]

NEW = 8
# Latent 32 + rotary 16 (powers of two: the Triton kernel's), 4 heads of 16 + 16 query / key and 16 value
# channels, so the expanded keys (32) and values (16) differ in width as DeepSeek's (192, 128).
GEOMETRY = dict(vocab_size=96, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4, num_experts_per_tok=2,
                n_shared_experts=1, first_k_dense_replace=1, kv_lora_rank=32, qk_rope_head_dim=16,
                qk_nope_head_dim=16, v_head_dim=16, max_position_embeddings=512, pad_token_id=0, bos_token_id=1,
                eos_token_id=2)  # fmt: skip
# V3: a query bottleneck and interleaved rotary pairs; V2 (Lite): a plain q_proj.
LATENT = {"deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM", dict(q_lora_rank=24, n_group=1, topk_group=1)),
          "deepseek_v2": ("DeepseekV2Config", "DeepseekV2ForCausalLM", dict(q_lora_rank=None))}  # fmt: skip


def tiny_latent_model(family: str = "deepseek_v3", seed: int = 0, sharpen: float = 8.0):
    """A random-weight MLA model (layer 0 dense, layer 1 MoE); queries scaled by `sharpen` so that attention is far
    from uniform."""
    cfg_name, model_name, extra = LATENT[family]
    torch.manual_seed(seed)
    cfg = getattr(transformers, cfg_name)(**GEOMETRY, **extra)
    cfg._attn_implementation = "sdpa"
    model = getattr(transformers, model_name)(cfg).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            a = layer.self_attn
            (a.q_b_proj if a.q_lora_rank else a.q_proj).weight.mul_(sharpen)
    return model


class E4M3Cache(DynamicCache):
    """HF's own cache over the codes an e4m3 latent cache stores: each latent and rotary key rounded to
    e4m3(x / scale) x scale as they are written."""

    def __init__(self, scale: float, **kw) -> None:
        super().__init__(**kw)
        self.scale = scale

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        def rnd(x):
            return (x / self.scale).to(torch.float8_e4m3fn).to(x.dtype) * self.scale

        return super().update(rnd(key_states), rnd(value_states), layer_idx, *args, **kwargs)


@pytest.mark.parametrize("family", list(LATENT))
def test_greedy_matches_hf_attention_with_padding(family):
    model = tiny_latent_model(family)
    ids, mask = prompts(3, 12, pads=(0, 4, 7))
    want = greedy(model, ids, mask, NEW)
    run = run_generate(model, ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, pad_token_id=0,
                       eos_token_id=None)  # fmt: skip
    assert isinstance(run.cache, CodesignLatentCache)
    assert model.config._attn_implementation != ATTN_NAME  # the user's attention put back
    assert_same_greedy_where_decisive(run.sequences, want, ids.shape[1])
    assert run.cache.row_lengths() == [12 + NEW - 1, 8 + NEW - 1, 5 + NEW - 1]  # padding never written
    assert [s.kind for s in run.steps] == ["prefill"] + ["decode"] * (NEW - 1)
    assert run.steps[0].q_lens == (12, 8, 5) and run.steps[-1].context_lens == (19, 15, 12)


@pytest.mark.parametrize(("kv_format", "prefill"), [(None, "expanded"), ("fp8", "absorbed")])
def test_which_attention_each_forward_runs(kv_format, prefill, monkeypatch):
    """The prompts' forward attends its own expanded keys and values (the paged extend kernel, DeepSeek's prefill),
    except over an e4m3 cache, whose codes every forward attends; decode steps attend the pool absorbed."""
    import codesign.kernels.attention.latent as latent_kernel

    calls = []
    for mod, name, attr in ((K, "paged_extend_attention", "paged_extend_attention"),
                            (latent_kernel, "latent_decode_attention", "latent_attention_torch")):  # fmt: skip
        real = getattr(mod, attr)
        monkeypatch.setattr(mod, attr, lambda *a, _n=name, _f=real, **k: calls.append((_n, a[0].shape)) or _f(*a, **k))
    model = tiny_latent_model("deepseek_v3")
    ids, mask = prompts(2, 9, pads=(0, 2))
    generate(model, ids, kv_format, attention_mask=mask, max_new_tokens=3, do_sample=False, pad_token_id=0,
             eos_token_id=None, kv_scale=0.05 if kv_format else None)  # fmt: skip
    first = "paged_extend_attention" if prefill == "expanded" else "latent_decode_attention"
    assert [n for n, _ in calls[:2]] == [first] * 2  # both layers
    assert calls[0][1] == ((9 + 7, 4, 32) if prefill == "expanded" else (9 + 7, 4, 32 + 16))  # real tokens only
    assert calls[2:] == [("latent_decode_attention", (2, 4, 48))] * 4  # 2 decode steps x 2 layers


def test_logits_within_fp32_of_hf_over_prefill_and_decode(paged):
    """Absorbed attention over the pool against HF's expanded keys and values: the same function, other
    arithmetic (fp32 both)."""
    model = tiny_latent_model("deepseek_v3")
    ids = torch.randint(3, 96, (2, 13), generator=torch.Generator().manual_seed(5))
    ref_cache, steps = DynamicCache(config=model.config), [ids, ids[:, -1:] + 1, ids[:, -2:-1] + 2]
    with torch.no_grad():
        want = [model(x, cache=ref_cache, use_cache=True).logits for x in steps]
        cache = CodesignLatentCache(paged(model), num_blocks=12, block_size=4)
        got = [model(x, cache=cache, use_cache=True).logits for x in steps]
    for g, w in zip(got, want):
        assert torch.isfinite(g).all()
        assert (g - w).abs().max() <= 1e-4 * w.abs().max()
    assert cache.row_lengths() == [15, 15]


@pytest.mark.parametrize("seed", range(6))
def test_random_shapes_match_hf_logits(seed, paged):
    """Fresh random scenarios: V2 or V3, 1-4 rows of 3-17 tokens left-padded at random, odd block sizes, a scrambled
    pool, the torch path or the Triton interpreter: the prompt's and three decode steps' logits within 1e-4 (relative)
    of transformers' sdpa over its own latent cache, position for position."""
    g = torch.Generator().manual_seed(100 + seed)

    def pick(n: int) -> int:
        return int(torch.randint(n, (1,), generator=g))

    family = ("deepseek_v2", "deepseek_v3")[seed % 2]
    model = tiny_latent_model(family, seed=seed)
    b, s, bs = 1 + pick(4), 3 + pick(15), (1, 2, 3, 5, 8, 16)[pick(6)]
    ids = torch.randint(3, 96, (b, s), generator=g)
    mask = torch.ones_like(ids)
    for r in range(1, b):
        mask[r, : pick(s - 1)] = 0  # row 0 unpadded; the others keep at least one token
    steps = [ids] + [torch.randint(3, 96, (b, 1), generator=g) for _ in range(3)]
    pos = (mask.cumsum(1) - 1).clamp(min=0)
    with torch.no_grad():
        ref = DynamicCache(config=model.config)
        cache = CodesignLatentCache(paged(model), num_blocks=b * -(-(s + 3) // bs) + b, block_size=bs)
        scramble_pool(cache, seed=seed)
        for i, x in enumerate(steps):
            p = pos if i == 0 else pos[:, -1:] + i
            m = mask if i == 0 else torch.cat((mask, torch.ones(b, i, dtype=mask.dtype)), 1)
            model.set_attn_implementation("sdpa")
            want = model(x, attention_mask=m, position_ids=p, cache=ref, use_cache=True).logits
            model.set_attn_implementation(ATTN_NAME)
            with use_backend("triton" if seed % 3 == 0 else "torch"):
                got = model(x, attention_mask=m, position_ids=p, cache=cache, use_cache=True).logits
            real = m[:, -x.shape[1] :].bool()  # padding columns' logits are nobody's
            assert (got - want)[real].abs().max() <= 1e-4 * want[real].abs().max(), (i, b, s, bs)
    assert cache.row_lengths() == (mask.sum(1) + 3).tolist()


def test_the_pool_is_what_is_attended(paged):
    """Teeth: one token's latent changed in the pool after the prompt changes the next logits of that row only (HF's
    expanded keys of the new token alone could not give the right logits without the pool)."""
    model = tiny_latent_model("deepseek_v3")
    ids = torch.randint(3, 96, (2, 9), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        outs = []
        for poison in (False, True):
            cache = CodesignLatentCache(paged(model), num_blocks=8, block_size=4)
            model(ids, cache=cache, use_cache=True)
            if poison:
                slot = cache.block_tables()[0, 0] * 4 + 2  # row 0's third token
                for pool in cache.pools:
                    pool.view(-1, pool.shape[-1])[slot] *= -3
            outs.append(model(ids[:, -1:], cache=cache, use_cache=True).logits)
    diff = (outs[0] - outs[1]).abs().amax(dim=(1, 2))
    assert diff[0] > 1e-2 and diff[1] == 0


@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_triton_kernels_over_a_scrambled_pool(block_size, paged):
    model = tiny_latent_model("deepseek_v3", seed=1)
    ids, mask = prompts(2, 11, pads=(0, 3))
    want = greedy(model, ids, mask, NEW)
    cache = CodesignLatentCache(paged(model), num_blocks=2 * (-(-(11 + NEW) // block_size)) + 4,
                                block_size=block_size)  # fmt: skip
    scramble_pool(cache, seed=block_size)
    with use_backend("triton"):
        got = greedy(model, ids, mask, NEW, cache=cache).sequences
    assert_same_greedy_where_decisive(got, want, ids.shape[1])
    bt = cache.block_tables()
    if bt.shape[1] > 1:
        assert (bt[:, 1:] != bt[:, :-1] + 1).any()  # blocks are not handed out in order


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_fp8_cache_matches_hf_over_the_same_codes(backend, paged):
    model = tiny_latent_model("deepseek_v2", seed=2)
    ids, mask = prompts(2, 10, pads=(0, 2))
    scale = 0.05  # codes up to ~|x| / 0.05: the rounding bites (a 1.0 scale would hold these latents in few codes)
    want = greedy(model, ids, mask, NEW, cache=E4M3Cache(scale, config=model.config))
    cache = CodesignLatentCache(paged(model), "fp8", num_blocks=12, block_size=4, kv_scale=scale)
    with use_backend(backend):
        got = greedy(model, ids, mask, NEW, cache=cache).sequences
    assert_same_greedy_where_decisive(got, want, ids.shape[1])
    assert cache.pools[0].dtype == torch.float8_e4m3fn and cache.format_name == "fp8"
    plain = CodesignLatentCache(model, num_blocks=12, block_size=4)
    assert cache.nbytes() * 4 == plain.nbytes() == 2 * 12 * 4 * (32 + 16) * 4  # layers x blocks x tokens x width


@pytest.mark.parametrize("kv_format", [None, "fp8"])
def test_forked_rows_copy_a_shared_partial_block(kv_format, paged):
    """Two rows forked from one share its blocks; each appending to the shared partial block takes a copy (the
    fresh block's slots are NaN in a scrambled pool: a missed copy shows), and each row's logits are those of its
    own prompt run alone."""
    model = tiny_latent_model("deepseek_v3", seed=8)
    ids = torch.randint(3, 96, (1, 6), generator=torch.Generator().manual_seed(9))
    nxt = torch.tensor([[7], [9]])
    kw = dict(kv_scale=0.05) if kv_format else {}
    with torch.no_grad():
        cache = CodesignLatentCache(paged(model), kv_format, num_blocks=12, block_size=4, **kw)
        for pool in cache.pools:
            if kv_format:
                pool.view(torch.uint8).fill_(0x7F)  # e4m3's NaN
            else:
                pool.fill_(float("nan"))
        scramble_pool(cache, seed=1)
        model(ids, cache=cache, use_cache=True)
        cache.select_rows([0, 0])
        assert cache.allocator.num_free == 12 - 2  # the rows share both blocks
        got = model(nxt, cache=cache, use_cache=True).logits[:, -1]
        for r in range(2):
            alone = CodesignLatentCache(model, kv_format, num_blocks=4, block_size=4, **kw)
            want = model(torch.cat((ids, nxt[r : r + 1]), 1), cache=alone, use_cache=True).logits[0, -1]
            assert (got[r] - want).abs().max() <= 1e-4 * want.abs().max()
    # the first block still shared; the partial one copied once (the second row then held the original alone)
    assert cache.allocator.num_free == 12 - 3


@pytest.mark.parametrize("kv_format", [None, "fp8"])
def test_prefix_sharing_saves_blocks_and_keeps_tokens(kv_format):
    """Rows whose prompts start alike share those full blocks, written once by the earlier row (an e4m3 cache's
    prefill attends them absorbed in the same layer that writes them); a left-padded row shares from its first real
    token."""
    model = tiny_latent_model("deepseek_v3", seed=9)
    ids, _ = prompts(1, 20, seed=5)
    ids = ids.repeat(4, 1)
    ids[1, 17:] = torch.tensor([3, 4, 5])
    ids[2, 9:] = torch.arange(10, 21)
    mask = torch.ones_like(ids)
    ids[3, 3:], ids[3, :3], mask[3, :3] = ids[0, :17].clone(), 0, 0  # row 0's first 17 tokens after 3 pads
    scale = 0.05
    ref = E4M3Cache(scale, config=model.config) if kv_format else None
    want = greedy(model, ids, mask, NEW, cache=ref)
    kw = dict(attention_mask=mask, block_size=4, max_new_tokens=NEW, do_sample=False, pad_token_id=0,
              eos_token_id=None, kv_scale=scale if kv_format else None)  # fmt: skip
    run = run_generate(model, ids, kv_format, **kw)
    alone = run_generate(model, ids, kv_format, share_prefix=False, **kw)
    assert_same_greedy_where_decisive(run.sequences, want, ids.shape[1])
    assert torch.equal(run.sequences, alone.sequences)
    # Row 1 shares 16 of its 20 prompt tokens (4 blocks), row 2 8 (2 blocks), row 3 16 of its 17 (4 blocks).
    assert alone.cache.blocks_in_use() - run.cache.blocks_in_use() == 10


def test_beam_search_forks_rows_and_prompt_lookup_crops(paged):
    """Beams fork rows (`reorder_cache`) over a scrambled, NaN-filled pool; prompt lookup crops the rows back after
    each verification."""
    model = tiny_latent_model("deepseek_v3", seed=3)
    ids, _ = prompts(1, 10, seed=4)
    want = model.generate(ids, max_new_tokens=NEW, num_beams=3, do_sample=False, pad_token_id=0, eos_token_id=None)
    cache = CodesignLatentCache(paged(model), num_blocks=40, block_size=4)
    for pool in cache.pools:
        pool.fill_(float("nan"))
    scramble_pool(cache, seed=3)
    got = model.generate(ids, max_new_tokens=NEW, num_beams=3, do_sample=False, pad_token_id=0, eos_token_id=None,
                         **{_compat.cache_kwarg(model): cache})  # fmt: skip
    assert cache.row_lengths() == [10 + NEW - 1] * 3
    assert torch.equal(got, want)
    model.set_attn_implementation("sdpa")
    loop = torch.tensor([[5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7, 8, 5, 6]])
    want = greedy(model, loop, None, NEW)
    run = run_generate(model, loop, max_new_tokens=NEW, do_sample=False, pad_token_id=0, eos_token_id=NO_EOS,
                       prompt_lookup_num_tokens=3, block_size=4)  # fmt: skip
    assert_same_greedy_where_decisive(run.sequences, want, loop.shape[1])
    assert "extend" in {s.kind for s in run.steps}  # verified drafts, then cropped back
    assert run.cache.row_lengths()[0] == run.sequences.shape[1] - 1


def test_quantized_weights_compose_with_absorption():
    """W8A16 linears (kv_b_proj among them) in bf16: W_UK and W_UV are read out of the quantized module itself, so
    the tokens are HF's over the same quantized model."""
    model = tiny_latent_model("deepseek_v2", seed=5).to(torch.bfloat16)
    K.quantize_(model, K.W8A16Config(group_size=32))
    assert isinstance(model.model.layers[0].self_attn.kv_b_proj, K.QuantLinear)
    ids, mask = prompts(2, 10, pads=(0, 2))
    want = greedy(model, ids, mask, NEW)
    got = generate(model, ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, pad_token_id=0,
                   eos_token_id=None)  # fmt: skip
    assert_same_greedy_where_decisive(got, want, ids.shape[1], DECISIVE_QUANT)


def test_quantized_experts_and_the_cli_cost_a_quantized_deepseek(tmp_path, capsys):
    """DeepSeek's stacked experts (Mixtral's loop) become QuantExperts with the linears, so the whole model is one
    weight format: generated as HF over the same quantized model, and costed by `codesign generate --design`."""
    from codesign.integrations.hf.experts import QuantExperts, quantize_model_

    model = tiny_latent_model("deepseek_v2", seed=7).to(torch.bfloat16)
    quantize_model_(model, K.W8A16Config(group_size=32))
    assert isinstance(model.model.layers[1].mlp.experts, QuantExperts)
    assert not [n for n, p in model.named_parameters() if p.dim() == 3 and p.is_floating_point()]
    ids, mask = prompts(2, 10, pads=(0, 2))
    want = greedy(model, ids, mask, NEW)
    got = generate(model, ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, pad_token_id=0,
                   eos_token_id=None)  # fmt: skip
    assert_same_greedy_where_decisive(got, want, ids.shape[1], DECISIVE_QUANT)
    folder = tmp_path / "tiny-deepseek-v2"
    tiny_latent_model("deepseek_v2").save_pretrained(folder)
    assert main(["generate", str(folder), "--max-new-tokens", "2", "--weights", "w8a16", "--group-size", "0",
                 "--design", "h100-sxm"]) == 0  # fmt: skip
    assert "predicted on h100-sxm" in capsys.readouterr().out


def test_a_refused_forward_leaves_the_cache_as_it_was(paged):
    """A value past e4m3's range at the cache's scale is refused, and the rows keep their lengths: the next
    forward (at a scale that holds it) gives the logits of a cache that never saw the refused one."""
    model = tiny_latent_model("deepseek_v3", seed=6)
    ids = torch.randint(3, 96, (2, 7), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        runs = []
        for refuse in (False, True):
            cache = CodesignLatentCache(paged(model), "fp8", num_blocks=8, block_size=4, kv_scale=0.05)
            model(ids, cache=cache, use_cache=True)
            if refuse:
                cache.kv_scale = 1e-4
                with pytest.raises(CodesignError, match="passes e4m3's range"):
                    model(ids[:, -1:], cache=cache, use_cache=True)
                assert (cache.row_lengths(), cache.seen, len(cache.steps)) == ([7, 7], 7, 1)
                cache.kv_scale = 0.05
            runs.append(model(ids[:, -1:], cache=cache, use_cache=True).logits)
    assert torch.equal(runs[0], runs[1])


@pytest.mark.parametrize("draft", ["ngram", "random", "swapped"])
def test_tree_speculation_is_plain_greedy(draft):
    """Tree verification over the latent cache: each node one decode row over a sequence of its own (its row's
    blocks shared, its path after them); accept_tree keeps the accepted node's. An n-gram draft, a random Llama
    draft, and the target as a draft with its two chains swapped (every accepted path leaves the first branch
    behind). No block is left behind when the rows finish."""
    from hf_testing import tiny_model
    from test_hf_speculative import _SwappedBranches

    from codesign.integrations.hf import TreeSpeculator

    model = tiny_latent_model("deepseek_v3", seed=10)
    ids, mask = prompts(2, 12, pads=(0, 3))
    ids[0, 6:] = ids[0, :6]  # something for prompt lookup to find
    want = greedy(model, ids, mask, NEW)
    d = {"ngram": "ngram", "random": tiny_model("llama", seed=7, num_hidden_layers=1),
         "swapped": _SwappedBranches(model)}[draft]  # fmt: skip
    sp = TreeSpeculator(d, width=2, depth=3)
    run = run_generate(model, ids, attention_mask=mask, speculative=sp, max_new_tokens=NEW, do_sample=False,
                       pad_token_id=0, eos_token_id=None, block_size=4)  # fmt: skip
    assert_same_greedy_where_decisive(run.sequences, want, ids.shape[1])
    assert [s.kind for s in run.steps[1:]] == ["tree"] * (len(run.steps) - 1) and len(run.steps) > 1
    if draft == "swapped":
        assert all(a == 3 for step in sp.stats.accepted for a in step), sp.stats.accepted
    assert run.cache.blocks_in_use() == 0 and not run.cache.row_lengths()


def test_the_target_as_its_own_draft_accepts_every_token():
    """A DeepSeek draft runs on a latent cache of its own (forked per node, rewound after proposing)."""
    from codesign.integrations.hf import TreeSpeculator

    model = tiny_latent_model("deepseek_v2", seed=11)
    ids, _ = prompts(1, 9)
    sp = TreeSpeculator(model, parents=[-1, 0, 1, 2, 0, 4])  # two chains of 3 and 2 tokens
    run = run_generate(model, ids, speculative=sp, max_new_tokens=NEW, do_sample=False, pad_token_id=0,
                       eos_token_id=None)  # fmt: skip
    want = greedy(model, ids, None, NEW)
    assert_same_greedy_where_decisive(run.sequences[:, : want.sequences.shape[1]], want, ids.shape[1])
    # Every step accepts the 3-token chain: 1 root + 3 steps of (3 accepted + 1 bonus) = 13 >= 8 tokens.
    assert sp.stats.accepted[:2] == [[3], [3]]


def test_tree_bookkeeping_is_refused_out_of_order(paged):
    model = tiny_latent_model("deepseek_v3")
    cache = CodesignLatentCache(paged(model), num_blocks=16, block_size=4)
    ids = torch.tensor([[3, 4, 5, 6, 7]])
    with torch.no_grad():
        model(ids, cache=cache, use_cache=True)
        with pytest.raises(CodesignError, match="accept_tree must follow a tree forward"):
            cache.accept_tree([[0]])
        cache.set_tree([-1, 0, 0])
        with pytest.raises(CodesignError, match="a tree of 3 nodes, but the forward has 2 columns"):
            model(torch.tensor([[8, 9]]), cache=cache, use_cache=True)
        cache.set_tree([-1, 0, 0])
        pos = torch.tensor([[5, 6, 6]])
        model(torch.tensor([[8, 9, 10]]), position_ids=pos, cache=cache, use_cache=True)
        assert cache.blocks_in_use() == 2 + 3 * 1  # the row's 2 blocks; each node: a copy of the partial one
        for call in (lambda: model(torch.tensor([[11]]), cache=cache, use_cache=True), lambda: cache.crop(-1),
                     lambda: cache.select_rows([0])):  # fmt: skip
            with pytest.raises(CodesignError, match="accept_tree"):
                call()
        with pytest.raises(CodesignError, match="is not a path from the root"):
            cache.accept_tree([[0, 2, 1]])
        cache.accept_tree([[0, 2]])
    assert cache.row_lengths() == [7] and cache.blocks_in_use() == 2


def test_cli_generates_a_deepseek_folder(tmp_path, capsys):
    folder = tmp_path / "tiny-deepseek"
    tiny_latent_model("deepseek_v3").save_pretrained(folder)
    assert main(["generate", str(folder), "--max-new-tokens", "3", "--batch", "2", "--kv-format", "fp8",
                 "--design", "hbm_pim"]) == 0  # fmt: skip
    out = capsys.readouterr().out
    assert "kv latent fp8" in out and "predicted on hbm_pim" in out
    assert main(["generate", str(folder), "--kv-format", "int4"]) == 2
    assert "kv_format='int4' is not served for a latent (MLA) cache" in capsys.readouterr().err


def test_each_latent_step_is_costed_as_what_it_ran():
    """Prefill expanded (kv_b_proj, then attention over the prompt), decode absorbed over the latent cache; an extend,
    a tree (each node over its prefix and path) and an e4m3 cache's prefill run each new token as a decode row (the
    decode graph of those rows)."""
    from codesign.integrations.hf.cache import StepRecord
    from codesign.integrations.hf.costing import StepCoster, run_shape, step_graph
    from codesign.specs import PagedDecodeAttention, PrefillAttention

    model = tiny_latent_model("deepseek_v3")
    shape, fp8 = run_shape(model, None, 16), run_shape(model, "fp8", 16)
    prefill, extend = StepRecord("prefill", (5, 3), (5, 3)), StepRecord("extend", (3,), (12,))
    g = step_graph(shape, prefill)
    assert isinstance(g.nodes["L1.attention"]["spec"], PrefillAttention) and "L1.kv_b_proj" in g
    tree = StepRecord("tree", (4, 4), (14, 24), (-1, 0, 1, 0))  # depths 0 1 2 1 over prefixes of 10 and 20
    for sh, step, ctx, logits in ((shape, extend, (10, 11, 12), 3), (fp8, prefill, (1, 2, 3, 4, 5, 1, 2, 3), 2),
                                  (shape, tree, (11, 12, 13, 12, 21, 22, 23, 22), 8)):  # fmt: skip
        g = step_graph(sh, step)
        a = g.nodes["L1.attention"]["spec"]
        assert isinstance(a, PagedDecodeAttention) and a.latent_kv and a.context_lens == ctx, a
        assert "L1.q_absorb" in g and "L1.kv_b_proj" not in g and g.nodes["L1.o_proj"]["spec"].M == len(ctx)
        assert g.nodes["lm_head"]["spec"].M == logits  # every verified token's; a prefill's last token a row
    assert fp8.kv_format.dtype == "fp8_e4m3" and shape.kv_format.dtype == "fp32"
    c = StepCoster("h100-sxm", shape)
    assert c.seconds(extend) > c.seconds(StepRecord("decode", (1,), (10,))) > 0


def test_catalogue_deepseek_models_become_transformers_configs():
    from codesign.catalog.models import load_model
    from codesign.integrations.hf.models import hf_config

    v3 = hf_config(load_model("deepseek-v3"), layers=4)
    assert (v3.model_type, v3.q_lora_rank, v3.kv_lora_rank, v3.qk_rope_head_dim, v3.qk_nope_head_dim) == (
        "deepseek_v3", 1536, 512, 64, 128)  # fmt: skip
    assert (v3.first_k_dense_replace, v3.intermediate_size, v3.n_routed_experts, v3.n_shared_experts) == (
        3, 18432, 256, 1)  # fmt: skip
    lite = hf_config(load_model("deepseek-v2-lite"))
    assert (lite.model_type, lite.q_lora_rank, lite.n_shared_experts, lite.moe_intermediate_size) == (
        "deepseek_v2", None, 2, 1408)  # fmt: skip


# --- refusals -------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(kv_format="int4"), "kv_format='int4' is not served for a latent"),
        (dict(kv_format="int8-kivi"), "kv_format='int8-kivi' is not served for a latent"),
        (dict(fuse=True), "fuse: not served for latent"),
        (dict(cuda_graph="tape"), "cuda_graph: not served for latent"),
        (dict(kv_scale=0.5), "kv_scale is for kv_format='fp8'"),
        (dict(kv_format="fp8", kv_scale=0.0), "kv_scale"),
        (dict(kv_format="fp8", kv_scale=float("nan")), "kv_scale"),
        (dict(kv_format="fp8", kv_scale=1e-4), "passes e4m3's range at kv_scale=0.0001"),
        (dict(block_size=2, num_blocks=1), "cannot hold the prompt"),
        (dict(num_blocks=1), "cannot hold this run"),
    ],
)
def test_bad_input_is_refused(kwargs, message):
    model = tiny_latent_model("deepseek_v2")
    with pytest.raises(CodesignError, match=message):
        generate(model, torch.tensor([[3, 4, 5, 6, 7]]), max_new_tokens=2, **kwargs)
    assert model.config._attn_implementation == "sdpa"


def test_other_caches_attentions_and_releases_are_refused(paged, monkeypatch):
    model = tiny_latent_model("deepseek_v3")
    with pytest.raises(CodesignError, match="served by CodesignLatentCache"):
        CodesignCache(model, num_blocks=4)
    cache = CodesignLatentCache(model, num_blocks=4)
    with pytest.raises(CodesignError, match="needs attn_implementation='codesign_paged'"):
        model(torch.tensor([[3, 4]]), cache=cache, use_cache=True)
    from hf_testing import tiny_model

    with pytest.raises(CodesignError, match="kv_scale is for a latent"):
        generate(tiny_model("llama"), torch.tensor([[3, 4]]), max_new_tokens=1, kv_scale=1.0)
    monkeypatch.setattr(_compat, "VERSION", (5, 24))
    with pytest.raises(CodesignError, match="served from transformers 5.25 on"):
        generate(model, torch.tensor([[3, 4]]), max_new_tokens=1)


def test_foreign_caches_still_run_codesign_attention(paged):
    """HF's DynamicCache under codesign_paged: the expanded keys and values (values narrower than keys) go through
    the transient paged pool, the same tokens as sdpa."""
    model = tiny_latent_model("deepseek_v2", seed=4)
    ids, mask = prompts(2, 9, pads=(0, 3))
    want = greedy(model, ids, mask, NEW)
    got = greedy(paged(model), ids, mask, NEW).sequences
    assert_same_greedy_where_decisive(got, want, ids.shape[1])
