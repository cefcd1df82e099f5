"""Lossless BF16 linear layers: DFloat11-style weights decoded into a shared buffer right before each GEMM.

`compress_model_(model, filter_fn, config)` swaps each selected BF16 `nn.Linear` for a
`LosslessBF16Linear` holding only the compressed weight (about 70% of BF16, see `df11.codec`). All
layers of a model share one `DecodeWorkspace`, sized to the largest layer, so the uncompressed weights
of at most one layer are resident at a time: forward = decode into the workspace, then `F.linear` on
that exact BF16 weight, so outputs are bit-identical (`torch.equal`) to the uncompressed layer.

The decode is the torch op `codesign::df11_decode` (mutates `out`, `err`). Backends (see
`codesign.backend`, op name "df11_decode"): "triton" is `df11.triton_decode` (CUDA tensors, or CPU tensors
through the interpreter); "torch" is the CPU numba decoder of `df11.codec` (CUDA tensors go through
host memory: correct but slow). "auto" picks triton on CUDA, torch on CPU.

`df11_gemv(packed, x)` is the decode-step alternative for one row x: the Triton kernel decodes the
weight in registers and never writes it (fp32 sums: close to, not bit-identical with, F.linear).
`df11_gemm(packed, x)` (`df11.triton_gemm`) does the same for a few rows: tiles decoded in registers.

Which path runs is chosen in one place, `choose_path(m, backend, exact)`, used by `df11_linear` and
by the layer's forward:
    exact (default)            decode into the shared buffer + F.linear: bit-identical to nn.Linear
    not exact, triton, M == 1  fused GEMV (`df11_gemv`)
    not exact, triton, M <= FUSED_MAX_M   fused tile GEMM (`df11_gemm`), never a decompressed weight
    otherwise                  the buffer path (at larger M the GEMM is compute-bound and one decode
                               per layer is amortised over the rows)
With `LosslessBF16Config(layout="rows")` the weight is a `PackedDF11Rows` (`df11.rows`: per-(row, lane)
streams, decoded with no scan) and the fused path is `df11_rows_gemv` for 1 <= M <= 4; the exact path is
the same decode-into-buffer + F.linear (its decode: the op `codesign::df11_rows_decode`).
The fused paths sum in fp32 in their own order: within fp32 rounding of the fp64 reference, not
bit-identical to F.linear (see `df11.triton_gemm` for what they are exact against).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from codesign.backend import capturing, device_view, resolve_backend
from codesign.kernels.df11 import codec, rows
from codesign.kernels.df11 import triton_decode as dt
from codesign.kernels.df11 import triton_gemm as fused
from codesign.kernels.df11 import triton_rows as tr
from codesign.kernels.df11.packed_rows import PackedDF11Rows, decode_out_bits, df11_rows_gemv
from codesign.specs import CodesignError, WeightFormat

OP = "df11_decode"
LINEAR_OP = "df11_linear"
# Up to 16 rows the fused tile GEMM does x-row FMAs per decoded weight on CUDA cores; beyond that the
# work per weight grows with M while the buffer path's decode is paid once. Untuned (no GPU numbers).
FUSED_MAX_M = 16
LAYOUTS = ("flat", "rows")


@dataclass(frozen=True)
class LosslessBF16Config:
    """How `compress_model_` compresses weights (codec parameters; see `df11.codec`).

    check: after each decode, read the kernel's per-group error flags (one host sync per layer) and
    raise on a corrupt stream. Set False only for streams already validated (e.g. CUDA-graph capture).
    exact: True (default) always decodes into the shared buffer and runs F.linear, so outputs are
    bit-identical to nn.Linear; False lets `choose_path` pick the fused GEMV / tile GEMM for small M
    (fp32 sums in another order) and packs the row-segment index those need (`segment` columns per
    entry: 64 / segment bits per weight more).
    layout: "flat" (default: the chunked stream of `df11.codec`) or "rows" (`df11.rows`: per-(row, lane)
    streams, no scan; its fused path is `df11_rows_gemv` for M <= 4). lanes: the rows layout's lanes per
    row (None: `rows.auto_lanes(N, K)`, 32 unless N is small, where more lanes split K over more programs, or
    K < 256, where fewer keep >= 8 codes a lane).
    """

    max_code_len: int | None = None  # None: the layout's default (flat 16, rows 12: its one-load table)
    chunk_bytes: int = codec.DEFAULT_CHUNK_BYTES
    chunks_per_group: int = codec.DEFAULT_CHUNKS_PER_GROUP
    check: bool = True
    exact: bool = True
    segment: int = fused.DEFAULT_SEGMENT
    layout: str = "flat"
    lanes: int | None = None

    def __post_init__(self) -> None:
        if self.layout not in LAYOUTS:
            raise CodesignError(f"layout must be one of {LAYOUTS}, got {self.layout!r}")


# ----------------------------------------------------------------------------- the decode op


@torch.library.custom_op("codesign::df11_decode", mutates_args=("out", "err"))
def _df11_decode_op(
    stream: torch.Tensor,
    sign_mantissa: torch.Tensor,
    gaps: torch.Tensor,
    group_offsets: torch.Tensor,
    luts: torch.Tensor,
    out: torch.Tensor,
    err: torch.Tensor,
    total_bits: int,
    max_codes: int,
    chunk_bytes: int,
    chunks_per_group: int,
    levels: int,
) -> None:
    backend = resolve_backend(OP, out.device)
    if backend == "triton":
        s = dt.DF11Stream(stream, sign_mantissa, gaps, group_offsets, luts, total_bits, max_codes, chunk_bytes,
                          chunks_per_group, levels)  # fmt: skip
        dt.df11_decode_triton(s, out, err)
        return
    bits = np.empty(out.numel(), np.uint16)
    bad = codec.decode_arrays(stream.cpu().numpy(), sign_mantissa.cpu().numpy(), gaps.cpu().numpy(),
                              group_offsets.cpu().numpy(), luts.cpu().numpy(), levels, total_bits, chunk_bytes,
                              chunks_per_group, bits)  # fmt: skip
    err.zero_()
    if bad:
        err[bad - 1] = 1
        return
    out.copy_(torch.from_numpy(bits.view(np.int16)).to(out.device))


@_df11_decode_op.register_fake
def _(stream, sign_mantissa, gaps, group_offsets, luts, out, err, total_bits, max_codes, chunk_bytes,
      chunks_per_group, levels) -> None:  # fmt: skip
    return None


class PackedDF11(nn.Module):
    """A `DF11Tensor` as device buffers (moved by `.to()`), decodable by `codesign::df11_decode`.

    segment: also pack the row-segment index of the fused tile GEMM (`triton_gemm.segment_index`, 2-D
    weights only); `nbytes` then counts it (int64 per `segment` weights of a row).
    """

    layout = "flat"

    def __init__(self, df: codec.DF11Tensor, device: torch.device | str | None = None,
                 segment: int | None = None) -> None:  # fmt: skip
        super().__init__()
        self.shape = tuple(df.shape)
        self.numel = df.numel
        self.total_bits = df.total_bits
        self.max_codes = df.max_codes_per_chunk
        self.chunk_bytes = df.chunk_bytes
        self.chunks_per_group = df.chunks_per_group
        self.levels = df.levels
        self.nbytes = df.nbytes
        self.register_buffer("stream", torch.from_numpy(df.stream.copy()).to(device))
        self.register_buffer("sign_mantissa", torch.from_numpy(df.sign_mantissa.copy()).to(device))
        self.register_buffer("gaps", torch.from_numpy(df.gaps.copy()).to(device))
        self.register_buffer("group_offsets", torch.from_numpy(df.group_offsets.astype(np.int64)).to(device))
        luts = codec.build_luts(df.code_lengths).astype(np.int32).reshape(-1)
        self.register_buffer("luts", torch.from_numpy(luts).to(device))
        self.register_buffer(
            "err", torch.zeros(max(df.group_offsets.size - 1, 1), dtype=torch.int32, device=device)
        )
        self.segment = segment
        idx = None if segment is None else fused.segment_index(df, segment)
        self.register_buffer("seg_bits", None if idx is None else torch.from_numpy(idx).to(device))
        self.nbytes += 0 if idx is None else idx.nbytes

    def kernel_stream(self) -> dt.DF11Stream:
        """The container's buffers and geometry as the Triton kernels take them."""
        return dt.DF11Stream(self.stream, self.sign_mantissa, self.gaps, self.group_offsets, self.luts,
                             self.total_bits, self.max_codes, self.chunk_bytes, self.chunks_per_group,
                             self.levels)  # fmt: skip

    @property
    def bits_per_weight(self) -> float:
        return 8 * self.nbytes / self.numel if self.numel else float("nan")

    def decode_into(self, out: torch.Tensor, check: bool = True) -> torch.Tensor:
        """Decode into `out` (bf16 or int16, >= numel elements, on the buffers' device); returns the bf16
        weight view of shape `self.shape`. check: raise CodesignError on a corrupt stream (a host sync)."""
        bits = decode_out_bits(out, self.stream.device, self.numel)
        if self.numel:
            _df11_decode_op(self.stream, self.sign_mantissa, self.gaps, self.group_offsets, self.luts, bits,
                            self.err, self.total_bits, self.max_codes, self.chunk_bytes, self.chunks_per_group,
                            self.levels)  # fmt: skip
            if check and int(self.err.max()) != 0:
                bad = int(torch.nonzero(self.err)[0, 0])
                raise CodesignError(f"df11 stream is corrupt: group {bad} did not decode to its stored count")
        return bits.view(torch.bfloat16).view(self.shape)

    def decode(self, check: bool = True) -> torch.Tensor:
        """Decode into a fresh bf16 tensor of `self.shape`."""
        return self.decode_into(torch.empty(self.numel, dtype=torch.int16, device=self.stream.device), check)


