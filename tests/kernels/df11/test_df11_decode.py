"""The Triton DF11 decode kernel (interpreter on CPU) against the CPU decoder and the original bits.

The kernel only moves integers (uint8 in, int16 out), so the interpreter's bf16 trap does not apply.
Shapes are small and chunks short (8 bytes) so the interpreter's per-iteration cost stays low. On a GPU
machine the same tests run the compiled kernel on CUDA tensors (DEV), plus the `gpu`-marked ones.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import assert_rel_close, assert_runs_without_interpreter

from codesign.backend import use_backend
from codesign.kernels.df11 import codec
from codesign.kernels.df11.linear import PackedDF11, _df11_decode_op, df11_gemv
from codesign.specs import CodesignError

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
POISON = 0x7FC1  # a NaN payload the inputs below never contain: any unwritten element shows


def realistic(shape, std: float = 0.02) -> torch.Tensor:
    return (torch.randn(*shape, dtype=torch.float64) * std).to(torch.bfloat16)


def triton_decode(packed: PackedDF11, check: bool = True) -> torch.Tensor:
    out = torch.full((packed.numel,), POISON, dtype=torch.int16, device=packed.stream.device)
    with use_backend("triton", op="df11_decode"):
        packed.decode_into(out, check=check)
    return out.cpu()


@pytest.mark.parametrize(
    "shape,std,chunk_bytes,chunks_per_group",
    [
        ((37, 29), 0.02, 8, 256),  # one program
        ((37, 29), 0.02, 4, 16),  # many programs, 32-bit chunks: many codes cross chunk edges
        ((3, 5), 1.0, 8, 1),  # one chunk per program
        ((61, 17), 1e-3, 16, 64),
    ],
)
def test_triton_matches_cpu_decoder(shape, std, chunk_bytes, chunks_per_group):
    t = realistic(shape, std)
    df = codec.compress(t, chunk_bytes=chunk_bytes, chunks_per_group=chunks_per_group)
    assert df.num_chunks == 1 or (df.gaps > 0).any(), "no code crosses a chunk boundary"
    got = triton_decode(PackedDF11(df, DEV))
    cpu = torch.from_numpy(codec.decompress_bits(df).view(np.int16))
    assert torch.equal(got, cpu), (
        f"{int((got != cpu).sum())} of {got.numel()} elements differ from the CPU decoder"
    )
    assert torch.equal(got.view(shape), t.view(torch.int16))


def test_triton_max_entropy_and_single_exponent():
    wild = torch.randint(-(2**15), 2**15, (23, 41), dtype=torch.int16)
    wild[wild == POISON] = 0
    df = codec.compress(wild.view(torch.bfloat16), chunk_bytes=8, chunks_per_group=128)
    assert torch.equal(triton_decode(PackedDF11(df, DEV)).view(23, 41), wild)
    same = (1 + 0.99 * torch.rand(19, 33, dtype=torch.float64)).to(torch.bfloat16)
    df = codec.compress(same, chunk_bytes=8, chunks_per_group=128)
    assert df.levels == 1
    assert torch.equal(triton_decode(PackedDF11(df, DEV)).view(19, 33), same.view(torch.int16))


def test_triton_three_table_levels():
    """A skewed exponent histogram with a 24-bit cap: codes over 16 bits walk the third table level."""
    fib = [1, 1]
    while len(fib) < 18:
        fib.append(fib[-1] + fib[-2])
    # Fibonacci counts are the worst case for Huffman depth: 18 exponents give codes of up to 17 bits.
    rng = np.random.default_rng(int(torch.randint(0, 2**31, ())))
    exps = rng.permutation(np.concatenate([np.full(f, 100 + i) for i, f in enumerate(fib)]))
    sm = rng.integers(0, 256, exps.size)
    u = ((sm & 0x80) << 8) | (exps.astype(np.int64) << 7) | (sm & 0x7F)
    t = torch.from_numpy(u.astype(np.uint16).view(np.int16)).view(torch.bfloat16)
    df = codec.compress(t, max_code_len=24, chunk_bytes=8, chunks_per_group=512)
    assert df.levels == 3
    assert torch.equal(triton_decode(PackedDF11(df, DEV)), t.view(torch.int16))


def test_triton_flags_miscounted_group_and_writes_nothing_there():
    t = realistic((16, 12))
    df = codec.compress(t, chunk_bytes=4, chunks_per_group=4)
    packed = PackedDF11(df, DEV)
    packed.group_offsets[2] += 1  # group 1 claims one weight more than its chunks hold
    with pytest.raises(CodesignError, match="corrupt"):
        triton_decode(packed)
    out = triton_decode(packed, check=False)
    assert packed.err[1] == 1 and packed.err[2] == 1 and packed.err[0] == 0
    lo, hi = int(packed.group_offsets[1]), int(packed.group_offsets[3])
    assert (out[lo:hi] == POISON).all(), "a corrupt group must not write weights"
    assert torch.equal(out[:lo], t.view(torch.int16).reshape(-1)[:lo])


def test_decode_into_checks_its_buffer():
    packed = PackedDF11(codec.compress(realistic((8, 8))))
    for bad in (torch.empty(63, dtype=torch.int16), torch.empty(64, dtype=torch.float32),
                torch.empty(128, dtype=torch.int16)[::2]):  # fmt: skip
        with pytest.raises(CodesignError, match="out must be"):
            packed.decode_into(bad)


def test_op_registration_opcheck():
    df = codec.compress(realistic((9, 11)), chunk_bytes=8, chunks_per_group=4)
    p = PackedDF11(df)
    args = (p.stream, p.sign_mantissa, p.gaps, p.group_offsets, p.luts, torch.empty(p.numel, dtype=torch.int16),
            p.err.clone(), p.total_bits, p.max_codes, p.chunk_bytes, p.chunks_per_group, p.levels)  # fmt: skip
    torch.library.opcheck(_df11_decode_op, args, test_utils=("test_schema", "test_faketensor"))


@pytest.mark.slow
def test_kernel_lowers_for_sm90():
    """The interpreter cannot show that the kernel compiles for a GPU: lower it to cubin in a subprocess
    (TRITON_INTERPRET off; ptxas ships with Triton, no GPU needed)."""
    code = (
        "from codesign.kernels.df11.triton_decode import lower_for_gpu\n"
        "for kernel in ('decode', 'gemv'):\n"
        "    asm = lower_for_gpu(kernel, 90, levels=3)\n"
        "    assert '.target sm_90' in asm['ptx'] and len(asm['cubin']) > 0, sorted(asm)\n"
        "print('ok')\n"
    )
    assert_runs_without_interpreter(code)


@pytest.mark.parametrize("n,k,chunk_bytes,chunks_per_group", [(9, 13, 8, 256), (5, 300, 4, 32)])
def test_fused_gemv_matches_reference(n, k, chunk_bytes, chunks_per_group):
    """Decode-in-registers GEMV: rows change inside chunks (K=13) and span lanes and programs (K=300)."""
    w = realistic((n, k), 0.05)
    x = torch.randn(1, k, dtype=torch.float64).to(torch.bfloat16)
    bias = torch.randn(n, dtype=torch.float64).to(torch.bfloat16)
    packed = PackedDF11(codec.compress(w, chunk_bytes=chunk_bytes, chunks_per_group=chunks_per_group), DEV)
    x, bias = x.to(DEV), bias.to(DEV)
    y = df11_gemv(packed, x, bias).cpu()
    assert y.shape == (1, n) and y.dtype == torch.bfloat16
    ref = w.double() @ x.double().reshape(-1) + bias.double()
    # fp32 accumulation then one bf16 rounding: within 2^-8 relative of the fp64 result.
    assert_rel_close(y.reshape(-1), ref, 2**-8, "df11_gemv")
    assert torch.equal(df11_gemv(packed, x.reshape(-1), bias).cpu(), y.reshape(-1))


def test_fused_gemv_bad_input():
    packed = PackedDF11(codec.compress(realistic((4, 6))), DEV)
    with pytest.raises(CodesignError, match="one row"):
        df11_gemv(packed, torch.zeros(2, 6, dtype=torch.bfloat16, device=DEV))
    with pytest.raises(CodesignError, match="bf16"):
        df11_gemv(packed, torch.zeros(6, device=DEV))
    with pytest.raises(CodesignError, match="bias"):
        df11_gemv(
            packed, torch.zeros(6, dtype=torch.bfloat16, device=DEV), torch.zeros(5, dtype=torch.bfloat16)
        )


@pytest.mark.gpu
@pytest.mark.parametrize("chunk_bytes,chunks_per_group", [(32, 128), (8, 256)])
def test_gpu_large_decode_and_gemv(chunk_bytes, chunks_per_group):
    """Llama-sized layer on a real GPU: bit-exact decode (vs the input and the CPU decoder), fused GEMV."""
    n, k = 4096 + 17, 4096
    w = realistic((n, k))
    df = codec.compress(w, chunk_bytes=chunk_bytes, chunks_per_group=chunks_per_group)
    packed = PackedDF11(df, "cuda")
    got = triton_decode(packed)
    assert torch.equal(got.view(n, k), w.view(torch.int16))
    assert torch.equal(got, torch.from_numpy(codec.decompress_bits(df).view(np.int16)))
    x = torch.randn(1, k, dtype=torch.float64).to(torch.bfloat16)
    y = df11_gemv(packed, x.cuda()).cpu()
    assert_rel_close(y.reshape(-1), w.double() @ x.double().reshape(-1), 2**-8, "df11_gemv on GPU")
