"""Tunable adapters for the paged KV-cache writer (`kvcache.triton_write`): plain and quantize-on-write caches.

Shape: M (new tokens in the step), kv_heads, head_dim. The kernel runs one program per token; its one
launch parameter is num_warps (table ops "kv_write", "kv_write_int8/4/2", "kv_write_fp8" as
`kvcache.triton_write.table_op` names them, key `table_key` (kv_heads, head_dim), M bucketed). Each op runs the public
writer (`kvcache.write.kv_write`, or `kvcache.kvq.kvq_write` for the quantized formats) on the Triton
backend. Correctness is bit-exact (tolerance 0): the cache rows of the written slots must equal the
inputs (plain) or the codes and scales the torch backend writes (quantized; the writer is bit-identical
to `kvcache.quantizers` by contract). One token in the step is padding (slot -1), as in a real batch.
"""

from __future__ import annotations

from typing import Any

import torch

from codesign.autotune.adapters.common import need_dims, seeded
from codesign.autotune.lookup import forced_config
from codesign.autotune.ops import Shape, register
from codesign.autotune.space import ConfigSpace, Resources
from codesign.kernels.kvcache.formats import KVQ_FORMATS
from codesign.specs.errors import CodesignError

BLOCK_SIZE = 16  # the cache's block size (vLLM's default); the writer's cost does not depend on it
FORMATS = (None, *KVQ_FORMATS)  # None: a plain (fp16/bf16/fp32) cache; the rest `QuantPagedKV.fmt`


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


