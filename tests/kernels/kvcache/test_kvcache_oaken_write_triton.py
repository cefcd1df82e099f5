"""The parallel Triton Oaken writer (`kv_write_oaken_triton`, in the interpreter) against the serial torch
writer of `OakenPagedKV.write`, on the orders that make the segmented scan hard: prefill chunks over
shuffled block tables continued by later calls (stored counts), slots of several blocks interleaved and
revisited (a block's reset token after its other tokens), skipped slots, saturated slot capacity; both
metadata variants, 2/4/8 bits. Every cache tensor must be bit-identical. Also: no host sync and a launch
count independent of the number of tokens (the writer run on meta tensors), and GPU lowering."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from helpers import seq_slots, shuffled_block_tables
from triton_lowering import assert_lowers_for_gpu

from codesign.backend import use_backend
from codesign.kernels.kvcache import quantizers as kvq
from codesign.kernels.kvcache import triton_oaken_write as kwo
from codesign.kernels.kvcache.oaken import OakenPagedKV

# Not `numerics`: two writers compared bit for bit on the same inputs (thresholds and grid computed once,
# shared), both made of exactly rounded elementwise ops, max, sorts and integer sums, none of which
# depends on the vector width torch picks; so the AVX2 rerun cannot find anything here.

BS, H, D = 8, 2, 16


def _cache(
    meta: str, bits: int, cap: int, nb: int, outlier_frac: float = 0.08, bs: int = BS, h: int = H, d: int = D
) -> OakenPagedKV:
    """A cache whose every tensor is garbage, counts within [0, cap] (a block continued without a reset
    starts from its stored count, whatever its slots hold)."""
    calib = [(torch.randn(32, h, d) * 1.5, torch.randn(32, h, d))]
    thr = kvq.calibrate_kv_thresholds(calib, outlier_frac)[0]
    grid = kvq.calibrate_oaken_grid(calib)[0] if meta == "offline" else None
    c = OakenPagedKV.empty(nb, bs, h, d, bits, thr, cap, grid=grid)
    for codes in (c.k_codes, c.v_codes):
        codes.random_(0, 256)
    for m in (c.k_meta, c.v_meta):
        m.fill_(0xFF) if meta == "offline" else m.fill_(float("nan"))
    for out, cnt in ((c.k_out, c.k_count), (c.v_out, c.v_count)):
        out.random_(-5, 2**20)
        cnt.random_(0, cap + 1)
    c.overflow.random_(0, 50)
    return c


def _kv(n: int, h: int = H, d: int = D) -> tuple[torch.Tensor, torch.Tensor]:
    k = torch.randn(n, h, d) * 1.5
    k[:, 0, 3] *= 4  # a channel outlier: the slots of head 0 run out
    k[n // 2, 1, [2, 7, 9, 12]] = 9.0  # equally far outliers: ties by position
    return k, torch.randn(n, h, d)


def _to(c: OakenPagedKV, device: str) -> OakenPagedKV:
    moved = {f.name: getattr(c, f.name).to(device) for f in dataclasses.fields(c)
             if isinstance(getattr(c, f.name), torch.Tensor)}  # fmt: skip
    return dataclasses.replace(c, **moved)


def _write_both(ref: OakenPagedKV, tri: OakenPagedKV, slots: list[int]) -> None:
    k, v = _kv(len(slots))
    s = torch.tensor(slots, dtype=torch.int64)
    ref.write(k, v, s)
    with use_backend("triton"):
        tri.write(k, v, s)
    _same(ref, tri)


def _same(a: OakenPagedKV, b: OakenPagedKV) -> None:
    for f in dataclasses.fields(a):
        x, y = getattr(a, f.name), getattr(b, f.name)
        if isinstance(x, torch.Tensor):
            if x.dtype == torch.float16:  # bitwise: poisoned NaNs must stay where they were
                x, y = x.view(torch.int16), y.view(torch.int16)
            assert torch.equal(x, y), f.name


@pytest.mark.parametrize(
    "meta,bits,cap",
    [("token", 4, 3), ("offline", 4, 13), ("offline", 2, 0), ("token", 8, 40), ("token", 2, 5)],
)
def test_prefill_chunks_then_decode_bit_identical(meta, bits, cap):
    ctx = [27, 11, 19]
    bt, nb = shuffled_block_tables(ctx, BS)
    ref = _cache(meta, bits, cap, nb)
    tri = copy.deepcopy(ref)
    s0, s1, s2 = (seq_slots(bt, b, n, BS).tolist() for b, n in enumerate(ctx))
    # A packed prefill of each sequence's head (with padding), a chunk continuing mid-block (stored
    # counts), two decode steps (one token per sequence, a batch).
    _write_both(ref, tri, s0[:13] + [-1] + s1[:5] + s2[:9] + [-1, -1])
    _write_both(ref, tri, s0[13:22] + [-1] + s1[5:9] + s2[9:17])
    for i in range(2):
        _write_both(ref, tri, [s0[22 + i], s1[9 + i], s2[17 + i]])
    if 0 < cap <= 5:
        assert int(ref.k_count.max()) == cap  # some block's slots ran out (the saturating min mattered)


@pytest.mark.parametrize("meta,bits", [("token", 4), ("offline", 2)])
def test_interleaved_revisited_blocks_bit_identical(meta, bits):
    """Random permutations of the slots of several blocks: a block's reset token (offset 0) may come after
    its other tokens (their words are wiped by the reset, their codes stay); blocks without their offset
    0 continue from the stored count; skipped slots anywhere."""
    nb, cap = 6, 4
    ref = _cache(meta, bits, cap, nb, outlier_frac=0.25)  # many outliers: saturation
    tri = copy.deepcopy(ref)
    before = ref.overflow.clone()
    for _ in range(3):
        slots = []
        for blk in torch.randperm(nb)[:4].tolist():
            offs = torch.randperm(BS)[: int(torch.randint(2, BS + 1, ()))].tolist()
            slots += [blk * BS + o for o in offs]
        slots += [-1] * 3
        perm = torch.randperm(len(slots)).tolist()
        _write_both(ref, tri, [slots[i] for i in perm])
    _write_both(ref, tri, [-1, -1])  # nothing to write: nothing changes
    assert bool((ref.overflow > before).all())  # outliers beyond the capacity in every head


def test_revisited_block_reset_after_its_tokens():
    """The hand-made case: block 1's tokens 3, 5 before its reset token 0 in call order, block 2 continued
    from its stored count between them."""
    ref = _cache("token", 4, 6, 4, outlier_frac=0.2)
    tri = copy.deepcopy(ref)
    _write_both(ref, tri, [1 * BS + 3, 2 * BS + 6, 1 * BS + 5, 1 * BS + 0, 2 * BS + 7, 1 * BS + 1])


class _Launches:
    """Stands in for a Triton kernel: records each launch's grid instead of running it."""

    def __init__(self) -> None:
        self.grids: list[tuple] = []

    def __getitem__(self, grid):
        return lambda *args, **kw: self.grids.append(grid)


