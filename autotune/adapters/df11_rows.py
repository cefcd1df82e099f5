"""Tunable adapters for the DF11 rows layout's kernels (`df11.triton_rows`): its decoder (`RowsDecode`, op
"df11_rows_decode") and its fused GEMV for 1..GEMV_MAX_M rows of x (`RowsGemv`, op "df11_rows_gemv").

Shape: N, K (the weight [N, K]), optionally lanes (the layout's L; default `rows.auto_lanes(N, K)`, what
`LosslessBF16Config(layout="rows")` compresses with); the GEMV also M (rows of x, 1..GEMV_MAX_M). The table
ops are the kernels' own (`triton_rows.DECODE_OP` / `GEMV_OP`), key `triton_rows.table_key(N, K, L)`; the
bucketed dimension is N * K for the decoder (what `PackedDF11Rows.decode_into` looks up with), M for the GEMV.
Tuned (`triton_rows.launch_config`): LANES (lanes per program, a power of two dividing L; below L a row is
split over L / LANES programs, met in fp32 atomics by the GEMV), ROWS (rows per program, a power of two),
num_warps. The weight (`df11.synthetic_weight`) is compressed once per (N, K, L) and copied per call.

Decode: the weight's own bits (tolerance 0) into an output holding their complement. GEMV: the kernel's fp32
y against x @ W^T in fp64, elementwise within the kernel's stated bound gamma_d sum_k |w_k x_k|
(`triton_rows.gemv_error_bound` at the config's LANES): `checked_output` keeps only the excess over the
bound, so the tolerance is 0 and one element past its bound fails.
"""

from __future__ import annotations

import copy
import functools
from typing import Any

import torch

from codesign.autotune.adapters.common import pow2_cap, seeded
from codesign.autotune.adapters.df11 import BitExactDecode, synthetic_weight
from codesign.autotune.lookup import forced_config
from codesign.autotune.ops import Shape, register
from codesign.autotune.space import ConfigSpace, Resources
from codesign.specs.errors import CodesignError

_POW2 = (1, 2, 4, 8, 16, 32, 64, 128, 256)
# Registers per thread ~ (14 + 2.5 M) per lane element it holds + 16, M the GEMV's rows of x (0: decode), fit to
# ptxas for sm_90 (Triton 3.9, N = K = 4096): decode 32 / 52 / 70 / 138 / 255 + spills at 1 / 2 / 4 / 8 / 16
# elements a thread, GEMV M = 4 32 / 58 / 125 / 203 / 255 + 1.8 KB of spills; pruned past 255 (spills of KBs).
_REGS_PER_ELEMENT = 14
_REGS_PER_X_ROW = 2.5
# The fp64 reference's own rounding, relative to sum |w x| (K terms, unit roundoff 2^-53).
_FP64_U = 2.0**-53


