"""`CodesignLatentCache`: DeepSeek-V2/V3's multi-head latent attention (MLA) on codesign's paged latent cache and
the absorbed latent kernel, inside transformers' `generate`.

transformers (from 5.25) caches MLA's latent itself: each attention module hands `cache.update` the normalised
latent `[B, 1, S, kv_lora_rank]` and the rotated key `[B, 1, S, rope]`, expands what it gets back through
kv_b_proj into per-head keys and values, and calls the attention function with them. This cache hands back the
new tokens only (the expansion then costs S tokens, not the history) and leaves them on the module;
`codesign_attention` finds them there and calls `attend`, which
- writes them into the layer's pool `[num_blocks, block_size, kv_lora_rank + rope]` (`latent_write`; e4m3 codes
  over one scale for kv_format="fp8", as vLLM keeps an MLA cache);
- takes each head's non-rotary query through W_UK into the latent space (the absorption; W_UK and W_UV are read
  out of kv_b_proj once, whatever module implements it);
- attends every query token over its row's cached vectors with `latent_decode_attention` (token j of a forward is
  a "sequence" of its row's first start + j + 1 vectors: causal attention over the same blocks), except in the
  prompts' forward over a cache in the model's dtype, whose attention `codesign_attention` runs expanded over its
  own tokens (the paged extend kernel, as DeepSeek prefills: 192-wide dots instead of 576; an e4m3 cache's codes
  are attended in every forward);
- takes the latent output through W_UV to the value heads.
The pool holds one vector a token and layer (576 elements in DeepSeek-V3, against 128 heads x (192 + 128) of
expanded K/V). Padding columns are never written; rows fork with copy-on-write (beam search), crop truncates
(prompt lookup), rows whose prompts start alike share those blocks. Tree verification (`set_tree`) gives each
node a sequence of its own, forked from its row and holding the node's path, so a node is one decode row and
`accept_tree` keeps the accepted node's sequence. Captured steps are not served for MLA (refused by `generate`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers.cache_utils import Cache

from codesign.integrations.hf import _compat
from codesign.integrations.hf import _kernels as K
from codesign.integrations.hf.blocks import BlockTables
from codesign.integrations.hf.cache import (
    CodesignCacheLayer,
    RowSelection,
    StepRecord,
    blocks_needed,
    check_tree_paths,
    plan_prefix_sharing,
)
from codesign.integrations.hf.kv_formats import PLAIN_DTYPES
from codesign.integrations.hf.support import ATTN_NAME, left_pads, text_config
from codesign.specs import CodesignError, KVFormat, check_integer, check_positive_int

FAMILIES = ("deepseek_v2", "deepseek_v3")
# The first transformers release whose MLA modules hand the cache the latent (earlier ones cache expanded K/V).
SINCE = (5, 25)
LATENT_BLOCK = 16  # tokens a block of a latent cache unless given (vLLM's and FlashMLA's 64 also serve)
FORMATS = {None: "the model's dtype, or its name", "fp8": "e4m3 codes over one scale, kv_scale"}


@dataclass(frozen=True)
class LatentLayout:
    """A served MLA model's geometry and its attention modules by layer index."""

    family: str
    layers: int
    heads: int
    latent: int  # kv_lora_rank
    rope: int  # qk_rope_head_dim
    nope: int  # qk_nope_head_dim
    v_dim: int  # v_head_dim
    dtype: torch.dtype
    modules: tuple

    @property
    def width(self) -> int:
        """Elements a cached token holds: the latent, then the rotary key."""
        return self.latent + self.rope


def is_latent_model(model) -> bool:
    """Whether the model's attention is MLA (served by this cache, not `CodesignCache`)."""
    return str(getattr(text_config(model), "model_type", "")) in FAMILIES


