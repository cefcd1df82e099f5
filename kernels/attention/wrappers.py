"""FlashInfer-style plan() / run() wrappers for paged decode, extend and tree attention over every cache type.

plan() validates and stages the batch metadata once per batch shape (one host sync); run() only launches,
so it can be captured in a CUDA graph. A quantized cache object (`kvcache.kvq.QuantPagedKV`,
`kivi.KiviPagedKV`, `oaken.OakenPagedKV`, `mixed.MixedPagedKV`) takes the place of k_cache (v_cache None):
plan() validates it once (`plan(..., q_dtype=)` says q's dtype), run() checks only host-side attributes and
calls the same op as the functional entry point, so the outputs are bit-identical.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from codesign.backend import canonical_device
from codesign.kernels.attention import quantized as kqd
from codesign.kernels.attention.paged import (
    NO_TREE,
    Q_DTYPES,
    SPEC_DTYPES,
    AttnMeta,
    attention_backend,
    paged_attention_torch,
    prepare_launch,
    triton_attention,
)
from codesign.kernels.attention.tree import TreeBatch, build_tree_batch, check_parents
from codesign.kernels.kvcache.checks import check_int_tensor, check_kv_cache, geometry_probe
from codesign.specs import (
    CodesignError,
    KVFormat,
    PagedDecodeAttention,
    PagedExtendAttention,
    TreeAttention,
)

_PERSISTED = ("block_tables", "context_lens", "cu_seqlens_q", "positions", "tree_mask", "mask_indptr",
              "alibi_slopes")  # fmt: skip


def _into(buf: torch.Tensor | None, x: torch.Tensor) -> torch.Tensor:
    """x, or x copied into the caller's buffer."""
    if buf is None or buf is x:
        return x
    return buf.copy_(x)


