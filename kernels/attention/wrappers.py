"""FlashInfer-style plan() / run() wrappers for paged decode, extend and tree attention over every cache type.

plan() does everything once per batch shape: validates the cache and the batch (one host sync), resolves the
options and plans the launch (`triton_attention.plan_launch`: the tuned config, the split count, the split
workspace); run() only checks host-side attributes against the plan and launches, with no table lookup, no
allocation (given `out` and `lse` buffers) and no host sync, so it can be captured in a CUDA graph. A
quantized cache object (`kvcache.kvq.QuantPagedKV`, `kivi.KiviPagedKV`, `oaken.OakenPagedKV`,
`mixed.MixedPagedKV`) takes the place of k_cache (v_cache None; `plan(..., q_dtype=)` says q's dtype). run()
launches what the functional entry point's op launches, so the outputs are bit-identical to it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from codesign.backend import canonical_device
from codesign.kernels.attention.mixed_by_width import ByWidthPlan, by_width_applies, plan_by_width
from codesign.kernels.attention.oaken_split import SplitPlan, plan_split, split_applies
from codesign.kernels.attention.ops import PLAIN, AttentionFormat, run_attention
from codesign.kernels.attention.options import Q_DTYPES, AttentionBatch, AttentionOptions, alloc_lse, prepare
from codesign.kernels.attention.quantized import QUANT_CACHE_TYPES, format_of
from codesign.kernels.attention.tree import TreeBatch, build_tree_batch, check_parents
from codesign.kernels.attention.triton_attention import LaunchPlan, plan_launch
from codesign.kernels.kvcache.checks import check_int_tensor, check_kv_cache, geometry_probe
from codesign.kernels.kvcache.formats import KV_FORMAT_PLAIN, PLAIN_BITS, kernel_format
from codesign.kernels.kvcache.oaken import OakenPagedKV
from codesign.specs import (
    CodesignError,
    KVFormat,
    PagedDecodeAttention,
    PagedExtendAttention,
    TreeAttention,
    check_positive_int,
)

SPEC_DTYPES = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}


@dataclass(frozen=True, eq=False)
class _Plan:
    """What plan() decided: the cache type, the batch (in buffers the wrapper owns), the resolved options
    (with and without lse), the launch plan, and what spec() and run()'s checks read."""

    fmt: AttentionFormat
    batch: AttentionBatch
    opts: AttentionOptions
    opts_lse: AttentionOptions
    launch: LaunchPlan | ByWidthPlan | SplitPlan
    no_lse: torch.Tensor  # the `[0, q_heads]` lse run() passes when none is asked
    signature: tuple | None  # a quantized cache's (`AttentionFormat.signature`), None for a plain cache
    kv_format: KVFormat
    window: int | None
    cache_shape: tuple[int, ...]
    dtype: torch.dtype
    q_shape: tuple[int, int, int]