def check_latent_model(model) -> LatentLayout:
    """The layout of an MLA model served here; CodesignError naming the reason for any other."""
    cfg = text_config(model)
    family = str(getattr(cfg, "model_type", ""))
    if family not in FAMILIES:
        raise CodesignError(f"model family {family!r} has no latent (MLA) attention; served: {', '.join(FAMILIES)}")
    if _compat.VERSION < SINCE:
        raise CodesignError(
            f"{family} is served from transformers {SINCE[0]}.{SINCE[1]} on (installed {_compat.VERSION[0]}."
            f"{_compat.VERSION[1]} caches expanded keys and values, not the latent)"
        )
    mods = sorted((m for m in model.modules() if hasattr(m, "kv_b_proj") and hasattr(m, "layer_idx")),
                  key=lambda m: m.layer_idx)  # fmt: skip
    n = int(cfg.num_hidden_layers)
    if [m.layer_idx for m in mods] != list(range(n)):
        raise CodesignError(f"{family}: expected one latent attention module per layer 0..{n - 1}")
    dtype = getattr(model, "dtype", torch.float32)
    if dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise CodesignError(f"{family}: a model in {dtype} is not served (float16, bfloat16 or float32)")
    return LatentLayout(family, n, int(cfg.num_attention_heads), int(cfg.kv_lora_rank), int(cfg.qk_rope_head_dim),
                        int(cfg.qk_nope_head_dim), int(cfg.v_head_dim), dtype, tuple(mods))  # fmt: skip


DTYPE_NAMES = {dtype: name for name, dtype in PLAIN_DTYPES.items()}  # (KVFormat's names of a plain cache's dtypes)


def parse_latent_format(kv_format, dtype: torch.dtype | None = None) -> str | None:
    """None (the model's dtype; also its name, "bf16" for a bf16 model) or "fp8" (also "fp8_e4m3"); CodesignError
    naming kv_format otherwise."""
    name = None if kv_format in (None, "plain") else str(kv_format).lower() if isinstance(kv_format, str) else kv_format
    if name == "fp8_e4m3":
        name = "fp8"
    if name is not None and name == DTYPE_NAMES.get(dtype):
        name = None
    if name not in FORMATS:
        served = ", ".join(f"{k!r} ({v})" for k, v in FORMATS.items())
        raise CodesignError(f"kv_format={kv_format!r} is not served for a latent (MLA) cache: {served}")
    return name


def latent_spec_format(kv_format: str | None, dtype: torch.dtype) -> KVFormat:
    """The operator-spec format the dataflow mapper costs a latent cache of `parse_latent_format`'s name in."""
    return KVFormat.parse("fp8") if kv_format == "fp8" else KVFormat(dtype=DTYPE_NAMES[dtype])


@dataclass
class LatentPending:
    """One layer's new latent and rotary key, left on its attention module by `update` for `attend`."""

    cache: CodesignLatentCache
    layer_idx: int
    latent: torch.Tensor  # [B, 1, S, kv_lora_rank]
    rope: torch.Tensor  # [B, 1, S, rope]


@dataclass
class _Step:
    """One forward's plan, shared by its layers: the write slots, one attention row a real query token."""

    batch: int
    width: int
    slots: torch.Tensor  # int64 [B * S]: each column's slot, -1 for padding
    real: torch.Tensor  # flat indices (row * S + col) of the real columns
    tables: torch.Tensor  # int32 [real tokens, blocks]: each token's row's block table
    context: torch.Tensor  # int32 [real tokens]: the vectors each token attends (causal)
    starts: list[int]  # each row's length before the forward (what `_undo_step` restores)
    first: bool  # the prompts' forward (its rows were created by it)
    gather: torch.Tensor | None = None  # a tree forward's: the column each written vector comes from (slots' order)
    tree_seqs: list[list[int]] | None = None  # a tree forward's: each row's sequence of each node (`_begin_tree`)

    @property
    def all_real(self) -> bool:
        """No padding column in the forward (every decode step): the query rows are the columns, in order."""
        return self.real.numel() == self.batch * self.width


