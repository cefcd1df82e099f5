"""compile_only: real op paths compile for sm_90 without a GPU, nothing launches, patches are undone.

Each compile runs in a fresh Python without TRITON_INTERPRET (`helpers.assert_runs_without_interpreter`):
this process runs under the interpreter (conftest), where kernels cannot be compiled.
"""

from __future__ import annotations

import pytest
from helpers import assert_runs_without_interpreter

from codesign.autotune.compile_only import (
    CompiledLaunch,
    compile_only,
    parse_ptxas_log,
    ptx_census,
    sync_staged_loads,
)
from codesign.specs import CodesignError

# Captured from Triton 3.9's ptxas-blackwell (CUDA 13.4) -v on the W4A16 split-K kernel for sm_90a.
PTXAS_LOG = """\
ptxas-blackwell info    : 0 bytes gmem
ptxas-blackwell info    : Compiling entry function '_wq_kernel' for 'sm_90a'
ptxas-blackwell info    : Function properties for _wq_kernel
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas-blackwell info    : Used 168 registers, used 1 barriers
ptxas-blackwell info    : Compile time = 185.812 ms
"""
# Captured from the mixed-precision KV decode kernel (spills), plus a helper function's block before it
# (the older ptxas layout: properties of a callee, then the entry's own numbers with smem / cmem).
PTXAS_LOG_SPILLS = """\
ptxas info    : 11 bytes gmem
ptxas info    : Function properties for _helper
    16 bytes stack frame, 4 bytes spill stores, 4 bytes spill loads
ptxas info    : Compiling entry function '_paged_attn_kernel' for 'sm_90a'
ptxas info    : Function properties for _paged_attn_kernel
    3592 bytes stack frame, 8620 bytes spill stores, 11070 bytes spill loads
ptxas info    : Used 32 registers, used 1 barriers, 3592 bytes cumulative stack size, 1024 bytes smem
"""


def test_parse_ptxas_log():
    assert parse_ptxas_log(PTXAS_LOG) == {
        "registers": 168,
        "stack_bytes": 0,
        "spill_stores": 0,
        "spill_loads": 0,
    }
    assert parse_ptxas_log(PTXAS_LOG_SPILLS, "_paged_attn_kernel") == {
        "registers": 32, "stack_bytes": 3592, "spill_stores": 8620, "spill_loads": 11070,
    }  # fmt: skip
    with pytest.raises(CodesignError, match="no register count for kernel '_other'"):
        parse_ptxas_log(PTXAS_LOG, "_other")
    with pytest.raises(CodesignError, match="no register count"):
        parse_ptxas_log("ptxas fatal   : Unsupported .version 9.4")


def test_ptx_census_counts_each_instruction_kind():
    ptx = """
    wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%f1}, %rd1, %rd2, 1, 1, 1, 0, 1;
    wgmma.mma_async.sync.aligned.m64n128k32.s32.s8.s8 {%r1}, %rd1, %rd2, 1;
    mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%f1}, {%r1}, {%r2}, {%f2};
    cp.async.cg.shared.global [ %r3 + 0 ], [ %rd4 + 0 ], 0x10, %r5;
    cp.async.ca.shared.global [ %r3 + 0 ], [ %rd4 + 0 ], 0x4, %r5;
    cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%r1], [%rd1, {%r2, %r3}], [%r4];
    cp.async.commit_group;
    ld.global.v4.b32 { %r1, %r2, %r3, %r4 }, [ %rd1 + 0 ];
    @%p1 ld.global.nc.v4.b32 { %r1, %r2, %r3, %r4 }, [ %rd2 + 0 ];
    ld.global.b32 %r6, [ %rd3 + 0 ];
    cvt.rn.bf16.u32 %rs1, %r7;
    cvt.rn.f32.s32 %f3, %r8;
    cvt.f32.bf16 %f4, %rs2;
    mma.sync.aligned.m16n8k32.row.col.satfinite.s32.s8.s8.s32 {%r1}, {%r2}, {%r3}, {%r4};
    wgmma.mma_async.sync.aligned.m64n32k32.f32.e4m3.e4m3 {%f1}, %rd1, %rd2, 1, 1, 1;
    red.global.gpu.relaxed.add.v4.f32 [%rd5], {%f1, %f2, %f3, %f4};
    atom.global.gpu.acq_rel.add.f32 %f5, [%rd6], %f6;
    atom.global.add.u32 %r9, [%rd7], 1;
    mul.f16x2 %r10, %r11, %r12;
    mul.rn.ftz.f16x2 %r10, %r11, %r12;
    fma.rn.ftz.f32 %f7, %f8, %f9, %f10;
    """
    want = {"wgmma": 3, "wgmma_8bit": 2, "mma_sync": 2, "cp_async": 2, "tma": 1, "ld_global_v4": 2, "ld_global": 3,
            "cvt_i2f": 2, "mma_s8": 2, "mma_e4m3": 1, "f16_ftz": 1, "atomic_add_f32": 2}  # fmt: skip
    assert ptx_census(ptx) == want