def df11_gemv(
    packed: PackedDF11, x: torch.Tensor, bias: torch.Tensor | None = None, check: bool = True
) -> torch.Tensor:
    """y = W @ x (+ bias) for one bf16 row x [K] or [1, K], W [N, K] decoded in registers (Triton).

    The decode-step path: the weight never lands in memory (reads ~1.34 bytes/weight instead of 2).
    Accumulates in fp32 (order differs from F.linear: equal to the fp64 reference within fp32
    rounding, not bit-identical to cuBLAS), returns bf16 of x's shape with K replaced by N.
    Runs the Triton kernel: CUDA tensors, or CPU tensors under the interpreter.
    """
    if len(packed.shape) != 2:
        raise CodesignError(f"df11_gemv needs a 2-D weight, got shape {packed.shape}")
    n, k = packed.shape
    if not isinstance(x, torch.Tensor) or x.dtype != torch.bfloat16:
        raise CodesignError(f"x must be a bf16 tensor, got {getattr(x, 'dtype', type(x))}")
    if x.shape not in ((k,), (1, k)):
        raise CodesignError(f"x must have shape [{k}] or [1, {k}] (one row), got {tuple(x.shape)}")
    if x.device != packed.stream.device:
        raise CodesignError(f"x is on {x.device} but the weight is on {packed.stream.device}")
    if bias is not None and (bias.shape != (n,) or bias.dtype != torch.bfloat16):
        raise CodesignError(f"bias must be bf16 of shape [{n}], got {bias.dtype} {tuple(bias.shape)}")
    if not device_view(x.device).triton_runs:
        raise CodesignError("df11_gemv runs the Triton kernel: CUDA tensors, or CPU with TRITON_INTERPRET=1")
    y = torch.zeros(n, dtype=torch.float32, device=x.device)
    dt.df11_gemv_triton(
        packed.kernel_stream(), x.contiguous().view(torch.int16).reshape(-1), y, packed.err, k
    )
    if check and int(packed.err.max()) != 0:
        raise CodesignError("df11 stream is corrupt: a group did not decode to its stored count")
    if bias is not None:
        y = y + bias.float()
    return y.to(torch.bfloat16).reshape(*x.shape[:-1], n)