def test_no_host_sync_and_launches_constant_in_tokens(monkeypatch):
    """On meta tensors any host sync (.item(), .tolist(), bool(), nonzero, boolean indexing) raises: the
    host side of the writer is sync-free. Two launches whatever the number of tokens."""
    cache = _to(_cache("offline", 4, 3, 5), "meta")
    count, write = _Launches(), _Launches()
    monkeypatch.setattr(kwo, "_oaken_count_kernel", count)
    monkeypatch.setattr(kwo, "_oaken_write_kernel", write)
    for n in (1, 37):
        k = torch.empty(n, H, D, device="meta")
        kwo.oaken_write_triton(cache, k, k.clone(), torch.empty(n, dtype=torch.int64, device="meta"))
    assert count.grids == write.grids == [(1, H, 2), (37, H, 2)]
    # The public entry with check_data=False (CUDA-graph capture) adds no sync either, nor does its rebuild of
    # the kept outlier index (the written blocks' rows for fewer tokens than blocks, else the whole pool), nor
    # attention's whole rebuild of a stale index.
    with use_backend("triton"):
        for n in (2, 5):
            k = torch.empty(n, H, D, device="meta")
            cache.write(k, k.clone(), torch.empty(n, dtype=torch.int64, device="meta"), check_data=False)
    assert write.grids[-2:] == [(2, H, 2), (5, H, 2)]
    assert not cache.index_current()
    cache.ensure_index()
    assert cache.index_current()
    with pytest.raises(RuntimeError, match="meta"):  # the check itself is live: a sync raises
        torch.empty(3, device="meta").sum().item()


