"""Every shipped tunable adapter: a candidate config runs correctly, and a tiny tune runs end to end.

The adapters take their table names and shape keys from the kernels' own functions (defined next to each
launcher), so the table a tune writes is the one the kernel reads by construction.
"""

from __future__ import annotations

import importlib
import math

import pytest
import torch

from codesign.autotune.cache import TuningCache
from codesign.autotune.ops import get_op, registered_ops
from codesign.autotune.space import DeviceLimits
from codesign.autotune.tuner import Tuner, checked_output, rel_error
from codesign.backend import use_backend

# One tiny shape per shipped op (odd sizes; interpreter-cheap).
ATT = {"M": 2, "q_heads": 4, "kv_heads": 2, "head_dim": 32, "block_size": 16, "ctx": 40}
KVW = {"M": 5, "kv_heads": 3, "head_dim": 24}  # 5 tokens (one is padding), heads and dim padded in the kernel
TINY = {
    "w4a16_gemm": {"M": 3, "N": 96, "K": 256, "G": 128},
    "w8a16_gemm": {"M": 19, "N": 80, "K": 128, "G": 0},  # the tiled variant
    "w8a8_gemm": {"M": 5, "N": 80, "K": 128},
    "fp8_gemm": {"M": 5, "N": 80, "K": 128},
    "quantize_per_token": {"M": 3, "K": 300},
    "df11_gemm": {"M": 3, "N": 21, "K": 40, "seg": 16},  # 3 segments: K split in 2 or 3 ranges
    # 4-byte chunks keep the interpreter's per-code loop short; 64 lanes allow 1 or 2 warps.
    "df11_decode": {"N": 9, "K": 13, "chunk_bytes": 4, "chunks_per_group": 64},
    "df11_gemv": {"N": 9, "K": 13, "chunk_bytes": 4, "chunks_per_group": 64},
    # 8 lanes: 10 full steps of K and a masked one (4 columns); a row whole or split in two per program.
    "df11_rows_decode": {"N": 24, "K": 84, "lanes": 8},
    "df11_rows_gemv": {"M": 2, "N": 24, "K": 84, "lanes": 8},
    "kv_write": KVW,
    "kv_write_int8": KVW,
    "kv_write_int4": KVW,
    "kv_write_int2": KVW,
    "kv_write_fp8": KVW,
    "paged_attention": ATT,
    "paged_attention_int8": ATT,
    "paged_attention_int4": ATT,
    "paged_attention_int2": ATT,
    "paged_attention_fp8": ATT,
    "paged_attention_mixed": ATT,
    "paged_attention_oaken": ATT,
    "paged_attention_kivi": {**ATT, "residual": 8},  # group 16: 32 tokens quantized, 8 in the ring
}


def test_every_shipped_op_has_a_tiny_shape():
    shipped = {n for n in registered_ops() if not n.startswith("test_")}
    assert shipped == set(TINY)


@pytest.mark.parametrize("name", sorted(TINY))
def test_a_candidate_config_runs_correctly(name):
    op = get_op(name)
    shape = TINY[name]
    op.check_shape(shape)
    cand = op.space(shape, torch.float32, False).candidates(DeviceLimits(name="cpu-interpreter"))[-1]
    inputs = op.make_inputs(shape, torch.float32, "cpu", 1)
    ref = op.reference(inputs)
    if hasattr(op, "poison"):
        op.poison(inputs)
    with use_backend("triton"):
        out = op.run(inputs, cand)
    err = rel_error(checked_output(op, inputs, out), ref)
    assert err <= op.tolerance(torch.float32), f"{name}: relative error {err:.3e}"


@pytest.mark.parametrize(
    "name",
    [
        "quantize_per_token",
        "paged_attention_int4",
        "paged_attention_mixed",
        "paged_attention_kivi",
        "df11_gemm",
        "df11_decode",
        "df11_gemv",
        "kv_write",
        "kv_write_int4",
        "kv_write_fp8",
    ],
)
def test_tiny_tune_through_the_interpreter(name, tmp_path):
    op = get_op(name)
    cache = TuningCache(tmp_path / "c.jsonl")
    tuner = Tuner(op, cache, dtype=torch.float32, device="cpu", strategy="exhaustive", log=lambda s: None)
    res = tuner.tune_shape(TINY[name])
    assert res.table_op == name and res.n_failed == 0 and res.n_new == res.n_candidates >= 2
    recs = cache.load().records
    assert all(r["ok"] and r["rel_error"] <= op.tolerance(torch.float32) for r in recs)
    assert res.best_ms == min(r["time_ms"] for r in recs) and math.isfinite(res.best_ms)


def test_a_wrong_quantizer_output_fails_the_check():
    # The bit-exact check is not vacuous: one flipped code or a NaN scale fails it.
    op = get_op("quantize_per_token")
    inputs = op.make_inputs(TINY["quantize_per_token"], torch.float32, "cpu", 3)
    ref = op.reference(inputs)
    out = op.run(inputs, {})
    assert rel_error(checked_output(op, inputs, out), ref) == 0.0
    out[1, 7] += 1
    assert rel_error(checked_output(op, inputs, out), ref) > 0.0
    out[1, 7] -= 1
    inputs["s"][2] = float("nan")
    assert rel_error(checked_output(op, inputs, out), ref) == math.inf


