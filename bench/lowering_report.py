"""Compile every kernel launch the GPU suite makes for sm_90 (or sm_80) on a CPU machine; report resources.

    python bench/lowering_report.py --arch 90 --out bench/results/lowering_sm90.json
    python bench/lowering_report.py --arch 90 --estimates --out bench/results/lowering_estimates_sm90.json

Drives the public ops of `bench/gpu_suite.py` (its correctness section: every tunable op at its
CORRECTNESS_SHAPES in fp16, bf16 and fp32, weight-only GEMMs in both variants) and of its kernel benches
(`gpu_attention`: decode over both layouts, every batch and context in bf16 and fp16, extend and tree;
`gpu_quant_gemm`: W4A16 g128, W8A16, W8A8 and FP8 at every M of the quick shapes; `gpu_kvquant`: decode
and writes over every quantized cache format, KIVI, Oaken, mixed; `gpu_df11`: decode, GEMV, the fused GEMM,
the rows layout's decode and GEMV; the layer ops of `kernels.layers`)
with CPU tensors under `codesign.autotune.compile_only`: every launch compiles for the target, nothing runs.

Shapes are the suite's real ones where they reach the compiled code (dtypes, constexprs such as the split
count that decode attention derives from batch x heads and the block-table width, 16-byte alignment of
pointers and integer arguments); KV pools are two blocks plus what the host code indexes (the launches'
block tables keep their real width, so the plans match), and data are zeros (nothing reads them).
FP8 needs sm_89+: skipped (with the reason) for --arch 80.

JSON: `kernels` one row per distinct specialisation (kernel + signature + alignment + constexprs + warps +
stages), with registers, spills, stack, shared memory, `ok` and the reason when not ok (compile error,
shared memory over the arch's opt-in limit, spills, > 255 registers), and the cases that launch it;
`cases` one row per driven call. Exit status 1 when a launch fails to compile or a case fails on the host,
else 0 (spills and limits are reported, not fatal). --estimates writes the tuner's resource estimates
against the compiler's numbers instead (`codesign.autotune.compile_check`).
"""

from __future__ import annotations

import argparse
import datetime as dt
import functools
import json
import os
import sys
import time
import traceback
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

BENCH_DIR = Path(__file__).resolve().parent
Case = tuple[str, str, Callable[[], Any]]  # (section, case name, the call)


def _suite_modules() -> dict[str, Any]:
    sys.path.insert(0, str(BENCH_DIR))
    import gpu_attention
    import gpu_df11
    import gpu_kvquant
    import gpu_quant_gemm
    import gpu_suite

    return dict(suite=gpu_suite, att=gpu_attention, qg=gpu_quant_gemm, kvq=gpu_kvquant, df11=gpu_df11)


# ----------------------------------------------------------------------------- cases
def _adapter_cases(mods: dict, arch: int) -> Iterator[Case]:
    """gpu_suite's correctness section: every tunable op at every CORRECTNESS_SHAPES entry and dtype."""
    import torch

    from codesign.autotune.ops import expand_variants, get_op, parse_shape, registered_ops

    suite = mods["suite"]
    for name in registered_ops():
        if name.startswith("test_"):
            continue
        op = get_op(name)
        for real in suite.CORRECTNESS_SHAPES.get(name, []):
            for shape in expand_variants(op, [parse_shape(real)]):
                for dname in suite.CORRECTNESS_DTYPES:
                    label = f"{name} {','.join(f'{k}={v}' for k, v in shape.items())} {dname}"
                    if name == "fp8_gemm" and arch < 89:
                        yield ("correctness", label, _skip("FP8 needs sm_89+"))
                        continue

                    def call(op=op, shape=shape, dname=dname):
                        op.run(op.make_inputs(shape, getattr(torch, dname), "cpu", 1), {})

                    yield ("correctness", label, call)


class Skipped(Exception):
    """A case that does not apply to this target (e.g. FP8 on sm_80)."""


def _skip(reason: str) -> Callable[[], None]:
    def call() -> None:
        raise Skipped(reason)

    return call


