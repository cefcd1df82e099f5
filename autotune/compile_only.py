"""Compile every Triton launch of our real op code for a CUDA target on a machine without a GPU.

    with compile_only(arch=90, gpu_name="NVIDIA H200") as session:
        paged_decode_attention(q, k, v, tables, lens)      # CPU tensors: compiles for sm_90, launches nothing
    for launch in session.launches: print(launch.kernel, launch.registers, launch.shared_bytes)

How (all undone on exit, also after an exception):
  * the kernels ask `codesign.backend.device_view` what the device is; the session overrides that one view
    (`use_device_view`) with the lent GPU's: the name their tables are looked up under, its SM count (decode
    split counts), compute capability and hardware fp8, the 16-row `tl.dot` minimum, bf16 dot operands, and
    that CPU tensors count as GPU tensors ("triton" runs on them, "auto" picks it). Without it the CPU
    tensors would compile the interpreter's variants (fp32 dots, 1-row tiles), not the kernels the GPU runs;
  * Triton itself still needs two stand-ins, since it asks its active driver for the target and launches
    after compiling: the driver is replaced by one that reports a `GPUTarget("cuda", arch, 32)` and a device
    id of its own (so compile-only kernels never share a JIT cache slot with a real GPU's), and
    `JITFunction.run` is wrapped to pass `warmup=True` (Triton binds the arguments, specialises, compiles:
    PTX by LLVM, cubin by the ptxas that ships with Triton, and returns before the launch).

Resources: registers, spill stores / loads and stack come from `ptxas -v`: the log of Triton's own ptxas run
when the session compiles the kernel, else (Triton loaded it from its cache) the facts kept beside the cubin
(`_kernel_facts`), else a run of the same ptxas binary with Triton's flags on its PTX (`_ptxas_usage`). `cuobjdump
--dump-resource-usage` on the cubin reports registers and stack but no spill bytes, so ptxas it is; the
tests check that both report the same register count. Shared memory is Triton's `metadata.shared`: the
dynamic shared memory the launch requests, which Triton's launcher compares with the device's opt-in limit.

Outputs are never written in this mode (nothing runs): host code that reads a kernel's output back sees
whatever the buffer held. Covered: the DF11 ops read their error flags back only with `check=True` (pass
`check=False`, as `bench/lowering_report.py` does). The GEMMs (split-K ones join their splits in the launch), the
plain and quantizing KV writers, paged decode / extend / tree attention over every cache format and the activation
quantizer read nothing back.

Process-wide and not thread-safe (Triton's driver and `JITFunction.run` are global); one session at a time.
Needs a process in which TRITON_INTERPRET is not "1" (Triton decides interpreter or compiler when a kernel
is defined).
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import os
import re
import subprocess
import tempfile
from collections.abc import Iterator
from typing import Any

from codesign.backend import DeviceView, use_device_view
from codesign.specs.errors import CodesignError

# Opt-in shared memory per block (bytes) by compute capability: CUDA programming guide, "Compute capabilities".
SMEM_OPTIN = {80: 163 * 1024, 86: 99 * 1024, 87: 163 * 1024, 89: 99 * 1024, 90: 227 * 1024}
MAX_REGS_PER_THREAD = 255
# SMs of the GPUs we are lent (decode attention picks its split count from them).
# First match wins (substring of the upper-cased name).
SMS_BY_NAME = {"H200": 132, "H100 PCIE": 114, "H100": 132, "A100": 108, "L40S": 142, "L4": 58}


@dataclasses.dataclass
class CompiledLaunch:
    """One `kernel[grid](...)` launch compiled for sm_`arch` (resources per thread / per block)."""

    kernel: str
    module: str
    arch: int
    grid: list[int] | str
    num_warps: int | None = None
    num_stages: int | None = None
    shared_bytes: int | None = None
    registers: int | None = None
    spill_stores: int | None = None
    spill_loads: int | None = None
    stack_bytes: int | None = None
    constexprs: dict[str, Any] = dataclasses.field(default_factory=dict)
    signature: dict[str, str] = dataclasses.field(default_factory=dict)
    aligned16: list[str] = dataclasses.field(default_factory=list)
    ptx_ops: dict[str, int] = dataclasses.field(default_factory=dict)  # `ptx_census` of the kernel's PTX
    # tiles a loop loads and stores to shared memory itself every step (`sync_staged_loads` of the TTGIR)
    sync_staged: int | None = None
    error: str | None = None

    @property
    def key(self) -> str:
        """Identity of the compiled code: kernel, argument types, 16-byte alignment, constexprs, options."""
        cx = ",".join(f"{k}={v}" for k, v in sorted(self.constexprs.items()))
        sig = ",".join(f"{k}:{v}" for k, v in self.signature.items())
        return (
            f"{self.module}.{self.kernel}({sig})[{cx}]"
            f"align16={','.join(self.aligned16)};w{self.num_warps};s{self.num_stages}"
        )

    def problems(self) -> list[str]:
        """Why this launch cannot run well on sm_`arch`: compile error, shared memory over the opt-in
        limit, register spills, more than 255 registers. Empty when it fits."""
        if self.error is not None:
            return [f"compile error: {self.error}"]
        out = []
        limit = SMEM_OPTIN.get(self.arch)
        if limit is not None and (self.shared_bytes or 0) > limit:
            out.append(f"shared memory {self.shared_bytes} B > sm_{self.arch} opt-in limit {limit} B")
        if (self.spill_stores or 0) > 0 or (self.spill_loads or 0) > 0:
            out.append(f"register spills: {self.spill_stores} B stored, {self.spill_loads} B loaded")
        if (self.registers or 0) > MAX_REGS_PER_THREAD:
            out.append(f"{self.registers} registers/thread > {MAX_REGS_PER_THREAD}")
        if (self.num_stages or 0) > 1 and (self.sync_staged or 0) > 0:
            out.append(f"{self.sync_staged} loop tile(s) loaded to registers and stored to shared memory every step "
                       "(not pipelined: the loop waits on each load)")
        return out

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready row: the fields, plus `key`, `ok` and (when not ok) `reason`."""
        d = dataclasses.asdict(self)
        bad = self.problems()
        d.update(key=self.key, ok=not bad)
        if bad:
            d["reason"] = "; ".join(bad)
        return d