class _PlannedAttention:
    """plan(): validate and stage metadata once per batch shape; run(): launch only.

    run() allocates nothing whose size depends on data and never syncs with the host, so it can be
    captured in a CUDA graph (pass `out`/`lse` buffers to reuse memory across replays).
    """

    is_decode = False

    def __init__(self, device: str | torch.device = "cpu") -> None:
        self.device = canonical_device(device)
        self._plan: _Plan | None = None
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

    def _keep(self, name: str, t: torch.Tensor) -> torch.Tensor:
        """The wrapper's buffer `name` when it has t's shape, dtype and device (its contents are not copied:
        run() rebuilds them), else t, kept from now on."""
        buf = self._bufs.get(name)
        if buf is None or buf.shape != t.shape or buf.dtype != t.dtype or buf.device != t.device:
            buf = self._bufs[name] = t
        return buf

    def _cache_geometry(self, cache: Any, block_tables: torch.Tensor, q_dtype: torch.dtype | None,
                        check_data: bool = True) -> tuple:  # fmt: skip
        """(format, a tensor of the cache's geometry and q's dtype, signature, spec format, kernel code, bits);
        `check_data`: the cache's value checks too (a host sync: thresholds, block widths)."""
        fmt = format_of(cache)
        if fmt is PLAIN:
            if q_dtype not in (None, cache.dtype):
                raise CodesignError(f"q_dtype {q_dtype} != cache dtype {cache.dtype}")
            return fmt, cache, None, KVFormat(dtype=SPEC_DTYPES[cache.dtype]), KV_FORMAT_PLAIN, PLAIN_BITS
        shape = fmt.check(cache, block_tables, check_data)
        q_dtype = q_dtype or torch.float16
        if q_dtype not in Q_DTYPES:
            raise CodesignError(f"q_dtype must be one of {Q_DTYPES}, got {q_dtype}")
        probe = geometry_probe(shape, q_dtype, self.device)
        return fmt, probe, fmt.signature(cache), cache.kv_format, *kernel_format(cache.kv_format)

    def _stage(self, cache, block_tables, context_lens, cu, q_tokens, q_heads, tree_args, opts, q_dtype) -> None:
        """plan()'s shared body; cu None for decode."""
        check_positive_int("num_q_heads", q_heads)
        if q_tokens < 0:
            raise CodesignError(f"the plan's query tokens (cu_seqlens_q[-1]) must be >= 0, got {q_tokens}")
        fmt, k_like, signature, kv_format, code, bits = self._cache_geometry(cache, block_tables, q_dtype,
                                                                             opts.check_data)  # fmt: skip
        dim = k_like.shape[3]
        probe = torch.empty(q_tokens, q_heads, dim, dtype=k_like.dtype, device=self.device)
        batch, opts = prepare(probe, k_like, k_like, block_tables, context_lens, cu, tree_args, opts)
        old = self._plan.launch.workspace if self._plan else None
        cap = cache.capacity if isinstance(cache, OakenPagedKV) else 0
        if by_width_applies(code, probe, batch, opts, tuple(k_like.shape)):  # a mixed cache's decode, width by width
            launch = plan_by_width(probe, tuple(k_like.shape), batch, opts.num_splits, old)
            # run() rebuilds the sorted tables in place: the buffers stay put across re-plans (CUDA graphs)
            launch = dataclasses.replace(launch, tables=self._keep("width_tables", launch.tables),
                                         lens=self._keep("width_lens", launch.lens))  # fmt: skip
        elif split_applies(code, probe, batch, opts, tuple(k_like.shape)):  # an Oaken decode in three launches
            launch = plan_split(probe, tuple(k_like.shape), bits, batch, opts.num_splits, old)
            # run() rewrites every buffer (q_t's padding heads stay 0): they stay put across re-plans (CUDA graphs)
            kept = {n: self._keep("split_" + n, getattr(launch, n)) for n in ("bias", "probs", "q_t", "corr")}
            maxima = self._keep("split_maxima", launch.launch.oaken_scratch)
            launch = dataclasses.replace(launch, launch=dataclasses.replace(launch.launch, oaken_scratch=maxima),
                                         **kept)  # fmt: skip
        else:
            launch = plan_launch(probe, tuple(k_like.shape), code, bits, batch, opts.num_splits, old, cap)
            launch = dataclasses.replace(launch, tree_words=self._persist("tree_words", launch.tree_words))
        if launch.oaken_scratch is not None:  # rewritten by every run(): only the buffer is kept across re-plans
            launch = dataclasses.replace(launch, oaken_scratch=self._keep("oaken_scratch", launch.oaken_scratch))
        persisted = {f.name: self._persist(f.name, getattr(batch, f.name)) for f in dataclasses.fields(batch)
                     if isinstance(getattr(batch, f.name), torch.Tensor)}  # fmt: skip
        self._plan = _Plan(
            fmt=fmt,
            batch=dataclasses.replace(batch, **persisted),
            opts=opts,
            opts_lse=dataclasses.replace(opts, return_lse=True),
            launch=launch,
            no_lse=alloc_lse(probe, False),
            signature=signature,
            kv_format=kv_format,
            window=opts.window,
            cache_shape=tuple(k_like.shape),
            dtype=k_like.dtype,
            q_shape=(q_tokens, q_heads, dim),
        )

    def _host_lens(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(context lengths, query offsets) of the planned batch on the host, for spec()'s roofline bookkeeping: read
        from the plan's buffers when asked (one sync), not at every plan (a decode step's re-plan would wait)."""
        b = self._plan.batch
        return tuple(b.context_lens.tolist()), tuple(b.cu_seqlens_q.tolist())

    def _spec_common(self) -> dict:
        p = self._plan
        if p is None:
            raise CodesignError("spec() called before plan()")
        _, bs, hkv, dim = p.cache_shape
        dt = SPEC_DTYPES[p.dtype]
        return dict(q_heads=p.q_shape[1], kv_heads=hkv, head_dim=dim, block_size=bs, dtype=dt, kv_format=p.kv_format)

    def run(
        self,
        q: torch.Tensor,
        k_cache,
        v_cache: torch.Tensor | None = None,
        out: torch.Tensor | None = None,
        lse: torch.Tensor | None = None,
        return_lse: bool = False,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Attention for the planned batch; q must have the planned shape, the cache the planned layout
        (a plain k_cache and v_cache, or the planned kind of quantized cache as k_cache alone). Outputs
        are bit-identical to the functional entry point's. sinks: this layer's fp32 `[q_heads]` attention sinks
        (`attention.sinks`), given per run since one plan serves every layer."""
        p = self._plan
        if p is None:
            raise CodesignError("run() called before plan()")
        if tuple(q.shape) != p.q_shape or q.dtype != p.dtype or q.device != self.device:
            raise CodesignError(
                f"q {tuple(q.shape)} {q.dtype} {q.device} does not match the plan "
                f"{p.q_shape} {p.dtype} {self.device}"
            )
        want_lse = return_lse or lse is not None
        _check_outputs(q, out, lse)
        if p.fmt is PLAIN and isinstance(k_cache, torch.Tensor):
            self._check_plain_run(k_cache, v_cache, q)
            tensors, params = (k_cache, v_cache), ()
        else:
            self._check_quant_run(k_cache, v_cache)
            tensors, params = p.fmt.op_tensors(k_cache), p.fmt.params(k_cache)
        opts = p.opts_lse if want_lse else p.opts
        if sinks is not None:
            opts = dataclasses.replace(opts, sinks=sinks)
            opts.check(q.shape[1], q.device)
        o, l_ = run_attention(p.fmt, q, tensors, params, p.batch, opts, out, lse if want_lse else p.no_lse,
                              p.launch)  # fmt: skip
        return (o, l_) if want_lse else o

    def _check_plain_run(self, k_cache: torch.Tensor, v_cache: torch.Tensor, q: torch.Tensor) -> None:
        p = self._plan
        check_kv_cache(k_cache, v_cache)
        if tuple(k_cache.shape) != p.cache_shape or k_cache.dtype != p.dtype or k_cache.device != q.device:
            raise CodesignError(
                f"cache {tuple(k_cache.shape)} {k_cache.dtype} does not match the plan {p.cache_shape} {p.dtype}"
            )

    def _check_quant_run(self, cache, v_cache) -> None:
        """run() over a quantized cache: host-side checks against the plan (no sync)."""
        p = self._plan
        if p.fmt is PLAIN or not isinstance(cache, QUANT_CACHE_TYPES):
            raise CodesignError(
                f"run() got a {type(cache).__name__} cache but the plan was made for "
                f"{'a plain cache' if p.fmt is PLAIN else p.signature[0]}"
            )
        if v_cache is not None:
            raise CodesignError("a quantized cache holds K and V: pass it as k_cache, with v_cache None")
        if p.fmt.signature(cache) != p.signature:
            raise CodesignError("the quantized cache does not match the plan (tensor shapes, dtypes or format)")


