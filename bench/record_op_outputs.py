"""Record the sha256 of every public kernel op's output on a fixed, seeded set of calls.

    python bench/record_op_outputs.py --out bench/results/op_outputs.json      # record
    python bench/record_op_outputs.py --check bench/results/op_outputs.json    # compare (exit 1 on a change)

Every call runs through the torch backend and through the Triton interpreter (CPU tensors,
TRITON_INTERPRET=1, set here before any kernel module is imported): each GEMM op and variant, the
activation quantizers, QuantLinear / quantize_ and the checkpoint importers, DF11 decode / GEMV / fused
GEMM / linear, every KV writer and cache type, paged decode / extend / tree attention over every cache
format with the options (window, softcap, ALiBi, lse, splits), verify_tree, and the plan()/run() wrappers
over every cache type. An output's hash covers its dtype, shape and bytes. Hashes are comparable on one
machine and environment (torch's CPU kernels may round differently elsewhere); one thread, so the
summation order does not depend on the machine's load.
"""

from __future__ import annotations

import argparse
import fnmatch
import hashlib
import json
import os
import sys
from collections.abc import Callable, Iterator
from typing import Any

os.environ["TRITON_INTERPRET"] = "1"  # before any @triton.jit is defined

import torch  # noqa: E402

from codesign.backend import use_backend  # noqa: E402
from codesign.kernels.attention import wrappers as aw  # noqa: E402
from codesign.kernels.attention.paged import paged_decode_attention, paged_extend_attention, tree_attention  # noqa: E402
from codesign.kernels.attention.quantized import (  # noqa: E402
    kivi_decode_attention,
    kivi_extend_attention,
    kivi_tree_attention,
    kvq_decode_attention,
    kvq_extend_attention,
    kvq_tree_attention,
    mixed_attention,
    oaken_attention,
)
from codesign.kernels.attention.tree import build_tree_batch, verify_tree  # noqa: E402
from codesign.kernels.df11 import codec  # noqa: E402
from codesign.kernels.df11 import linear as dl  # noqa: E402
from codesign.kernels.gemm import checkpoints as qi  # noqa: E402
from codesign.kernels.gemm import formats as qf  # noqa: E402
from codesign.kernels.gemm import linear as ql  # noqa: E402
from codesign.kernels.gemm import ops as qg  # noqa: E402
from codesign.kernels.kvcache import quantizers as kq  # noqa: E402
from codesign.kernels.kvcache.blocks import PagedKVCache  # noqa: E402
from codesign.kernels.kvcache.kivi import KiviPagedKV  # noqa: E402
from codesign.kernels.kvcache.kvq import QuantPagedKV, kvq_write  # noqa: E402
from codesign.kernels.kvcache.mixed import MixedPagedKV, cocktail_bits, mixed_write  # noqa: E402
from codesign.kernels.kvcache.oaken import OakenPagedKV  # noqa: E402
from codesign.kernels.kvcache.write import kv_write  # noqa: E402

BACKENDS = ("torch", "triton")
Case = tuple[str, Callable[[], Any]]
# Cases whose output changed on purpose since the recording (glob over the case key -> why); --check lists
# them apart and does not fail on them.
INTENDED = {
    "attention/*/wrapper * spec mixed *": "mixed precision became a KVFormat of its own (scheme 'mixed', counted "
    "as INT8 per token as before): the spec's kv_format changed, its flops and bytes did not ('spec numbers')",
    "kv/*/caches *": "Oaken caches keep their outlier index (k_index, v_index): two more fields in the digest",
    "kv/*/oaken writes": "Oaken caches keep their outlier index (k_index, v_index): two more fields in the digest",
    "attention/*oaken*": "Oaken's index holds each slot's delta rounded at its last 9 mantissa bits (2026-12-06): "
    "both backends read the outliers as the index holds them (`OakenPagedKV.dequantize(as_read=True)`)",
}


