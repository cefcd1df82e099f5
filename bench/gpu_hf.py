"""GPU benchmark entry for Hugging Face generate (for the one GPU suite, bench/gpu_suite.py).

`run(report)` adds `report["hf_generate"]` from `codesign.integrations.hf.bench.bench_decode`: decode
tokens/s of transformers' greedy generate with its own sdpa attention against codesign's paged attention
(bf16 / INT8 / INT4 KV) and W4A16 weights, at batch 1 and 16, on a random-weight Llama-3-8B, each row beside
the design model's prediction for the same steps; `prefill_rows`: the prefill of one 2048-token prompt (time to
first token) by the variants with bf16 weights, beside the design model's prefill step. `checks_ok`: every
variant generated every token, in positive time (token agreement with sdpa is not asserted: bf16 greedy ties
may break either way). `report["hf_generate_mla"]`: decode rows of DeepSeek-V3's first three (dense) blocks,
transformers' own multi-head latent attention against the latent cache (bf16, e4m3), a 512-token prompt, and their
prefill rows (one 2048-token prompt).

Smoke mode: a two-layer Llama of hidden 128 on the CPU, float32 (fp32 in place of the bf16 caches), the
Triton interpreter, 3 new tokens, batch 2, six variants (sdpa, an INT4 cache, captured decode and captured tree
speculation on the CPU stand-in, W4A16 weights, and those with fused layer ops in a captured step), and a
two-layer DeepSeek-V3 of the same width for the MLA rows; the prefill
rows an 8-token prompt.
"""

from __future__ import annotations

from typing import Any

PREFILL_TOKENS = 2048  # the prefill rows' prompt (batch 1)
MLA_LAYERS, MLA_PROMPT = 3, 512  # hf_generate_mla: DeepSeek-V3's dense blocks, the prompt a row
SMOKE_MLA_CONFIG = dict(vocab_size=256, hidden_size=128, intermediate_size=256, moe_intermediate_size=64,
                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4,
                        num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1, kv_lora_rank=32,
                        q_lora_rank=32, qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=16, n_group=1,
                        topk_group=1, max_position_embeddings=512)  # fmt: skip
SMOKE_NAME = "tiny llama (random weights, fp32, CPU interpreter)"
SMOKE_CONFIG = dict(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=512)  # fmt: skip


def run(report: dict, quick: bool = False, mode: Any = None) -> None:
    """Rows into report["hf_generate"] (quick: 16 new tokens; smoke: the tiny model)."""

    from codesign.integrations.hf.bench import VARIANTS, bench_decode

    smoke = mode is not None and mode.smoke
    if mode is not None and not mode.available():
        report["hf_generate"] = {"skipped": "no CUDA device"}
        return
    if smoke:
        # Six variants cover the paths (transformers' own, a quantized cache, captured decode and captured tree
        # speculation, quantized weights, quantized weights with fused layer ops in a captured step).
        variants, kw = _smoke(v for v in VARIANTS if v[0] in ("hf-sdpa", "codesign-int4", "codesign-bf16-graph",
                                                               "codesign-bf16-tree-graph", "codesign-bf16-w4a16",
                                                               "codesign-bf16-w4a16-fused-graph"))  # fmt: skip
        model = kw.pop("model")
        new_tokens = 3
        kw.update(batches=(2,), variants=variants)
        name = SMOKE_NAME
    else:
        model, new_tokens, kw = None, 16 if quick else 64, {}
        name = "llama-3-8b (random weights, bf16)"
    rows = bench_decode(model, new_tokens=new_tokens, **kw)
    # Prefill end to end: one long prompt at batch 1, its first step (time to first token) beside the design model's
    # prefill step; the variants with bf16 weights and eager decode (captured and speculative prefills are theirs),
    # on a fresh model (W4A16 quantized the first in place). The warm-up runs the same prompt, so no kernel compiles
    # inside the timed step.
    n = 8 if smoke else PREFILL_TOKENS
    pre_variants = tuple(v for v in kw.get("variants", VARIANTS) if v[3] is None and v[1] in ("sdpa", "codesign"))
    pkw = {**kw, "batches": (1,), "prompt_len": n, "warmup": n, "variants": pre_variants}
    pre = bench_decode(_smoke_model() if smoke else None, new_tokens=2, **pkw)
    prefill = [{"variant": r["variant"], "prompt": n, "prefill_s": r["prefill_s"],
                "predicted_prefill_s": r["predicted_prefill_s"], "prefill_tokens_per_s": n / r["prefill_s"]}
               for r in pre]  # fmt: skip
    report["hf_generate"] = {
        "model": name, "design": "h200", "new_tokens": new_tokens, "rows": rows, "prefill_rows": prefill,
        "checks_ok": bool(rows) and all(r["tokens"] == new_tokens and r["decode_tokens_per_s"] > 0 for r in rows)
        and len(prefill) == len(pre_variants) and all(r["prefill_s"] > 0 for r in prefill),
    }  # fmt: skip
    report["hf_generate_mla"] = _mla(smoke, new_tokens)


