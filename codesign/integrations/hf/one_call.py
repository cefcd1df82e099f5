"""One call: `generate(model, input_ids, kv_format=..., **generate_kwargs)` runs transformers' `generate` on
codesign's paged attention with a `CodesignCache` sized for the run (and, with `speculative=`, the tree
speculative loop). Weights quantized with `codesign.kernels.quantize_` (or loaded through the "codesign"
quantizer) compose with it: the linears are ours, the attention and cache too.

Everything that can be refused is refused before generation starts: an unsupported model, a format the
head_dim does not allow, a pool too small for the run, a draft of another vocabulary.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from transformers import StoppingCriteria, StoppingCriteriaList

from codesign.integrations.hf import state_trees
from codesign.integrations.hf._compat import cache_kwarg
from codesign.integrations.hf.cache import CodesignCache, StepRecord, blocks_needed, pool_blocks
from codesign.integrations.hf.fuse import fuse_layers_
from codesign.integrations.hf.graphs import CAPTURES, GraphDecoding, compile_options
from codesign.integrations.hf.kv_formats import default_block_size, parse_kv_format
from codesign.integrations.hf.latent import (
    LATENT_BLOCK,
    CodesignLatentCache,
    check_latent_model,
    is_latent_model,
    latent_pool_blocks,
    latent_tree_blocks,
    parse_latent_format,
)
from codesign.integrations.hf.speculative import SpeculationStats, TreeSpeculator
from codesign.integrations.hf.support import (
    ATTN_NAME,
    check_model,
    layer_chunks,
    layer_windows,
    linear_layers,
    text_config,
)
from codesign.specs import CodesignError
from codesign.specs.errors import check_positive_int


class StepClock(StoppingCriteria):
    """Never stops generation; records the time of each call (once per forward, after its logits)."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def __call__(self, input_ids: torch.LongTensor, scores, **kwargs) -> torch.BoolTensor:
        if input_ids.is_cuda:
            torch.cuda.synchronize(input_ids.device)
        self.times.append(time.perf_counter())
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


@dataclass
class GenerationRun:
    """What one `run_generate` did: the output of transformers' generate, the cache (with its per-forward
    `steps`), the wall time of each forward (prefill first) and, for speculative runs, the acceptance."""

    output: object
    cache: CodesignCache | CodesignLatentCache
    steps: list[StepRecord]
    step_seconds: list[float]
    prompt_cols: int
    seconds: float
    speculation: SpeculationStats | None = None

    @property
    def sequences(self) -> torch.Tensor:
        return self.output if isinstance(self.output, torch.Tensor) else self.output.sequences

    @property
    def new_tokens(self) -> int:
        """Tokens generated over all rows (the columns after the prompt)."""
        return self.sequences[:, self.prompt_cols :].numel()


def _max_new_tokens(model, prompt_cols: int, kwargs: dict) -> int:
    """The run's new tokens a row (generate's keywords, else the generation config), refused where there are none
    or where the prompt and they pass the model's max_position_embeddings (positions it was not trained on; the pool
    would be sized for them too)."""
    gc = model.generation_config
    if kwargs.get("max_new_tokens") is not None:
        max_new = check_positive_int("max_new_tokens", kwargs["max_new_tokens"])
    elif kwargs.get("max_length") is not None:
        max_new = check_positive_int("max_length", kwargs["max_length"]) - prompt_cols
    elif gc.max_new_tokens is not None:
        max_new = int(gc.max_new_tokens)
    else:
        max_new = int(gc.max_length or 20) - prompt_cols
    if max_new < 1:
        raise CodesignError(f"the run leaves no new tokens: a prompt of {prompt_cols} columns, {max_new} new a row "
                            "(set max_new_tokens)")  # fmt: skip
    limit = getattr(text_config(model), "max_position_embeddings", None)
    if isinstance(limit, int) and prompt_cols + max_new > limit:
        raise CodesignError(
            f"a prompt of {prompt_cols} columns and {max_new} new tokens pass the model's max_position_embeddings "
            f"({limit})"
        )
    return max_new