def _quant_gemm_cases(mods: dict, arch: int) -> Iterator[Case]:
    """gpu_quant_gemm (quick, as the suite runs it): every kernel at every M over its shapes, bf16."""
    import torch

    from codesign.kernels.gemm import formats as qf
    from codesign.kernels.gemm import ops as qg

    qgb = mods["qg"]

    def weight(fmt: str, n: int, k: int, group: int | None, sym: bool, sdtype: torch.dtype) -> Any:
        # Codes are never read (nothing runs); scales and zeros are validated on the host: finite, in range.
        if fmt == "fp8_e4m3":
            codes = torch.zeros(n, k, dtype=torch.float8_e4m3fn).t()  # K contiguous, as `quantize_rtn` gives it
        else:
            codes = torch.empty(k // (32 // (4 if fmt == "int4" else 8)), n, dtype=torch.int32)
        groups = 1 if group is None else k // group
        scales = torch.ones(groups, n, dtype=sdtype)
        zeros = None if sym else torch.full((groups, n), 8.0, dtype=sdtype)
        return qf.QuantizedWeight(codes, scales, zeros, fmt, group, n, k)

    for model, layers in qgb.QUICK_SHAPES.items():
        for layer, (n, k) in layers.items():
            kernels = {
                "w4a16_g128": (lambda n=n, k=k: weight("int4", n, k, 128, False, torch.bfloat16), False),
                "w8a16_pc": (lambda n=n, k=k: weight("int8", n, k, None, True, torch.bfloat16), False),
                "w8a8_int8": (lambda n=n, k=k: weight("int8", n, k, None, True, torch.float32), True),
                "fp8": (lambda n=n, k=k: weight("fp8_e4m3", n, k, None, True, torch.float32), False),
            }
            for m in qgb.MS:
                for kname, (make_w, act_quant) in kernels.items():
                    label = f"quant_gemm {model}/{layer} M={m} N={n} K={k} {kname} bf16"
                    if kname == "fp8" and arch < 89:
                        yield ("quant_gemm", label, _skip("FP8 needs sm_89+"))
                        continue

                    def call(m=m, k=k, make_w=make_w, act_quant=act_quant, kname=kname):
                        x = torch.zeros(m, k, dtype=torch.bfloat16)
                        w = make_w()
                        if kname == "w8a8_int8":  # signed codes, K contiguous: what `QuantLinear` runs
                            codes = torch.empty(w.N, w.K, dtype=torch.int8).t()
                            qg.w8a8_gemm(x, codes, w.scales, None)
                        else:
                            qg.quant_matmul(x, w, act_quant=act_quant)

                    yield ("quant_gemm", label, call)


def _tables(batch: int, ctx: int, bs: int) -> tuple[Any, Any]:
    import torch

    # Real width (the split count and plans read it); every entry block 0 of a small pool.
    width = -(-ctx // bs)
    return torch.zeros(batch, width, dtype=torch.int32), torch.full((batch,), ctx, dtype=torch.int32)


def _attention_cases(mods: dict) -> Iterator[Case]:
    """gpu_attention: decode (both layouts, every batch and context, bf16 and fp16), extend and tree (bf16)."""
    import torch

    from codesign.kernels.attention.wrappers import (
        PagedDecodeWrapper,
        PagedExtendWrapper,
        TreeAttentionWrapper,
    )

    att = mods["att"]
    bs = att.BLOCK_SIZE
    for dtype in (torch.bfloat16, torch.float16):
        for model, (hq, hkv, dim) in att.LAYOUTS.items():
            for batch in att.BATCHES:
                for ctx in att.CONTEXTS:
                    if 2 * batch * ctx * hkv * dim * 2 > att.MAX_KV_BYTES:
                        continue  # the bench skips it too

                    def call(hq=hq, hkv=hkv, dim=dim, batch=batch, ctx=ctx, dtype=dtype):
                        bt, cl = _tables(batch, ctx, bs)
                        k = torch.zeros(2, bs, hkv, dim, dtype=dtype)
                        q = torch.zeros(batch, hq, dim, dtype=dtype)
                        w = PagedDecodeWrapper("cpu")
                        w.plan(k, bt, cl, hq)
                        w.run(q, k, k.clone(), out=torch.full_like(q, float("nan")))

                    yield ("attention", f"decode {model} batch={batch} ctx={ctx} {dtype}", call)
    hq, hkv, dim = att.LAYOUTS["llama3-8b"]
    for batch, q_len, prefix in att.EXTEND_CASES:

        def extend(batch=batch, q_len=q_len, prefix=prefix):
            bt, cl = _tables(batch, prefix + q_len, bs)
            k = torch.zeros(2, bs, hkv, dim, dtype=torch.bfloat16)
            cu = torch.arange(0, (batch + 1) * q_len, q_len, dtype=torch.int32)
            w = PagedExtendWrapper("cpu")
            w.plan(k, bt, cl, cu, hq)
            q = torch.zeros(batch * q_len, hq, dim, dtype=torch.bfloat16)
            w.run(q, k, k.clone(), out=torch.full_like(q, float("nan")))

        yield ("attention", f"extend batch={batch} q_len={q_len} prefix={prefix} bf16", extend)
        if (batch, q_len, prefix) == att.EXTEND_CASES[0]:

            def tree(batch=batch, q_len=q_len, prefix=prefix):
                bt, _ = _tables(batch, prefix + q_len, bs)
                k = torch.zeros(2, bs, hkv, dim, dtype=torch.bfloat16)
                parents = [[-1] + [i - 1 for i in range(1, q_len)] for _ in range(batch)]
                tw = TreeAttentionWrapper("cpu")
                tw.plan(k, bt, parents, [prefix] * batch, hq)
                q = torch.zeros(batch * q_len, hq, dim, dtype=torch.bfloat16)
                tw.run(q, k, k.clone(), out=torch.full_like(q, float("nan")))

            yield ("attention", f"tree batch={batch} nodes={q_len} prefix={prefix} bf16", tree)


def _oaken_decode(q, bt, cl, cache, split: int) -> None:
    """Oaken decode over `cache` on the path SPLIT picks (1: three launches, `attention.oaken_split`), over whatever
    config an outer block forces (bench/attention_configs.py forces the tile)."""
    from codesign.autotune.lookup import forced_key
    from codesign.kernels.attention.quantized import oaken_attention

    with forced_key("paged_attention_oaken", "SPLIT", split):
        oaken_attention(q, cache, bt, cl, check_data=False)


def _kvquant_cases(mods: dict) -> Iterator[Case]:
    """gpu_kvquant: decode over every quantized format at its batch and context, and the writers (bf16, fp16)."""
    import torch

    from codesign.autotune.lookup import forced_key
    from codesign.kernels.attention.quantized import (
        kivi_decode_attention,
        kvq_decode_attention,
        mixed_attention,
        oaken_attention,
    )
    from codesign.kernels.kvcache.kivi import KiviPagedKV
    from codesign.kernels.kvcache.kvq import QuantPagedKV, kvq_write
    from codesign.kernels.kvcache.mixed import MixedPagedKV
    from codesign.kernels.kvcache.oaken import OakenPagedKV, default_capacity

    b = mods["kvq"]
    hq, hkv, dim, bs = b.HQ, b.HKV, b.DIM, b.BLOCK_SIZE
    nb = 4  # a small pool: tables point at block 0 (nothing runs)

    def q_and_tables(dtype):
        bt, cl = _tables(b.BATCH, b.CONTEXT, bs)
        return torch.zeros(b.BATCH, hq, dim, dtype=dtype), bt, cl

    for dtype in (torch.bfloat16, torch.float16):
        dn = str(dtype).removeprefix("torch.")
        for fmt in b.FORMATS:
            hs = torch.full((hkv,), 4.0 / 448) if fmt == "fp8" else None

            def decode(fmt=fmt, hs=hs, dtype=dtype):
                q, bt, cl = q_and_tables(dtype)
                kvq_decode_attention(q, QuantPagedKV.empty(nb, bs, hkv, dim, fmt, "cpu", hs, hs), bt, cl,
                                     check_data=False)  # fmt: skip

            def write(fmt=fmt, hs=hs, dtype=dtype):
                c = QuantPagedKV.empty(nb, bs, hkv, dim, fmt, "cpu", hs, hs)
                new = torch.zeros(b.BATCH, hkv, dim, dtype=dtype)
                kvq_write(new, new, c, torch.arange(b.BATCH, dtype=torch.int32) % (nb * bs), check_data=False)

            yield ("kv_quant", f"decode {fmt} batch={b.BATCH} ctx={b.CONTEXT} {dn}", decode)
            yield ("kv_quant", f"write {fmt} tokens={b.BATCH} {dn}", write)
        for name, bits in b.KIVI.items():

            def kivi(bits=bits, dtype=dtype):
                q, bt, cl = q_and_tables(dtype)
                c = KiviPagedKV.empty(nb, bs, hkv, dim, bits, b.KIVI_G, b.KIVI_R, b.BATCH, device="cpu")
                kivi_decode_attention(q, c, bt, cl, check_data=False)

            def kivi_write(bits=bits, dtype=dtype):  # appends that flush groups to the cache (the writer)
                c = KiviPagedKV.empty(nb, bs, hkv, dim, bits, b.KIVI_G, b.KIVI_R, 1, device="cpu")
                n = 2 * b.KIVI_G + b.KIVI_R
                row = torch.arange(-(-n // bs), dtype=torch.int32)
                c.append(0, row, 0, torch.zeros(n, hkv, dim), torch.zeros(n, hkv, dim))

            yield ("kv_quant", f"decode {name} batch={b.BATCH} ctx={b.CONTEXT} {dn}", kivi)
            yield ("kv_quant", f"write {name} {dn}", kivi_write)
        cap = default_capacity(0.04, bs, dim)
        thr = torch.tensor([[-1.0, 1.0]] * hkv).expand(2, hkv, 2).contiguous()

        def oaken(dtype=dtype, thr=thr, cap=cap, split=0):  # split 1: in three launches (`oaken_split`)
            _oaken_decode(*q_and_tables(dtype), OakenPagedKV.empty(nb, bs, hkv, dim, 4, thr, cap, "cpu"), split)

        def oaken_offline(dtype=dtype, thr=thr):  # 8-bit metadata on a per-head grid, 4 slots per block
            q, bt, cl = q_and_tables(dtype)
            grid = torch.tensor([[-2.0, 0.0625]] * hkv).expand(2, hkv, 2).contiguous()
            c = OakenPagedKV.empty(nb, bs, hkv, dim, 4, thr, 4, "cpu", grid=grid)
            oaken_attention(q, c, bt, cl, check_data=False)

        def oaken_write(dtype=dtype, thr=thr, cap=cap):
            c = OakenPagedKV.empty(nb, bs, hkv, dim, 4, thr, cap, "cpu")
            new = torch.zeros(b.BATCH, hkv, dim, dtype=dtype)
            c.write(new, new, torch.arange(b.BATCH, dtype=torch.int32))

        def mixed(dtype=dtype, by_width=1):  # by_width 0: the one launch it replaced (extend and tree still run it)
            q, bt, cl = q_and_tables(dtype)
            c = MixedPagedKV.empty(nb, bs, hkv, dim, "cpu")
            c.block_bits.copy_(torch.tensor([8, 4, 4, 2], dtype=torch.uint8))
            # BY_WIDTH over whatever an outer block forces (bench/attention_configs.py forces the tile)
            with forced_key("paged_attention_mixed", "BY_WIDTH", by_width):
                mixed_attention(q, c, bt, cl, check_data=False)

        yield ("kv_quant", f"decode int4-oaken batch={b.BATCH} ctx={b.CONTEXT} {dn}", oaken)
        yield ("kv_quant", f"decode int4-oaken-split batch={b.BATCH} ctx={b.CONTEXT} {dn}",
               functools.partial(oaken, split=1))
        yield ("kv_quant", f"decode int4-oaken-offline batch={b.BATCH} ctx={b.CONTEXT} {dn}", oaken_offline)
        yield ("kv_quant", f"write int4-oaken tokens={b.BATCH} {dn}", oaken_write)
        yield ("kv_quant", f"decode mixed-8/4/4/2 batch={b.BATCH} ctx={b.CONTEXT} {dn}", mixed)
        yield ("kv_quant", f"decode mixed-8/4/4/2-one-launch batch={b.BATCH} ctx={b.CONTEXT} {dn}",
               functools.partial(mixed, by_width=0))


def _df11_cases(mods: dict) -> Iterator[Case]:
    """gpu_df11 (quick): decode + GEMV at the first shape and two chunkings, the fused GEMM at small M, the
    rows layout (`_df11_rows_cases`)."""
    import torch

    from codesign.kernels.df11 import codec
    from codesign.kernels.df11.linear import DecodeWorkspace, PackedDF11, df11_gemm, df11_gemv

    b = mods["df11"]
    n, k = b.SHAPES[0]
    gen = torch.Generator().manual_seed(0)
    w = (torch.randn(n, k, generator=gen) * 0.02).to(torch.bfloat16)  # the bench's synthetic weights
    chunkings = [(codec.DEFAULT_CHUNK_BYTES, codec.DEFAULT_CHUNKS_PER_GROUP), *b.SWEEP[:2]]
    for cb, cpg in dict.fromkeys(chunkings):

        def decode_gemv(cb=cb, cpg=cpg):
            packed = PackedDF11(codec.compress(w, chunk_bytes=cb, chunks_per_group=cpg), "cpu")
            packed.decode_into(DecodeWorkspace().get(n * k, "cpu"), check=False)  # check reads flags back
            df11_gemv(packed, torch.zeros(1, k, dtype=torch.bfloat16), check=False)

        yield ("df11", f"decode+gemv N={n} K={k} chunk_bytes={cb} chunks_per_group={cpg}", decode_gemv)
    for m in b.SMALL_M[:2]:

        def gemm(m=m):
            packed = PackedDF11(codec.compress(w), "cpu", segment=1024)
            df11_gemm(packed, torch.zeros(m, k, dtype=torch.bfloat16), check=False)

        yield ("df11", f"fused gemm M={m} N={n} K={k}", gemm)
    yield from _df11_rows_cases(b, w)


def _df11_rows_cases(b: Any, w: Any) -> Iterator[Case]:
    """gpu_df11's rows layout: decode and the fused GEMV at every M it benches (ROWS_M), its own lanes (32 at
    the first shape), and at 64 lanes, where the default LANES = 32 splits each row (the GEMV's atomics)."""
    import torch

    from codesign.kernels.df11 import rows
    from codesign.kernels.df11.packed_rows import PackedDF11Rows, df11_rows_gemv

    n, k = w.shape
    for lanes in (rows.auto_lanes(n, k), 64):

        def decode_gemv(lanes=lanes):
            packed = PackedDF11Rows(rows.compress_rows(w, lanes=lanes), "cpu")
            packed.decode_into(torch.empty(n * k, dtype=torch.int16), check=False)
            for m in b.ROWS_M:
                df11_rows_gemv(packed, torch.zeros(m, k, dtype=torch.bfloat16), check=False)

        yield (
            "df11",
            f"rows decode+gemv M={','.join(map(str, b.ROWS_M))} N={n} K={k} lanes={lanes}",
            decode_gemv,
        )


def _layer_cases() -> Iterator[Case]:
    """The layer ops (`kernels.layers`, what `integrations.hf.fuse` runs) at Llama-3-8B's decode (16 rows) and prefill
    (2048 tokens) shapes in bf16, and rotary embedding at 64 and 128 query heads (70B-class; its warps double)."""
    import torch

    from codesign.kernels.layers import ops as L

    bf = dict(dtype=torch.bfloat16)
    for rows in (16, 2048):
        x, w = torch.zeros(rows, 4096, **bf), torch.zeros(4096, **bf)
        yield ("layers", f"rms_norm rows={rows} hidden=4096 bf16", lambda x=x, w=w: L.rms_norm(x, w, 1e-5))
        yield ("layers", f"rms_norm (Gemma: 1 + w) rows={rows} bf16",
               lambda x=x, w=w: L.rms_norm(x, w, 1e-6, 1.0, False))  # fmt: skip
        yield ("layers", f"add_rms_norm rows={rows} hidden=4096 bf16",
               lambda x=x, w=w: L.add_rms_norm(x, x, w, 1e-5))  # fmt: skip
        gu = torch.zeros(rows, 2 * 14336, **bf)
        for act in ("silu", "gelu_tanh"):
            yield ("layers", f"{act}_mul rows={rows} n=14336 (one GEMM's halves) bf16",
                   lambda gu=gu, act=act: L.act_mul(*gu.chunk(2, -1), act))  # fmt: skip
    for b, s, hq in ((16, 1, 32), (1, 2048, 32), (16, 1, 64), (16, 1, 128)):
        q = torch.zeros(b, s, hq, 128, **bf).transpose(1, 2)
        k = torch.zeros(b, s, 8, 128, **bf).transpose(1, 2)
        c = torch.zeros(b, s, 128, **bf)
        yield ("layers", f"rope B={b} S={s} q_heads={hq} kv_heads=8 D=128 bf16",
               lambda q=q, k=k, c=c: L.rope(q, k, c, c))  # fmt: skip
    yield from _state_cases()


def _state_cases() -> Iterator[Case]:
    """The recurrent-state ops (`kernels.layers.state_ops`) at decode, 16 sequences in bf16: Qwen3-Next's Gated
    DeltaNet (16 key heads, 32 value heads, 128 x 128; also 4 tokens, a speculative step's; trees of 15 and 31 nodes,
    a tree step's verification; and a 2048-token prompt, the chunked form), Mamba-2 as in Granite 4.0-H / Nemotron-H
    (128 heads of 64, state 128, one group and eight; trees of 15 and 31 nodes; and its scan over a 2048-token prompt);
    Jamba's Mamba-1 step (8192 channels, state 16) and its scan over a 2048-token prompt."""
    import torch

    from codesign.kernels.layers import state_ops as S
    from codesign.kernels.layers import tree_state_ops as TS

    bf = dict(dtype=torch.bfloat16)
    for t in (1, 4):
        q, v = torch.zeros(16, t, 16, 128, **bf), torch.zeros(16, t, 32, 128, **bf)
        g, h0 = torch.zeros(16, t, 32), torch.zeros(16, 32, 128, 128)
        yield ("layers", f"gated_delta_rule B=16 T={t} heads=16/32 dk=dv=128 bf16",
               lambda q=q, v=v, g=g, h0=h0: S.gated_delta_rule(q, q, v, g, g.bfloat16(), h0))  # fmt: skip
    for n in (15, 31):  # a tree speculative step's verification (binary trees of depth 3 and 4)
        q, v = torch.zeros(16, n, 16, 128, **bf), torch.zeros(16, n, 32, 128, **bf)
        g, h0 = torch.zeros(16, n, 32), torch.zeros(16, 32, 128, 128)
        parents = [-1] + [(i - 1) // 2 for i in range(1, n)]
        yield ("layers", f"gated_delta_tree B=16 N={n} heads=16/32 dk=dv=128 bf16",
               lambda q=q, v=v, g=g, h0=h0, p=parents: TS.gated_delta_tree(q, q, v, g, g.bfloat16(), p, h0))
    q, v = torch.zeros(1, 2048, 16, 128, **bf), torch.zeros(1, 2048, 32, 128, **bf)
    g = torch.zeros(1, 2048, 32)
    yield ("layers", "gated_delta_rule (chunked) B=1 T=2048 heads=16/32 dk=dv=128 bf16",
           lambda: S.gated_delta_rule(q, q, v, g, g.bfloat16()))  # fmt: skip
    for t in (1, 2048):  # the widest key heads the op takes (256), decode and a prompt
        qw, vw, gw = torch.zeros(1, t, 4, 256, **bf), torch.zeros(1, t, 8, 256, **bf), torch.zeros(1, t, 8)
        yield ("layers", f"gated_delta_rule B=1 T={t} heads=4/8 dk=dv=256 bf16",
               lambda qw=qw, vw=vw, gw=gw: S.gated_delta_rule(qw, qw, vw, gw, gw.bfloat16()))  # fmt: skip
    xs, bcs = torch.zeros(1, 2048, 128, 64, **bf), torch.zeros(1, 2048, 1, 128, **bf)
    dts, a = torch.zeros(1, 2048, 128, **bf), torch.zeros(128)
    yield ("layers", "ssd_scan B=1 T=2048 heads=128 P=64 N=128 groups=1 bf16",
           lambda: S.ssd_scan(xs, dts, a, bcs, bcs, a, a, True))  # fmt: skip
    bc2, h2 = torch.zeros(1, 2048, 1, 256, **bf), torch.zeros(1, 128, 64, 256)
    yield ("layers", "ssd_scan B=1 T=2048 heads=128 P=64 N=256 groups=1 bf16, an initial state, fp32 out",
           lambda: S.ssd_scan(xs, dts, a, bc2, bc2, a, a, True, initial_state=h2, out_dtype=torch.float32))
    st1, x1 = torch.zeros(16, 8192, 16), torch.zeros(16, 8192, **bf)
    a1, bc1 = torch.zeros(8192, 16), torch.zeros(16, 16, **bf)
    yield ("layers", "selective_state_update B=16 D=8192 N=16 fp32 state bf16 (Jamba's Mamba-1)",
           lambda: S.selective_state_update(st1, x1, x1, a1, bc1, bc1, a1[:, 0], a1[:, 0], True, x1))  # fmt: skip
    # Jamba's prompt as transformers' module passes it: x and dt contiguous `[Bt, D, T]`, the gate a `[D, T]` view of
    # the input projection (channels contiguous), B and C their norms' `[Bt, T, N]` outputs transposed; A, D and
    # dt's bias fp32, fp32 out
    proj = torch.zeros(1, 2048, 2 * 8192, **bf)
    gate, dt1, bc_t = proj[..., 8192:].transpose(1, 2), torch.zeros(1, 8192, 2048, **bf), \
        torch.zeros(1, 2048, 16, **bf).transpose(1, 2)  # fmt: skip
    xs1 = torch.zeros(1, 8192, 2048, **bf)
    yield ("layers", "selective_scan B=1 D=8192 T=2048 N=16 bf16 (Jamba's Mamba-1 prompt, its views), fp32 out",
           lambda: S.selective_scan(xs1, dt1, a1, bc_t, bc_t, a1[:, 0], a1[:, 0], True, gate,
                                    out_dtype=torch.float32))  # fmt: skip
    xw, bw = torch.zeros(1, 512, 2048, **bf), torch.zeros(1, 256, 2048, **bf)
    yield ("layers", "selective_scan B=1 D=512 T=2048 N=256 bf16, an initial state",
           lambda: S.selective_scan(xw, xw, torch.zeros(512, 256), bw, bw, None, None, True, None,
                                    torch.zeros(1, 512, 256)))  # fmt: skip
    for n in (15, 31):  # Mamba-2 (Granite 4.0-H) in a tree step's verification
        xt, bct = torch.zeros(16, n, 128, 64, **bf), torch.zeros(16, n, 1, 128, **bf)
        dtt = torch.zeros(16, n, 128, **bf)
        parents = [-1] + [(i - 1) // 2 for i in range(1, n)]
        yield ("layers", f"ssd_tree B=16 N={n} heads=128 P=64 N=128 groups=1 bf16, fp32 state",
               lambda xt=xt, bct=bct, dtt=dtt, p=parents: TS.ssd_tree(xt, dtt, a, bct, bct, p, a, a, True,
                                                                      torch.zeros(16, 128, 64, 128)))
    xa, bca, dta = torch.zeros(16, 4, 128, 64, **bf), torch.zeros(16, 4, 1, 128, **bf), torch.zeros(16, 4, 128)
    yield ("layers", "ssd_scan B=16 T=4 heads=128 P=64 N=128 groups=1 bf16, an initial state (the recurrence)",
           lambda: S.ssd_scan(xa, dta, a, bca, bca, initial_state=torch.zeros(16, 128, 64, 128)))
    st2, bcw = torch.zeros(16, 128, 64, 256), torch.zeros(16, 1, 256, **bf)
    yield ("layers", "ssd_update B=16 heads=128 P=64 N=256 fp32 state bf16",
           lambda: S.ssd_update(st2, torch.zeros(16, 128, 64, **bf), torch.zeros(16, 128, **bf), torch.zeros(128),
                                bcw, bcw, None, None, True))  # fmt: skip
    for groups in (1, 8):
        st, x = torch.zeros(16, 128, 64, 128), torch.zeros(16, 128, 64, **bf)
        bc, dt, a = torch.zeros(16, groups, 128, **bf), torch.zeros(16, 128, **bf), torch.zeros(128)
        yield ("layers", f"ssd_update B=16 heads=128 P=64 N=128 groups={groups} fp32 state bf16",
               lambda st=st, x=x, bc=bc, dt=dt, a=a: S.ssd_update(st, x, dt, a, bc, bc, a, a, True))  # fmt: skip


# ----------------------------------------------------------------------------- run
def lowering_report(arch: int, gpu_name: str, sections: list[str] | None = None, log=print) -> dict[str, Any]:
    """Compile every case's launches under compile_only(arch, gpu_name); the JSON report (module docstring)."""
    import torch
    import triton

    from codesign.autotune.compile_only import SMEM_OPTIN, compile_only
    from codesign.backend import use_backend

    # Expected here: no per-GPU tables are shipped (defaults are what the lent GPU runs too).
    warnings.filterwarnings("ignore", message="no tuned config for")
    warnings.filterwarnings("ignore", message="TRITON_DEFAULT_FP_FUSION")
    mods = _suite_modules()
    makers = {
        "correctness": lambda: _adapter_cases(mods, arch), "quant_gemm": lambda: _quant_gemm_cases(mods, arch),
        "attention": lambda: _attention_cases(mods), "kv_quant": lambda: _kvquant_cases(mods),
        "df11": lambda: _df11_cases(mods), "layers": _layer_cases,
    }  # fmt: skip
    t0 = time.monotonic()
    cases: list[dict[str, Any]] = []
    kernels: dict[str, dict[str, Any]] = {}
    with compile_only(arch, gpu_name) as session, use_backend("triton"):
        for sec in sections or list(makers):
            for section, label, call in makers[sec]():
                n0, c0 = len(session.launches), time.monotonic()
                row: dict[str, Any] = {"section": section, "case": label}
                try:
                    with torch.no_grad():
                        call()
                    row["ok"] = True
                except Skipped as e:
                    row.update(ok=None, skipped=str(e))
                except Exception as e:
                    row.update(ok=False, error=f"{type(e).__name__}: {e}"[:2000])
                    row["traceback"] = traceback.format_exc(limit=6)[-2500:]
                keys = []
                for launch in session.launches[n0:]:
                    d = launch.as_dict()
                    kern = kernels.setdefault(d["key"], {**d, "grids": [], "used_by": []})
                    if len(kern["grids"]) < 4 and d["grid"] not in kern["grids"]:
                        kern["grids"].append(d["grid"])
                    kern["used_by"].append(label)
                    keys.append(d["key"])
                    if not d["ok"]:
                        row["ok"] = False
                        row.setdefault("launch_problems", []).append(f"{launch.kernel}: {d['reason']}"[:600])
                row.update(launches=len(keys), seconds=round(time.monotonic() - c0, 2))
                cases.append(row)
                tag = "ok  " if row["ok"] else "skip" if row["ok"] is None else "BAD "
                err = f"  {row.get('error', '')[:200]}" if row["ok"] is False else ""
                log(f"[{time.monotonic() - t0:6.1f}s] {tag} {label}: {len(keys)} launches{err}")
    rows = list(kernels.values())
    for r in rows:
        r.pop("grid", None)
        r["n_launches"] = len(r["used_by"])
        r["used_by"] = sorted(set(r["used_by"]))[:12]
    bad = [r for r in rows if not r["ok"]]
    return {
        "version": 1,
        "arch": arch,
        "gpu_name": gpu_name,
        "smem_optin_limit": SMEM_OPTIN.get(arch),
        "triton": triton.__version__,
        "torch": torch.__version__,
        "date_utc": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "method": (
            "CPU tensors under codesign.autotune.compile_only: Triton compiles each launch for the target "
            "(JITFunction.run with warmup=True) and does not launch; registers/spills/stack from ptxas -v on "
            "the PTX (Triton's ptxas and flags); shared memory = metadata.shared (dynamic, what the launch requests)"
        ),
        "seconds": round(time.monotonic() - t0, 1),
        "summary": {
            "cases": len(cases),
            "case_errors": [c["case"] for c in cases if c["ok"] is False and "error" in c],
            "skipped": [c["case"] for c in cases if c["ok"] is None],
            "launches": sum(c["launches"] for c in cases),
            "distinct_kernels": len(rows),
            "compile_failures": [r["key"] for r in rows if r.get("error")],
            "not_ok": [
                f"{r['kernel']} {r['signature'].get('q_ptr', '')} w{r['num_warps']} s{r['num_stages']} "
                f"(first case: {r['used_by'][0]}; {len(r['used_by'])} cases): {r['reason']}"
                for r in bad
            ],
        },
        "kernels": rows,
        "cases": cases,
    }


def main(argv: list[str] | None = None) -> int:
    """CLI (module docstring): 1 when a launch failed to compile or a case failed on the host, else 0."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", type=int, default=90, help="compute capability to compile for (90, 80, ...)")
    ap.add_argument("--gpu-name", default="NVIDIA H200", help="GPU name the kernels look configs up under")
    ap.add_argument(
        "--out", type=Path, default=None, help="JSON file (default bench/results/lowering_sm<arch>.json)"
    )
    ap.add_argument("--sections", nargs="*", default=None,
                    help="correctness quant_gemm attention kv_quant df11 layers (default: all)")  # fmt: skip
    ap.add_argument("--estimates", action="store_true", help="tuner estimates vs compiler (compile_check)")
    args = ap.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        print(
            "lowering_report: unset TRITON_INTERPRET (kernels must compile, not interpret)", file=sys.stderr
        )
        return 2
    from codesign.autotune.export import atomic_write_json

    if args.estimates:
        from codesign.autotune.compile_check import estimate_report

        report = estimate_report(args.arch, args.gpu_name, log=print)
        out = args.out or BENCH_DIR / "results" / f"lowering_estimates_sm{args.arch}.json"
        atomic_write_json(out, json.loads(json.dumps(report, default=str)))
        print(f"wrote {out}")
        return 0
    report = lowering_report(args.arch, args.gpu_name, args.sections)
    out = args.out or BENCH_DIR / "results" / f"lowering_sm{args.arch}.json"
    atomic_write_json(out, json.loads(json.dumps(report, default=str)))
    s = report["summary"]
    print(f"{s['cases']} cases, {s['launches']} launches, {s['distinct_kernels']} distinct kernels, "
          f"{len(s['compile_failures'])} compile failures, {len(s['not_ok'])} not ok, "
          f"{len(s['case_errors'])} case errors; {report['seconds']} s")  # fmt: skip
    for line in s["not_ok"] + [f"case error: {c}" for c in s["case_errors"]]:
        print("  " + line[:300])
    print(f"wrote {out}")
    return 1 if s["compile_failures"] or s["case_errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
