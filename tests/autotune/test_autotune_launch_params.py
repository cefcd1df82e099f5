"""num_warps of the KV writer and the DF11 decoder / fused GEMV: defaults, tuned tables, and their adapters.

The adapters' own spy and tiny-tune tests are in test_autotune_adapters.py; here: their bit-exact checks
are not vacuous, the untuned defaults are the values the kernels had before, an exported table reaches
the launch, catalogue shapes, and the (changed) KV-write kernel still lowers for a GPU.
"""

from __future__ import annotations

import json

import pytest
import torch
from helpers import device_view_with, spy_launches
from triton_lowering import assert_lowers_for_gpu

from codesign import cli
from codesign.autotune import lookup
from codesign.autotune.cache import TuningCache
from codesign.autotune.ops import get_op
from codesign.autotune.tune_cli import shapes_from_model
from codesign.autotune.tuner import CPU_GPU_NAME, checked_output, rel_error
from codesign.backend import use_backend
from codesign.kernels.df11 import triton_decode as dt
from codesign.kernels.kvcache import formats as kf
from codesign.kernels.kvcache import triton_write as kvt
from codesign.kernels.kvcache.kvq import kvq_write

KVW = {"M": 6, "kv_heads": 3, "head_dim": 24}


@pytest.mark.parametrize("name", ["kv_write", "kv_write_int4", "kv_write_fp8"])
def test_a_wrong_kv_write_fails_the_bit_exact_check(name):
    op = get_op(name)
    inputs = op.make_inputs(KVW, torch.float32, "cpu", 5)
    ref = op.reference(inputs)
    op.poison(inputs)
    assert rel_error(checked_output(op, inputs, inputs["cache"]), ref) > 0.0, "poison must not pass"
    out = op.run(inputs, {"num_warps": 2})
    assert rel_error(checked_output(op, inputs, out), ref) == 0.0
    k = out[0] if name == "kv_write" else out.k_codes
    slot = int(inputs["live"][-1])
    k.view(-1, *k.shape[2:])[slot].view(-1)[3] += 1  # one element / code byte of one written slot
    assert rel_error(checked_output(op, inputs, out), ref) > 0.0


def test_a_padding_token_is_not_written():
    op = get_op("kv_write_int8")
    inputs = op.make_inputs(KVW, torch.float32, "cpu", 1)
    assert int((inputs["slots"] < 0).sum()) == 1 and inputs["live"].numel() == KVW["M"] - 1
    cache = op.run(inputs, {})
    untouched = torch.ones(cache.k_codes.shape[0] * cache.k_codes.shape[1], dtype=torch.bool)
    untouched[inputs["live"]] = False
    assert not cache.k_codes.view(-1, *cache.k_codes.shape[2:])[untouched].any()  # still the zeroed cache


def test_a_wrong_df11_decode_fails_the_bit_exact_check():
    op = get_op("df11_decode")
    shape = {"N": 5, "K": 7, "chunk_bytes": 4, "chunks_per_group": 32}
    inputs = op.make_inputs(shape, torch.float32, "cpu", 0)
    ref = op.reference(inputs)
    op.poison(inputs)
    assert (inputs["out"] != inputs["bits"]).all(), "the poison must differ from every expected pattern"
    out = op.run(inputs, {"num_warps": 1})
    assert rel_error(out, ref) == 0.0
    out[4] ^= 1  # one mantissa bit
    assert rel_error(out, ref) > 0.0


def test_untuned_defaults_are_the_previous_constants():
    cpu = torch.device("cpu")
    # KV writer: 4 warps for rows of >= 2048 elements (e.g. 16 heads x 128), else 1.
    assert kvt.launch_config(kf.KV_FORMAT_PLAIN, 16, 7, 16, 128, cpu) == {"num_warps": 4}
    assert kvt.launch_config(kf.KV_FORMAT_INT, 4, 7, 8, 128, cpu) == {"num_warps": 1}
    names = [kvt.table_op(kf.KV_FORMAT_PLAIN, 16), kvt.table_op(kf.KV_FORMAT_INT, 2),
             kvt.table_op(kf.KV_FORMAT_FP8, 8)]  # fmt: skip
    assert names == ["kv_write", "kv_write_int2", "kv_write_fp8"]
    s = dt.DF11Stream(*([torch.empty(0)] * 5), 0, 0, 32, 128, 2)
    assert (
        dt.launch_config(dt.DECODE_OP, s, 4096, cpu)
        == {"num_warps": 4}
        == dt.launch_config(dt.GEMV_OP, s, 4096, cpu)
    )