def _check_options(**options) -> None:
    """generate's own keywords: bools, a TreeSpeculator, positive block and pool sizes."""
    for name in ("fuse", "share_prefix", "check"):
        if not isinstance(options[name], bool):
            raise CodesignError(f"{name} must be True or False, got {options[name]!r}")
    if options["speculative"] is not None and not isinstance(options["speculative"], TreeSpeculator):
        raise CodesignError(f"speculative must be a TreeSpeculator or None, got {options['speculative']!r}")
    for name in ("block_size", "num_blocks"):
        if options[name] is not None:
            check_positive_int(name, options[name])


def run_generate(model, input_ids: torch.Tensor, kv_format: str | None = None, *,
                 attention_mask: torch.Tensor | None = None, block_size: int | None = None,
                 num_blocks: int | None = None, speculative: TreeSpeculator | None = None,
                 share_prefix: bool = True, check: bool = True, cuda_graph: bool | str = False,
                 compile: bool | dict = False, fuse: bool = False, kv_scale: float | None = None,
                 **generate_kwargs) -> GenerationRun:  # fmt: skip
    """`generate` with its record (see `generate`)."""
    latent = is_latent_model(model)
    layout = check_latent_model(model) if latent else check_model(model)
    _check_options(fuse=fuse, share_prefix=share_prefix, check=check, speculative=speculative,
                   block_size=block_size, num_blocks=num_blocks)  # fmt: skip
    if latent:
        return _run_latent(model, layout.dtype, input_ids, kv_format, attention_mask, block_size, num_blocks,
                           kv_scale, check, share_prefix, speculative,
                           dict(cuda_graph=cuda_graph not in (False, None), compile=compile not in (False, None),
                                fuse=fuse), generate_kwargs)  # fmt: skip
    if kv_scale is not None:
        raise CodesignError("kv_scale is for a latent (MLA) model's fp8 cache; per-head formats find their scales")
    spec = parse_kv_format(kv_format, layout.dtype)
    _check_ids(model, input_ids, attention_mask)
    _check_layer_kinds(model, layout, speculative, cuda_graph, compile)
    if speculative is not None:
        block_size, num_blocks = _speculator_pool(speculative, spec, layout.dtype, block_size, num_blocks)
    graphs = _graph_decoding(model, cuda_graph, compile, spec, speculative, generate_kwargs)
    bs = block_size or default_block_size(spec)
    cols, rows, max_new, extra = _run_rows(model, input_ids, attention_mask, generate_kwargs)
    if speculative is not None:
        speculative.block_size, speculative.kv_format = bs, spec
        need, need_window = speculative.blocks_for(rows, cols + max_new, model)
    else:
        windows = layer_windows(text_config(model), layout.layers)
        need, need_window = pool_blocks(windows, spec, rows, [n + max_new + extra for n in rows], extra, bs)
    nb = _pool_size(num_blocks, need, blocks_needed(rows, bs), bs, max_new)
    cache = CodesignCache(model, spec, num_blocks=nb, block_size=bs, check=check,
                          window_num_blocks=need_window if num_blocks is None else None)  # fmt: skip
    if share_prefix and spec.shares_prompt_blocks:
        _share_prefixes(cache, input_ids, attention_mask, rows)
    if fuse:
        fuse_layers_(model)
    return _generate_on(model, cache, input_ids, attention_mask, generate_kwargs, speculative or graphs, cols,
                        speculative)  # fmt: skip


