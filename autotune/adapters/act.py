"""Tunable adapter for the per-token activation quantizer of the W8A8 / FP8 GEMMs (`quantize_per_token`).

Shape: M (tokens), K (row length). The kernel (`gemm.triton_gemm.quantize_per_token`, table op
"quantize_per_token", key K) runs one program per row over K in BLOCK_K chunks, twice (absmax,
then quantize); BLOCK_K and num_warps are tuned. The int8 quantizer is timed; the fp8 one shares
the table (same loop, another rounding). Correctness is bit-exact: codes and scales must equal
`gemm.formats.quantize_per_token` (the check compares both, concatenated, with tolerance 0).
"""

from __future__ import annotations

from typing import Any

import torch

from codesign.autotune.adapters.common import need_dims, pow2_cap, seeded
from codesign.autotune.lookup import forced_config
from codesign.autotune.ops import Shape, register
from codesign.autotune.space import ConfigSpace, Resources

TABLE_OP = "quantize_per_token"  # the registered name: the kernel's table (`triton_gemm.ACT_TABLE_OP`)


class ActQuant:
    """quantize_per_token: q[m, k] = round(x[m, k] / s[m]), s[m] = absmax(x[m, :]) / 127 (int8)."""

    default_trial = True  # run(inputs, {}) is the untuned default (forced_config merges over it)

    name = TABLE_OP
    source_modules = ("codesign.kernels.gemm.triton_gemm",)

    def __init__(self) -> None:
        from codesign.kernels.gemm import triton_gemm  # unavailable kernel -> ImportError

        self.kernel = triton_gemm

    def check_shape(self, shape: Shape) -> None:
        need_dims(shape, ("M", "K"), self.name)

    def table_op(self, shape: Shape) -> str:
        return self.kernel.ACT_TABLE_OP

    def table_key(self, shape: Shape) -> str:
        return self.kernel.act_table_key(shape["K"])

    def m(self, shape: Shape) -> int:
        return shape["M"]

    def space(self, shape: Shape, dtype: torch.dtype, on_gpu: bool) -> ConfigSpace:
        params = (
            {"BLOCK_K": [256, 512, 1024, 2048, 4096, 8192], "num_warps": [1, 2, 4, 8, 16]}
            if on_gpu
            else {"BLOCK_K": [128, 256, 512], "num_warps": [4]}
        )
        # The launcher clamps BLOCK_K to next_pow2(K): larger values repeat that config.
        cap = max(pow2_cap(shape["K"]), min(params["BLOCK_K"]))
        # One row chunk in registers: BLOCK_K fp32 values over 32 * num_warps threads, plus ~56 of state
        # (ptxas, sm_90: 184 at BLOCK_K 4096 on one warp, 29-32 at 256-1024).
        return ConfigSpace(
            params=params,
            valid=lambda c: c["BLOCK_K"] <= cap,
            resources=lambda c: Resources(0, c["BLOCK_K"] // (32 * c["num_warps"]) + 56),
        )

    def make_inputs(self, shape: Shape, dtype: torch.dtype, device: Any, seed: int) -> dict[str, Any]:
        from codesign.kernels.gemm import formats as qf

        x = (torch.randn(shape["M"], shape["K"], generator=seeded(seed)) * 3).to(dtype)
        x[0, :] = 0  # an all-zero row: scale 1, codes 0
        q_ref, s_ref = qf.quantize_per_token(x, "int8")
        return {
            "x": x.to(device),
            "q": torch.empty(shape["M"], shape["K"], dtype=torch.int8, device=device),
            "s": torch.empty(shape["M"], dtype=torch.float32, device=device),
            "ref": torch.cat([q_ref.double().reshape(-1), s_ref.double()]),
        }

    def input_bytes(self, inputs: dict[str, Any]) -> int:
        return inputs["x"].numel() * inputs["x"].element_size()

    def poison(self, inputs: dict[str, Any]) -> None:
        inputs["q"].fill_(-128)  # never produced: codes clamp at -127
        inputs["s"].fill_(float("nan"))

    def run(self, inputs: dict[str, Any], config: dict[str, int]) -> torch.Tensor:
        from codesign.kernels.gemm.triton_gemm import quantize_per_token

        with forced_config(self.table_op({}), config):
            quantize_per_token(inputs["x"], False, inputs["q"], inputs["s"])
        return inputs["q"]

    def checked_output(self, inputs: dict[str, Any], out: torch.Tensor) -> torch.Tensor:
        return torch.cat([out.double().reshape(-1), inputs["s"].double()]).cpu()

    def reference(self, inputs: dict[str, Any]) -> torch.Tensor:
        return inputs["ref"]

    def tolerance(self, dtype: torch.dtype) -> float:
        return 0.0  # integer codes and a scale computed the same way: bit-exact (test_quant_gemm)


register(TABLE_OP, ActQuant)