def df11_gemm(
    packed: PackedDF11, x: torch.Tensor, bias: torch.Tensor | None = None, check: bool = True
) -> torch.Tensor:
    """y = x @ W^T (+ bias) for bf16 x [..., K] with few rows, W [N, K] decoded tile by tile in registers.

    Needs a PackedDF11 built with `segment=` (the row-segment index). Accumulates in fp32 (order in
    `df11.triton_gemm` module docstring: deterministic and exact against a sequential fp32 sum when K is not
    split); returns bf16 [..., N]. Runs the Triton kernel: CUDA tensors, or CPU under the interpreter.
    """
    n, k = _check_call("df11_gemm", packed, x, bias)
    if not device_view(x.device).triton_runs:
        raise CodesignError("df11_gemm runs a Triton kernel: CUDA tensors, or CPU with TRITON_INTERPRET=1")
    if packed.seg_bits is None:
        raise CodesignError(
            "df11_gemm needs the row-segment index: build PackedDF11(df, device, segment=...)"
        )
    x2 = x.reshape(-1, k).contiguous()
    m = x2.shape[0]
    cfg = fused.gemm_config(m, n, k, x.device)
    grid = fused.launch_grid(m, n, k, packed.segment, cfg)
    y = (torch.zeros if grid[1] > 1 else torch.empty)((m, n), dtype=torch.float32, device=x.device)
    err = torch.zeros(grid[0] * grid[1] * grid[2], dtype=torch.int32, device=x.device)
    fused.df11_gemm_triton(packed.stream, packed.sign_mantissa, packed.luts, packed.seg_bits,
                           x2.view(torch.int16), y, err, n, k, packed.segment, packed.levels, cfg)  # fmt: skip
    if check and err.numel() and int(err.max()) != 0:
        raise CodesignError("df11 stream is corrupt: a weight row did not decode to its indexed length")
    if bias is not None:
        y = y + bias.float()
    return y.to(torch.bfloat16).reshape(*x.shape[:-1], n)