def test_sync_staged_loads_counts_in_loop_allocs_of_loads_only():
    """A loop's own load staged to shared memory counts; the same pattern before the loop (a q tile loaded once),
    an alloc of computed values, and async copies do not."""
    ttgir = """
    %q = tt.load %qp : tensor<64x128x!tt.ptr<bf16>, #blocked>
    %qs = ttg.local_alloc %q : (tensor<64x128xbf16, #blocked>) -> !ttg.memdesc<64x128xbf16, #shared, #smem>
    %acc = scf.for %k = %c0 to %K step %c128 iter_args(%a = %cst) -> (tensor<64x64xf32, #mma>)  : i32 {
      %w_1 = tt.load %wp, %m, %cst_1 : tensor<128x64x!tt.ptr<f8E4M3FN>, #blocked1>
      %w_2 = ttg.local_alloc %w_1 : (tensor<128x64xf8E4M3FN, #blocked1>) -> !ttg.memdesc<128x64xf8E4M3FN>
      %x = arith.addf %w_1, %w_1 : tensor<128x64xf8E4M3FN, #blocked1>
      %x_s = ttg.local_alloc %x : (tensor<128x64xf8E4M3FN, #blocked1>) -> !ttg.memdesc<128x64xf8E4M3FN>
      %c = ttg.async_copy_global_to_local %ap, %buf : tensor<64x128x!tt.ptr<bf16>, #blocked> -> <64x128xbf16, #shared>
      scf.yield %a : tensor<64x64xf32, #mma>
    }
    %after = tt.load %qp : tensor<64x128x!tt.ptr<bf16>, #blocked>
    %after_s = ttg.local_alloc %after : (tensor<64x128xbf16, #blocked>) -> !ttg.memdesc<64x128xbf16, #shared, #smem>
    """
    assert sync_staged_loads(ttgir) == 1
    staged = CompiledLaunch("k", "m", 90, [1], 4, 3, 1024, 64, 0, 0, 0, sync_staged=1)
    assert any("not pipelined" in p for p in staged.problems())
    staged.num_stages = 1  # nothing to pipeline with one stage
    assert staged.problems() == []


def test_problems_name_each_limit():
    ok = CompiledLaunch("k", "m", 90, [1], 4, 2, 227 * 1024, 255, 0, 0, 0)
    assert ok.problems() == [] and ok.as_dict()["ok"]
    big = CompiledLaunch("k", "m", 80, [1], 4, 2, 163 * 1024 + 1, 96, 8, 4, 16)
    reasons = big.problems()
    assert any("opt-in limit 166912" in r for r in reasons) and any("spills: 8 B" in r for r in reasons)
    failed = CompiledLaunch("k", "m", 90, "(1,)", error="CompilationError: boom")
    assert failed.as_dict()["reason"] == "compile error: CompilationError: boom"


def test_refuses_under_the_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with pytest.raises(CodesignError, match="fresh process"), compile_only():
        pass


_PRELUDE = """
import torch
from codesign.autotune.compile_only import compile_only
from codesign.backend import use_backend
"""


