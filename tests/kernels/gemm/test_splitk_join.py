"""The split-K join (`kernels/gemm/splitk_join.py`): K slices meet in one launch, through buffers that every launch
leaves zero. Checked in the interpreter for each kernel that splits (the weight-only GEMV and split-K GEMM, the W8A8
/ FP8 two-launch and fused-quantizer GEMMs): outputs against fp64 into NaN-poisoned buffers, the buffers zero again
after each call (and, as teeth, a counter or a workspace left dirty corrupts the next call), no host-side fill or
copy, one launch a call; the buffers' policy (`stream_buffers`: per stream, per capture scope, fresh past the size
cap or in a foreign capture; the dequantized weight's buffer too); the bf16 rounding by bits equal to torch's
round-to-nearest-even."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl
from helpers import OpLog

from codesign.autotune.lookup import forced_config
from codesign.backend import use_backend
from codesign.kernels.gemm import formats as qf
from codesign.kernels.gemm import splitk_join as sj
from codesign.kernels.gemm import stream_buffers as sb
from codesign.kernels.gemm import triton_dequant as td
from codesign.kernels.gemm import triton_fusedq as fq
from codesign.kernels.gemm import triton_gemm as qt
from codesign.kernels.gemm import triton_gemv as gv


def _w4(n: int, k: int):
    return qf.quantize_rtn(torch.randn(n, k), "int4", 64, False, torch.float32)


def _wq_ref(x, w) -> torch.Tensor:
    return x.double() @ qf.dequantize(w).double().T


def _w8(n: int, k: int):
    return qf.quantize_rtn(torch.randn(n, k), "int8", None, True, torch.float32)


def _scaled_ref(x, w) -> torch.Tensor:
    aq = torch.empty(x.shape, dtype=torch.int8)
    a_s = torch.empty(x.shape[0])
    with use_backend("triton"):
        qt.quantize_per_token(x, False, aq, a_s)
    wk = (qf.unpack_codes(w.qweight, 8) - 128).double()
    return (aq.double() @ wk) * a_s.double()[:, None] * w.scales.double()


# (name, kernel attribute, call(x, out), reference(x), M): each splits K in the interpreter's defaults.
def _cases():
    w4 = _w4(96, 320)
    w8 = _w8(80, 256)

    def gemv(x, out):
        gv.wq_gemv(x, w4.qweight, w4.scales, w4.zeros, None, 4, 64, out, {"BLOCK_K": 64, "BLOCK_N": 64, "num_warps": 4})

    def splitk(x, out):
        with forced_config(qt.wq_variant_op(4), qt.wq_variant_entry("splitk")):
            qt.wq_gemm(x, w4.qweight, w4.scales, w4.zeros, None, 4, 64, out)

    codes = {}

    def scaled(x, out):
        if id(x) not in codes:  # the activation codes, made once an input (another launch: not the one checked)
            codes[id(x)] = (torch.empty(x.shape, dtype=torch.int8), torch.empty(x.shape[0]), x)
            qt.quantize_per_token(x, False, *codes[id(x)][:2])
        aq, a_s, _ = codes[id(x)]
        with forced_config(qt.scaled_mm_table_op(False), {"SPLIT_K": 3}):
            qt.scaled_mm(aq, a_s, w8.qweight, w8.scales, None, out, "triton")

    def fused(x, out):
        cfg = {**qt._INTERP_DEFAULTS["fusedq"], "SPLIT_K": 2}
        fq.fusedq_mm(x, w8.qweight, w8.scales, None, out, False, cfg, True)

    return [
        ("gemv", (gv, "_wq_gemv_kernel"), gemv, lambda x: _wq_ref(x, w4), 6),  # 2 launches: 4 rows, then 2
        ("splitk", (qt, "_wq_kernel"), splitk, lambda x: _wq_ref(x, w4), 5),
        ("scaled_mm", (qt, "_scaled_mm_kernel"), scaled, lambda x: _scaled_ref(x, w8), 3),
        ("fusedq", (fq, "_fusedq_kernel"), fused, lambda x: _scaled_ref(x, w8), 2),
    ]


CASES = _cases()
IDS = [c[0] for c in CASES]


@pytest.fixture(autouse=True)
def _fresh_buffers(monkeypatch):
    """Each test starts from no held buffers (and leaves the module's as it found them)."""
    monkeypatch.setattr(sb, "_EAGER", {})


def _held() -> list[torch.Tensor]:
    return [t for key, t in sb._EAGER.items() if key[0].startswith("splitk")]


def _run(call, x, n: int) -> torch.Tensor:
    out = torch.full((x.shape[0], n), float("nan"))
    with use_backend("triton"):
        call(x, out)
    return out


def _n(ref, x) -> int:
    return ref(x[:1]).shape[1]


@pytest.mark.parametrize(("name", "kernel", "call", "ref", "m"), CASES, ids=IDS)
def test_the_splits_meet_in_the_launch_and_leave_its_buffers_zero(name, kernel, call, ref, m):
    for trial in range(3):  # the buffers of one call serve the next
        x = torch.randn(m + trial % 2, 320 if name in ("gemv", "splitk") else 256)
        want = ref(x)
        got = _run(call, x, want.shape[1])
        assert torch.isfinite(got).all(), f"{name}: unwritten outputs"
        torch.testing.assert_close(got.double(), want, rtol=2e-5, atol=2e-5 * want.abs().max().item())
        held = _held()
        assert held and all(not t.any() for t in held), f"{name}: a buffer left dirty"
    assert len(_held()) == 2  # one workspace, one set of counters


@pytest.mark.parametrize(("name", "kernel", "call", "ref", "m"), CASES, ids=IDS)
def test_teeth_a_dirty_counter_or_workspace_corrupts_the_next_call(name, kernel, call, ref, m):
    """What the zero check above guards: a counter a launch left at 1 makes a program short of the last write a
    partial sum; far off, no program is the last (the output stays unwritten); a workspace left nonzero is added into
    the next sum."""
    x = torch.randn(m, 320 if name in ("gemv", "splitk") else 256)
    n = _n(ref, x)
    want = ref(x)
    _run(call, x, n)
    ws, cnt = (sb._EAGER[k] for k in sorted(k for k in sb._EAGER if k[0].startswith("splitk")))  # sums, tickets
    cnt.fill_(1)
    assert (_run(call, x, n).double() - want).abs().max() > 1e-2
    cnt.fill_(1 << 20)
    assert torch.isnan(_run(call, x, n)).all()
    cnt.zero_()
    ws.fill_(1000.0)
    assert (_run(call, x, n)[0].double() - want[0]).abs().min() > 500  # (row 0: the first launch's)


@pytest.mark.parametrize(("name", "kernel", "call", "ref", "m"), CASES, ids=IDS)
def test_a_split_call_is_one_launch_with_no_fill_or_copy(name, kernel, call, ref, m, monkeypatch):
    """The host side of a split call, launches stubbed: the kernel's launches and views, no zeroing, copy or
    allocation once the buffers are held (the fill and copy launches it had are gone)."""
    x = torch.randn(m, 320 if name in ("gemv", "splitk") else 256)
    n = _n(ref, x)
    _run(call, x, n)  # buffers allocated
    module, attr = kernel
    launches = []

    class _Stub:
        def __getitem__(self, grid):
            return lambda *a, **kw: launches.append(grid)

    monkeypatch.setattr(module, attr, _Stub())
    with OpLog() as log:
        _run(call, x, n)
    assert launches and all(g[1] > 1 for g in launches), launches  # split: grid axis 1
    assert len(launches) == (2 if name == "gemv" else 1)
    touched = [op for op in log.ops if op.split(".")[1] in ("zero_", "fill_", "copy_", "zeros", "empty", "add_")]
    assert touched == [], touched



def test_buffers_per_stream_per_scope_and_fresh_past_the_cap_or_in_a_foreign_capture(monkeypatch):
    """`stream_buffers`' policy through the join's buffers and the dequantized weight's."""
    cpu = torch.device("cpu")
    a = sj.join_buffers(cpu, 100, 3)
    b = sj.join_buffers(cpu, 50, 2)
    assert all(x is y for x, y in zip(a, b))  # held, reused
    grown = sj.join_buffers(cpu, a[0].numel() + 1, 3)
    assert grown[0] is not a[0] and grown[0].numel() >= 2 * a[0].numel() and not grown[0].any()  # doubled, zero
    w = td.workspace(64, 96, torch.float16, cpu)
    assert td.workspace(128, 96, torch.float16, cpu).numel() == 128 * 96  # a layer's size exactly (grow=False)
    with sb.capture_scope() as held:
        s1 = sj.join_buffers(cpu, 100, 3)
        assert s1[0] is not grown[0] and held == list(s1)  # a capture's own
        assert all(x is y for x, y in zip(sj.join_buffers(cpu, 100, 3), s1))
        s2 = sj.join_buffers(cpu, s1[0].numel() + 1, 3)
        assert held == [*s1, s2[0]]  # the outgrown one stays held: launches captured before use it
        ws = td.workspace(64, 96, torch.float16, cpu)
        assert ws.data_ptr() != w.data_ptr() and held[-1].data_ptr() == ws.data_ptr()
    assert sj.join_buffers(cpu, 100, 3)[0] is grown[0]
    big = sj.join_buffers(cpu, sj.REUSE_MAX_ELEMS + 1, 3)[0]
    assert big is not sj.join_buffers(cpu, sj.REUSE_MAX_ELEMS + 1, 3)[0]  # fresh each call past the cap
    # A capture the scope does not know (a user's own torch.cuda.graph): fresh buffers each call.
    made = []
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    monkeypatch.setattr(torch, "zeros", lambda n, dtype, device: made.append((device.type, n, dtype)))
    sj.join_buffers(torch.device("cuda", 0), 100, 3)
    sj.join_buffers(torch.device("cuda", 0), 100, 3)
    assert made == [("cuda", 100, torch.float32), ("cuda", 3, torch.int32)] * 2


@triton.jit
def _round_kernel(x_ptr, out_ptr, N, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=offs < N)
    tl.store(out_ptr + offs, sj._to_out(x, out_ptr), mask=offs < N)


def test_bf16_rounding_by_bits_is_round_to_nearest_even():
    """Ties (a low half of exactly 0x8000) to even, carries into the exponent, infinities, NaN with any payload,
    subnormals and signed zeros, as torch's cast rounds them."""
    bits = torch.tensor([0x3F808000, 0x3F818000, 0x3F80FFFF, 0x3F807FFF, 0x7F7FFFFF, 0x7F800000, 0xFF800000,
                         0x7F800001, 0xFFC00001, 0x00008000, 0x00018000, 0x80000000, 0x00000000, 0x477FF000],
                        dtype=torch.int64).to(torch.int32)  # fmt: skip
    x = torch.cat([bits.view(torch.float32), torch.randn(1000) * 10.0 ** torch.randint(-30, 30, (1000,))])
    out = torch.empty(x.shape, dtype=torch.bfloat16)
    _round_kernel[(triton.cdiv(x.numel(), 256),)](x, out, x.numel(), BLOCK=256)
    want = x.to(torch.bfloat16)
    nan = want.isnan()
    assert torch.equal(out.isnan(), nan)
    assert torch.equal(out[~nan].view(torch.int16), want[~nan].view(torch.int16))


@pytest.mark.gpu
def test_on_a_gpu_each_stream_and_each_capture_has_its_buffers():
    """Streams run concurrently, so each gets its pair; a capture inside `capture_scope` uses its own, zeroed by the
    graph's fill, and its replays equal eager calls (the GEMV at M = 1, its K split over the SMs)."""
    dev = torch.device("cuda")
    w = _w4(4096, 4096)
    qw, s, z = (t.to(dev) for t in (w.qweight, w.scales.half(), w.zeros.half()))
    x = torch.randn(1, 4096, device=dev, dtype=torch.float16)
    main = sj.join_buffers(dev, 100, 3)
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        assert sj.join_buffers(dev, 100, 3)[0] is not main[0]
    out = torch.empty(1, 4096, device=dev, dtype=torch.float16)
    with use_backend("triton"):
        qt.wq_gemm(x, qw, s, z, None, 4, 64, out)
        eager = out.clone()
        torch.testing.assert_close(eager.double().cpu(), _wq_ref(x.cpu().float(), w), rtol=1e-2, atol=0.5)
        graph = torch.cuda.CUDAGraph()
        with sb.capture_scope() as held, torch.cuda.graph(graph):
            qt.wq_gemm(x, qw, s, z, None, 4, 64, out)
    out.zero_()
    for _ in range(3):
        graph.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(out, eager, rtol=1e-3, atol=1e-3)
    assert held and all(not t.any() for t in held)
