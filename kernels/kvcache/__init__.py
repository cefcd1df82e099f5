"""The paged KV cache: its blocks, its formats, its writers, and the quantized cache types (data, checks, writers).

    formats.py              the one KV-format vocabulary: `codesign.specs.KVFormat` and the kernels' codes,
                            table names and format lists derived from it
    checks.py               the input checks every paged kernel and cache runs before a launch
    blocks.py               BlockAllocator and PagedKVCache (host bookkeeping, copy-on-write forks)
    quantizers.py           the reference quantizers in torch (per-token, fp8, KIVI, Oaken and its offline grid)
    write.py                the torch op codesign::kv_write (plain caches)
    triton_write.py         the writer kernel: plain, per-token INT8/4/2 and FP8 quantize-on-write
    latent.py               codesign::latent_write: MLA's latent and rotary key into a latent cache (plain or
                            e4m3), with triton_latent_write.py
    kvq.py                  QuantPagedKV (per-token INT8/4/2, per-head FP8) and codesign::kvq_write
    kivi.py                 KiviPagedKV and its writer (append), with triton_kivi_flush.py
    oaken.py                OakenPagedKV (fp16 or offline 8-bit metadata) and its writer, with triton_oaken_write.py
    mixed.py                MixedPagedKV (per-chunk INT8/4/2), the Cocktail policy and its writer
    accuracy.py             attention error and bits per element of every format (`codesign kvq-accuracy`,
                            accuracy_cli.py)

Attention over these caches lives in `codesign.kernels.attention`; nothing here imports it. Importing this
package defines no kernel; the public names are re-exported by `codesign.kernels`.
"""