def _check_call(
    name: str, packed: PackedDF11 | PackedDF11Rows, x: torch.Tensor, bias: torch.Tensor | None
) -> tuple:
    """(N, K) after the argument checks every DF11 linear path shares; raises CodesignError."""
    if not isinstance(packed, (PackedDF11, PackedDF11Rows)) or len(packed.shape) != 2:
        raise CodesignError(
            f"{name} needs a PackedDF11 (or PackedDF11Rows) of a 2-D weight, got {getattr(packed, 'shape', packed)}"
        )
    n, k = packed.shape
    if not isinstance(x, torch.Tensor) or x.dtype != torch.bfloat16:
        raise CodesignError(f"x must be a bf16 tensor, got {getattr(x, 'dtype', type(x))}")
    if x.dim() < 1 or x.shape[-1] != k:
        raise CodesignError(f"x must have last dim in_features={k}, got shape {tuple(x.shape)}")
    if x.device != packed.stream.device:
        raise CodesignError(f"x is on {x.device} but the weight is on {packed.stream.device}")
    if bias is not None and (bias.shape != (n,) or bias.dtype != torch.bfloat16):
        raise CodesignError(f"bias must be bf16 of shape [{n}], got {bias.dtype} {tuple(bias.shape)}")
    return n, k


def choose_path(m: int, backend: str, exact: bool, fused_ready: bool = True, layout: str = "flat") -> str:
    """The one place a DF11 linear picks its path ("buffer", "gemv" or "gemm") for M rows of x.

    exact, a non-Triton backend, M = 0: "buffer" (decode into the shared buffer, then F.linear;
    bit-identical to nn.Linear). Flat layout: M == 1 "gemv"; 2 <= M <= FUSED_MAX_M "gemm" (with the
    row-segment index, fused_ready; else "buffer"); larger M "buffer". Rows layout: 1 <= M <=
    `triton_rows.GEMV_MAX_M` "gemv" (the rows GEMV takes up to 4 rows of x), larger M "buffer".
    """
    if layout not in LAYOUTS:
        raise CodesignError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    if exact or backend != "triton" or m < 1:
        return "buffer"
    if layout == "rows":
        return "gemv" if m <= tr.GEMV_MAX_M else "buffer"
    if m > FUSED_MAX_M:
        return "buffer"
    if m == 1:
        return "gemv"
    return "gemm" if fused_ready else "buffer"


