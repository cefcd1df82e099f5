"""CuPy backend of W4A16 for small M: a CUDA C++ RawKernel (source: `cupy_gemm.cu`).

Selected with `use_backend("cupy", op="w4a16_gemm")` (CUDA tensors only). Supports M <= 16,
fp16 activations, fp16 scales/zeros, the native int4 layout; anything else is refused with a
CodesignError before launch. Without a GPU the source can still be compile-checked: `compile_ptx`
uses NVRTC (cuda-python or CuPy's binding, no device needed) or `nvcc --ptx`.
"""

from __future__ import annotations

import functools
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from codesign.specs import CodesignError

SOURCE = Path(__file__).resolve().with_name("cupy_gemm.cu")
KERNEL_NAME = "w4a16_gemv_splitk"
MAX_M = 16  # the kernel's per-thread accumulator count (MAX_M in the .cu file)
THREADS = 128
# Split K so that about 4 waves of blocks exist even when N / THREADS is small (decode GEMVs).
TARGET_BLOCKS = 4 * 132


def compile_ptx(arch: str = "compute_80") -> str:
    """PTX of the kernel source, via NVRTC if importable, else `nvcc --ptx`; raises CodesignError."""
    src = SOURCE.read_text()
    try:
        from cupy.cuda import nvrtc  # type: ignore[import-not-found]

        prog = nvrtc.createProgram(src, SOURCE.name, [], [])
        try:
            nvrtc.compileProgram(prog, [f"--gpu-architecture={arch}"])
        except nvrtc.NVRTCError as e:
            raise CodesignError(f"NVRTC failed on {SOURCE.name}: {nvrtc.getProgramLog(prog)}") from e
        ptx = nvrtc.getPTX(prog)
        return ptx.decode() if isinstance(ptx, bytes) else ptx
    except ImportError:
        pass
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        raise CodesignError("neither NVRTC (cupy) nor nvcc is available to compile the CUDA source")
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "k.ptx"
        r = subprocess.run(
            [nvcc, "--ptx", f"-arch={arch}", str(SOURCE), "-o", str(out)],
            capture_output=True,
            text=True,
            timeout=120,
        )
        if r.returncode != 0:
            raise CodesignError(f"nvcc failed on {SOURCE.name}:\n{r.stderr}")
        return out.read_text()


@functools.lru_cache(maxsize=1)
def _kernel():
    import cupy  # noqa: F401  (optional dependency: codesign[cuda])

    return cupy.RawKernel(SOURCE.read_text(), KERNEL_NAME)


def w4a16_gemv(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None,
    bias: torch.Tensor | None,
    group: int,
) -> torch.Tensor:
    """out [M, N] fp16 = x @ ((code - zero) * scale)^T (+ bias) for x [M <= 16, K] fp16 on CUDA.

    Arguments are already validated by `gemm.ops.check_wq_args`; the CuPy-specific limits
    (M, dtypes, device) are checked here.
    """
    m, k = x.shape
    n = qweight.shape[1]
    if x.device.type != "cuda":
        raise CodesignError(f"the cupy backend needs CUDA tensors, got {x.device}")
    if m > MAX_M:
        raise CodesignError(f"the cupy W4A16 kernel handles M <= {MAX_M}, got M={m}: use backend 'triton'")
    if x.dtype != torch.float16 or scales.dtype != torch.float16:
        raise CodesignError(
            f"the cupy W4A16 kernel needs fp16 x and scales, got {x.dtype} and {scales.dtype}"
        )
    import cupy

    k_words = k // 8
    blocks_n = (n + THREADS - 1) // THREADS
    split = max(1, min(k_words, TARGET_BLOCKS // blocks_n))
    words_per_split = (k_words + split - 1) // split
    split = (k_words + words_per_split - 1) // words_per_split
    acc = torch.zeros((m, n), dtype=torch.float32, device=x.device)
    dummy = scales  # never read when the has_* flag is 0
    args = [
        cupy.asarray(t)
        for t in (
            x,
            qweight,
            scales,
            zeros if zeros is not None else dummy,
            bias if bias is not None else dummy,
            acc,
        )
    ]
    scalars = [cupy.int32(v) for v in (m, n, k, group, words_per_split, zeros is not None, bias is not None)]
    with cupy.cuda.ExternalStream(torch.cuda.current_stream(x.device).cuda_stream):
        _kernel()((blocks_n, split), (THREADS,), (*args, *scalars))
    return acc.to(torch.float16)