@dataclasses.dataclass
class CompileSession:
    """What one `compile_only` block compiled, in launch order."""

    arch: int
    gpu_name: str
    sms: int
    launches: list[CompiledLaunch] = dataclasses.field(default_factory=list)
    # Triton's compiled kernels, one per launch (None where the compile failed): their `asm` holds the PTX,
    # the cubin and, on first access, the SASS (`bench/attention_predict.py` counts its main loop).
    compiled: list[Any] = dataclasses.field(default_factory=list)


# ----------------------------------------------------------------------------- what the PTX holds
# Instructions whose presence says how a kernel was lowered: Hopper's asynchronous warpgroup MMA or the
# Ampere-style synchronous one, asynchronous global->shared copies (Triton's software pipeline), bulk
# tensor copies (TMA), 16-byte vector loads. Counts are static (instructions in the PTX, not executed).
PTX_OPS = {
    "wgmma": r"\bwgmma\.mma_async\b",
    # ... on 8-bit operands (int8 / e4m3 / e5m2: the W8A8 / FP8 GEMMs' dots, not a bf16 upcast of them).
    "wgmma_8bit": r"\bwgmma\.mma_async(?:\.\w+)*\.(?:s8|u8|e4m3|e5m2)\b",
    "mma_sync": r"\bmma\.sync\b",
    "cp_async": r"\bcp\.async\.(?:ca|cg)\b",
    "tma": r"\bcp\.async\.bulk\.tensor\b",
    "ld_global_v4": r"\bld\.global(?:\.\w+)*\.v4\b",
    # Every global load, any width: dequantizing caches that gather metadata per element issue one per
    # element (a KIVI tile loaded its per-channel scales once per token row).
    "ld_global": r"\bld\.global\b",
    # Integer-to-float conversions (16 per clock per SM on sm_80/sm_90): one per element of a dequantized tile
    # bounded the INT8 KV cache near its whole memory time; codes become fp16 by bit patterns instead.
    "cvt_i2f": r"\bcvt\.rn\.(?:f16|bf16|f32|f64)(?:x2)?\.[us](?:8|16|32|64)\b",
    # Matrix instructions by operand type (either MMA): int8 GEMMs must meet s8 codes, e4m3 ones e4m3 (at a 16-row
    # tile on sm_90 Triton's mma.sync takes e4m3 upcast to f16 instead), not a wider copy of them.
    "mma_s8": r"\b(?:mma\.sync|wgmma\.mma_async\.sync)\.aligned(?:\.\w+)*?\.s32\.s8\.s8\b",
    "mma_e4m3": r"\b(?:mma\.sync|wgmma\.mma_async\.sync)\.aligned(?:\.\w+)*?\.f32\.e4m3\.e4m3\b",
    # fp16 arithmetic that flushes subnormals: the mixed KV cache's codes are fp16 subnormals made normal by one
    # packed multiply (`triton_codes.words_f16_units`), which a flush to zero would turn into zeros.
    "f16_ftz": r"\b(?:mul|fma|add|sub)(?:\.\w+)*?\.ftz(?:\.\w+)*?\.f16(?:x2)?\b",
    # fp32 atomic adds to global memory (split-K reductions), with or without a returned value.
    "atomic_add_f32": r"\b(?:red|atom)\.global(?:\.\w+)*?\.add(?:\.\w+)*?\.f32\b",
}


