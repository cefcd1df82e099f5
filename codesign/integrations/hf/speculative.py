"""Tree speculative decoding as a `generate(custom_generate=...)` loop over a CodesignCache.

Each step: a draft proposes a token tree per row (one parent array for every row; node 0 is the root, the
last token accepted, whose K/V are not cached yet), the target runs ONE forward over all nodes through tree
attention (`CodesignCache.set_tree`; node i at position prefix + depth(i)), `verify_tree` accepts the longest
path the target agrees with (greedy, or SpecInfer's multi-step speculative sampling, which keeps the target's
distribution), and the cache is compacted to the root and the accepted nodes (`CodesignCache.accept_tree`).
The row emits the accepted tokens plus one bonus token from the target, which becomes the next root.

Drafts: `NGramDraft` (prompt lookup: continuations of the latest earlier occurrences of the context's last
n-gram; deterministic, so SpecInfer sees it as a one-hot draft and can accept only the first child of a node)
and `ModelDraft` (a smaller transformers model of the same vocabulary, on a plain CodesignCache of its own;
each tree level is one batched draft forward, rows forked per node so branches share the cached context).

The target's logits at every node go through the generation's logits processors with that node's path
appended to the context (so repetition penalties, EOS suppression, temperature, top-k see what plain
generation would), then greedy verification takes their argmax, stochastic verification samples them.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from codesign.integrations.hf import _kernels as K
from codesign.integrations.hf.cache import CROP_MARGIN, CodesignCache, pool_blocks
from codesign.integrations.hf.forwards import forward_rows, prefill
from codesign.integrations.hf.graphs import CapturedForward, capturer, check_capture, compile_options
from codesign.integrations.hf.kv_formats import default_block_size, parse_kv_format
from codesign.integrations.hf.latent import (
    LATENT_BLOCK,
    CodesignLatentCache,
    check_latent_model,
    is_latent_model,
    latent_tree_blocks,
)
from codesign.integrations.hf.support import ATTN_NAME, check_model, layer_windows, linear_layers, text_config
from codesign.specs import CodesignError
from codesign.specs.errors import check_nonneg_int, check_positive_int

MODES = ("greedy", "stochastic")


def chain_tree(width: int, depth: int) -> list[int]:
    """Parent array of `width` chains of `depth` tokens each below the root (1 + width * depth nodes)."""
    check_positive_int("tree width", width)
    check_positive_int("tree depth", depth)
    if 1 + width * depth > MAX_TREE_NODES:
        raise CodesignError(
            f"a tree of width {width} and depth {depth} has {1 + width * depth} nodes, more than {MAX_TREE_NODES}"
        )
    parents = [-1]
    for _ in range(width):
        parents += [0] + [len(parents) + i for i in range(depth - 1)]
    return parents


# Nodes a verification tree may have: each is a target token every step (published trees hold tens to a few
# hundred); a larger one is refused before anything is built for it.
MAX_TREE_NODES = 1024
DEFAULT_BLOCK = 16  # a model draft's block size when the speculator gives none


def _children(parents: Sequence[int]) -> list[list[int]]:
    ch: list[list[int]] = [[] for _ in parents]
    for i, p in enumerate(parents[1:], start=1):
        ch[p].append(i)
    return ch


class NGramDraft:
    """Prompt lookup: a node's children continue the latest earlier occurrences of the last `max_ngram`
    (down to 1) tokens of the context and the node's path, distinct first tokens first."""

    def __init__(self, max_ngram: int = 3) -> None:
        self.max_ngram = check_positive_int("max_ngram", max_ngram)

    def start(self, model, prompts: list[list[int]], input_ids, attention_mask, num_blocks: int) -> None:
        """Nothing to prefill."""

    def propose(self, contexts, roots, parents, vocab: int, mode: str, temperature: float, generator):
        """(tokens `[R, n]`, draft probabilities `[R, n, vocab]` one-hot on each node's first child or None)."""
        ch = _children(parents)
        toks = torch.zeros(len(contexts), len(parents), dtype=torch.long)
        for r, (ctx, root) in enumerate(zip(contexts, roots)):
            seq = {0: [*ctx, root]}
            toks[r, 0] = root
            for u in range(len(parents)):
                if ch[u]:
                    cand = self._continuations(seq[u], len(ch[u]))
                    for c, t in zip(ch[u], cand):
                        toks[r, c] = t
                        seq[c] = [*seq[u], t]
        probs = None
        if mode == "stochastic":
            probs = torch.zeros(len(contexts), len(parents), vocab)
            for u, kids in enumerate(ch):
                if kids:
                    probs[torch.arange(len(contexts)), u, toks[:, kids[0]]] = 1.0
        return toks, probs

    def _continuations(self, seq: list[int], m: int) -> list[int]:
        out: list[int] = []
        for n in range(min(self.max_ngram, len(seq) - 1), 0, -1):
            tail = seq[-n:]
            for i in range(len(seq) - n - 1, -1, -1):  # latest occurrence first
                if seq[i : i + n] == tail and seq[i + n] not in out:
                    out.append(seq[i + n])
                    if len(out) == m:
                        return out
        return out + [seq[-1]] * (m - len(out))

    def accept(self, committed: list[list[int]], target_lengths: list[int]) -> None:
        """Nothing: the contexts carry everything."""

    def select(self, rows: list[int]) -> None:
        """Nothing: stateless."""


