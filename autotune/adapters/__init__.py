"""The tunable-op adapters shipped with codesign, one module per kernel family (registered on import; each
imports its kernels lazily, so listing the ops defines no kernel):

    gemm.py       w4a16_gemm, w8a16_gemm (split-K and tiled variants), w8a8_gemm, fp8_gemm
    act.py        quantize_per_token (the W8A8 / FP8 activation quantizer)
    df11.py       df11_gemm, df11_decode, df11_gemv (the flat layout)
    df11_rows.py  df11_rows_decode, df11_rows_gemv (the rows layout)
    kvcache.py    kv_write and kv_write_<fmt> (the paged-KV writer)
    attention.py  paged_attention and paged_attention_<fmt> (decode over each quantized cache)
    common.py     what they share (tolerances, shape checks, seeded generators)

Every adapter takes its table name and shape key from the kernel it tunes (the functions defined next to
the kernel's launcher), so the tuner writes the table the kernel reads. The protocol is in
`codesign.autotune.ops`.
"""
