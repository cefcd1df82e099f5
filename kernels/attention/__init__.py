"""Paged attention (decode, extend / chunked prefill, tree verification) over every KV cache type.

    options.py           AttentionOptions and AttentionBatch: the two typed values from the public call to the
                         launcher, their checks (`prepare`), and the custom ops' view of both
    reference.py         the CPU implementation in plain torch
    triton_attention.py  the Triton kernel (one jit helper per cache format family), its launch plan (config,
                         split count, workspace: `plan_launch`), the launcher, the tuned-table name and key
    ops.py               the custom-op factory (`AttentionFormat`), the backend dispatch, codesign::paged_attention
    tree.py              token trees: parent arrays, masks, TreeBatch, verify_tree
    paged.py             the entry points over a plain cache (decode, extend, tree) and `attend`, the body
                         every entry point shares
    quantized.py         the quantized caches' formats and ops (codesign::paged_attention_kvq, _kivi, _oaken,
                         _mixed) and their entry points
    wrappers.py          FlashInfer-style plan() / run() wrappers over every cache type
    latent.py            multi-head latent attention decode (DeepSeek-V2/V3) over a paged latent cache:
                         codesign::latent_decode_attention, its checks, torch path and spec
    triton_latent.py     its Triton kernel (one tile of the cache read once for keys and values)

Depends on `codesign.kernels.kvcache`, never the reverse. Importing this package defines no kernel; the
public names are re-exported by `codesign.kernels`.
"""
