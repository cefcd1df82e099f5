"""`codesign generate`: run a transformers model end to end on codesign's kernels and caches, and with
`--design` cost the same run (every prefill, decode and verification step, with its batch and context
lengths) on a simulated design or a GPU model, predicted beside measured time per step and in total.

MODEL is a local folder (config.json and weights; `--random-weights` for a config alone) or a catalogue model
(`codesign/catalog/models.yaml`, random weights, for benchmarking; `--layers` keeps the first N layers).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from codesign.specs import CodesignError
from codesign.specs.paths import output_file

DTYPES = ("fp32", "fp16", "bf16")
# Defaults of options that apply to one part of a run only (None in the parser: given or not, `_check_applies`)
PROMPT_LEN, GROUP_SIZE, TREE_WIDTH, TREE_DEPTH = 16, 128, 2, 3
# torch.compile modes `--compile` takes (reduce-overhead and max-autotune capture Inductor's CUDA graphs)
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="local model folder, or a catalogue model name (random weights)")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--prompt", help="prompt text (needs a tokenizer in the model folder)")
    src.add_argument("--prompt-ids", help="prompt token ids, comma separated")
    p.add_argument("--prompt-len", type=int, default=None,
                   help=f"random prompt length (default {PROMPT_LEN}; no --prompt / --prompt-ids)")  # fmt: skip
    p.add_argument("--batch", type=int, default=1, help="rows (the prompt repeated)")
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument("--kv-format", default=None, help="fp16, bf16, fp32, int8, int4, int2, fp8, int4-kivi, "
                   "int4-oaken, int4-oaken_offline, mixed (default: the model's dtype)")  # fmt: skip
    p.add_argument("--weights", default="none", help="none, w4a16, w8a16, w8a8, fp8 or lossless-bf16")
    p.add_argument("--group-size", type=int, default=None,
                   help=f"w4a16 / w8a16 group size (default {GROUP_SIZE}; 0: per channel)")  # fmt: skip
    p.add_argument(
        "--speculative", default="none", help="none, ngram, or a draft model folder (tree decoding)"
    )
    p.add_argument("--tree-width", type=int, default=None, help=f"--speculative's tree (default {TREE_WIDTH})")
    p.add_argument("--tree-depth", type=int, default=None, help=f"--speculative's tree (default {TREE_DEPTH})")
    p.add_argument(
        "--design", help="also cost the run on this design or GPU model (as `codesign map --design`)"
    )
    p.add_argument("--cuda-graph", action="store_true",
                   help="decode steps (or --speculative's tree forwards) replay one forward captured in a CUDA "
                        "graph (decode: every format; trees: plain, per-token INT and FP8 caches)")
    p.add_argument("--compile", nargs="?", const="default", default=None, choices=COMPILE_MODES,
                   help="decode steps (or --speculative's tree forwards) run one torch.compile'd forward (no graph "
                        "break; the cache's side one op a layer): a torch.compile mode (default: 'default'); with "
                        "--cuda-graph captured in ours, 'reduce-overhead' in Inductor's CUDA graphs")  # fmt: skip
    p.add_argument("--fuse", action="store_true",
                   help="RMSNorms, rotary embedding, gated MLPs and hybrid models' recurrent steps on codesign's "
                        "kernels; q / k / v and gate / up projections one GEMM each")
    p.add_argument("--block-size", type=int, default=None, help="KV block size (default 16, 32 for KIVI)")
    p.add_argument("--dtype", default="fp32", choices=DTYPES)
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when there is one)")
    p.add_argument("--layers", type=int, default=None, help="catalogue models: keep the first N layers")
    p.add_argument("--random-weights", action="store_true",
                   help="a model (and --speculative draft) folder with a config only")  # fmt: skip
    p.add_argument("--seed", type=int, default=0, help="seeds random weights, the random prompt and sampling")
    p.add_argument("--json", type=output_file, help="write the run (tokens, steps, predictions) as JSON")


def _prompt(args, tok, vocab: int):
    import torch

    if args.prompt is not None:
        if tok is None:
            raise CodesignError("--prompt needs a tokenizer in the model folder: pass --prompt-ids instead")
        ids = tok(args.prompt, return_tensors="pt").input_ids
    elif args.prompt_ids is not None:
        try:
            ids = torch.tensor([[int(x) for x in args.prompt_ids.split(",")]])
        except ValueError:
            raise CodesignError(
                f"--prompt-ids must be comma-separated integers, got {args.prompt_ids!r}"
            ) from None
    else:
        ids = torch.randint(
            3, vocab, (1, args.prompt_len or PROMPT_LEN), generator=torch.Generator().manual_seed(args.seed)
        )
    if ids.numel() == 0 or int(ids.min()) < 0 or int(ids.max()) >= vocab:
        raise CodesignError(f"prompt token ids must lie in [0, {vocab})")
    return ids.repeat(args.batch, 1)


def _quantize(model, args, dtype) -> None:
    import torch

    from codesign.integrations.hf.experts import quantize_model_
    from codesign.integrations.hf.quantizer import CodesignQuantConfig

    if args.weights == "none":
        return
    if args.weights == "lossless-bf16" and dtype != torch.bfloat16:
        raise CodesignError("--weights lossless-bf16 compresses bf16 weights: pass --dtype bf16")
    group = GROUP_SIZE if args.group_size is None else args.group_size
    qc = CodesignQuantConfig(args.weights, group_size=group or None)
    quantize_model_(model, qc.kernel_config(), lambda m, fqn: qc.converts(fqn))  # a MoE's experts too


def _speculator(args, dtype, device):
    from codesign.integrations.hf import TreeSpeculator

    if args.speculative == "none":
        return None
    draft = "ngram"
    if args.speculative != "ngram":
        from codesign.integrations.hf.models import load_model

        try:  # (--random-weights: the draft folder's config alone too)
            draft, _ = load_model(args.speculative, dtype, device, None, args.random_weights)
        except CodesignError as e:
            raise CodesignError(f"--speculative: {e}") from None
    return TreeSpeculator(draft, width=args.tree_width or TREE_WIDTH, depth=args.tree_depth or TREE_DEPTH)


def _check_applies(args: argparse.Namespace) -> None:
    """Options given for a part of the run that does not happen are refused, not ignored."""
    unused = [
        ("--prompt-len", args.prompt_len is not None and (args.prompt is not None or args.prompt_ids is not None),
         "a random prompt (not with --prompt / --prompt-ids)"),
        ("--group-size", args.group_size is not None and args.weights not in ("w4a16", "w8a16"),
         "--weights w4a16 or w8a16"),
        ("--tree-width", args.tree_width is not None and args.speculative == "none", "--speculative"),
        ("--tree-depth", args.tree_depth is not None and args.speculative == "none", "--speculative"),
    ]  # fmt: skip
    for flag, unused_here, needs in unused:
        if unused_here:
            raise CodesignError(f"{flag} applies to {needs}")


def _device(name: str | None) -> str:
    """--device: cpu, cuda or cuda:N on this machine (default: cuda when there is one)."""
    import torch

    if name is None:
        return "cuda" if torch.cuda.is_available() else "cpu"
    try:
        dev = torch.device(name)
    except RuntimeError:
        raise CodesignError(f"--device must be cpu, cuda or cuda:N, got {name!r}") from None
    if dev.type == "cuda" and (not torch.cuda.is_available() or (dev.index or 0) >= torch.cuda.device_count()):
        raise CodesignError(f"--device {name}: this machine's torch sees {torch.cuda.device_count()} CUDA devices")
    if dev.type not in ("cpu", "cuda"):
        raise CodesignError(f"--device must be cpu, cuda or cuda:N, got {name!r}")
    return name


def run(args: argparse.Namespace) -> int:
    import torch

    from codesign.integrations.hf import run_generate
    from codesign.integrations.hf.cache import StepRecord
    from codesign.integrations.hf.costing import StepCoster, run_shape
    from codesign.integrations.hf.kv_formats import default_block_size, parse_kv_format
    from codesign.integrations.hf.latent import (
        LATENT_BLOCK,
        check_latent_model,
        is_latent_model,
        parse_latent_format,
    )
    from codesign.integrations.hf.models import load_model
    from codesign.integrations.hf.support import check_model

    for name in ("batch", "max_new_tokens", "prompt_len", "tree_width", "tree_depth", "layers", "block_size"):
        if getattr(args, name) is not None and getattr(args, name) < 1:  # (None: not given, the default)
            raise CodesignError(f"--{name.replace('_', '-')} must be >= 1")
    _check_applies(args)
    dtype = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[args.dtype]
    device = _device(args.device)
    torch.manual_seed(args.seed)  # random weights too: one seed, one run
    if args.layers is not None and Path(args.model).is_dir():
        raise CodesignError("--layers keeps a catalogue model's first layers; a model folder keeps its own")
    model, tok = load_model(args.model, dtype, device, args.layers, args.random_weights)
    if is_latent_model(model):  # DeepSeek's MLA: a latent cache, None or "fp8"
        spec, bs = parse_latent_format(args.kv_format, check_latent_model(model).dtype), args.block_size or LATENT_BLOCK
    else:
        spec = parse_kv_format(args.kv_format, check_model(model).dtype)
        bs = args.block_size or default_block_size(spec)
    _quantize(model, args, dtype)
    text = model.config.get_text_config()
    ids = _prompt(args, tok, text.vocab_size).to(device)
    limit = getattr(text, "max_position_embeddings", None)
    if limit and ids.shape[1] + args.max_new_tokens > limit:  # (the pool would be sized for it, then the rotary)
        raise CodesignError(f"the prompt's {ids.shape[1]} tokens and --max-new-tokens {args.max_new_tokens} pass "
                            f"the model's max_position_embeddings ({limit})")  # fmt: skip
    coster = None
    if args.design:  # refuse a target the model does not fit before generating
        coster = StepCoster(args.design, run_shape(model, spec, bs))
        n = (ids.shape[1],) * ids.shape[0]
        coster.check_fits(StepRecord("prefill", n, n))
    torch.manual_seed(args.seed)
    r = run_generate(model, ids, spec, block_size=args.block_size, speculative=_speculator(args, dtype, device),
                     max_new_tokens=args.max_new_tokens, do_sample=False, pad_token_id=0,
                     eos_token_id=None, cuda_graph=args.cuda_graph, fuse=args.fuse,
                     compile=_compile(args.compile))  # fmt: skip
    pred = coster.predict(r.steps) if coster else None
    print(_report(args, r, pred, tok, getattr(model, "_codesign_fused", None)))
    if args.json:
        _write_json(args.json, args, r, pred)
    return 0


def _kv_name(cache) -> str:
    """The run's KV format: a CodesignCache's, or a latent cache's ("latent " and its storage)."""
    return f"latent {cache.format_name}" if hasattr(cache, "format_name") else cache.spec.name


