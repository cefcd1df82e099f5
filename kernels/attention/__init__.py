"""Paged attention (decode, extend / chunked prefill, tree verification) over every KV cache type.

    options.py           AttentionOptions and AttentionBatch, the checks, and the ops' view of both
    reference.py         the CPU implementation in plain torch
    triton_attention.py  the Triton kernel, its launch plan (configs, splits, workspace), launcher and tables
    ops.py               the custom-op factory, the attention formats and codesign::paged_attention
    paged.py             paged_decode_attention, paged_extend_attention (plain caches)
    tree.py              token trees, tree_attention, verify_tree
    quantized.py         attention over the quantized caches of `kvcache` (their ops and entry points)
    wrappers.py          FlashInfer-style plan() / run() wrappers over every cache type

Depends on `codesign.kernels.kvcache`, never the reverse. Importing this package defines no kernel; the
public names are re-exported by `codesign.kernels`.
"""
