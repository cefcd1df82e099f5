"""The one KV-format vocabulary of the kernels: the operator spec's `KVFormat`, and what each part derives from it.

`codesign.specs.KVFormat` says how a cache stores K and V (plain, per-token INT8/4/2, per-head FP8, KIVI,
Oaken with either metadata variant, per-chunk mixed precision). The kernels derive from it:

  * `kernel_format(fmt)` -> (KV_FORMAT code, BITS): the constexprs the writer and attention kernels branch on;
  * `table_suffix(code, bits)`: their tuned tables, "paged_attention_<suffix>" and "kv_write_<suffix>";
  * `KVQ_FORMATS`: the names of the per-token / per-head cache (`kvcache.kvq.QuantPagedKV.fmt`);
  * `ATTENTION_TABLE_FORMATS`, `WRITE_TABLE_FORMATS`: the formats with a tuned table of their own, as the
    tuner's adapters register them and the GPU suite runs them.

Each cache type reports its `KVFormat` (`kv_format`); this module imports nothing but the specs, so the
tuner and the GPU suite read it without defining a kernel.
"""

from __future__ import annotations

from codesign.specs import CodesignError, KVFormat, dtype_bits

# The kernels' KV_FORMAT constexpr: how a tile of K or V is stored (layouts in `attention.triton_attention`).
KV_FORMAT_PLAIN = 0  # fp16 / bf16 / fp32 values
KV_FORMAT_INT = 1  # per-token INT8/4/2 codes with (scale, zero)
KV_FORMAT_FP8 = 2  # e4m3 codes, one scale per kv head
KV_FORMAT_KIVI = 3
KV_FORMAT_MIXED = 4
KV_FORMAT_OAKEN = 5  # fp16 (scale, lower bound) per token
KV_FORMAT_OAKEN_OFFLINE = 6  # 8-bit (z, r) per token on an offline grid

_CODE_BY_SCHEME = {
    "none": KV_FORMAT_PLAIN,
    "per_token": KV_FORMAT_INT,
    "per_head": KV_FORMAT_FP8,
    "kivi": KV_FORMAT_KIVI,
    "mixed": KV_FORMAT_MIXED,
    "oaken": KV_FORMAT_OAKEN,
}
_SUFFIX_BY_CODE = {
    KV_FORMAT_FP8: "fp8",
    KV_FORMAT_KIVI: "kivi",
    KV_FORMAT_MIXED: "mixed",
    KV_FORMAT_OAKEN: "oaken",
    KV_FORMAT_OAKEN_OFFLINE: "oaken",  # one table for both metadata variants
}
PLAIN_BITS = 16  # BITS of a plain cache (unused by the kernels)


def kernel_format(fmt: KVFormat) -> tuple[int, int]:
    """(KV_FORMAT code, BITS) of a cache stored as `fmt`; mixed precision's BITS is its widest code (8)."""
    if not isinstance(fmt, KVFormat):
        raise CodesignError(f"expected a KVFormat, got {type(fmt).__name__}")
    code = _CODE_BY_SCHEME[fmt.scheme]
    if code == KV_FORMAT_OAKEN and fmt.meta == "offline":
        code = KV_FORMAT_OAKEN_OFFLINE
    return code, PLAIN_BITS if code == KV_FORMAT_PLAIN else dtype_bits(fmt.dtype)


def table_suffix(code: int, bits: int) -> str | None:
    """The tuned-table suffix of a cache format ("int4", "fp8", "kivi", "mixed", "oaken"); None for plain caches,
    whose tables carry the bare op name."""
    if code == KV_FORMAT_PLAIN:
        return None
    return _SUFFIX_BY_CODE.get(code) or f"int{bits}"


def format_suffix(fmt: KVFormat) -> str | None:
    """`table_suffix` of a spec format."""
    return table_suffix(*kernel_format(fmt))


# The per-token INT and per-head FP8 cache's formats, by the names `QuantPagedKV.fmt` takes.
KVQ_FORMATS: dict[str, KVFormat] = {name: KVFormat.parse(name) for name in ("int8", "int4", "int2", "fp8")}
# Formats with a tuned attention table (KIVI, Oaken and mixed at the widths the tuner measures: their table
# does not depend on the width) and with a tuned writer table.
ATTENTION_TABLE_FORMATS: tuple[str, ...] = tuple(
    format_suffix(f) for f in (*KVQ_FORMATS.values(), KVFormat.parse("mixed"), KVFormat.parse("int4-kivi"),
                               KVFormat.parse("int4-oaken"))
)  # fmt: skip
WRITE_TABLE_FORMATS: tuple[str, ...] = tuple(format_suffix(f) for f in KVQ_FORMATS.values())
