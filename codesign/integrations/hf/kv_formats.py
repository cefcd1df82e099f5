"""The KV formats a `CodesignCache` can hold, and one layer's storage in each of them.

Names (the vocabulary of `codesign map --kv-format`, plus "mixed"):

    fp16 / bf16 / fp32        plain paged K/V in that dtype (queries are cast to it)
    int8 / int4 / int2        per-token asymmetric codes (`kv_quant_paged`)
    fp8                       e4m3 codes, one scale per kv head
    int{8,4,2}-kivi           KIVI: keys per channel over groups of G tokens, a full-precision residual ring
    int{8,4,2}-oaken          Oaken: dense codes plus per-block outlier slots, online per-token metadata
    int{8,4,2}-oaken_offline  Oaken with 8-bit per-token metadata on an offline grid
    mixed                     per-block INT8 / INT4 / INT2 (Cocktail-style policy on the prompt)

Per-head parameters that the kernels take as calibrated offline (fp8 scales, Oaken thresholds and grid)
are calibrated on a layer's first write (the prompt) and then fixed: later tokens outside the prompt's
range saturate (fp8) or are clamped (Oaken's grid), as with any offline calibration.

A storage writes one forward's new tokens (`WritePlan`), attends over the pool (`AttendPlan`: decode,
extend or tree), copies a block (copy-on-write after a fork) and, for formats whose writes touch more than
the written tokens' own slots (KIVI's ring, Oaken's per-block outlier slots), snapshots and restores that
state so that the cache can roll a forward back (crop, tree compaction).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from codesign.integrations.hf import _kernels as K
from codesign.specs import CodesignError, KVFormat

PLAIN_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
KINDS = ("plain", "per_token", "fp8", "kivi", "oaken", "oaken_offline", "mixed")


@dataclass(frozen=True)
class KVSpec:
    """A parsed KV format. kind: one of KINDS; bits: code width (quantized kinds); dtype: plain kinds."""

    name: str
    kind: str
    bits: int = 16
    dtype: torch.dtype | None = None
    kivi_group: int = K.KIVI_GROUP
    kivi_residual: int = K.KIVI_RESIDUAL

    @property
    def token_local(self) -> bool:
        """True when a write changes nothing but the written tokens' own slots (and fresh blocks)."""
        return self.kind not in ("kivi", "oaken", "oaken_offline")

    def check_capturable(self, trees: bool = False) -> None:
        """Raise unless one captured forward (a CUDA graph: `CodesignCache.graph_begin`) can serve every step of its
        kind over this format. Decode: every format; its writes read the step's fixed buffers only (slots; KIVI the
        positions, deciding on the device which group leaves the ring; mixed a writer a width, each skipping the
        others' tokens). Trees (tree verification): token-local formats only (plain, per-token INT, FP8): a tree's
        rollback snapshots KIVI's rings and Oaken's slots from host lists; mixed names a tree step's widths from
        them."""
        if trees and (not self.token_local or self.kind == "mixed"):
            raise CodesignError(
                f"kv_format {self.name!r}: its tree forwards cannot be captured or compiled (plain, per-token INT "
                "and FP8 caches can)"
            )

    @property
    def shares_prompt_blocks(self) -> bool:
        """KIVI keeps a residual ring per sequence, filled by the sequence's own writes."""
        return self.kind != "kivi"

    def spec_format(self, block_size: int, head_dim: int) -> KVFormat:
        """The operator-spec format the dataflow mapper costs (mixed counts as its widest, INT8, chunks)."""
        if self.kind == "plain":
            return KVFormat(dtype=self.name)
        if self.kind == "fp8":
            return KVFormat(dtype="fp8_e4m3", scheme="per_head")
        dt = f"int{self.bits}"
        if self.kind in ("per_token", "mixed"):
            return KVFormat(dtype="int8" if self.kind == "mixed" else dt, scheme="per_token")
        if self.kind == "kivi":
            return KVFormat(dtype=dt, scheme="kivi", group_size=self.kivi_group, residual=self.kivi_residual)
        cap = _oaken_capacity(self.kind, block_size, head_dim)
        meta = "offline" if self.kind == "oaken_offline" else "token"
        return KVFormat(dtype=dt, scheme="oaken", outlier_fraction=cap / (block_size * head_dim), meta=meta)