def ptx_census(ptx: str) -> dict[str, int]:
    """Static count of each `PTX_OPS` instruction in `ptx`: are the matrix instructions and the pipelined
    copies that were meant there (the first H200 run found quantized GEMMs far slower than bf16)."""
    return {name: len(re.findall(pattern, ptx)) for name, pattern in PTX_OPS.items()}


_SSA_LOAD_RE = re.compile(r"^\s*(%[\w.#]+) = tt\.load\b")
_SSA_ALLOC_RE = re.compile(r"\bttg\.local_alloc (%[\w.#]+)\b")


def sync_staged_loads(ttgir: str) -> int:
    """Shared-memory operands a loop loads itself every step: `ttg.local_alloc` of a `tt.load` result inside an
    `scf.for`. Triton's pipeliner turns the loads it can stage into `cp.async` / TMA copies, so one left is a tile
    the loop waits on each step (e.g. an 8-bit wgmma operand that is not K contiguous: sm_90 reads those only
    K-contiguous, so a row-major weight tile was transposed through registers every K step, unpipelined)."""
    loads: set[str] = set()
    loops: list[int] = []  # indentation of the open scf.for lines
    n = 0
    for line in ttgir.splitlines():
        indent = len(line) - len(line.lstrip())
        while loops and line.strip().startswith("}") and indent <= loops[-1]:
            loops.pop()
        if "scf.for" in line:
            loops.append(indent)
        m = _SSA_LOAD_RE.match(line)
        if m:
            loads.add(m.group(1))
        m = _SSA_ALLOC_RE.search(line)
        if m and loops and m.group(1) in loads:
            n += 1
    return n


# ----------------------------------------------------------------------------- ptxas resource usage
_FUNC_RE = re.compile(r"(?:Compiling entry function|Function properties for)\s+'?([A-Za-z_$][\w$]*)'?")
_PROPS_RE = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_REGS_RE = re.compile(r"Used (\d+) registers")


def parse_ptxas_log(text: str, kernel: str | None = None) -> dict[str, int]:
    """Registers, spill stores / loads and stack frame (bytes) of `kernel` (default: the first entry
    function) from `ptxas -v` output. Lines name the function they belong to ("Compiling entry
    function 'k'", "Function properties for k"); the numbers after one belong to it. CodesignError when
    the kernel's register line is missing (an unparseable log must not read as "0 registers")."""
    per: dict[str, dict[str, int]] = {}
    order: list[str] = []
    cur = None
    for line in text.splitlines():
        m = _FUNC_RE.search(line)
        if m:
            cur = m.group(1)
            if cur not in per:
                per[cur] = {}
                order.append(cur)
            continue
        if cur is None:
            continue
        if m := _PROPS_RE.search(line):
            per[cur].update(stack_bytes=int(m[1]), spill_stores=int(m[2]), spill_loads=int(m[3]))
        if m := _REGS_RE.search(line):
            per[cur]["registers"] = int(m[1])
    name = kernel if kernel is not None else (order[0] if order else None)
    got = per.get(name or "", {})
    if "registers" not in got:
        raise CodesignError(f"ptxas log: no register count for kernel {name!r} in:\n{text[-800:]}")
    return {"stack_bytes": 0, "spill_stores": 0, "spill_loads": 0, **got}


_FACTS_FILE = "codesign_compile_facts.json"  # beside the kernel's cubin in Triton's cache
_FACTS: dict[str, dict[str, Any]] = {}  # by kernel hash, this process


