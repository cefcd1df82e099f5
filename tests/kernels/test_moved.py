"""The module names of codesign.kernels before its four families still import, warn once, and give the same
objects as the new modules (`codesign.kernels._moved`); a name that is gone says so."""

from __future__ import annotations

import importlib
import inspect
import sys
import warnings

import pytest

import codesign.kernels as kernels
from codesign.kernels import _moved

# Every public name each old module defined (at ebbe96d, before the move).
OLD_NAMES = {
    "df11_codec": (
        "FORMAT_VERSION MAGIC MAX_CODE_LEN_LIMIT DEFAULT_MAX_CODE_LEN DEFAULT_CHUNK_BYTES "
        "DEFAULT_CHUNKS_PER_GROUP LUT_SIZE limited_code_lengths canonical_codes check_code_lengths "
        "build_luts lut_levels DF11Tensor split_bf16 compress decode_arrays decompress_bits decompress "
        "df11_weight_format exponent_entropy"
    ),
    "df11_gemm": (
        "OP DEFAULT_SEGMENT DEFAULT_CONFIG segment_index gemm_config df11_gemm_triton launch_grid "
        "lower_for_gpu"
    ),
    "df11_linear": (
        "OP LINEAR_OP FUSED_MAX_M LosslessBF16Config PackedDF11 df11_gemv df11_gemm choose_path "
        "df11_linear DecodeWorkspace LosslessBF16Linear compress_model_ model_weight_format"
    ),
    "df11_triton": (
        "DECODE_OP GEMV_OP DEFAULT_NUM_WARPS DF11Stream launch_config df11_decode_triton df11_gemv_triton "
        "lower_for_gpu"
    ),
    "kv_quant": (
        "INT_BITS FP8_MAX check_bits quantize_asym dequantize_asym pack_codes unpack_codes "
        "quantize_per_token fake_quant_per_token fp8_head_scales check_head_scales quantize_fp8 "
        "dequantize_fp8 kivi_split kivi_fake_quant calibrate_kv_thresholds check_thresholds OakenBlock "
        "oaken_capacity oaken_quantize_block FP16_MAX GRID_LEVELS calibrate_oaken_grid check_grid "
        "offline_meta grid_clamp oaken_offline_quantize_block oaken_dequantize_block oaken_fake_quant "
        "layout_bits_per_element"
    ),
    "kv_quant_dispatch": "QUANT_CACHE_TYPES QuantCacheInfo is_quant_cache signature describe check_plan launch",
    "kv_quant_kivi": (
        "RES_DTYPES KiviPagedKV check_rings launch_kivi kivi_decode_attention kivi_extend_attention "
        "kivi_tree_attention"
    ),
    "kv_quant_kivi_triton": "triton_flush_supported kivi_flush_triton",
    "kv_quant_mixed": "MIXED_BITS MixedPagedKV cocktail_bits mixed_write launch_mixed mixed_attention",
    "kv_quant_oaken": "OakenPagedKV default_capacity launch_oaken oaken_attention",
    "kv_quant_paged": (
        "FORMATS WRITE_OP IN_DTYPES QuantPagedKV check_pool_dims check_cache_tensors check_quant_cache "
        "check_quant_write check_writer_dtype kvq_write prepare_attention attend_quant launch_kvq "
        "kvq_decode_attention kvq_extend_attention kvq_tree_attention"
    ),
    "kv_write": "OP check_kv_write kv_write",
    "kv_write_oaken_triton": "triton_writer_supported oaken_write_triton",
    "kv_write_triton": "KV_FORMAT_PLAIN KV_FORMAT_INT KV_FORMAT_FP8 RINT_MAGIC kv_write_triton table_op launch_config",
    "kvq_accuracy": (
        "KIVI_GROUP KIVI_RESIDUAL OAKEN_FRACTION OAKEN_SLOTS OAKEN_BLOCK OAKEN_OFFLINE_FRACTION "
        "OAKEN_OFFLINE_CAP MIXED_CHUNK MIXED_RECENT Layer FormatRow attention formats "
        "oaken_offline_formats int4_study_formats evaluate synthetic_layers CALIB_TEXT EVAL_TEXT "
        "minilm_available minilm_layers format_table"
    ),
    "kvq_accuracy_cli": "add_arguments run",
    "paged_attention": (
        "OP Q_DTYPES SPEC_DTYPES check_attention_inputs on_gpu check_backend_dtype attention_backend "
        "AttnMeta NO_TREE alloc_lse attention_per_sequence paged_attention_torch triton_attention "
        "auto_num_splits geometry_probe ATTENTION_OPTIONS prepare_launch attend_plain "
        "paged_decode_attention paged_extend_attention PagedDecodeWrapper PagedExtendWrapper"
    ),
    "paged_attention_triton": (
        "OP KV_FORMAT_PLAIN KV_FORMAT_INT KV_FORMAT_FP8 KV_FORMAT_KIVI KV_FORMAT_MIXED KV_FORMAT_OAKEN "
        "KV_FORMAT_OAKEN_OFFLINE F16_MMA_FORMATS MASK_CAUSAL MASK_TREE LOG2E MIN_TOKENS_PER_SPLIT "
        "MAX_SPLITS DEFAULT_CONFIG DEFAULT_SMEM_BUDGET SUBBYTE_TILE_ELEMS TREE_MAX_BLOCK_N TREE_MIN_WARPS "
        "OAKEN_SC num_sms choose_num_splits default_config reads_words WORDS8_DEFAULT mixed_reads_words "
        "table_op launch_config hw_fp8 tree_config tile_blocks dim_pad rows_layout paged_attention_triton"
    ),
    "paged_kv_cache": (
        "KV_DTYPES MAX_BLOCK_SIZE BlockAllocator PagedKVCache check_kv_cache check_int_tensor "
        "check_block_tables"
    ),
    "quant_formats": (
        "BITS GROUP_SIZES FP8_MAX pack_factor pack_codes unpack_codes QuantizedWeight "
        "validate_quantized_weight quantize_rtn dequantize quantize_per_token"
    ),
    "quant_gemm": (
        "check_wq_args w4a16_gemm w8a16_gemm quantize_per_token_int8 quantize_per_token_fp8 w8a8_gemm "
        "fp8_gemm quant_matmul"
    ),
    "quant_gemm_cupy": "SOURCE KERNEL_NAME MAX_M THREADS TARGET_BLOCKS compile_ptx w4a16_gemv",
    "quant_gemm_triton": "SMALL_M_MAX choose_variant launch_config wq_gemm quantize_per_token scaled_mm",
    "quant_import": "AWQ_ORDER from_gptq from_awq",
    "quant_linear": "W4A16Config W8A16Config W8A8Config FP8Config QuantConfig QuantLinear quantize_",
    "tree_attention": (
        "check_parents tree_depths tree_mask parents_from_mask TreeBatch build_tree_batch tree_attention "
        "TreeAttentionWrapper TreeVerifyResult verify_tree"
    ),
}