def _run_latent(model, dtype, input_ids, kv_format, attention_mask, block_size, num_blocks, kv_scale, check,
                share_prefix, speculative, asked, generate_kwargs) -> GenerationRun:  # fmt: skip
    """`run_generate` of an MLA model: a CodesignLatentCache sized for the run (what it does not serve, refused)."""
    refused = [name for name, on in asked.items() if on]
    if refused:
        raise CodesignError(f"{', '.join(refused)}: not served for latent (MLA) models (captured steps and fused "
                            "layers run over per-head caches)")  # fmt: skip
    fmt = parse_latent_format(kv_format, dtype)
    _check_ids(model, input_ids, attention_mask)
    if speculative is not None:
        own = speculative.kv_format
        if own is not None and parse_latent_format(own, dtype) != fmt:
            raise CodesignError(f"kv_format={fmt!r} but the TreeSpeculator was built with kv_format={own!r}: give "
                                "it once")  # fmt: skip
        block_size, num_blocks = _agree(speculative, block_size, num_blocks)
    bs = block_size or LATENT_BLOCK
    cols, rows, max_new, extra = _run_rows(model, input_ids, attention_mask, generate_kwargs)
    if speculative is not None:
        speculative.block_size, speculative.kv_format = bs, fmt
        need = latent_tree_blocks(rows, cols + max_new, speculative.parents, bs)
    else:
        need = latent_pool_blocks([n + max_new + extra for n in rows], bs)
    nb = _pool_size(num_blocks, need, blocks_needed(rows, bs), bs, max_new)
    cache = CodesignLatentCache(model, fmt, num_blocks=nb, block_size=bs, kv_scale=kv_scale, check=check)
    if share_prefix:
        _share_prefixes(cache, input_ids, attention_mask, rows)
    return _generate_on(model, cache, input_ids, attention_mask, generate_kwargs, speculative, cols, speculative)


def _share_prefixes(cache, input_ids, attention_mask, rows: list[int]) -> None:
    """Plan the cache's first forward to share common prompt prefixes between its rows (beams expand each prompt)."""
    if len(rows) > 1:
        expand = len(rows) // input_ids.shape[0]
        mask = None if attention_mask is None else attention_mask.repeat_interleave(expand, 0)
        cache.share_prefixes(input_ids.repeat_interleave(expand, 0), mask)


def _run_rows(model, input_ids, attention_mask, generate_kwargs) -> tuple[int, list[int], int, int]:
    """(prompt columns, each cache row's prompt tokens (beams and returned sequences expand a row), new tokens a
    row, tokens a forward appends at most)."""
    if "cache" in generate_kwargs or "past_key_values" in generate_kwargs:
        raise CodesignError(
            "generate builds its own CodesignCache: pass kv_format / num_blocks instead of a cache"
        )
    cols = input_ids.shape[1]
    pads = [0] * input_ids.shape[0] if attention_mask is None else (attention_mask == 0).sum(1).tolist()
    expand = max(
        int(generate_kwargs.get("num_beams", 1) or 1),
        int(generate_kwargs.get("num_return_sequences", 1) or 1),
    )
    rows = [cols - p for p in pads for _ in range(expand)]
    max_new = _max_new_tokens(model, cols, generate_kwargs)
    extra = int(generate_kwargs.get("prompt_lookup_num_tokens") or 0) + 1
    return cols, rows, max_new, extra


def _pool_size(num_blocks: int | None, need: int, need_prompt: int, bs: int, max_new: int) -> int:
    """The pool's blocks: `need` unless given; a given pool too small for the prompt or the run is refused."""
    nb = need if num_blocks is None else num_blocks
    if nb < need_prompt:
        raise CodesignError(
            f"a pool of {nb} blocks of {bs} tokens cannot hold the prompt ({need_prompt} blocks)"
        )
    if nb < need:
        raise CodesignError(
            f"a pool of {nb} blocks of {bs} tokens cannot hold this run: the prompt and {max_new} new tokens a "
            f"row need {need}"
        )
    return nb


def _generate_on(model, cache, input_ids, attention_mask, generate_kwargs, custom, cols, speculative) -> GenerationRun:
    """transformers' generate over `cache` with codesign_paged attention (the user's put back after), timed per
    forward; `custom`: a custom_generate loop (a speculator or captured decoding)."""
    cfg = text_config(model)
    prev = cfg._attn_implementation
    clock = StepClock()
    stops = StoppingCriteriaList([*generate_kwargs.pop("stopping_criteria", []), clock])
    model.set_attn_implementation(ATTN_NAME)
    try:
        kw = dict(
            generate_kwargs,
            attention_mask=attention_mask,
            stopping_criteria=stops,
            **{cache_kwarg(model): cache},
        )
        if custom is not None:
            kw["custom_generate"] = custom
        t0 = time.perf_counter()
        out = model.generate(input_ids, **kw)
        seconds = time.perf_counter() - t0
    finally:
        model.set_attn_implementation(prev)
    if speculative is not None:
        step_s = list(speculative.stats.step_seconds)
    else:
        step_s = [b - a for a, b in zip([t0, *clock.times[:-1]], clock.times)]
    return GenerationRun(out, cache, list(cache.steps), step_s, cols, seconds,
                         speculative.stats if speculative else None)  # fmt: skip