@pytest.mark.gpu
@pytest.mark.parametrize("meta", ["token", "offline"])
def test_gpu_long_prefill_and_revisits_bit_identical_without_sync(meta):
    """On a GPU, where programs really race: a 1k-token packed prefill over shuffled blocks (with skipped
    slots), then one call in a random order that resets some blocks (their reset tokens after their other
    tokens) and continues others from their stored counts, against the torch writer on the CPU; the
    writer itself under CUDA's sync debug mode "error"."""
    bs, h, d, cap = 16, 4, 64, 24
    ctx = [700, 333, 61]
    bt, nb = shuffled_block_tables(ctx, bs)
    ref = _cache(meta, 4, cap, nb, 0.1, bs, h, d)
    gpu = _to(ref, "cuda")
    pad = torch.full((3,), -1, dtype=torch.int32)
    packed = torch.cat([torch.cat([seq_slots(bt, b, n, bs), pad]) for b, n in enumerate(ctx)]).long()
    reset = [b * bs + o for b in range(0, nb, 3) for o in range(0, bs, 2)]
    cont = [b * bs + o for b in range(1, nb, 3) for o in range(1, bs, 2)]
    revisit = torch.tensor(reset + cont)
    for slots in (packed, revisit[torch.randperm(len(revisit))]):
        k, v = _kv(len(slots), h, d)
        ref.write(k, v, slots)
        # Copied before the debug mode is on: a host-to-device copy from pageable memory synchronizes, and
        # the mode must catch the writer's syncs only (the first H200 run failed here, on these copies).
        kd, vd, sd = k.cuda(), v.cuda(), slots.cuda()
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            kwo.oaken_write_triton(gpu, kd, vd, sd)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        _same(ref, _to(gpu, "cpu"))


@pytest.mark.lowering
def test_oaken_writer_kernels_lower_for_sm90():
    """Both kernels compile for sm_90 in every format (fp16 input, int32 / int64 slots, odd capacity,
    capacity 0, the 8-bit offline grid)."""
    common = {"k_ptr": "*fp16", "v_ptr": "*fp16", "slot_ptr": "*i64", "k_thr_ptr": "*fp32",
              "v_thr_ptr": "*fp32", "k_cnt_ptr": "*i32", "v_cnt_ptr": "*i32", "scratch_ptr": "*i32"}  # fmt: skip
    count_types = {**common, "key_ptr": "*i32"}
    assert_lowers_for_gpu(
        "codesign.kernels.kvcache.triton_oaken_write:_oaken_count_kernel",
        count_types,
        [
            dict(H=8, D=128, BS=16),
            dict(H=2, D=64, BS=32, types={"slot_ptr": "*i32", "k_ptr": "*fp32", "v_ptr": "*fp32"}),
        ],
    )
    write_types = {**common, "perm_ptr": "*i64", "grid_ptr": "*fp32", "k_codes_ptr": "*u8",
                   "v_codes_ptr": "*u8", "k_meta_ptr": "*fp16", "v_meta_ptr": "*fp16", "k_out_ptr": "*i32",
                   "v_out_ptr": "*i32", "over_ptr": "*i64"}  # fmt: skip
    u8 = {"k_meta_ptr": "*u8", "v_meta_ptr": "*u8"}
    base = dict(H=8, D=128, BS=16, BS_PAD=16)
    assert_lowers_for_gpu(
        "codesign.kernels.kvcache.triton_oaken_write:_oaken_write_kernel",
        write_types,
        [
            {**base, "BITS": 4, "CAP": 13, "CAP_PAD": 16, "OFFLINE": False},
            {**base, "BITS": 2, "CAP": 0, "CAP_PAD": 1, "OFFLINE": True, "types": u8},
            {
                **base,
                "BITS": 8,
                "CAP": 64,
                "CAP_PAD": 64,
                "OFFLINE": True,
                "types": {**u8, "slot_ptr": "*i32"},
            },
        ],
    )