class _PlannedAttention:
    """plan(): validate and stage metadata once per batch shape; run(): launch only.

    run() allocates nothing whose size depends on data and never syncs with the host, so it can be
    captured in a CUDA graph (pass `out`/`lse` buffers to reuse memory across replays).
    """

    is_decode = False

    def __init__(self, device: str | torch.device = "cpu") -> None:
        self.device = canonical_device(device)
        self._plan: dict | None = None
        self._bufs: dict[str, torch.Tensor] = {}

    def _persist(self, name: str, t: torch.Tensor | None) -> torch.Tensor | None:
        """Keep metadata in buffers the wrapper owns; a re-plan with the same shapes refills them in
        place, so a CUDA graph captured over run() replays with the new batch (FlashInfer's rule)."""
        if t is None:
            return None
        buf = self._bufs.get(name)
        if buf is None or buf.shape != t.shape or buf.dtype != t.dtype or buf.device != t.device:
            buf = self._bufs[name] = t.clone()
        else:
            buf.copy_(t)
        return buf

    def _stage(self, k_cache, block_tables, context_lens, cu, q_tokens, q_heads, tree_args, opts) -> None:
        """plan()'s shared body; cu None for decode, opts: plan()'s keywords."""
        quant = None
        if kqd.is_quant_cache(k_cache) or not isinstance(k_cache, torch.Tensor):
            quant = kqd.describe(k_cache)
            kqd.check_plan(quant, k_cache, block_tables)
            q_dtype = opts["q_dtype"] or torch.float16
            if q_dtype not in Q_DTYPES:
                raise CodesignError(f"q_dtype must be one of {Q_DTYPES}, got {q_dtype}")
            k_cache = geometry_probe(quant.shape, q_dtype, self.device)
        elif opts["q_dtype"] not in (None, k_cache.dtype):
            raise CodesignError(f"q_dtype {opts['q_dtype']} != cache dtype {k_cache.dtype}")
        nb, bs, hkv, dim = k_cache.shape
        probe = torch.empty(q_tokens, q_heads, dim, dtype=k_cache.dtype, device=self.device)
        meta = prepare_launch(probe, k_cache, k_cache, block_tables, context_lens, cu, tree_args, opts)
        from codesign.kernels.attention.triton_attention import dim_pad, launch_config

        ws = None
        if meta.num_splits > 1 and quant is None:  # the quantized-cache ops allocate their own workspace
            shape = (q_tokens, q_heads, meta.num_splits)
            old = self._plan["workspace"] if self._plan else None
            if old is not None and old[1].shape == shape and old[0].shape[-1] == dim_pad(dim):
                ws = old
            else:
                ws = (
                    torch.empty(*shape, dim_pad(dim), dtype=torch.float32, device=self.device),
                    torch.empty(*shape, dtype=torch.float32, device=self.device),
                )
        # Looked up once here, so run() does no table lookup.
        config = launch_config(
            q_heads, hkv, dim, bs, block_tables.shape[0], self.device, k_cache.element_size()
        )  # fmt: skip
        meta = meta._replace(**{f: self._persist(f, getattr(meta, f)) for f in _PERSISTED})
        self._plan = dict(
            meta._asdict(),  # the launch metadata, in buffers the wrapper owns
            quant=quant,  # None for a plain cache
            # Host copies (plan already synced for its checks) for spec(): the roofline bookkeeping.
            host_ctx=tuple(context_lens.tolist()),
            host_cu=tuple(meta.cu_seqlens_q.tolist()),
            window_opt=opts["window"],
            cache_shape=tuple(k_cache.shape),
            dtype=k_cache.dtype,
            q_shape=(q_tokens, q_heads, dim),
            workspace=ws,
            config=config,
        )

    def _spec_common(self) -> dict:
        p = self._plan
        if p is None:
            raise CodesignError("spec() called before plan()")
        _, bs, hkv, dim = p["cache_shape"]
        dt = SPEC_DTYPES[p["dtype"]]
        kv_format = KVFormat(dtype=dt) if p["quant"] is None else p["quant"].kv_format
        return dict(
            q_heads=p["q_shape"][1],
            kv_heads=hkv,
            head_dim=dim,
            block_size=bs,
            dtype=dt,
            kv_format=kv_format,
        )

    def run(
        self,
        q: torch.Tensor,
        k_cache,
        v_cache: torch.Tensor | None = None,
        out: torch.Tensor | None = None,
        lse: torch.Tensor | None = None,
        return_lse: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Attention for the planned batch; q must have the planned shape, the cache the planned layout
        (a plain k_cache and v_cache, or the planned kind of quantized cache as k_cache alone). The
        quantized caches run the functional entry point's op: outputs bit-identical to it."""
        p = self._plan
        if p is None:
            raise CodesignError("run() called before plan()")
        if tuple(q.shape) != p["q_shape"] or q.dtype != p["dtype"] or q.device != self.device:
            raise CodesignError(
                f"q {tuple(q.shape)} {q.dtype} {q.device} does not match the plan "
                f"{p['q_shape']} {p['dtype']} {self.device}"
            )
        want_lse = return_lse or lse is not None
        meta = AttnMeta(*(p[f] for f in AttnMeta._fields))
        if p["quant"] is not None or not isinstance(k_cache, torch.Tensor):
            self._check_quant_run(k_cache, v_cache)
            o, l_ = kqd.launch(p["quant"], q, k_cache, meta, want_lse)
        else:
            check_kv_cache(k_cache, v_cache)
            if (
                tuple(k_cache.shape) != p["cache_shape"]
                or k_cache.dtype != p["dtype"]
                or k_cache.device != q.device
            ):
                raise CodesignError(
                    f"cache {tuple(k_cache.shape)} {k_cache.dtype} does not match the plan "
                    f"{p['cache_shape']} {p['dtype']}"
                )
            if attention_backend(q) == "torch":
                o, l_ = paged_attention_torch(q, k_cache, v_cache, meta, want_lse)
            else:
                kw = dict(workspace=p["workspace"], config=p["config"])
                o, l_ = triton_attention(q, k_cache, v_cache, meta, want_lse, out, lse, **kw)
        out, lse = _into(out, o), _into(lse, l_)
        return (out, lse) if want_lse else out

    def _check_quant_run(self, cache, v_cache) -> None:
        """run() over a quantized cache: host-side checks against the plan (no sync)."""
        info = self._plan["quant"]
        if info is None or not kqd.is_quant_cache(cache):
            raise CodesignError(
                f"run() got a {type(cache).__name__} cache but the plan was made for "
                f"{'a plain cache' if info is None else info.signature[0]}"
            )
        if v_cache is not None:
            raise CodesignError("a quantized cache holds K and V: pass it as k_cache, with v_cache None")
        if kqd.signature(cache) != info.signature:
            raise CodesignError(
                "the quantized cache does not match the plan (tensor shapes, dtypes or format)"
            )


def _plan_opts(sm_scale, window, softcap, alibi_slopes, num_splits, q_dtype) -> dict:
    """plan()'s keywords, as `_stage` and `prepare_launch` read them."""
    return dict(sm_scale=sm_scale, window=window, softcap=softcap, alibi_slopes=alibi_slopes,
                num_splits=num_splits, q_dtype=q_dtype)  # fmt: skip


class PagedDecodeWrapper(_PlannedAttention):
    """Decode attention, FlashInfer style: `plan(...)` once per batch shape, then `run(q, k, v)` per layer."""

    is_decode = True

    def spec(self) -> PagedDecodeAttention:
        """The operator spec of the planned batch (flops, min bytes) for roofline reports."""
        c = self._spec_common()
        return PagedDecodeAttention(context_lens=self._plan["host_ctx"], window=self._plan["window_opt"], **c)

    def plan(
        self,
        k_cache: torch.Tensor,
        block_tables: torch.Tensor,
        context_lens: torch.Tensor,
        num_q_heads: int,
        *,
        sm_scale: float | None = None,
        window: int | None = None,
        softcap: float | None = None,
        alibi_slopes: torch.Tensor | None = None,
        num_splits: int | None = None,
        q_dtype: torch.dtype | None = None,
    ) -> None:
        """Validate the tables (one host sync) and choose splits and workspace for this batch.
        k_cache: a plain cache, or a quantized cache object (then q_dtype, default fp16, is q's dtype)."""
        opts = _plan_opts(sm_scale, window, softcap, alibi_slopes, num_splits, q_dtype)
        self._stage(
            k_cache, block_tables, context_lens, None, block_tables.shape[0], num_q_heads, NO_TREE, opts
        )


class PagedExtendWrapper(_PlannedAttention):
    """Extend / chunked-prefill attention with plan()/run()."""

    def spec(self) -> PagedExtendAttention:
        """The operator spec of the planned batch (sequences without new tokens left out)."""
        c = self._spec_common()
        cu, ctx = self._plan["host_cu"], self._plan["host_ctx"]
        ql = [cu[i + 1] - cu[i] for i in range(len(ctx))]
        keep = [i for i, n in enumerate(ql) if n > 0]
        return PagedExtendAttention(
            q_lens=tuple(ql[i] for i in keep),
            prefix_lens=tuple(ctx[i] - ql[i] for i in keep),
            window=self._plan["window_opt"],
            **c,
        )

    def plan(
        self,
        k_cache: torch.Tensor,
        block_tables: torch.Tensor,
        context_lens: torch.Tensor,
        cu_seqlens_q: torch.Tensor,
        num_q_heads: int,
        *,
        sm_scale: float | None = None,
        window: int | None = None,
        softcap: float | None = None,
        alibi_slopes: torch.Tensor | None = None,
        num_splits: int | None = None,
        q_dtype: torch.dtype | None = None,
    ) -> None:
        """Validate tables and offsets (one host sync); q of run() has cu_seqlens_q[-1] tokens.
        k_cache: a plain cache, or a quantized cache object (then q_dtype, default fp16, is q's dtype)."""
        check_int_tensor("cu_seqlens_q", cu_seqlens_q, 1, self.device)
        tokens = int(cu_seqlens_q[-1]) if cu_seqlens_q.numel() else 0
        opts = _plan_opts(sm_scale, window, softcap, alibi_slopes, num_splits, q_dtype)
        self._stage(k_cache, block_tables, context_lens, cu_seqlens_q, tokens, num_q_heads, NO_TREE, opts)


class TreeAttentionWrapper(_PlannedAttention):
    """Tree attention with plan() (trees -> masks, positions; checks) and run() (launch only)."""

    def plan(
        self,
        k_cache: torch.Tensor,
        block_tables: torch.Tensor,
        parents: Sequence[Sequence[int]],
        prefix_lens: Sequence[int],
        num_q_heads: int,
        *,
        sm_scale: float | None = None,
        window: int | None = None,
        softcap: float | None = None,
        alibi_slopes: torch.Tensor | None = None,
        num_splits: int | None = None,
        q_dtype: torch.dtype | None = None,
    ) -> TreeBatch:
        """Build the tree metadata on the device and validate it against the block tables.

        k_cache: a plain cache, or a quantized cache object (then q_dtype, default fp16, is q's dtype)."""
        tree = build_tree_batch(parents, prefix_lens, self.device)
        opts = _plan_opts(sm_scale, window, softcap, alibi_slopes, num_splits, q_dtype)
        self._stage(k_cache, block_tables, tree.context_lens, tree.cu_seqlens_q, sum(tree.tree_sizes),
                    num_q_heads, tree.mask_args, opts)  # fmt: skip
        self._tree = tree
        self._pairs = tuple(TreeAttention.pairs_from_parents(check_parents(par)) for par in parents)
        return tree

    def spec(self) -> TreeAttention:
        """The operator spec of the planned trees (flops, min bytes) for roofline reports."""
        c = self._spec_common()
        t = self._tree
        return TreeAttention(
            tree_sizes=t.tree_sizes, prefix_lens=t.prefix_lens, ancestor_pairs=self._pairs, **c
        )
