"""Quantized GEMM: the native weight layout, the torch ops and their Triton / CuPy kernels, the layers.

    formats.py      native layout of int4 / int8 / fp8 weights: round-to-nearest quantizer, pack, dequantize
    ops.py          the torch ops codesign::w4a16_gemm, w8a16_gemm, w8a8_gemm, fp8_gemm, quantize_per_token_*:
                    argument checks, backend dispatch, the plain-torch implementations; quant_matmul
    triton_gemm.py  the Triton kernels (split-K and tiled weight-only, W8A8 / FP8, the activation quantizer),
                    their launchers, launch configs and tuned-table names
    cupy_gemm.py    the CuPy W4A16 GEMV (small M) and its CUDA source cupy_gemm.cu
    linear.py       QuantLinear and quantize_(model, config) with the W4A16 / W8A16 / W8A8 / FP8 configs
    merged.py       sibling linears of one input (q / k / v, gate / up) as one GEMM: merge_linears, split_tensors
    checkpoints.py  GPTQ and AWQ checkpoint importers to the native layout

Importing this package defines no kernel; the public names are re-exported by `codesign.kernels`.
"""
