"""Host time of a Hugging Face decode step on codesign's cache, without a GPU: what each layer costs the CPU
before any kernel runs (Python, torch dispatch, checks), against transformers' own sdpa path.

At batch 1 an eager decode step is host-bound: the GPU waits for the next launch. This times greedy decoding of a
small random-weight Llama on the CPU with every Triton launch stubbed out (the interpreter's
`InterpretedFunction.run` returns at once, so neither kernel work nor the interpreter's own launch path is counted;
outputs are garbage, only time is measured), and counts the launches per layer (each costs Triton's launcher,
~10-30 us of host time, on a GPU). The sdpa rows do run their (small) CPU attention. `--entry-point`: decode
through the attention entry points at every layer, as before `CodesignCache` planned decode once a forward.
`--tree`: the forwards of tree speculation (an n-gram draft) instead, time a forward (no sdpa row: transformers
has no tree verification). `--cuda-graph`: also a row per format for captured decode (`graphs.GraphDecoding`;
with `--tree`, captured tree forwards) whose replay costs nothing here, so the row is a captured step's host side
alone (its slots, buffer copies and re-plans, the logits processors, the stopping check; a tree step's draft,
verification and compaction too), timed from one replay to the next. `--fuse`: also a row per format with the
model's RMSNorms, rotary embedding and gated MLPs on codesign's layer ops and its q / k / v and gate / up
projections one GEMM each (`fuse.fuse_layers_`), and one with the projections apart (`-fused-unmerged`): fewer
torch ops a layer, 4 more Triton launches (stubbed here: each costs its launcher on a GPU), 3 fewer linear calls.
`--weights w4a16` (or another format `codesign generate --weights` takes): the codesign rows' linears quantized
(`quantize_model_`, group 32 at this size), so their GEMM calls' host side counts too (the sdpa row, first, keeps
the fp32 linears). `--mla`: a small DeepSeek-V3 (multi-head latent attention, dense layers) instead, its latent
cache (`--formats fp32 fp8`) against transformers' own MLA, which expands the history through kv_b_proj every step.

    python bench/hf_host_time.py [--layers 8] [--tokens 32] [--batch 1] [--formats fp32 int8 int4] [--entry-point]
                                 [--tree] [--cuda-graph] [--fuse] [--weights w4a16] [--mla] [--json F]

Times are the process's CPU time on one torch thread (wall time counts a shared VM's stolen time, which moved
rows of one run by up to ~200 us a layer on the development machine). Numbers depend on the CPU; compare rows of
one run (or runs back to back). Formats: fp32, fp16, per-token INT8 / INT4 / INT2 and KIVI INT4 / INT2; bf16
needs a GPU for the Triton writer, and the others calibrate on the values they first write (FP8's scales, Oaken,
mixed), which the stubbed kernels leave unwritten.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

SMALL = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
             head_dim=16, max_position_embeddings=512)  # fmt: skip


FORMATS = ("fp32", "fp16", "int8", "int4", "int2", "int4-kivi", "int2-kivi")  # what runs on the stubs' outputs
DEFAULT_FORMATS = ("fp32", "int8", "int4")
MLA_FORMATS = ("fp32", "fp8")  # a latent cache's (`--mla`)
# --mla: DeepSeek-V3's attention at SMALL's width (4 heads of 16 + 16 query / key and 16 value channels, a latent of
# 32), every layer dense (first_k_dense_replace: the MLP as the Llama rows'), a plain q_proj.
SMALL_MLA = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=4,
                 kv_lora_rank=32, q_lora_rank=None, qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=16,
                 moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1,
                 max_position_embeddings=512)  # fmt: skip


def _stub_launches(counter: list[int]) -> Any:
    """Every interpreted Triton launch returns at once, counted; returns the original launch, to restore."""
    from triton.runtime import interpreter

    def run(self, *args, **kwargs):
        counter.append(1)

    original, interpreter.InterpretedFunction.run = interpreter.InterpretedFunction.run, run
    return original


class _HostOnly:
    """A capturer whose replay is free: `warm` and `capture` run the step (as `graphs.CudaCapture` runs it once
    each), then every replay returns the captured logits, its CPU time appended to `times`."""

    def __init__(self, times: list[float]) -> None:
        self.times = times

    def warm(self, step):
        return step()

    def capture(self, step):
        out = step()

        def replay():
            self.times.append(time.process_time())
            return out

        return replay, out


def _per_forward_ms(model, ids, kv_format: str | None, tokens: int, check: bool, tree: bool,
                    graph: bool = False, fuse: bool = False) -> tuple[float, int]:  # fmt: skip
    """(CPU ms a forward after the prefill, forwards): greedy decoding of `tokens` tokens, or with `tree` tree
    speculation (an n-gram draft, width 2, depth 3: its accepted paths vary with the stubs' garbage, so time is
    counted per forward); `graph`: a captured step's host side (`_HostOnly` replays), from one replay to the next."""
    from codesign.integrations.hf import TreeSpeculator
    from codesign.integrations.hf.graphs import GraphDecoding
    from codesign.integrations.hf.one_call import run_generate

    kw = dict(max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False, pad_token_id=0)
    if fuse:
        kw["fuse"] = True  # (fused before: fuse_layers_' probes are not a step's time)
    if graph:
        times: list[float] = []
        if tree:
            sp = TreeSpeculator("ngram", width=2, depth=3, cuda_graph=_HostOnly(times))
            run_generate(model, ids, kv_format, check=check, eos_token_id=None, speculative=sp, **kw)
        else:
            run_generate(model, ids, kv_format, check=check, custom_generate=GraphDecoding(_HostOnly(times)), **kw)
        return (times[-1] - times[0]) / (len(times) - 1) * 1e3, len(times) - 1
    t0 = time.process_time()
    if kv_format is None:
        model.generate(ids, **kw)
        forwards = tokens
    elif tree:
        run = run_generate(model, ids, kv_format, check=check, eos_token_id=None,
                           speculative=TreeSpeculator("ngram", width=2, depth=3), **kw)  # fmt: skip
        forwards = len(run.steps)
    else:
        run_generate(model, ids, kv_format, check=check, **kw)
        forwards = tokens
    return (time.process_time() - t0) / forwards * 1e3, forwards