def _mla(smoke: bool, new_tokens: int) -> dict:
    """DeepSeek-V3's first 3 blocks (dense: the attention compared, not transformers' expert loop), random bf16
    weights, a 512-token prompt at batch 1 and 16: transformers' own MLA against the latent cache (bf16, e4m3);
    in smoke mode a two-layer tiny DeepSeek-V3 on the CPU."""
    import torch

    from codesign.integrations.hf.bench import MLA_VARIANTS, bench_decode

    if smoke:
        from transformers import DeepseekV3Config

        from codesign.integrations.hf.models import random_model

        torch.manual_seed(0)
        model = random_model(DeepseekV3Config(**SMOKE_MLA_CONFIG), torch.float32, "cpu")
        kw = dict(batches=(2,), prompt_len=8, device="cpu", dtype=torch.float32, warmup=2)
        name = "tiny deepseek-v3 (random weights, fp32, CPU interpreter)"
    else:
        from codesign.catalog.models import load_model as catalogue
        from codesign.integrations.hf.models import hf_config, random_model

        model = random_model(hf_config(catalogue("deepseek-v3"), layers=MLA_LAYERS), torch.bfloat16, "cuda")
        kw, name = dict(prompt_len=MLA_PROMPT), f"deepseek-v3, first {MLA_LAYERS} (dense) blocks (random weights, bf16)"
    rows = bench_decode(model, new_tokens=new_tokens, variants=MLA_VARIANTS, **kw)
    # Time to first token of one long prompt: transformers' expanded prefill against ours (the expanded keys through
    # the paged extend kernel; the e4m3 cache's absorbed rows), beside the MLA graph's prefill step.
    n = 8 if smoke else PREFILL_TOKENS
    pre = bench_decode(model, new_tokens=2, variants=MLA_VARIANTS, **{**kw, "batches": (1,), "prompt_len": n,
                                                                       "warmup": n})  # fmt: skip
    prefill = [{"variant": r["variant"], "prompt": n, "prefill_s": r["prefill_s"],
                "predicted_prefill_s": r["predicted_prefill_s"], "prefill_tokens_per_s": n / r["prefill_s"]}
               for r in pre]  # fmt: skip
    return {"model": name, "design": "h200", "new_tokens": new_tokens, "rows": rows, "prefill_rows": prefill,
            "checks_ok": len(rows) == len(MLA_VARIANTS) * len(kw.get("batches", (1, 16)))
            and all(r["tokens"] == new_tokens and r["decode_tokens_per_s"] > 0 for r in rows)
            and len(prefill) == len(MLA_VARIANTS) and all(r["prefill_s"] > 0 for r in prefill)}  # fmt: skip


def _smoke(variants) -> tuple[tuple, dict]:
    """`variants` and bench_decode's keywords for the smoke model on the CPU: the interpreter computes bf16 wrongly
    (the writer refuses it), so the bf16 cache rows run fp32."""
    import torch

    variants = tuple((n, a, "fp32" if kv == "bf16" else kv, w) for n, a, kv, w in variants)
    return variants, dict(model=_smoke_model(), prompt_len=8, device="cpu", dtype=torch.float32, warmup=2)


def _smoke_model():
    import torch
    from transformers import LlamaConfig

    from codesign.integrations.hf.models import random_model

    torch.manual_seed(0)
    return random_model(LlamaConfig(**SMOKE_CONFIG), torch.float32, "cpu")


def main(argv=None) -> int:
    """Chosen variants alone (`bench_decode`), e.g. the compiled ones beside the captured one they compare with:
    python bench/gpu_hf.py --variants codesign-bf16-fused-graph codesign-bf16-fused-compiled --out hf.json"""
    import argparse
    from pathlib import Path

    from codesign.dataflow.reports import write_json_atomic
    from codesign.integrations.hf.bench import COMPILED_VARIANTS, VARIANTS, bench_decode

    known = {v[0]: v for v in (*VARIANTS, *COMPILED_VARIANTS)}
    p = argparse.ArgumentParser(description=main.__doc__.splitlines()[0])
    p.add_argument("--variants", nargs="+", required=True, choices=sorted(known))
    p.add_argument("--batches", nargs="+", type=int, default=[1, 16])
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--out", required=True, help="write the rows here (JSON)")
    p.add_argument("--smoke", action="store_true", help="the suite's smoke model on the CPU (fp32: a check, untimed)")
    args = p.parse_args(argv)
    variants = tuple(known[v] for v in args.variants)
    kw, name = {}, "llama-3-8b (random weights, bf16)"
    if args.smoke:
        variants, kw = _smoke(variants)
        name = SMOKE_NAME
    rows = bench_decode(batches=args.batches, new_tokens=args.new_tokens, variants=variants, **kw)
    write_json_atomic({"model": name, "design": "h200", "rows": rows}, Path(args.out))
    for r in rows:
        steady, pred = r["steady_decode_tokens_per_s"] or 0.0, r["predicted_decode_tokens_per_s"]
        print(f"{r['variant']:<40} batch {r['batch']:>3}: {r['decode_tokens_per_s']:9.1f} decode tokens/s "
              f"(steady {steady:9.1f}; predicted {pred:9.1f})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