class CodesignLatentCache(RowSelection, Cache):
    """A paged latent (MLA) cache for a DeepSeek-V2/V3 model running `attn_implementation="codesign_paged"`.

    kv_format: None (the model's dtype) or "fp8" (e4m3 codes of x / kv_scale; kv_scale default 1.0, as vLLM's);
    num_blocks: pool size in blocks of `block_size` tokens, per layer; check: the kernels' data checks (host syncs),
    and for fp8 that no value passes e4m3's range at that scale (it would be clamped: refused instead).
    """

    def __init__(self, model, kv_format: str | None = None, *, num_blocks: int, block_size: int = LATENT_BLOCK,
                 kv_scale: float | None = None, check: bool = True) -> None:  # fmt: skip
        layout = check_latent_model(model)
        self.kv_format = parse_latent_format(kv_format, layout.dtype)
        check_positive_int("num_blocks", num_blocks)
        check_positive_int("block_size", block_size)
        if not isinstance(check, bool):
            raise CodesignError(f"check must be True or False, got {check!r}")
        if self.kv_format is None and kv_scale is not None:
            raise CodesignError("kv_scale is for kv_format='fp8' (this cache stores the model's dtype)")
        if self.kv_format == "fp8":
            kv_scale = 1.0 if kv_scale is None else kv_scale
            K.check_positive_real("kv_scale", kv_scale)
        self.kv_scale = None if kv_scale is None else float(kv_scale)
        self.layout, self.block_size, self.num_blocks, self.check = layout, block_size, num_blocks, check
        self._config = text_config(model)
        dtype = torch.float8_e4m3fn if self.kv_format == "fp8" else layout.dtype
        device = next(model.parameters()).device
        self.pools = [torch.zeros(num_blocks, block_size, layout.width, dtype=dtype, device=device)
                      for _ in range(layout.layers)]  # fmt: skip
        super().__init__(layers=[CodesignCacheLayer(self, i, None) for i in range(layout.layers)])  # (pools: ours)
        self._tables = BlockTables(num_blocks, block_size)
        self._rows: list[int] = []  # sequence id of each batch row
        self._next_seq = 0
        self.seen = 0  # columns every row has gone through (transformers' sequence length)
        self._step: _Step | None = None
        self._absorb: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # layer -> (W_UK, W_UV), per head
        self.steps: list[StepRecord] = []
        self._share: list[tuple[int, int] | None] | None = None  # the first forward's shared prefixes
        self._share_shape: tuple[int, ...] = ()
        self._tree: tuple[int, ...] | None = None  # the next forward's tree (`set_tree`)
        self._tree_pending: tuple[tuple[int, ...], list[list[int]]] | None = None  # (parents, node sequences)

    # --- transformers' side ---------------------------------------------------------------------------
    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        """Leave the new latent (`key_states`) and rotary key (`value_states`) on layer `layer_idx`'s attention
        module, for `codesign_attention` to write and attend, and return them."""
        if self._config._attn_implementation != ATTN_NAME:
            raise CodesignError(
                f"CodesignLatentCache needs attn_implementation={ATTN_NAME!r} (the model runs "
                f"{self._config._attn_implementation!r}): call model.set_attn_implementation({ATTN_NAME!r})"
            )
        lay = self.layout
        if key_states.shape[-1] != lay.latent or value_states.shape[-1] != lay.rope or key_states.shape[1] != 1:
            raise CodesignError(
                f"layer {layer_idx}: expected the latent [B, 1, S, {lay.latent}] and rotary key [B, 1, S, {lay.rope}], "
                f"got {tuple(key_states.shape)} and {tuple(value_states.shape)} (a transformers release that caches "
                "expanded keys?)"
            )
        mod = lay.modules[layer_idx]
        if mod.__dict__.get("_codesign_pending") is not None:
            raise CodesignError(f"layer {layer_idx}: the previous latent was never attended (foreign attention?)")
        mod._codesign_pending = LatentPending(self, layer_idx, key_states, value_states)
        return key_states, value_states

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.seen

    def model_seen(self) -> int:
        """`seen`, as the layers (`CodesignCacheLayer`) read it."""
        return self.seen

    def get_mask_sizes(self, query_length, layer_idx: int = 0) -> tuple[int, int]:
        return self.seen + _compat.query_length(query_length), 0

    def get_max_length(self, layer_idx: int | None = None) -> int:
        return -1

    get_max_cache_shape = get_max_length

    @property
    def is_compileable(self) -> bool:
        return False

    def activate_past_recording(self, recurrent_states_to_keep: int | None = None) -> None:
        """Nothing to do: every layer keeps all its tokens."""

    def reset(self) -> None:
        self._free_tree()
        for seq in self._rows:
            self._tables.free(seq)
        self._rows, self.seen, self._step, self._tree = [], 0, None, None

    def crop(self, tokens_to_remove: int) -> None:
        """Drop the last `-tokens_to_remove` columns (transformers 5 passes a negative count; 0: nothing)."""
        n = _compat.tokens_to_remove(check_integer("crop: tokens_to_remove", tokens_to_remove), self.seen)
        if n == 0:
            return
        self._check_no_tree("crop")
        if n > self.seen:
            raise CodesignError(f"crop of {n} tokens from a cache of {self.seen}")
        for seq in self._rows:
            self._tables.truncate(seq, max(self._tables.seq_len(seq) - n, 0))
        self.seen -= n

    # --- codesign's side ---------------------------------------------------------------------------------
    def select_rows(self, rows: list[int]) -> None:
        """New batch row i continues old row rows[i]; rows may repeat (forks share blocks, copy on write)."""
        self._check_no_tree("select_rows")
        old = self._rows
        rows = [check_integer(f"select_rows: rows[{i}]", r) for i, r in enumerate(rows)]
        if any(not 0 <= r < len(old) for r in rows):
            raise CodesignError(f"select_rows: rows {rows} outside the batch of {len(old)}")
        new = []
        for r in rows:
            seq, self._next_seq = self._next_seq, self._next_seq + 1
            self._tables.fork(old[r], seq)
            new.append(seq)
        for seq in old:
            self._tables.free(seq)
        self._rows = new

    def share_prefixes(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> list[int]:
        """Plan the first forward so that each row shares the full blocks of its longest common real-token prefix
        with an earlier row (forked from it, those tokens written once); returns the shared token count per row."""
        if self._rows:
            raise CodesignError("share_prefixes must be planned before the first forward")
        self._share = plan_prefix_sharing(input_ids, attention_mask, self.block_size)
        self._share_shape = tuple(input_ids.shape)
        return [p[1] if p else 0 for p in self._share]

    def rewind(self, lengths: list[int]) -> None:
        """Truncate row b to lengths[b] tokens (a draft model's cache after proposing a tree)."""
        self._check_no_tree("rewind")
        lengths = [check_integer(f"rewind: lengths[{b}]", n) for b, n in enumerate(lengths)]
        if len(lengths) != len(self._rows):
            raise CodesignError(f"rewind: {len(lengths)} lengths for {len(self._rows)} rows")
        for seq, n in zip(self._rows, lengths):
            self._tables.truncate(seq, n)

    def set_tree(self, parents) -> None:
        """Make the next forward a tree verification: its columns are the nodes of this tree (a parent array, the
        same for every row), each attending to its row's tokens and to its ancestors only. Each node gets a
        sequence of its own, forked from its row (the prefix's blocks shared) and holding the path from the root to
        it, so a node is one decode row of the latent kernel; `accept_tree` keeps the accepted node's."""
        self._tree = tuple(K.check_parents(parents))

    def accept_tree(self, paths: list[list[int]]) -> None:
        """Compact each row to its accepted path: row b keeps nodes paths[b] (node 0, the root, first) of the last
        tree forward at positions prefix, prefix + 1, ...: the sequence of the path's last node, which holds
        exactly those; every other node's is dropped."""
        if self._tree_pending is None:
            raise CodesignError("accept_tree must follow a tree forward")
        parents, seqs = self._tree_pending
        check_tree_paths(paths, parents, len(self._rows))
        for r, path in enumerate(paths):
            keep = seqs[r][path[-1]]
            seqs[r] = [v for v in seqs[r] if v != keep]
            self._tables.free(self._rows[r])
            self._rows[r] = keep
        self._free_tree()

    @property
    def allocator(self):
        """The block allocator (reference-counted block ids) the pools are indexed by."""
        return self._tables.allocator

    def blocks_in_use(self) -> int:
        """Blocks of the pool held by some row."""
        return self.num_blocks - self._tables.allocator.num_free

    def row_lengths(self) -> list[int]:
        return [self._tables.seq_len(s) for s in self._rows]

    def block_tables(self) -> torch.Tensor:
        """int32 `[rows, blocks]` of the current rows."""
        return self._tables.block_tables(self._rows)

    @property
    def format_name(self) -> str:
        """"fp8", or the model dtype's name ("bf16", "fp16", "fp32") the cache stores."""
        return self.kv_format or DTYPE_NAMES[self.layout.dtype]

    def nbytes(self) -> int:
        """Bytes of every layer's pool."""
        return sum(p.numel() * p.element_size() for p in self.pools)

    def attend(self, pending: LatentPending, query: torch.Tensor, mask2d, scaling, window=None, softcap=None,
               sinks=None) -> torch.Tensor | None:  # fmt: skip
        """Write a layer's pending latent and attend its query `[B, H, S, nope + rope]` (absorbed, over the
        pool); the output `[B, S, H, v_head_dim]` as transformers' attention functions return it. None in the
        prompts' forward over a cache in the model's dtype (the latent written): its attention is over its own
        tokens only, which the caller runs expanded, with the per-head keys and values transformers made of them
        (fewer FLOPs a key than absorbed: nope + rope and v wide, not latent + rope and latent, as DeepSeek prefills
        and the step graph costs it). An e4m3 cache attends its codes in every forward, the prompts' too."""
        if window is not None or softcap is not None or sinks is not None:
            raise CodesignError(f"{ATTN_NAME} attention over a latent cache takes no window, soft cap or sinks")
        lay, layer = self.layout, pending.layer_idx
        b, h, s, d = query.shape
        if (h, d) != (lay.heads, lay.nope + lay.rope) or pending.latent.shape[0] != b or pending.latent.shape[2] != s:
            raise CodesignError(
                f"layer {layer}: a query of shape {tuple(query.shape)} for a latent of {tuple(pending.latent.shape)} "
                f"({lay.heads} heads of {lay.nope} + {lay.rope} expected)"
            )
        if layer == 0:
            self._begin(b, s, mask2d, query.device)
        step = self._step
        if step is None or (step.batch, step.width) != (b, s):
            raise CodesignError(f"layer {layer}: no forward of {b} x {s} tokens was begun at layer 0")
        try:
            return self._attend(step, pending, query, scaling, absorbed=not step.first or self.kv_format == "fp8")
        except CodesignError:
            self._undo_step()  # the cache stays as before this forward
            raise

    def _attend(self, step: _Step, pending: LatentPending, query: torch.Tensor, scaling, absorbed: bool):
        lay, layer = self.layout, pending.layer_idx
        b, h, s, d = query.shape
        pool, kv_scale = self.pools[layer], float(self.kv_scale or 1.0)
        kv_c = pending.latent.reshape(b * s, lay.latent).contiguous()
        k_pe = pending.rope.reshape(b * s, lay.rope).contiguous()
        if self.kv_format == "fp8" and self.check:
            self._check_range(layer, kv_c, k_pe, step.real)
        if step.gather is not None:  # a tree: each node's path into its own sequence (an ancestor once a descendant)
            kv_c, k_pe = kv_c.index_select(0, step.gather), k_pe.index_select(0, step.gather)
        # Layer 0 goes through the checked entry points; the others repeat its geometry on their own pool, so they
        # run the ops' bodies (no checks, no dispatcher: host time a layer, as a plan saves the paged layers).
        checked = layer == 0 or (self.check and self.kv_format == "fp8")  # (an e4m3 cache: each layer's q range)
        if checked:
            K.latent_write(kv_c, k_pe, pool, step.slots, kv_scale=self.kv_scale, check_data=self.check and layer == 0)
        else:
            K.latent_write_body(kv_c, k_pe, pool, step.slots, kv_scale)
        if not absorbed:
            return None
        w_uk, w_uv = self._weights(layer, query.dtype)
        q = query.transpose(1, 2).reshape(b * s, h, d)
        if not step.all_real:
            q = q.index_select(0, step.real)
        q_abs = torch.matmul(q[..., : lay.nope].transpose(0, 1), w_uk)  # [H, tokens, latent]
        q_lat = torch.cat((q_abs.transpose(0, 1).to(query.dtype), q[..., lay.nope :]), dim=-1)
        if checked:
            out = K.latent_decode_attention(q_lat, pool, step.tables, step.context, v_dim=lay.latent,
                                            sm_scale=float(scaling), kv_scale=self.kv_scale, check_data=self.check)
        else:
            out = K.latent_decode_body(q_lat, pool, step.tables, step.context, lay.latent, float(scaling), kv_scale, 0)
        o = torch.matmul(out.transpose(0, 1), w_uv).transpose(0, 1).to(query.dtype)  # [tokens, H, v]
        if step.all_real:
            return o.reshape(b, s, h, lay.v_dim)
        full = o.new_zeros(b * s, h, lay.v_dim)
        full.index_copy_(0, step.real, o)
        return full.view(b, s, h, lay.v_dim)

    def _weights(self, layer: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(W_UK `[H, nope, latent]`, W_UV `[H, latent, v]`) of a layer: kv_b_proj applied to the identity, so
        any module implementing it (a quantized linear too) gives its effective weight. Read once a cache."""
        got = self._absorb.get(layer)
        if got is None:
            lay = self.layout
            proj = lay.modules[layer].kv_b_proj
            w = next(proj.parameters(), None)
            eye = torch.eye(lay.latent, dtype=dtype, device=w.device if w is not None else None)
            with torch.no_grad():
                wt = proj(eye)  # [latent, H * (nope + v)]
            if wt.shape != (lay.latent, lay.heads * (lay.nope + lay.v_dim)):
                raise CodesignError(f"layer {layer}: kv_b_proj maps {lay.latent} channels to {tuple(wt.shape)}")
            wt = wt.view(lay.latent, lay.heads, lay.nope + lay.v_dim)
            got = (wt[..., : lay.nope].permute(1, 2, 0).contiguous(), wt[..., lay.nope :].permute(1, 0, 2).contiguous())
            self._absorb[layer] = got
        return got

    def _check_range(self, layer: int, kv_c: torch.Tensor, k_pe: torch.Tensor, real: torch.Tensor) -> None:
        """e4m3 holds |x / kv_scale| <= 448: a larger value would be clamped, so it is refused (one host sync)."""
        big = max(float(t.index_select(0, real).abs().amax()) if real.numel() else 0.0 for t in (kv_c, k_pe))
        if not big <= K.kvq.FP8_MAX * self.kv_scale:
            raise CodesignError(
                f"layer {layer}: a latent value of {big:g} passes e4m3's range at kv_scale={self.kv_scale:g} "
                f"(|x| <= {K.kvq.FP8_MAX * self.kv_scale:g}): pass a larger kv_scale"
            )

    def _begin(self, b: int, s: int, mask2d, device) -> None:
        """Plan a forward of `b` rows x `s` columns: append each row's real columns (the first forward's left
        padding is never written) and give every real token its attention row."""
        if self._tree_pending is not None:
            raise CodesignError("a tree forward's accept_tree must come before the next forward")
        first = not self._rows
        if self._tree is not None and not first:
            return self._begin_tree(b, s, mask2d, device)
        share, self._share = (self._share if first else None), None
        if first:
            real = torch.ones(b, s, dtype=torch.bool) if mask2d is None else mask2d[:, -s:].cpu().to(torch.bool)
            left_pads(real, (b, s))
            if share is not None and (b, s) != self._share_shape:
                raise CodesignError(f"the first forward has {b}x{s} tokens, share_prefixes was planned for "
                                    f"input_ids of shape {self._share_shape}")  # fmt: skip
        else:
            if b != len(self._rows):
                raise CodesignError(f"a forward of {b} rows over a cache of {len(self._rows)}")
            if mask2d is not None and not bool(mask2d[:, -s:].all()):
                raise CodesignError("padding is served in the first forward only (the prompts')")
            real = torch.ones(b, s, dtype=torch.bool)
        counts = real.sum(1).tolist()
        starts = [0] * b if first else self.row_lengths()
        slots = torch.full((b, s), -1, dtype=torch.int64)
        try:
            self._reserve(counts, share, first, slots)
        except CodesignError:  # (a pool too small): the rows as before the forward
            if first:
                self.reset()
            else:
                for seq, n in zip(self._rows, starts):
                    self._tables.truncate(seq, n)
            raise
        flat = torch.nonzero(real.flatten()).flatten()
        rows = (flat // s).tolist()
        table = self._tables.block_tables(self._rows)
        ctx = [starts[r] + j + 1 for r, n in enumerate(counts) for j in range(n)]
        self._step = _Step(b, s, slots.flatten().to(device), flat.to(device), table[rows].to(device),
                           torch.tensor(ctx, dtype=torch.int32, device=device), starts, first)  # fmt: skip
        kind = "prefill" if first else "decode" if s == 1 else "extend"
        self.steps.append(StepRecord(kind, tuple(counts), tuple(a + n for a, n in zip(starts, counts))))
        self.seen += s

    def _begin_tree(self, b: int, s: int, mask2d, device) -> None:
        """Plan a tree verification (`set_tree`): for each row and node a sequence forked from the row, holding the
        node's path from the root after the row's tokens; the node attends to it as one decode row."""
        parents, self._tree = self._tree, None
        if s != len(parents):
            raise CodesignError(f"a tree of {len(parents)} nodes, but the forward has {s} columns")
        if b != len(self._rows):
            raise CodesignError(f"a forward of {b} rows over a cache of {len(self._rows)}")
        if mask2d is not None and not bool(mask2d[:, -s:].all()):
            raise CodesignError("a tree forward takes no padding")
        paths: list[list[int]] = [[0]]
        for u in range(1, s):
            paths.append([*paths[parents[u]], u])
        starts = self.row_lengths()
        seqs: list[list[int]] = []
        gather, slots, ctx, copies = [], [], [], []
        self._tree_pending = (parents, seqs)  # (`_free_tree` returns whatever was forked if a fork fails)
        try:
            for r in range(b):
                seqs.append([])
                for u in range(s):
                    seq, self._next_seq = self._next_seq, self._next_seq + 1
                    self._tables.fork(self._rows[r], seq)
                    seqs[r].append(seq)
                    slots += self._append(seq, len(paths[u]), copies)
                    gather += [r * s + a for a in paths[u]]
                    ctx.append(starts[r] + len(paths[u]))
        except CodesignError:
            self._free_tree()
            raise
        self._copy_blocks(copies)
        table = self._tables.block_tables([v for row in seqs for v in row])
        self._step = _Step(b, s, torch.tensor(slots, dtype=torch.int64, device=device),
                           torch.arange(b * s, device=device), table.to(device),
                           torch.tensor(ctx, dtype=torch.int32, device=device), starts, False,
                           torch.tensor(gather, dtype=torch.int64, device=device), seqs)  # fmt: skip
        self.steps.append(StepRecord("tree", (s,) * b, tuple(n + s for n in starts), parents))
        self.seen += s

    def _free_tree(self) -> None:
        """Return the node sequences of a tree forward not accepted (or accepted: the rest) to the pool."""
        pending, self._tree_pending = self._tree_pending, None
        for row in pending[1] if pending else []:
            for seq in row:
                self._tables.free(seq)

    def _check_no_tree(self, call: str) -> None:
        if self._tree_pending is not None:
            raise CodesignError(f"{call}: the last tree forward's accept_tree comes first")

    def _reserve(self, counts: list[int], share, first: bool, slots: torch.Tensor) -> None:
        """Each row's slots for its counts[r] new (rightmost) columns into `slots`; in the first forward each row is
        created, or forked from an earlier row's first `shared` tokens (share[r]), which it then does not write."""
        s, copies = slots.shape[1], []
        for r, n in enumerate(counts):
            shared = 0
            if first:
                seq, self._next_seq = self._next_seq, self._next_seq + 1
                src, shared = (share or [None] * len(counts))[r] or (None, 0)
                if src is None:
                    self._tables.add_sequence(seq)
                else:
                    self._tables.fork(self._rows[src], seq, shared)
                self._rows.append(seq)
            slots[r, s - n + shared :] = torch.tensor(self._append(self._rows[r], n - shared, copies),
                                                      dtype=torch.int64)  # fmt: skip
        self._copy_blocks(copies)

    def _undo_step(self) -> None:
        """Forget the forward in progress (a layer refused its data): rows back to their lengths before it."""
        step, self._step = self._step, None
        if step is None:
            return
        if step.first:
            self.reset()
        elif step.tree_seqs is not None:  # (the rows themselves were not touched)
            self._free_tree()
            self.seen -= step.width
        else:
            for seq, n in zip(self._rows, step.starts):
                self._tables.truncate(seq, n)
            self.seen -= step.width
        self.steps.pop()

    def _append(self, seq: int, n: int, copies: list[tuple[int, int]]) -> list[int]:
        """Reserve n slots of `seq`; a shared partial last block's fresh replacement joins `copies` as (old, new),
        to be copied (`_copy_blocks`) before anything is written."""
        before = self._tables.blocks_view(seq)
        idx, old = len(before) - 1, before[-1] if before else None
        slots = self._tables.append_slots(seq, n)
        new = self._tables.blocks_view(seq)
        if old is not None and new[idx] != old:  # copy-on-write
            copies.append((old, new[idx]))
        return slots

    def _copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """The copies-on-write of a forward, one gather and scatter a layer's pool (a tree copies a block a node)."""
        if copies:
            dev = self.pools[0].device
            old = torch.tensor([o for o, _ in copies], device=dev)
            new = torch.tensor([n for _, n in copies], device=dev)
            for pool in self.pools:
                raw = pool.view(torch.uint8) if pool.dtype == torch.float8_e4m3fn else pool  # (no e4m3 index_copy_)
                raw.index_copy_(0, new, raw.index_select(0, old))


def latent_pool_blocks(final_lens: list[int], block_size: int) -> int:
    """Blocks a run needs: every row whole at its final length, plus one a row for copy-on-write."""
    return blocks_needed(final_lens, block_size) + len(final_lens)


def latent_tree_blocks(prompt_lens: list[int], max_length: int, parents, block_size: int) -> int:
    """Blocks a tree-speculative run needs: every row whole at max_length plus a tree, and during a tree forward
    each node's own sequence (`set_tree`): a copy of its row's partial last block and its path's blocks."""
    depths = K.tree_depths(K.check_parents(parents))
    per_node = 1 + -(-(max(depths) + 1) // block_size) + 1
    rows = len(prompt_lens)
    return blocks_needed([max_length + len(parents)] * rows, block_size) + rows * len(parents) * per_node
