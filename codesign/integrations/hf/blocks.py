"""`BlockTables`: each sequence's list of block ids over the kernels' reference-counted `BlockAllocator`, whose
oldest blocks can go back to the pool (`drop_before`: a sliding window moved past them) while the list keeps
its logical indexing, token t in entry t // block_size, as the paged kernels read it.

A dropped entry keeps its old id in the block table, and the allocator no longer counts it for this
sequence. Whatever the pool reuses that block for never reaches a query whose window starts after it: the
kernels mask every key before the window to -inf (the Triton kernels start at the tile holding the window's
first key, the torch path gathers and masks them) and every pool holds finite values only.

The same operations as the kernels' `PagedKVCache` tables (fork, append with copy-on-write of a shared
partial last block, truncate, free), without its K/V tensors: the cache copies blocks in every layer's pool.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from codesign.integrations.hf import _kernels as K
from codesign.specs import CodesignError


@dataclass
class _Seq:
    blocks: list[int] = field(default_factory=list)
    length: int = 0
    dropped: int = 0  # leading entries of `blocks` already returned to the allocator


class BlockTables:
    """Sequence id -> its blocks (and length) over one BlockAllocator of `num_blocks` blocks."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.allocator = K.BlockAllocator(num_blocks)
        self.block_size = block_size
        self._seqs: dict[int, _Seq] = {}
        self.dropped_total = 0  # blocks drop_before has released, over all sequences

    def add_sequence(self, seq: int) -> None:
        if seq in self._seqs:
            raise CodesignError(f"seq_id {seq} already exists")
        self._seqs[seq] = _Seq()

    def fork(self, src: int, dst: int, num_tokens: int | None = None) -> None:
        """New sequence `dst` sharing the first `num_tokens` (default all) tokens of `src` (and its drops)."""
        s = self._seq(src)
        n = s.length if num_tokens is None else num_tokens
        if not 0 <= n <= s.length:
            raise CodesignError(f"num_tokens={n} outside [0, {s.length}] of sequence {src}")
        if dst in self._seqs:
            raise CodesignError(f"seq_id {dst} already exists")
        blocks = s.blocks[: -(-n // self.block_size)]
        dropped = min(s.dropped, len(blocks))
        self.allocator.incref(blocks[dropped:])
        self._seqs[dst] = _Seq(list(blocks), n, dropped)

    def free(self, seq: int) -> None:
        s = self._seq(seq)
        self.allocator.free(s.blocks[s.dropped :])
        del self._seqs[seq]

    def append_slots(self, seq: int, n: int) -> list[int]:
        """Reserve the next n token slots of `seq` (new blocks as needed; a shared partial last block is
        replaced by a fresh one, which the caller fills with a copy); their flat slot ids."""
        s, bs = self._seq(seq), self.block_size
        need = -(-(s.length + n) // bs) - len(s.blocks)
        cow = n > 0 and s.length % bs != 0 and self.allocator.refcount(s.blocks[-1]) > 1
        fresh = self.allocator.allocate(need + int(cow))
        if cow:
            self.allocator.free([s.blocks[-1]])
            s.blocks[-1] = fresh.pop()
        s.blocks.extend(fresh)
        slots = [s.blocks[t // bs] * bs + t % bs for t in range(s.length, s.length + n)]
        s.length += n
        return slots

    def truncate(self, seq: int, length: int) -> None:
        """Drop the tokens after `length`; CodesignError below the dropped blocks (they are gone)."""
        s = self._seq(seq)
        keep = -(-length // self.block_size)
        if not 0 <= length <= s.length or keep < s.dropped:
            raise CodesignError(
                f"cannot truncate sequence {seq} of {s.length} tokens to {length}: its first "
                f"{s.dropped * self.block_size} tokens were freed (sliding window)"
            )
        self.allocator.free(s.blocks[keep:])
        del s.blocks[keep:]
        s.length = length

    def drop_before(self, seq: int, position: int) -> int:
        """Return to the pool every block of `seq` whose tokens all lie before `position`; how many."""
        s = self._seq(seq)
        upto = min(max(position, 0) // self.block_size, len(s.blocks))
        if upto <= s.dropped:
            return 0
        self.allocator.free(s.blocks[s.dropped : upto])
        n, s.dropped = upto - s.dropped, upto
        self.dropped_total += n
        return n

    def dropped_tokens(self, seq: int) -> int:
        """Leading tokens of `seq` whose blocks went back to the pool."""
        return self._seq(seq).dropped * self.block_size

    def seq_len(self, seq: int) -> int:
        return self._seq(seq).length

    def seq_blocks(self, seq: int) -> list[int]:
        return list(self._seq(seq).blocks)

    def blocks_view(self, seq: int) -> list[int]:
        """`seq`'s block list itself, not a copy (read only; it changes with the sequence)."""
        return self._seq(seq).blocks

    def block_tables(self, seqs: list[int]) -> torch.Tensor:
        """int32 `[len(seqs), max blocks]`; unused entries 0 (never read)."""
        return K.device_rows([self._seq(i).blocks for i in seqs], torch.device("cpu"))

    def _seq(self, seq: int) -> _Seq:
        if seq not in self._seqs:
            raise CodesignError(f"unknown seq_id {seq}")
        return self._seqs[seq]