def parse_kv_format(name: str | KVSpec | None, model_dtype: torch.dtype) -> KVSpec:
    """A KVSpec from a format name (module docstring); None means plain K/V in the model's dtype."""
    if isinstance(name, KVSpec):
        return name
    if name is None:
        name = next(k for k, v in PLAIN_DTYPES.items() if v == model_dtype)
    if not isinstance(name, str):
        raise CodesignError(f"kv_format must be a format name or None, got {type(name).__name__}")
    t = name.lower()
    if t in PLAIN_DTYPES:
        return KVSpec(t, "plain", dtype=PLAIN_DTYPES[t])
    if t in ("fp8", "fp8_e4m3"):
        return KVSpec("fp8", "fp8", bits=8)
    if t == "mixed":
        return KVSpec(t, "mixed", bits=8)
    dtype, _, scheme = t.partition("-")
    bits = {"int8": 8, "int4": 4, "int2": 2}.get(dtype)
    kind = {"": "per_token", "per_token": "per_token", "kivi": "kivi", "oaken": "oaken",
            "oaken_offline": "oaken_offline"}.get(scheme)  # fmt: skip
    if bits is None or kind is None:
        raise CodesignError(
            f"unknown kv_format {name!r}: expected fp16, bf16, fp32, fp8, mixed, or int8 / int4 / int2 with "
            "nothing, -kivi, -oaken or -oaken_offline"
        )
    return KVSpec(t, kind, bits=bits)


def default_block_size(spec: KVSpec) -> int:
    """16 tokens a block; KIVI's 32, its key group, which must divide the block."""
    return K.KIVI_GROUP if spec.kind == "kivi" else 16


def _oaken_capacity(kind: str, block_size: int, head_dim: int) -> int:
    if kind == "oaken_offline":
        return K.OAKEN_OFFLINE_CAP
    return K.kvq.oaken_capacity(K.OAKEN_SLOTS, block_size, head_dim)


@dataclass
class WritePlan:
    """Where one forward's new tokens go; the k/v rows passed with it are these rows' tokens, row after row.

    rows[i], seqs[i]: batch row and sequence id; starts[i]: the position of its first new token; counts[i]:
    how many; slots: int64 flat slot of each token (-1: a prompt token shared with an earlier row, not
    written); fresh[i]: the block ids allocated for row i in this forward (not copies); blocks[i]: row i's
    block ids on the host (the tables' own lists: read only); memo: the step's index tensors built once for
    all the group's layers (`device_ints`)."""

    rows: list[int]
    seqs: list[int]
    starts: list[int]
    counts: list[int]
    slots: torch.Tensor
    block_tables: torch.Tensor
    fresh: list[list[int]]
    blocks: list[list[int]]
    memo: dict = dataclasses.field(default_factory=dict)  # index tensors the group's layers share (device_ints)
    # A captured decode step's (`CodesignCache.graph_begin`): each row's new position, a fixed device buffer; its
    # host lists then hold only seqs (the rows, the same every step): a write reads nothing else of the host.
    positions: torch.Tensor | None = None


@dataclass
class AttendPlan:
    """One forward's attention metadata: cu_seqlens_q None for decode, tree for tree verification."""

    block_tables: torch.Tensor
    context_lens: torch.Tensor
    cu_seqlens_q: torch.Tensor | None
    tree: object | None  # a TreeBatch
    ring_seqs: list[int]  # sequence id of each block-table row (KIVI rings)


