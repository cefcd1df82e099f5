"""Tunable adapters for the DF11 kernels: the fused decode + GEMM (`df11.linear.df11_gemm`, kernel
`df11.triton_gemm`), and the decoder and fused GEMV of `df11.triton_decode` (`DF11Decode`, `DF11Gemv`, below).

Shape: M (rows of x), N, K (the weight [N, K]), optionally seg (columns per row-segment index
entry; default the kernel's DEFAULT_SEGMENT, which serving uses; tests pass a small one so the
interpreter's per-k loop stays short). The kernel's table op is "df11_gemm", key `table_key` (K, N), M bucketed.
Tuned: BLOCK_M (rows per program; the launcher caps it at next_pow2(M)), BLOCK_N (lanes, one weight
row each), SEGS_PER_PROG (K-range per program: fewer segments = more programs, fp32 atomics when
K is split), num_warps. Weights are bf16 with a realistic spread (std 0.02, as trained linear
layers; one weight per (N, K, seg), x fresh per seed), compressed by the codec; x is bf16; the
reference is x @ W^T in fp64. The output is bf16, whatever the tuner's dtype (the kernel works on
bf16 bits, so it also runs in the interpreter).
"""

from __future__ import annotations

import copy
import functools
from typing import Any

import torch

from codesign.autotune.adapters.common import pow2_cap, seeded
from codesign.autotune.lookup import forced_config
from codesign.autotune.ops import Shape, register
from codesign.autotune.space import ConfigSpace, Resources
from codesign.specs.errors import CodesignError

TABLE_OP = "df11_gemm"  # the registered name: the fused GEMM's table (`df11.triton_gemm.OP`)
# bf16 output: one rounding of each element (2^-9 relative) on an fp32 sum; a wrong config is O(1).
TOLERANCE = 4e-3