def _check_ids(model, input_ids, attention_mask) -> None:
    """input_ids: a non-empty [batch, tokens] integer tensor of ids in the vocabulary (one host sync);
    attention_mask: None or 0 / 1 of the same shape (left padding: the cache refuses other padding)."""
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
        raise CodesignError(
            f"input_ids must be a [batch, tokens] tensor, got {getattr(input_ids, 'shape', input_ids)}"
        )
    if input_ids.dtype.is_floating_point or input_ids.dtype.is_complex or input_ids.dtype == torch.bool:
        raise CodesignError(f"input_ids must hold integer token ids, got {input_ids.dtype}")
    if input_ids.numel() == 0:
        raise CodesignError(f"input_ids is empty (shape {tuple(input_ids.shape)})")
    vocab = text_config(model).vocab_size
    lo, hi = int(input_ids.min()), int(input_ids.max())
    if lo < 0 or hi >= vocab:
        raise CodesignError(f"input_ids must lie in [0, {vocab}) (the model's vocab_size), got [{lo}, {hi}]")
    if attention_mask is None:
        return
    if not isinstance(attention_mask, torch.Tensor) or tuple(attention_mask.shape) != tuple(input_ids.shape):
        raise CodesignError(
            f"attention_mask must be a tensor of input_ids' shape {tuple(input_ids.shape)}, got "
            f"{tuple(attention_mask.shape) if isinstance(attention_mask, torch.Tensor) else attention_mask!r}"
        )
    if attention_mask.dtype.is_floating_point or not bool(((attention_mask == 0) | (attention_mask == 1)).all()):
        raise CodesignError("attention_mask must hold 0 (padding) and 1 (tokens) as integers or bools")
    empty = torch.nonzero(attention_mask.sum(1) == 0).flatten().tolist()
    if empty:
        raise CodesignError(f"attention_mask rows {empty} hold no token (every column padding)")


def _speculator_pool(speculative, spec, dtype, block_size, num_blocks) -> tuple[int | None, int | None]:
    """(block_size, num_blocks) of a speculative run: generate's and the speculator's own, which must agree where
    both are given (generate sets its format and block size on the speculator; a different one is refused, not
    overridden)."""
    own = speculative.kv_format
    if own is not None and parse_kv_format(own, dtype).name != spec.name:
        raise CodesignError(
            f"kv_format={spec.name!r} but the TreeSpeculator was built with kv_format={own!r}: give it once"
        )
    return _agree(speculative, block_size, num_blocks)


def _agree(speculative, block_size, num_blocks) -> tuple[int | None, int | None]:
    """generate's and the speculator's block size and pool, refused where both are given and differ."""
    for name, mine, theirs in (("block_size", block_size, speculative.block_size),
                               ("num_blocks", num_blocks, speculative.num_blocks)):  # fmt: skip
        if mine is not None and theirs is not None and mine != theirs:
            raise CodesignError(f"{name}={mine} but the TreeSpeculator was built with {name}={theirs}: give it once")
    return (block_size if block_size is not None else speculative.block_size,
            num_blocks if num_blocks is not None else speculative.num_blocks)  # fmt: skip


