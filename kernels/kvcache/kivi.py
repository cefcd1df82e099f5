"""KIVI paged KV cache: keys per channel over groups of G tokens, values per token over groups of
GV = min(G, D) elements, the newest tokens in a per-sequence full-precision residual ring. Attention reads
codes and ring directly (`codesign::paged_attention_kivi`, in `attention.quantized`).

Layout, per layer (b bits, G | block_size, GV | D, (8 / b) | D):
    k_codes, v_codes  uint8 `[num_blocks, block_size, kv_heads, D * b / 8]`   (packed along D)
    k_meta            fp16  `[num_blocks, block_size / G, kv_heads, D, 2]`   (scale, zero per channel)
    v_meta            fp16  `[num_blocks, block_size, kv_heads, D / GV, 2]`  (scale, zero per GV elements)
    k_res, v_res      `[batch, G + R, kv_heads, D]` (fp16 or fp32): token t of sequence b at row t % (G + R)
Tokens [0, n_q) of a sequence of length T are in the codes, n_q = floor(max(T - R, 0) / G) * G
(`quantizers.kivi_split`); tokens [n_q, T) (fewer than G + R) are in the ring. Row b of the ring belongs
to row b of block_tables. `append` is the writer (`append_rows`: several sequences at once):
new tokens go to the ring, each group that fills is quantized straight into its block (a Triton flush kernel on
GPUs / with the triton backend, torch otherwise); the codes are exactly those of `quantizers.kivi_fake_quant`
on the whole sequence.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from codesign.backend import resolve_backend
from codesign.kernels.kvcache import quantizers as kq
from codesign.kernels.kvcache.checks import IN_DTYPES, check_cache_tensors, check_pool_dims
from codesign.kernels.kvcache.host_ints import device_ints
from codesign.specs import CodesignError, KVFormat, check_positive_int

RES_DTYPES = (torch.float16, torch.float32)


@dataclass
class KiviPagedKV:
    """One layer's KIVI cache (module docstring)."""

    bits: int
    group: int
    residual: int
    head_dim: int
    k_codes: torch.Tensor
    v_codes: torch.Tensor
    k_meta: torch.Tensor
    v_meta: torch.Tensor
    k_res: torch.Tensor
    v_res: torch.Tensor

    @classmethod
    def empty(
        cls,
        num_blocks: int,
        block_size: int,
        kv_heads: int,
        head_dim: int,
        bits: int,
        group: int,
        residual: int,
        batch: int,
        res_dtype: torch.dtype = torch.float16,
        device: str | torch.device = "cpu",
    ) -> KiviPagedKV:
        """Zeroed codes, metadata and residual rings for `batch` sequences."""
        check_pool_dims(num_blocks, block_size, kv_heads, head_dim)
        check_positive_int("batch", batch)
        kq.check_bits(bits)
        check_positive_int("group", group)
        if isinstance(residual, bool) or not isinstance(residual, int) or residual < 0:
            raise CodesignError(f"residual must be an int >= 0, got {residual!r}")
        if block_size % group:
            raise CodesignError(f"the KIVI group ({group}) must divide block_size ({block_size})")
        gv = min(group, head_dim)
        if head_dim % gv or head_dim % (8 // bits):
            raise CodesignError(
                f"head_dim {head_dim} must be a multiple of the value group {gv} and of {8 // bits}"
            )
        if res_dtype not in RES_DTYPES:
            raise CodesignError(f"res_dtype must be one of {RES_DTYPES}, got {res_dtype}")
        w = head_dim * bits // 8
        z8 = dict(dtype=torch.uint8, device=device)
        z16 = dict(dtype=torch.float16, device=device)
        return cls(
            bits,
            group,
            residual,
            head_dim,
            torch.zeros(num_blocks, block_size, kv_heads, w, **z8),
            torch.zeros(num_blocks, block_size, kv_heads, w, **z8),
            torch.zeros(num_blocks, block_size // group, kv_heads, head_dim, 2, **z16),
            torch.zeros(num_blocks, block_size, kv_heads, head_dim // gv, 2, **z16),
            torch.zeros(batch, group + residual, kv_heads, head_dim, dtype=res_dtype, device=device),
            torch.zeros(batch, group + residual, kv_heads, head_dim, dtype=res_dtype, device=device),
        )

    @property
    def value_group(self) -> int:
        return min(self.group, self.head_dim)

    @property
    def kv_format(self) -> KVFormat:
        return KVFormat(dtype=f"int{self.bits}", scheme="kivi", group_size=self.group, residual=self.residual)

    def check(self) -> tuple[int, int, int, int]:
        """Validate every tensor against the parameters; (num_blocks, block_size, kv_heads, head_dim)."""
        kq.check_bits(self.bits)
        nb, bs, h, w = self.k_codes.shape if self.k_codes.dim() == 4 else (0, 0, 0, 0)
        d, g, gv = self.head_dim, self.group, self.value_group
        want = {
            "k_codes": (torch.uint8, (nb, bs, h, d * self.bits // 8)),
            "v_codes": (torch.uint8, (nb, bs, h, d * self.bits // 8)),
            "k_meta": (torch.float16, (nb, bs // g, h, d, 2)),
            "v_meta": (torch.float16, (nb, bs, h, d // gv, 2)),
        }
        check_cache_tensors("KIVI", self, want)
        for name in ("k_res", "v_res"):
            t = getattr(self, name)
            if (
                not isinstance(t, torch.Tensor)
                or t.dtype not in RES_DTYPES
                or t.dim() != 4
                or tuple(t.shape[1:]) != (g + self.residual, h, d)
                or not t.is_contiguous()
            ):
                raise CodesignError(
                    f"KIVI {name} must be a contiguous fp16/fp32 tensor [batch, {g + self.residual}, {h}, {d}]"
                )
        if self.k_res.shape != self.v_res.shape or self.k_res.dtype != self.v_res.dtype:
            raise CodesignError("k_res and v_res must match in shape and dtype")
        devs = {getattr(self, n).device for n in ("k_codes", "v_codes", "k_meta", "v_meta", "k_res", "v_res")}
        if len(devs) != 1:
            raise CodesignError(f"all KIVI tensors must be on one device, got {sorted(map(str, devs))}")
        return nb, bs, h, d

    # --- writers ---------------------------------------------------------------------------------
    def append(
        self,
        seq: int,
        block_row: torch.Tensor,
        start: int,
        k_new: torch.Tensor,
        v_new: torch.Tensor,
        check_data: bool = True,
    ) -> None:
        """Append tokens [start, start + n) of sequence `seq` (blocks `block_row`, a row of block_tables).

        New tokens go to the ring; each group of G tokens leaving the residual window is quantized
        (keys per channel, values per token) into its block, so sequences forked from a shared prefix
        rewrite identical codes into shared blocks. `check_data=False` skips the check that the new
        tokens are finite (a host sync). `append_rows` for one row, after checking the row's block ids (a sync).
        """
        nb, bs, h, d = self.check()
        self._check_new(k_new, v_new, h, d)
        end = start + k_new.shape[0]
        if start < 0 or -(-end // bs) > block_row.numel():
            raise CodesignError(
                f"tokens [{start}, {end}) need {-(-end // bs)} blocks, the row has {block_row.numel()}"
            )
        rows = block_row[: -(-end // bs)].long().cpu()
        if ((rows < 0) | (rows >= nb)).any():
            raise CodesignError(f"block_row holds ids outside [0, {nb})")
        self.append_rows([seq], [start], [k_new.shape[0]], k_new, v_new, [rows.tolist()], check_data)

    def append_rows(
        self,
        seqs: Sequence[int],
        starts: Sequence[int],
        counts: Sequence[int],
        k_new: torch.Tensor,
        v_new: torch.Tensor,
        blocks: Sequence[Sequence[int]] | torch.Tensor,
        check_data: bool = True,
        memo: dict | None = None,
    ) -> None:
        """Tokens [starts[i], starts[i] + counts[i]) of sequences seqs[i] (distinct), rows after rows in
        k_new / v_new `[tokens, kv_heads, D]`, in one pass (a decode, prefill, extend or tree forward): the same
        cache contents as `append` row by row. blocks[i]: sequence seqs[i]'s block ids (host lists, or a
        block_tables tensor: one host copy).

        Where every row's unflushed ring tokens and new tokens fit in its ring (a decode step, short forwards), the
        new tokens go into the rings (one copy) and every group leaving a residual window is quantized from there
        (one flush launch); otherwise each row's unflushed and new tokens are staged together first (one gather).
        On a GPU no host sync without check_data (the finiteness check); `memo` (`host_ints.device_ints`) shares
        the index copies with the other layers of a step.
        """
        nb, bs, h, d = self.check()
        self._check_new(k_new, v_new, h, d)
        if not len(seqs) == len(starts) == len(counts) == len(blocks):
            raise CodesignError(
                f"append_rows: seqs ({len(seqs)}), starts ({len(starts)}), counts ({len(counts)}) and block rows "
                f"({len(blocks)}) must match"
            )
        if len(set(seqs)) != len(seqs):
            raise CodesignError(f"append_rows: seqs must be distinct, got {list(seqs)}")
        for s, t, n in zip(seqs, starts, counts):
            self._check_ring(s)
            _check_position("starts", t)
            _check_position("counts", n)
        if sum(counts) != k_new.shape[0]:
            raise CodesignError(f"append_rows: counts add up to {sum(counts)}, k_new has {k_new.shape[0]} tokens")
        if isinstance(blocks, torch.Tensor):
            blocks = blocks.tolist()
        g, r = self.group, self.residual
        ring = g + r
        if check_data:
            kq._check_finite("k_new", k_new), kq._check_finite("v_new", v_new)
        dev = self.k_res.device
        kr, vr = self.k_res.view(-1, h, d), self.v_res.view(-1, h, d)
        rows = list(zip(seqs, starts, counts, blocks))
        if all(t + n - kq.kivi_split(t, g, r) <= ring for _, t, n, _ in rows):
            # The new tokens enter the rings first: a flushed group's tokens are all in the ring then.
            at = device_ints([s * ring + u % ring for s, t, n, _ in rows for u in range(t, t + n)], dev, memo)
            kr.index_copy_(0, at, k_new.to(dev, kr.dtype))
            vr.index_copy_(0, at, v_new.to(dev, vr.dtype))
            split = lambda t: kq.kivi_split(t, g, r)  # noqa: E731
            flush = [(s * ring, g0 % ring, self._group_slot(s, g0, row, nb, bs))
                     for s, t, n, row in rows for g0 in range(split(t), split(t + n), g)]  # fmt: skip
            self._flush(kr, vr, flush, ring, memo)
            return
        from_ring, to_stage, new_from, new_at, ring_at, ring_from, flush = [], [], [], [], [], [], []
        off = staged = 0  # k_new row of this row's first token; stage rows so far
        for s, t, n, row in rows:
            old, new, end = kq.kivi_split(t, g, r), kq.kivi_split(t + n, g, r), t + n
            if new > old:  # stage: ring tokens [old, t), then the new tokens
                from_ring += [s * ring + u % ring for u in range(old, t)]
                to_stage += range(staged, staged + t - old)
                new_from += range(off, off + n)
                new_at += range(staged + t - old, staged + end - old)
                flush += [(0, staged + g0 - old, self._group_slot(s, g0, row, nb, bs))
                          for g0 in range(old, new, g)]  # fmt: skip
                staged += end - old
            ring_at += [s * ring + u % ring for u in range(max(new, t), end)]
            ring_from += range(off + max(new, t) - t, off + n)
            off += n
        if flush:
            stage = []
            for res, x in ((kr, k_new), (vr, v_new)):
                p = torch.empty(staged, h, d, dtype=torch.float32, device=dev)
                if to_stage:
                    p.index_copy_(0, device_ints(to_stage, dev, memo), res[device_ints(from_ring, dev, memo)].float())
                p.index_copy_(0, device_ints(new_at, dev, memo), x.to(dev)[device_ints(new_from, dev, memo)].float())
                stage.append(p)
            self._flush(*stage, flush, staged, memo)
        if ring_at:
            at, src = device_ints(ring_at, dev, memo), device_ints(ring_from, dev, memo)
            kr.index_copy_(0, at, k_new.to(dev)[src].to(kr.dtype))
            vr.index_copy_(0, at, v_new.to(dev)[src].to(vr.dtype))

    def append_step(
        self, positions: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor, block_tables: torch.Tensor
    ) -> None:
        """One new token a row (a decode step) with every decision on the device: row b's token (position
        positions[b], `[B]` ints on the cache's device) goes to ring b at row positions[b] % (G + R), and the group
        it pushes out of the residual window, if any (at most one a row), is quantized into its block, found in
        row b of block_tables `[B, max_blocks]`. No host sync and nothing read on the host, so one captured forward
        (a CUDA graph) serves every step; the cache contents are `append_rows`'. Not checked: that the positions
        and tables are the rows' own (the caller's buffers) and finite values."""
        nb, bs, h, d = self.check()
        self._check_new(k_new, v_new, h, d)
        b, dev = k_new.shape[0], self.k_res.device
        if not isinstance(positions, torch.Tensor) or tuple(positions.shape) != (b,) or positions.is_floating_point():
            got = getattr(positions, "shape", positions)
            raise CodesignError(f"append_step: positions must be {b} ints, got {got}")
        if not isinstance(block_tables, torch.Tensor) or block_tables.dim() != 2 or block_tables.shape[0] != b:
            raise CodesignError(f"append_step: block_tables must be [{b}, max_blocks]")
        if b > self.k_res.shape[0]:
            raise CodesignError(f"append_step: {b} rows but {self.k_res.shape[0]} residual rings")
        g, r = self.group, self.residual
        ring = g + r
        pos = positions.to(dev, torch.int64)
        kr, vr = self.k_res.view(-1, h, d), self.v_res.view(-1, h, d)
        base = torch.arange(b, device=dev) * ring
        kr.index_copy_(0, base + pos % ring, k_new.to(dev, kr.dtype))
        vr.index_copy_(0, base + pos % ring, v_new.to(dev, vr.dtype))
        before, after = ((pos + x - r).clamp(min=0) // g * g for x in (0, 1))  # kivi_split before and after
        flush = after > before
        # A row without a flush names its own current group, a target no other row's flush writes (rows own
        # their blocks: KIVI shares none), so the torch path may write it back unchanged.
        g0 = torch.where(flush, after - g, pos // g * g)
        blk = block_tables.to(dev).long().gather(1, (g0 // bs)[:, None])[:, 0]
        self._flush_rows(kr, vr, torch.stack([base, g0 % ring, blk * bs + g0 % bs], 1), flush, ring)

    def _flush_rows(self, pk: torch.Tensor, pv: torch.Tensor, groups: torch.Tensor, flush: torch.Tensor,
                    ring: int) -> None:  # fmt: skip
        """`_flush` of device groups `[B, 3]` (base, first, slot) where `flush` `[B]` holds, without a sync: the
        Triton flush with the other rows' slots -1 (skipped), else torch, writing the unflushed rows' targets back
        as they are."""
        from codesign.kernels.kvcache import triton_kivi_flush as tf

        bs, h, d = self.k_codes.shape[1], self.k_codes.shape[2], self.head_dim
        g, gv, bits = self.group, self.value_group, self.bits
        if resolve_backend("kv_write", pk.device) == "triton" and tf.triton_flush_supported(g, gv, d):
            slots = torch.where(flush, groups[:, 2], -1)
            tf.kivi_flush_triton(self, pk, pv, torch.stack([groups[:, 0], groups[:, 1], slots], 1), ring)
            return
        base, first, slot = groups.unbind(1)
        t = torch.arange(g, device=pk.device)
        at = base[:, None] + (first[:, None] + t) % ring  # [B, G]
        blk, off = (slot // bs)[:, None], (slot % bs)[:, None] + t
        keep = flush[:, None, None, None]
        k = pk[at].float()  # [B, G, h, d]: keys per channel over the group's tokens
        c, s, z = kq._asym(k, k.amin(1, keepdim=True), k.amax(1, keepdim=True), bits, 1, "fp16")
        self.k_codes[blk, off] = torch.where(keep, kq.pack_codes(c, bits, check=False), self.k_codes[blk, off])
        km = self.k_meta[blk[:, 0], off[:, 0] // g]  # [B, h, d, 2]
        self.k_meta[blk[:, 0], off[:, 0] // g] = torch.where(keep, torch.stack([s, z], -1).half(), km)
        v = pv[at].float().reshape(*at.shape, h, d // gv, gv)  # values per token over GV elements
        c, s, z = kq._asym(v, v.amin(-1, keepdim=True), v.amax(-1, keepdim=True), bits, -1, "fp16")
        packed = kq.pack_codes(c.reshape(*at.shape, h, d), bits, check=False)
        self.v_codes[blk, off] = torch.where(keep, packed, self.v_codes[blk, off])
        vm = self.v_meta[blk, off]
        self.v_meta[blk, off] = torch.where(keep[..., None], torch.stack([s, z], -1).half(), vm)

    def _group_slot(self, seq: int, g0: int, row, nb: int, bs: int) -> int:
        """The slot a group starting at token g0 of `seq` lands in (its block from the host row, checked)."""
        if g0 // bs >= len(row) or not 0 <= int(row[g0 // bs]) < nb:
            raise CodesignError(
                f"append_rows: sequence {seq} flushes tokens [{g0}, {g0 + self.group}), whose block {g0 // bs} its "
                f"block row ({len(row)} entries) does not hold inside [0, {nb})"
            )
        return int(row[g0 // bs]) * bs + g0 % bs

    def _check_ring(self, seq: int) -> None:
        if isinstance(seq, bool) or not isinstance(seq, int) or not 0 <= seq < self.k_res.shape[0]:
            raise CodesignError(f"seq {seq!r} outside the {self.k_res.shape[0]} residual rings")

    @staticmethod
    def _check_new(k_new, v_new, h: int, d: int) -> None:
        for name, x in (("k_new", k_new), ("v_new", v_new)):
            if not isinstance(x, torch.Tensor) or x.dim() != 3 or tuple(x.shape[1:]) != (h, d):
                raise CodesignError(
                    f"{name} must be [tokens, {h}, {d}], got {tuple(getattr(x, 'shape', ()))}"
                )
            if x.dtype not in IN_DTYPES:
                raise CodesignError(f"{name} dtype must be one of {IN_DTYPES}, got {x.dtype}")
        if k_new.shape != v_new.shape:
            raise CodesignError("k_new and v_new must have the same shape")

    def _flush(self, pk: torch.Tensor, pv: torch.Tensor, groups: list[tuple[int, int, int]], ring: int,
               memo: dict | None = None) -> None:  # fmt: skip
        """Quantize groups (base, first, slot) of the pending rows `[P, kv_heads, D]` (group token t at row
        base + (first + t) % ring) into their slots: the Triton flush in one launch, else torch."""
        from codesign.kernels.kvcache.triton_kivi_flush import kivi_flush_triton, triton_flush_supported

        bs, h, d = self.k_codes.shape[1], self.k_codes.shape[2], self.head_dim
        g, gv = self.group, self.value_group
        if resolve_backend("kv_write", pk.device) == "triton" and triton_flush_supported(g, gv, d):
            kivi_flush_triton(self, pk, pv, groups, ring, memo)
            return
        for base, first, slot in groups:
            at = base + (first + torch.arange(g, device=pk.device)) % ring
            blk, off = slot // bs, slot % bs
            c, s, z = kq.quantize_asym(pk[at].float(), self.bits, dim=0)
            self.k_codes[blk, off : off + g] = kq.pack_codes(c, self.bits)
            self.k_meta[blk, off // g] = torch.stack([s, z], -1).half()
            c, s, z = kq.quantize_asym(pv[at].float().reshape(g, h, d // gv, gv), self.bits)
            self.v_codes[blk, off : off + g] = kq.pack_codes(c.reshape(g, h, d), self.bits)
            self.v_meta[blk, off : off + g] = torch.stack([s, z], -1).half()

    def dequantize_seq(
        self, seq: int, block_row: torch.Tensor, length: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Debug / reference: sequence `seq`'s K and V `[length, kv_heads, D]` in float32."""
        nb, bs, h, d = self.check()
        g, gv, ring = self.group, self.value_group, self.group + self.residual
        nq = kq.kivi_split(length, g, self.residual)
        dev = self.k_codes.device
        t = torch.arange(length, device=dev)
        blk, off = block_row.long().to(dev)[t // bs], t % bs
        kc = kq.unpack_codes(self.k_codes[blk, off], self.bits).float()
        km = self.k_meta[blk, off // g].float()
        k = kc * km[..., 0] + km[..., 1]
        vc = kq.unpack_codes(self.v_codes[blk, off], self.bits).float().reshape(length, h, d // gv, gv)
        vm = self.v_meta[blk, off].float()
        v = (vc * vm[..., 0:1] + vm[..., 1:2]).reshape(length, h, d)
        res = (t >= nq)[:, None, None]
        k = torch.where(res, self.k_res[seq, t % ring].float(), k)
        v = torch.where(res, self.v_res[seq, t % ring].float(), v)
        return k, v


def _check_position(name: str, t) -> None:
    if isinstance(t, bool) or not isinstance(t, int) or t < 0:
        raise CodesignError(f"append_rows: {name} must be ints >= 0, got {t!r}")


def check_rings(cache: KiviPagedKV, block_tables: torch.Tensor) -> None:
    """Row b of block_tables reads residual ring b: the cache needs a ring per row."""
    if block_tables.dim() == 2 and block_tables.shape[0] > cache.k_res.shape[0]:
        raise CodesignError(
            f"block_tables has {block_tables.shape[0]} rows but the cache "
            f"{cache.k_res.shape[0]} residual rings"
        )