def measure(layers: int = 8, tokens: int = 32, formats: tuple[str, ...] = ("fp32", "int8", "int4"),
            repeats: int = 3, entry_point: bool = False, batch: int = 1, tree: bool = False, graph: bool = False,
            fuse: bool = False, weights: str = "none", mla: bool = False) -> dict[str, Any]:  # fmt: skip
    """Rows of host ms a forward (a token in greedy decoding) and us a forward and layer (the best of `repeats`),
    sdpa first (not with `tree`: transformers has no tree verification); launches a forward and layer.
    entry_point: every storage attends through `Storage.attend` (no planned attention); graph: also each
    capturable format's captured decode, its step's host side; fuse: also each format with fused layer ops;
    weights: the codesign rows' linears quantized to that format ("none": fp32); mla: the small DeepSeek-V3."""
    import torch
    from triton.runtime import interpreter

    from codesign.integrations.hf import kv_formats

    launches: list[int] = []
    original, threads = _stub_launches(launches), torch.get_num_threads()
    torch.set_num_threads(1)  # CPU time counts every thread's
    planned = {c: c.planned_run for c in set(kv_formats.STORAGES.values())}
    if entry_point:
        for c in planned:
            c.planned_run = kv_formats.Storage.planned_run
    try:
        rep = _measure(layers, tokens, formats, repeats, launches, batch, tree, graph, fuse, weights, mla)
        return {**rep, "entry_point": entry_point, "weights": weights}
    finally:
        interpreter.InterpretedFunction.run = original
        torch.set_num_threads(threads)
        for c, f in planned.items():
            c.planned_run = f


def _measure(layers: int, tokens: int, formats: tuple[str, ...], repeats: int, launches: list[int], batch: int,
             tree: bool, graph: bool, fuse: bool = False, weights: str = "none",
             mla: bool = False) -> dict[str, Any]:  # fmt: skip
    import torch
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM, LlamaConfig, LlamaForCausalLM

    from codesign.integrations.hf.fuse import fuse_layers_, unfuse_layers_

    torch.manual_seed(0)
    if mla:
        cfg = DeepseekV3Config(num_hidden_layers=layers, first_k_dense_replace=layers, **SMALL_MLA)
        model = DeepseekV3ForCausalLM(cfg).eval()
    else:
        model = LlamaForCausalLM(LlamaConfig(num_hidden_layers=layers, **SMALL)).eval()
    ids = torch.randint(3, 256, (batch, 16))
    rows = []
    # With checks only where no check reads values: the stubbed kernels leave their outputs unwritten (garbage,
    # NaN among it), which a quantized write's finiteness check refuses at the next layer.
    variants = [] if tree else [("hf-sdpa", None, False, False, False)]
    variants += [(f"codesign-{f}", f, False, False, False) for f in formats]
    variants += [(f"codesign-{f}+checks", f, True, False, False) for f in formats if f in ("fp32", "fp16")]
    if graph:
        variants += [(f"codesign-{f}-graph", f, False, True, False) for f in formats
                     if not (tree and "kivi" in f)]  # (KIVI tree forwards are not capturable)
    if fuse:  # (merged: q / k / v and gate / up one GEMM each, fuse_layers_' default)
        variants += [(f"codesign-{f}-fused{m}", f, False, False, m or "merged") for f in formats
                     for m in ("", "-unmerged")]  # fmt: skip
    for name, fmt, check, captured, fused in variants:
        if fmt is not None and weights != "none" and not getattr(model, "_host_time_quantized", False):
            _quantize(model, weights)  # (after the sdpa row, which is first)
        best, per_step = float("inf"), 0.0
        if fused:
            fuse_layers_(model, merge=fused == "merged")
        for _ in range(repeats):
            launches.clear()
            ms, forwards = _per_forward_ms(model, ids, fmt, tokens, check, tree, captured, bool(fused))
            best = min(best, ms)
            per_step = 0.0 if captured else len(launches) / (forwards * layers)  # (a replay's: the GPU's)
        unfuse_layers_(model)
        rows.append({"variant": name, "ms_per_forward": best, "us_per_layer": best * 1e3 / layers,
                     "launches_per_layer": per_step})  # fmt: skip
    for r in rows:
        r["extra_us_per_layer"] = None if tree else r["us_per_layer"] - rows[0]["us_per_layer"]
    return {"layers": layers, "tokens": tokens, "batch": batch, "tree": tree, "config": SMALL_MLA if mla else SMALL,
            "mla": mla, "rows": rows,
            "note": "CPU host time with Triton launches stubbed; compare rows of one run"}  # fmt: skip


