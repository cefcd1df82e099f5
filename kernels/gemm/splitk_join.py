"""Split-K in one launch: K slices meet in a self-cleaning fp32 workspace, and the last slice to reach an output tile
writes it out.

    ws, counters = join_buffers(out.device, m * n, tiles)     # host, before the launch
    join_splits(acc, sum_ptr, cnt_ptr, out_ptr, offs_m, offs_n, M, N)  # a split-K kernel's epilogue

Each program adds its fp32 partial into the workspace (relaxed atomics, as before), waits for its own threads
(a CTA barrier), and takes a ticket from its tile's counter (one acq_rel atomic: its partial is visible before the
ticket). The program that draws the last ticket reads the tile's sum back by atomics, stores it in the output's
dtype, and leaves the workspace tile and the counter zero again for the next launch. So a split call is one launch
where it was three (a zero fill of an fp32 buffer, the kernel, a copy-and-cast into the output): at decode the fill
and the copy are launches of a few KB each, which cost a launch gap each in a CUDA graph and a torch call each on
the host in eager decode (7 linears a layer). The sum is the same as before (0 + the partials in arrival order).

Buffers (`join_buffers`): they must be zero when a launch starts, and every launch leaves them so, so they are
reused where launches run in order (`stream_buffers`: per stream eagerly, per capture in its `capture_scope()`); a
capture outside a scope (a user's own `torch.cuda.graph`), and calls past `REUSE_MAX_ELEMS`, get fresh zeroed
buffers (the fill stays; the copy goes).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from codesign.kernels.gemm.stream_buffers import stream_buffer

# The largest workspace (fp32 elements) kept between calls: decode's M x N (M <= 16, N <= 2^18) fits; a tuned
# table that splits at large M gets a fresh one per call rather than a held 100 MB.
REUSE_MAX_ELEMS = 1 << 22


@triton.jit
def join_splits(acc, sum_ptr, cnt_ptr, out_ptr, offs_m, offs_n, M, N):
    """The epilogue of a program of a split-K launch whose grid's axis 1 is the split (axes 0 and 2 the output tile):
    acc [BM, BN] fp32 is its partial of out's rows offs_m, columns offs_n (out [M, N] contiguous). The last of the
    splits to arrive stores the sum in out's dtype and zeroes the tile's workspace and counter."""
    mask = (offs_m < M)[:, None] & (offs_n < N)[None, :]
    ws = sum_ptr + offs_m[:, None] * N + offs_n[None, :]
    tl.atomic_add(ws, acc, mask=mask, sem="relaxed")
    tl.debug_barrier()  # every thread's partial issued before the ticket (the release covers them through the barrier)
    tile = tl.program_id(0) + tl.num_programs(0) * tl.program_id(2)
    ticket = tl.atomic_add(cnt_ptr + tile, 1, sem="acq_rel")
    if ticket == tl.num_programs(1) - 1:
        # Read back by atomics (performed in L2, where the other splits' adds are), then left zero.
        total = tl.atomic_add(ws, tl.zeros_like(acc), mask=mask, sem="relaxed")
        tl.store(ws, tl.zeros_like(acc), mask=mask)
        tl.store(out_ptr + offs_m[:, None] * N + offs_n[None, :], _to_out(total, out_ptr), mask=mask)
        tl.store(cnt_ptr + tile, 0)


@triton.jit
def _to_out(x, out_ptr):
    """fp32 x in out's dtype, rounded to nearest even. bf16 by its bits: Triton's interpreter truncates in its cast
    (docs/known-issues.md), where this rounds as a GPU's cvt.rn does (a few integer ops an element, once a tile)."""
    if out_ptr.dtype.element_ty == tl.bfloat16:
        b = x.to(tl.uint32, bitcast=True)
        r = ((b + 0x7FFF + ((b >> 16) & 1)) >> 16).to(tl.uint16)
        r = tl.where(x != x, 0x7FC0, r).to(tl.uint16)  # NaN stays NaN (a low payload would round into inf)
        return r.to(tl.bfloat16, bitcast=True)
    else:
        return x.to(out_ptr.dtype.element_ty)


def join_buffers(device: torch.device, elems: int, tiles: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp32 workspace of at least `elems`, int32 counters of at least `tiles`), both zero: reused where launches
    run in order (`stream_buffers`), fresh past REUSE_MAX_ELEMS."""
    ws = stream_buffer("splitk_sums", device, torch.float32, elems, zeroed=True, reuse_max=REUSE_MAX_ELEMS)
    return ws, stream_buffer("splitk_tickets", device, torch.int32, tiles, zeroed=True)