def _kernel_facts(kernel: Any, arch: int, log: str = "") -> dict[str, Any]:
    """The launch's resources (`_ptxas_usage`), `ptx_census` and `sync_staged_loads`, computed once a kernel:
    kept in Triton's cache beside the cubin (its key covers the source, options, target and ptxas), so a
    kernel Triton loads from its cache is not run through ptxas and the PTX scans again. `log`: the
    `ptxas -v` output of Triton's own compile of it, when this call compiled it (then no second ptxas run)."""
    from triton.runtime.cache import get_cache_manager

    h = kernel.hash
    if h in _FACTS:
        return _FACTS[h]
    cache = get_cache_manager(h)
    stored = cache.get_file(_FACTS_FILE)
    facts = None
    if stored:
        with contextlib.suppress(OSError, ValueError):
            with open(stored) as f:
                facts = json.load(f)
    usage_keys = {"registers", "stack_bytes", "spill_stores", "spill_loads"}
    if not isinstance(facts, dict) or not {"usage", "census", "sync_staged"} <= set(facts) \
            or not isinstance(facts["usage"], dict) or set(facts["usage"]) != usage_keys:
        usage = None
        if kernel.metadata.name in log:  # the log names each function it compiled
            with contextlib.suppress(CodesignError):
                usage = parse_ptxas_log(log, kernel.metadata.name)
        facts = {
            "usage": usage or _ptxas_usage(kernel, arch),
            "census": ptx_census(kernel.asm["ptx"]),
            "sync_staged": sync_staged_loads(kernel.asm["ttgir"]),
        }
        with contextlib.suppress(OSError, RuntimeError):  # a read-only cache: computed again next time
            cache.put(json.dumps(facts), _FACTS_FILE, binary=False)
    _FACTS[h] = facts
    return facts


@contextlib.contextmanager
def _ptxas_log() -> Iterator[io.StringIO]:
    """Collects the `ptxas -v` log of the kernels Triton compiles inside the block (Triton prints it to stdout
    when `knobs.nvidia.dump_ptxas_log` is set); everything else printed there is passed on."""
    from triton import knobs

    buf = io.StringIO()
    saved = knobs.nvidia.dump_ptxas_log
    knobs.nvidia.dump_ptxas_log = True
    try:
        with contextlib.redirect_stdout(buf):
            yield buf
    finally:
        knobs.nvidia.dump_ptxas_log = saved
        rest = [line for line in buf.getvalue().splitlines(keepends=True)
                if line.strip() and not line.startswith("ptxas") and not _PROPS_RE.search(line)]  # (indented)
        if rest:
            print("".join(rest), end="")


def _ptxas_usage(kernel: Any, arch: int) -> dict[str, int]:
    """`ptxas -v` on the compiled kernel's PTX, with Triton's ptxas for `arch` and Triton's flags."""
    from triton.backends.nvidia.compiler import get_ptxas, sm_arch_from_capability

    md = kernel.metadata
    with tempfile.TemporaryDirectory(prefix="codesign-ptxas-") as tmp:
        src = os.path.join(tmp, "k.ptx")
        with open(src, "w") as f:
            f.write(kernel.asm["ptx"])
        cmd = [get_ptxas(arch).path, "-lineinfo", "-v", "--regAllocOptLevel=2",
               f"--gpu-name={sm_arch_from_capability(arch)}", src, "-o", os.path.join(tmp, "k.o")]  # fmt: skip
        if not md.enable_fp_fusion:
            cmd.insert(1, "--fmad=false")
        if md.maxnreg is not None:
            cmd.insert(1, f"--maxrregcount={md.maxnreg}")
        if md.ptx_options:  # extra ptxas options Triton was given (knobs.nvidia.ptxas_options)
            cmd[1:1] = md.ptx_options.split()
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    if res.returncode != 0:
        raise CodesignError(f"ptxas failed on {md.name} for sm_{arch}: {res.stderr[-1500:]}")
    return parse_ptxas_log(res.stdout + res.stderr, md.name)