def _quantize(model, weights: str) -> None:
    from codesign.integrations.hf.experts import quantize_model_
    from codesign.integrations.hf.quantizer import CodesignQuantConfig

    qc = CodesignQuantConfig(weights, group_size=32 if weights in ("w4a16", "w8a16") else None)
    quantize_model_(model, qc.kernel_config(), lambda m, fqn: qc.converts(fqn))
    model._host_time_quantized = True


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--batch", type=int, default=1, help="rows a decode step (each its own sequence)")
    ap.add_argument("--formats", nargs="+", default=None, help="default fp32 int8 int4 (--mla: fp32 fp8)")
    ap.add_argument("--entry-point", action="store_true", help="attend through the entry points at every layer")
    ap.add_argument("--tree", action="store_true", help="tree speculation's forwards (n-gram draft) instead")
    ap.add_argument("--cuda-graph", action="store_true", help="also captured decode: a step's host side alone")
    ap.add_argument("--fuse", action="store_true", help="also each format with fused layer ops (fuse_layers_)")
    ap.add_argument("--weights", default="none", help="quantize the codesign rows' linears (w4a16, w8a16, ...)")
    ap.add_argument("--mla", action="store_true", help="a small DeepSeek-V3 on its latent cache (--formats fp32 fp8)")
    ap.add_argument("--json", default=None, help="also write the rows here")
    args = ap.parse_args(argv)
    os.environ.setdefault("TRITON_INTERPRET", "1")
    os.environ.setdefault("CODESIGN_BACKEND", "triton")
    if os.environ["TRITON_INTERPRET"] != "1":
        print("hf_host_time: needs TRITON_INTERPRET=1 (it stubs the interpreter's launches)", file=sys.stderr)
        return 2
    clash = [o for o, on in (("--tree", args.tree), ("--cuda-graph", args.cuda_graph), ("--fuse", args.fuse),
                             ("--entry-point", args.entry_point)) if on and args.mla]  # fmt: skip
    if clash:
        print(f"hf_host_time: --mla runs decode on the latent cache only, not {clash[0]}", file=sys.stderr)
        return 2
    known = MLA_FORMATS if args.mla else FORMATS
    args.formats = args.formats or list(MLA_FORMATS if args.mla else DEFAULT_FORMATS)
    bad = [f for f in args.formats if f not in known]
    if bad:
        print(f"hf_host_time: --formats {bad[0]!r}: one of {', '.join(known)} (the module docstring says why)",
              file=sys.stderr)  # fmt: skip
        return 2
    if args.cuda_graph and args.tokens < 5:
        print("hf_host_time: --cuda-graph needs --tokens >= 5 (a prefill, a warm step, a capture, two replays)",
              file=sys.stderr)  # fmt: skip
        return 2
    if args.batch < 1:
        print(f"hf_host_time: --batch must be >= 1, got {args.batch}", file=sys.stderr)
        return 2
    # (imports transformers: after the cheap checks)
    from codesign.integrations.hf.quantizer import WEIGHT_FORMATS

    if args.weights != "none" and args.weights not in WEIGHT_FORMATS:
        print(f"hf_host_time: --weights {args.weights!r}: none or one of {', '.join(WEIGHT_FORMATS)}", file=sys.stderr)
        return 2
    rep = measure(args.layers, args.tokens, tuple(args.formats), entry_point=args.entry_point, batch=args.batch,
                  tree=args.tree, graph=args.cuda_graph, fuse=args.fuse, weights=args.weights,
                  mla=args.mla)  # fmt: skip
    print(f"{'variant':<30} {'ms/forward':>10} {'us/layer':>9} {'extra':>8} {'launches/layer':>15}")
    for r in rep["rows"]:
        extra = "" if r["extra_us_per_layer"] is None else f"{r['extra_us_per_layer']:.0f}"
        print(f"{r['variant']:<30} {r['ms_per_forward']:10.2f} {r['us_per_layer']:9.0f} {extra:>8} "
              f"{r['launches_per_layer']:15.2f}")  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rep, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