def test_compiles_decode_attention_and_w4a16_gemv_for_sm90_without_launching():
    code = (
        _PRELUDE
        + """
import os, subprocess
from triton.backends.nvidia.compiler import get_ptxas
from codesign.kernels.gemm import formats as qf
from codesign.kernels.attention.wrappers import PagedDecodeWrapper
from codesign.kernels.attention.triton_attention import _paged_attn_kernel
from codesign.kernels.gemm.ops import quant_matmul
outs = {}
with compile_only(90, "NVIDIA H200") as s:
    for dt in (torch.float16, torch.bfloat16):
        k = torch.randn(5, 16, 2, 64).to(dt)
        bt = torch.tensor([[3, 1, 0], [4, 2, 0]], dtype=torch.int32)
        w = PagedDecodeWrapper("cpu")
        w.plan(k, bt, torch.tensor([37, 20], dtype=torch.int32), 6)   # auto backend: triton in this mode
        q = torch.randn(2, 6, 64).to(dt)
        outs[dt] = w.run(q, k, k.clone(), out=torch.full_like(q, float("nan")))
    qw = qf.quantize_rtn(torch.randn(96, 256), "int4", 64, True, torch.float16)
    quant_matmul(torch.randn(5, 256, dtype=torch.float16), qw)  # M = 5: the split-K variant
assert all(o.isnan().all() for o in outs.values()), "a kernel ran: the poisoned output was written"
names = [l.kernel for l in s.launches]
assert names.count("_paged_attn_kernel") == 2 and names[-1] == "_wq_kernel", names
att16, att_bf = [l for l in s.launches if l.kernel == "_paged_attn_kernel"]
gemv = s.launches[-1]
assert att16.signature["q_ptr"] == "*fp16" and att_bf.signature["q_ptr"] == "*bf16"
assert att16.constexprs["GROUP"] == 3 and att16.constexprs["GROUP_PAD"] == 16  # the GPU's 16-row tl.dot
assert gemv.constexprs["DOT_DTYPE"] == "fp16" and gemv.constexprs["SPLITK"] is True
assert gemv.grid[0] >= 1 and len(gemv.grid) == 3
for l in s.launches:
    assert l.arch == 90 and l.error is None and l.num_warps >= 1 and l.num_stages >= 1, l
    assert 0 < l.registers <= 255 and l.shared_bytes > 0 and l.spill_stores >= 0 and l.stack_bytes >= 0, l
# The registers ptxas -v reports equal those the cubin Triton built declares (cuobjdump, independent).
ck = list(_paged_attn_kernel.device_caches["compile-only-sm90"][0].values())[0]
assert ".target sm_90a" in ck.asm["ptx"]
import tempfile
cubin = tempfile.NamedTemporaryFile(suffix=".cubin", delete=False)
cubin.write(ck.asm["cubin"])
cubin.close()
dump = subprocess.run([get_ptxas(90).path.replace("ptxas-blackwell", "cuobjdump"), "--dump-resource-usage",
                       cubin.name], capture_output=True, text=True, check=True).stdout
os.remove(cubin.name)
regs = int(dump.split("REG:")[1].split()[0])
assert regs in {l.registers for l in s.launches if l.kernel == "_paged_attn_kernel"}, (regs, dump)
print("ok")
"""
    )
    assert_runs_without_interpreter(code)


