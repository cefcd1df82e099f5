"""Lossless BF16 weights (DFloat11-style: entropy-coded exponents), decoded on the GPU.

    codec.py          the container: Huffman code lengths, compress / decompress, the numba CPU decoder
    triton_decode.py  the decode kernel (into a buffer) and the fused decode + GEMV kernel, their launchers
    triton_gemm.py    the fused decode + tile GEMM kernel for a few rows (the row-segment index)
    linear.py         the torch op codesign::df11_decode, PackedDF11, df11_linear / gemv / gemm, the layer
                      LosslessBF16Linear and compress_model_

Importing this package defines no kernel; the public names are re-exported by `codesign.kernels`.
"""