class ModelDraft:
    """A smaller transformers model proposing each node's children from its own next-token distribution:
    greedy, its top-m distinct tokens; stochastic, m i.i.d. samples of softmax(logits / temperature)."""

    def __init__(self, model, block_size: int = DEFAULT_BLOCK) -> None:
        if is_latent_model(model):
            check_latent_model(model)
        else:
            layout = check_model(model)
            if any(linear_layers(text_config(model), layout.layers)):
                raise CodesignError(f"a draft model with linear-attention layers ({layout.family}) is not served: its "
                                    "proposals fork and rewind rows, which those layers' states cannot; use an "
                                    "attention-only draft or 'ngram'")  # fmt: skip
        self.model, self.block_size = model, check_positive_int("block_size", block_size)
        # A proposal rewinds its cache across one forward per tree level: a sliding window must keep those.
        self.crop_margin = CROP_MARGIN
        self.cache: CodesignCache | CodesignLatentCache | None = None
        self._prev_attn: str | None = None

    def start(self, target, prompts, input_ids, attention_mask, num_blocks: int) -> None:
        v_t, v_d = text_config(target).vocab_size, text_config(self.model).vocab_size
        if v_t != v_d:
            raise CodesignError(f"the draft's vocabulary ({v_d} tokens) is not the target's ({v_t} tokens)")
        cfg = text_config(self.model)
        self._prev_attn = cfg._attn_implementation
        self.model.set_attn_implementation(ATTN_NAME)
        # Plain K/V in the draft's dtype: its forks are rewound across forwards, which every plain format allows.
        if is_latent_model(self.model):
            self.cache = CodesignLatentCache(self.model, None, num_blocks=num_blocks, block_size=self.block_size)
        else:
            self.cache = CodesignCache(self.model, None, num_blocks=num_blocks, block_size=self.block_size,
                                       crop_margin=self.crop_margin)  # fmt: skip
        prefill(self.model, self.cache, input_ids, attention_mask)

    def finish(self) -> None:
        if self._prev_attn is not None:
            self.model.set_attn_implementation(self._prev_attn)

    def propose(self, contexts, roots, parents, vocab: int, mode: str, temperature: float, generator):
        cache, ch = self.cache, _children(parents)
        lens = cache.row_lengths()
        r_n, n = len(roots), len(parents)
        toks = torch.zeros(r_n, n, dtype=torch.long)
        toks[:, 0] = torch.tensor(roots)
        probs = torch.zeros(r_n, n, vocab) if mode == "stochastic" else None
        depth = K.tree_depths(parents)
        level = [0]  # nodes whose next-token distribution this forward computes, for every row
        row_of = {0: list(range(r_n))}  # node -> cache row of each request, holding the path up to the node
        while level:
            batch = [(u, r) for u in level for r in range(r_n)]
            cache.select_rows([row_of[parents[u]][r] if u else r for u, r in batch])
            logits = forward_rows(self.model, cache, [[int(toks[r, u])] for u, r in batch],
                                  [lens[r] + depth[u] for u, r in batch])[:, -1].float().cpu()  # fmt: skip
            for i, (u, r) in enumerate(batch):
                m = len(ch[u])
                if mode == "greedy":
                    kids = torch.topk(logits[i], m).indices
                else:
                    q = torch.softmax(logits[i] / temperature, -1)
                    probs[r, u] = q
                    kids = torch.multinomial(q, m, replacement=True, generator=generator)
                for c, t in zip(ch[u], kids.tolist()):
                    toks[r, c] = t
            for u in level:
                row_of[u] = [level.index(u) * r_n + r for r in range(r_n)]
            level = [c for u in level for c in ch[u] if ch[c]]
        # Back to one row per request holding its context only.
        last = batch[-1][0]
        cache.select_rows([row_of[last][r] for r in range(r_n)])
        cache.rewind(lens)
        return toks, probs

    def accept(self, committed: list[list[int]], target_lengths: list[int]) -> None:
        """Cache the committed tokens (root and accepted) of each row; the draft then holds the target's context."""
        forward_rows(self.model, self.cache, committed, self.cache.row_lengths())
        if self.cache.row_lengths() != target_lengths:
            raise CodesignError(
                f"draft and target contexts diverged: {self.cache.row_lengths()} vs {target_lengths} tokens"
            )

    def select(self, rows: list[int]) -> None:
        self.cache.select_rows(rows)