def test_resources_come_from_tritons_own_ptxas_log_then_from_its_cache(tmp_path):
    """A kernel Triton compiles in the session takes its registers and spills from Triton's own `ptxas -v` log;
    one Triton loads from its cache takes them from the facts stored beside its cubin: no second ptxas run either
    way, and the same numbers a separate ptxas run gives. A corrupt facts file is computed again."""
    code = (
        _PRELUDE
        + """
import json, os, sys
from pathlib import Path
import codesign.autotune.compile_only as co
from codesign.kernels.gemm import formats as qf
from codesign.kernels.gemm.ops import quant_matmul
runs, real = [], co._ptxas_usage
co._ptxas_usage = lambda k, a: runs.append(k.hash) or real(k, a)
qw = qf.quantize_rtn(torch.randn(96, 256), "int4", 64, True, torch.float16)
with compile_only(90, "NVIDIA H200") as s:
    quant_matmul(torch.randn(5, 256, dtype=torch.float16), qw)
(l,) = s.launches
k = s.compiled[0]
from triton.runtime.cache import get_cache_manager
facts = Path(get_cache_manager(k.hash).get_file("codesign_compile_facts.json"))
assert str(facts).startswith(os.environ["TRITON_CACHE_DIR"]), facts
assert runs == [], runs  # from Triton's log (first process) or the stored facts (second)
assert json.loads(facts.read_text())["usage"] == real(k, 90) == {n: getattr(l, n) for n in
    ("registers", "stack_bytes", "spill_stores", "spill_loads")}
assert l.ptx_ops == co.ptx_census(k.asm["ptx"]) and l.ptx_ops["mma_sync"] + l.ptx_ops["wgmma"] > 0
if sys.argv[1] == "warm":  # a corrupt file: ptxas runs again, and the facts are stored anew
    for bad in ("{not json", json.dumps({"usage": {"registers": 1}, "census": {}, "sync_staged": 0})):
        facts.write_text(bad)
        co._FACTS.clear()
        again = co._kernel_facts(k, 90)["usage"]
        assert json.loads(facts.read_text())["usage"] == again == real(k, 90), bad
    assert runs == [k.hash] * 2, runs
print("ok")
"""
    )
    import os
    import subprocess
    import sys

    env = dict(os.environ, TRITON_INTERPRET="0", TRITON_CACHE_DIR=str(tmp_path))
    for phase in ("cold", "warm"):
        res = subprocess.run([sys.executable, "-c", code, phase], env=env, capture_output=True, text=True, timeout=300)
        # nothing of Triton's ptxas log reaches the session's stdout
        assert res.returncode == 0 and res.stdout == "ok\n", (phase, res.stdout[-2000:], res.stderr[-3000:])


def test_patches_undone_after_the_block_and_after_an_exception():
    code = (
        _PRELUDE
        + """
from triton.runtime import driver
from triton.runtime.jit import JITFunction
from codesign.backend import device_view
from codesign.specs import CodesignError
from codesign.kernels.attention.paged import paged_decode_attention
def state():
    return (JITFunction.run, driver._active, device_view("cpu"))
before = state()
assert before[2].gpu_name is None and not before[2].gpu and not before[2].compile_only
with compile_only() as s:
    v = device_view("cpu")
    assert (v.gpu_name, v.sms, v.capability, v.min_dot_rows) == ("NVIDIA H200", 132, (9, 0), 16)
    assert v.gpu and v.compiled and v.hw_fp8 and v.bf16_dot and v.compile_only and not v.interpreted
assert state() == before
try:
    with compile_only():
        raise KeyError("inside")
except KeyError:
    pass
assert state() == before
q, k = torch.randn(1, 2, 16, dtype=torch.float16), torch.randn(2, 16, 2, 16, dtype=torch.float16)
args = (q, k, k, torch.zeros(1, 1, dtype=torch.int32), torch.ones(1, dtype=torch.int32))
try:
    with use_backend("triton"):
        paged_decode_attention(*args)
    raise AssertionError("triton on CPU tensors without compile_only or the interpreter must be refused")
except CodesignError as e:
    assert "TRITON_INTERPRET=1" in str(e)
try:
    with compile_only(), compile_only():
        pass
    raise AssertionError("nested sessions must be refused")
except CodesignError as e:
    assert "already active" in str(e)
assert state() == before
print("ok")
"""
    )
    assert_runs_without_interpreter(code)


def test_kernels_look_their_tables_up_under_the_given_gpu_name(tmp_path):
    code = (
        _PRELUDE
        + f"""
import json, os
from codesign.autotune import lookup
from codesign.kernels.gemm import formats as qf
from codesign.kernels.gemm.ops import quant_matmul
root = {str(tmp_path)!r}
os.environ["CODESIGN_CONFIG_DIR"] = root
cfg = {{"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 32, "SPLIT_K": 1, "num_warps": 2, "num_stages": 2}}
table = {{**lookup.table_header("w4a16_gemm_splitk", "NVIDIA H200", ["codesign.kernels.gemm.triton_gemm"]),
          "entries": {{lookup.shape_key(N=96, K=256, G=64): {{"1": cfg}}}}}}
os.makedirs(os.path.join(root, "nvidia-h200"))
json.dump(table, open(os.path.join(root, "nvidia-h200", "w4a16_gemm_splitk.json"), "w"))
qw = qf.quantize_rtn(torch.randn(96, 256), "int4", 64, True, torch.float16)
x = torch.randn(5, 256, dtype=torch.float16)  # M = 5: split-K (the table's M = 1 entry is the nearest)
for gpu, want in (("NVIDIA H200", (32, 32, 2, 2)), ("NVIDIA H100 80GB HBM3", (128, 64, 8, 4))):
    with compile_only(90, gpu) as s:
        quant_matmul(x, qw)
    c = s.launches[-1]
    got = (c.constexprs["BLOCK_N"], c.constexprs["BLOCK_K"], c.num_warps, c.num_stages)
    assert got == want, (gpu, got)  # H100: no table, the GPU defaults (splitk_w4; BLOCK_K clamped to the group)
print("ok")
"""
    )
    assert_runs_without_interpreter(code)