# ----------------------------------------------------------------------------- the lent GPU's view
def lent_gpu_view(arch: int, gpu_name: str, sms: int) -> DeviceView:
    """The device view of a GPU of compute capability `arch` named `gpu_name` with `sms` SMs, compiled for and
    never run: what every device answers inside a `compile_only` block."""
    return DeviceView(
        gpu=True,
        gpu_name=gpu_name,
        sms=sms,
        capability=(arch // 10, arch % 10),
        hw_fp8=arch >= 89,
        min_dot_rows=16,
        bf16_dot=True,
        interpreted=False,
        compile_only=True,
    )


# ----------------------------------------------------------------------------- the context manager
_ACTIVE: list[CompileSession] = []


class _TargetDriver:
    """Stands in for Triton's CUDA driver: a compile target and a device id of its own, no device."""

    def __init__(self, arch: int) -> None:
        from triton.backends.compiler import GPUTarget

        self.target = GPUTarget("cuda", arch, 32)
        self.device = f"compile-only-sm{arch}"  # a JIT cache slot no real device uses

    def get_current_target(self) -> Any:
        return self.target

    def get_current_device(self) -> Any:
        return self.device

    def get_current_stream(self, device: Any = None) -> int:
        return 0

    def get_active_torch_device(self) -> Any:
        import torch

        return torch.device("cpu")


def _describe(kernel: Any, fn: Any, arch: int, grid: Any, log: str = "") -> CompiledLaunch:
    src = kernel.src
    names = list(src.signature)
    cx = {}
    for path, val in src.constants.items():
        idx = path[0] if isinstance(path, tuple) else path
        name = names[idx] if isinstance(idx, int) else str(idx)
        cx[name] = val if isinstance(val, (bool, int, float, str)) or val is None else str(val)
    sig = {n: t for n, t in src.signature.items() if t != "constexpr"}
    aligned = []
    for path, attrs in (getattr(src, "attrs", None) or {}).items():
        idx = path[0] if isinstance(path, tuple) else path
        if isinstance(idx, int) and any(a and a[0] == "tt.divisibility" for a in attrs):
            aligned.append(names[idx])
    md = kernel.metadata
    facts = _kernel_facts(kernel, arch, log)
    return CompiledLaunch(
        kernel=md.name, module=fn.module if hasattr(fn, "module") else "", arch=arch,
        grid=[int(g) for g in grid] if isinstance(grid, (tuple, list)) else "callable",
        num_warps=md.num_warps, num_stages=md.num_stages, shared_bytes=md.shared, constexprs=cx,
        signature=sig, aligned16=aligned, ptx_ops=dict(facts["census"]), sync_staged=facts["sync_staged"],
        **facts["usage"],
    )  # fmt: skip


@contextlib.contextmanager
def compile_only(
    arch: int = 90, gpu_name: str = "NVIDIA H200", sms: int | None = None
) -> Iterator[CompileSession]:
    """Inside the block every Triton launch compiles for sm_`arch` and does not run; yields the session
    whose `launches` list gets one `CompiledLaunch` per launch (a failed compile is recorded with its
    error, then re-raised to the caller). `gpu_name` is the name kernels look their config tables up
    under; `sms` the SM count they plan with (default: looked up from `gpu_name`, else 132).

    CodesignError when TRITON_INTERPRET is "1" (run it in a fresh process without it), when `arch` is
    not an int in [70, 120], or when a session is already active.
    """
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        raise CodesignError(
            "compile_only: TRITON_INTERPRET=1 is set, so kernels were defined for the interpreter and cannot "
            "be compiled; run compile_only in a fresh process without TRITON_INTERPRET (e.g. a subprocess)"
        )
    if not isinstance(arch, int) or isinstance(arch, bool) or not 70 <= arch <= 120:
        raise CodesignError(
            f"arch: expected a compute capability as an int in [70, 120] (e.g. 90), got {arch!r}"
        )
    if not isinstance(gpu_name, str) or not gpu_name:
        raise CodesignError(f"gpu_name: expected a non-empty GPU name, got {gpu_name!r}")
    if _ACTIVE:
        raise CodesignError("compile_only: a compile-only session is already active (no nesting)")
    if sms is None:
        sms = next((n for k, n in SMS_BY_NAME.items() if k in gpu_name.upper()), 132)
    from triton.runtime import driver as drv  # the DriverConfig instance
    from triton.runtime.jit import JITFunction

    session = CompileSession(arch=arch, gpu_name=gpu_name, sms=sms)
    saved_driver = drv._active  # private: the public reset_active() would build the real driver (fails here)
    orig_run = JITFunction.run

    def run(self: Any, *args: Any, grid: Any, warmup: bool, **kwargs: Any) -> Any:
        try:
            with _ptxas_log() as log:
                kernel = orig_run(self, *args, grid=grid, warmup=True, **kwargs)
        except Exception as e:
            session.launches.append(
                CompiledLaunch(
                    kernel=getattr(self, "_fn_name", str(self)),
                    module=getattr(self, "module", ""),
                    arch=arch,
                    grid=str(grid),
                    error=f"{type(e).__name__}: {e}"[-3000:],
                )  # fmt: skip
            )
            session.compiled.append(None)
            raise
        session.launches.append(_describe(kernel, self, arch, grid, log.getvalue()))
        session.compiled.append(kernel)
        return kernel

    _ACTIVE.append(session)
    try:
        drv.set_active(_TargetDriver(arch))
        JITFunction.run = run
        with use_device_view(lent_gpu_view(arch, gpu_name, sms)):
            yield session
    finally:
        JITFunction.run = orig_run
        drv._active = saved_driver
        _ACTIVE.clear()
