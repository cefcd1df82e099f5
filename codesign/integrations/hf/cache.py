"""`CodesignCache`: a transformers `Cache` whose layers live in codesign's paged block pool, in any KV format.

Bookkeeping is shared by the layers of a group (the layers of one attention window, `support.layer_windows`;
full attention is the window None): one `BlockTables` per group (over the kernels' reference-counted block
allocator) maps each batch row to a sequence of blocks, and every layer of the group stores its K/V in its own
pool (`kv_formats.Storage`) at the same block ids. Group 0 is the full-attention layers' if the model has any.
A row's blocks hold only its real tokens: left-padding columns are never written, so a padded batch runs as
variable-length sequences. Sequence ids are the same in every group.

Sliding windows: in a group of window W, a forward starting at position S first returns each row's blocks
that lie wholly before S - W - crop_margin to that group's pool (shared blocks lose one reference), so a row
holds at most `window_blocks(...)` of that group's blocks however long it grows (its pool can be that small:
`window_num_blocks`). A rollback (`crop`, `rewind`) may reach `crop_margin` tokens before the last forward's
start, no further: below that the keys a query would need are gone, and it raises.

The write happens in the attention function, not in `update()`: `update()` hands the new K/V to the
layer's attention module, and `codesign_attention` (which also sees the padding mask) writes them and
attends (`CodesignCache.attend`). `update()` refuses to run under any other attention implementation, so
the cache can never feed a foreign attention function only the new tokens.

Chunked attention (Llama 4's "chunked_attention" layers, `support.layer_chunks`): a query at position p sees the
keys from its chunk's start, p // C * C, to p. Such layers write as their group does; to attend, each row's new
tokens are split at multiples of C and every piece runs as a row of its own over the row's blocks from its chunk's
start (C a multiple of the block size, so a chunk starts a block): the kernels' causal attention over that row is
the chunked one (`chunk_pieces`, `_chunk_plan`). Their past chunks' blocks are kept (vLLM frees them); trees and
captured steps are refused on such models, and formats with per-sequence state (KIVI, Oaken).

Linear-attention layers (Gated DeltaNet, Mamba mixers: `support.linear_layers`) hold no KV: each is
transformers' own `LinearAttentionLayer` (conv and recurrent states, one batch row each; `state_trees`' subclass)
among this cache's layers, reached through the Cache methods their modules call. The KV layers' step starts at the
first of them; `select_rows` reorders the states, `crop` rolls them back after `activate_past_recording`, trees run
over Gated DeltaNet's and Mamba-2's layers (`state_trees`: each node from the state entering the step, the accepted
path's states written at `accept_tree`), and what cannot move them row by row (`rewind`, trees over Mamba-1 layers)
or freeze them (captured steps) is refused. Stateless layers (Nemotron-H's MLP / MoE blocks:
`support.stateless_layers`) hold nothing: transformers' own `DummyLayer`, as its caches keep them.

Prefix sharing: rows whose prompts start with the same tokens share those tokens' full blocks
(`share_prefixes`); `reorder_cache` (beam search), `batch_repeat_interleave` and `select_rows` fork
sequences, so rows share blocks until one appends into a shared partial block (copy-on-write).

Rolling back a forward (`crop`, `accept_tree`): token-local formats just truncate; KIVI and Oaken, whose
writes also change per-sequence or per-block state, restore that state from a snapshot taken before the
forward and re-append the kept tokens from the forward's K/V (kept for forwards of <= UNDO_MAX tokens a
row), so the cache ends exactly as if only the kept tokens had been written, in order.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

try:  # transformers >= 5.25: linear-attention layers' conv and recurrent states, stateless layers' placeholder
    from transformers.cache_utils import DummyLayer
except ImportError:  # (earlier releases serve no model with such layers: `support.FAMILY_SINCE`)
    DummyLayer = None

from codesign.catalog.models import chunk_pieces
from codesign.integrations.hf import _compat, state_trees
from codesign.integrations.hf import _kernels as K
from codesign.integrations.hf.blocks import BlockTables
from codesign.integrations.hf.kv_formats import (
    AttendPlan,
    KVSpec,
    WritePlan,
    check_geometry,
    new_storage,
    parse_kv_format,
)
from codesign.integrations.hf.support import (
    ATTN_NAME,
    check_model,
    layer_chunks,
    layer_windows,
    left_pads,
    linear_layers,
    text_config,
)
from codesign.integrations.hf.traced import new_handle
from codesign.specs import CodesignError, check_integer, check_positive_int

UNDO_MAX = 64  # tokens a row: forwards this short (decode, verification) can be rolled back in every format
# Tokens kept beyond a sliding window: how far before the last forward's start a crop may still reach
# (transformers' prompt lookup and assisted decoding crop inside the last forward).
CROP_MARGIN = 8


@dataclass(frozen=True)
class StepRecord:
    """One forward as the cache saw it: kind ("prefill", "decode", "extend" or "tree"), per row with new
    tokens its new-token count and its context length after the forward (prefix + new), and the tree."""

    kind: str
    q_lens: tuple[int, ...]
    context_lens: tuple[int, ...]
    parents: tuple[int, ...] = ()


@dataclass
class _Group:
    """The layers attending within one window (None: full attention), their block tables and pool size."""

    window: int | None
    layers: list[int]
    tables: BlockTables
    num_blocks: int
    keep: int | None  # tokens a row keeps behind a forward's start (None: all)


@dataclass
class _Step:
    batch: int
    width: int  # columns of this forward
    real: torch.Tensor | None  # flat (row * width + col) indices of the real new tokens; None: all
    write: list[WritePlan]  # per group
    attend: list[AttendPlan]  # per group
    keep_kv: bool
    offsets: list[int] = field(default_factory=list)  # first flat index of each row's tokens in k/v
    checked: set[int] = field(default_factory=set)  # groups whose plans a layer has checked this forward
    # group -> (options key, its planned wrapper, plan_into's arguments after the wrapper: a re-plan's)
    planned: dict[int, tuple] = field(default_factory=dict)
    # (group, chunk) -> the chunked layers' plan (`_chunk_plan`)
    chunked: dict[tuple[int, int], AttendPlan] = field(default_factory=dict)
    # a captured step's K/V of each layer (the graph's own tensors: each replay refills them), for accept_tree
    kept: dict[int, tuple] = field(default_factory=dict)
    buffers: dict[int, tuple] = field(default_factory=dict)  # group -> its wrapper's buffers a captured forward reads
    seen: int = 0  # a graph's: the cache's `seen` at graph_begin, what a traced forward reads (`model_seen`)


class CodesignCacheLayer(CacheLayerMixin):
    """One layer of a CodesignCache: its storage, and what a rollback of the last forward needs."""

    is_sliding = False
    is_croppable = True
    supports_early_init = False

    def __init__(self, cache: CodesignCache, layer_idx: int, storage) -> None:
        super().__init__()
        self._cache, self.layer_idx, self.storage = cache, layer_idx, storage
        self.snap: object = None
        self.last_kv: tuple[torch.Tensor, torch.Tensor] | None = None

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor | None = None) -> None:
        """Nothing: the pool is built on the first write, when the real tokens are known."""

    def update(self, key_states, value_states, *args, **kwargs):
        return self._cache.update(key_states, value_states, self.layer_idx)

    def get_mask_sizes(self, query_length) -> tuple[int, int]:
        return self._cache.model_seen() + _compat.query_length(query_length), 0

    def get_seq_length(self) -> int:
        return self._cache.model_seen()

    def get_max_length(self) -> int:
        return -1

    get_max_cache_shape = get_max_length  # 4.57's name of the same (abstract there)


class RowSelection:
    """transformers' batch-row calls (beam search's reorder, expansion, filtering) over the cache's `select_rows`;
    shared by CodesignCache and CodesignLatentCache."""

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self.select_rows(beam_idx.tolist())

    def batch_repeat_interleave(self, repeats: int) -> None:
        check_positive_int("repeats", repeats)
        self.select_rows([b for b in range(len(self._rows)) for _ in range(repeats)])

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        idx = torch.as_tensor(indices)
        if idx.dtype == torch.bool:  # a row mask: the rows it keeps
            if idx.shape != (len(self._rows),):
                raise CodesignError(f"batch_select_indices: a mask of shape {tuple(idx.shape)} for "
                                    f"{len(self._rows)} rows")  # fmt: skip
            idx = torch.nonzero(idx).flatten()
        self.select_rows(idx.tolist())


class CodesignCache(RowSelection, Cache):
    """A paged, optionally quantized KV cache for a transformers model running `attn_implementation=
    "codesign_paged"` (`codesign.integrations.hf.attention`).

    kv_format: a name of `kv_formats` (None: plain K/V in the model's dtype); num_blocks: pool size in
    blocks of `block_size` tokens, per layer of group 0; window_num_blocks: per layer of the sliding groups of a
    model that also has full-attention layers (default num_blocks); check: the kernels' data checks (host syncs):
    of the shared slots and tables once a forward per group of layers, of each layer's values (quantized writes)
    at every layer (mixed block widths are checked where the cache sets them); crop_margin: tokens kept beyond a
    sliding window, how far before the last forward a rollback may reach.
    """

    def __init__(self, model, kv_format: str | None = None, *, num_blocks: int, block_size: int = 16,
                 check: bool = True, crop_margin: int = CROP_MARGIN,
                 window_num_blocks: int | None = None) -> None:  # fmt: skip
        layout = check_model(model)
        self.spec: KVSpec = parse_kv_format(kv_format, layout.dtype)
        check_positive_int("num_blocks", num_blocks)
        check_positive_int("block_size", block_size)
        if window_num_blocks is not None:
            check_positive_int("window_num_blocks", window_num_blocks)
        if not isinstance(check, bool):
            raise CodesignError(f"check must be True or False, got {check!r}")
        check_geometry(self.spec, block_size, layout.kv_heads, layout.head_dim)
        self.layout, self.block_size, self.num_blocks, self.check = layout, block_size, num_blocks, check
        self._config = text_config(model)
        self._state_layers = state_trees.state_layers(model) if any(linear_layers(self._config, layout.layers)) \
            else None  # (what a tree over them must fit: `state_trees.check_tree`)  # fmt: skip
        if isinstance(crop_margin, bool) or not isinstance(crop_margin, int) or crop_margin < 0:
            raise CodesignError(f"crop_margin must be an int >= 0, got {crop_margin!r}")
        self.windows = layer_windows(self._config, layout.layers)  # what each layer's attention is passed
        self.chunks = layer_chunks(self._config, layout.layers)
        self.linear = linear_layers(self._config, layout.layers)
        self._check_chunks(block_size)
        self.crop_margin = crop_margin
        self._groups = self._make_groups(num_blocks, window_num_blocks)
        self._group_of = {i: g for g, grp in enumerate(self._groups) for i in grp.layers}
        self.keep = self._groups[0].keep  # group 0's (the model's, when every layer shares one window)
        # A linear-attention layer keeps its conv and recurrent states in transformers' own layer class, which the
        # Cache methods its module calls (get_recurrent_state, update_conv_state, ...) reach.
        layers = [state_trees.TreeLinearLayer() if self.linear[i] else DummyLayer() if layout.modules[i] is None else
                  CodesignCacheLayer(self, i, new_storage(self.spec, self._groups[self._group_of[i]].num_blocks,
                                                          block_size))
                  for i in range(layout.layers)]  # fmt: skip
        super().__init__(layers=layers)
        self._kv_layers = [(i, layers[i]) for i in layout.attention_layers]
        self._pages = self._groups[0].tables
        self._rows: list[int] = []  # sequence id of each batch row
        self._pads: list[int] = []  # padding columns of each row (never written)
        self._next_seq = 0
        self.seen = 0  # columns every row has gone through (transformers' sequence length)
        self._step: _Step | None = None
        # (starts, counts, seen) of the last forward: what a rollback into it needs.
        self._undo: tuple[list[int], list[int], int] | None = None
        self._unstep: tuple | None = None  # (a graph_step's starts, and seen and _undo before it)
        self._tree: tuple[int, ...] | None = None
        self._share: list[tuple[int, int] | None] | None = None
        self._share_shape: tuple[int, ...] = ()
        self.steps: list[StepRecord] = []
        self._graph: _Step | None = None  # the fixed step captured decode forwards read (`graph_begin`)
        self.handle = new_handle(self)  # what a traced forward names this cache by (`traced.hf_attend`)

    # --- transformers' side ---------------------------------------------------------------------------
    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        """Hand the new K/V to layer `layer_idx`'s attention module (which writes them) and return them."""
        if self._config._attn_implementation != ATTN_NAME:
            raise CodesignError(
                f"CodesignCache needs attn_implementation={ATTN_NAME!r} (the model runs "
                f"{self._config._attn_implementation!r}): call model.set_attn_implementation({ATTN_NAME!r})"
            )
        mod = self.layout.modules[layer_idx]
        if mod.__dict__.get("_codesign_pending") is not None:
            raise CodesignError(
                f"layer {layer_idx}: the previous K/V were never attended (foreign attention?)"
            )
        mod._codesign_pending = (self, layer_idx, key_states)
        return key_states, value_states

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.model_seen()

    def get_mask_sizes(self, query_length, layer_idx: int = 0) -> tuple[int, int]:
        return self.model_seen() + _compat.query_length(query_length), 0

    def model_seen(self) -> int:
        """`seen` as the model's forward reads it (its cache positions and mask sizes, which our attention does not
        use): while torch.compile traces a step of `graph_begin`, the count at graph_begin, so that the traced step
        does not hold a count that moves every step (a guard on it would compile the step again; a captured graph
        freezes the value anyway, and the loops pass the positions)."""
        if self._graph is not None and torch.compiler.is_compiling():
            return self._graph.seen
        return self.seen

    def get_max_length(self, layer_idx: int | None = None) -> int:
        return -1

    get_max_cache_shape = get_max_length  # 4.57's name

    @property
    def is_compileable(self) -> bool:
        return False

    def activate_past_recording(self, recurrent_states_to_keep: int | None = None) -> None:
        """The KV layers keep all their tokens anyway; linear-attention layers record their past states so that
        `crop` can roll them back (transformers calls this before assisted decoding's verification forwards)."""
        for layer in self._linear_layers():
            layer.activate_past_recording(recurrent_states_to_keep)

    def _linear_layers(self) -> list:
        return [layer for layer, lin in zip(self.layers, self.linear) if lin]

    def get_recurrent_state(self, layer_idx: int, state_idx: int = 0):
        """transformers' state, as a marked view while a tree forward runs (`state_trees`: only codesign's tree
        functions take such a view, and the layer is not written)."""
        state = super().get_recurrent_state(layer_idx, state_idx)
        layer = self.layers[layer_idx]
        if state is not None and getattr(layer, "tree", None) is not None:
            return layer.state_view(state)
        return state

    def update_recurrent_state(self, recurrent_states, layer_idx: int, state_idx: int = 0, **kwargs):
        layer = self.layers[layer_idx]
        if getattr(layer, "tree", None) is None:
            return super().update_recurrent_state(recurrent_states, layer_idx, state_idx, **kwargs)
        if getattr(recurrent_states, state_trees.MARK, None) is not layer:
            raise CodesignError(f"layer {layer_idx}: a tree forward's delta rule ran outside codesign's tree "
                                "functions (its states would be a sequence's)")  # fmt: skip
        return layer.recurrent_states[state_idx]

    def update_conv_state(self, conv_states, layer_idx: int, state_idx: int = 0, **kwargs):
        if getattr(self.layers[layer_idx], "tree", None) is not None:
            raise CodesignError(f"layer {layer_idx}: a tree forward's conv ran outside codesign's tree functions")
        return super().update_conv_state(conv_states, layer_idx, state_idx, **kwargs)

    def reset(self) -> None:
        for seq in self._rows:
            self._free_seq(seq)
        for layer in self._linear_layers():
            layer.reset()
        self._rows, self._pads, self.seen, self._undo, self._step = [], [], 0, None, None
        self._unstep = None

    def crop(self, tokens_to_remove: int) -> None:
        """Drop the last `-tokens_to_remove` columns (transformers 5 passes a negative count, 0 a no-op for the KV;
        4.57 the length to keep: `_compat.tokens_to_remove`); linear-attention layers crop their recorded states."""
        n = _compat.tokens_to_remove(check_integer("crop: tokens_to_remove", tokens_to_remove), self.seen)
        linear = self._linear_layers()
        if n == 0:  # (a recording linear layer trims its conv states back to the kernel: transformers' crop(0))
            for layer in linear:
                if getattr(layer, "record_past", False):
                    layer.crop(0)
            return
        if n > self.seen:
            raise CodesignError(f"crop of {n} tokens from a cache of {self.seen}")
        lengths = [max(length - n, 0) for length in self.row_lengths()]
        self._check_window_rollback(lengths, f"crop(tokens_to_remove={tokens_to_remove})")
        if linear and not all(getattr(layer, "record_past", False) for layer in linear):
            raise CodesignError("crop of a model with linear-attention layers needs activate_past_recording first "
                                "(transformers' assisted decoding calls it)")  # fmt: skip
        self._rewind_kv(lengths)
        for layer in linear:
            layer.crop(-n)  # (their states back n tokens: the history recorded since activate_past_recording)
        self.seen -= n

    # --- codesign's side ---------------------------------------------------------------------------------
    def select_rows(self, rows: list[int]) -> None:
        """New batch row i continues old row rows[i]; rows may repeat (forks share blocks, copy on write)."""
        old = self._rows
        if isinstance(rows, torch.Tensor):
            rows = rows.tolist()
        rows = [check_integer(f"select_rows: rows[{i}]", r) for i, r in enumerate(rows)]
        if any(not 0 <= r < len(old) for r in rows):
            raise CodesignError(f"select_rows: rows {rows} outside the batch of {len(old)}")
        new = [self._fork(old[r]) for r in rows]
        for seq in old:
            self._free_seq(seq)
        for layer in self._linear_layers():  # (their states are one batch row each, as transformers keeps them)
            layer.reorder_cache(torch.tensor(rows, dtype=torch.long))
        self._rows, self._pads, self._undo = new, [self._pads[r] for r in rows], None

    def share_prefixes(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None
    ) -> list[int]:
        """Plan the first forward so that each row shares the full blocks of its longest common real-token
        prefix with an earlier row; returns the shared token count per row. KIVI (a residual ring per
        sequence) shares nothing at the prompt."""
        if self._rows:
            raise CodesignError("share_prefixes must be planned before the first forward")
        self._share = plan_prefix_sharing(input_ids, attention_mask, self.block_size, self.spec.shares_prompt_blocks)
        self._share_shape = tuple(input_ids.shape)  # (the first forward must be of these ids: `_begin` checks)
        return [p[1] if p else 0 for p in self._share]

    def set_tree(self, parents) -> None:
        """Make the next forward a tree verification: its columns are the nodes of this tree (a parent array,
        the same shape for every row), written after each row's tokens and attending to the prefix and to
        their ancestors only."""
        if any(self.chunks):
            raise CodesignError("tree verification over chunked-attention (Llama 4) layers is not served "
                                f"({self.layout.family})")  # fmt: skip
        tree = tuple(K.check_parents(parents))
        linear = self._linear_layers()
        if linear:
            state_trees.check_tree(self._state_layers, self.layout.family, len(tree))
            for i, layer in zip([i for i, lin in enumerate(self.linear) if lin], linear):
                layer.begin_tree(tree, i)
        self._tree = tree

    def end_tree(self) -> None:
        """Leave a tree forward that failed: the linear layers out of tree mode, their states as before it."""
        self._tree = None
        for layer in self._linear_layers():
            layer.end_tree()

    def accept_tree(self, paths: list[list[int]]) -> None:
        """Compact each row to its accepted path: row b keeps nodes paths[b] (node 0, the root, first) of the
        last tree forward at positions prefix, prefix + 1, ...; everything else of the tree is dropped."""
        if self._undo is None or self.steps[-1].kind != "tree":
            raise CodesignError("accept_tree must follow a tree forward")
        check_tree_paths(paths, self.steps[-1].parents, len(self._rows))
        paths = [list(p) for p in paths]
        # the linear layers' new states first, nothing written: a failure leaves the cache as it was
        states = [(self.layers[i], self.layers[i].accepted_states(paths, i)) for i, lin in enumerate(self.linear)
                  if lin]  # fmt: skip
        starts = self._undo[0]
        self._rewind([s + len(p) for s, p in zip(starts, paths)], paths)
        for layer, new in states:
            layer.write_states(*new)

    def rewind(self, lengths: list[int]) -> None:
        """Truncate row b to lengths[b] tokens (KIVI and Oaken: only back into the last forward; sliding
        windows: at most crop_margin tokens before it). Linear-attention layers' states roll back with `crop` only
        (every row alike): refused here."""
        if any(self.linear):
            raise CodesignError("rewind of rows of a model with linear-attention layers: only crop (every row alike) "
                                "rolls their states back")  # fmt: skip
        self._rewind_kv(lengths)

    def _rewind_kv(self, lengths: list[int]) -> None:
        """`rewind` of the KV layers."""
        lengths = [check_integer(f"rewind: lengths[{b}]", n) for b, n in enumerate(lengths)]
        self._check_window_rollback(lengths, f"rewind(lengths={lengths})")
        starts = self._undo[0] if self._undo else [0] * len(lengths)
        self._rewind(lengths, [list(range(max(n - s, 0))) for n, s in zip(lengths, starts)])

    @property
    def allocator(self):
        """The block allocator (reference-counted block ids) group 0's pools are indexed by."""
        return self._pages.allocator

    @property
    def groups(self) -> list[tuple[int | None, list[int]]]:
        """(window, layer indices) of each group, group 0 first."""
        return [(g.window, list(g.layers)) for g in self._groups]

    def row_lengths(self) -> list[int]:
        return [self._pages.seq_len(s) for s in self._rows]

    def blocks_in_use(self, group: int = 0) -> int:
        """Blocks of group `group`'s pool held by some row."""
        if not 0 <= check_integer("group", group) < len(self._groups):
            raise CodesignError(f"group must lie in [0, {len(self._groups)}), got {group}")
        g = self._groups[group]
        return g.num_blocks - g.tables.allocator.num_free

    def _make_groups(self, num_blocks: int, window_num_blocks: int | None) -> list[_Group]:
        kv = self.layout.attention_layers  # (linear-attention and stateless layers hold no KV)
        windows = sorted({self.windows[i] for i in kv}, key=lambda w: (w is not None, w or 0))  # full attention first
        mixed = len(windows) > 1 and windows[0] is None
        out = []
        for w in windows:
            nb = window_num_blocks if (mixed and w is not None and window_num_blocks) else num_blocks
            keep = None if w is None else keep_tokens([w], self.crop_margin, self.spec)
            layers = [i for i in kv if self.windows[i] == w]
            out.append(_Group(w, layers, BlockTables(nb, self.block_size), nb, keep))
        return out

    def _check_window_rollback(self, lengths: list[int], call: str) -> None:
        """A row cut back to n tokens needs keys from n - window + 1 on: refuse where those blocks are gone."""
        for g in self._groups:
            if g.keep is None:
                continue
            for b, (seq, n) in enumerate(zip(self._rows, lengths)):
                gone = g.tables.dropped_tokens(seq)
                if gone and n - g.window + 1 < gone:
                    raise CodesignError(
                        f"{call}: row {b} would end at {n} tokens, but its first {gone} were freed (sliding "
                        f"window {g.window}); a rollback reaches at most crop_margin={self.crop_margin} tokens "
                        "before the last forward"
                    )

    def nbytes(self) -> int:
        """Bytes of every layer's pool (codes, scales, outlier slots, rings)."""
        return sum(layer.storage.nbytes() for _, layer in self._kv_layers)

    # --- captured decode steps (`graphs.GraphDecoding`) ----------------------------------------------------
    def graph_begin(self, max_tokens: int, device, tree: Sequence[int] | None = None) -> None:
        """From now on every forward is a step of one shape reading fixed buffers, so that one captured forward (a
        CUDA graph) serves them all: a decode step, or with `tree` (a parent array) a verification of that tree in
        every row (`set_tree` before each). Per group the block tables padded to `max_tokens` tokens a row, the new
        slots; the context lengths (and a tree's query offsets). Each step's host side runs before its forward:
        `graph_step`. Data checks are off (the cache builds the buffers); `graph_end` returns to eager forwards."""
        self.spec.check_capturable(tree is not None)
        if any(self.chunks) or any(self.linear):
            raise CodesignError("captured or compiled steps over chunked-attention (Llama 4) or linear-attention "
                                f"(Qwen3.5, state-space hybrids) layers are not served ({self.layout.family})"
                                )  # fmt: skip
        if not self._rows:
            raise CodesignError("graph_begin needs the prompts' forward first")
        if max(self.row_lengths()) >= max_tokens:
            raise CodesignError(f"graph_begin(max_tokens={max_tokens}): a row already holds that many tokens")
        cols = -(-max_tokens // self.block_size)
        b, n = len(self._rows), 1 if tree is None else len(K.check_parents(tree))
        ctx = torch.zeros(b, dtype=torch.int32, device=device)
        cu = None if tree is None else torch.zeros(b + 1, dtype=torch.int32, device=device)
        write, attend = [], []
        pos = None if tree is not None else torch.zeros(b, dtype=torch.int64, device=device)
        for _ in self._groups:  # (of a write plan's host fields only the rows: `WritePlan.positions`)
            bt = torch.zeros(b, cols, dtype=torch.int32, device=device)
            slots = torch.zeros(b * n, dtype=torch.int64, device=device)
            write.append(WritePlan([], list(self._rows), [], [], slots, bt, [], [], positions=pos))
            attend.append(AttendPlan(bt, ctx, cu, None, []))  # (a tree's TreeBatch: set by each graph_step)
        self._graph = _Step(b, n, None, write, attend, keep_kv=tree is not None, seen=self.seen)

    def graph_step(self) -> None:
        """A step's host side, before its captured forward: its slots in every group, the step's tables, lengths
        (offsets, tree) and slots copied into the fixed buffers, the attention wrappers re-planned in place
        (FlashInfer's rule: a replay reads their buffers), a tree step's layers handed the graph's K/V (for
        `accept_tree`). A re-plan that would move a buffer the graph reads raises."""
        gs = self._graph
        if gs is None:
            raise CodesignError("graph_step outside graph_begin / graph_end")
        if (self._tree is not None) != gs.keep_kv:
            raise CodesignError(f"graph_begin was for {'a tree' if gs.keep_kv else 'decode'}: call set_tree "
                                f"before each tree step, and only then")  # fmt: skip
        before = (self.seen, self._undo)
        st = self._begin(gs.batch, gs.width, None, gs.attend[0].context_lens.device)
        self._unstep = (self._undo[0], *before)
        for fixed, new in zip(gs.write, st.write):
            width = new.block_tables.shape[1]
            if width > fixed.block_tables.shape[1]:
                raise CodesignError(
                    f"a row outgrew the {fixed.block_tables.shape[1] * self.block_size} tokens of graph_begin"
                )
            fixed.block_tables[:, :width].copy_(new.block_tables)
            fixed.slots.copy_(new.slots)
        for i, layer in self._kv_layers:
            layer.storage.before_replay(st.write[self._group_of[i]])
        gs.attend[0].context_lens.copy_(st.attend[0].context_lens)
        if gs.write[0].positions is not None:
            gs.write[0].positions.copy_(st.attend[0].context_lens - 1)  # (one new token a row)
        if gs.keep_kv:
            gs.attend[0].cu_seqlens_q.copy_(st.attend[0].cu_seqlens_q)
            for fixed, new in zip(gs.attend, st.attend):
                fixed.tree = new.tree  # (host lists for the re-plan; its device tensors go to the wrappers' buffers)
            for i, kv in gs.kept.items():
                self.layers[i].last_kv = kv
        for g, (_, w, args) in gs.planned.items():
            plan_into(w, *args)
            now = plan_buffers(w)
            if gs.buffers.setdefault(g, now) != now:  # (the first re-plan's are the capture's: it follows that step's)
                raise CodesignError("a re-plan moved a buffer the captured forward reads: capture it again")
        self._step = gs

    def graph_unstep(self) -> None:
        """Undo the last `graph_step` before its forward ran (a loop that prepared the next step while the device
        ran this one, then stopped): its slots back to the pool, its step record dropped, the cache as the last
        forward left it. The fixed buffers keep the step's values, which no replay reads. Only the caller knows
        that the forward has not run (a replay runs no Python): `graphs.CapturedForward.cancel`."""
        if self._graph is None or self._unstep is None:
            raise CodesignError("graph_unstep must follow a graph_step whose forward has not run")
        starts, self.seen, self._undo = self._unstep
        for seq, s in zip(self._rows, starts):
            for g in self._groups:
                g.tables.truncate(seq, s)
        self.steps.pop()
        self._unstep = self._step = None

    def graph_end(self) -> None:
        """Back to eager forwards (each plans its own buffers)."""
        self._graph = None

    def in_graph(self) -> bool:
        """Whether forwards are steps of `graph_begin` (until `graph_end`)."""
        return self._graph is not None

    # --- one forward -------------------------------------------------------------------------------------
    def attend(self, layer_idx, query, key, value, mask2d, scaling, window, softcap, sinks=None) -> torch.Tensor:
        """Write layer `layer_idx`'s new K/V and attend: query `[B, Hq, S, D]`, key/value `[B, Hkv, S, D]`,
        mask2d: bool `[B, seen + S]` (False: a padding column) or None; sinks: the layer's fp32 `[Hq]` attention
        sinks or None; returns `[B, S, Hq, D]`."""
        b, hq, s, d = query.shape
        if layer_idx == self._kv_layers[0][0]:  # the first KV layer (a captured step's host side ran: `graph_step`)
            self._step = self._graph if self._graph is not None else self._begin(b, s, mask2d, query.device)
            self._unstep = None  # (its forward runs: no longer undone by `graph_unstep`)
        st = self._step
        if st is None or (st.batch, st.width) != (b, s):
            raise CodesignError(
                f"layer {layer_idx} runs a forward of {b}x{s} tokens that layer 0 did not start"
            )
        if window != self.windows[layer_idx]:  # the freed blocks were chosen by the configured windows
            raise CodesignError(
                f"layer {layer_idx} attends with window {window}, its config says {self.windows[layer_idx]}"
            )
        q, k, v = (_tokens(x, st.real) for x in (query, key, value))
        layer, g = self.layers[layer_idx], self._group_of[layer_idx]
        if layer.storage.kv is None:
            layer.storage.build(k, v)
        layer.snap = layer.storage.snapshot(st.write[g])
        layer.last_kv = (k, v) if st.keep_kv else None
        if st is self._graph and st.keep_kv:  # (the capture's run is the last to set it: the graph's tensors)
            st.kept[layer_idx] = layer.last_kv
        # The group's layers share this step's slots and tables: its first layer checks them for all (each
        # check is a host sync and host work, at every layer of a GPU decode step otherwise).
        first = g not in st.checked
        st.checked.add(g)
        store, check = layer.storage, self.check and self._graph is None  # (a graph's buffers: the cache's own)
        store.write(k, v, st.write[g], q, check and (first or not store.write_checks_plan_only))
        chunk = self.chunks[layer_idx]
        plan = st.chunked[g, chunk] if chunk else st.attend[g]
        run = store.planned_run(plan)
        if run is not None:
            out = self._run_planned(st, (g, chunk) if chunk else g, plan, run, q, scaling, window, softcap, sinks)
        else:
            out = store.attend(q, plan, sm_scale=scaling, window=window, softcap=softcap, sinks=sinks,
                               check_data=check and first)  # fmt: skip
        return _untokens(out, st.real, b, s)

    def _run_planned(self, st: _Step, g, plan: AttendPlan, run: tuple, q, scaling, window, softcap, sinks=None
                     ) -> torch.Tensor:  # fmt: skip
        """Attend through a wrapper (decode, extend or tree) planned by the group's first layer of this forward
        (its layers share tables, lengths and trees; the plan checks them with `check`): each layer launches,
        with no option resolution, config lookup or check (`attention.wrappers`; bit-identical to the entry
        point). The layer's sinks go to run(), not the plan: they differ by layer. g: the group, or (group,
        chunk) for its chunked layers' plan."""
        caches, dtype = run
        qd = q if dtype is None else q.to(dtype)
        c = caches[0]
        geometry = (c.shape, c.dtype) if isinstance(c, torch.Tensor) else K.format_of(c).signature(c)
        key = (tuple(qd.shape), qd.dtype, scaling, window, softcap, geometry)
        hit = st.planned.get(g)
        if hit is None or hit[0] != key:  # a layer whose options or pool differ from the group's first: planned again
            tree = self.steps[-1].parents if plan.tree is not None else ()  # (a captured tree's: the same each step)
            args = (plan, tree, c, qd, self.check and self._graph is None, scaling, window, softcap)
            st.planned[g] = hit = (key, plan_into(_new_wrapper(plan, qd.device), *args), args)
        out = hit[1].run(qd, *caches, sinks=sinks)
        return out if dtype is None else out.to(q.dtype)

    def _begin(self, batch: int, width: int, mask2d, device) -> _Step:
        """Layer 0 of a forward: allocate every row's new slots (all layers share them) and build the plans."""
        pads = self._pad_columns(batch, width, mask2d)
        first = not self._rows
        if not first and batch != len(self._rows):
            raise CodesignError(f"batch changed from {len(self._rows)} to {batch} rows without select_rows")
        tree, self._tree = self._tree, None
        if tree is not None and (width != len(tree) or any(pads)):
            raise CodesignError(
                f"a tree forward takes its {len(tree)} nodes in every row, got {width} columns"
            )
        if first:
            self._rows, self._pads = [None] * batch, [0] * batch
        counts = [width - p for p in pads]
        for b in range(batch):
            self._pads[b] += pads[b]
        starts = [0] * batch if first else self.row_lengths()
        for g in self._groups:  # blocks no query of this forward (or later) sees again in that group
            if g.keep is not None and not first:
                for seq, s in zip(self._rows, starts):
                    g.tables.drop_before(seq, s - g.keep)
        share, self._share = (self._share if first else None), None
        if share is not None and (batch, width) != self._share_shape:
            raise CodesignError(f"the first forward has {batch}x{width} tokens, share_prefixes was planned for "
                                f"input_ids of shape {self._share_shape}")  # fmt: skip
        write = self._allocate(counts, starts, device, share)
        self._undo = (starts, counts, self.seen)
        self.seen += width
        ctx = [s + c for s, c in zip(starts, counts)]
        live = [b for b in range(batch) if counts[b]]
        decode = tree is None and all(c == 1 for c in counts)
        kind = "tree" if tree else ("decode" if decode else ("prefill" if first else "extend"))
        self.steps.append(
            StepRecord(kind, tuple(counts[b] for b in live), tuple(ctx[b] for b in live), tree or ())
        )
        cu = None  # (the step's metadata from pinned memory, non-blocking: layer 0 does not wait for the GPU)
        if not decode:
            cu = K.device_ints([0, *itertools.accumulate(counts)], device, dtype=torch.int32)
        tb = K.build_tree_batch([tree] * batch, starts, device) if tree else None
        ctx_t = K.device_ints(ctx, device, dtype=torch.int32)
        attend = [AttendPlan(w.block_tables, ctx_t, cu, tb, list(self._rows)) for w in write]
        real = None
        if any(pads):
            real = torch.cat([b * width + torch.arange(pads[b], width) for b in range(batch)]).to(device)
        keep_kv = tree is not None or (not self.spec.token_local and max(counts) <= UNDO_MAX)
        st = _Step(batch, width, real, write, attend, keep_kv)
        for chunk in {c for c in self.chunks if c}:
            for g in {self._group_of[i] for i, c in enumerate(self.chunks) if c == chunk}:
                st.chunked[g, chunk] = self._chunk_plan(g, chunk, starts, counts, decode, device)
        return st

    def _chunk_plan(self, g: int, chunk: int, starts, counts, decode: bool, device) -> AttendPlan:
        """Group g's plan for layers of attention chunk `chunk`: each row's new tokens split at the chunks
        (`chunk_pieces`), each piece a row over the blocks from its chunk's start (module docstring)."""
        tables, rows, ctx, q_lens, seqs = self._groups[g].tables, [], [], [], []
        for seq, s, c in zip(self._rows, starts, counts):
            blocks = tables.blocks_view(seq)
            for cs, a, e in chunk_pieces(s, c, chunk):
                rows.append(blocks[cs // self.block_size :])
                ctx.append(e - cs)
                q_lens.append(e - a)
                seqs.append(seq)
        cu = None if decode else K.device_ints([0, *itertools.accumulate(q_lens)], device, dtype=torch.int32)
        return AttendPlan(K.device_rows(rows, device), K.device_ints(ctx, device, dtype=torch.int32), cu, None, seqs)

    def _check_chunks(self, block_size: int) -> None:
        """Refuse a block size or a format the chunked layers (if any) cannot take."""
        for chunk in {c for c in self.chunks if c}:
            if chunk % block_size:
                raise CodesignError(f"block_size={block_size} must divide attention_chunk_size={chunk} (a chunk's "
                                    "first key must start a block)")  # fmt: skip
            if not self.spec.token_local:
                raise CodesignError(f"kv_format {self.spec.name!r} keeps state beyond each token's own slots (KIVI's "
                                    "rings, Oaken's outlier lists): not served on chunked-attention layers "
                                    "(Llama 4)")  # fmt: skip

    def _pad_columns(self, batch: int, width: int, mask2d) -> list[int]:
        """Padding columns among each row's new `width` columns; only left padding is served."""
        if mask2d is None:
            return [0] * batch
        if tuple(mask2d.shape) != (batch, self.seen + width):
            raise CodesignError(
                f"attention mask of shape {tuple(mask2d.shape)}; expected ({batch}, {self.seen + width})"
            )
        return left_pads(mask2d[:, -width:], (batch, width))

    def _allocate(self, counts, starts, device, share=None) -> list[WritePlan]:
        """Reserve counts[b] slots for each row in every group, copying shared partial blocks (copy-on-write)
        in the group's layers; the write plan of those tokens per group. A row not created yet is created, or,
        with share[b] = (src, n), forked from row src (allocated before it) sharing its first n tokens, which
        it then does not write."""
        acc = [([], [], []) for _ in self._groups]  # per group: slots, fresh blocks per row, copies
        for b in range(len(counts)):
            skip = 0
            if self._rows[b] is None:
                src, skip = share[b] if share and share[b] else (None, 0)
                self._rows[b] = self._fork(self._rows[src], skip) if src is not None else self._new_seq()
            for g, (slots, fresh, copies) in zip(self._groups, acc):
                before = g.tables.seq_blocks(self._rows[b])
                new = g.tables.append_slots(self._rows[b], counts[b] - skip)
                after = g.tables.seq_blocks(self._rows[b])
                if before and after[len(before) - 1] != before[-1]:
                    copies.append((before[-1], after[len(before) - 1]))
                fresh.append(after[len(before) :])
                slots += [-1] * skip + new
        return [self._write_plan(g, *a, counts, starts, device) for g, a in zip(self._groups, acc)]

    def _write_plan(self, g: _Group, slots, fresh, copies, counts, starts, device) -> WritePlan:
        """Group g's copies made in its layers' pools, and its write plan."""
        for src, dst in copies:
            for i in g.layers:
                if self.layers[i].storage.kv is not None:
                    self.layers[i].storage.copy_block(src, dst)
        live = [b for b in range(len(counts)) if counts[b]]
        bt = K.device_rows([g.tables.blocks_view(seq) for seq in self._rows], device)
        slots_t = K.device_ints(slots, device)
        pick = lambda xs: [xs[b] for b in live]  # noqa: E731
        blocks = [g.tables.blocks_view(self._rows[b]) for b in live]
        return WritePlan(live, pick(self._rows), pick(starts), pick(counts), slots_t, bt, pick(fresh), blocks)

    def _rewind(self, lengths: list[int], keep: list[list[int]]) -> None:
        """Row b ends with lengths[b] tokens; keep[b]: which of the last forward's tokens of row b (by index
        among them) make up its part after the forward's start, in order."""
        if len(lengths) != len(self._rows):
            raise CodesignError(f"{len(lengths)} lengths for {len(self._rows)} rows")
        now = self.row_lengths()
        prefix_only = all(k == list(range(len(k))) for k in keep)
        if prefix_only and self.spec.token_local:
            for seq, n, m in zip(self._rows, lengths, now):
                if not 0 <= n <= m:
                    raise CodesignError(f"cannot rewind a row of {m} tokens to {n}")
                for g in self._groups:
                    g.tables.truncate(seq, n)
            self._undo = None
            return
        if self._undo is None or any(layer.last_kv is None for _, layer in self._kv_layers):
            raise CodesignError(
                f"kv_format {self.spec.name!r} rolls back only into the last forward (of <= {UNDO_MAX} tokens "
                "a row), and only right after it"
            )
        starts, counts, _ = self._undo
        for b, (n, s, c) in enumerate(zip(lengths, starts, counts)):
            if n != s + len(keep[b]) or any(not 0 <= i < c for i in keep[b]):
                raise CodesignError(f"row {b}: cannot keep {keep[b]} of the last forward's {c} tokens")
        for seq, s in zip(self._rows, starts):
            for g in self._groups:
                g.tables.truncate(seq, s)
        offsets = [0, *torch.tensor(counts).cumsum(0).tolist()]  # row b's tokens start there in last_kv
        idx = torch.tensor([offsets[b] + i for b in range(len(keep)) for i in keep[b]], dtype=torch.long)
        device = self._kv_layers[0][1].last_kv[0].device
        plans = self._allocate([len(k) for k in keep], starts, device)
        for i, layer in self._kv_layers:
            layer.storage.restore(layer.snap)
            k, v = (x[idx.to(x.device)] for x in layer.last_kv)
            layer.storage.write(k, v, plans[self._group_of[i]], None, self.check)
            layer.last_kv = layer.snap = None
        self._undo = None

    # --- sequences ---------------------------------------------------------------------------------------
    def _new_seq(self) -> int:
        seq, self._next_seq = self._next_seq, self._next_seq + 1
        for g in self._groups:
            g.tables.add_sequence(seq)
        return seq

    def _fork(self, src: int, num_tokens: int | None = None) -> int:
        seq, self._next_seq = self._next_seq, self._next_seq + 1
        for g in self._groups:
            g.tables.fork(src, seq, num_tokens)
        for _, layer in self._kv_layers:
            layer.storage.fork_seq(src, seq)
        return seq

    def _free_seq(self, seq: int) -> None:
        for g in self._groups:
            g.tables.free(seq)
        for _, layer in self._kv_layers:
            layer.storage.free_seq(seq)


def _new_wrapper(plan: AttendPlan, device):
    """An unplanned wrapper of the forward's kind: tree, extend or decode."""
    kind = K.TreeAttentionWrapper if plan.tree is not None else (
        K.PagedExtendWrapper if plan.cu_seqlens_q is not None else K.PagedDecodeWrapper)  # fmt: skip
    return kind(device)


def plan_into(w, plan: AttendPlan, tree: tuple[int, ...], cache, qd: torch.Tensor, check: bool, scaling, window,
              softcap):  # fmt: skip
    """Wrapper `w` (of the forward's kind: decode, extend, or tree, every row verifying `tree`, a parent array)
    planned over `cache` (any layer's pool of the group) for queries like `qd`; returns w."""
    kw = dict(sm_scale=scaling, window=window, softcap=softcap, q_dtype=qd.dtype, check_data=check)
    heads, bt = qd.shape[1], plan.block_tables
    if plan.tree is not None:
        w.plan(cache, bt, [tree] * len(plan.tree.prefix_lens), plan.tree.prefix_lens, heads, **kw)
    elif plan.cu_seqlens_q is not None:
        w.plan(cache, bt, plan.context_lens, plan.cu_seqlens_q, heads, **kw)
    else:
        w.plan(cache, bt, plan.context_lens, heads, **kw)
    return w


def plan_buffers(w) -> tuple:
    """(field path, data pointer) of every tensor a planned wrapper's run() reads from its plan: the batch's
    buffers and the launch's (workspace, scratch), one dataclass level down."""
    out = []

    def walk(name, x, depth):
        if isinstance(x, torch.Tensor):
            out.append((name, x.data_ptr()))
        elif isinstance(x, tuple | list):
            for i, y in enumerate(x):
                walk((name, i), y, depth)
        elif depth < 2 and hasattr(type(x), "__dataclass_fields__"):  # (every field sits in __dict__: no slots)
            for k, y in vars(x).items():
                walk((name, k), y, depth + 1)

    p = w._plan
    walk("batch", p.batch, 0)
    walk("launch", p.launch, 0)
    return tuple(out)


def blocks_needed(lengths: list[int], block_size: int) -> int:
    """Blocks a batch of sequences of these lengths takes (no sharing)."""
    return sum(math.ceil(n / block_size) for n in lengths)


def pool_blocks(windows: list[int | None], spec: KVSpec, prompt_lens: list[int], final_lens: list[int], step: int,
                block_size: int, spare_per_row: int = 1) -> tuple[int, int | None]:  # fmt: skip
    """(num_blocks, window_num_blocks) a run needs, for a CodesignCache with the default crop margin: a row
    grows from its prompt to `final_lens` in forwards of at most `step` new tokens. Full-attention layers hold
    every row whole; sliding layers the most a row holds (its prompt, or the window's blocks during a forward);
    plus `spare_per_row` blocks a row (copy-on-write). window_num_blocks None: no full layers to differ from
    (every layer slides, or none does), num_blocks is the pool."""
    spare = spare_per_row * len(prompt_lens)
    full = blocks_needed(final_lens, block_size) + spare
    sliding = {w for w in windows if w is not None}
    if not sliding:
        return full, None
    keep = max(keep_tokens([w], CROP_MARGIN, spec) for w in sliding)
    win = window_blocks(keep, step, block_size)
    held = [min(-(-f // block_size), max(-(-p // block_size), win)) for p, f in zip(prompt_lens, final_lens)]
    windowed = sum(held) + spare
    return (full, windowed) if None in windows else (windowed, None)


def keep_tokens(windows: list[int | None], crop_margin: int, spec: KVSpec) -> int | None:
    """Tokens a row keeps behind its next forward's start, when every layer slides (None: it keeps all):
    the smallest window, the crop margin, and for KIVI its ring (a group is flushed to its blocks late)."""
    if not windows or any(w is None for w in windows):
        return None
    ring = spec.kivi_group + spec.kivi_residual if spec.kind == "kivi" else 0
    return min(windows) + crop_margin + ring


def window_blocks(keep: int, step: int, block_size: int) -> int:
    """The most blocks a row holds during a forward of `step` new tokens that keeps `keep` tokens behind
    its start: the blocks an interval of keep + step positions can touch."""
    return math.ceil((keep + step - 1) / block_size) + 1


def check_tree_paths(paths, parents: Sequence[int], rows: int) -> None:
    """accept_tree's paths: one a row, each a path from the root (node 0) down the tree `parents`."""
    if len(paths) != rows:
        raise CodesignError(f"accept_tree: {len(paths)} paths for {rows} rows")
    for b, path in enumerate(paths):
        nodes = [check_integer(f"accept_tree: paths[{b}][{i}]", x) for i, x in enumerate(path)]
        if not nodes or nodes[0] != 0 or any(not 0 <= x < len(parents) for x in nodes) or any(
                parents[x] != u for u, x in zip(nodes, nodes[1:])):  # fmt: skip
            raise CodesignError(
                f"accept_tree: paths[{b}]={list(path)} is not a path from the root (node 0) down the tree "
                f"{list(parents)}"
            )


def plan_prefix_sharing(input_ids, attention_mask, block_size: int,
                        shares: bool = True) -> list[tuple[int, int] | None]:  # fmt: skip
    """Per row of a first forward's `input_ids`: (an earlier row, the tokens it shares with it: the full blocks of
    their longest common real-token prefix), or None; `shares` False: None for every row."""
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
        raise CodesignError(f"share_prefixes: input_ids must be a [batch, tokens] tensor, got "
                            f"{getattr(input_ids, 'shape', input_ids)}")  # fmt: skip
    if attention_mask is not None and (not isinstance(attention_mask, torch.Tensor)
                                       or attention_mask.shape != input_ids.shape):  # fmt: skip
        raise CodesignError(f"share_prefixes: attention_mask must have input_ids' shape {tuple(input_ids.shape)}")
    ids = input_ids.tolist()
    pads = [0] * len(ids) if attention_mask is None else (attention_mask == 0).sum(1).tolist()
    real = [row[p:] for row, p in zip(ids, pads)]
    plan: list[tuple[int, int] | None] = []
    for b, r in enumerate(real):
        best = max(((_common(real[a], r), a) for a in range(b)), default=(0, 0))
        n = best[0] // block_size * block_size if shares else 0
        plan.append((best[1], n) if n else None)
    return plan


def _common(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def _tokens(x: torch.Tensor, real: torch.Tensor | None) -> torch.Tensor:
    """`[B, H, S, D]` -> `[T, H, D]`, the real tokens row after row."""
    b, h, s, d = x.shape
    flat = x.transpose(1, 2).reshape(b * s, h, d)
    return flat if real is None else flat.index_select(0, real)


def _untokens(out: torch.Tensor, real: torch.Tensor | None, b: int, s: int) -> torch.Tensor:
    """`[T, H, D]` -> `[B, S, H, D]`, zeros at padding columns."""
    if real is None:
        return out.view(b, s, *out.shape[1:])
    full = out.new_zeros(b * s, *out.shape[1:])
    full.index_copy_(0, real, out)
    return full.view(b, s, *out.shape[1:])