def _check_layer_kinds(model, layout, speculative, cuda_graph, compile) -> None:
    """A model with chunked-attention (Llama 4) or linear-attention (Qwen3.5, Mamba) layers refuses captured steps,
    and trees unless its linear layers are Gated DeltaNet's or Mamba-2's and the tree fits their kernels
    (`state_trees.check_tree`), before generation (the cache would refuse them at their first tree forward)."""
    cfg = text_config(model)
    chunked, linear = any(layer_chunks(cfg, layout.layers)), any(linear_layers(cfg, layout.layers))
    if not (chunked or linear):
        return
    trees = speculative is not None and chunked
    asked = [name for name, on in (("speculative", trees), ("cuda_graph", cuda_graph),
                                   ("compile", compile)) if on]  # fmt: skip
    if asked:
        raise CodesignError(f"{', '.join(asked)}: not served over chunked-attention (Llama 4) or linear-attention "
                            f"(Qwen3.5, state-space hybrids) layers ({layout.family})")  # fmt: skip
    if speculative is not None:
        state_trees.check_tree(state_trees.state_layers(model), layout.family, len(speculative.parents))


def _graph_decoding(model, cuda_graph, compile, spec, speculative, generate_kwargs) -> GraphDecoding | None:
    """The captured loop `cuda_graph` and `compile` ask for (cuda_graph True: CUDA graphs; "tape": the CPU stand-in;
    compile: torch.compile of the step), refused before generation where it cannot run: decode steps
    (`GraphDecoding`), or a TreeSpeculator's tree forwards (both set on it)."""
    if cuda_graph is not True and cuda_graph not in (False, None, *CAPTURES):
        raise CodesignError(f"cuda_graph must be True, False or 'tape', got {cuda_graph!r}")
    capture = None if cuda_graph is False or cuda_graph is None else "cuda" if cuda_graph is True else cuda_graph
    options = compile_options(compile, capture)
    if capture is None and options is None:
        return None
    trees = speculative is not None
    spec.check_capturable(trees)
    clash = [k for k in ("custom_generate", "prompt_lookup_num_tokens", "assistant_model") if generate_kwargs.get(k)]
    if clash or int(generate_kwargs.get("num_beams", 1) or 1) != 1:
        what = "cuda_graph" if options is None else "compile"
        raise CodesignError(f"{what} runs its own loop: it does not combine with {clash or 'num_beams'}")
    if capture == "cuda" and model.device.type != "cuda":
        raise CodesignError(f"cuda_graph=True needs a model on a CUDA device, not {model.device} ('tape': the CPU "
                            "stand-in that checks a step is capturable)")  # fmt: skip
    if trees:
        speculative.cuda_graph, speculative.compile = capture, options
        return None
    return GraphDecoding(capture, compile)


def generate(model, input_ids: torch.Tensor, kv_format: str | None = None, **kwargs):
    """transformers' `model.generate(input_ids, **kwargs)` on codesign's paged attention and a CodesignCache
    holding `kv_format` (None: plain K/V in the model's dtype; see `kv_formats` for the names).

    Keywords of ours: attention_mask (left padding only), block_size (default 16, 32 for KIVI), num_blocks
    (default: sized for the prompt and max_new_tokens), speculative (a TreeSpeculator: tree speculative
    decoding), cuda_graph (True: every decode step, or with speculative every tree forward, replays one forward
    captured in a CUDA graph, `graphs`; decode over every format, trees over plain, per-token INT and FP8), compile
    (True or a dict of torch.compile's keywords: every decode step, or with speculative every tree forward, runs one
    compiled forward, the cache's side one op a layer; with cuda_graph True captured in ours, with
    mode="reduce-overhead" in Inductor's), share_prefix (rows with a common prompt prefix share its full blocks),
    check (the kernels' data checks), kv_scale (a DeepSeek model's "fp8" latent cache: e4m3 codes of x / kv_scale,
    default 1.0; DeepSeek-V2/V3 run on a `CodesignLatentCache`, kv_format None or "fp8"), fuse (the model's
    RMSNorms, rotary embedding and gated MLPs on codesign's one-launch ops, its q / k / v and gate / up projections
    one GEMM each, `fuse.fuse_layers_`; it stays fused).
    Everything else goes to transformers' generate. Returns what it returns.
    """
    return run_generate(model, input_ids, kv_format, **kwargs).output
