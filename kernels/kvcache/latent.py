"""The latent cache's writer (DeepSeek-V2/V3, vLLM's `concat_and_cache_mla`): `codesign::latent_write`.

    for each t with slot = slot_mapping[t] >= 0:
        latent_cache[slot // block_size, slot % block_size] = cat(kv_c[t], k_pe[t])      (as stored: q's dtype)
        ... = e4m3(clamp(cat(kv_c[t], k_pe[t]) / kv_scale, +-448))                       (an e4m3 cache)

kv_c is the normalised latent `[tokens, latent]`, k_pe the rotated key `[tokens, rope]`; the cache is what
`attention.latent.latent_decode_attention` reads. The e4m3 codes are rounded half to even on both backends (the
same bytes: torch's cast and the kernel's integer rounding). CUDA tensors run the Triton kernel, CPU tensors
torch; `use_backend("triton")` forces the kernel (the interpreter on CPU).
"""

from __future__ import annotations

import torch

from codesign.backend import device_view, resolve_backend
from codesign.kernels.host_math import next_pow2
from codesign.kernels.kvcache.checks import MAX_BLOCK_SIZE, check_positive_real, check_slot_mapping
from codesign.specs import CodesignError, KVFormat, KVWrite

OP = "kv_write"  # the backend choice's op name, shared with the plain writer
DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_NAMES = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}  # (KVFormat's dtype names)
FP8 = torch.float8_e4m3fn


def check_latent_cache(cache, dtype: torch.dtype, dtype_of: str) -> tuple[int, int, int]:
    """A latent cache `[num_blocks, block_size, latent + rope]` in `dtype` (the dtype of `dtype_of`, named in the
    message) or e4m3; its (num_blocks, block_size, width). The writer's and the decode attention's check."""
    if not isinstance(cache, torch.Tensor) or cache.dim() != 3 or cache.stride(-1) != 1:
        raise CodesignError("latent_cache must be a 3-D tensor [num_blocks, block_size, latent + rope], contiguous "
                            "along its last dimension")  # fmt: skip
    if cache.dtype not in (dtype, FP8):
        raise CodesignError(f"latent_cache dtype must be {dtype_of}'s ({dtype}) or {FP8}, got {cache.dtype}")
    nb, bs, width = cache.shape
    if not (1 <= bs <= MAX_BLOCK_SIZE):
        raise CodesignError(f"block_size (latent_cache.shape[1]) must be in [1, {MAX_BLOCK_SIZE}], got {bs}")
    return nb, bs, width


def check_latent_scale(cache_dtype: torch.dtype, kv_scale) -> None:
    """kv_scale: an e4m3 cache's one scale (required, positive, finite); None for any other cache."""
    if cache_dtype == FP8:
        check_positive_real("kv_scale", kv_scale, "(an e4m3 cache's scale)")
    elif kv_scale is not None:
        raise CodesignError(f"kv_scale is for an e4m3 cache; this one is {cache_dtype} (pass None)")


def latent_kv_format(cache: torch.Tensor) -> KVFormat:
    """The KV format of a latent cache tensor: its float dtype, or fp8 (e4m3, one scale)."""
    return KVFormat.parse("fp8") if cache.dtype == FP8 else KVFormat(dtype=_NAMES[cache.dtype])


def _check(kv_c, k_pe, cache, slot_mapping, kv_scale, check_data) -> None:
    for name, t in (("kv_c", kv_c), ("k_pe", k_pe), ("slot_mapping", slot_mapping)):
        if not isinstance(t, torch.Tensor):
            raise CodesignError(f"{name} must be a tensor, got {type(t).__name__}")
    for name, t in (("kv_c", kv_c), ("k_pe", k_pe)):
        if t.dim() != 2 or t.shape[0] != kv_c.shape[0] or t.shape[1] < 1 or t.stride(-1) != 1:
            raise CodesignError(f"{name} must be [tokens, width] (one row a token for both), contiguous along its "
                                f"width; got {tuple(t.shape)}")  # fmt: skip
        if t.dtype not in DTYPES or t.dtype != kv_c.dtype:
            raise CodesignError(f"{name} dtype must be one of {DTYPES} and both the same, got {t.dtype}")
    nb, bs, width = check_latent_cache(cache, kv_c.dtype, "kv_c")
    for name, t in (("kv_c", kv_c), ("k_pe", k_pe)):
        if t.device != cache.device:
            raise CodesignError(f"{name} is on {t.device} but the cache is on {cache.device}")
    if kv_c.shape[1] + k_pe.shape[1] != width:
        raise CodesignError(f"kv_c's {kv_c.shape[1]} + k_pe's {k_pe.shape[1]} channels != the cache's {width}")
    check_latent_scale(cache.dtype, kv_scale)
    check_slot_mapping(slot_mapping, kv_c.shape[0], nb * bs, cache.device, check_data)