class Storage:
    """One layer's pool; built on the first write, when heads, head_dim, dtype and device are known."""

    block_fields: tuple[str, ...] = ()
    # Whether the data checks of a write read only the step's plan (its slots), the same for every layer of a
    # group, so that the group's first layer checks them for all (`CodesignCache`); a quantized write also checks
    # its values are finite: per layer. An attention's checks read only the plan (tables and lengths).
    write_checks_plan_only = False

    def __init__(self, spec: KVSpec, num_blocks: int, block_size: int) -> None:
        self.spec, self.num_blocks, self.block_size = spec, num_blocks, block_size
        self.kv = None  # the kernel's cache object (or a (k_cache, v_cache) pair for plain formats)

    # --- hooks of each format -----------------------------------------------------------------------
    def build(self, k: torch.Tensor, v: torch.Tensor) -> None:
        raise NotImplementedError

    def write(self, k: torch.Tensor, v: torch.Tensor, plan: WritePlan, q: torch.Tensor | None, check: bool) -> None:
        """Write one forward's new tokens; `check`: the kernels' data checks (a host sync)."""
        raise NotImplementedError

    def attend(self, q: torch.Tensor, plan: AttendPlan, **kw) -> torch.Tensor:
        raise NotImplementedError

    def planned_run(self, plan: AttendPlan) -> tuple[tuple, torch.dtype | None] | None:
        """(the cache arguments of a wrapper's plan and run, q's dtype for it or None for q's own) for a format
        whose attention over `plan` (decode, extend or tree) runs planned (`CodesignCache`: a wrapper planned once
        per group and forward, then only launches at each layer); None: through `attend`."""
        return None

    def snapshot(self, plan: WritePlan) -> object:
        """State the write of `plan` changes outside its own slots (None for token-local formats)."""
        return None

    def before_replay(self, plan: WritePlan) -> None:
        """A captured step's host side (`CodesignCache.graph_step`; `plan`: the step's eager plan, with its fresh
        blocks): what the replay's write cannot decide on the device."""

    def restore(self, snap: object) -> None:
        """Put back what `snapshot` saved."""

    def fork_seq(self, src: int, dst: int) -> None:
        """Per-sequence state follows a fork (KIVI rings)."""

    def free_seq(self, seq: int) -> None:
        """Forget a sequence's per-sequence state."""

    # --- shared -----------------------------------------------------------------------------------
    def copy_block(self, src: int, dst: int) -> None:
        """Copy-on-write: block dst becomes a copy of block src in every per-block tensor."""
        for name in self.block_fields:
            t = getattr(self.kv, name)
            t[dst].copy_(t[src])

    def nbytes(self) -> int:
        """Bytes of every tensor of the pool."""
        if self.kv is None:
            return 0
        ts = [getattr(self.kv, f.name) for f in dataclasses.fields(self.kv)]
        return sum(t.numel() * t.element_size() for t in ts if isinstance(t, torch.Tensor))

    def _attend_kvq(self, entries, q: torch.Tensor, plan: AttendPlan, kw: dict, kv=None) -> torch.Tensor:
        """Through the (decode, extend, tree) entry points of a format that takes the cache object first."""
        decode, extend, tree = entries
        kv, bt = self.kv if kv is None else kv, plan.block_tables
        if plan.tree is not None:
            return tree(q, kv, bt, plan.tree, **kw)
        if plan.cu_seqlens_q is None:
            return decode(q, kv, bt, plan.context_lens, **kw)
        return extend(q, kv, bt, plan.context_lens, plan.cu_seqlens_q, **kw)


@dataclass
class _PlainKV:
    k_cache: torch.Tensor
    v_cache: torch.Tensor


class PlainStorage(Storage):
    block_fields = ("k_cache", "v_cache")
    write_checks_plan_only = True  # slots only

    def build(self, k, v):
        shape = (self.num_blocks, self.block_size, k.shape[1], k.shape[2])
        dt = self.spec.dtype
        self.kv = _PlainKV(
            torch.zeros(shape, dtype=dt, device=k.device), torch.zeros(shape, dtype=dt, device=k.device)
        )

    def write(self, k, v, plan, q, check):
        dt = self.spec.dtype
        K.kv_write(k.to(dt), v.to(dt), self.kv.k_cache, self.kv.v_cache, plan.slots, check, dispatch=False)

    def planned_run(self, plan):
        return (self.kv.k_cache, self.kv.v_cache), self.spec.dtype

    def attend(self, q, plan, **kw):
        kc, vc, bt, qd = self.kv.k_cache, self.kv.v_cache, plan.block_tables, q.to(self.spec.dtype)
        if plan.tree is not None:
            out = K.tree_attention(qd, kc, vc, bt, plan.tree, **kw)
        elif plan.cu_seqlens_q is None:
            out = K.paged_decode_attention(qd, kc, vc, bt, plan.context_lens, **kw)
        else:
            out = K.paged_extend_attention(qd, kc, vc, bt, plan.context_lens, plan.cu_seqlens_q, **kw)
        return out.to(q.dtype)