def df11_linear(
    packed: PackedDF11,
    x: torch.Tensor,
    bias: torch.Tensor | None = None,
    workspace: DecodeWorkspace | None = None,
    exact: bool = True,
    check: bool = True,
) -> torch.Tensor:
    """y = x @ W^T (+ bias) for bf16 x [..., K], by the path `choose_path` picks (backend op "df11_linear").

    exact=True: bit-identical to F.linear on the original weight (decoded into `workspace`, or a
    fresh buffer). exact=False: the fused GEMV / tile GEMM for small M on the Triton backend. `check` is skipped
    while a graph is captured (`backend.capturing`: the warm-up run checked the same stream).
    """
    n, k = _check_call("df11_linear", packed, x, bias)
    check = check and not capturing(x)
    m = x.numel() // k if k else 0
    grad = torch.is_grad_enabled() and x.requires_grad  # the fused kernels have no backward
    layout = packed.layout
    ready = layout == "rows" or packed.seg_bits is not None
    path = choose_path(m, resolve_backend(LINEAR_OP, x.device), exact or grad, ready, layout)
    if path == "gemv" and layout == "rows":
        return df11_rows_gemv(packed, x, bias, check)
    if path == "gemv":
        return df11_gemv(packed, x.reshape(-1, k), bias, check).reshape(*x.shape[:-1], n)
    if path == "gemm":
        return df11_gemm(packed, x, bias, check)
    ws = workspace if workspace is not None else DecodeWorkspace()
    w = packed.decode_into(ws.get(packed.numel, packed.stream.device), check)
    if torch.is_grad_enabled() and x.requires_grad:
        w = w.clone()  # autograd keeps w for backward; the shared buffer is overwritten by the next layer
    return F.linear(x, w, bias)


class DecodeWorkspace:
    """One reusable decode buffer per device, grown to the largest weight asked for (shared by layers)."""

    def __init__(self) -> None:
        self._bufs: dict[torch.device, torch.Tensor] = {}

    def get(self, numel: int, device: torch.device) -> torch.Tensor:
        """An int16 buffer of >= numel elements on `device` (reused across calls: contents are transient)."""
        buf = self._bufs.get(device)
        if buf is None or buf.numel() < numel:
            buf = torch.empty(numel, dtype=torch.int16, device=device)
            self._bufs[device] = buf
        return buf

    def nbytes(self) -> int:
        return sum(b.numel() * 2 for b in self._bufs.values())


# ----------------------------------------------------------------------------- the layer