def test_int8_kv_decode_tunes_the_word_read_on_gpus_only():
    shape = dict(M=4, q_heads=8, kv_heads=2, head_dim=64, block_size=16, ctx=512)
    int8, int4 = get_op("paged_attention_int8"), get_op("paged_attention_int4")
    assert int8.space(shape, torch.float16, True).params["WORDS8"] == [0, 1]
    assert "WORDS8" not in int8.space(shape, torch.float16, False).params  # the interpreter: no timing
    assert "WORDS8" not in int4.space(shape, torch.float16, True).params  # sub-byte codes are words already


def test_int_kv_decode_tune_code_planes_and_one_warp():
    """Where the kernel can dot code planes (16-bit queries, INT4 / INT2 at head_dim >= 128, INT8 at >= 64) the GPU
    space holds PLANES 0 / 1 and one warp; never planes over bytes (WORDS8 0); not at head_dim 64 for INT4 / INT2,
    not on CPU; KIVI by its shape's bits."""
    int8, int4, int2 = (get_op(f"paged_attention_{f}") for f in ("int8", "int4", "int2"))
    shape = dict(M=4, q_heads=8, kv_heads=2, head_dim=128, block_size=16, ctx=512)
    for op in (int8, int4, int2):
        sp = op.space(shape, torch.bfloat16, True)
        assert sp.params["PLANES"] == [0, 1] and sp.params["num_warps"][0] == 1
        assert "PLANES" not in op.space(shape, torch.bfloat16, False).params
        assert "PLANES" not in op.space(shape, torch.float32, True).params
    sp = int8.space(shape, torch.float16, True)
    base = {"BLOCK_N": 32, "num_warps": 1, "num_stages": 2, "BLOCK_M": 64}
    assert sp.valid({**base, "WORDS8": 1, "PLANES": 1}) and not sp.valid({**base, "WORDS8": 0, "PLANES": 1})
    assert not int4.space(shape, torch.float16, True).valid({**base, "num_warps": 4, "PLANES": 1})  # joined there
    assert "PLANES" not in int4.space({**shape, "head_dim": 64}, torch.float16, True).params
    assert "PLANES" not in int2.space({**shape, "head_dim": 64}, torch.float16, True).params
    kivi2 = get_op("paged_attention_kivi").space({**shape, "bits": 2}, torch.float16, True)  # half-words
    assert kivi2.params["VPLANES"] == [0, 1] and kivi2.valid({**base, "PLANES": 1, "VPLANES": 1})
    kivi = get_op("paged_attention_kivi").space(shape, torch.float16, True)  # its key tiles: [16, BLOCK_N] outputs
    assert kivi.params["PLANES"] == [0, 1]
    assert kivi.valid({**base, "PLANES": 1, "VPLANES": 0}) and not kivi.valid(
        {**base, "num_warps": 4, "BLOCK_N": 16, "PLANES": 1, "VPLANES": 0})  # fmt: skip
    # value planes: on one warp, with key planes; not on 4 warps (a value plane's 16 columns) nor without PLANES
    assert kivi.params["VPLANES"] == [0, 1] and kivi.valid({**base, "PLANES": 1, "VPLANES": 1})
    assert not kivi.valid({**base, "num_warps": 4, "PLANES": 1, "VPLANES": 1})
    assert not kivi.valid({**base, "PLANES": 0, "VPLANES": 1})


@pytest.mark.parametrize("fmt, key, module",
                         [("mixed", "BY_WIDTH", "mixed_by_width"), ("oaken", "SPLIT", "oaken_split")])  # fmt: skip
def test_kv_decode_tunes_its_decode_paths(fmt, key, module):
    """The mixed and Oaken caches' GPU spaces hold their decode path's key 0 / 1 (width by width, `BY_WIDTH`; three
    launches, `SPLIT`), the path only on the default tile (it ignores the tile, so other tiles would time the same
    launches again); not on CPU. Their tables follow the path's module."""
    from codesign.autotune.lookup import kernel_modules

    op = get_op(f"paged_attention_{fmt}")
    shape = dict(M=4, q_heads=8, kv_heads=2, head_dim=128, block_size=32, ctx=512)
    sp = op.space(shape, torch.float16, True)
    assert sp.params[key] == [0, 1]
    assert key not in op.space(shape, torch.float16, False).params
    lr = importlib.import_module("codesign.kernels.attention.launch_rules")
    kf, bits = (lr.KV_FORMAT_MIXED, 8) if fmt == "mixed" else (lr.KV_FORMAT_OAKEN, 4)
    base = {k: lr.default_config(128, 2, kf, bits, 32)[k] for k in ("BLOCK_N", "num_warps", "num_stages")}
    cfg = {**base, "BLOCK_M": 64}
    other = {**cfg, "BLOCK_N": 16 if base["BLOCK_N"] != 16 else 32}
    assert sp.valid({**cfg, key: 1}) and sp.valid({**other, key: 0})
    assert not sp.valid({**other, key: 1})
    assert f"codesign.kernels.attention.{module}" in kernel_modules(op.source_modules)