class PerTokenStorage(Storage):
    """INT8 / INT4 / INT2 per token, and fp8 per head (scales calibrated on the first write)."""

    @property
    def block_fields(self):
        return (
            ("k_codes", "v_codes") if self.spec.kind == "fp8" else ("k_codes", "v_codes", "k_meta", "v_meta")
        )

    def build(self, k, v):
        fmt = "fp8" if self.spec.kind == "fp8" else f"int{self.spec.bits}"
        scales = (K.kvq.fp8_head_scales(k), K.kvq.fp8_head_scales(v)) if fmt == "fp8" else (None, None)
        self.kv = K.QuantPagedKV.empty(self.num_blocks, self.block_size, k.shape[1], k.shape[2], fmt, k.device,
                                       *scales)  # fmt: skip

    def write(self, k, v, plan, q, check):
        K.kvq_write(k, v, self.kv, plan.slots, check, dispatch=False)

    def planned_run(self, plan):
        return (self.kv,), None

    def attend(self, q, plan, **kw):
        entries = (K.kvq_decode_attention, K.kvq_extend_attention, K.kvq_tree_attention)
        return self._attend_kvq(entries, q, plan, kw)


class KiviStorage(Storage):
    """KIVI codes in the shared pool; a residual ring per sequence in a pool of rings (grown on demand)."""

    block_fields = ("k_codes", "v_codes", "k_meta", "v_meta")

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self._ring_of: dict[int, int] = {}
        self._free_rings: list[int] = []

    @property
    def ring(self) -> int:
        return self.spec.kivi_group + self.spec.kivi_residual

    def build(self, k, v):
        res = torch.float16 if k.dtype == torch.float16 else torch.float32  # bf16 values are exact in fp32
        s = self.spec
        self.kv = K.KiviPagedKV.empty(self.num_blocks, self.block_size, k.shape[1], k.shape[2], s.bits,
                                      s.kivi_group, s.kivi_residual, 1, res, k.device)  # fmt: skip

    def _row(self, seq: int) -> int:
        """The ring row of `seq`, allocating one (the pool doubles when full)."""
        if seq not in self._ring_of:
            if not self._free_rings:
                n = self.kv.k_res.shape[0] if self._ring_of else 0
                if self._ring_of:
                    grow = [torch.cat([t, torch.zeros_like(t)]) for t in (self.kv.k_res, self.kv.v_res)]
                    self.kv = dataclasses.replace(self.kv, k_res=grow[0], v_res=grow[1])
                self._free_rings = list(range(self.kv.k_res.shape[0] - 1, n - 1, -1))
            self._ring_of[seq] = self._free_rings.pop()
        return self._ring_of[seq]

    def write(self, k, v, plan, q, check):
        rings = [self._row(seq) for seq in plan.seqs]  # every row at once, no host sync without checks
        if plan.positions is not None:  # a captured step: ring b is row b's (the graph's one tensor of rings)
            if rings != list(range(len(rings))):
                raise CodesignError(f"a captured KIVI step needs ring b for row b, the rows have rings {rings}")
            self.kv.append_step(plan.positions, k, v, plan.block_tables)
            return
        self.kv.append_rows(rings, plan.starts, plan.counts, k, v, plan.blocks, check, plan.memo)

    def planned_run(self, plan):
        """Planned where ring b is block-table row b's (the kernel's rule; generate keeps rows in place), else
        through `attend`, which gathers the rings into that order."""
        return ((self.kv,), None) if self._rings_out_of_place(plan) is None else None

    def _rings_out_of_place(self, plan) -> list[int] | None:
        """The ring of each block-table row, or None where ring b is row b's."""
        idx = [self._row(s) for s in plan.ring_seqs]
        return None if idx == list(range(len(idx))) else idx

    def attend(self, q, plan, **kw):
        idx, kv = self._rings_out_of_place(plan), self.kv
        if idx is not None:  # the kernel reads ring b for block-table row b
            t = K.device_ints(idx, kv.k_res.device)
            kv = dataclasses.replace(kv, k_res=kv.k_res[t].contiguous(), v_res=kv.v_res[t].contiguous())
        entries = (K.kivi_decode_attention, K.kivi_extend_attention, K.kivi_tree_attention)
        return self._attend_kvq(entries, q, plan, kw, kv)

    def snapshot(self, plan):
        """The ring rows the write of `plan` claims, every row's in one gather (flat indices into the rings); none
        for a captured decode step (never rolled back)."""
        if plan.positions is not None:
            return None
        ring = self.ring
        at = [self._row(seq) * ring + (start + i) % ring
              for seq, start, n in zip(plan.seqs, plan.starts, plan.counts) for i in range(min(n, ring))]  # fmt: skip
        h, d = self.kv.k_res.shape[2:]
        at = K.device_ints(at, self.kv.k_res.device, plan.memo)
        return at, self.kv.k_res.view(-1, h, d)[at], self.kv.v_res.view(-1, h, d)[at]

    def restore(self, snap):
        at, ks, vs = snap
        h, d = self.kv.k_res.shape[2:]  # the pool may have grown since (new rings go after the old)
        self.kv.k_res.view(-1, h, d).index_copy_(0, at, ks)
        self.kv.v_res.view(-1, h, d).index_copy_(0, at, vs)

    def fork_seq(self, src, dst):
        if self.kv is not None and src in self._ring_of:
            a, b = self._row(src), self._row(dst)
            self.kv.k_res[b].copy_(self.kv.k_res[a])
            self.kv.v_res[b].copy_(self.kv.v_res[a])

    def free_seq(self, seq):
        if seq in self._ring_of:
            self._free_rings.append(self._ring_of.pop(seq))