class DF11Gemm:
    """df11_gemm: y[M, N] = x[M, K] @ W[N, K]^T with W DFloat11-coded and decoded in registers."""

    default_trial = True  # run(inputs, {}) is the untuned default (forced_config merges over it)

    name = TABLE_OP
    source_modules = ("codesign.kernels.df11.triton_gemm", "codesign.kernels.df11.triton_decode")

    def __init__(self) -> None:
        from codesign.kernels.df11 import triton_gemm  # unavailable kernel -> ImportError
        from codesign.kernels.df11.linear import df11_gemm  # noqa: F401

        self.kernel = triton_gemm
        self.default_seg = triton_gemm.DEFAULT_SEGMENT

    def _seg(self, shape: Shape) -> int:
        return shape.get("seg", self.default_seg)

    def check_shape(self, shape: Shape) -> None:
        if not {"M", "N", "K"} <= set(shape) <= {"M", "N", "K", "seg"} or min(shape.values()) < 1:
            raise CodesignError(
                f"shape for {self.name}: expected positive dims M, N, K (and seg); got {shape}"
            )

    def table_op(self, shape: Shape) -> str:
        return self.kernel.OP

    def table_key(self, shape: Shape) -> str:
        return self.kernel.table_key(shape["N"], shape["K"])

    def m(self, shape: Shape) -> int:
        return shape["M"]

    def space(self, shape: Shape, dtype: torch.dtype, on_gpu: bool) -> ConfigSpace:
        params = (
            {"BLOCK_M": [1, 2, 4, 8, 16], "BLOCK_N": [16, 32, 64, 128, 256], "SEGS_PER_PROG": [1, 2, 4, 8],
             "num_warps": [1, 2, 4, 8]}
            if on_gpu
            else {"BLOCK_M": [4], "BLOCK_N": [32], "SEGS_PER_PROG": [1, 2], "num_warps": [4]}
        )  # fmt: skip
        nseg = -(-shape["K"] // self._seg(shape))
        cap_m = pow2_cap(shape["M"], 1)
        cap_n = max(pow2_cap(shape["N"]), min(params["BLOCK_N"]))

        def valid(c: dict[str, int]) -> bool:
            # Larger values than these only repeat a smaller config (the launcher caps BLOCK_M; a
            # K-range past the last segment is empty) or waste lanes on absent rows.
            return c["BLOCK_M"] <= cap_m and c["BLOCK_N"] <= cap_n and c["SEGS_PER_PROG"] <= max(nseg, 1)

        def resources(c: dict[str, int]) -> Resources:
            # fp32 accumulator tile plus per-lane decoder state (bit position, end, symbol, error: ~6 words).
            threads = 32 * c["num_warps"]
            return Resources(0, (c["BLOCK_M"] * c["BLOCK_N"] + 6 * c["BLOCK_N"]) // threads + 40)

        return ConfigSpace(params=params, valid=valid, resources=resources)

    def make_inputs(self, shape: Shape, dtype: torch.dtype, device: Any, seed: int) -> dict[str, Any]:
        # The weight is compressed once per (N, K, seg) (seconds at 4096 x 4096) and copied per call:
        # the rotating input sets of cold-L2 timing need distinct memory, not distinct values.
        w, packed_cpu = _packed_weight(shape["N"], shape["K"], self._seg(shape))
        x = torch.randn(shape["M"], shape["K"], generator=seeded(seed), dtype=torch.float64).to(torch.bfloat16)
        packed = copy.deepcopy(packed_cpu).to(device)
        return {"packed": packed, "x": x.to(device), "ref": x.double() @ w.double().T}

    def input_bytes(self, inputs: dict[str, Any]) -> int:
        return int(inputs["packed"].nbytes) + inputs["x"].numel() * 2

    def poison(self, inputs: dict[str, Any]) -> None:
        # The launcher allocates y itself: hand the caching allocator a NaN block of y's size first.
        m, n = inputs["ref"].shape
        torch.full((m, n), float("nan"), dtype=torch.float32, device=inputs["x"].device)

    def run(self, inputs: dict[str, Any], config: dict[str, int]) -> torch.Tensor:
        from codesign.kernels.df11.linear import df11_gemm

        with forced_config(self.table_op({}), config):
            return df11_gemm(inputs["packed"], inputs["x"], None, check=False)

    def reference(self, inputs: dict[str, Any]) -> torch.Tensor:
        return inputs["ref"]

    def tolerance(self, dtype: torch.dtype) -> float:
        return TOLERANCE


def synthetic_weight(n: int, k: int) -> torch.Tensor:
    """The DF11 adapters' weight [n, k]: bf16 with std 0.02 (as trained linear layers), fixed per (n, k)."""
    return (torch.randn(n, k, generator=seeded(n * 7919 + k), dtype=torch.float64) * 0.02).to(torch.bfloat16)


@functools.lru_cache(maxsize=2)
def _packed_weight(n: int, k: int, seg: int | None, chunk_bytes: int | None = None,
                   chunks_per_group: int | None = None) -> tuple[torch.Tensor, Any]:  # fmt: skip
    """(W bf16 [n, k] with std 0.02, its PackedDF11 on the CPU): the codec's chunk geometry unless given,
    with the row-segment index of `seg` columns when seg is not None."""
    from codesign.kernels.df11 import codec
    from codesign.kernels.df11.linear import PackedDF11

    w = synthetic_weight(n, k)
    geometry = {"chunk_bytes": chunk_bytes, "chunks_per_group": chunks_per_group}
    df = codec.compress(w, **{name: v for name, v in geometry.items() if v is not None})
    return w, PackedDF11(df, "cpu", segment=seg)


class BitExactDecode:
    """The decoders' check (both layouts): the weight's own bits (`inputs["bits"]`), tolerance 0, written into
    an output (`inputs["out"]`) that first holds their complement, so any element left unwritten shows."""

    def poison(self, inputs: dict[str, Any]) -> None:
        inputs["out"].copy_(~inputs["bits"].to(inputs["out"].device))

    def reference(self, inputs: dict[str, Any]) -> torch.Tensor:
        return inputs["bits"].double()

    def tolerance(self, dtype: torch.dtype) -> float:
        return 0.0  # lossless: the decoded bits are the weight's bits


class DF11Decode(BitExactDecode):
    """df11_decode: the two-phase decoder's bf16 bits of W [N, K] (`PackedDF11.decode_into`), bit-exact.

    Shape: N, K, optionally chunk_bytes and chunks_per_group (the container geometry; default the codec's,
    which `compress_model_` uses). Table op "df11_decode", key (chunk_bytes, chunks_per_group), bucketed
    dimension N * K (the weights decoded). Tuned: num_warps; the lanes per program are the container's
    chunks_per_group, fixed when it was compressed. The reference is W's own bits (tolerance 0).
    """

    default_trial = True  # run(inputs, {}) is the untuned default (forced_config merges over it)

    name = "df11_decode"
    source_modules = ("codesign.kernels.df11.triton_decode",)

    def __init__(self) -> None:
        from codesign.kernels.df11 import codec, triton_decode  # unavailable kernel -> ImportError

        self.kernel = triton_decode

        self.defaults = {
            "chunk_bytes": codec.DEFAULT_CHUNK_BYTES,
            "chunks_per_group": codec.DEFAULT_CHUNKS_PER_GROUP,
        }

    def _geometry(self, shape: Shape) -> tuple[int, int]:
        g = {**self.defaults, **shape}
        return g["chunk_bytes"], g["chunks_per_group"]

    def check_shape(self, shape: Shape) -> None:
        allowed = {"N", "K", "chunk_bytes", "chunks_per_group"}
        if not {"N", "K"} <= set(shape) <= allowed or min(shape.values()) < 1:
            raise CodesignError(
                f"shape for {self.name}: expected positive dims N, K (and chunk_bytes, chunks_per_group); "
                f"got {shape}"
            )

    def table_op(self, shape: Shape) -> str:
        return self.kernel.GEMV_OP if self.name == "df11_gemv" else self.kernel.DECODE_OP

    def table_key(self, shape: Shape) -> str:
        return self.kernel.table_key(*self._geometry(shape))

    def m(self, shape: Shape) -> int:
        return shape["N"] * shape["K"]

    def space(self, shape: Shape, dtype: torch.dtype, on_gpu: bool) -> ConfigSpace:
        lanes = self._geometry(shape)[1]
        # One lane per chunk: warps beyond lanes / 32 would only hold copies of the same lanes.
        return ConfigSpace(
            params={"num_warps": [1, 2, 4, 8, 16] if on_gpu else [1, 2]},
            valid=lambda c: 32 * c["num_warps"] <= max(32, lanes),
            resources=lambda c: Resources(0, 12 * max(1, lanes // (32 * c["num_warps"])) + 40),
        )

    def make_inputs(self, shape: Shape, dtype: torch.dtype, device: Any, seed: int) -> dict[str, Any]:
        w, packed_cpu = _packed_weight(shape["N"], shape["K"], None, *self._geometry(shape))
        packed = copy.deepcopy(packed_cpu).to(device)
        out = torch.empty(packed.numel, dtype=torch.int16, device=device)
        return {"packed": packed, "out": out, "bits": w.view(torch.int16).reshape(-1), "w": w}

    def input_bytes(self, inputs: dict[str, Any]) -> int:
        return int(inputs["packed"].nbytes)

    def run(self, inputs: dict[str, Any], config: dict[str, int]) -> torch.Tensor:
        from codesign.backend import use_backend

        with use_backend("triton", op="df11_decode"), forced_config(self.table_op({}), config):
            inputs["packed"].decode_into(inputs["out"], check=False)
        return inputs["out"]


class DF11Gemv(DF11Decode):
    """df11_gemv: y[N] = W[N, K] @ x[K] with W decoded in registers (`df11.linear.df11_gemv`), M = 1.

    Same shape, key and space as df11_decode (table op "df11_gemv"); x is bf16 (the kernel moves bf16
    bits, so it also runs in the interpreter); the reference is W @ x in fp64; the output is bf16.
    """

    name = "df11_gemv"

    def __init__(self) -> None:
        super().__init__()
        from codesign.kernels.df11.linear import df11_gemv  # noqa: F401

    def make_inputs(self, shape: Shape, dtype: torch.dtype, device: Any, seed: int) -> dict[str, Any]:
        inputs = super().make_inputs(shape, dtype, device, seed)
        x = torch.randn(shape["K"], generator=seeded(seed), dtype=torch.float64).to(torch.bfloat16)
        return {**inputs, "x": x.to(device), "ref": inputs["w"].double() @ x.double()}

    def input_bytes(self, inputs: dict[str, Any]) -> int:
        return int(inputs["packed"].nbytes) + inputs["x"].numel() * 2

    def poison(self, inputs: dict[str, Any]) -> None:
        pass  # y is zeroed by the launcher: a config that writes nothing returns zeros (relative error 1)

    def run(self, inputs: dict[str, Any], config: dict[str, int]) -> torch.Tensor:
        from codesign.kernels.df11.linear import df11_gemv

        with forced_config(self.table_op({}), config):
            return df11_gemv(inputs["packed"], inputs["x"], None, check=False)

    def reference(self, inputs: dict[str, Any]) -> torch.Tensor:
        return inputs["ref"]

    def tolerance(self, dtype: torch.dtype) -> float:
        return TOLERANCE


register(TABLE_OP, DF11Gemm)
register("df11_decode", DF11Decode)
register("df11_gemv", DF11Gemv)