def test_an_exported_kv_write_table_sets_the_launch(tmp_path, monkeypatch):
    """A tiny CPU tune of kv_write_int4 at M = 6, exported, then read at launch: the kernel gets the
    table's num_warps once the device is taken for the table's GPU (tables are per GPU)."""
    cache, out = tmp_path / "c.jsonl", tmp_path / "tables"
    argv = ["tune", "--op", "kv_write_int4", "--shape", "M=6,kv_heads=3,head_dim=24", "--device", "cpu",
            "--cache", str(cache), "--strategy", "exhaustive", "--export", "--out-dir", str(out)]  # fmt: skip
    assert cli.main(argv) == 0
    table = json.loads((out / lookup.gpu_slug(CPU_GPU_NAME) / "kv_write_int4.json").read_text())
    best = table["entries"]["head_dim=24,kv_heads=3"]["6"]
    recs = TuningCache(cache).load().records
    assert len(recs) == 2 and best == min(recs, key=lambda r: r["time_ms"])["config"]

    seen = spy_launches(monkeypatch, ((kvt, "_kv_write_kernel"),), lambda name, grid, kw: kw["num_warps"])
    monkeypatch.setenv("CODESIGN_CONFIG_DIR", str(out))
    lookup.reload_tables()
    op = get_op("kv_write_int4")
    for m in (6, 2):  # M = 2: the nearest tuned M, 6
        inputs = op.make_inputs({**KVW, "M": m}, torch.float32, "cpu", 9)
        # the public writer, no forced config: the table (of the device named as the table's GPU) decides
        with use_backend("triton", op="kv_write"), device_view_with(gpu_name=CPU_GPU_NAME):
            kvq_write(inputs["key"], inputs["value"], inputs["cache"], inputs["slots"])
        assert seen.pop() == best["num_warps"]
        assert rel_error(checked_output(op, inputs, inputs["cache"]), inputs["ref"]) == 0.0
    with use_backend("triton", op="kv_write"):  # a CPU device reads no table
        kvq_write(inputs["key"], inputs["value"], inputs["cache"], inputs["slots"])
    assert seen.pop() == 1  # the default for a 3 x 24 row
    lookup.reload_tables()


def test_df11_launch_config_reads_the_table(tmp_path, monkeypatch):
    gpu = "NVIDIA Test GPU"
    root = tmp_path / "tables"
    head = lookup.table_header(dt.DECODE_OP, gpu, ["codesign.kernels.df11.triton_decode"])
    entries = {"chunk_bytes=32,chunks_per_group=128": {"1000": {"num_warps": 2}, "100000": {"num_warps": 1}}}
    (root / lookup.gpu_slug(gpu)).mkdir(parents=True)
    (root / lookup.gpu_slug(gpu) / "df11_decode.json").write_text(json.dumps({**head, "entries": entries}))
    monkeypatch.setenv("CODESIGN_CONFIG_DIR", str(root))
    lookup.reload_tables()
    s = dt.DF11Stream(*([torch.empty(0)] * 5), 0, 0, 32, 128, 2)
    cpu = torch.device("cpu")
    with device_view_with(gpu_name=gpu):
        assert dt.launch_config(dt.DECODE_OP, s, 900, cpu)["num_warps"] == 2
        assert dt.launch_config(dt.DECODE_OP, s, 90_000, cpu)["num_warps"] == 1
        with pytest.warns(UserWarning, match="no tuned config for df11_gemv"):
            assert dt.launch_config(dt.GEMV_OP, s, 900, cpu)["num_warps"] == dt.DEFAULT_NUM_WARPS
        other = s._replace(chunk_bytes=8)  # another geometry: not in the table, the default
        with pytest.warns(UserWarning, match="no tuned config for df11_decode"):
            assert dt.launch_config(dt.DECODE_OP, other, 900, cpu)["num_warps"] == dt.DEFAULT_NUM_WARPS
    lookup.reload_tables()


def test_shapes_from_a_catalogue_model():
    # Llama-3-8B: 8 KV heads of 128; linear layers (N, K) as in test_autotune_tuner.
    kv = shapes_from_model("kv_write_fp8", "llama-3-8b", [1, 64], 128, 2048, 16)
    assert kv == [{"M": 1, "kv_heads": 8, "head_dim": 128}, {"M": 64, "kv_heads": 8, "head_dim": 128}]
    df = shapes_from_model("df11_decode", "llama-3-8b", [1], 128, 2048, 16)
    assert {(s["N"], s["K"]) for s in df} == {(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)}
    for name, shapes in (("kv_write_fp8", kv), ("kv_write", kv), ("df11_decode", df), ("df11_gemv", df)):
        op = get_op(name)
        for s in shapes:
            op.check_shape(s)
    assert get_op("df11_gemv").m(df[0]) == df[0]["N"] * df[0]["K"]


@pytest.mark.slow
def test_kv_write_kernel_lowers_for_sm90_in_every_format():
    types = {"key_ptr": "*fp16", "value_ptr": "*fp16", "slot_ptr": "*i64", "k_cache_ptr": "*u8",
             "v_cache_ptr": "*u8", "k_meta_ptr": "*fp16", "v_meta_ptr": "*fp16"}  # fmt: skip
    common = dict(NUM_HEADS=6, HEAD_DIM=96, HEADS_PAD=8, DIM_PAD=128, BLOCK_SIZE=16)
    variants = [
        {**common, "KV_FORMAT": 0, "BITS": 16, "types": {"k_cache_ptr": "*fp16", "v_cache_ptr": "*fp16"}},
        {**common, "KV_FORMAT": 1, "BITS": 4},
        {**common, "KV_FORMAT": 1, "BITS": 2},
        {**common, "KV_FORMAT": 2, "BITS": 8, "types": {"k_meta_ptr": "*fp32", "v_meta_ptr": "*fp32"}},
    ]
    assert_lowers_for_gpu("codesign.kernels.kvcache.triton_write:_kv_write_kernel", types, variants)
