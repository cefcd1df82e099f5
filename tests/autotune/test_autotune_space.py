"""Config spaces: grid, op rules, pruning by shared memory / registers / threads before launch."""

from __future__ import annotations

import pytest
import torch

from codesign.autotune.ops import get_op, parse_shape
from codesign.autotune.space import ConfigSpace, DeviceLimits, config_id, gemm_resources
from codesign.specs import CodesignError

SMALL = DeviceLimits(name="48K", smem_per_block=48 * 1024, regs_per_thread=255, regs_per_block=65536)


def test_shared_memory_estimate_prunes_before_launch():
    space = ConfigSpace(
        params={
            "BLOCK_M": [64, 128],
            "BLOCK_N": [128],
            "BLOCK_K": [64],
            "num_stages": [1, 4],
            "num_warps": [4],
        },
        resources=gemm_resources(a_bytes=2, b_bytes=0.5),
    )
    kept = {(c["BLOCK_M"], c["num_stages"]) for c in space.candidates(SMALL)}
    # By hand, stages * (BM*BK*2 + BK*BN*0.5) bytes: (64, 1) 12288; (64, 4) 49152, exactly the
    # 48 KiB limit, so it fits; (128, 1) 20480; (128, 4) 81920, pruned.
    assert kept == {(64, 1), (64, 4), (128, 1)}
    assert "shared memory 81920 B > 49152 B" in space.why_not(
        {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "num_stages": 4, "num_warps": 4}, SMALL
    )
    assert len(space.candidates(DeviceLimits())) == 4  # Hopper's 227 KiB takes them all


def test_register_and_thread_limits():
    space = ConfigSpace(
        params={
            "BLOCK_M": [256],
            "BLOCK_N": [256],
            "BLOCK_K": [16],
            "num_stages": [1],
            "num_warps": [1, 8, 64],
        },
        resources=gemm_resources(2, 2),
    )
    why = {c["num_warps"]: space.why_not(c, DeviceLimits()) for c in space.grid()}
    # 256*256 fp32 accumulators over 32 threads = 2048 regs/thread; over 256 threads = 256 + 32 > 255.
    assert "registers/thread" in why[1] and "registers/thread" in why[8]
    assert why[64] == "2048 threads > 1024"


def test_grid_order_validity_rule_and_bad_spaces():
    space = ConfigSpace({"A": [1, 2, 3], "B": [5, 6]}, valid=lambda c: c["A"] != 2, fixed={"C": 0})
    assert space.size == 6 and len(space.candidates(DeviceLimits())) == 4
    assert all(c["C"] == 0 for c in space.grid())
    assert config_id({"b": 1, "a": 2}) == config_id({"a": 2, "b": 1})
    with pytest.raises(CodesignError, match="distinct"):
        ConfigSpace({"A": [1, 1]})
    with pytest.raises(CodesignError, match="at least one"):
        ConfigSpace({})


@pytest.mark.parametrize(
    "name, shape",
    [
        ("w4a16_gemm", "M=1,N=4096,K=4096,G=128,SPLITK=1"),
        ("w4a16_gemm", "M=256,N=11008,K=4096,G=0"),
        ("w8a8_gemm", "M=64,N=4096,K=4096"),
        ("paged_attention", "M=8,q_heads=32,kv_heads=8,head_dim=128,block_size=16,ctx=4096"),
    ],
)
def test_shipped_gpu_spaces_fit_an_h100_after_pruning(name, shape):
    op = get_op(name)
    s = parse_shape(shape)
    op.check_shape(s)
    space = op.space(s, torch.float16, on_gpu=True)
    h100 = DeviceLimits()
    cands = space.candidates(h100)
    assert 20 <= len(cands) <= space.size
    for c in cands:
        r = space.resources(c)
        assert r.smem_bytes <= h100.smem_per_block and r.regs_per_thread <= h100.regs_per_thread
    assert len(space.candidates(SMALL)) < len(cands)  # a 48 KiB device prunes more


def test_the_gemv_space_is_pruned_by_registers():
    """The GEMV keeps its tile in registers and uses no shared memory to speak of: its estimate must prune the
    tiles that cannot fit 255 registers a thread, on every device."""
    op = get_op("w4a16_gemm")
    s = parse_shape("M=1,N=4096,K=4096,G=128,SPLITK=0,GEMV=1")
    space = op.space(s, torch.float16, on_gpu=True)
    cands = space.candidates(DeviceLimits())
    assert 10 <= len(cands) < space.size
    assert all(space.resources(c).regs_per_thread <= 255 for c in cands)
    assert {"BLOCK_K": 256, "BLOCK_N": 256, "num_warps": 1} not in cands


def test_parse_shape_rejects_junk():
    assert parse_shape("M=1, N=2") == {"M": 1, "N": 2}
    for bad in ("M", "M=", "=3", "M=1.5", "M=1;N=2"):
        with pytest.raises(CodesignError, match="NAME=INT"):
            parse_shape(bad)
