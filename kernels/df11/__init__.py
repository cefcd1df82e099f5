"""Lossless BF16 weights (DFloat11-style: entropy-coded exponents), decoded on the GPU.

    codec.py          the container: Huffman code lengths, compress / decompress, the numba CPU decoder
    triton_decode.py  the decode kernel (into a buffer) and the fused decode + GEMV kernel, their launchers
    triton_gemm.py    the fused decode + tile GEMM kernel for a few rows (the row-segment index)
    rows.py           the rows layout: per-(row, lane) exponent streams (no scan), its container and numba codec
    triton_rows.py    the rows layout's decode kernel and fused GEMV (M = 1..4), their launchers
    packed_rows.py    the torch op codesign::df11_rows_decode, PackedDF11Rows, df11_rows_gemv
    linear.py         the torch op codesign::df11_decode, PackedDF11, df11_linear / gemv / gemm, the layer
                      LosslessBF16Linear and compress_model_

Importing this package defines no kernel; the public names are re-exported by `codesign.kernels`.
"""