@pytest.mark.slow
def test_gemm_smem_estimate_not_below_the_compilers():
    code = """
from codesign.autotune.compile_check import check_estimates
rows = check_estimates("w8a8_gemm", {"M": 20, "N": 40, "K": 256}, n=3, arch=90)  # tiles <= 32 x 64
assert len(rows) == 3 and any(r.pruned_by_estimate is None for r in rows), rows
rows += check_estimates("fp8_gemm", {"M": 20, "N": 40, "K": 256}, n=2, arch=90)
fused = check_estimates("w8a8_gemm", {"M": 3, "N": 256, "K": 512, "FUSEDQ": 1}, n=2, arch=90)
fused += check_estimates("fp8_gemm", {"M": 3, "N": 256, "K": 512, "FUSEDQ": 1}, n=2, arch=90)
for r in fused:  # the fused kernel's register estimate too (its A tile lives in registers)
    assert r.pruned_by_estimate is not None or r.est_regs >= r.real_regs, r
rows += fused
rows += check_estimates("w4a16_gemm", {"M": 3, "N": 256, "K": 512, "G": 128, "SPLITK": 1}, n=2, arch=90)
rows += check_estimates("w4a16_gemm", {"M": 3, "N": 256, "K": 512, "G": 128, "GEMV": 1}, n=3, arch=90)
for r in rows:
    # (the GEMV may use no shared memory at all: its sums stay in registers)
    assert r.error is None and (r.real_smem > 0 or r.shape.get("GEMV")) and r.real_regs > 0, r
    assert r.est_smem >= r.real_smem, f"estimate {r.est_smem} B < compiler {r.real_smem} B for {r.config}"
print("ok")
"""
    assert_runs_without_interpreter(code)