def latent_write(
    kv_c: torch.Tensor,
    k_pe: torch.Tensor,
    latent_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    kv_scale: float | None = None,
    check_data: bool = True,
) -> None:
    """Write each token's latent and rotary key into its slot of `latent_cache` (in place); an e4m3 cache takes
    their codes over `kv_scale` (required for one, refused otherwise). `check_data`: the slot checks (one host
    sync: range, -1 skips, no slot twice)."""
    _check(kv_c, k_pe, latent_cache, slot_mapping, kv_scale, check_data)
    torch.ops.codesign.latent_write(kv_c, k_pe, latent_cache, slot_mapping, float(kv_scale or 1.0))


@torch.library.custom_op("codesign::latent_write", mutates_args=("cache",))
def _latent_write_op(
    kv_c: torch.Tensor, k_pe: torch.Tensor, cache: torch.Tensor, slot_mapping: torch.Tensor, kv_scale: float
) -> None:
    latent_write_body(kv_c, k_pe, cache, slot_mapping, kv_scale)


def latent_write_body(kv_c, k_pe, cache, slot_mapping, kv_scale: float) -> None:
    """The op's body, without torch's dispatcher or any check: for an eager caller repeating a geometry it passed
    through `latent_write` already (the layers after a forward's first). kv_scale 1.0 for a cache that has none."""
    if resolve_backend(OP, kv_c.device) == "torch":
        _latent_write_torch(kv_c, k_pe, cache, slot_mapping, kv_scale)
        return
    if torch.bfloat16 in (kv_c.dtype, cache.dtype) and not device_view(kv_c.device).compiled:
        raise CodesignError("bf16 latent writes with the Triton backend need a GPU (the interpreter mishandles bf16)")
    _latent_write_triton(kv_c, k_pe, cache, slot_mapping, kv_scale)


@_latent_write_op.register_fake
def _(kv_c, k_pe, cache, slot_mapping, kv_scale) -> None:
    return None


def _latent_write_torch(kv_c, k_pe, cache, slot_mapping, kv_scale: float) -> None:
    keep = slot_mapping >= 0
    x = torch.cat([kv_c[keep], k_pe[keep]], dim=1)
    flat = cache.view(-1, cache.shape[2])
    if cache.dtype == FP8:  # torch's cast rounds half to even; clamp first (it does not saturate)
        x = (x.float() / kv_scale).clamp(-448.0, 448.0).to(FP8).view(torch.uint8)
        flat = flat.view(torch.uint8)  # (index_copy_ has no e4m3 kernel: the same bytes as uint8)
    flat.index_copy_(0, slot_mapping[keep].to(torch.int64), x)


def _latent_write_triton(kv_c, k_pe, cache, slot_mapping, kv_scale: float) -> None:
    from codesign.kernels.kvcache.triton_latent_write import _latent_write_kernel

    t = kv_c.shape[0]
    if t == 0:
        return
    fp8 = cache.dtype == FP8
    lat, rope = kv_c.shape[1], k_pe.shape[1]
    _latent_write_kernel[(t,)](
        kv_c, k_pe, cache.view(torch.uint8) if fp8 else cache, slot_mapping, kv_scale,
        lat, rope, kv_c.stride(0), k_pe.stride(0), cache.stride(0), cache.stride(1),
        BLOCK_SIZE=cache.shape[1], LATENT_PAD=next_pow2(lat), ROPE_PAD=next_pow2(rope), FP8=fp8,
    )  # fmt: skip


def latent_write_spec(kv_c: torch.Tensor, k_pe: torch.Tensor, latent_cache: torch.Tensor) -> KVWrite:
    """The call's operator spec: the dataflow graph's kv_write node of an MLA model."""
    fmt = latent_kv_format(latent_cache)
    return KVWrite(kv_c.shape[0], 1, latent_cache.shape[2], fmt, src_dtype=_NAMES[kv_c.dtype], latent=True)
