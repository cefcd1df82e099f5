"""Quantized paged KV cache: the cache tensors, quantize-on-write, and decode / extend / tree attention that
read the codes directly (torch ops `codesign::kvq_write` and `codesign::paged_attention_kvq`).

Formats (rules in `codesign.kernels.kv_quant`), per layer, addressed by the same block ids as a plain cache:
  - "int8" / "int4" / "int2": per-token asymmetric. codes uint8 `[num_blocks, block_size, kv_heads,
    head_dim * b / 8]` (packed), meta fp16 `[num_blocks, block_size, kv_heads, 2]` = (scale, zero).
  - "fp8": e4m3 codes (as uint8) `[num_blocks, block_size, kv_heads, head_dim]`, meta fp32 `[kv_heads]`
    (per-head scales, calibrated offline with `kv_quant.fp8_head_scales`).

CUDA tensors run the Triton kernels (the quantizer fused in the KV writer, dequantization fused in the
attention inner loop); CPU tensors run torch references (quantize with `kv_quant`, dequantize the
blocks, then `paged_attention_torch`); `use_backend("triton")` forces the kernels (the interpreter on
CPU). Bad input raises CodesignError before any launch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from codesign.backend import resolve_backend
from codesign.kernels import kv_quant as kvq
from codesign.kernels.paged_attention import (
    NO_TREE,
    AttnMeta,
    alloc_lse,
    attention_backend,
    geometry_probe,
    on_gpu,
    paged_attention_torch,
    prepare_launch,
    triton_attention,
)
from codesign.kernels.paged_kv_cache import MAX_BLOCK_SIZE
from codesign.kernels.tree_attention import TreeBatch, _check_tree_batch
from codesign.specs import CodesignError, KVFormat, check_positive_int

FORMATS = {"int8": (1, 8), "int4": (1, 4), "int2": (1, 2), "fp8": (2, 8)}  # name -> (KV_FORMAT, bits)
WRITE_OP = "kv_write"
IN_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


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
        if kind == 2:
            for name, s in (("k_head_scale", k_head_scale), ("v_head_scale", v_head_scale)):
                if s is None:
                    raise CodesignError(f"fp8 caches need {name} (float32 [kv_heads])")
                kvq.check_head_scales(s, kv_heads)
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
        if self.fmt == "fp8":
            return KVFormat(dtype="fp8_e4m3", scheme="per_head")
        return KVFormat(dtype=self.fmt, scheme="per_token")

    def dequantize(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Debug / reference dequantization of the whole pool to float32 `[nb, bs, kv_heads, head_dim]`."""
        check_quant_cache(self)
        return tuple(
            _dequant(c, m, self.fmt) for c, m in ((self.k_codes, self.k_meta), (self.v_codes, self.v_meta))
        )


def check_pool_dims(num_blocks: int, block_size: int, kv_heads: int, head_dim: int) -> None:
    """A quantized cache's pool geometry: four positive ints (`empty()` of every format)."""
    for n, v in (("num_blocks", num_blocks), ("block_size", block_size), ("kv_heads", kv_heads)):
        check_positive_int(n, v)
    check_positive_int("head_dim", head_dim)


def check_cache_tensors(
    label: str, cache, want: dict[str, tuple[torch.dtype, tuple]], device: torch.device | None = None
) -> None:
    """Each `cache.<name>` is a contiguous tensor of the dtype and shape `want[name]` (and on `device`,
    if given); errors name the format (`label`) and the tensor (`check()` of every format)."""
    for name, (dt, shape) in want.items():
        t = getattr(cache, name)
        if (
            not isinstance(t, torch.Tensor)
            or t.dtype != dt
            or tuple(t.shape) != shape
            or not t.is_contiguous()
        ):
            raise CodesignError(
                f"{label} {name} must be a contiguous {dt} tensor of shape {shape}, got "
                f"{getattr(t, 'dtype', type(t))} {tuple(getattr(t, 'shape', ()))}"
            )
        if device is not None and t.device != device:
            raise CodesignError(f"{name} is on {t.device}, the codes on {device}")


def _format(fmt: str) -> tuple[int, int]:
    if fmt not in FORMATS:
        raise CodesignError(f"kv cache format must be one of {tuple(FORMATS)}, got {fmt!r}")
    return FORMATS[fmt]


def _dequant(codes: torch.Tensor, meta: torch.Tensor, fmt: str) -> torch.Tensor:
    kind, bits = FORMATS[fmt]
    if kind == 2:
        return kvq.dequantize_fp8(codes, meta)
    return kvq.dequantize_asym(kvq.unpack_codes(codes, bits), meta[..., 0].float(), meta[..., 1].float())