def digest(x: Any) -> str:
    """sha256 over every tensor in `x` (nested tuples / lists / dicts / dataclasses), with dtype and shape."""
    h = hashlib.sha256()

    def feed(v: Any) -> None:
        if isinstance(v, torch.Tensor):
            t = v.detach().cpu().contiguous()
            h.update(f"T{t.dtype}{tuple(t.shape)}".encode())
            if t.numel():
                h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
        elif isinstance(v, dict):
            for k in sorted(v):
                h.update(f"K{k}".encode())
                feed(v[k])
        elif isinstance(v, (tuple, list)):
            h.update(f"L{len(v)}".encode())
            for e in v:
                feed(e)
        elif hasattr(v, "__dataclass_fields__"):
            for k in v.__dataclass_fields__:
                h.update(f"F{k}".encode())
                feed(getattr(v, k))
        else:
            h.update(f"S{v!r}".encode())

    feed(x)
    return h.hexdigest()


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# ----------------------------------------------------------------------------- GEMM
def gemm_cases() -> Iterator[Case]:
    g = gen(1)
    for bits, (n, k) in ((4, (48, 256)), (8, (40, 128))):
        w = torch.randn(n, k, generator=g)
        for group, sym in ((32, True), (64, False), (None, True)):
            qw = qf.quantize_rtn(w, f"int{bits}", group, sym, torch.float16)
            yield f"quantize_rtn int{bits} g{group} sym{sym}", lambda qw=qw: (qw, qf.dequantize(qw))
            bias = torch.randn(n, generator=g)
            for m in (3, 37):  # split-K and tiled variants
                for dt in (torch.float16, torch.float32, torch.bfloat16):
                    x = torch.randn(m, k, generator=g).to(dt)
                    b = bias.to(dt) if group == 64 else None
                    op = qg.w4a16_gemm if bits == 4 else qg.w8a16_gemm
                    yield (
                        f"w{bits}a16 g{group} sym{sym} M{m} {dt}",
                        lambda op=op, x=x, qw=qw, b=b: op(x, qw.qweight, qw.scales, qw.zeros, b, qw.group),
                    )
    w = torch.randn(40, 128, generator=g)
    q8 = qf.quantize_rtn(w, "int8", None, True, torch.float32)
    f8 = qf.quantize_rtn(w, "fp8_e4m3", None, True)
    f8t = qf.quantize_rtn(w, "fp8_e4m3", -1, True)
    for m in (1, 5, 70):
        for dt in (torch.float16, torch.float32):
            x = torch.randn(m, 128, generator=g).to(dt) * 3
            b = torch.randn(40, generator=g).to(dt)
            yield f"w8a8 M{m} {dt}", lambda x=x, b=b: qg.w8a8_gemm(x, q8.qweight, q8.scales, b)
            yield f"fp8 M{m} {dt}", lambda x=x: qg.fp8_gemm(x, f8.qweight, f8.scales, None)
            yield f"fp8 per-tensor M{m} {dt}", lambda x=x, b=b: qg.fp8_gemm(x, f8t.qweight, f8t.scales, b)
            yield f"act int8 M{m} {dt}", lambda x=x: qg.quantize_per_token_int8(x)
            yield f"act fp8 M{m} {dt}", lambda x=x: qg.quantize_per_token_fp8(x)
    x = torch.randn(2, 3, 128, generator=g)
    yield "quant_matmul int8 act", lambda: qg.quant_matmul(x, q8, None, act_quant=True)
    yield "quant_matmul fp8", lambda: qg.quant_matmul(x, f8)
    yield from _linear_cases(g)
    yield from _checkpoint_cases(g)


def _linear_cases(g: torch.Generator) -> Iterator[Case]:
    base = torch.nn.Sequential(torch.nn.Linear(128, 64), torch.nn.ReLU(), torch.nn.Linear(64, 32, bias=False))
    with torch.no_grad():
        for p in base.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    x = torch.randn(4, 128, generator=g)
    configs = (ql.W4A16Config(group_size=32), ql.W4A16Config(group_size=64, symmetric=False),
               ql.W8A16Config(), ql.W8A8Config(), ql.FP8Config(), ql.FP8Config(per_tensor=True))  # fmt: skip
    for cfg in configs:
        import copy

        def run(cfg=cfg):
            model = ql.quantize_(copy.deepcopy(base), cfg)
            return [model(x), *(b for b in model.buffers())]

        yield f"quantize_ {cfg}", run


