"""Per-chunk mixed-precision KV cache (Cocktail-style): each paged block (a chunk of `block_size` tokens)
stores INT8, INT4 or INT2 per-token codes, chosen by a policy from the chunk's similarity to recent
queries. Decode attends width by width (`attention.mixed_by_width`: one per-token INT launch a width over the
cache in place); extend, tree, ALiBi and windows run one launch over blocks of every width (`KV_FORMAT_MIXED`).

Layout, per layer: codes uint8 `[num_blocks, block_size, kv_heads, D]` (rows sized for INT8; a b-bit block
uses the first D * b / 8 bytes of each row, packed as `quantizers.pack_codes`), meta fp16
`[num_blocks, block_size, kv_heads, 2]` (per-token scale, zero: the engine's rule), block_bits uint8
`[num_blocks]`. Rows sized for the widest code keep the block pool uniform: the traffic shrinks with
the width (a b-bit block reads D * b / 8 bytes a row), the capacity does not (that needs one pool per
width; not done).

Policy (`cocktail_bits`): score_c = max over recent queries and query heads of q . mean_k(chunk c) / sqrt(D)
(the kv head a query head reads); the top `frac_int8` of chunks by score get INT8, the bottom
`frac_int2` INT2, the rest INT4 (ties by chunk index).
"""

from __future__ import annotations

import math
from collections.abc import Collection
from dataclasses import dataclass

import torch

from codesign.kernels.kvcache import kvq
from codesign.kernels.kvcache import quantizers as kq
from codesign.kernels.kvcache.checks import check_cache_tensors, check_pool_dims, check_quant_write
from codesign.kernels.kvcache.host_ints import device_ints
from codesign.kernels.kvcache.kvq import FORMATS, kvq_write_op
from codesign.kernels.kvcache.write import direct
from codesign.specs import CodesignError, KVFormat

MIXED_BITS = (8, 4, 2)