def _fresh_import(old: str):
    sys.modules.pop(f"codesign.kernels.{old}", None)
    return importlib.import_module(f"codesign.kernels.{old}")


def test_every_old_module_is_mapped():
    assert set(OLD_NAMES) == set(_moved.MOVED)


@pytest.mark.parametrize("old", sorted(OLD_NAMES))
def test_old_module_imports_with_a_warning_and_gives_the_same_objects(old):
    with pytest.warns(DeprecationWarning, match=f"codesign.kernels.{old} has moved"):
        mod = _fresh_import(old)
    homes = [importlib.import_module(m) for m in _moved.new_modules(old)]
    for name in OLD_NAMES[old].split():
        if f"{old}.{name}" in _moved.REMOVED:
            with pytest.raises(AttributeError, match="was removed"):
                getattr(mod, name)
            continue
        obj = getattr(mod, name)
        home = next(h for h in homes if hasattr(h, name))
        assert obj is getattr(home, name), f"{old}.{name}"
        if inspect.isfunction(obj) or inspect.isclass(obj):
            assert obj.__module__ in _moved.new_modules(old), f"{old}.{name} defined in {obj.__module__}"
    with pytest.raises(AttributeError, match="has no attribute"):
        mod.no_such_name  # noqa: B018


def test_removed_names_belong_to_old_modules():
    for key in _moved.REMOVED:
        old, name = key.split(".")
        assert name in OLD_NAMES[old].split(), key


def test_from_import_of_an_old_module_and_its_names():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        from codesign.kernels import quant_gemm  # noqa: F401
        from codesign.kernels.paged_attention import paged_decode_attention
    from codesign.kernels.attention.paged import paged_decode_attention as new

    assert paged_decode_attention is new


def test_the_package_exports_resolve():
    for name in kernels.__all__:
        assert getattr(kernels, name) is not None, name
    with pytest.raises(AttributeError):
        kernels.no_such_name  # noqa: B018
