"""Fused DF11 decode + tile GEMM (M > 1) in the interpreter, the path choice by M, and the exact path.

What is exact against what:
  - the fused kernel with one K-range per tile (no split) equals, bit for bit (torch.equal on fp32),
    a sequential fp32 sum over k of the exact bf16 x bf16 products (`sequential_fp32` below);
  - with K split over programs (fp32 atomics) it is within 1e-6 relative (Frobenius) of the fp64 reference
    (K <= 200 terms, fp32 unit roundoff 6e-8);
  - the module's default (exact) path is bit-identical to nn.Linear (torch.equal on bf16).
Shapes are odd and small: the interpreter costs a few ms per decoded column.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from helpers import assert_rel_close, assert_runs_without_interpreter
from torch import nn

from codesign.autotune.lookup import forced_config
from codesign.backend import use_backend
from codesign.kernels.df11 import codec
from codesign.kernels.df11 import triton_gemm as fused
from codesign.kernels.df11.linear import (
    FUSED_MAX_M,
    LosslessBF16Config,
    LosslessBF16Linear,
    PackedDF11,
    choose_path,
    compress_model_,
    df11_gemm,
    df11_linear,
)
from codesign.specs import CodesignError

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def realistic(shape, std: float = 0.02) -> torch.Tensor:
    return (torch.randn(*shape, dtype=torch.float64) * std).to(torch.bfloat16)


def sequential_fp32(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """y[m, n] = fl(fl(... + x[m, k] * w[n, k])) in fp32, k ascending (products of bf16 are exact in fp32)."""
    xf, wf = x.float().cpu(), w.float().cpu()
    acc = torch.zeros(xf.shape[0], wf.shape[0], dtype=torch.float32)
    for k in range(xf.shape[1]):
        acc += xf[:, k : k + 1] * wf[:, k][None, :]
    return acc


def launch(packed: PackedDF11, x: torch.Tensor, config: dict, poison: bool = True) -> tuple:
    """Run the kernel directly on a NaN-poisoned y; returns (y fp32, err)."""
    n, k = packed.shape
    grid = fused.launch_grid(x.shape[0], n, k, packed.segment, config)
    split = grid[1] > 1
    y = (
        torch.zeros(x.shape[0], n, device=DEV)
        if split
        else torch.full((x.shape[0], n), float("nan"), device=DEV)
    )
    err = torch.full((grid[0] * grid[1] * grid[2],), -1, dtype=torch.int32, device=DEV)
    fused.df11_gemm_triton(packed.stream, packed.sign_mantissa, packed.luts, packed.seg_bits,
                           x.view(torch.int16), y, err, n, k, packed.segment, packed.levels, config)  # fmt: skip
    return y.cpu(), err.cpu()


@pytest.mark.parametrize(
    "n,k,m,segment,cfg",
    [
        ((37, 91, 5, 32, {"BLOCK_M": 8, "BLOCK_N": 64, "SEGS_PER_PROG": 4})),  # one tile, K not split
        ((70, 45, 3, 16, {"BLOCK_M": 4, "BLOCK_N": 32, "SEGS_PER_PROG": 4})),  # 3 N-tiles, partial last
        ((19, 77, 11, 1024, {"BLOCK_M": 4, "BLOCK_N": 32, "SEGS_PER_PROG": 1})),  # 3 M-tiles
    ],
)
def test_fused_gemm_equals_sequential_fp32_sum(n, k, m, segment, cfg):
    w, x = realistic((n, k)), torch.randn(m, k, dtype=torch.float64).to(torch.bfloat16)
    packed = PackedDF11(codec.compress(w, chunk_bytes=8, chunks_per_group=16), DEV, segment=segment)
    y, err = launch(packed, x.to(DEV), {**fused.DEFAULT_CONFIG, **cfg})
    assert fused.launch_grid(m, n, k, segment, cfg)[1] == 1 and int(err.max()) == 0 and int(err.min()) == 0
    ref = sequential_fp32(x, w)
    assert torch.equal(y, ref), (
        f"{int((y != ref).sum())} of {y.numel()} outputs differ; NaN: {y.isnan().sum()}"
    )
    assert_rel_close(y, x.double() @ w.double().T, 1e-6, "fused gemm vs fp64")


def test_fused_gemm_split_k_within_fp32_rounding():
    n, k, m = 29, 150, 6
    w, x = realistic((n, k), std=0.5), torch.randn(m, k, dtype=torch.float64).to(torch.bfloat16)
    packed = PackedDF11(codec.compress(w, chunk_bytes=8, chunks_per_group=16), DEV, segment=16)
    cfg = {**fused.DEFAULT_CONFIG, "BLOCK_M": 8, "BLOCK_N": 32, "SEGS_PER_PROG": 3}
    assert fused.launch_grid(m, n, k, 16, cfg)[1] == 4  # 10 segments in K-ranges of 3: 4 splits, atomics
    y, err = launch(packed, x.to(DEV), cfg)
    assert int(err.max()) == 0
    assert_rel_close(y, x.double() @ w.double().T, 1e-6, "split-K fused gemm vs fp64")


def test_segment_index_is_the_bit_offset_of_each_segment_start():
    """Checked against code lengths of the original exponents (not the decoder the index is built from)."""
    w = realistic((9, 50))
    df = codec.compress(w)
    idx = fused.segment_index(df, 16)
    exp, _ = codec.split_bf16(w)
    bits_before = np.concatenate([[0], np.cumsum(df.code_lengths[exp].astype(np.int64))])
    want = [bits_before[r * 50 + s * 16] for r in range(9) for s in range(4)] + [df.total_bits]
    assert idx.tolist() == want
    with pytest.raises(CodesignError, match="seg must be a positive int"):
        fused.segment_index(df, 0)
    with pytest.raises(CodesignError, match="2-D"):
        fused.segment_index(codec.compress(realistic((2, 3, 4))), 8)


def test_choose_path_by_m():
    assert [choose_path(m, "triton", False) for m in (0, 1, 2, FUSED_MAX_M, FUSED_MAX_M + 1)] == [
        "buffer",
        "gemv",
        "gemm",
        "gemm",
        "buffer",
    ]
    assert {choose_path(m, "triton", True) for m in (1, 2, 300)} == {"buffer"}  # exact: always the buffer
    assert {choose_path(m, "torch", False) for m in (1, 2, 300)} == {"buffer"}  # no Triton: the buffer
    assert choose_path(4, "triton", False, fused_ready=False) == "buffer"  # packed without the index


@pytest.mark.parametrize("m", [1, 3, FUSED_MAX_M + 1])
def test_df11_linear_paths(m):
    """exact=True is bit-identical to F.linear; exact=False at small M runs the fused kernels (no
    decode buffer is ever allocated) and rounds the fp32 sum to bf16 once."""
    n, k = 23, 40
    w, b = realistic((n, k)), realistic((n,))
    x = torch.randn(m, k, dtype=torch.float64).to(torch.bfloat16).to(DEV)
    layer = LosslessBF16Linear.from_linear(
        _linear(w, b),
        LosslessBF16Config(chunk_bytes=8, exact=False, segment=64),  # K = 40: one segment
    )
    with torch.no_grad(), use_backend("triton", op="df11_linear"):  # the buffer decode stays on numba
        out = layer(x)
        exact = df11_linear(layer.weight_packed, x, layer.bias, exact=True)
    assert torch.equal(exact.cpu(), F.linear(x.cpu(), w, b))
    assert out.dtype == torch.bfloat16 and out.shape == (m, n)
    ref = (x.double().cpu() @ w.double().T + b.double()).to(torch.bfloat16)
    if m <= FUSED_MAX_M:
        assert layer.workspace.nbytes() == 0, "a fused path decoded the weight into a buffer"
        if m > 1:  # the tile GEMM: one segment, so K is not split and the fp32 sum is sequential
            want = (sequential_fp32(x, w) + b.float()).to(torch.bfloat16)
            assert torch.equal(out.cpu(), want)
    else:
        assert layer.workspace.nbytes() == 2 * n * k and torch.equal(out.cpu(), F.linear(x.cpu(), w, b))
    assert_rel_close(out.cpu(), ref, 8e-3, f"df11_linear M={m}")  # bf16 output rounding, 2^-8


def test_model_default_stays_bit_identical_and_fused_model_is_close():
    model = nn.Sequential(nn.Linear(33, 48), nn.GELU(), nn.Linear(48, 7)).to(torch.bfloat16).to(DEV)
    x = torch.randn(2, 3, 33, dtype=torch.bfloat16, device=DEV)  # M = 6 rows: the tile GEMM
    fast, exact = copy.deepcopy(model), copy.deepcopy(model)
    compress_model_(fast, config=LosslessBF16Config(chunk_bytes=8, exact=False, segment=16))
    compress_model_(exact, config=LosslessBF16Config(chunk_bytes=8))  # exact by default
    with torch.no_grad(), use_backend("triton", op="df11_linear"):
        ref = model(x)
        assert torch.equal(exact(x), ref)
        assert_rel_close(fast(x), ref, 2e-2, "fused model vs nn.Linear")  # bf16 rounding of 2 layers
    assert all(m.workspace.nbytes() == 0 for m in fast.modules() if isinstance(m, LosslessBF16Linear))


def test_fused_gemm_flags_corruption_and_writes_nothing():
    w, x = realistic((21, 40)), torch.randn(3, 40, dtype=torch.float64).to(torch.bfloat16).to(DEV)
    packed = PackedDF11(codec.compress(w, chunk_bytes=8, chunks_per_group=16), DEV, segment=16)
    cfg = {**fused.DEFAULT_CONFIG, "BLOCK_M": 4, "BLOCK_N": 32, "SEGS_PER_PROG": 4}
    packed.seg_bits[3] += 1  # row 1 (3 segments a row) starts a bit late: row 0 ends early, row 1 late
    y, err = launch(packed, x, cfg)
    assert int(err.max()) == 1 and y.isnan().all(), "a corrupt program wrote outputs"
    with use_backend("triton"), pytest.raises(CodesignError, match="corrupt"):
        df11_gemm(packed, x)
    packed.seg_bits[3] -= 1
    packed.stream.zero_()  # every code now reads as the shortest one: rows end at the wrong bit
    with use_backend("triton"), pytest.raises(CodesignError, match="corrupt"):
        df11_gemm(packed, x)


def test_bad_inputs_raise_before_launch():
    w = realistic((5, 8))
    packed = PackedDF11(codec.compress(w), DEV, segment=16)
    x = torch.randn(2, 8, dtype=torch.bfloat16, device=DEV)
    with pytest.raises(CodesignError, match="bf16"):
        df11_gemm(packed, x.float())
    with pytest.raises(CodesignError, match="in_features=8"):
        df11_gemm(packed, x[:, :7])
    with pytest.raises(CodesignError, match="bias must be bf16"):
        df11_gemm(packed, x, torch.zeros(4, dtype=torch.bfloat16, device=DEV))
    with pytest.raises(CodesignError, match="row-segment index"):
        df11_gemm(PackedDF11(codec.compress(w), DEV), x)
    with pytest.raises(CodesignError, match="in_features=8"):
        df11_linear(packed, x[:, :3])


def test_kernel_params_come_from_lookup():
    w, x = realistic((13, 24)), torch.randn(5, 24, dtype=torch.float64).to(torch.bfloat16).to(DEV)
    packed = PackedDF11(codec.compress(w), DEV, segment=8)
    assert fused.gemm_config(5, 13, 24, torch.device("cpu"))["BLOCK_M"] == 8  # next power of two >= M
    with use_backend("triton"), forced_config(fused.OP, {"BLOCK_N": 16, "SEGS_PER_PROG": 1}):
        assert fused.gemm_config(5, 13, 24, DEV)["BLOCK_N"] == 16
        split = df11_gemm(packed, x)  # 3 K-splits through atomics
    with use_backend("triton"), forced_config(fused.OP, {"BLOCK_N": 16, "SEGS_PER_PROG": 4}):
        whole = df11_gemm(packed, x)
    assert torch.equal(whole.cpu(), sequential_fp32(x, w).to(torch.bfloat16))
    assert_rel_close(split.cpu(), whole.cpu(), 8e-3, "split vs whole K")


def _linear(w: torch.Tensor, b: torch.Tensor) -> nn.Linear:
    lin = nn.Linear(w.shape[1], w.shape[0]).to(torch.bfloat16)
    with torch.no_grad():
        lin.weight.copy_(w)
        lin.bias.copy_(b)
    return lin.to(DEV)


def test_fused_gemm_lowers_for_sm90():
    """The interpreter cannot show the kernel compiles: lower it for an H100/H200 target in a subprocess
    (TRITON_INTERPRET off; ptxas ships with Triton, no GPU needed), with and without split-K atomics."""
    code = (
        "from codesign.kernels.df11.triton_gemm import lower_for_gpu\n"
        "for atomic in (False, True):\n"
        "    asm = lower_for_gpu(90, levels=2, atomic=atomic)\n"
        "    assert '.target sm_90' in asm['ptx'] and len(asm['cubin']) > 0, sorted(asm)\n"
        "print('ok')\n"
    )
    assert_runs_without_interpreter(code)


@pytest.mark.gpu
@pytest.mark.parametrize("m", [2, 7, 16])
def test_gpu_fused_gemm_llama_layer(m):
    """A Llama-sized layer on a GPU: exact against the sequential fp32 sum when K is not split."""
    n, k = 4096 + 17, 4096
    w = realistic((n, k))
    x = torch.randn(m, k, dtype=torch.float64).to(torch.bfloat16)
    packed = PackedDF11(codec.compress(w), "cuda", segment=1024)
    y, err = launch(packed, x.cuda(), {**fused.DEFAULT_CONFIG, "SEGS_PER_PROG": 4})
    assert int(err.max()) == 0
    assert torch.equal(y, sequential_fp32(x, w))
    with use_backend("triton"):
        split = df11_gemm(packed, x.cuda()).cpu()
    assert_rel_close(split, x.double() @ w.double().T, 2**-8, "df11_gemm on GPU")