class LosslessBF16Linear(nn.Module):
    """y = x @ W^T + b with W stored DFloat11-style and decoded per call into a shared workspace.

    x must be bf16 with last dim in_features on the weight's device. With exact=True (default) the
    output is bit-identical to `nn.Linear` with the original BF16 weight (same `F.linear` on the same
    bits); exact=False lets `df11_linear` take the fused paths for small M. When autograd needs the
    weight (x requires grad), the buffer path runs and the decoded weight is cloned.
    """

    def __init__(self, packed: PackedDF11 | PackedDF11Rows, bias: torch.Tensor | None,
                 workspace: DecodeWorkspace | None = None,
                 check: bool = True, exact: bool = True) -> None:  # fmt: skip
        super().__init__()
        if len(packed.shape) != 2:
            raise CodesignError(f"LosslessBF16Linear needs a 2-D weight, got shape {packed.shape}")
        self.out_features, self.in_features = packed.shape
        self.weight_packed = packed
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)
        self.workspace = workspace if workspace is not None else DecodeWorkspace()
        self.check = check
        self.exact = exact

    @classmethod
    def from_linear(cls, linear: nn.Linear, config: LosslessBF16Config | None = None,
                    workspace: DecodeWorkspace | None = None) -> LosslessBF16Linear:  # fmt: skip
        """Compress an nn.Linear whose weight is BF16 (others are refused: convert the model first)."""
        if not isinstance(linear, nn.Linear):
            raise CodesignError(f"from_linear needs an nn.Linear, got {type(linear).__name__}")
        cfg = config or LosslessBF16Config()
        w = linear.weight
        if w.dtype != torch.bfloat16:
            raise CodesignError(
                f"LosslessBF16Linear compresses bf16 weights only, got {w.dtype}: call model.to(torch.bfloat16)"
            )
        if cfg.layout == "rows":
            lanes = cfg.lanes if cfg.lanes is not None else rows.auto_lanes(*w.shape)
            cap = rows.DEFAULT_MAX_CODE_LEN if cfg.max_code_len is None else cfg.max_code_len
            packed = PackedDF11Rows(rows.compress_rows(w.detach(), cap, lanes), w.device)
            return cls(packed, linear.bias, workspace, cfg.check, cfg.exact)
        cap = codec.DEFAULT_MAX_CODE_LEN if cfg.max_code_len is None else cfg.max_code_len
        df = codec.compress(w.detach(), cap, cfg.chunk_bytes, cfg.chunks_per_group)
        packed = PackedDF11(df, w.device, None if cfg.exact else cfg.segment)
        return cls(packed, linear.bias, workspace, cfg.check, cfg.exact)

    def weight(self) -> torch.Tensor:
        """The decoded BF16 weight, in the shared workspace (valid until the next decode)."""
        p = self.weight_packed
        return p.decode_into(self.workspace.get(p.numel, p.stream.device), self.check)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return df11_linear(self.weight_packed, x, self.bias, self.workspace, self.exact, self.check)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
            f"bits_per_weight={self.weight_packed.bits_per_weight:.2f}"
        )


def _default_filter(module: nn.Module, fqn: str) -> bool:
    return isinstance(module, nn.Linear)


def compress_model_(
    model: nn.Module,
    filter_fn: Callable[[nn.Module, str], bool] | None = None,
    config: LosslessBF16Config | None = None,
) -> nn.Module:
    """Replace, in place, each `nn.Linear` with filter_fn(module, fqn) true by a LosslessBF16Linear.

    All replaced layers share one DecodeWorkspace. Weights must be bf16 (CodesignError otherwise).
    Returns the model. filter_fn defaults to "every nn.Linear" (same signature as torchao's quantize_).
    """
    if not isinstance(model, nn.Module):
        raise CodesignError(f"model must be an nn.Module, got {type(model).__name__}")
    if filter_fn is not None and not callable(filter_fn):
        raise CodesignError(f"filter_fn must be callable(module, fqn) -> bool or None, got {filter_fn!r}")
    if config is not None and not isinstance(config, LosslessBF16Config):
        raise CodesignError(f"config must be a LosslessBF16Config or None, got {type(config).__name__}")
    if isinstance(model, nn.Linear):
        raise CodesignError("model is itself an nn.Linear: use LosslessBF16Linear.from_linear(model, config)")
    keep = filter_fn or _default_filter
    cfg = config or LosslessBF16Config()
    ws = DecodeWorkspace()
    targets = [(fqn, m) for fqn, m in model.named_modules() if isinstance(m, nn.Linear) and keep(m, fqn)]
    for fqn, m in targets:
        try:
            new = LosslessBF16Linear.from_linear(m, cfg, ws)
        except CodesignError as e:
            raise CodesignError(f"layer {fqn!r}: {e}") from e
        parent_name, _, child = fqn.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, child, new)
    return model


def model_weight_format(model: nn.Module) -> WeightFormat:
    """WeightFormat("df11", avg_bits) over all LosslessBF16Linear weights: 8 * sum(bytes) / sum(weights)."""
    packs = [m.weight_packed for m in model.modules() if isinstance(m, LosslessBF16Linear)]
    n = sum(p.numel for p in packs)
    if n == 0:
        raise CodesignError("model has no LosslessBF16Linear layers (run compress_model_ first)")
    return WeightFormat(dtype="df11", avg_bits=8 * sum(p.nbytes for p in packs) / n)
