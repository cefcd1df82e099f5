"""The module names `codesign.kernels` had before its four families (gemm, df11, kvcache, attention).

`import codesign.kernels.paged_attention` (or any name in `MOVED`) still works: a `sys.meta_path` finder
answers it with a module whose attributes are the objects themselves, looked up in the new modules, and
warns once (DeprecationWarning) with the new place. A name that no longer exists raises an AttributeError
saying why (`REMOVED`). Installed by `codesign.kernels` on import.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import types
import warnings
from typing import Any

_K = "codesign.kernels."

# old module (under codesign.kernels) -> the modules its public names live in now, searched in order.
MOVED: dict[str, tuple[str, ...]] = {
    "quant_formats": ("gemm.formats",),
    "quant_gemm": ("gemm.ops",),
    "quant_gemm_triton": ("gemm.triton_gemm",),
    "quant_gemm_cupy": ("gemm.cupy_gemm",),
    "quant_linear": ("gemm.linear",),
    "quant_import": ("gemm.checkpoints",),
    "df11_codec": ("df11.codec",),
    "df11_triton": ("df11.triton_decode",),
    "df11_gemm": ("df11.triton_gemm",),
    "df11_linear": ("df11.linear",),
    "paged_kv_cache": ("kvcache.blocks", "kvcache.checks"),
    "kv_quant": ("kvcache.quantizers",),
    "kv_write": ("kvcache.write", "kvcache.checks"),
    "kv_write_triton": ("kvcache.triton_write", "kvcache.formats"),
    "kv_write_oaken_triton": ("kvcache.triton_oaken_write",),
    "kv_quant_kivi_triton": ("kvcache.triton_kivi_flush",),
    "kv_quant_paged": ("kvcache.kvq", "kvcache.checks", "attention.quantized"),
    "kv_quant_kivi": ("kvcache.kivi", "attention.quantized"),
    "kv_quant_oaken": ("kvcache.oaken", "attention.quantized"),
    "kv_quant_mixed": ("kvcache.mixed", "attention.quantized"),
    "kv_quant_dispatch": ("attention.quantized",),
    "kvq_accuracy": ("kvcache.accuracy",),
    "kvq_accuracy_cli": ("kvcache.accuracy_cli",),
    "paged_attention": (
        "attention.paged",
        "attention.options",
        "attention.reference",
        "attention.ops",
        "attention.wrappers",
        "kvcache.checks",
    ),
    "paged_attention_triton": ("attention.triton_attention", "attention.launch_rules", "kvcache.formats"),
    "tree_attention": ("attention.tree", "attention.paged", "attention.wrappers", "parents"),
}

# old module.name -> why it is gone (the AttributeError says so).
_VIEW = "ask codesign.backend.device_view(device)"
REMOVED: dict[str, str] = {
    "paged_attention.on_gpu": f"{_VIEW}.compiled",
    "paged_attention_triton.num_sms": f"{_VIEW}.sms",
    "paged_attention_triton.hw_fp8": f"{_VIEW}.hw_fp8",
    "paged_attention_triton.OAKEN_SC": "Oaken's outliers are gathered through kvcache.oaken.outlier_index, not "
    "scattered in chunks",
    "paged_attention.AttnMeta": "the launch metadata is attention.options.AttentionBatch and AttentionOptions",
    "paged_attention.NO_TREE": "pass tree=None (a TreeBatch otherwise) to attention.paged.attend",
    "paged_attention.ATTENTION_OPTIONS": "the fields of attention.options.AttentionOptions",
    "paged_attention.prepare_launch": "use attention.options.prepare",
    "paged_attention.check_attention_inputs": "attention.options.prepare runs every check",
    "paged_attention.attend_plain": "use attention.paged.attend(attention.ops.PLAIN, ...)",
    "paged_attention.triton_attention": "use attention.ops.run_attention",
    "paged_attention.auto_num_splits": "the split count is planned by attention.triton_attention.plan_launch",
    "kv_quant_paged.prepare_attention": "use attention.options.prepare (attention.paged.attend)",
    "kv_quant_paged.attend_quant": "use attention.paged.attend(attention.quantized.KVQ, ...)",
    "kv_quant_paged.launch_kvq": "use attention.quantized.KVQ.op",
    "kv_quant_kivi.launch_kivi": "use attention.quantized.KIVI.op",
    "kv_quant_oaken.launch_oaken": "use attention.quantized.OAKEN.op",
    "kv_quant_mixed.launch_mixed": "use attention.quantized.MIXED.op",
    **{
        f"kv_quant_dispatch.{n}": "each cache type is an attention.quantized format (format_of(cache))"
        for n in ("QuantCacheInfo", "is_quant_cache", "signature", "describe", "check_plan", "launch")
    },
}


def new_modules(old: str) -> tuple[str, ...]:
    """The full names of the modules that hold `codesign.kernels.<old>`'s names now."""
    return tuple(_K + m for m in MOVED[old])


def _proxy(old: str) -> types.ModuleType:
    homes = new_modules(old)
    mods = [importlib.import_module(m) for m in homes]
    proxy = types.ModuleType(_K + old, f"Moved: {_K}{old} now lives in {', '.join(homes)}.")

    def __getattr__(name: str) -> Any:
        for m in mods:
            if hasattr(m, name):
                return getattr(m, name)
        why = REMOVED.get(f"{old}.{name}")
        if why is not None:
            raise AttributeError(f"{_K}{old}.{name} was removed when codesign.kernels was restructured: {why}")
        raise AttributeError(f"module {_K}{old} (moved to {', '.join(homes)}) has no attribute {name!r}")

    def __dir__() -> list[str]:
        return sorted({n for m in mods for n in dir(m) if not n.startswith("__")})

    proxy.__getattr__ = __getattr__  # type: ignore[method-assign]
    proxy.__dir__ = __dir__  # type: ignore[method-assign]
    return proxy


class _MovedFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds the old module names and loads each as a proxy of its new modules."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if not fullname.startswith(_K) or fullname[len(_K) :] not in MOVED:
            return None
        return importlib.machinery.ModuleSpec(fullname, self)

    def create_module(self, spec: Any) -> types.ModuleType:
        old = spec.name[len(_K) :]
        warnings.warn(
            f"{spec.name} has moved: import from {', '.join(new_modules(old))} (or codesign.kernels)",
            DeprecationWarning,
            stacklevel=2,
        )
        return _proxy(old)

    def exec_module(self, module: types.ModuleType) -> None:
        return None


def install() -> None:
    """Put the finder on `sys.meta_path` (once)."""
    if not any(isinstance(f, _MovedFinder) for f in sys.meta_path):
        sys.meta_path.append(_MovedFinder())