class OakenStorage(Storage):
    """Oaken, online or offline metadata; thresholds (and grid) calibrated on the first write."""

    block_fields = ("k_codes", "v_codes", "k_meta", "v_meta", "k_out", "v_out", "k_count", "v_count")
    _slot_state = ("k_out", "v_out", "k_count", "v_count")

    def build(self, k, v):
        offline = self.spec.kind == "oaken_offline"
        frac = K.OAKEN_OFFLINE_FRACTION if offline else K.OAKEN_FRACTION
        thr = K.kvq.calibrate_kv_thresholds([(k, v)], frac)[0]
        grid = K.kvq.calibrate_oaken_grid([(k, v)])[0] if offline else None
        cap = _oaken_capacity(self.spec.kind, self.block_size, k.shape[2])
        self.kv = K.OakenPagedKV.empty(self.num_blocks, self.block_size, k.shape[1], k.shape[2], self.spec.bits,
                                       thr, cap, k.device, grid)  # fmt: skip

    def write(self, k, v, plan, q, check):
        self.kv.write(k, v, plan.slots, check)

    def planned_run(self, plan):
        return (self.kv,), None

    def attend(self, q, plan, **kw):
        tree = plan.tree
        ctx = plan.context_lens if tree is None else tree.context_lens
        return K.oaken_attention(q, self.kv, plan.block_tables, ctx, plan.cu_seqlens_q, tree=tree, **kw)

    def snapshot(self, plan):
        """The outlier slots of each row's partly filled block, which the write claims into (one gather a
        tensor for all rows)."""
        bs = self.block_size
        blocks = sorted({row[start // bs] for row, start in zip(plan.blocks, plan.starts) if start % bs})
        if not blocks:
            return None
        at = K.device_ints(blocks, self.kv.k_out.device, plan.memo)
        return at, [getattr(self.kv, n)[at] for n in self._slot_state]

    def restore(self, snap):
        if snap is None:
            return
        at, saved = snap
        with self.kv.editing_slots(at):  # the kept outlier index follows the slots
            for n, t in zip(self._slot_state, saved):
                getattr(self.kv, n).index_copy_(0, at, t)

    def copy_block(self, src: int, dst: int) -> None:
        with self.kv.editing_slots([dst]):
            super().copy_block(src, dst)


class MixedStorage(Storage):
    """Per-block INT8 / INT4 / INT2: a prompt's blocks by `cocktail_bits` on its last queries, later blocks INT8."""

    block_fields = ("k_codes", "v_codes", "k_meta", "v_meta", "block_bits")

    def build(self, k, v):
        self.kv = K.MixedPagedKV.empty(self.num_blocks, self.block_size, k.shape[1], k.shape[2], k.device)
        self._bits: dict[int, int] = {}  # the widths this storage set, on the host (other blocks: INT8)

    def write(self, k, v, plan, q, check):
        if plan.positions is not None:  # a captured step: its fresh blocks' widths were set before the replay
            K.mixed_write(k, v, self.kv, plan.slots, False, dispatch=False, widths=K.MIXED_BITS)
            return
        self._set_fresh(plan, q, k)
        bs = self.block_size
        widths = {self._bits.get(row[p // bs], 8)  # the blocks the tokens land in
                  for row, s, n in zip(plan.blocks, plan.starts, plan.counts)
                  for p in range(s // bs * bs, s + n, bs)}  # fmt: skip
        K.mixed_write(k, v, self.kv, plan.slots, check, dispatch=False, widths=widths)

    def before_replay(self, plan):
        self._set_fresh(plan, None, None)

    def _set_fresh(self, plan, q, k) -> None:
        """The widths of the blocks opened by `plan` (the policy on a prompt; INT8 for generated tokens)."""
        off, blocks, bits = 0, [], []
        for start, n, fresh in zip(plan.starts, plan.counts, plan.fresh):
            if fresh:
                blocks += fresh
                bits += self._policy(q, k, off, start, n, len(fresh))
            off += n
        if blocks:
            self.kv.set_block_bits(blocks, bits, plan.memo)
            self._bits.update(zip(blocks, bits))

    def copy_block(self, src: int, dst: int) -> None:
        super().copy_block(src, dst)
        self._bits[dst] = self._bits.get(src, 8)

    def planned_run(self, plan):
        """Planned: a decode's plan re-sorts the block tables by width at each run, from that layer's widths."""
        return (self.kv,), None

    def _policy(self, q, k, off, start, n, nfresh) -> list[int]:
        if start != 0 or q is None:  # blocks opened by generated tokens keep the widest codes
            return [8] * nfresh
        bs = self.block_size
        chunks = [k[off + s : off + min(s + bs, n)] for s in range(0, n, bs)]
        bits = K.cocktail_bits(q[off + n - min(n, K.MIXED_RECENT) : off + n], chunks)
        return bits[len(bits) - nfresh :]

    def attend(self, q, plan, **kw):
        tree = plan.tree
        ctx = plan.context_lens if tree is None else tree.context_lens
        return K.mixed_attention(q, self.kv, plan.block_tables, ctx, plan.cu_seqlens_q, tree=tree, **kw)


STORAGES = {"plain": PlainStorage, "per_token": PerTokenStorage, "fp8": PerTokenStorage, "kivi": KiviStorage,
            "oaken": OakenStorage, "oaken_offline": OakenStorage, "mixed": MixedStorage}  # fmt: skip


def new_storage(spec: KVSpec, num_blocks: int, block_size: int) -> Storage:
    """An empty (unbuilt) storage of `spec`."""
    return STORAGES[spec.kind](spec, num_blocks, block_size)


def check_geometry(spec: KVSpec, block_size: int, kv_heads: int, head_dim: int) -> None:
    """Refuse a format the model's head_dim (or the block size) does not allow: a one-block pool of the format
    is built on zeros, so the kernels' own checks decide."""
    if block_size > K.MAX_BLOCK_SIZE or block_size < 1:
        raise CodesignError(f"block_size must be in [1, {K.MAX_BLOCK_SIZE}], got {block_size}")
    probe = new_storage(spec, 1, block_size)
    x = torch.ones(4, kv_heads, head_dim)
    try:
        probe.build(x, x)
    except CodesignError as e:
        raise CodesignError(f"kv_format {spec.name!r} cannot hold this model's K/V (head_dim {head_dim}, "
                            f"block_size {block_size}): {e}") from None  # fmt: skip