def _plan_options(sm_scale, window, softcap, alibi_slopes, num_splits, check_data: bool = True) -> AttentionOptions:
    """plan()'s keywords as options (the data checks on unless the plan's caller turns them off)."""
    return AttentionOptions(sm_scale, window, softcap, alibi_slopes, False, num_splits, check_data)


class PagedDecodeWrapper(_PlannedAttention):
    """Decode attention, FlashInfer style: `plan(...)` once per batch shape, then `run(q, k, v)` per layer."""

    is_decode = True

    def spec(self) -> PagedDecodeAttention:
        """The operator spec of the planned batch (flops, min bytes) for roofline reports."""
        c = self._spec_common()
        return PagedDecodeAttention(context_lens=self._host_lens()[0], window=self._plan.window, **c)

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
        check_data: bool = True,
    ) -> None:
        """Validate the tables (one host sync; `check_data` False: a caller that built them skips it) and choose
        splits and workspace for this batch.
        k_cache: a plain cache, or a quantized cache object (then q_dtype, default fp16, is q's dtype)."""
        opts = _plan_options(sm_scale, window, softcap, alibi_slopes, num_splits, check_data)
        check_int_tensor("block_tables", block_tables, 2, self.device)
        self._stage(
            k_cache, block_tables, context_lens, None, block_tables.shape[0], num_q_heads, None, opts, q_dtype
        )


