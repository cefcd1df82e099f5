"""The rows layout on a device: the torch op codesign::df11_rows_decode, `PackedDF11Rows`, `df11_rows_gemv`.

`PackedDF11Rows` is the rows-layout sibling of `linear.PackedDF11` (same `decode_into` / `decode` / `nbytes`
face, so `LosslessBF16Linear` and `df11_linear` hold either). The decode op's backends (op name
"df11_rows_decode", see `codesign.backend`): "triton" is `df11.triton_rows` (CUDA, or CPU through the
interpreter); "torch" is the numba decoder of `df11.rows` (CUDA tensors go through host memory).
`df11_rows_gemv(packed, x)` is the fused path for 1..4 rows of x: no decompressed weight, fp32 sums.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from codesign.backend import device_view, resolve_backend
from codesign.kernels.df11 import rows
from codesign.kernels.df11 import triton_rows as tr
from codesign.specs import CodesignError

OP = "df11_rows_decode"


@torch.library.custom_op("codesign::df11_rows_decode", mutates_args=("out", "err"))
def _rows_decode_op(
    stream: torch.Tensor,
    sign_mantissa: torch.Tensor,
    row_offsets: torch.Tensor,
    lane_offsets: torch.Tensor,
    luts: torch.Tensor,
    out: torch.Tensor,
    err: torch.Tensor,
    n: int,
    k: int,
    lanes: int,
    levels: int,
    rows_per_prog: int,
    lanes_per_prog: int,
    num_warps: int,
) -> None:
    if resolve_backend(OP, out.device) == "triton":
        s = tr.RowsStream(stream, sign_mantissa, row_offsets, lane_offsets, luts, n, k, lanes, levels)
        cfg = {"ROWS": rows_per_prog, "LANES": lanes_per_prog, "num_warps": num_warps}
        tr.rows_decode_triton(s, out, err, cfg)
        return
    bits = np.empty(out.numel(), np.uint16)
    bad = rows.decode_rows_arrays(stream.cpu().numpy(), sign_mantissa.cpu().numpy(),
                                  row_offsets.cpu().numpy().view(np.uint32),
                                  lane_offsets.cpu().numpy().view(np.uint16).reshape(n, lanes), luts.cpu().numpy(),
                                  levels, k, bits)  # fmt: skip
    err.zero_()
    if bad:
        err[0] = 1
        return
    out.copy_(torch.from_numpy(bits.view(np.int16)).to(out.device))


@_rows_decode_op.register_fake
def _(stream, sign_mantissa, row_offsets, lane_offsets, luts, out, err, n, k, lanes, levels, rows_per_prog,
      lanes_per_prog, num_warps) -> None:  # fmt: skip
    return None


def decode_out_bits(out: torch.Tensor, device: torch.device, numel: int) -> torch.Tensor:
    """The int16 view of a decoder's output buffer `out` (bf16 or int16, contiguous, on `device`, at least
    `numel` elements), its first `numel` elements; CodesignError naming `out` otherwise. Both layouts' decoders."""
    if not isinstance(out, torch.Tensor) or out.dtype not in (torch.bfloat16, torch.int16):
        raise CodesignError(f"out must be a bf16 or int16 tensor, got {getattr(out, 'dtype', type(out))}")
    if out.device != device or not out.is_contiguous() or out.numel() < numel:
        raise CodesignError(
            f"out must be a contiguous tensor on {device} with >= {numel} elements, "
            f"got {tuple(out.shape)} on {out.device}"
        )
    return out.view(torch.int16).reshape(-1)[:numel]


