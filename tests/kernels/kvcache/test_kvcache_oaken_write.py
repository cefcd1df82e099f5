"""Triton Oaken writer (`kv_write_oaken_triton`, in the interpreter) against the torch writer of
`OakenPagedKV.write`: bit-identical codes, metadata, outlier slots (incl. the order outliers claim them),
slot counts and overflow counts, for both metadata variants, with poisoned caches, interleaved sequences,
skipped slots and tokens spanning block boundaries over several writes."""

from __future__ import annotations

import copy

import pytest
import torch

from codesign.backend import use_backend
from codesign.kernels.kvcache import quantizers as kvq
from codesign.kernels.kvcache.oaken import OakenPagedKV
from codesign.specs import CodesignError

# Not `numerics`: two writers compared bit for bit on the same inputs (thresholds and grid computed once,
# shared), both made of exactly rounded elementwise ops, max, sorts and integer sums, none of which
# depends on the vector width torch picks; so the AVX2 rerun cannot find anything here.

BS, H, D, CAP = 4, 2, 16, 3


def _poisoned(meta, bits):
    calib = [(torch.randn(32, H, D) * 1.5, torch.randn(32, H, D))]
    thr = kvq.calibrate_kv_thresholds(calib, 0.08)[0]
    grid = kvq.calibrate_oaken_grid(calib)[0] if meta == "offline" else None
    c = OakenPagedKV.empty(9, BS, H, D, bits, thr, CAP, grid=grid)
    c.k_codes.random_(0, 256)
    c.v_codes.random_(0, 256)
    if meta == "offline":
        c.k_meta.fill_(0xFF)
    else:
        c.k_meta.fill_(float("nan"))
        c.v_meta.fill_(float("nan"))
    c.k_out.random_(-5, 2**20)  # garbage until a block's first token resets it
    c.k_count.random_(0, 100)
    c.overflow.fill_(7)
    return c


def _same(a: OakenPagedKV, b: OakenPagedKV) -> None:
    for name in ("k_codes", "v_codes", "k_out", "v_out", "k_count", "v_count", "overflow"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name
    for name in ("k_meta", "v_meta"):  # bitwise: poisoned NaNs must stay where they were
        x, y = getattr(a, name), getattr(b, name)
        if x.dtype == torch.float16:
            x, y = x.view(torch.int16), y.view(torch.int16)
        assert torch.equal(x, y), name


@pytest.mark.parametrize("meta,bits", [("token", 4), ("offline", 4), ("offline", 2)])
def test_triton_writer_bit_identical_to_torch(meta, bits):
    ref = _poisoned(meta, bits)
    tri = copy.deepcopy(ref)
    # Sequence A in blocks 5, 2 (7 tokens), B in blocks 7, 0 (6 tokens), written in two interleaved
    # chunks that cross block boundaries; a padding slot (-1) in between.
    a = [5 * BS + i for i in range(BS)] + [2 * BS + i for i in range(3)]
    b = [7 * BS + i for i in range(BS)] + [0 * BS + i for i in range(2)]
    chunks = [[a[0], b[0], a[1], -1, b[1], a[2], a[3], a[4]], [b[2], b[3], a[5], b[4], a[6], b[5]]]
    for ch in chunks:
        n = len(ch)
        k = torch.randn(n, H, D) * 1.5
        k[:, 0, 3] *= 4  # a channel outlier: the slots run out in some blocks
        k[0, 1, [2, 7, 9, 12, 14]] = 9.0  # equally far outliers, more than the slots: ties by position
        v = torch.randn(n, H, D)
        s = torch.tensor(ch, dtype=torch.int32)
        ref.write(k, v, s)
        with use_backend("triton"):
            tri.write(k, v, s)
        _same(ref, tri)
    assert int(ref.overflow.sum()) > 7 * 2 * H  # some outliers found no slot
    assert int(ref.k_count[5].max()) == CAP


def test_triton_writer_fp16_input_and_bad_input():
    ref = _poisoned("offline", 4)
    tri = copy.deepcopy(ref)
    k, v = torch.randn(5, H, D).half(), torch.randn(5, H, D).half()
    s = torch.tensor([3 * BS + i for i in range(5)], dtype=torch.int32)
    ref.write(k, v, s)
    with use_backend("triton"):
        tri.write(k, v, s)
        _same(ref, tri)
        with pytest.raises(CodesignError, match="bf16"):
            tri.write(k.bfloat16(), v.bfloat16(), s)
        with pytest.raises(CodesignError, match="finite"):
            tri.write(torch.full((1, H, D), float("nan")), v[:1].float(), s[:1])