class PagedExtendWrapper(_PlannedAttention):
    """Extend / chunked-prefill attention with plan()/run()."""

    def spec(self) -> PagedExtendAttention:
        """The operator spec of the planned batch (sequences without new tokens left out)."""
        c = self._spec_common()
        ctx, cu = self._host_lens()
        ql = [cu[i + 1] - cu[i] for i in range(len(ctx))]
        keep = [i for i, n in enumerate(ql) if n > 0]
        return PagedExtendAttention(
            q_lens=tuple(ql[i] for i in keep),
            prefix_lens=tuple(ctx[i] - ql[i] for i in keep),
            window=self._plan.window,
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
        check_data: bool = True,
    ) -> None:
        """Validate tables and offsets (one host sync; `check_data` False: a caller that built them skips the
        data checks); q of run() has cu_seqlens_q[-1] tokens.
        k_cache: a plain cache, or a quantized cache object (then q_dtype, default fp16, is q's dtype)."""
        check_int_tensor("cu_seqlens_q", cu_seqlens_q, 1, self.device)
        tokens = int(cu_seqlens_q[-1]) if cu_seqlens_q.numel() else 0
        opts = _plan_options(sm_scale, window, softcap, alibi_slopes, num_splits, check_data)
        self._stage(k_cache, block_tables, context_lens, cu_seqlens_q, tokens, num_q_heads, None, opts, q_dtype)


def _check_outputs(q: torch.Tensor, out: torch.Tensor | None, lse: torch.Tensor | None) -> None:
    """run()'s out and lse buffers: q's shape, dtype and device (out contiguous along head_dim: the kernels write
    its rows by their strides), lse fp32 [tokens, q_heads]; the kernels write them unchecked."""
    for name, t, shape, dtype in (("out", out, tuple(q.shape), q.dtype), ("lse", lse, tuple(q.shape[:2]),
                                                                              torch.float32)):  # fmt: skip
        if t is None:
            continue
        if not isinstance(t, torch.Tensor) or tuple(t.shape) != shape or t.dtype != dtype:
            got = f"{t.dtype} {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
            raise CodesignError(f"{name} must be {dtype} of shape {shape}, got {got}")
        if t.device != q.device:
            raise CodesignError(f"{name} is on {t.device} but q is on {q.device}")
    if out is not None and out.numel() > 0 and out.stride(-1) != 1:
        raise CodesignError(f"out must be contiguous along head_dim, got stride {out.stride()}")


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
        check_data: bool = True,
    ) -> TreeBatch:
        """Build the tree metadata on the device and validate it against the block tables (`check_data` False:
        a caller that built the tables skips the data checks, a host sync).

        k_cache: a plain cache, or a quantized cache object (then q_dtype, default fp16, is q's dtype)."""
        tree = build_tree_batch(parents, prefix_lens, self.device)
        opts = _plan_options(sm_scale, window, softcap, alibi_slopes, num_splits, check_data)
        self._stage(k_cache, block_tables, tree.context_lens, tree.cu_seqlens_q, sum(tree.tree_sizes),
                    num_q_heads, tree.mask_args, opts, q_dtype)  # fmt: skip
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
