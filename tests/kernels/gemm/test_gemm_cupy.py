"""CuPy W4A16 backend: the CUDA source compiles here (NVRTC or nvcc); it runs and matches on a GPU."""

from __future__ import annotations

import shutil

import pytest
import torch
from helpers import assert_rel_close

from codesign.backend import use_backend
from codesign.kernels.gemm import cupy_gemm as qc
from codesign.kernels.gemm import formats as qf
from codesign.kernels.gemm import ops as qg
from codesign.specs import CodesignError


def _have_compiler() -> bool:
    try:
        import cupy.cuda.nvrtc  # noqa: F401

        return True
    except ImportError:
        return shutil.which("nvcc") is not None


@pytest.mark.skipif(not _have_compiler(), reason="neither NVRTC (cupy) nor nvcc is installed")
def test_cuda_source_compiles_to_ptx():
    ptx = qc.compile_ptx("compute_80")
    assert f".entry {qc.KERNEL_NAME}" in ptx
    assert "atom.global.add.f32" in ptx  # the split-K reduction


def test_cupy_backend_refuses_unsupported_calls_before_launch():
    qw = qf.quantize_rtn(torch.randn(64, 128), "int4", 32)
    x = torch.randn(17, 128, dtype=torch.float16)
    with pytest.raises(CodesignError, match="CUDA"):
        qc.w4a16_gemv(x, qw.qweight, qw.scales, None, None, 32)


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 5, 16])
def test_cupy_matches_triton_on_gpu(m):
    pytest.importorskip("cupy")
    qw = qf.quantize_rtn(torch.randn(1000, 1024), "int4", 128, False)
    args = [t.cuda() for t in (qw.qweight, qw.scales, qw.zeros)]
    x = torch.randn(m, 1024, dtype=torch.float16, device="cuda")
    bias = torch.randn(1000, dtype=torch.float16, device="cuda")
    with use_backend("cupy", op="w4a16_gemm"):
        y_cupy = qg.w4a16_gemm(x, *args, bias, 128)
    with use_backend("triton"):
        y_triton = qg.w4a16_gemm(x, *args, bias, 128)
    want = x.double().cpu() @ qw.dequantize(torch.float64).t() + bias.double().cpu()
    assert_rel_close(y_cupy, want, 2e-3, "cupy")
    assert_rel_close(y_cupy, y_triton, 2e-3, "cupy vs triton")
