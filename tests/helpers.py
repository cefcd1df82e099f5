"""Helpers shared by the tests: fp64 comparisons (relative errors), the Inductor cache policy, an ast import scanner,
launch spies and an op log."""

from __future__ import annotations

import ast
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode


def rel_fro_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref||_F / ||ref||_F in fp64; inf if `out` has any NaN/inf."""
    o = out.detach().to(torch.float64).cpu()
    r = ref.detach().to(torch.float64).cpu()
    if not torch.isfinite(o).all():
        return float("inf")
    den = torch.linalg.vector_norm(r).item()
    num = torch.linalg.vector_norm(o - r).item()
    return num / den if den else num


def assert_rel_close(out: torch.Tensor, ref: torch.Tensor, bound: float, what: str = "output") -> None:
    """Assert shapes match and the relative Frobenius error is under `bound`; report the worst elements."""
    assert out.shape == ref.shape, f"{what}: shape {tuple(out.shape)} != reference {tuple(ref.shape)}"
    err = rel_fro_error(out, ref)
    if err <= bound:
        return
    o = out.detach().to(torch.float64).cpu()
    r = ref.detach().to(torch.float64).cpu()
    bad = ~torch.isfinite(o)
    diff = (o - r).abs().nan_to_num(float("inf"))
    idx = torch.topk(diff.flatten(), k=min(5, diff.numel())).indices
    worst = [
        (tuple(int(i) for i in torch.unravel_index(j, o.shape)), o.flatten()[j].item(), r.flatten()[j].item())
        for j in idx
    ]
    raise AssertionError(
        f"{what}: relative error {err:.3e} > {bound:.1e}; non-finite: {int(bad.sum())}; "
        f"worst (index, got, want): {worst}"
    )


def poison_like(t: torch.Tensor) -> torch.Tensor:
    """A tensor like `t` full of NaN (float, fp8 included) or the dtype's minimum (int), to catch unwritten outputs."""
    if t.dtype.is_floating_point:
        return torch.full_like(t, float("nan"))
    return torch.full_like(t, torch.iinfo(t.dtype).min)


def assert_runs_without_interpreter(code: str) -> None:
    """Run `code` in a fresh Python with TRITON_INTERPRET off and check it prints 'ok' last.

    The interpreter cannot show that a kernel compiles for a GPU; lowering it to PTX/cubin for a
    given target needs no GPU (ptxas ships with Triton), but Triton reads TRITON_INTERPRET when a
    kernel is defined, so it must happen in another process.
    """
    import os
    import subprocess
    import sys

    env = dict(os.environ, TRITON_INTERPRET="0")
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0 and res.stdout.strip().endswith("ok"), res.stderr[-3000:]


def shuffled_block_tables(ctx, block_size: int, spare: int = 2) -> tuple[torch.Tensor, int]:
    """Block tables for sequences of lengths `ctx` over a pool with `spare` unused blocks, the blocks
    handed out in a random order (so no kernel can assume block i follows block i - 1), and one more
    table column than needed (padding a kernel must never read). Returns (int32 tables, pool size)."""
    need = [-(-c // block_size) for c in ctx]
    nb = sum(need) + spare
    perm = torch.randperm(nb)
    bt = torch.zeros(len(ctx), max(need) + 1, dtype=torch.int32)
    pos = 0
    for b, n in enumerate(need):
        bt[b, :n] = perm[pos : pos + n]
        pos += n
    return bt, nb


def seq_slots(block_tables: torch.Tensor, b: int, n: int, block_size: int) -> torch.Tensor:
    """int32 cache slots (block * block_size + offset) of tokens 0..n-1 of sequence b (tables row b)."""
    return torch.tensor(
        [int(block_tables[b, t // block_size]) * block_size + t % block_size for t in range(n)],
        dtype=torch.int32,
    )


def inductor_cache_per_cpu_capability() -> str:
    """Point TORCHINDUCTOR_CACHE_DIR at a folder of its own per ATen CPU capability; returns it.

    torch 2.13's FX graph cache leaves the capability out of its key, but the cached C++ kernels are
    rebuilt for the current one: code vectorized 8 wide under ATEN_CPU_CAPABILITY=avx2 then stores
    16 floats per step under AVX-512 (32 bytes past each buffer: glibc aborts), and 16-wide code
    leaves half of every output unwritten under AVX2 (NaN, 1e35). One folder per capability keeps
    the two apart (docs/known-issues.md).
    """
    import os

    base = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if base is None:
        from torch._inductor.runtime.cache_dir_utils import default_cache_dir

        base = default_cache_dir()
    cap = torch.backends.cpu.get_cpu_capability().lower()
    if os.path.basename(os.path.normpath(base)) != cap:
        base = os.path.join(base, cap)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = base
    return base


def device_view_with(**changes):
    """A context in which every device's `DeviceView` is this CPU's with `changes` (e.g. gpu_name= the name a
    tuned table was written under, bf16_dot=True): what the kernels see, without touching a kernel module."""
    import dataclasses

    from codesign.backend import device_view, use_device_view

    return use_device_view(dataclasses.replace(device_view("cpu"), **changes))


def spy_launches(monkeypatch, targets, record=None) -> list:
    """Stand-ins for the @triton.jit kernels `targets` ((module, name) pairs): each launch still runs, after
    appending record(name, grid, launch kwargs) (default: the kernel's name) to the list returned."""
    seen: list = []
    rec = record or (lambda name, grid, kw: name)
    for module, name in targets:
        real = getattr(module, name)

        class _Spy:
            def __getitem__(self, grid, real=real, name=name):
                def launch(*args, **kw):
                    seen.append(rec(name, grid, kw))
                    return real[grid](*args, **kw)

                return launch

        monkeypatch.setattr(module, name, _Spy())
    return seen


def module_imports(path: Path, package: str) -> set[str]:
    """Absolute names of the modules `path` imports (relative imports resolved against `package`)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parts, base]) if base else ".".join(parts)
            out.add(base)
            out.update(f"{base}.{a.name}" for a in node.names)  # `from pkg import module`
    return out


def load_script(path: Path, name: str):
    """A script that is not a package module (bench/*.py) imported as module `name`."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


class OpLog(TorchDispatchMode):
    """The name of every op dispatched inside the block (`log.ops`), run as it would run without the log."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))