class KVWrite:
    """kv_write[_<fmt>]: cache[slot // bs, slot % bs] = key[t] (quantized: its codes and scales), per token."""

    default_trial = True  # run(inputs, {}) is the untuned default (forced_config merges over it)

    source_modules = ("codesign.kernels.kvcache.triton_write",)

    def __init__(self, fmt: str | None) -> None:
        from codesign.kernels.kvcache import triton_write  # unavailable kernel -> ImportError
        from codesign.kernels.kvcache.formats import KV_FORMAT_PLAIN, PLAIN_BITS
        from codesign.kernels.kvcache.kvq import FORMATS

        self.kernel = triton_write
        self.fmt = fmt
        self.name = triton_write.table_op(*(FORMATS[fmt] if fmt else (KV_FORMAT_PLAIN, PLAIN_BITS)))

    def check_shape(self, shape: Shape) -> None:
        need_dims(shape, ("M", "kv_heads", "head_dim"), self.name)
        per = 8 // int(self.fmt[3:]) if self.fmt and self.fmt.startswith("int") else 1
        if shape["head_dim"] % per:
            raise CodesignError(f"shape for {self.name}: head_dim must be a multiple of {per}, got {shape}")

    def table_op(self, shape: Shape) -> str:
        return self.name

    def table_key(self, shape: Shape) -> str:
        return self.kernel.table_key(shape["kv_heads"], shape["head_dim"])

    def m(self, shape: Shape) -> int:
        return shape["M"]

    def space(self, shape: Shape, dtype: torch.dtype, on_gpu: bool) -> ConfigSpace:
        params = {"num_warps": [1, 2, 4, 8, 16] if on_gpu else [1, 2]}
        elems = _pow2(shape["kv_heads"]) * _pow2(shape["head_dim"])
        # More threads than row elements only idle (one program holds one token's [heads, head_dim] row);
        # registers: the K and V rows in fp32 (plus quantizer temporaries) spread over the threads.
        return ConfigSpace(
            params=params,
            valid=lambda c: 32 * c["num_warps"] <= max(32, elems),
            resources=lambda c: Resources(0, 4 * elems // (32 * c["num_warps"]) + 32),
        )

    def make_inputs(self, shape: Shape, dtype: torch.dtype, device: Any, seed: int) -> dict[str, Any]:
        from codesign.backend import use_backend

        gen = seeded(seed)
        t, h, d = shape["M"], shape["kv_heads"], shape["head_dim"]
        nb = -(-t // BLOCK_SIZE) + 2  # spare blocks: the written slots are scattered, not packed
        slots = torch.randperm(nb * BLOCK_SIZE, generator=gen)[:t]
        if t > 1:
            slots[t // 2] = -1  # a padding token: skipped
        key = torch.randn(t, h, d, generator=gen).to(dtype)
        value = torch.randn(t, h, d, generator=gen).to(dtype)
        live = slots[slots >= 0]
        if self.fmt is None:
            cache = tuple(torch.empty(nb, BLOCK_SIZE, h, d, dtype=dtype, device=device) for _ in range(2))
            ref = torch.cat([key[slots >= 0].double().reshape(-1), value[slots >= 0].double().reshape(-1)])
        else:
            from codesign.kernels.kvcache.kvq import kvq_write

            cache = self._empty_quant(nb, h, d, key, value, "cpu")
            with use_backend("torch", op="kv_write"):  # the reference writer
                kvq_write(key, value, cache, slots, check_data=True)
            ref = self._rows(cache, live)
            cache = self._empty_quant(nb, h, d, key, value, device)
        return {"key": key.to(device), "value": value.to(device), "slots": slots.to(device), "cache": cache,
                "live": live.to(device), "ref": ref}  # fmt: skip

    def _empty_quant(
        self, nb: int, h: int, d: int, key: torch.Tensor, value: torch.Tensor, device: Any
    ) -> Any:
        from codesign.kernels.kvcache import quantizers as kvq
        from codesign.kernels.kvcache.kvq import QuantPagedKV

        scales = (kvq.fp8_head_scales(key), kvq.fp8_head_scales(value)) if self.fmt == "fp8" else (None, None)
        return QuantPagedKV.empty(nb, BLOCK_SIZE, h, d, self.fmt, device, *scales)

    def _rows(self, cache: Any, live: torch.Tensor) -> torch.Tensor:
        """The written slots' codes (and per-token scale/zero for the int formats) as one fp64 vector."""
        parts = [cache.k_codes, cache.v_codes] + ([] if self.fmt == "fp8" else [cache.k_meta, cache.v_meta])
        return torch.cat([p.view(-1, *p.shape[2:])[live].double().reshape(-1).cpu() for p in parts])

    def input_bytes(self, inputs: dict[str, Any]) -> int:
        return 2 * inputs["key"].numel() * inputs["key"].element_size()

    def poison(self, inputs: dict[str, Any]) -> None:
        c, live = inputs["cache"], inputs["live"]
        if self.fmt is None:
            for t in c:
                t.fill_(float("nan"))
            return
        # Codes: the complement of the expected byte, so every byte left unwritten shows; scales: NaN.
        n = live.numel() * c.k_codes[0, 0].numel()
        for i, t in enumerate((c.k_codes, c.v_codes)):
            want = inputs["ref"][i * n : (i + 1) * n].to(torch.uint8).reshape(-1, *t.shape[2:])
            t.view(-1, *t.shape[2:])[live] = 255 - want.to(t.device)
        if self.fmt != "fp8":
            c.k_meta.fill_(float("nan"))
            c.v_meta.fill_(float("nan"))

    def run(self, inputs: dict[str, Any], config: dict[str, int]) -> Any:
        from codesign.backend import use_backend

        i = inputs
        with use_backend("triton", op="kv_write"), forced_config(self.table_op({}), config):
            if self.fmt is None:
                from codesign.kernels.kvcache.write import kv_write

                kv_write(i["key"], i["value"], *i["cache"], i["slots"], check_data=False)
            else:
                from codesign.kernels.kvcache.kvq import kvq_write

                kvq_write(i["key"], i["value"], i["cache"], i["slots"], check_data=False)
        return i["cache"]

    def checked_output(self, inputs: dict[str, Any], out: Any) -> torch.Tensor:
        if self.fmt is None:
            live = inputs["live"]
            return torch.cat([t.view(-1, *t.shape[2:])[live].double().reshape(-1).cpu() for t in out])
        return self._rows(out, inputs["live"])

    def reference(self, inputs: dict[str, Any]) -> torch.Tensor:
        return inputs["ref"]

    def tolerance(self, dtype: torch.dtype) -> float:
        return 0.0  # a copy, or integer codes and fp16 scales computed by the same rule: bit-exact


for _fmt in FORMATS:
    register("kv_write" if _fmt is None else f"kv_write_{_fmt}", lambda f=_fmt: KVWrite(f))
