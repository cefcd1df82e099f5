"""GPU-suite hook: end-to-end decode tokens/s of a random-weight model in transformers' generate, HF `sdpa`
against codesign's paged attention with bf16 / INT8 / INT4 KV and W4A16 weights, at batch 1 and 16, each
beside the design model's prediction for the same run (the same prefill and decode steps, costed by the
dataflow mapper on a GPU model).

    rows = bench_decode()            # Llama-3-8B-shaped, bf16, on the current CUDA device, predicted on h200

The GPU suite runs it through bench/gpu_hf.py (report["hf_generate"]; a tiny model in smoke mode).

decode tokens/s = rows x tokens after the prefill's / the measured time after the prefill (each step timed from one
forward's logits to the next's, synchronized); end-to-end tokens/s counts the prefill too; the steady rate leaves
out the first decode forwards too (a captured run's eager and captured ones; not for tree speculation, whose
forwards emit unequal counts).
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from codesign.integrations.hf import _kernels as K
from codesign.integrations.hf.cache import StepRecord
from codesign.integrations.hf.costing import StepCoster, run_shape
from codesign.integrations.hf.fuse import fuse_layers_, unfuse_layers_
from codesign.integrations.hf.kv_formats import default_block_size, parse_kv_format
from codesign.integrations.hf.latent import LATENT_BLOCK, is_latent_model, parse_latent_format
from codesign.integrations.hf.one_call import StepClock, run_generate
from codesign.integrations.hf.speculative import TreeSpeculator

# (name, attention, KV format, weights): "sdpa" is transformers' own attention and DynamicCache; "codesign-graph"
# decodes by replaying one captured forward (`graphs.GraphDecoding`: CUDA graphs, the tape on a CPU); "-tree" runs
# tree speculation (an n-gram draft, width 2, depth 3), eager or with its tree forwards captured; "-fused" runs the
# model's RMSNorms, rotary embedding and gated MLPs on codesign's one-launch ops and its q / k / v and gate / up
# projections one GEMM each (`fuse.fuse_layers_`), "-unmerged" the same with the projections apart.
VARIANTS = (("hf-sdpa", "sdpa", None, None), ("codesign-bf16", "codesign", "bf16", None),
            ("codesign-int8", "codesign", "int8", None), ("codesign-int4", "codesign", "int4", None),
            ("codesign-bf16-graph", "codesign-graph", "bf16", None),
            ("codesign-int8-graph", "codesign-graph", "int8", None),
            ("codesign-bf16-tree", "codesign-tree", "bf16", None),
            ("codesign-bf16-tree-graph", "codesign-tree-graph", "bf16", None),
            ("codesign-bf16-fused-graph", "codesign-fused-graph", "bf16", None),
            ("codesign-bf16-w4a16", "codesign", "bf16", "w4a16"),
            ("codesign-bf16-w4a16-graph", "codesign-graph", "bf16", "w4a16"),
            ("codesign-bf16-w4a16-fused-graph", "codesign-fused-graph", "bf16", "w4a16"),
            ("codesign-bf16-w4a16-fused-unmerged-graph", "codesign-fused-unmerged-graph", "bf16", "w4a16"))  # fmt: skip
# "-compiled": decode steps (with "-tree" the tree forwards) run one torch.compile'd forward (`graphs.GraphDecoding
# (compile=...)`, `TreeSpeculator(compile=...)`; on a GPU mode="reduce-overhead", Inductor's CUDA graphs; on a CPU the
# aot_eager backend). Compiling an 8B model costs a minute or more a batch size, so these run on request
# (bench/gpu_hf.py --variants), beside the captured variant.
COMPILED_VARIANTS = (("codesign-bf16-fused-compiled", "codesign-fused-compiled", "bf16", None),
                     ("codesign-bf16-w4a16-fused-compiled", "codesign-fused-compiled", "bf16", "w4a16"),
                     ("codesign-bf16-tree-compiled", "codesign-tree-compiled", "bf16", None))  # fmt: skip
# A DeepSeek model (multi-head latent attention): transformers' own MLA (its DynamicCache holds the latent, and every
# step expands the whole history through kv_b_proj) against CodesignLatentCache in the model's dtype and in e4m3.
MLA_VARIANTS = (("hf-sdpa", "sdpa", None, None), ("codesign-latent", "codesign", None, None),
                ("codesign-latent-fp8", "codesign", "fp8", None))  # fmt: skip
STEADY_AFTER = 3  # steps a steady rate leaves out: the prefill, and a captured run's eager and captured steps


GREEDY = dict(do_sample=False, pad_token_id=0, eos_token_id=None)


def _timed(model, attn: str, spec, ids, new_tokens: int) -> tuple[list[float], list[StepRecord], int]:
    """Greedy generation of new_tokens: each step's (forward's) seconds and shape, and the tokens a row made."""
    if attn != "sdpa":
        graph = attn.endswith("-graph") and (True if ids.is_cuda else "tape")
        compiled = attn.endswith("-compiled") and (
            {"mode": "reduce-overhead"} if ids.is_cuda else {"backend": "aot_eager"})
        sp = TreeSpeculator("ngram", width=2, depth=3) if "-tree" in attn else None
        try:
            if "-unmerged" in attn:
                fuse_layers_(model, merge=False)  # (run_generate's fuse then keeps it)
            r = run_generate(model, ids, spec, max_new_tokens=new_tokens, check=False, cuda_graph=graph,
                             compile=compiled, speculative=sp, fuse="-fused" in attn, **GREEDY)  # fmt: skip
        finally:
            unfuse_layers_(model)  # (the next variant runs the model's own modules)
        return r.step_seconds, r.steps, r.sequences.shape[1] - ids.shape[1]
    clock = StepClock()  # transformers' own generate: sdpa over a DynamicCache
    model.set_attn_implementation("sdpa")
    t0 = time.perf_counter()
    out = model.generate(ids, max_new_tokens=new_tokens, stopping_criteria=[clock], **GREEDY)
    b, p = ids.shape
    steps = [StepRecord("prefill", (p,) * b, (p,) * b)]
    steps += [StepRecord("decode", (1,) * b, (p + i,) * b) for i in range(1, new_tokens)]
    return [y - x for x, y in zip([t0, *clock.times[:-1]], clock.times)], steps, out.shape[1] - p


def _row(name: str, batch: int, tokens: int, secs: Sequence[float], pred: Sequence[float]) -> dict:
    """A row: `tokens` a row in len(secs) forwards (the prefill first, which picks each row's first token). The steady
    rate leaves out the first STEADY_AFTER forwards (one token a row each: not for tree speculation, None there)."""
    dec, pdec, n = sum(secs[1:]), sum(pred[1:]), len(secs)
    steady = sum(secs[STEADY_AFTER:])
    one_each = n == tokens
    return {"variant": name, "batch": batch, "steps": n, "tokens": tokens, "measured_s": sum(secs),
            "predicted_s": sum(pred), "decode_tokens_per_s": batch * (tokens - 1) / dec if dec else 0.0,
            "predicted_decode_tokens_per_s": batch * (tokens - 1) / pdec if pdec else 0.0,
            "steady_decode_tokens_per_s": batch * (n - STEADY_AFTER) / steady if one_each and steady else None,
            "tokens_per_s": batch * tokens / sum(secs), "prefill_s": secs[0],
            "predicted_prefill_s": pred[0]}  # fmt: skip


def bench_decode(model=None, *, batches: Sequence[int] = (1, 16), prompt_len: int = 128, new_tokens: int = 64,
                 design: str = "h200", device: str = "cuda", dtype: torch.dtype = torch.bfloat16,
                 variants=VARIANTS, group_size: int = 128, warmup: int = 4) -> list[dict]:  # fmt: skip
    """One row per (variant, batch): measured and predicted decode tokens/s of greedy generation of
    `new_tokens` tokens after a random prompt of `prompt_len`. model: a transformers model (default: a
    random-weight Llama-3-8B shape built on `device`); the W4A16 variant quantizes it in place, so it runs last."""
    if model is None:
        from codesign.catalog.models import load_model as catalogue
        from codesign.integrations.hf.models import hf_config, random_model

        model = random_model(hf_config(catalogue("llama-3-8b")), dtype, device)
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(0)
    rows = []
    for name, attn, kv, weights in sorted(variants, key=lambda v: v[3] is not None):
        if weights == "w4a16":
            K.quantize_(model, K.W4A16Config(group_size=group_size), lambda m, fqn: "lm_head" not in fqn)
        if is_latent_model(model):  # (a latent cache's format: None or "fp8")
            spec = parse_latent_format(kv, model.dtype)
            coster = StepCoster(design, run_shape(model, spec, LATENT_BLOCK))
        else:
            spec = parse_kv_format(kv, model.dtype)
            coster = StepCoster(design, run_shape(model, spec, default_block_size(spec)))
        for batch in batches:
            ids = torch.randint(3, vocab, (batch, prompt_len), generator=g).to(device)
            # kernel compiles, allocator growth; a captured or speculative run over the whole prompt: its tables'
            # widths (which Triton may specialize on) near the timed run's, its capture and its tree kernels run
            eager = attn in ("sdpa", "codesign")  # (a compiled run: its compiles, for the timed run's shapes)
            _timed(model, attn, spec, ids[:, :warmup] if eager else ids, 2 if eager else 5)
            secs, steps, made = _timed(model, attn, spec, ids, new_tokens)
            rows.append(_row(name, batch, made, secs, coster.predict(steps)))
    return rows