def _checkpoint_cases(g: torch.Generator) -> Iterator[Case]:
    k, n, group = 256, 64, 128
    codes = torch.randint(0, 16, (k, n), generator=g)
    qweight = qf.pack_codes(codes, 4)
    zeros = torch.randint(0, 16, (k // group, n), generator=g)
    qzeros = torch.zeros(k // group, n // 8, dtype=torch.int64)
    for j in range(8):
        qzeros |= (zeros[:, j::8] - 1).clamp(min=0) << (4 * j)
    qzeros = qzeros.to(torch.int32)
    scales = torch.rand(k // group, n, generator=g).half() + 0.01
    g_idx = torch.randperm(k, generator=g).to(torch.int32) // group
    yield "from_gptq", lambda: qf.dequantize(qi.from_gptq(qweight, qzeros, scales, None, 4, group))
    yield "from_gptq act-order", lambda: qf.dequantize(qi.from_gptq(qweight, qzeros, scales, g_idx, 4, group))
    awq_w = torch.randint(-(2**31), 2**31 - 1, (k, n // 8), generator=g, dtype=torch.int64).to(torch.int32)
    yield "from_awq", lambda: qf.dequantize(qi.from_awq(awq_w, qzeros, scales, group))


# ----------------------------------------------------------------------------- DF11
def df11_cases() -> Iterator[Case]:
    g = gen(2)
    w = (torch.randn(24, 96, generator=g) * 0.05).to(torch.bfloat16)
    df = codec.compress(w, 16, 4, 32)
    yield "df11 compress", lambda: (torch.from_numpy(df.stream.copy()), torch.from_numpy(df.gaps.copy()),
                                    torch.from_numpy(df.sign_mantissa.copy()))  # fmt: skip
    packed = dl.PackedDF11(df, "cpu", segment=32)
    yield "df11 decode", lambda: packed.decode()
    x1 = torch.randn(96, generator=g).to(torch.bfloat16)
    xm = torch.randn(5, 96, generator=g).to(torch.bfloat16)
    bias = torch.randn(24, generator=g).to(torch.bfloat16)
    yield "df11_gemv", lambda: dl.df11_gemv(packed, x1, bias)
    yield "df11_gemm", lambda: dl.df11_gemm(packed, xm, bias)
    for exact in (True, False):
        for x in (x1[None], xm, torch.randn(20, 96, generator=g).to(torch.bfloat16)):
            yield f"df11_linear exact{exact} M{x.shape[0]}", lambda x=x, e=exact: dl.df11_linear(packed, x, bias,
                                                                                               exact=e)  # fmt: skip
    lin = torch.nn.Linear(96, 24).to(torch.bfloat16)
    with torch.no_grad():
        lin.weight.copy_(w)
    yield "LosslessBF16Linear", lambda: dl.LosslessBF16Linear.from_linear(lin)(xm)


# ----------------------------------------------------------------------------- KV caches
BS, H, D, HQ = 4, 2, 16, 4


def _tables(ctx: list[int], seed: int) -> tuple[torch.Tensor, int]:
    need = [-(-c // BS) for c in ctx]
    nb = sum(need) + 2
    perm = torch.randperm(nb, generator=gen(seed))
    bt = torch.zeros(len(ctx), max(need) + 1, dtype=torch.int32)
    pos = 0
    for b, n in enumerate(need):
        bt[b, :n] = perm[pos : pos + n].to(torch.int32)
        pos += n
    return bt, nb


def _slots(bt: torch.Tensor, ctx: list[int]) -> torch.Tensor:
    return torch.tensor(
        [int(bt[b, t // BS]) * BS + t % BS for b, n in enumerate(ctx) for t in range(n)], dtype=torch.int64
    )


CTX = [9, 14, 5]


def _kv(seed: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = gen(seed)
    return torch.randn(n, H, D, generator=g), torch.randn(n, H, D, generator=g)


def _oaken_params(k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return kq.calibrate_kv_thresholds([(k, v)], 0.06)[0], kq.calibrate_oaken_grid([(k, v)])[0]


def make_caches(dtype: torch.dtype = torch.float32) -> dict[str, Any]:
    """One cache of every type holding the same K/V for CTX (written by the active backend's writer)."""
    bt, nb = _tables(CTX, 3)
    slots = _slots(bt, CTX)
    k, v = _kv(4, slots.numel())
    out: dict[str, Any] = {"bt": bt, "nb": nb}
    kc = torch.zeros(nb, BS, H, D, dtype=dtype)
    vc = torch.zeros_like(kc)
    kv_write(k.to(dtype), v.to(dtype), kc, vc, slots)
    out["plain"] = (kc, vc)
    for fmt in ("int8", "int4", "int2", "fp8"):
        sc = (kq.fp8_head_scales(k), kq.fp8_head_scales(v)) if fmt == "fp8" else (None, None)
        c = QuantPagedKV.empty(nb, BS, H, D, fmt, "cpu", *sc)
        kvq_write(k.to(dtype), v.to(dtype), c, slots)
        out[fmt] = c
    kivi = KiviPagedKV.empty(nb, BS, H, D, 4, 2, 2, len(CTX))
    pos = 0
    for b, n in enumerate(CTX):
        half = n // 2  # two appends: the second flushes groups the first left in the ring
        kivi.append(b, bt[b], 0, k[pos : pos + half], v[pos : pos + half])
        kivi.append(b, bt[b], half, k[pos + half : pos + n], v[pos + half : pos + n])
        pos += n
    out["kivi"] = kivi
    thr, grid = _oaken_params(k, v)
    for name, gr in (("oaken", None), ("oaken_offline", grid)):
        c = OakenPagedKV.empty(nb, BS, H, D, 4, thr, 3, "cpu", grid=gr)
        c.write(k.to(dtype), v.to(dtype), slots)
        out[name] = c
    mixed = MixedPagedKV.empty(nb, BS, H, D)
    mixed.set_block_bits(list(range(nb)), [(8, 4, 2)[i % 3] for i in range(nb)])
    mixed_write(k.to(dtype), v.to(dtype), mixed, slots)
    out["mixed"] = mixed
    return out


def kv_cases() -> Iterator[Case]:
    for dt in (torch.float32, torch.float16):
        yield f"caches {dt}", lambda dt=dt: {n: c for n, c in make_caches(dt).items()}

    def oaken_split():  # two writes into one block, and a revisited block
        k, v = _kv(5, 12)
        thr, grid = _oaken_params(k, v)
        res = []
        for gr in (None, grid):
            c = OakenPagedKV.empty(6, BS, H, D, 2, thr, 2, "cpu", grid=gr)
            c.write(k[:6], v[:6], torch.arange(6))
            c.write(k[6:], v[6:], torch.tensor([6, 7, -1, 0, 1, 20]))
            res.append(c)
        return res

    yield "oaken writes", oaken_split
    g = gen(6)
    x = torch.randn(20, 3, 32, generator=g)
    xv = torch.randn(20, 3, 32, generator=g)
    yield "kv_quant references", lambda: (
        [kq.quantize_per_token(x, b) for b in (8, 4, 2)],
        kq.kivi_fake_quant(x, xv, 4, 8, 4),
        kq.oaken_fake_quant(x, 4, kq.calibrate_kv_thresholds([(x, xv)], 0.05)[0][0], 4, 3),
        kq.oaken_fake_quant(x, 4, kq.calibrate_kv_thresholds([(x, xv)], 0.05)[0][0], 4, 3,
                            kq.calibrate_oaken_grid([(x, xv)])[0][0]),
        kq.quantize_fp8(x, kq.fp8_head_scales(x)),
        cocktail_bits(torch.randn(3, 6, 32, generator=gen(7)), [x[i : i + 4] for i in range(0, 20, 4)]),
    )  # fmt: skip

    def allocator():
        c = PagedKVCache(8, 4, 2, 16)
        c.add_sequence(0)
        s0 = c.append_slots(0, 6)
        c.fork(0, 1)
        s1 = c.append_slots(1, 3)
        c.truncate(0, 2)
        return s0, s1, c.block_tables([0, 1]), c.context_lens([0, 1])

    yield "PagedKVCache", allocator


# ----------------------------------------------------------------------------- attention
OPTIONS = {
    "default": {},
    "window+softcap+lse": {"window": 5, "softcap": 8.0, "return_lse": True},
    "alibi+scale+splits": {"sm_scale": 0.3, "num_splits": 2, "return_lse": True},
}


def _alibi() -> torch.Tensor:
    return torch.linspace(0.1, 0.8, HQ)


def _opts(name: str) -> dict:
    o = dict(OPTIONS[name])
    if name.startswith("alibi"):
        o["alibi_slopes"] = _alibi()
    return o


def _tree(prefix: list[int]) -> Any:
    return build_tree_batch([[-1, 0, 0, 1], [-1, 0], [-1, 0, 1]], prefix)


def attention_cases() -> Iterator[Case]:
    for dt in (torch.float32, torch.float16):
        caches = make_caches(dt)
        g = gen(8)
        inputs = {
            "bt": caches["bt"],
            "ctx": torch.tensor(CTX, dtype=torch.int32),
            "qd": torch.randn(len(CTX), HQ, D, generator=g).to(dt),
            "cu": torch.tensor([0, 3, 5, 8], dtype=torch.int32),
            "qe": torch.randn(8, HQ, D, generator=g).to(dt),
            "tree": _tree([c - n for c, n in zip(CTX, (4, 2, 3))]),
            "qt": torch.randn(9, HQ, D, generator=g).to(dt),
        }
        for oname in OPTIONS:
            yield from _option_cases(caches, inputs, f"{dt} {oname}", _opts(oname))
        yield from _wrapper_cases(dt, caches, inputs)
    yield from _verify_cases()


def _option_cases(caches: dict, i: dict, tag: str, o: dict) -> Iterator[Case]:
    bt, ctx, cu, tree, qd, qe, qt = (i[n] for n in ("bt", "ctx", "cu", "tree", "qd", "qe", "qt"))
    kc, vc = caches["plain"]
    yield f"plain decode {tag}", lambda: paged_decode_attention(qd, kc, vc, bt, ctx, **o)
    yield f"plain extend {tag}", lambda: paged_extend_attention(qe, kc, vc, bt, ctx, cu, **o)
    yield f"plain tree {tag}", lambda: tree_attention(qt, kc, vc, bt, tree, **o)
    for fmt in ("int8", "int4", "int2", "fp8"):
        c = caches[fmt]
        yield f"{fmt} decode {tag}", lambda c=c: kvq_decode_attention(qd, c, bt, ctx, **o)
        yield f"{fmt} extend {tag}", lambda c=c: kvq_extend_attention(qe, c, bt, ctx, cu, **o)
        yield f"{fmt} tree {tag}", lambda c=c: kvq_tree_attention(qt, c, bt, tree, **o)
    c = caches["kivi"]
    yield f"kivi decode {tag}", lambda: kivi_decode_attention(qd, c, bt, ctx, **o)
    yield f"kivi extend {tag}", lambda: kivi_extend_attention(qe, c, bt, ctx, cu, **o)
    yield f"kivi tree {tag}", lambda: kivi_tree_attention(qt, c, bt, tree, **o)
    for name, fn in (
        ("oaken", oaken_attention),
        ("oaken_offline", oaken_attention),
        ("mixed", mixed_attention),
    ):
        c = caches[name]
        yield f"{name} decode {tag}", lambda c=c, fn=fn: fn(qd, c, bt, ctx, **o)
        yield f"{name} extend {tag}", lambda c=c, fn=fn: fn(qe, c, bt, ctx, cu, **o)
        yield f"{name} tree {tag}", lambda c=c, fn=fn: fn(qt, c, bt, None, tree=tree, **o)


def _wrapper_cases(dt: torch.dtype, caches: dict, i: dict) -> Iterator[Case]:
    bt, ctx, cu = i["bt"], i["ctx"], i["cu"]
    parents = [[-1, 0, 0, 1], [-1, 0], [-1, 0, 1]]
    prefix = [c - n for c, n in zip(CTX, (4, 2, 3))]
    kinds = {
        "decode": (aw.PagedDecodeWrapper, (bt, ctx, HQ), i["qd"]),
        "extend": (aw.PagedExtendWrapper, (bt, ctx, cu, HQ), i["qe"]),
        "tree": (aw.TreeAttentionWrapper, (bt, parents, prefix, HQ), i["qt"]),
    }
    for name in ("plain", "int8", "int4", "int2", "fp8", "kivi", "oaken", "oaken_offline", "mixed"):
        cache = caches[name]
        k_arg, v_arg = cache if name == "plain" else (cache, None)
        qdt = {"q_dtype": dt} if name != "plain" else {}
        for oname in ("default", "alibi+scale+splits"):
            o = _opts(oname)
            lse = o.pop("return_lse", False)
            for kind, (cls, args, q) in kinds.items():

                def planned(cls=cls, args=args, k_arg=k_arg, o=o, qdt=qdt):
                    w = cls("cpu")
                    w.plan(k_arg, *args, **o, **qdt)
                    return w

                tag = f"{name} {dt} {oname}"
                run = lambda p=planned, q=q, k=k_arg, v=v_arg, lse=lse: p().run(q, k, v, return_lse=lse)  # noqa: E731
                yield f"wrapper {kind} {tag}", run
                yield f"wrapper {kind} spec {tag}", lambda p=planned: p().spec()
                yield f"wrapper {kind} spec numbers {tag}", lambda p=planned: _spec_numbers(p().spec())


def _spec_numbers(spec: Any) -> tuple[float, float]:
    return spec.flops(), spec.min_bytes()


def _verify_cases() -> Iterator[Case]:
    g = gen(9)
    parents = [-1, 0, 0, 1, 1, 2]
    logits = torch.randn(6, 11, generator=g)
    toks = torch.randint(0, 11, (6,), generator=g)
    toks[1] = int(logits[0].argmax())
    probs = torch.softmax(torch.randn(6, 11, generator=g), -1)
    yield "verify_tree greedy", lambda: verify_tree(parents, toks, logits)
    for t in (0.7, 1.0):
        yield (
            f"verify_tree stochastic T{t}",
            lambda t=t: [verify_tree(parents, toks, logits, probs, mode="stochastic", temperature=t,
                                     generator=gen(s)) for s in range(5)],
        )  # fmt: skip


SECTIONS = {"gemm": gemm_cases, "df11": df11_cases, "kv": kv_cases, "attention": attention_cases}


def record(only: list[str] | None = None) -> dict[str, str]:
    torch.set_num_threads(1)
    out = {}
    for section, cases in SECTIONS.items():
        if only and section not in only:
            continue
        for backend in BACKENDS:
            with use_backend(backend):
                for name, call in cases():
                    key = f"{section}/{backend}/{name}"
                    if key in out:
                        raise RuntimeError(f"duplicate case {key}")
                    torch.manual_seed(0)
                    try:
                        out[key] = digest(call())
                    except Exception as e:  # a refused call is behaviour too: record the error's type
                        out[key] = f"error {type(e).__name__}: {str(e)[:200]}"
                    print(key, out[key][:16], flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", help="write the hashes to this JSON file")
    p.add_argument("--check", help="compare with this JSON file; exit 1 on any difference")
    p.add_argument("--only", nargs="*", choices=tuple(SECTIONS), help="only these sections")
    args = p.parse_args(argv)
    got = record(args.only)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"torch": torch.__version__, "cases": got}, f, indent=1, sort_keys=True)
            f.write("\n")
    if args.check:
        with open(args.check) as f:
            want = json.load(f)["cases"]
        if args.only:
            want = {k: v for k, v in want.items() if k.split("/")[0] in args.only}
        return _report(want, got)
    return 0


def _report(want: dict[str, str], got: dict[str, str]) -> int:
    """Print the differences (intended ones apart); 1 when any case differs without a reason in INTENDED."""
    diff = sorted(k for k in set(want) | set(got) if want.get(k) != got.get(k))
    why = {k: next((r for pat, r in INTENDED.items() if fnmatch.fnmatchcase(k, pat)), None) for k in diff}
    for k in diff:
        print(f"{'INTENDED' if why[k] else 'DIFF'} {k}: {want.get(k)} -> {got.get(k)}")
    for reason in sorted({r for r in why.values() if r}):
        print(f"intended ({sum(r == reason for r in why.values())}): {reason}")
    unexplained = [k for k in diff if not why[k]]
    print(f"{len(want) - len(diff)} of {len(want)} hashes match; {len(diff) - len(unexplained)} differ as "
          f"intended, {len(unexplained)} otherwise")  # fmt: skip
    return 1 if unexplained else 0


if __name__ == "__main__":
    sys.exit(main())