@pytest.mark.slow
def test_untuned_defaults_neither_spill_nor_overflow_shared_memory():
    """Regressions the lowering report found: sub-byte KV decode spilled at BLOCK_N 64 on sm_90 (1.2 KB per
    thread for INT4), and so did Oaken's offline variant at 64 x 128 (52 B); W8A8's 128 x 128 x 128 default
    needed 180 KB of shared memory (over the A100's 163 KiB) and the tiled weight-only default 115 KB (over
    sm_89's 99 KiB). KIVI gathered its scales per element."""
    code = (
        _PRELUDE
        + """
from codesign.autotune.ops import get_op
from codesign.kernels.attention import triton_attention as pt
from codesign.kernels.attention import launch_rules as lr
from codesign.kernels.gemm.triton_gemm import _GPU_DEFAULTS
fmts = {"paged_attention_int4": pt.KV_FORMAT_INT, "paged_attention_mixed": pt.KV_FORMAT_MIXED,
        "paged_attention_kivi": pt.KV_FORMAT_KIVI, "paged_attention_oaken": pt.KV_FORMAT_OAKEN}
fmts_both = (pt.KV_FORMAT_INT, pt.KV_FORMAT_MIXED)
# Mixed and KIVI defaults depend on the block size: 16-token tiles in blocks of 16, 32 x 128 on 4 warps in blocks of 32.
blocks = (pt.KV_FORMAT_MIXED, pt.KV_FORMAT_KIVI)
with compile_only(90, "NVIDIA H200") as s:
    for name, fmt in fmts.items():
        for m, ctx in ((4, 256), (16, 4096)) if fmt in fmts_both else ((16, 4096),):  # 1 and 3 splits
            for bs in (16, 32) if fmt in blocks else (16,):
                shape = dict(M=m, q_heads=32, kv_heads=8, head_dim=128, block_size=bs, ctx=ctx)
                op = get_op(name)
                cfg = lr.default_config(128, 2, fmt, 4, bs) | ({"BY_WIDTH": 0} if fmt == pt.KV_FORMAT_MIXED else {})
                op.run(op.make_inputs(shape, torch.float16, "cpu", 0), cfg)  # (mixed: its one-launch kernel)
# Tree verification at its default tile (64 x 4 warps, as the extend): the byte-mask tile spilled 312 B there.
from codesign.kernels.attention.tree import build_tree_batch
from codesign.kernels.attention.paged import tree_attention
tree = build_tree_batch([[-1] + [i // 2 for i in range(63)]] * 4, [4096] * 4)
bt = torch.zeros(4, 4096 // 16 + 5, dtype=torch.int32)
kv = torch.zeros(2, 16, 8, 128, dtype=torch.bfloat16)
with compile_only(90, "NVIDIA H200") as t, use_backend("triton"):
    tree_attention(torch.zeros(4 * 64, 32, 128, dtype=torch.bfloat16), kv, kv, bt, tree, check_data=False)
(tl_,) = [l for l in t.launches if l.kernel == "_paged_attn_kernel"]
assert (tl_.constexprs["BLOCK_N"], tl_.num_warps) == (64, 4), (tl_.constexprs["BLOCK_N"], tl_.num_warps)
# Quantized trees at 64 wide: FP8 keeps 4 warps (228 registers); INT8 spilled 44 B there, so it takes 8.
from codesign.kernels.attention.quantized import kvq_tree_attention
from codesign.kernels.kvcache.kvq import QuantPagedKV
with compile_only(90, "NVIDIA H200") as tq:
    for fmt, hs in (("int8", None), ("fp8", torch.full((8,), 4.0 / 448))):
        kvq_tree_attention(torch.zeros(4 * 64, 32, 128, dtype=torch.bfloat16),
                           QuantPagedKV.empty(4, 16, 8, 128, fmt, "cpu", hs, hs), bt, tree, check_data=False)
tq_ = [l for l in tq.launches if l.kernel == "_paged_attn_kernel"]
assert [l.num_warps for l in tq_] == [8, 4], [(l.constexprs["BLOCK_N"], l.num_warps) for l in tq_]
# KIVI reads its per-channel key scales once per tile and its value scales once per group, not once per
# element: the bench shape's kernel had 139 global loads in its PTX with the per-element gather (20x slower
# than the bf16 cache on an H200), 48 without (80 here: G = 16, eight value groups per token).
for kv_ in [l for l in s.launches if l.constexprs.get("KV_FORMAT") == pt.KV_FORMAT_KIVI]:
    assert kv_.ptx_ops["ld_global"] <= 100, kv_.ptx_ops
# Codes become fp16 by bit patterns, not an integer-to-float cvt per element (128 per thread in the INT8 and INT4
# decode kernels before, 64 in KIVI's, 38 in Oaken's): what is left converts indices, outside the loop.
for l in s.launches:
    if l.kernel == "_paged_attn_kernel":
        assert l.ptx_ops["cvt_i2f"] <= 4, (l.constexprs["KV_FORMAT"], l.ptx_ops)
        # Mixed's codes are fp16 subnormals until one packed multiply: no fp16 op may flush them to zero.
        assert l.ptx_ops["f16_ftz"] == 0, (l.constexprs["KV_FORMAT"], l.ptx_ops)
# Oaken's offline variant (8-bit metadata on a per-head grid) at its default: 64 x 128 spilled 52 B.
from codesign.kernels.kvcache.oaken import OakenPagedKV
from codesign.kernels.attention.quantized import oaken_attention
thr = torch.tensor([[-1.0, 1.0]] * 8).expand(2, 8, 2).contiguous()
grid = torch.tensor([[-2.0, 0.0625]] * 8).expand(2, 8, 2).contiguous()
with compile_only(90, "NVIDIA H200") as o:
    cache = OakenPagedKV.empty(4, 32, 8, 128, 4, thr, 4, "cpu", grid=grid)
    oaken_attention(torch.zeros(16, 32, 128, dtype=torch.bfloat16), cache, torch.zeros(16, 64, dtype=torch.int32),
                    torch.full((16,), 2048, dtype=torch.int32), check_data=False)
for l in [*s.launches, tl_, *tq_, *o.launches]:
    assert l.problems() == [], (l.kernel, l.constexprs.get("BLOCK_N"), l.problems())
for arch, gpu, opname, kind, shp in ((80, "NVIDIA A100-SXM4-80GB", "w8a8_gemm", "scaled_mm", dict(M=256, N=512, K=512)),
                                     (89, "NVIDIA L40S", "w4a16_gemm", "tiled", dict(M=256, N=512, K=512, G=128)),
                                     # the 256-row tile past one wave: mma.sync at ~245 registers must not spill
                                     (80, "NVIDIA A100-SXM4-80GB", "w4a16_gemm", "tiled_wide",
                                      dict(M=512, N=512, K=512, G=128)),
                                     (89, "NVIDIA L40S", "w8a16_gemm", "tiled_wide", dict(M=512, N=512, K=512, G=0))):
    with compile_only(arch, gpu) as s:
        op = get_op(opname)
        op.run(op.make_inputs(shp, torch.float16, "cpu", 0), dict(_GPU_DEFAULTS[kind]))
    big = [l for l in s.launches if l.kernel in ("_scaled_mm_kernel", "_wq_kernel")]
    assert big and all(l.problems() == [] for l in big), [(l.kernel, l.shared_bytes, l.problems()) for l in big]
    assert all(l.ptx_ops["mma_sync"] > 0 and l.ptx_ops["wgmma"] == 0 for l in big), [l.ptx_ops for l in big]
# On Hopper the int8 and fp8 GEMMs must reach the warpgroup MMA, fed by the asynchronous copy pipeline.
with compile_only(90, "NVIDIA H200") as s:
    for opname in ("w8a8_gemm", "fp8_gemm"):
        op = get_op(opname)
        # TORCH=0 pins ours in two launches (at M = 256 on sm_90 the default rule takes the TMA kernel).
        op.run(op.make_inputs(dict(M=256, N=512, K=512, TORCH=0), torch.float16, "cpu", 0),
               dict(_GPU_DEFAULTS["scaled_mm"]))  # fmt: skip
mm = [l for l in s.launches if l.kernel == "_scaled_mm_kernel"]
assert len(mm) == 2 and all(l.ptx_ops["wgmma"] > 0 and l.ptx_ops["cp_async"] > 0 for l in mm), [l.ptx_ops for l in mm]
# W4A16's 64-row Hopper tile (tiled_w4) and the 256-row one on 16 warps (tiled_wide_wg, W4A16 and W8A16): warpgroup
# MMA, no spill, within sm_90's shared memory.
with compile_only(90, "NVIDIA H200") as s:
    op = get_op("w4a16_gemm")
    op.run(op.make_inputs(dict(M=256, N=512, K=512, G=128), torch.bfloat16, "cpu", 0), dict(_GPU_DEFAULTS["tiled_w4"]))
    for opname, g in (("w4a16_gemm", 128), ("w8a16_gemm", 0)):
        op = get_op(opname)
        op.run(op.make_inputs(dict(M=512, N=512, K=512, G=g), torch.bfloat16, "cpu", 0),
               dict(_GPU_DEFAULTS["tiled_wide_wg"]))  # fmt: skip
w4 = [l for l in s.launches if l.kernel == "_wq_kernel"]
assert len(w4) >= 3 and all(l.problems() == [] and l.ptx_ops["wgmma"] > 0 for l in w4), [(l.problems(), l.ptx_ops)
                                                                                          for l in w4]  # fmt: skip
assert sorted(l.num_warps for l in w4)[-2:] == [16, 16]
# and its 8-warp split-K (splitk_w4) at decode M: no spill.
with compile_only(90, "NVIDIA H200") as s:
    op = get_op("w4a16_gemm")
    op.run(op.make_inputs(dict(M=16, N=512, K=1024, G=128, SPLITK=1), torch.bfloat16, "cpu", 0),
           dict(_GPU_DEFAULTS["splitk_w4"]))  # fmt: skip
sk = [l for l in s.launches if l.kernel == "_wq_kernel"]
assert sk and all(l.problems() == [] and l.num_warps == 8 for l in sk), [(l.problems(), l.num_warps) for l in sk]
print("ok")
"""
    )
    assert_runs_without_interpreter(code)


