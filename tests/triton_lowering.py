"""Test helper: check that a Triton kernel compiles for a CUDA target without a GPU (ptxas ships with Triton).

The interpreter cannot show that a kernel lowers to PTX/cubin; Triton reads TRITON_INTERPRET when a
kernel is defined, so the compile runs in a fresh process (`helpers.assert_runs_without_interpreter`).
"""

from __future__ import annotations

from helpers import assert_runs_without_interpreter


def assert_lowers_for_gpu(
    kernel: str, arg_types: dict[str, str], variants: list[dict], arch: int = 90, num_warps: int = 4
) -> None:
    """Compile `kernel` ("package.module:function") for sm_`arch` once per constexpr dict in `variants`.

    arg_types: Triton type of each pointer / scalar argument by name ("*fp16", "i64"...); arguments not
    named and not constexpr are "i32". A variant may override arg_types under the key "types".
    """
    module, _, name = kernel.partition(":")
    code = (
        "import triton\n"
        "import triton.language as tl\n"
        "from triton.backends.compiler import GPUTarget\n"
        "from triton.compiler import ASTSource\n"
        f"from {module} import {name} as fn\n"
        f"for c in {variants!r}:\n"
        f"    types = {{**{arg_types!r}, **c.pop('types', {{}})}}\n"
        "    c = {k: getattr(tl, v[3:]) if isinstance(v, str) and v.startswith('tl.') else v for k, v in c.items()}\n"
        "    sig = {n: 'constexpr' if n in c else types.get(n, 'i32') for n in fn.arg_names}\n"
        f"    asm = triton.compile(ASTSource(fn, sig, constexprs=c), target=GPUTarget('cuda', {arch}, 32),\n"
        f"                         options={{'num_warps': {num_warps}}}).asm\n"
        f"    assert '.target sm_{arch}' in asm['ptx'] and len(asm['cubin']) > 0, c\n"
        "print('ok')\n"
    )
    assert_runs_without_interpreter(code)
