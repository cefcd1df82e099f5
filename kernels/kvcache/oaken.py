"""Oaken-style paged KV cache: dense low-bit codes after group-shift plus a fused sparse-outlier section per
block, written online token by token; attention reads it in the kernel (`codesign::paged_attention_oaken`, in
`attention.quantized`).

Layout, per layer (b bits, C = capacity slots per (block, kv head)):
    k_codes, v_codes  uint8 `[num_blocks, block_size, kv_heads, D * b / 8]` (outlier positions: code 0)
    k_meta, v_meta    fp16  `[num_blocks, block_size, kv_heads, 2]` = (scale, inner lower bound)
    k_out, v_out      int32 `[num_blocks, kv_heads, C]`: (offset * D + d) << 16 | fp16 bits of the value,
                      -1 = empty slot (so block_size * D < 32768)
    k_count, v_count  int32 `[num_blocks, kv_heads]`: slots in use (host bookkeeping for the writer)
    overflow          int64 `[2, kv_heads]`: outliers clamped for lack of a slot (K, V)
    k_index, v_index  int32 `[num_blocks, kv_heads, index_width]`: the attention kernel's outlier index of those
                      slots, kept by the cache (below)
Thresholds (lo, hi) per kv head come from `quantizers.calibrate_kv_thresholds` (offline, per layer, K and V).

The "offline" variant (`grid` given: `quantizers.calibrate_oaken_grid`, one layer's `[2 (K, V), kv_heads,
2 (base, step)]` float32) stores k_meta, v_meta as uint8 `[num_blocks, block_size, kv_heads, 2]` = (z, r)
on the offline grid instead of fp16 (scale, lower bound): 16 instead of 32 bits per token and head, and
outliers without a slot stay dense (`quantizers.oaken_offline_quantize_block`), counted in `overflow`.

The writer applies `quantizers`' online rule: a token's outliers claim the free slots of its block,
farthest beyond the threshold first; the rest are clamped into [lo, hi] and counted; the inner elements
are quantized per token with the engine's rule. Writing a block's tokens in order gives exactly
`quantizers.oaken_quantize_block` (tested). A token written at offset 0 starts its block afresh. On CUDA
tensors (or `use_backend("triton")`) the writer is the Triton kernel of `triton_oaken_write`,
bit-identical to the torch loop.

The kept index. The kernel reads the slots through `outlier_index` (keys grouped by token, values by channel),
which the cache keeps in k_index / v_index: every write rebuilds the index rows of exactly the blocks it wrote
(gather their slots and meta, `outlier_index`, scatter back: torch ops, no host sync, so a CUDA graph captures
it with the write), and so does every other slot change made through the cache (`editing_slots`: copy-on-write,
rollback). A decode step thus re-indexes its batch's written blocks, not the pool. Validity rule: the cache
records, on the host, the identity and version counter of k_out, v_out, k_meta, v_meta, k_index and v_index
(the index's deltas hold each token's zero, from the meta) whenever the index is known to equal `outlier_index`
of the slots and meta (built whole, or rebuilt after a change made through the cache while it was current).
Any other change (slots or meta assigned by hand, a replaced tensor, a cache built without the
index or unpickled) leaves that record behind, and the next attention (`ensure_index`) rebuilds the whole index
once before the kernel reads it. Tensors without a version counter (inference tensors) are rebuilt whole every
attention. Writes torch does not count (through `.data`, a NumPy or DLPack view, another kernel's pointers) are
not seen, nor is anything under CUDA-graph replay: make those inside `editing_slots`, or through the writers.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from codesign.backend import resolve_backend
from codesign.kernels.kvcache import quantizers as kq
from codesign.kernels.kvcache.checks import (
    check_cache_tensors,
    check_pool_dims,
    check_quant_write,
    check_writer_dtype,
)
from codesign.specs import CodesignError, KVFormat


@dataclass
class OakenPagedKV:
    """One layer's Oaken cache (module docstring)."""

    bits: int
    head_dim: int
    k_thresholds: torch.Tensor
    v_thresholds: torch.Tensor
    k_codes: torch.Tensor
    v_codes: torch.Tensor
    k_meta: torch.Tensor
    v_meta: torch.Tensor
    k_out: torch.Tensor
    v_out: torch.Tensor
    k_count: torch.Tensor
    v_count: torch.Tensor
    overflow: torch.Tensor
    grid: torch.Tensor | None = None  # the "offline" variant's metadata grid (module docstring)
    k_index: torch.Tensor | None = None  # the kept outlier index (module docstring); None: built on first use
    v_index: torch.Tensor | None = None

    def __post_init__(self) -> None:
        self._stamp = None  # host record of the slots the index was built from (module docstring)

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state["_stamp"] = None  # weak references do not pickle; an unpickled index is rebuilt once
        return state

    @classmethod
    def empty(
        cls,
        num_blocks: int,
        block_size: int,
        kv_heads: int,
        head_dim: int,
        bits: int,
        thresholds: torch.Tensor,
        capacity: int,
        device: str | torch.device = "cpu",
        grid: torch.Tensor | None = None,
    ) -> OakenPagedKV:
        """thresholds: one layer's `[2 (K, V), kv_heads, 2 (lo, hi)]` (a slice of calibrate_kv_thresholds);
        grid: one layer's `[2, kv_heads, 2]` (a slice of calibrate_oaken_grid) for the "offline" variant."""
        check_pool_dims(num_blocks, block_size, kv_heads, head_dim)
        kq.check_bits(bits)
        if head_dim % (8 // bits):
            raise CodesignError(f"head_dim {head_dim} must be a multiple of {8 // bits} for {bits}-bit codes")
        if block_size * head_dim >= 2**15:
            raise CodesignError(
                f"block_size * head_dim must be < 32768 (16-bit positions), got {block_size * head_dim}"
            )
        check_index_shape(block_size, head_dim)
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 0:
            raise CodesignError(f"capacity must be an int >= 0, got {capacity!r}")
        _check_kv_pairs("thresholds", thresholds, kv_heads, "lo/hi", kq.check_thresholds)
        if grid is not None:
            _check_kv_pairs("grid", grid, kv_heads, "base/step", kq.check_grid)
            grid = grid.to(device).contiguous()
        w = head_dim * bits // 8
        u8 = dict(dtype=torch.uint8, device=device)
        mdt = torch.float16 if grid is None else torch.uint8
        with torch.inference_mode(False):  # normal tensors keep version counters (the index's validity rule)
            meta = torch.zeros(num_blocks, block_size, kv_heads, 2, dtype=mdt, device=device)
            out = torch.full((num_blocks, kv_heads, capacity), -1, dtype=torch.int32, device=device)
            cnt = torch.zeros(num_blocks, kv_heads, dtype=torch.int32, device=device)
            cache = cls(
                bits, head_dim, thresholds[0].to(device), thresholds[1].to(device),
                torch.zeros(num_blocks, block_size, kv_heads, w, **u8),
                torch.zeros(num_blocks, block_size, kv_heads, w, **u8),
                meta, meta.clone(), out, out.clone(), cnt, cnt.clone(),
                torch.zeros(2, kv_heads, dtype=torch.int64, device=device), grid,
            )  # fmt: skip
            cache.ensure_index()
        return cache

    @property
    def capacity(self) -> int:
        return self.k_out.shape[2]

    @property
    def meta(self) -> str:
        """ "offline" (8-bit z, r on the offline grid) or "token" (fp16 scale and lower bound)."""
        return "token" if self.grid is None else "offline"

    @property
    def kv_format(self) -> KVFormat:
        """The operator-spec format; outlier_fraction = the slot capacity as a fraction of the elements."""
        _, bs, _, d = self.check(values=False)  # (shapes only: a plan asks this, and must not wait for the device)
        return KVFormat(
            dtype=f"int{self.bits}", scheme="oaken", outlier_fraction=self.capacity / (bs * d), meta=self.meta,
        )  # fmt: skip

    def check(self, values: bool = True) -> tuple[int, int, int, int]:
        """Validate the tensors (and with `values`, a host sync, the thresholds' and grid's values);
        (num_blocks, block_size, kv_heads, head_dim)."""
        kq.check_bits(self.bits)
        c = self.k_codes
        if not isinstance(c, torch.Tensor) or c.dim() != 4:
            raise CodesignError("k_codes must be a 4-D uint8 tensor")
        nb, bs, h, _ = c.shape
        check_index_shape(bs, self.head_dim)
        cap = self.k_out.shape[-1] if isinstance(self.k_out, torch.Tensor) and self.k_out.dim() == 3 else -1
        mdt = torch.float16 if self.grid is None else torch.uint8
        want = {
            "k_codes": (torch.uint8, (nb, bs, h, self.head_dim * self.bits // 8)),
            "v_codes": (torch.uint8, (nb, bs, h, self.head_dim * self.bits // 8)),
            "k_meta": (mdt, (nb, bs, h, 2)),
            "v_meta": (mdt, (nb, bs, h, 2)),
            "k_out": (torch.int32, (nb, h, cap)),
            "v_out": (torch.int32, (nb, h, cap)),
            "k_count": (torch.int32, (nb, h)),
            "v_count": (torch.int32, (nb, h)),
        }
        for name in ("k_index", "v_index"):  # None until ensure_index builds it
            if getattr(self, name) is not None:
                want[name] = (torch.int32, (nb, h, index_width(max(cap, 0), bs, self.head_dim)))
        check_cache_tensors("Oaken", self, want, c.device)
        kq.check_thresholds(self.k_thresholds, h, values)
        kq.check_thresholds(self.v_thresholds, h, values)
        if self.grid is not None:
            g = self.grid
            if not isinstance(g, torch.Tensor) or tuple(g.shape) != (2, h, 2) or not g.is_contiguous():
                raise CodesignError(f"Oaken grid must be a contiguous tensor of shape (2, {h}, 2)")
            if g.device != c.device:
                raise CodesignError(f"grid is on {g.device}, the codes on {c.device}")
            kq.check_grid(g[0], h, values)
            kq.check_grid(g[1], h, values)
        return nb, bs, h, self.head_dim

    @property
    def bits_per_element(self) -> float:
        """The format's bits per element: codes + per-token metadata (fp16 scale and shift, or the offline
        variant's 8-bit z and r) + the fixed outlier slots (`KVFormat.bits_per_element`'s)."""
        nb, bs, h, d = self.check()
        scheme = "oaken" if self.grid is None else "oaken_offline"
        return kq.layout_bits_per_element(scheme, self.bits, d, block_size=bs, capacity=self.capacity)

    @property
    def stored_bits_per_element(self) -> float:
        """What this cache stores per element: the format's bits and the outlier index its attention kernels
        read (`index_bits_per_element`; an accelerator reading the slots in place keeps no such index)."""
        _, bs, _, d = self.check(values=False)
        return self.bits_per_element + index_bits_per_element(self.capacity, bs, d)

    # --- writer (token by token: the online rule) ------------------------------------------------
    def write(
        self, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor, check_data: bool = True
    ) -> None:
        """Quantize tokens `[n, kv_heads, D]` into their slots, in the given order (-1 skips).

        The Triton writer (`kv_write_oaken_triton`; CUDA tensors, or `use_backend("triton")`, head_dim a
        power of two) and the torch loop below give bit-identical caches. `check_data` (host syncs) checks
        that slots are in range and unique and that key/value are finite; `check_data=False` is for
        CUDA-graph capture, where the caller guarantees both (the Triton writer relies on unique slots).
        Either way the written blocks' index rows are then rebuilt (the kept index, module docstring)."""
        nb, bs, h, d = self.check(check_data)
        check_quant_write(
            key, value, (nb, bs, h, d), self.k_codes.device, slot_mapping, check_data, check_data
        )
        from codesign.kernels.kvcache.triton_oaken_write import oaken_write_triton, triton_writer_supported

        current = self.index_current()
        if resolve_backend("kv_write", key.device) == "triton" and triton_writer_supported(d):
            check_writer_dtype(key)
            oaken_write_triton(self, key, value, slot_mapping)
        else:
            self._write_loop(key, value, slot_mapping, bs)
        self._reindex(_written_blocks(slot_mapping, bs, nb), current)

    def _write_loop(self, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor, bs: int) -> None:
        """The torch writer: the online rule token by token (module docstring)."""
        kx, vx = key.to(torch.float32), value.to(torch.float32)
        for t, s in enumerate(slot_mapping.tolist()):
            if s < 0:
                continue
            blk, off = divmod(s, bs)
            for i, (x, thr, codes, meta, out, cnt) in enumerate(
                (
                    (kx[t], self.k_thresholds, self.k_codes, self.k_meta, self.k_out, self.k_count),
                    (vx[t], self.v_thresholds, self.v_codes, self.v_meta, self.v_out, self.v_count),
                )
            ):
                if off == 0:  # a fresh block
                    out[blk] = -1
                    cnt[blk] = 0
                self._write_token(x, thr, codes, meta, out, cnt, blk, off, i)

    def _write_token(self, x, thr, codes, meta, out, cnt, blk, off, kv) -> None:
        h, d = x.shape
        lo, hi = thr[:, 0:1], thr[:, 1:2]
        keep = self._claim_token(x, lo, hi, out, cnt, blk, off, kv)
        if self.grid is not None:  # offline: unslotted outliers stay dense, 8-bit meta on the grid
            g = self.grid[kv]
            c, z, r, _, _ = kq.offline_meta(kq.grid_clamp(x, g), keep, g, self.bits)
            codes[blk, off] = kq.pack_codes(c, self.bits)
            meta[blk, off] = torch.stack([z, r], -1)
            return
        xd = torch.where(keep, x, torch.minimum(torch.maximum(x, lo), hi))
        mn = torch.where(keep, torch.inf, xd).amin(-1, keepdim=True)
        mx = torch.where(keep, -torch.inf, xd).amax(-1, keepdim=True)
        empty = ~torch.isfinite(mn)
        mn, mx = torch.where(empty, 0.0, mn), torch.where(empty, 0.0, mx)
        c, sc, zr = kq._asym(torch.where(keep, mn, xd), mn, mx, self.bits, -1, "fp16")
        c = torch.where(keep, torch.zeros_like(c), c)
        codes[blk, off] = kq.pack_codes(c, self.bits)
        meta[blk, off] = torch.stack([sc, zr], -1).to(torch.float16)

    def _claim_token(self, x, lo, hi, out, cnt, blk, off, kv) -> torch.Tensor:
        """The token's outliers claim free slots of its block, farthest first; returns the kept mask."""
        h, d = x.shape
        beyond = torch.maximum(x - hi, lo - x)
        keep = torch.zeros_like(x, dtype=torch.bool)
        for hh in range(h):
            idx = torch.nonzero(beyond[hh] > 0).flatten().tolist()
            order = sorted(idx, key=lambda j: (-float(beyond[hh, j]), j))
            n0 = int(cnt[blk, hh])
            kept = order[: self.capacity - n0]
            self.overflow[kv, hh] += len(order) - len(kept)
            for k, j in enumerate(sorted(kept)):
                fp16 = int(x[hh, j].to(torch.float16).view(torch.int16)) & 0xFFFF
                out[blk, hh, n0 + k] = ((off * d + j) << 16) | fp16
                keep[hh, j] = True
            cnt[blk, hh] = n0 + len(kept)
        return keep

    # --- the kept outlier index (module docstring) ---------------------------------------------------
    def _versions(self) -> tuple | None:
        """Each of k_out, v_out, k_meta, v_meta, k_index, v_index with its version counter (host-side, no sync;
        the meta: the index's deltas hold each token's zero); None when one keeps no counter (an inference
        tensor) or the index is not allocated."""
        ts = self._indexed()
        if not all(isinstance(t, torch.Tensor) for t in ts):
            return None
        try:
            return tuple((weakref.ref(t), t._version) for t in ts)
        except RuntimeError:  # inference tensors track no version
            return None

    def _indexed(self) -> tuple:
        """The tensors the index is built from, and the index (`_versions`)."""
        return (self.k_out, self.v_out, self.k_meta, self.v_meta, self.k_index, self.v_index)

    def index_current(self) -> bool:
        """Whether k_index / v_index are `outlier_index` of the slots as they are now, by the validity rule
        (module docstring): the same tensors, unchanged since the cache last brought the index up to date."""
        stamp, ts = self._stamp, self._indexed()
        if stamp is None:
            return False
        try:
            return all(ref() is t and t._version == v for (ref, v), t in zip(stamp, ts))
        except RuntimeError:
            return False

    def ensure_index(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(k_index, v_index) as the kernel reads them: allocated if missing, and rebuilt over the whole pool
        when not current (`index_current`); torch ops into the kept buffers, no host sync. Every attention
        over the cache calls it before the launch."""
        if self.k_index is None or self.v_index is None:
            nb, h, cap = self.k_out.shape
            shape = (nb, h, index_width(cap, self.k_codes.shape[1], self.head_dim))
            with torch.inference_mode(False):
                self.k_index = torch.zeros(shape, dtype=torch.int32, device=self.k_out.device)
                self.v_index = torch.zeros_like(self.k_index)
        if not self.index_current():
            self._index_rows(None)
            self._stamp = self._versions()
        return self.k_index, self.v_index

    @contextlib.contextmanager
    def editing_slots(self, blocks: Sequence[int] | torch.Tensor) -> Iterator[None]:
        """Change the outlier slots (k_out, v_out, and the counts) of `blocks` in place inside this context (a
        copy-on-write, a rollback's restore); on leaving it their index rows are rebuilt, and the index stays
        current if it was. Changes to other blocks' slots are not followed (the next attention would read
        their old index only if the index was current: keep edits to `blocks`)."""
        current = self.index_current()
        yield
        if not isinstance(blocks, torch.Tensor):
            blocks = torch.tensor(list(blocks), dtype=torch.long)
        self._reindex(blocks.to(device=self.k_out.device, dtype=torch.long).reshape(-1), current)

    def _reindex(self, blocks: torch.Tensor | None, current: bool) -> None:
        """After the slots of `blocks` (None: any) changed through the cache: rebuild their index rows; the
        index is current again if it was before the change."""
        if self.k_index is None or self.v_index is None:
            return  # nothing kept yet: ensure_index builds it whole
        self._index_rows(blocks)
        self._stamp = self._versions() if current else None

    def _index_rows(self, blocks: torch.Tensor | None) -> None:
        """k_index / v_index rows of `blocks` (block ids, repeats allowed; None: every block) from the slots
        now: `outlier_index` of the gathered rows, scattered back. Torch ops only, no host sync."""
        bs, d = self.k_codes.shape[1], self.head_dim
        for slots, meta, index, by, kv in ((self.k_out, self.k_meta, self.k_index, "token", 0),
                                           (self.v_out, self.v_meta, self.v_index, "channel", 1)):  # fmt: skip
            if blocks is None:
                outlier_index(slots, bs, d, by, index, dense_zeros(meta, self._grid(kv)))
            else:  # repeated blocks get equal rows, so the scatter's order does not matter
                z = dense_zeros(meta.index_select(0, blocks), self._grid(kv))
                index.index_copy_(0, blocks, outlier_index(slots.index_select(0, blocks), bs, d, by, zeros=z))

    def dequantize(self, as_read: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """Debug / reference: the whole pool in float32, outliers written back (`as_read`: as the attention
        kernels read them, `dequantize_pool`)."""
        self.check()
        return tuple(
            dequantize_pool(codes, meta, out, self.bits, self._grid(i), as_read)
            for i, (codes, meta, out) in enumerate(((self.k_codes, self.k_meta, self.k_out),
                                                    (self.v_codes, self.v_meta, self.v_out)))
        )  # fmt: skip

    def _grid(self, kv: int) -> torch.Tensor | None:
        return None if self.grid is None else self.grid[kv]


def _written_blocks(slot_mapping: torch.Tensor, block_size: int, num_blocks: int) -> torch.Tensor | None:
    """The blocks a write of `slot_mapping` changes, one per token (skipped tokens name block 0, whose index is
    then rebuilt as it is); None (every block) when there are at least as many tokens as blocks."""
    if slot_mapping.shape[0] >= num_blocks:
        return None
    return slot_mapping.clamp(min=0).to(torch.long) // block_size


def _check_kv_pairs(name: str, t: torch.Tensor, kv_heads: int, pair: str, check_half) -> None:
    """A `[2 (K, V), kv_heads, 2]` parameter tensor (thresholds, grid); `check_half` checks each of K, V."""
    if not isinstance(t, torch.Tensor) or tuple(t.shape) != (2, kv_heads, 2):
        raise CodesignError(
            f"{name} must have shape (2, {kv_heads}, 2) (K/V, kv head, {pair}), got "
            f"{tuple(getattr(t, 'shape', ()))}"
        )
    check_half(t[0], kv_heads)
    check_half(t[1], kv_heads)


def dequantize_pool(codes, meta, out, bits, grid, as_read: bool = False) -> torch.Tensor:
    """Debug / reference: a pool `[nb, bs, H, D]` in float32, dense codes with their metadata (`grid`: the
    offline variant's `[H, 2]`), then the slot outliers written over: each its fp16 value, or (`as_read`) as the
    attention kernels read it, its token's dense value at code 0 plus its delta rounded as the index holds it
    (`index_delta`: within 2^-15 of the delta)."""
    d = codes.shape[-1] * 8 // bits
    c = kq.unpack_codes(codes, bits)
    if grid is None:
        scale = meta[..., 0].float()
    else:  # scale = r * step / (2^b - 1)   (quantizers.offline_meta)
        scale = (meta[..., 1].float() * grid[:, 1]) / torch.tensor(float(2**bits - 1))
    x = kq.dequantize_asym(c, scale, _token_zeros(meta, grid))
    used = out >= 0
    blk, hh, _ = torch.nonzero(used, as_tuple=True)
    w = out[used]
    pos = w >> 16
    v = (w & 0xFFFF).to(torch.int16).view(torch.float16).float()
    if as_read:
        z = _token_zeros(meta, grid)[blk, pos // d, hh]
        v = z + index_delta(v - z)
    x[blk, pos // d, hh, pos % d] = v
    return x


def default_capacity(outlier_fraction: float, block_size: int, head_dim: int) -> int:
    """ceil(fraction * block_size * head_dim) slots per (block, kv head)."""
    return kq.oaken_capacity(outlier_fraction, block_size, head_dim)


# --- the attention kernel's outlier index ------------------------------------------------------------------
OUTLIER_KEYS = ("token", "channel")
INDEX_COORD_BITS = 9  # a slot word's coordinate bits: head_dim and block_size at most 2^9 (`outlier_index`)
_COORD = (1 << INDEX_COORD_BITS) - 1


def index_width(capacity: int, block_size: int, head_dim: int) -> int:
    """Int32 words per (block, kv head) of an `outlier_index`, either side (one stride for both): CAP slot words,
    L + 1 list starts and the fullest list's length, L = max(block_size, head_dim)."""
    return capacity + max(block_size, head_dim) + 2


def index_capacity(width: int, block_size: int, head_dim: int) -> int:
    """The slot capacity of an `outlier_index` `width` words wide (`index_width`'s inverse; -1: no such width)."""
    extra = width - index_width(0, block_size, head_dim)
    return extra if extra >= 0 else -1


def index_bits_per_element(capacity: int, block_size: int, head_dim: int) -> float:
    """Bits per K or V element of the outlier index an `OakenPagedKV` keeps beside its slots (one index a side,
    `index_width` int32 words per (block, kv head) of block_size x head_dim elements)."""
    return index_width(capacity, block_size, head_dim) * 32 / (block_size * head_dim)


def check_index_shape(block_size: int, head_dim: int) -> None:
    """An outlier index addresses a slot's channel and token in INDEX_COORD_BITS bits."""
    for name, n in (("block_size", block_size), ("head_dim", head_dim)):
        if n > 1 << INDEX_COORD_BITS:
            raise CodesignError(f"{name} must be at most {1 << INDEX_COORD_BITS} for an Oaken cache, got {n}")


def index_delta(delta: torch.Tensor) -> torch.Tensor:
    """fp32 `delta` as a slot word holds it: rounded to nearest at its last INDEX_COORD_BITS mantissa bits, which
    are then 0 (relative error at most 2^-(24 - INDEX_COORD_BITS): 2^-15; infinities and NaN kept)."""
    bits = delta.to(torch.float32).view(torch.int32)
    kept = torch.where(delta.isfinite(), bits + (1 << (INDEX_COORD_BITS - 1)), bits) & ~_COORD
    return kept.view(torch.float32)


def index_slots(index: torch.Tensor, capacity: int) -> tuple[torch.Tensor, torch.Tensor]:
    """An `outlier_index`'s slot words `[..., CAP]` as (coordinate int32, delta float32)."""
    words = index[..., :capacity]
    return words & _COORD, (words & ~_COORD).view(torch.float32)


def index_defined(index: torch.Tensor, capacity: int, n: int) -> torch.Tensor:
    """The words of an `outlier_index` its layout defines (n = block_size for keys, head_dim for values): two
    indexes are the same index when these are equal."""
    return index[..., : capacity + n + 2]


def dense_zeros(meta: torch.Tensor, grid: torch.Tensor | None = None) -> torch.Tensor:
    """`[nb, H, block_size]` float32: each token's dense value at code 0 (its lower bound), as the attention
    kernel's factored path has it: fp16 meta's zero, or the offline grid's base + z step (grid: one side's
    `[H, 2]`), from meta `[nb, block_size, H, 2]`. An outlier's index delta is its value minus this."""
    return _token_zeros(meta, grid).transpose(1, 2)


def _token_zeros(meta: torch.Tensor, grid: torch.Tensor | None) -> torch.Tensor:
    """`[nb, block_size, H]` float32 zeros of meta `[nb, block_size, H, 2]`: the fp16 meta's second value, or on
    the offline grid base + z step (`quantizers.offline_meta`)."""
    if grid is None:
        return meta[..., 1].to(torch.float32)
    return grid[:, 0] + meta[..., 0].to(torch.float32) * grid[:, 1]


def outlier_index(
    slots: torch.Tensor,
    block_size: int,
    head_dim: int,
    by: str,
    out: torch.Tensor | None = None,
    zeros: torch.Tensor | None = None,
) -> torch.Tensor:
    """The slots `[nb, H, CAP]` of each (block, kv head) grouped by token (`by="token"`, the key side) or by
    channel (`"channel"`, the value side), as the attention kernel reads them (the cache keeps it:
    `OakenPagedKV.k_index` / `v_index`, module docstring): `[nb, H, W]` int32 (`index_width`) with

        [0, CAP)                 one word a slot, the used slots stably sorted by their token (or channel), unused
                                 ones 0 last: the fp32 bits of its delta, its value minus its token's dense value
                                 at code 0 (`zeros` `[nb, H, block_size]`, `dense_zeros` of the block's meta; None:
                                 0) rounded at its last INDEX_COORD_BITS mantissa bits (`index_delta`), which hold
                                 its other coordinate instead (the channel of a token's list, the token of a
                                 channel's: the kernel's gather index, with no division by D a slot). The kernel's
                                 correction, with no decode or zero a slot: one 4-byte load and two ANDs
                                 (`index_slots` reads them back)
        [CAP, CAP + n + 1)       start of each token's (channel's) list in that order (n = block_size or head_dim):
                                 list i is slots [start[i], start[i + 1])
        CAP + n + 1              the fullest list's length (the kernel's inner-loop bound for that block)

    Empty slots (-1) and positions past the block are left out. Torch ops only, into `out` when given: no host
    sync and no factory allocation, so a writer can rebuild its blocks' rows inside a CUDA graph; words past
    CAP + n + 2 are left as they are (0 in a buffer allocated here). The one definition of the layout: the cache's
    kept index is made of its rows."""
    if by not in OUTLIER_KEYS:
        raise CodesignError(f"by must be one of {OUTLIER_KEYS}, got {by!r}")
    check_index_shape(block_size, head_dim)
    nb, h, cap = slots.shape
    n = block_size if by == "token" else head_dim
    pos = slots >> 16
    valid = (slots >= 0) & (pos < block_size * head_dim)
    key = pos // head_dim if by == "token" else pos % head_dim
    key = torch.where(valid, key, n)  # unused slots sort after every list
    order = torch.sort(key, dim=-1, stable=True).indices
    if out is None:
        out = slots.new_zeros(nb, h, index_width(cap, block_size, head_dim))  # the words past CAP + n + 2: 0
    words = slots.gather(-1, order)
    wpos = words >> 16
    used = (words >= 0) & (wpos < block_size * head_dim)
    other = wpos % head_dim if by == "token" else wpos // head_dim
    value = (words & 0xFFFF).to(torch.int16).view(torch.float16).to(torch.float32)
    if zeros is not None:
        tok = torch.where(used, wpos // head_dim, 0).long()
        value = value - zeros.to(torch.float32).gather(-1, tok)
    out[..., :cap].copy_(torch.where(used, index_delta(value).view(torch.int32) | other, 0))
    counts = out[..., cap + 1 : cap + n + 1]
    counts.zero_()
    counts.scatter_add_(-1, torch.where(valid, key, 0), valid.to(torch.int32))
    out[..., cap + n + 1].copy_(counts.amax(-1))
    out[..., cap].zero_()
    counts.copy_(counts.cumsum(-1))
    return out