def test_extend_and_tree_launches_do_not_spill_with_either_mma():
    """Extend and tree programs hold 64 query rows (`launch_rules.rows_config`). Before that rule, compiled
    for sm_80 (mma.sync: both dot operands and the accumulators in registers) in bf16 at head_dim 128 every
    such launch spilled on 4 warps (bf16 tree 112 B, INT8 extend 532 B; INT8 tree 164 B even on 8 warps), and for
    sm_90 the INT8 extend spilled 20 B on 4 warps, the mixed tree over two blocks 164 B on 8, and with Oaken's
    index read as pairs its tree 40 B on 64 rows (the offline variant's 16 B on 32)."""
    code = (
        _PRELUDE
        + """
from codesign.backend import use_backend
from codesign.kernels.attention.paged import tree_attention
from codesign.kernels.attention.quantized import (kvq_extend_attention, kvq_tree_attention, mixed_attention,
                                                  oaken_attention)
from codesign.kernels.kvcache.oaken import OakenPagedKV
from codesign.kernels.attention.tree import build_tree_batch
from codesign.kernels.kvcache.kvq import QuantPagedKV
from codesign.kernels.kvcache.mixed import MixedPagedKV
B, Q, P, HQ, HKV, D = 4, 64, 4096, 32, 8, 128
tree = build_tree_batch([[-1] + [i // 2 for i in range(Q - 1)]] * B, [P] * B)
bt = torch.zeros(B, (P + Q) // 16 + 5, dtype=torch.int32)
cl = torch.full((B,), P + Q, dtype=torch.int32)
cu = torch.arange(0, (B + 1) * Q, Q, dtype=torch.int32)
q = torch.zeros(B * Q, HQ, D, dtype=torch.bfloat16)
kv = torch.zeros(2, 16, HKV, D, dtype=torch.bfloat16)
fp8 = QuantPagedKV.empty(4, 16, HKV, D, "fp8", "cpu", torch.full((HKV,), 0.01), torch.full((HKV,), 0.01))
int8 = QuantPagedKV.empty(4, 16, HKV, D, "int8")
mixed = MixedPagedKV.empty(8, 32, HKV, D)
bt32 = torch.zeros(B, (P + Q) // 32 + 5, dtype=torch.int32)
thr = torch.tensor([[-1.0, 1.0]] * HKV).expand(2, HKV, 2).contiguous()
grid = torch.tensor([[-2.0, 0.0625]] * HKV).expand(2, HKV, 2).contiguous()
oaken = OakenPagedKV.empty(8, 32, HKV, D, 4, thr, 4)
oaken_off = OakenPagedKV.empty(8, 32, HKV, D, 4, thr, 4, grid=grid)
cases = {
    80: {"bf16 tree": lambda: tree_attention(q, kv, kv, bt, tree, check_data=False),
         "fp8 tree": lambda: kvq_tree_attention(q, fp8, bt, tree, check_data=False),
         "int8 extend": lambda: kvq_extend_attention(q, int8, bt, cl, cu, check_data=False),
         "int8 tree": lambda: kvq_tree_attention(q, int8, bt, tree, check_data=False),
         "mixed tree": lambda: mixed_attention(q, mixed, bt32, cl, tree=tree, check_data=False)},
    90: {"int8 extend": lambda: kvq_extend_attention(q, int8, bt, cl, cu, check_data=False),
         "mixed tree": lambda: mixed_attention(q, mixed, bt32, cl, tree=tree, check_data=False),
         "oaken tree": lambda: oaken_attention(q, oaken, bt32, cl, tree=tree, check_data=False),
         "oaken offline tree": lambda: oaken_attention(q, oaken_off, bt32, cl, tree=tree, check_data=False)},
}
gpus = {80: "NVIDIA A100-SXM4-80GB", 90: "NVIDIA H200"}
for arch, calls in cases.items():
    for name, call in calls.items():
        with use_backend("triton"), compile_only(arch, gpus[arch]) as s:
            call()
        (l,) = [l for l in s.launches if l.kernel == "_paged_attn_kernel"]
        assert l.problems() == [], (arch, name, l.registers, l.problems())
        assert l.num_warps == 8 or (arch == 90 and name.startswith(("bf16", "fp8"))), (arch, name, l.num_warps)
print("ok")
"""
    )
    assert_runs_without_interpreter(code)
