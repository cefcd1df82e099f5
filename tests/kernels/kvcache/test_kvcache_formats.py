"""The one KV-format vocabulary (`kvcache.formats`): every cache type reports its spec `KVFormat`, and the
kernel codes, tuned-table names and format lists derive from it."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from codesign.kernels.attention import launch_rules as lr
from codesign.kernels.kvcache import formats as kf
from codesign.kernels.kvcache import quantizers as kq
from codesign.kernels.kvcache import triton_write as tw
from codesign.kernels.kvcache.kivi import KiviPagedKV
from codesign.kernels.kvcache.kvq import FORMATS, QuantPagedKV
from codesign.kernels.kvcache.mixed import MixedPagedKV
from codesign.kernels.kvcache.oaken import OakenPagedKV
from codesign.specs import CodesignError, KVFormat


def _caches():
    thr = torch.tensor([[[-1.0, 1.0]]] * 2)
    grid = kq.calibrate_oaken_grid([(torch.randn(8, 1, 16), torch.randn(8, 1, 16))])[0]
    hs = torch.ones(1)
    yield from ((QuantPagedKV.empty(2, 4, 1, 16, f, k_head_scale=hs, v_head_scale=hs), (c, b))
                for f, (c, b) in FORMATS.items())  # fmt: skip
    yield KiviPagedKV.empty(2, 4, 1, 16, 2, 2, 2, 1), (kf.KV_FORMAT_KIVI, 2)
    yield OakenPagedKV.empty(2, 4, 1, 16, 4, thr, 2), (kf.KV_FORMAT_OAKEN, 4)
    yield OakenPagedKV.empty(2, 4, 1, 16, 4, thr, 2, grid=grid), (kf.KV_FORMAT_OAKEN_OFFLINE, 4)
    yield MixedPagedKV.empty(2, 4, 1, 16), (kf.KV_FORMAT_MIXED, 8)


def test_every_cache_type_maps_to_its_kernel_code():
    seen = set()
    for cache, want in _caches():
        assert kf.kernel_format(cache.kv_format) == want, type(cache).__name__
        seen.add(want[0])
    assert seen == {kf.KV_FORMAT_INT, kf.KV_FORMAT_FP8, kf.KV_FORMAT_KIVI, kf.KV_FORMAT_MIXED,
                    kf.KV_FORMAT_OAKEN, kf.KV_FORMAT_OAKEN_OFFLINE}  # fmt: skip
    assert kf.kernel_format(KVFormat("bf16")) == (kf.KV_FORMAT_PLAIN, kf.PLAIN_BITS)


def test_table_names_derive_from_the_format():
    assert lr.table_op() == "paged_attention" and tw.table_op(kf.KV_FORMAT_PLAIN, 16) == "kv_write"
    for suffix in kf.ATTENTION_TABLE_FORMATS:
        name = {"kivi": "int4-kivi", "oaken": "int4-oaken"}.get(suffix, suffix)
        assert lr.table_op(*kf.kernel_format(KVFormat.parse(name))) == f"paged_attention_{suffix}"
    assert lr.table_op(*kf.kernel_format(KVFormat.parse("int2-oaken_offline"))) == "paged_attention_oaken"
    for name in kf.WRITE_TABLE_FORMATS:
        assert tw.table_op(*FORMATS[name]) == f"kv_write_{name}"
    assert kf.ATTENTION_TABLE_FORMATS == ("int8", "int4", "int2", "fp8", "mixed", "kivi", "oaken")


def test_mixed_precision_is_a_spec_format():
    f = KVFormat.parse("mixed")
    assert f == KVFormat.parse("int8-mixed") == KVFormat("int8", "mixed") and f.name == "int8-mixed"
    # Rows sized for INT8: counted as INT8 per token (codes + an fp16 scale and zero per token and head).
    assert f.bits_per_element(32) == KVFormat.parse("int8").bits_per_element(32) == 9.0
    with pytest.raises(CodesignError, match="sized for int8"):
        KVFormat("int4", "mixed")


def test_the_vocabulary_defines_no_kernel():
    code = (
        "import sys; from codesign.kernels.kvcache import formats; from codesign.backend import "
        "kernel_modules_imported as k; assert k() == [], k(); assert 'triton' not in sys.modules; print('ok')"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]