class RowsDecode(BitExactDecode):
    """df11_rows_decode: the bf16 bits of W [N, K] decoded by `PackedDF11Rows.decode_into`, bit-exact."""

    default_trial = True  # run(inputs, {}) is the untuned default (forced_config merges over it)

    name = "df11_rows_decode"
    dims: tuple[str, ...] = ("N", "K")
    source_modules = ("codesign.kernels.df11.triton_rows",)

    def __init__(self) -> None:
        from codesign.kernels.df11 import packed_rows, rows  # unavailable kernel -> ImportError
        from codesign.kernels.df11 import triton_rows as tr

        self.rows, self.tr, self.backend_op = rows, tr, packed_rows.OP

    def lanes(self, shape: Shape) -> int:
        """The layout's L for `shape`: its lanes dim, else what compression picks for [N, K]."""
        return shape.get("lanes") or self.rows.auto_lanes(shape["N"], shape["K"])

    def check_shape(self, shape: Shape) -> None:
        if not set(self.dims) <= set(shape) <= {*self.dims, "lanes"} or min(shape.values()) < 1:
            raise CodesignError(
                f"shape for {self.name}: expected positive dims {', '.join(self.dims)} (and lanes); got {shape}"
            )
        lanes = shape.get("lanes", 1)
        if lanes > self.rows.MAX_LANES or lanes & (lanes - 1):
            raise CodesignError(
                f"shape for {self.name}: lanes must be a power of two in 1..{self.rows.MAX_LANES}; got {shape}"
            )

    def table_op(self, shape: Shape) -> str:
        return self.tr.DECODE_OP

    def table_key(self, shape: Shape) -> str:
        return self.tr.table_key(shape["N"], shape["K"], self.lanes(shape))

    def m(self, shape: Shape) -> int:
        return shape["N"] * shape["K"]

    def accumulators(self, shape: Shape) -> int:
        return 0

    def space(self, shape: Shape, dtype: torch.dtype, on_gpu: bool) -> ConfigSpace:
        lanes = self.lanes(shape)
        cap_rows = pow2_cap(shape["N"], 1)
        params = (
            {"LANES": [v for v in _POW2 if min(lanes, 4) <= v <= lanes], "ROWS": [1, 2, 4, 8, 16, 32, 64],
             "num_warps": [1, 2, 4, 8]}
            if on_gpu  # the interpreter: a whole row per program and a row split in two (the GEMV's atomics)
            else {"LANES": sorted({lanes, max(1, lanes // 2)}), "ROWS": [min(8, cap_rows)], "num_warps": [1]}
        )  # fmt: skip
        acc = self.accumulators(shape)  # fp32 accumulators per lane element: M for the GEMV

        def valid(c: dict[str, int]) -> bool:
            # Larger ROWS than next_pow2(N) only repeat one row block with more masked rows; warps beyond
            # ROWS * LANES / 32 would only hold copies of the same elements.
            per = c["ROWS"] * c["LANES"]
            return c["ROWS"] <= cap_rows and (c["num_warps"] == 1 or per >= 32 * c["num_warps"])

        def resources(c: dict[str, int]) -> Resources:
            per_thread = max(1, c["ROWS"] * c["LANES"] // (32 * c["num_warps"]))
            return Resources(0, int((_REGS_PER_ELEMENT + _REGS_PER_X_ROW * acc) * per_thread) + 16)

        return ConfigSpace(params=params, valid=valid, resources=resources)

    def make_inputs(self, shape: Shape, dtype: torch.dtype, device: Any, seed: int) -> dict[str, Any]:
        w, packed_cpu = _rows_weight(shape["N"], shape["K"], self.lanes(shape))
        packed = copy.deepcopy(packed_cpu).to(device)
        out = torch.empty(packed.numel, dtype=torch.int16, device=device)
        return {"packed": packed, "out": out, "bits": w.view(torch.int16).reshape(-1), "w": w}

    def input_bytes(self, inputs: dict[str, Any]) -> int:
        return int(inputs["packed"].nbytes)

    def run(self, inputs: dict[str, Any], config: dict[str, int]) -> Any:
        from codesign.backend import use_backend

        with use_backend("triton", op=self.backend_op), forced_config(self.tr.DECODE_OP, config):
            inputs["packed"].decode_into(inputs["out"], check=False)
        return inputs["out"]


class RowsGemv(RowsDecode):
    """df11_rows_gemv: y[M, N] = x[M, K] @ W[N, K]^T in fp32 for M <= GEMV_MAX_M, W decoded in registers.

    x is bf16 (the kernel moves bf16 bits, so it also runs in the interpreter) whatever the tuner's dtype;
    `run` launches `triton_rows.rows_gemv_triton` into the adapter's own y (NaN-poisoned; zeroed first when the
    config splits rows, as `df11_rows_gemv` allocates it) and returns (y, the config's LANES).
    """

    name = "df11_rows_gemv"
    dims = ("M", "N", "K")

    def check_shape(self, shape: Shape) -> None:
        super().check_shape(shape)
        if shape["M"] > self.tr.GEMV_MAX_M:
            raise CodesignError(f"shape for {self.name}: M must be 1..{self.tr.GEMV_MAX_M}; got {shape}")

    def table_op(self, shape: Shape) -> str:
        return self.tr.GEMV_OP

    def m(self, shape: Shape) -> int:
        return shape["M"]

    def accumulators(self, shape: Shape) -> int:
        return shape["M"]  # one fp32 accumulator per row of x per lane element

    def make_inputs(self, shape: Shape, dtype: torch.dtype, device: Any, seed: int) -> dict[str, Any]:
        w, packed_cpu = _rows_weight(shape["N"], shape["K"], self.lanes(shape))
        x = torch.randn(shape["M"], shape["K"], generator=seeded(seed), dtype=torch.float64).to(
            torch.bfloat16
        )
        return {
            "packed": copy.deepcopy(packed_cpu).to(device),
            "x_bits": x.view(torch.int16).to(device),
            "y": torch.empty(shape["M"], shape["N"], dtype=torch.float32, device=device),
            "ref": x.double() @ w.double().T,
            "abs": x.double().abs() @ w.double().abs().T,  # sum_k |w_k x_k|: the bound's scale per element
        }

    def input_bytes(self, inputs: dict[str, Any]) -> int:
        return int(inputs["packed"].nbytes) + inputs["x_bits"].numel() * 2

    def poison(self, inputs: dict[str, Any]) -> None:
        inputs["y"].fill_(float("nan"))

    def run(self, inputs: dict[str, Any], config: dict[str, int]) -> tuple[torch.Tensor, int]:
        tr, y = self.tr, inputs["y"]
        s = inputs["packed"].kernel_stream()
        with forced_config(tr.GEMV_OP, config):  # merged over the default and validated like a table entry
            cfg = tr.launch_config(tr.GEMV_OP, s, y.shape[0], y.device)
        grid = tr.launch_grid(s, cfg)
        if grid[1] > 1:  # split rows meet in atomics
            y.zero_()
        err = torch.zeros(grid[0] * grid[1], dtype=torch.int32, device=y.device)
        tr.rows_gemv_triton(s, inputs["x_bits"], y, err, cfg)
        return y, int(cfg["LANES"])

    def checked_output(self, inputs: dict[str, Any], out: tuple[torch.Tensor, int]) -> torch.Tensor:
        """ref + each element's excess over gamma_d sum_k |w_k x_k| (0 within it; NaN stays NaN)."""
        y, group_lanes = out
        n_lanes, k = inputs["packed"].lanes, inputs["packed"].shape[1]
        gamma = self.tr.gemv_error_bound(k, n_lanes, group_lanes) + k * _FP64_U
        ref = inputs["ref"]
        err = y.detach().to("cpu", torch.float64) - ref
        return ref + err.sign() * (err.abs() - gamma * inputs["abs"]).clamp_min(0)

    def reference(self, inputs: dict[str, Any]) -> torch.Tensor:
        return inputs["ref"]

    def tolerance(self, dtype: torch.dtype) -> float:
        return 0.0  # the bound is applied elementwise by checked_output


@functools.lru_cache(maxsize=2)
def _rows_weight(n: int, k: int, lanes: int) -> tuple[torch.Tensor, Any]:
    """(W bf16 [n, k], its PackedDF11Rows with `lanes` lanes on the CPU)."""
    from codesign.kernels.df11 import rows
    from codesign.kernels.df11.packed_rows import PackedDF11Rows

    w = synthetic_weight(n, k)
    return w, PackedDF11Rows(rows.compress_rows(w, lanes=lanes), "cpu")


register("df11_rows_decode", RowsDecode)
register("df11_rows_gemv", RowsGemv)
