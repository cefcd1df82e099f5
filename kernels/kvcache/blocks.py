"""Paged KV cache: the cache tensors and a reference-counted block allocator (the checks every paged
kernel runs are in `kvcache.checks`).

Layout (docs/architecture.md, data contracts): per layer K and V are `[num_blocks, block_size, num_kv_heads, head_dim]`;
token t of a sequence lives in slot `block_tables[b, t // block_size] * block_size + t % block_size`;
`block_tables` is int32 `[batch, max_blocks_per_seq]`, `context_lens` int32 `[batch]`.

Sharing: a block may back several sequences (a shared prompt prefix, beams, tree branches). The
allocator counts references; `fork` shares blocks, and appending into a shared, partly filled last
block first copies it (copy-on-write), so no sequence ever writes into a block another one reads.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from codesign.kernels.kvcache.checks import KV_DTYPES, MAX_BLOCK_SIZE
from codesign.specs import CodesignError, check_nonneg_int, check_positive_int


class BlockAllocator:
    """A pool of `num_blocks` block ids with reference counts (host-side bookkeeping only)."""

    def __init__(self, num_blocks: int) -> None:
        check_positive_int("num_blocks", num_blocks)
        self.num_blocks = num_blocks
        # Pop from the end: low ids first, so fresh pools hand out 0, 1, 2, ...
        self._free = list(range(num_blocks - 1, -1, -1))
        self._refs = [0] * num_blocks

    @property
    def num_free(self) -> int:
        return len(self._free)

    def refcount(self, block: int) -> int:
        self._check_id(block)
        return self._refs[block]

    def allocate(self, n: int) -> list[int]:
        """n fresh blocks with refcount 1; CodesignError (and nothing taken) if fewer than n are free."""
        check_nonneg_int("n", n)
        if n > len(self._free):
            raise CodesignError(
                f"KV block pool exhausted: need {n} block(s), {len(self._free)} of {self.num_blocks} free"
            )
        out = [self._free.pop() for _ in range(n)]
        for b in out:
            self._refs[b] = 1
        return out

    def incref(self, blocks: list[int]) -> None:
        """One more owner for each block (they must be allocated)."""
        for b in blocks:
            self._check_live(b)
        for b in blocks:
            self._refs[b] += 1

    def free(self, blocks: list[int]) -> None:
        """Drop one reference per block; a block returns to the pool when its count reaches 0."""
        for b in blocks:
            self._check_live(b)
        for b in blocks:
            self._refs[b] -= 1
            if self._refs[b] == 0:
                self._free.append(b)

    def _check_id(self, block: int) -> None:
        if not (0 <= block < self.num_blocks):
            raise CodesignError(f"block id {block} outside the pool [0, {self.num_blocks})")

    def _check_live(self, block: int) -> None:
        self._check_id(block)
        if self._refs[block] == 0:
            raise CodesignError(f"block id {block} is not allocated (double free?)")


@dataclass
class _Seq:
    blocks: list[int] = field(default_factory=list)
    length: int = 0


class PagedKVCache:
    """One layer's paged K/V cache plus the per-sequence block lists that index it.

    Host bookkeeping (which blocks a sequence owns, its length) lives here; the device side sees
    only `k_cache`, `v_cache`, `block_tables(...)`, `context_lens(...)` and `slot_mapping`s.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.float16,
        device: str | torch.device = "cpu",
        fill: float = 0.0,
    ) -> None:
        check_positive_int("num_blocks", num_blocks)
        check_positive_int("block_size", block_size)
        if block_size > MAX_BLOCK_SIZE:
            raise CodesignError(f"block_size must be in [1, {MAX_BLOCK_SIZE}], got {block_size}")
        check_positive_int("num_kv_heads", num_kv_heads)
        check_positive_int("head_dim", head_dim)
        if dtype not in KV_DTYPES:
            raise CodesignError(f"dtype must be one of {KV_DTYPES}, got {dtype}")
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        self.k_cache = torch.full(shape, fill, dtype=dtype, device=device)
        self.v_cache = torch.full(shape, fill, dtype=dtype, device=device)
        self.block_size = block_size
        self.allocator = BlockAllocator(num_blocks)
        self._seqs: dict[int, _Seq] = {}

    # --- sequence lifetime -------------------------------------------------------------------
    def add_sequence(self, seq_id: int) -> None:
        """Register an empty sequence."""
        if seq_id in self._seqs:
            raise CodesignError(f"seq_id {seq_id} already exists")
        self._seqs[seq_id] = _Seq()

    def fork(self, src: int, dst: int, num_tokens: int | None = None) -> None:
        """New sequence `dst` sharing the first `num_tokens` (default: all) tokens of `src`.

        Full blocks are shared for good; a shared partial last block is copied on the first write.
        """
        s = self._seq(src)
        n = s.length if num_tokens is None else check_nonneg_int("num_tokens", num_tokens)
        if n > s.length:
            raise CodesignError(f"num_tokens={n} exceeds the length {s.length} of sequence {src}")
        if dst in self._seqs:
            raise CodesignError(f"seq_id {dst} already exists")
        blocks = s.blocks[: -(-n // self.block_size)]
        self.allocator.incref(blocks)
        self._seqs[dst] = _Seq(list(blocks), n)

    def free(self, seq_id: int) -> None:
        """Release a sequence's blocks (shared blocks stay alive for their other owners)."""
        self.allocator.free(self._seq(seq_id).blocks)
        del self._seqs[seq_id]

    def append_slots(self, seq_id: int, n: int) -> list[int]:
        """Reserve the next `n` token slots of `seq_id` and return their flat slot ids.

        Allocates blocks as needed and copies a shared partial last block first (copy-on-write).
        On pool exhaustion raises CodesignError and leaves the sequence unchanged.
        """
        check_nonneg_int("n", n)
        s = self._seq(seq_id)
        bs = self.block_size
        need = -(-(s.length + n) // bs) - len(s.blocks)
        cow = n > 0 and s.length % bs != 0 and self.allocator.refcount(s.blocks[-1]) > 1
        fresh = self.allocator.allocate(need + int(cow))
        if cow:
            old, new = s.blocks[-1], fresh.pop()
            self.k_cache[new].copy_(self.k_cache[old])
            self.v_cache[new].copy_(self.v_cache[old])
            self.allocator.free([old])
            s.blocks[-1] = new
        s.blocks.extend(fresh)
        slots = [s.blocks[t // bs] * bs + t % bs for t in range(s.length, s.length + n)]
        s.length += n
        return slots

    def truncate(self, seq_id: int, length: int) -> None:
        """Drop the tokens after `length` (rejected draft tokens); frees blocks no longer needed."""
        s = self._seq(seq_id)
        check_nonneg_int("length", length)
        if length > s.length:
            raise CodesignError(f"length={length} exceeds the length {s.length} of sequence {seq_id}")
        keep = -(-length // self.block_size)
        self.allocator.free(s.blocks[keep:])
        del s.blocks[keep:]
        s.length = length

    # --- device views --------------------------------------------------------------------------
    def seq_len(self, seq_id: int) -> int:
        return self._seq(seq_id).length

    def seq_blocks(self, seq_id: int) -> list[int]:
        return list(self._seq(seq_id).blocks)

    def block_tables(self, seq_ids: list[int], max_blocks: int | None = None) -> torch.Tensor:
        """int32 `[len(seq_ids), max_blocks]` block table; unused entries are 0 (never read)."""
        rows = [self._seq(i).blocks for i in seq_ids]
        width = max([len(r) for r in rows] + [1]) if max_blocks is None else max_blocks
        out = torch.zeros(len(rows), width, dtype=torch.int32)
        for i, r in enumerate(rows):
            if len(r) > width:
                raise CodesignError(f"max_blocks={width} < {len(r)} blocks of sequence {seq_ids[i]}")
            out[i, : len(r)] = torch.tensor(r, dtype=torch.int32)
        return out.to(self.k_cache.device)

    def context_lens(self, seq_ids: list[int]) -> torch.Tensor:
        """int32 `[len(seq_ids)]` current lengths."""
        lens = [self._seq(i).length for i in seq_ids]
        return torch.tensor(lens, dtype=torch.int32, device=self.k_cache.device)

    def _seq(self, seq_id: int) -> _Seq:
        if seq_id not in self._seqs:
            raise CodesignError(f"unknown seq_id {seq_id}")
        return self._seqs[seq_id]
