"""codesign.kernels: Triton (and CuPy) kernels for LLM inference, exposed as torch ops."""
