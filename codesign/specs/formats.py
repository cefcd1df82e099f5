"""Number formats in one place: element dtypes, weight formats, KV-cache formats.

Every format knows its storage cost *including metadata* (scales, zeros,
outlier entries), because the roofline, the accelerator models and the
mapper all count bytes from here. Example: int4 codes with an fp16 scale and
fp16 zero per group of 128 along K cost 4 + 32/128 = 4.25 bits per weight.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from codesign.specs.errors import CodesignError, check_choice, check_nonneg_int, check_positive_int

# Storage bits per element of each plain dtype. "df11" is the DFloat11-style
# lossless BF16 (entropy-coded exponent): its nominal cost; the real cost of a
# given tensor comes from its compressor and is carried in WeightFormat.avg_bits.
DTYPE_BITS: dict[str, int] = {
    "fp64": 64,
    "fp32": 32,
    "tf32": 32,
    "fp16": 16,
    "bf16": 16,
    "fp8_e4m3": 8,
    "fp8_e5m2": 8,
    "int32": 32,
    "int8": 8,
    "int4": 4,
    "int2": 2,
    "df11": 11,
}

FLOAT_DTYPES = ("fp64", "fp32", "tf32", "fp16", "bf16", "fp8_e4m3", "fp8_e5m2")
INT_DTYPES = ("int32", "int8", "int4", "int2")
ACT_DTYPES = ("fp32", "fp16", "bf16", "int8", "fp8_e4m3")
SCALE_DTYPES = ("fp32", "fp16", "bf16")
WEIGHT_DTYPES = ("fp32", "fp16", "bf16", "int8", "int4", "int2", "fp8_e4m3", "fp8_e5m2", "df11")
KV_DTYPES = ("fp32", "fp16", "bf16", "fp8_e4m3", "int8", "int4", "int2")
GROUP_SIZES = (32, 64, 128)  # None means per-channel (one group spans all of K)


def dtype_bits(name: str) -> int:
    """Storage bits of one element of dtype `name` (e.g. 'int4' -> 4)."""
    check_choice("dtype", name, DTYPE_BITS)
    return DTYPE_BITS[name]


def dtype_bytes(name: str) -> float:
    """Storage bytes of one element (fractional for sub-byte dtypes)."""
    return dtype_bits(name) / 8


def peak_key(dtype: str) -> str:
    """Which peak-throughput figure of a device a matmul in `dtype` runs at."""
    if dtype in ("fp8_e4m3", "fp8_e5m2"):
        return "fp8"
    if dtype in ("fp16", "bf16"):
        return "fp16"
    if dtype in ("int8", "int4", "int2"):
        return "int8"
    if dtype == "tf32":
        return "tf32"
    return "fp32"


@dataclass(frozen=True)
class WeightFormat:
    """How a weight matrix [N, K] is stored.

    dtype: element format of the codes. group_size: K-elements sharing one scale
    (32/64/128), or None for per-channel (one scale per output row). symmetric:
    no zero point. scale_dtype: dtype of scales and zeros. avg_bits: for
    entropy-coded formats ("df11") the measured bits per weight, if known.
    Float formats fp16/bf16/fp32 carry no metadata; fp8 carries one scale per
    output channel (group_size None) or one per tensor (group_size = -1).
    """

    dtype: str = "fp16"
    group_size: int | None = None
    symmetric: bool = True
    scale_dtype: str = "fp16"
    avg_bits: float | None = None

    def __post_init__(self) -> None:
        check_choice("weight dtype", self.dtype, WEIGHT_DTYPES)
        check_choice("scale_dtype", self.scale_dtype, SCALE_DTYPES)
        if self.group_size is not None and self.group_size != -1:
            check_choice("group_size", self.group_size, GROUP_SIZES + (None, -1))
        if self.avg_bits is not None and not (0 < self.avg_bits <= 32):
            raise CodesignError(f"avg_bits must be in (0, 32], got {self.avg_bits!r}")

    @property
    def quantized(self) -> bool:
        """True when the codes carry scales (int and fp8 formats)."""
        return self.dtype in INT_DTYPES or self.dtype.startswith("fp8")

    @property
    def name(self) -> str:
        if not self.quantized:
            return self.dtype
        g = "pc" if self.group_size is None else ("pt" if self.group_size == -1 else f"g{self.group_size}")
        return f"{self.dtype}-{g}-{'sym' if self.symmetric else 'asym'}"

    def code_bits(self) -> float:
        if self.dtype == "df11" and self.avg_bits is not None:
            return self.avg_bits
        return float(DTYPE_BITS[self.dtype])

    def metadata_bytes(self, n: int, k: int) -> float:
        """Bytes of scales (+ zeros) for an [n, k] matrix."""
        if not self.quantized:
            return 0.0
        per_scale = dtype_bytes(self.scale_dtype) * (1 if self.symmetric else 2)
        if self.group_size == -1:
            return per_scale
        groups_per_row = 1 if self.group_size is None else math.ceil(k / self.group_size)
        return n * groups_per_row * per_scale

    def total_bytes(self, n: int, k: int) -> float:
        """Bytes to store an [n, k] weight matrix in this format, metadata included."""
        return n * k * self.code_bits() / 8 + self.metadata_bytes(n, k)

    def bits_per_element(self, k: int | None = None) -> float:
        """Average bits per weight including metadata (k needed only for per-channel)."""
        if not self.quantized:
            return self.code_bits()
        if self.group_size in (None, -1):
            if k is None:
                return self.code_bits()
            return self.total_bytes(1, k) * 8 / k
        return (
            self.code_bits() + dtype_bits(self.scale_dtype) * (1 if self.symmetric else 2) / self.group_size
        )

    @classmethod
    def parse(cls, text: str) -> WeightFormat:
        """Parse 'fp16', 'int4-g128', 'int4-g128-asym', 'int8-pc', 'fp8_e4m3', 'df11'."""
        parts = text.lower().replace("_asym", "-asym").split("-")
        dtype = parts[0]
        check_choice("weight format", dtype, WEIGHT_DTYPES)
        group: int | None = None
        symmetric = True
        for p in parts[1:]:
            if p == "asym":
                symmetric = False
            elif p == "sym":
                symmetric = True
            elif p == "pc":
                group = None
            elif p == "pt":
                group = -1
            elif p.startswith("g") and p[1:].isdigit():
                group = int(p[1:])
            else:
                raise CodesignError(
                    f"weight format {text!r}: unknown part {p!r}; expected e.g. int4-g128-asym, int8-pc, fp16"
                )
        return cls(dtype=dtype, group_size=group, symmetric=symmetric)


KV_SCHEMES = ("none", "per_token", "per_head", "kivi", "oaken", "mixed")
KV_OAKEN_META = ("token", "offline")


@dataclass(frozen=True)
class KVFormat:
    """How the paged KV cache stores keys and values.

    scheme:
      - "none": plain fp16/bf16/fp32 (dtype).
      - "per_head": fp8 e4m3 with one fp32 scale per (layer, kv head) (negligible per token).
      - "per_token": int codes with scale (+ zero) per token per head over head_dim.
      - "kivi": keys per channel over groups of `group_size` tokens, values per token
        over groups of `group_size` elements of head_dim; the newest `residual`
        tokens stay in fp16 until a group fills.
      - "oaken": dense inner codes after group-shift (scale + lower bound per token
        per head), plus sparse outlier slots: `outlier_fraction` is the slot capacity
        per (block, kv head) as a fraction of its elements (not the measured outlier
        rate), each slot `outlier_bits` (fp16 value + 16-bit in-block position).
        meta="token": fp16 scale + lower bound per token per head (2 x scale_dtype);
        meta="offline": two 8-bit codes per token per head on a per-(layer, kv head) grid calibrated
        offline (`kernels.kvcache.quantizers.calibrate_oaken_grid`; the grid, like the thresholds, is per
        layer and not counted per token).
      - "mixed": per-chunk mixed precision (Cocktail-style): each paged block holds INT8, INT4 or INT2
        per-token codes with a (scale, zero) per token per head. Rows are sized for the widest code, so
        dtype is "int8" and the bits are counted as int8 per token (the pool's capacity; the traffic of a
        narrower block is less).
    """

    dtype: str = "fp16"
    scheme: str = "none"
    group_size: int = 32
    residual: int = 0
    scale_dtype: str = "fp16"
    outlier_fraction: float = 0.0
    outlier_bits: int = 32  # fp16 value + 16-bit position inside the block (kernels.kvcache.oaken layout)
    meta: str = "token"  # oaken only: "token" (fp16 scale + shift) or "offline" (8-bit z, r on a grid)

    def __post_init__(self) -> None:
        check_choice("kv dtype", self.dtype, KV_DTYPES)
        check_choice("kv scheme", self.scheme, KV_SCHEMES)
        check_positive_int("kv group_size", self.group_size)
        check_nonneg_int("kv residual", self.residual)
        check_choice("kv scale_dtype", self.scale_dtype, SCALE_DTYPES)
        if not (0.0 <= self.outlier_fraction < 1.0):
            raise CodesignError(f"outlier_fraction must be in [0, 1), got {self.outlier_fraction!r}")
        plain = self.dtype in ("fp32", "fp16", "bf16")
        if plain and self.scheme != "none":
            raise CodesignError(f"kv dtype {self.dtype} takes scheme 'none', got {self.scheme!r}")
        if not plain and self.scheme == "none":
            raise CodesignError(f"kv dtype {self.dtype} needs a quantization scheme, one of {KV_SCHEMES[1:]}")
        if self.dtype.startswith("fp8") and self.scheme != "per_head":
            raise CodesignError(f"fp8 KV uses scheme 'per_head', got {self.scheme!r}")
        if self.scheme == "oaken" and self.dtype not in ("int4", "int2", "int8"):
            raise CodesignError("the oaken scheme needs an int dtype (int8, int4, int2)")
        if self.scheme == "mixed" and self.dtype != "int8":
            raise CodesignError(f"the mixed scheme stores rows sized for int8 (dtype 'int8'), got {self.dtype!r}")
        check_choice("kv meta", self.meta, KV_OAKEN_META)
        if self.meta != "token" and self.scheme != "oaken":
            raise CodesignError(
                f"kv meta {self.meta!r} applies to the oaken scheme only, got {self.scheme!r}"
            )

    @property
    def quantized(self) -> bool:
        return self.scheme != "none"

    @property
    def name(self) -> str:
        if self.scheme == "none":
            return self.dtype
        if self.meta == "offline":
            return f"{self.dtype}-oaken_offline"
        return f"{self.dtype}-{self.scheme}"

    def bits_per_element(self, head_dim: int) -> float:
        """Average stored bits per K or V element, metadata included (residual window ignored)."""
        check_positive_int("head_dim", head_dim)
        code = float(DTYPE_BITS[self.dtype])
        meta_pair = 2 * dtype_bits(self.scale_dtype)  # scale + zero (or lower bound)
        if self.scheme in ("none", "per_head"):
            return code
        if self.scheme in ("per_token", "mixed"):
            return code + meta_pair / head_dim
        if self.scheme == "kivi":
            # K: per channel over group_size tokens; V: per token over group_size elements.
            # Average over K and V.
            k_bits = code + meta_pair / self.group_size
            v_bits = code + meta_pair / min(self.group_size, head_dim)
            return (k_bits + v_bits) / 2
        # oaken: dense codes + per-token-per-head scale/shift (fp16 pair, or two 8-bit grid codes) + the
        # sparse outlier slots.
        meta = 16 if self.meta == "offline" else meta_pair
        return code + meta / head_dim + self.outlier_fraction * self.outlier_bits

    def bytes_per_token(self, num_kv_heads: int, head_dim: int, *, latent: bool = False) -> float:
        """Bytes of K and V together for one token of one layer; `latent`: one cached vector a head whose
        leading channels are the values (MLA's compressed cache), not a K and a V."""
        check_positive_int("num_kv_heads", num_kv_heads)
        return (1 if latent else 2) * num_kv_heads * head_dim * self.bits_per_element(head_dim) / 8

    @classmethod
    def parse(cls, text: str) -> KVFormat:
        """Parse 'fp16', 'bf16', 'fp8', 'int8', 'int4-kivi', 'int2-kivi', 'int4-oaken', 'int4-oaken_offline',
        'int8-per_token', 'mixed' (or 'int8-mixed')."""
        t = text.lower()
        if t in ("fp32", "fp16", "bf16"):
            return cls(dtype=t)
        if t == "mixed":
            return cls(dtype="int8", scheme="mixed")
        if t in ("fp8", "fp8_e4m3"):
            return cls(dtype="fp8_e4m3", scheme="per_head")
        dtype, _, scheme = t.partition("-")
        if dtype not in ("int8", "int4", "int2"):
            raise CodesignError(
                f"kv format {text!r}: expected fp16, bf16, fp32, fp8, or int8/int4/int2 with "
                f"-kivi, -oaken, -oaken_offline or -per_token, or mixed"
            )
        scheme = scheme or "per_token"
        if scheme == "oaken_offline":
            # kernels.kvcache.accuracy's default: 2 slots per (16-token block, kv head) of head_dim 32.
            return cls(dtype=dtype, scheme="oaken", outlier_fraction=2 / 512, meta="offline")
        check_choice("kv scheme", scheme, KV_SCHEMES[2:] + ("per_token",))
        if scheme == "oaken":
            return cls(dtype=dtype, scheme="oaken", outlier_fraction=0.04)
        if scheme == "kivi":
            return cls(dtype=dtype, scheme="kivi", group_size=32, residual=32)
        return cls(dtype=dtype, scheme=scheme)