@dataclass
class MixedPagedKV:
    """One layer's mixed-precision cache (module docstring)."""

    head_dim: int
    k_codes: torch.Tensor
    v_codes: torch.Tensor
    k_meta: torch.Tensor
    v_meta: torch.Tensor
    block_bits: torch.Tensor

    @classmethod
    def empty(
        cls,
        num_blocks: int,
        block_size: int,
        kv_heads: int,
        head_dim: int,
        device: str | torch.device = "cpu",
    ) -> MixedPagedKV:
        """Zeroed codes and metadata, every block INT8 until `set_block_bits`."""
        check_pool_dims(num_blocks, block_size, kv_heads, head_dim)
        if head_dim % 4:
            raise CodesignError(f"head_dim {head_dim} must be a multiple of 4 (INT2 packs 4 codes a byte)")
        shape = (num_blocks, block_size, kv_heads, head_dim)
        u8 = dict(dtype=torch.uint8, device=device)
        meta = torch.zeros(num_blocks, block_size, kv_heads, 2, dtype=torch.float16, device=device)
        return cls(
            head_dim,
            torch.zeros(shape, **u8),
            torch.zeros(shape, **u8),
            meta,
            meta.clone(),
            torch.full((num_blocks,), 8, **u8),
        )

    @property
    def kv_format(self) -> KVFormat:
        """The operator-spec format: mixed precision, counted at its widest (INT8 per token) chunks."""
        return KVFormat.parse("mixed")

    def check(self) -> tuple[int, int, int, int]:
        """Validate the tensors; (num_blocks, block_size, kv_heads, head_dim)."""
        c = self.k_codes
        if not isinstance(c, torch.Tensor) or c.dim() != 4 or c.shape[-1] != self.head_dim:
            raise CodesignError(f"k_codes must be [blocks, block_size, kv_heads, {self.head_dim}]")
        nb, bs, h, d = c.shape
        want = {
            "k_codes": (torch.uint8, (nb, bs, h, d)),
            "v_codes": (torch.uint8, (nb, bs, h, d)),
            "k_meta": (torch.float16, (nb, bs, h, 2)),
            "v_meta": (torch.float16, (nb, bs, h, 2)),
            "block_bits": (torch.uint8, (nb,)),
        }
        check_cache_tensors("mixed-precision", self, want, c.device)
        return nb, bs, h, d

    def check_block_bits(self) -> None:
        """Every block's width is one of MIXED_BITS (one host sync)."""
        allowed = torch.tensor(MIXED_BITS, dtype=torch.uint8).to(self.block_bits.device)
        if not bool(torch.isin(self.block_bits, allowed).all()):
            raise CodesignError(f"block_bits must all be in {MIXED_BITS}")

    def set_block_bits(self, blocks: list[int], bits: list[int], memo: dict | None = None) -> None:
        """Choose the width of `blocks` (before their tokens are written: codes are not re-packed); no host sync
        (`memo`: `host_ints.device_ints`')."""
        nb = self.check()[0]
        if len(blocks) != len(bits):
            raise CodesignError(f"{len(blocks)} blocks but {len(bits)} bit widths")
        for blk, b in zip(blocks, bits):
            if not 0 <= blk < nb:
                raise CodesignError(f"block id {blk} outside the pool [0, {nb})")
            if b not in MIXED_BITS:
                raise CodesignError(f"chunk bits must be one of {MIXED_BITS}, got {b!r}")
        dev = self.block_bits.device
        self.block_bits[device_ints(blocks, dev, memo)] = device_ints(bits, dev, memo).to(torch.uint8)

    def dequantize(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Debug / reference: the whole pool in float32 `[nb, bs, kv_heads, D]`."""
        self.check()
        out = []
        for codes, meta in ((self.k_codes, self.k_meta), (self.v_codes, self.v_meta)):
            x = torch.empty(codes.shape, dtype=torch.float32, device=codes.device)
            for b in MIXED_BITS:
                sel = self.block_bits == b
                c = kq.unpack_codes(codes[sel][..., : self.head_dim * b // 8], b)
                x[sel] = kq.dequantize_asym(c, meta[sel][..., 0].float(), meta[sel][..., 1].float())
            out.append(x)
        return out[0], out[1]

    def bits_per_element(self, blocks: list[int]) -> float:
        """Average stored bits per element over `blocks` (codes + per-token fp16 scale and zero)."""
        bb = self.block_bits[torch.tensor(blocks, dtype=torch.long)].float()
        return float(bb.mean()) + 32 / self.head_dim


def cocktail_bits(
    q_recent: torch.Tensor, k_chunks: list[torch.Tensor], frac_int8: float = 0.25, frac_int2: float = 0.25
) -> list[int]:
    """Bits per chunk from its relevance to recent queries (module docstring).

    q_recent `[n, q_heads, D]`, k_chunks: each chunk's keys `[tokens, kv_heads, D]`.
    """
    if not (0 <= frac_int8 <= 1 and 0 <= frac_int2 <= 1 and frac_int8 + frac_int2 <= 1):
        raise CodesignError(
            f"need 0 <= frac_int8, frac_int2 and their sum <= 1, got {frac_int8}, {frac_int2}"
        )
    if not k_chunks:
        return []
    q = kq._check_finite("q_recent", q_recent)
    hkv = k_chunks[0].shape[1]
    if q.dim() != 3 or q.shape[1] % hkv or q.shape[2] != k_chunks[0].shape[2]:
        raise CodesignError(f"q_recent must be [n, a multiple of {hkv} heads, D], got {tuple(q.shape)}")
    g = q.shape[1] // hkv
    means = torch.stack([kq._check_finite("k_chunks", k).mean(0) for k in k_chunks])  # [C, hkv, D]
    s = torch.einsum("nhgd,chd->cnhg", q.view(q.shape[0], hkv, g, -1), means) / math.sqrt(q.shape[2])
    score = s.flatten(1).amax(1)
    c = len(k_chunks)
    order = sorted(range(c), key=lambda i: (-float(score[i]), i))
    n8 = math.ceil(frac_int8 * c - 1e-9)
    n2 = min(math.floor(frac_int2 * c + 1e-9), c - n8)
    bits = [4] * c
    for i in order[:n8]:
        bits[i] = 8
    for i in order[c - n2 :]:
        bits[i] = 2
    return bits


def mixed_write(
    key: torch.Tensor,
    value: torch.Tensor,
    cache: MixedPagedKV,
    slot_mapping: torch.Tensor,
    check_data: bool = True,
    dispatch: bool = True,
    widths: Collection[int] | None = None,
) -> None:
    """Quantize tokens into their slots at their block's width (one writer launch per width present).

    Finds the widths present by reading block_bits on the host (one sync, which also checks that key and value
    are finite), unless the caller names them in `widths` (the HF cache keeps its blocks' widths on the host):
    then nothing syncs without `check_data`, a width named without tokens launches a writer that skips every
    token, and a width present but not named would leave its tokens unwritten (name all). `dispatch=False`: the
    writer op's body without torch's dispatcher (`write.kv_write`).
    """
    nb, bs, h, d = cache.check()
    if widths is not None and not set(widths) <= set(MIXED_BITS):
        raise CodesignError(f"widths must be among {MIXED_BITS}, got {sorted(widths)}")
    check_quant_write(key, value, (nb, bs, h, d), cache.k_codes.device, slot_mapping, check_data,
                      check_data or widths is None)  # fmt: skip
    slot_bits = torch.where(
        slot_mapping >= 0, cache.block_bits.long()[(slot_mapping.long() // bs).clamp(min=0)], 0
    )  # fmt: skip
    for b in MIXED_BITS:
        sel = slot_bits == b
        if (b not in widths) if widths is not None else not bool(sel.any()):
            continue
        slots = torch.where(sel, slot_mapping, -1).to(slot_mapping.dtype)
        w = d * b // 8
        kc, vc = cache.k_codes[..., :w], cache.v_codes[..., :w]  # strided views: rows stay D bytes apart
        # The per-token INT writer of `kvq` (Triton or torch), at this width.
        args = (key, value, kc, vc, cache.k_meta, cache.v_meta, slots, *FORMATS[f"int{b}"])
        if direct(dispatch):
            kvq._kvq_write_body(*args)  # (through the module: a graph tape swaps it for one node)
        else:
            kvq_write_op(*args)