@dataclass
class SpeculationStats:
    """Per step: tokens accepted from the tree in each active row (the bonus token not counted), and the
    wall time of each step (prefill first)."""

    accepted: list[list[int]] = field(default_factory=list)
    step_seconds: list[float] = field(default_factory=list)

    @property
    def mean_accepted(self) -> float:
        n = sum(len(a) for a in self.accepted)
        return sum(map(sum, self.accepted)) / n if n else 0.0


class TreeSpeculator:
    """`model.generate(ids, custom_generate=TreeSpeculator(...), max_new_tokens=...)`: tree speculative decoding.

    draft: "ngram", an NGramDraft / ModelDraft, or a transformers model (wrapped in ModelDraft); width/depth: the
    chain tree `chain_tree(width, depth)`, or `parents`, any parent array; mode: "greedy" or "stochastic" (the
    verification; "stochastic" needs do_sample generation); kv_format / block_size / num_blocks: the target's
    CodesignCache (num_blocks None: sized for the run); seed: the verification's random draws; cuda_graph: the
    target's tree forwards replay one captured forward a batch size (`graphs.CapturedForward`; True: CUDA graphs,
    "tape": the CPU stand-in, or a capturer; plain, per-token INT and FP8 caches); compile (True or a dict of
    torch.compile's keywords, `graphs.compile_options`): those tree forwards run one compiled forward a batch size
    (the cache's side one op a layer, `traced`), replayed in our CUDA graph with cuda_graph True, else each run as
    compiled (with mode="reduce-overhead" in Inductor's CUDA graphs).
    """

    def __init__(self, draft="ngram", width: int = 2, depth: int = 3, mode: str = "greedy", *,
                 parents: Sequence[int] | None = None, kv_format: str | None = None, block_size: int | None = None,
                 num_blocks: int | None = None, seed: int | None = None, cuda_graph=False,
                 compile: bool | dict | None = None) -> None:  # fmt: skip
        if mode not in MODES:
            raise CodesignError(f"mode must be one of {MODES}, got {mode!r}")
        if cuda_graph not in (False, None, True):
            check_capture(cuda_graph)
        self.cuda_graph = cuda_graph
        self.compile = compile_options(compile, self._capture_name())
        self.parents = K.check_parents(parents) if parents is not None else chain_tree(width, depth)
        if len(self.parents) < 2:
            raise CodesignError("the tree needs at least one node below the root")
        if len(self.parents) > MAX_TREE_NODES:
            raise CodesignError(f"parents has {len(self.parents)} nodes, more than {MAX_TREE_NODES}")
        if kv_format is not None and not isinstance(kv_format, str):
            raise CodesignError(f"kv_format must be a format name or None, got {kv_format!r}")
        for name, v in (("block_size", block_size), ("num_blocks", num_blocks)):
            if v is not None:
                check_positive_int(name, v)
        if seed is not None:
            check_nonneg_int("seed", seed)
        if isinstance(draft, str) and draft == "ngram":
            draft = NGramDraft()
        elif isinstance(draft, str):
            raise CodesignError(
                f"draft must be 'ngram', an NGramDraft / ModelDraft or a transformers model, got {draft!r}"
            )
        elif not isinstance(draft, NGramDraft | ModelDraft):
            draft = ModelDraft(draft, block_size=block_size or DEFAULT_BLOCK)
        if isinstance(draft, ModelDraft):
            draft.crop_margin = CROP_MARGIN + max(K.tree_depths(self.parents))
        self.draft, self.mode, self.kv_format = draft, mode, kv_format
        self.block_size, self.num_blocks, self.seed = block_size, num_blocks, seed
        self.stats = SpeculationStats()
        self.captures = 0  # forwards the last call captured (one a batch size it ran)
        self.cache: CodesignCache | CodesignLatentCache | None = None

    def blocks_for(self, prompt_lens: list[int], max_length: int, model=None,
                   block_size: int | None = None) -> tuple[int, int | None]:  # fmt: skip
        """(num_blocks, window_num_blocks) of the target's pool for a run: every row up to max_length plus one
        tree and two blocks a row for copies; the target's sliding layers (`model`'s windows) hold only the
        window's blocks, as generate's pool does (`cache.pool_blocks`)."""
        n, rows = len(self.parents), len(prompt_lens)
        windows, spec, bs = [None], None, block_size or self.block_size or DEFAULT_BLOCK
        if model is not None and is_latent_model(model):  # every node its own sequence during a tree forward
            return latent_tree_blocks(prompt_lens, max_length, self.parents, bs), None
        if model is not None:
            layout = check_model(model)
            windows = layer_windows(text_config(model), layout.layers)
            spec = parse_kv_format(self.kv_format, layout.dtype)
            bs = self.target_block_size(model)
        return pool_blocks(windows, spec, prompt_lens, [max_length + n] * rows, n, bs, spare_per_row=2)

    def target_block_size(self, model) -> int:
        """The target cache's block size: the speculator's, else its format's default (KIVI 32, else 16)."""
        if is_latent_model(model):
            return self.block_size or LATENT_BLOCK
        return self.block_size or default_block_size(parse_kv_format(self.kv_format, check_model(model).dtype))

    def draft_blocks(self, prompt_lens: list[int], max_length: int) -> int:
        """A model draft's pool: its rows fork per tree node and rewind, so it is sized for the whole run."""
        own = self.draft.block_size if isinstance(self.draft, ModelDraft) else None
        return self.blocks_for(prompt_lens, max_length, block_size=own)[0]

    def __call__(self, model, input_ids, logits_processor=None, stopping_criteria=None, generation_config=None,
                 **model_kwargs):  # fmt: skip
        cfg = generation_config
        if self.mode == "stochastic" and not getattr(cfg, "do_sample", False):
            raise CodesignError("stochastic verification samples: generate with do_sample=True")
        if self.mode == "greedy" and getattr(cfg, "do_sample", False):
            raise CodesignError("greedy verification: generate with do_sample=False (or mode='stochastic')")
        if getattr(cfg, "num_beams", 1) != 1:
            raise CodesignError("tree speculative decoding does not combine with beam search")
        if text_config(model)._attn_implementation != ATTN_NAME:
            raise CodesignError(f"the target must run attn_implementation={ATTN_NAME!r}")
        widest, vocab = max(len(c) for c in _children(self.parents)), text_config(model).vocab_size
        if widest > vocab:
            raise CodesignError(f"a tree node has {widest} children, more than the vocabulary's {vocab} tokens")
        capture = None
        self.compile = compile_options(self.compile, self._capture_name())  # (either may have been set since)
        if self.cuda_graph not in (False, None) or self.compile is not None:
            capture = capturer(self._capture_name(), model.device, self.compile is not None)
        gen = torch.Generator().manual_seed(
            self.seed if self.seed is not None else int(torch.randint(2**31, ()))
        )
        mask = model_kwargs.get("attention_mask")
        pads = [0] * input_ids.shape[0] if mask is None else (mask == 0).sum(1).tolist()
        prompts = [row[p:] for row, p in zip(input_ids.tolist(), pads)]
        max_length = int(cfg.max_length)
        cache = model_kwargs.get("cache") or model_kwargs.get("past_key_values")
        lens = [len(p) for p in prompts]
        latent = is_latent_model(model)
        if latent and capture is not None:
            raise CodesignError("captured or compiled tree forwards are not served for latent (MLA) models")
        if not isinstance(cache, CodesignLatentCache if latent else CodesignCache) or cache.row_lengths():
            nb, nbw = (self.num_blocks, None) if self.num_blocks else self.blocks_for(lens, max_length, model)
            if latent:
                cache = CodesignLatentCache(model, self.kv_format, num_blocks=nb,
                                            block_size=self.target_block_size(model))  # fmt: skip
            else:
                cache = CodesignCache(model, self.kv_format, num_blocks=nb, block_size=self.target_block_size(model),
                                      window_num_blocks=nbw)  # fmt: skip
        self.cache, self.stats = cache, SpeculationStats()  # the stats are this call's
        if capture is not None:
            cache.spec.check_capturable(trees=True)
        self.draft.start(model, prompts, input_ids, mask, self.num_blocks or self.draft_blocks(lens, max_length))
        try:
            return self._loop(
                model, input_ids, mask, prompts, cache, logits_processor, stopping_criteria, cfg, gen, capture
            )
        finally:
            if isinstance(cache, CodesignCache):
                cache.graph_end()
            if isinstance(self.draft, ModelDraft):
                self.draft.finish()

    def _loop(self, model, input_ids, mask, prompts, cache, processors, stopping, cfg, gen, capture=None):
        t0 = time.perf_counter()
        vocab = text_config(model).vocab_size
        logits = prefill(model, cache, input_ids, mask)
        rows = [list(r) for r in input_ids.tolist()]  # padded prompt + generated, as generate's input_ids
        roots = [self._pick(processors, rows[b], logits[b, -1], gen) for b in range(len(rows))]
        done = [False] * len(rows)
        for b in range(len(rows)):
            done[b] = self._emit(rows, b, [roots[b]], stopping)
        active = [b for b in range(len(rows)) if not done[b]]
        self._select(cache, active, list(range(len(rows))))
        ctx = [prompts[b] + rows[b][len(input_ids[b]) :] for b in range(len(rows))]
        self.stats.step_seconds.append(time.perf_counter() - t0)
        parents, depth = self.parents, K.tree_depths(self.parents)
        anc = _paths(parents)
        temperature = float(getattr(cfg, "temperature", 1.0) or 1.0)
        forward, captured = None, 0  # (captured: one a batch size, rows leave the batch as they finish)
        self.captures = 0
        while active:
            t0 = time.perf_counter()
            toks, probs = self.draft.propose([ctx[b][:-1] for b in active], [roots[b] for b in active], parents,
                                             vocab, self.mode, temperature, gen)  # fmt: skip
            lens = cache.row_lengths()
            cache.set_tree(parents)
            if capture is None:
                try:
                    tl = forward_rows(model, cache, toks.tolist(), lens, depth)
                except BaseException:
                    if isinstance(cache, CodesignCache):  # (its state layers out of tree mode, as before the step)
                        cache.end_tree()
                    raise
            else:
                if forward is None or forward.batch != len(active):
                    captured += forward.captures if forward else 0
                    cache.graph_end()
                    forward = CapturedForward(model, cache, capture, int(cfg.max_length) + len(parents), parents,
                                              compile=self.compile)  # fmt: skip
                pos = torch.tensor(lens)[:, None] + torch.tensor(depth)[None, :]
                tl = forward(toks.to(model.device), pos.to(model.device))
                self.captures = captured + forward.captures
            tl = tl.float().cpu()  # (one copy a step; the processors and verification run on the host)
            paths, accepted, committed = [], [], []
            for i, b in enumerate(active):
                proc = torch.stack([self._apply(processors, rows[b] + [int(toks[i, a]) for a in anc[u]], tl[i, u])
                                    for u in range(len(parents))])  # fmt: skip
                res = K.verify_tree(parents, toks[i], proc, None if probs is None else probs[i],
                                    mode=self.mode, generator=gen)  # fmt: skip
                paths.append([0, *res.accepted_nodes])
                accepted.append(len(res.accepted_nodes))
                committed.append([roots[b], *res.tokens[:-1]])
                done[b] = self._emit(rows, b, list(res.tokens), stopping)
                ctx[b] += list(res.tokens)
                roots[b] = res.tokens[-1]
            cache.accept_tree(paths)
            self.draft.accept(committed, cache.row_lengths())
            self.stats.accepted.append(accepted)
            keep = [i for i, b in enumerate(active) if not done[b]]
            if len(keep) < len(active):
                self._select(cache, [active[i] for i in keep], active)
            active = [active[i] for i in keep]
            self.stats.step_seconds.append(time.perf_counter() - t0)
        pad = (
            cfg._pad_token_tensor if getattr(cfg, "_pad_token_tensor", None) is not None else cfg.pad_token_id
        )
        pad = int(pad) if pad is not None else 0
        width = max(len(r) for r in rows)
        return torch.tensor(
            [r + [pad] * (width - len(r)) for r in rows], dtype=torch.long, device=input_ids.device
        )

    def _capture_name(self):
        """What captures the tree forwards: "cuda", "tape", a capturer, or None (not captured)."""
        return None if self.cuda_graph in (False, None) else "cuda" if self.cuda_graph is True else self.cuda_graph

    def _select(self, cache, keep: list[int], current: list[int]) -> None:
        idx = [current.index(b) for b in keep]
        if idx != list(range(len(current))):
            cache.select_rows(idx)
            self.draft.select(idx)

    def _pick(self, processors, row: list[int], logits: torch.Tensor, gen) -> int:
        scores = self._apply(processors, row, logits)
        if self.mode == "greedy":
            return int(scores.argmax())
        return int(torch.multinomial(torch.softmax(scores, -1), 1, generator=gen))

    @staticmethod
    def _apply(processors, row: list[int], logits: torch.Tensor) -> torch.Tensor:
        """One position's scores after the logits processors, given the tokens before it; finite."""
        scores = logits.float().cpu()[None]
        if processors:
            scores = processors(torch.tensor([row]), scores)
        return torch.nan_to_num(scores[0], neginf=-1e30)

    @staticmethod
    def _emit(rows, b: int, tokens: list[int], stopping) -> bool:
        """Append tokens to row b until a stopping criterion fires; True when the row is done."""
        for t in tokens:
            rows[b].append(int(t))
            if stopping is not None and bool(stopping(torch.tensor([rows[b]]), None)[0]):
                return True
        return False


def _paths(parents: Sequence[int]) -> list[list[int]]:
    """Each node's path below the root (root excluded, the node included)."""
    out: list[list[int]] = [[]]
    for i, p in enumerate(parents[1:], start=1):
        out.append([*out[p], i])
    return out