class PackedDF11Rows(nn.Module):
    """A `rows.DF11Rows` as device buffers (moved by `.to()`), decodable by `codesign::df11_rows_decode`.

    The u32 stream words, sign/mantissa words and row offsets and the u16 lane offsets are held as int32 / int16
    bit patterns (the kernels mask them).
    """

    layout = "rows"

    def __init__(self, df: rows.DF11Rows, device: torch.device | str | None = None) -> None:
        super().__init__()
        if not isinstance(df, rows.DF11Rows):
            raise CodesignError(f"PackedDF11Rows needs a rows.DF11Rows, got {type(df).__name__}")
        self.shape = tuple(df.shape)
        self.numel = df.numel
        self.lanes = df.lanes
        self.levels = df.levels
        self.max_code_len = df.max_code_len
        self.nbytes = df.nbytes
        self.code_lengths = df.code_lengths.copy()
        self.register_buffer("stream", torch.from_numpy(df.stream.view(np.int32).copy()).to(device))
        self.register_buffer(
            "sign_mantissa", torch.from_numpy(df.sign_mantissa.view(np.int32).copy()).to(device)
        )
        self.register_buffer("row_offsets", torch.from_numpy(df.row_offsets.view(np.int32).copy()).to(device))
        lane_bits = df.lane_offsets.reshape(-1).view(np.int16).copy()
        self.register_buffer("lane_offsets", torch.from_numpy(lane_bits).to(device))
        luts = rows.build_rows_luts(df.code_lengths)
        self.register_buffer("luts", torch.from_numpy(luts).to(device))

    @property
    def bits_per_weight(self) -> float:
        return 8 * self.nbytes / self.numel if self.numel else float("nan")

    def kernel_stream(self) -> tr.RowsStream:
        """The container's buffers and geometry as the Triton kernels take them."""
        n, k = self.shape
        return tr.RowsStream(self.stream, self.sign_mantissa, self.row_offsets, self.lane_offsets, self.luts, n, k,
                             self.lanes, self.levels)  # fmt: skip

    def container(self) -> rows.DF11Rows:
        """The host container again (validated), e.g. for `to_bytes()`."""
        n = self.shape[0]
        return rows.DF11Rows(self.shape, self.code_lengths.copy(), self.stream.cpu().numpy().view(np.uint32).copy(),
                             self.row_offsets.cpu().numpy().view(np.uint32).copy(),
                             self.lane_offsets.cpu().numpy().view(np.uint16).reshape(n, self.lanes).copy(),
                             self.sign_mantissa.cpu().numpy().view(np.uint32).copy(), self.max_code_len)  # fmt: skip

    def to_bytes(self) -> bytes:
        """The CRC32-checked rows container (`rows.DF11Rows.to_bytes`)."""
        return self.container().to_bytes()

    @classmethod
    def from_bytes(cls, data: bytes, device: torch.device | str | None = None) -> PackedDF11Rows:
        """Parse and validate a rows container onto `device`; CodesignError on a corrupt one."""
        return cls(rows.DF11Rows.from_bytes(data), device)

    def decode_into(self, out: torch.Tensor, check: bool = True) -> torch.Tensor:
        """Decode into `out` (bf16 or int16, >= numel elements, on the buffers' device); returns the bf16
        weight view of shape `self.shape`. check: raise CodesignError on a corrupt stream (a host sync)."""
        bits = decode_out_bits(out, self.stream.device, self.numel)
        if self.numel:
            s = self.kernel_stream()
            cfg = tr.launch_config(tr.DECODE_OP, s, self.numel, out.device)
            g = tr.launch_grid(s, cfg)
            err = torch.zeros(g[0] * g[1], dtype=torch.int32, device=out.device)
            _rows_decode_op(self.stream, self.sign_mantissa, self.row_offsets, self.lane_offsets, self.luts, bits,
                            err, s.n, s.k, s.lanes, s.levels, int(cfg["ROWS"]), int(cfg["LANES"]),
                            int(cfg["num_warps"]))  # fmt: skip
            if check and int(err.max()) != 0:
                raise CodesignError("df11 rows stream is corrupt: a lane did not decode to its stored bytes")
        return bits.view(torch.bfloat16).view(self.shape)

    def decode(self, check: bool = True) -> torch.Tensor:
        """Decode into a fresh bf16 tensor of `self.shape`."""
        return self.decode_into(torch.empty(self.numel, dtype=torch.int16, device=self.stream.device), check)


def df11_rows_gemv(
    packed: PackedDF11Rows, x: torch.Tensor, bias: torch.Tensor | None = None, check: bool = True
) -> torch.Tensor:
    """y = x @ W^T (+ bias) for bf16 x [..., K] with 1..4 rows, W [N, K] in the rows layout decoded in registers.

    fp32 sums (bound in `df11.triton_rows`), one bf16 rounding of the result; bf16 [..., N]. Runs the Triton
    kernel: CUDA tensors, or CPU tensors under the interpreter.
    """
    if not isinstance(packed, PackedDF11Rows):
        raise CodesignError(f"df11_rows_gemv needs a PackedDF11Rows, got {type(packed).__name__}")
    n, k = packed.shape
    if not isinstance(x, torch.Tensor) or x.dtype != torch.bfloat16:
        raise CodesignError(f"x must be a bf16 tensor, got {getattr(x, 'dtype', type(x))}")
    if x.dim() < 1 or x.shape[-1] != k or not 1 <= x.numel() // max(k, 1) <= tr.GEMV_MAX_M:
        raise CodesignError(f"x must be [..., {k}] with 1..{tr.GEMV_MAX_M} rows, got shape {tuple(x.shape)}")
    if x.device != packed.stream.device:
        raise CodesignError(f"x is on {x.device} but the weight is on {packed.stream.device}")
    if bias is not None and (bias.shape != (n,) or bias.dtype != torch.bfloat16):
        raise CodesignError(f"bias must be bf16 of shape [{n}], got {bias.dtype} {tuple(bias.shape)}")
    if not device_view(x.device).triton_runs:
        raise CodesignError(
            "df11_rows_gemv runs a Triton kernel: CUDA tensors, or CPU with TRITON_INTERPRET=1"
        )
    x2 = x.reshape(-1, k).contiguous()
    s = packed.kernel_stream()
    cfg = tr.launch_config(tr.GEMV_OP, s, x2.shape[0], x.device)
    g = tr.launch_grid(s, cfg)
    y = (torch.zeros if g[1] > 1 else torch.empty)((x2.shape[0], n), dtype=torch.float32, device=x.device)
    err = torch.zeros(g[0] * g[1], dtype=torch.int32, device=x.device)
    tr.rows_gemv_triton(s, x2.view(torch.int16), y, err, cfg)
    if check and err.numel() and int(err.max()) != 0:
        raise CodesignError("df11 rows stream is corrupt: a lane did not decode to its stored bytes")
    if bias is not None:
        y = y + bias.float()
    return y.to(torch.bfloat16).reshape(*x.shape[:-1], n)