def check_quant_cache(cache: QuantPagedKV, fmt: str | None = None) -> tuple[int, int, int, int]:
    """Validate codes and metadata (and that the cache holds `fmt`, if given); (nb, bs, kv_heads, D)."""
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
    want = (torch.float32, (h,)) if kind == 2 else (torch.float16, (nb, bs, h, 2))
    for name in ("k_meta", "v_meta"):
        t = getattr(cache, name)
        if not isinstance(t, torch.Tensor) or t.dtype != want[0] or tuple(t.shape) != want[1]:
            raise CodesignError(
                f"{name} of a {cache.fmt} cache must be {want[0]} of shape {want[1]}, got "
                f"{getattr(t, 'dtype', type(t))} {tuple(getattr(t, 'shape', ()))}"
            )
        if not t.is_contiguous() or t.device != cache.k_codes.device:
            raise CodesignError(f"{name} must be contiguous and on the codes' device")
    if kind == 2:
        for name in ("k_meta", "v_meta"):
            kvq.check_head_scales(getattr(cache, name), h)
    return nb, bs, h, cache.head_dim


# --- quantize on write ----------------------------------------------------------------------------
def check_quant_write(
    key: torch.Tensor,
    value: torch.Tensor,
    cache_shape: tuple[int, int, int, int],
    device: torch.device,
    slot_mapping: torch.Tensor,
    check_data: bool,
    check_finite: bool,
) -> None:
    """The quantizing writers' shared checks: key / value dtypes, the plain writer's checks
    (`kv_write.check_kv_write`, slots with `check_data`) against a `geometry_probe` of the cache, and with
    `check_finite` (one host sync) that key and value are finite."""
    from codesign.kernels.kv_write import check_kv_write

    for name, t in (("key", key), ("value", value)):
        if not isinstance(t, torch.Tensor) or t.dtype not in IN_DTYPES:
            raise CodesignError(
                f"{name} dtype must be one of {IN_DTYPES}, got {getattr(t, 'dtype', type(t))}"
            )
    probe = geometry_probe(cache_shape, key.dtype, device)
    check_kv_write(key, value, probe, probe, slot_mapping, check_data)
    if check_finite and not (torch.isfinite(key).all() and torch.isfinite(value).all()):
        raise CodesignError("key and value must be finite to be quantized (NaN or inf found)")


def check_writer_dtype(key: torch.Tensor) -> None:
    """bf16 keys only on a GPU for the Triton writers: the interpreter computes bf16 on raw bits."""
    if key.dtype == torch.bfloat16 and not on_gpu(key):
        raise CodesignError("bf16 keys need a GPU for the Triton writer (the interpreter mishandles bf16)")


def _write_torch(key, value, k_codes, v_codes, k_meta, v_meta, slot_mapping, kind, bits) -> None:
    keep = slot_mapping >= 0
    s = slot_mapping[keep].to(torch.int64)
    for x, codes, meta in ((key[keep], k_codes, k_meta), (value[keep], v_codes, v_meta)):
        flat = codes.view(-1, *codes.shape[2:])
        if kind == 2:
            flat.index_copy_(0, s, kvq.quantize_fp8(x, meta))
            continue
        c, sc, zr = kvq.quantize_per_token(x, bits)
        flat.index_copy_(0, s, kvq.pack_codes(c, bits))
        meta.view(-1, *meta.shape[2:]).index_copy_(0, s, torch.stack([sc, zr], -1).to(torch.float16))


