"""Quantized paged KV cache, per-token INT8/4/2 or per-head FP8: the cache tensors and quantize-on-write
(torch op `codesign::kvq_write`); attention over the codes is `attention.quantized`.

Formats (rules in `codesign.kernels.kvcache.quantizers`), per layer, addressed by the same block ids as a plain cache:
  - "int8" / "int4" / "int2": per-token asymmetric. codes uint8 `[num_blocks, block_size, kv_heads,
    head_dim * b / 8]` (packed), meta fp16 `[num_blocks, block_size, kv_heads, 2]` = (scale, zero).
  - "fp8": e4m3 codes (as uint8) `[num_blocks, block_size, kv_heads, head_dim]`, meta fp32 `[kv_heads]`
    (per-head scales, calibrated offline with `quantizers.fp8_head_scales`).

CUDA tensors run the Triton writer (the quantizer fused in the KV writer); CPU tensors the torch reference
(`quantizers`); `use_backend("triton")` forces the kernel (the interpreter on CPU). Bad input raises
CodesignError before any launch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from codesign.backend import resolve_backend
from codesign.kernels.kvcache import quantizers as kq
from codesign.kernels.kvcache.checks import (
    MAX_BLOCK_SIZE,
    check_pool_dims,
    check_quant_write,
    check_writer_dtype,
)
from codesign.kernels.kvcache.formats import KV_FORMAT_FP8, KVQ_FORMATS, kernel_format
from codesign.kernels.kvcache.write import direct
from codesign.specs import CodesignError, KVFormat

# name -> (KV_FORMAT code, bits), from the one vocabulary (`kvcache.formats`)
FORMATS = {name: kernel_format(fmt) for name, fmt in KVQ_FORMATS.items()}
WRITE_OP = "kv_write"


@dataclass
class QuantPagedKV:
    """One layer's quantized paged K/V (layouts in the module docstring)."""

    fmt: str
    head_dim: int
    k_codes: torch.Tensor
    v_codes: torch.Tensor
    k_meta: torch.Tensor
    v_meta: torch.Tensor

    @classmethod
    def empty(
        cls,
        num_blocks: int,
        block_size: int,
        kv_heads: int,
        head_dim: int,
        fmt: str,
        device: str | torch.device = "cpu",
        k_head_scale: torch.Tensor | None = None,
        v_head_scale: torch.Tensor | None = None,
    ) -> QuantPagedKV:
        """Zeroed codes and metadata; fp8 needs its per-head scales (float32 `[kv_heads]`)."""
        check_pool_dims(num_blocks, block_size, kv_heads, head_dim)
        kind, bits = _format(fmt)
        per = 8 // bits
        if head_dim % per:
            raise CodesignError(f"head_dim {head_dim} must be a multiple of {per} for {fmt} codes")
        shape = (num_blocks, block_size, kv_heads, head_dim // per)
        kc = torch.zeros(shape, dtype=torch.uint8, device=device)
        vc = torch.zeros(shape, dtype=torch.uint8, device=device)
        if kind == KV_FORMAT_FP8:
            for name, s in (("k_head_scale", k_head_scale), ("v_head_scale", v_head_scale)):
                if s is None:
                    raise CodesignError(f"fp8 caches need {name} (float32 [kv_heads])")
                kq.check_head_scales(s, kv_heads)
            km, vm = k_head_scale.to(device).clone(), v_head_scale.to(device).clone()
        else:
            km = torch.zeros(num_blocks, block_size, kv_heads, 2, dtype=torch.float16, device=device)
            vm = torch.zeros_like(km)
        return cls(fmt, head_dim, kc, vc, km, vm)

    @property
    def bits(self) -> int:
        return FORMATS[self.fmt][1]

    @property
    def kv_format(self) -> KVFormat:
        """The operator-spec format (for the models' traffic counts)."""
        return KVQ_FORMATS[self.fmt]

    def dequantize(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Debug / reference dequantization of the whole pool to float32 `[nb, bs, kv_heads, head_dim]`."""
        check_quant_cache(self)
        return tuple(
            dequantize_codes(c, m, self.fmt) for c, m in ((self.k_codes, self.k_meta), (self.v_codes, self.v_meta))
        )


def _format(fmt: str) -> tuple[int, int]:
    if fmt not in FORMATS:
        raise CodesignError(f"kv cache format must be one of {tuple(FORMATS)}, got {fmt!r}")
    return FORMATS[fmt]


def dequantize_codes(codes: torch.Tensor, meta: torch.Tensor, fmt: str) -> torch.Tensor:
    """float32 values of `fmt` codes with their metadata (per-token (scale, zero), or fp8 head scales)."""
    kind, bits = FORMATS[fmt]
    if kind == KV_FORMAT_FP8:
        return kq.dequantize_fp8(codes, meta)
    return kq.dequantize_asym(kq.unpack_codes(codes, bits), meta[..., 0].float(), meta[..., 1].float())


def check_quant_cache(
    cache: QuantPagedKV, fmt: str | None = None, check_data: bool = True
) -> tuple[int, int, int, int]:
    """Validate codes and metadata (and that the cache holds `fmt`, if given; `check_data`: that fp8 head scales
    are finite and > 0, a host sync); (nb, bs, kv_heads, D)."""
    if not isinstance(cache, QuantPagedKV):
        raise CodesignError(f"cache must be a QuantPagedKV, got {type(cache).__name__}")
    if fmt is not None and cache.fmt != fmt:
        raise CodesignError(f"cache format {cache.fmt!r} does not match the kernel's {fmt!r}")
    kind, bits = _format(cache.fmt)
    per = 8 // bits
    for name in ("k_codes", "v_codes"):
        t = getattr(cache, name)
        if not isinstance(t, torch.Tensor) or t.dim() != 4 or t.dtype != torch.uint8:
            raise CodesignError(f"{name} must be a 4-D uint8 tensor, got {getattr(t, 'dtype', type(t))}")
        if not t.is_contiguous():
            raise CodesignError(f"{name} must be contiguous")
    if cache.k_codes.shape != cache.v_codes.shape or cache.k_codes.device != cache.v_codes.device:
        raise CodesignError("k_codes and v_codes must have the same shape and device")
    nb, bs, h, w = cache.k_codes.shape
    if not 1 <= bs <= MAX_BLOCK_SIZE:
        raise CodesignError(f"block_size must be in [1, {MAX_BLOCK_SIZE}], got {bs}")
    if w * per != cache.head_dim:
        raise CodesignError(
            f"{cache.fmt} codes of head_dim {cache.head_dim} need {cache.head_dim // per} bytes per row, got {w}"
        )
    want = (torch.float32, (h,)) if kind == KV_FORMAT_FP8 else (torch.float16, (nb, bs, h, 2))
    for name in ("k_meta", "v_meta"):
        t = getattr(cache, name)
        if not isinstance(t, torch.Tensor) or t.dtype != want[0] or tuple(t.shape) != want[1]:
            raise CodesignError(
                f"{name} of a {cache.fmt} cache must be {want[0]} of shape {want[1]}, got "
                f"{getattr(t, 'dtype', type(t))} {tuple(getattr(t, 'shape', ()))}"
            )
        if not t.is_contiguous() or t.device != cache.k_codes.device:
            raise CodesignError(f"{name} must be contiguous and on the codes' device")
    if kind == KV_FORMAT_FP8:
        for name in ("k_meta", "v_meta"):
            kq.check_head_scales(getattr(cache, name), h, check_data)
    return nb, bs, h, cache.head_dim


def _write_torch(key, value, k_codes, v_codes, k_meta, v_meta, slot_mapping, kind, bits) -> None:
    keep = slot_mapping >= 0
    s = slot_mapping[keep].to(torch.int64)
    for x, codes, meta in ((key[keep], k_codes, k_meta), (value[keep], v_codes, v_meta)):
        flat = codes.view(-1, *codes.shape[2:])
        if kind == KV_FORMAT_FP8:
            flat.index_copy_(0, s, kq.quantize_fp8(x, meta))
            continue
        c, sc, zr = kq.quantize_per_token(x, bits)
        flat.index_copy_(0, s, kq.pack_codes(c, bits))
        meta.view(-1, *meta.shape[2:]).index_copy_(0, s, torch.stack([sc, zr], -1).to(torch.float16))


def _kvq_write_body(key, value, k_codes, v_codes, k_meta, v_meta, slot_mapping, kind, bits) -> None:
    """The op's body: the backend's writer."""
    if resolve_backend(WRITE_OP, key.device) == "triton":
        check_writer_dtype(key)
        from codesign.kernels.kvcache.triton_write import kv_write_triton

        kv_write_triton(key, value, k_codes, v_codes, slot_mapping, k_meta, v_meta, kind, bits)
    else:
        _write_torch(key, value, k_codes, v_codes, k_meta, v_meta, slot_mapping, kind, bits)


@torch.library.custom_op("codesign::kvq_write", mutates_args=("k_codes", "v_codes", "k_meta", "v_meta"))
def kvq_write_op(
    key: torch.Tensor,
    value: torch.Tensor,
    k_codes: torch.Tensor,
    v_codes: torch.Tensor,
    k_meta: torch.Tensor,
    v_meta: torch.Tensor,
    slot_mapping: torch.Tensor,
    kind: int,
    bits: int,
) -> None:
    _kvq_write_body(key, value, k_codes, v_codes, k_meta, v_meta, slot_mapping, kind, bits)


@kvq_write_op.register_fake
def _(key, value, k_codes, v_codes, k_meta, v_meta, slot_mapping, kind, bits) -> None:
    return None


def kvq_write(
    key: torch.Tensor,
    value: torch.Tensor,
    cache: QuantPagedKV,
    slot_mapping: torch.Tensor,
    check_data: bool = True,
    dispatch: bool = True,
) -> None:
    """Quantize key/value `[tokens, kv_heads, head_dim]` straight into the cache slots (in place).

    Slot s = block * block_size + offset; -1 skips a token. The codes and scales written are bit
    for bit those of `quantizers.quantize_per_token` / `quantize_fp8` (one writer launch per layer).
    `check_data` (one host sync) checks slots and that key/value are finite. `dispatch=False`: the op's body
    without torch's dispatcher, as `write.kv_write`'s.
    """
    shape = check_quant_cache(cache, check_data=check_data)
    check_quant_write(key, value, shape, cache.k_codes.device, slot_mapping, check_data, check_data)
    kind, bits = FORMATS[cache.fmt]
    args = (key, value, cache.k_codes, cache.v_codes, cache.k_meta, cache.v_meta, slot_mapping, kind, bits)
    if direct(dispatch):
        _kvq_write_body(*args)
    else:
        kvq_write_op(*args)