def _compile(mode: str | None) -> bool | dict:
    """generate's `compile` for `--compile MODE` (None: not given)."""
    return False if mode is None else True if mode == "default" else {"mode": mode}


def _report(args, r, pred, tok, fused=None) -> str:
    lines = [f"model {args.model}: kv {_kv_name(r.cache)}, weights {args.weights}, block {r.cache.block_size}, "
             f"{r.sequences.shape[0]} row(s)"]  # fmt: skip
    gen = r.sequences[0, r.prompt_cols :].tolist()
    lines.append("tokens: " + (repr(tok.decode(gen)) if tok is not None else " ".join(map(str, gen))))
    head = f"{'step':>4}  {'kind':<8}{'rows':>5}{'new':>6}{'context':>9}{'measured ms':>13}"
    lines.append(head + (f"{'predicted ms':>14}" if pred else ""))
    for i, (s, t) in enumerate(zip(r.steps, r.step_seconds)):
        row = (
            f"{i:>4}  {s.kind:<8}{len(s.q_lens):>5}{sum(s.q_lens):>6}{max(s.context_lens):>9}{t * 1e3:>13.3f}"
        )
        lines.append(row + (f"{pred[i] * 1e3:>14.4f}" if pred else ""))
    total = sum(r.step_seconds)
    lines.append(f"total: {len(r.steps)} steps, {r.new_tokens} new tokens in {total:.3f} s measured "
                 f"({r.new_tokens / total:.1f} tokens/s)")  # fmt: skip
    if pred:
        p = sum(pred)
        lines.append(f"predicted on {args.design}: {p * 1e3:.3f} ms ({r.new_tokens / p:.1f} tokens/s)")
    if r.speculation is not None:
        lines.append(f"speculative: {r.speculation.mean_accepted:.2f} tokens accepted a step a row")
    if fused is not None:
        lines.append(fused.summary())
    return "\n".join(lines)


def _write_json(path: Path, args, r, pred) -> None:
    from codesign.dataflow.reports import write_json_atomic

    steps = [{"kind": s.kind, "q_lens": list(s.q_lens), "context_lens": list(s.context_lens), "measured_s": t,
              **({"predicted_s": pred[i]} if pred else {})}
             for i, (s, t) in enumerate(zip(r.steps, r.step_seconds))]  # fmt: skip
    out = {"model": args.model, "kv_format": _kv_name(r.cache), "weights": args.weights, "design": args.design,
           "sequences": r.sequences.tolist(), "new_tokens": r.new_tokens, "steps": steps}  # fmt: skip
    if r.speculation is not None:
        out["accepted_per_step"] = r.speculation.accepted
    write_json_atomic(out, path)