@torch.library.custom_op("codesign::kvq_write", mutates_args=("k_codes", "v_codes", "k_meta", "v_meta"))
def _kvq_write_op(
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
    if resolve_backend(WRITE_OP, key.device) == "triton":
        check_writer_dtype(key)
        from codesign.kernels.kv_write_triton import kv_write_triton

        kv_write_triton(key, value, k_codes, v_codes, slot_mapping, k_meta, v_meta, kind, bits)
    else:
        _write_torch(key, value, k_codes, v_codes, k_meta, v_meta, slot_mapping, kind, bits)


@_kvq_write_op.register_fake
def _(key, value, k_codes, v_codes, k_meta, v_meta, slot_mapping, kind, bits) -> None:
    return None


def kvq_write(
    key: torch.Tensor,
    value: torch.Tensor,
    cache: QuantPagedKV,
    slot_mapping: torch.Tensor,
    check_data: bool = True,
) -> None:
    """Quantize key/value `[tokens, kv_heads, head_dim]` straight into the cache slots (in place).

    Slot s = block * block_size + offset; -1 skips a token. The codes and scales written are bit
    for bit those of `kv_quant.quantize_per_token` / `quantize_fp8` (one writer launch per layer).
    `check_data` (one host sync) checks slots and that key/value are finite.
    """
    shape = check_quant_cache(cache)
    check_quant_write(key, value, shape, cache.k_codes.device, slot_mapping, check_data, check_data)
    kind, bits = FORMATS[cache.fmt]
    _kvq_write_op(
        key, value, cache.k_codes, cache.v_codes, cache.k_meta, cache.v_meta, slot_mapping, kind, bits
    )


# --- attention over the codes ---------------------------------------------------------------------
@torch.library.custom_op("codesign::paged_attention_kvq", mutates_args=())
def _attn_kvq_op(
    q: torch.Tensor,
    k_codes: torch.Tensor,
    v_codes: torch.Tensor,
    k_meta: torch.Tensor,
    v_meta: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    positions: torch.Tensor | None,
    tree_mask: torch.Tensor | None,
    mask_indptr: torch.Tensor | None,
    alibi_slopes: torch.Tensor | None,
    sm_scale: float,
    window: int,
    softcap: float,
    num_splits: int,
    is_decode: bool,
    return_lse: bool,
    kind: int,
    bits: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    meta = AttnMeta(block_tables, context_lens, cu_seqlens_q, positions, tree_mask, mask_indptr,
                    alibi_slopes, sm_scale, window, softcap, num_splits, is_decode)  # fmt: skip
    if attention_backend(q) == "torch":
        # CPU reference path: dequantize the pool, then plain attention.
        fmt = next(n for n, v in FORMATS.items() if v == (kind, bits))
        k, v = _dequant(k_codes, k_meta, fmt), _dequant(v_codes, v_meta, fmt)
        return paged_attention_torch(q, k, v, meta, return_lse)
    return triton_attention(q, k_codes, v_codes, meta, return_lse, kv_format=kind, bits=bits,
                            k_scale=k_meta, v_scale=v_meta)  # fmt: skip


@_attn_kvq_op.register_fake
def _(q, *rest):
    return torch.empty_like(q), alloc_lse(q, rest[-3])  # rest[-3]: return_lse


def prepare_attention(
    q: torch.Tensor,
    cache_shape: tuple[int, int, int, int],
    device: torch.device,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor | None,
    cu_seqlens_q: torch.Tensor | None,
    tree: TreeBatch | None,
    kw: dict,
) -> AttnMeta:
    """`prepare_launch` for a quantized cache of `cache_shape` on `device` (every format): its geometry is
    checked through a `geometry_probe`, so no dequantized copy is ever made.

    `tree` (a TreeBatch) replaces context_lens / cu_seqlens_q; otherwise cu_seqlens_q None means decode.
    kw: the entry point's keywords (`prepare_launch`'s opts).
    """
    if not isinstance(q, torch.Tensor):
        raise CodesignError(f"q must be a tensor, got {type(q).__name__}")
    probe = geometry_probe(cache_shape, q.dtype, device)
    tree_args = NO_TREE
    if tree is not None:
        if not isinstance(tree, TreeBatch):
            raise CodesignError(f"tree must be a TreeBatch (build_tree_batch), got {type(tree).__name__}")
        _check_tree_batch(tree, q, block_tables)
        context_lens, cu_seqlens_q, tree_args = tree.context_lens, tree.cu_seqlens_q, tree.mask_args
    return prepare_launch(q, probe, probe, block_tables, context_lens, cu_seqlens_q, tree_args, kw)


def attend_quant(
    launch: Callable[[torch.Tensor, object, AttnMeta, bool], tuple[torch.Tensor, torch.Tensor | None]],
    q: torch.Tensor,
    cache,
    cache_shape: tuple[int, int, int, int],
    block_tables: torch.Tensor,
    context_lens: torch.Tensor | None,
    cu_seqlens_q: torch.Tensor | None,
    tree: TreeBatch | None,
    kw: dict,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """The quantized-cache entry points' shared body (the cache already validated, `cache_shape` its
    geometry): `prepare_attention`, then `launch(q, cache, meta, return_lse)`, the format's op; out, or
    (out, lse) when kw["return_lse"]."""
    meta = prepare_attention(
        q, cache_shape, cache.k_codes.device, block_tables, context_lens, cu_seqlens_q, tree, kw
    )
    return_lse = bool(kw.get("return_lse", False))
    out, lse = launch(q, cache, meta, return_lse)
    return (out, lse) if return_lse else out


def launch_kvq(
    q: torch.Tensor, cache: QuantPagedKV, meta: AttnMeta, return_lse: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """The op over a validated cache with a launch's metadata (entry points and plan()/run() wrappers)."""
    kind, bits = FORMATS[cache.fmt]
    return _attn_kvq_op(q, cache.k_codes, cache.v_codes, cache.k_meta, cache.v_meta, *meta, return_lse,
                        kind, bits)  # fmt: skip


def _attend(q, cache, block_tables, context_lens, cu, tree, kw) -> torch.Tensor | tuple:
    shape = check_quant_cache(cache, kw.pop("fmt", None))
    return attend_quant(launch_kvq, q, cache, shape, block_tables, context_lens, cu, tree, kw)


def kvq_decode_attention(
    q: torch.Tensor, cache: QuantPagedKV, block_tables: torch.Tensor, context_lens: torch.Tensor, **kw
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """`paged_decode_attention` over a quantized cache (same keywords, plus `fmt=` to assert the format)."""
    return _attend(q, cache, block_tables, context_lens, None, None, kw)


def kvq_extend_attention(
    q: torch.Tensor,
    cache: QuantPagedKV,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    **kw,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """`paged_extend_attention` over a quantized cache."""
    return _attend(q, cache, block_tables, context_lens, cu_seqlens_q, None, kw)


def kvq_tree_attention(
    q: torch.Tensor, cache: QuantPagedKV, block_tables: torch.Tensor, tree: TreeBatch, **kw
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """`tree_attention` over a quantized cache."""
    return _attend(q, cache, block_tables, None, None, tree, kw)
