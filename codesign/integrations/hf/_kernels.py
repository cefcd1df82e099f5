"""Every kernel internal the Hugging Face integration uses, imported in this one place.

The kernel modules are being regrouped into families (gemm, df11, kvcache, attention); when their paths
move, only these imports change.
"""

from __future__ import annotations

from codesign.kernels import kv_quant as kvq
from codesign.kernels.df11_linear import LosslessBF16Config, LosslessBF16Linear, compress_model_
from codesign.kernels.kv_quant_kivi import (
    KiviPagedKV,
    kivi_decode_attention,
    kivi_extend_attention,
    kivi_tree_attention,
)
from codesign.kernels.kv_quant_mixed import (
    MIXED_BITS,
    MixedPagedKV,
    cocktail_bits,
    mixed_attention,
    mixed_write,
)
from codesign.kernels.kv_quant_oaken import OakenPagedKV, oaken_attention
from codesign.kernels.kv_quant_paged import (
    QuantPagedKV,
    kvq_decode_attention,
    kvq_extend_attention,
    kvq_tree_attention,
    kvq_write,
)
from codesign.kernels.kv_write import kv_write
from codesign.kernels.kvq_accuracy import (
    KIVI_GROUP,
    KIVI_RESIDUAL,
    MIXED_RECENT,
    OAKEN_FRACTION,
    OAKEN_OFFLINE_CAP,
    OAKEN_OFFLINE_FRACTION,
    OAKEN_SLOTS,
)
from codesign.kernels.paged_attention import paged_decode_attention, paged_extend_attention
from codesign.kernels.paged_kv_cache import MAX_BLOCK_SIZE, PagedKVCache
from codesign.kernels.quant_formats import QuantizedWeight
from codesign.kernels.quant_import import from_awq, from_gptq
from codesign.kernels.quant_linear import (
    FP8Config,
    QuantLinear,
    W4A16Config,
    W8A8Config,
    W8A16Config,
    quantize_,
)
from codesign.kernels.tree_attention import (
    TreeBatch,
    build_tree_batch,
    check_parents,
    tree_attention,
    tree_depths,
    verify_tree,
)

__all__ = [
    "FP8Config", "KIVI_GROUP", "KIVI_RESIDUAL", "KiviPagedKV", "LosslessBF16Config", "LosslessBF16Linear",
    "MAX_BLOCK_SIZE", "MIXED_BITS", "MIXED_RECENT", "MixedPagedKV", "OAKEN_FRACTION", "OAKEN_OFFLINE_CAP",
    "OAKEN_OFFLINE_FRACTION", "OAKEN_SLOTS", "OakenPagedKV", "PagedKVCache", "QuantLinear", "QuantPagedKV",
    "QuantizedWeight", "TreeBatch", "W4A16Config", "W8A8Config", "W8A16Config", "build_tree_batch",
    "check_parents", "cocktail_bits", "compress_model_", "from_awq", "from_gptq", "kivi_decode_attention",
    "kivi_extend_attention", "kivi_tree_attention", "kv_write", "kvq", "kvq_decode_attention",
    "kvq_extend_attention", "kvq_tree_attention", "kvq_write", "mixed_attention", "mixed_write",
    "oaken_attention", "paged_decode_attention", "paged_extend_attention", "quantize_", "tree_attention",
    "tree_depths", "verify_tree",
]  # fmt: skip
