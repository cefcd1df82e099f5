"""DF11 Huffman decode unit: its own cycle/energy/area numbers and a df11 Gemm's cost on the designs.

Every golden number is re-derived by hand in the comment beside it from the formulas in the module
docstrings (huffman_decoder.py, energy.py, evaluate.py, dram.py) and the design YAML, ZigZag-style; none
was copied from a run of the code.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import yaml

from codesign.accel_model.design import DESIGN_DIR, design_from_dict, load_design
from codesign.accel_model.energy import EnergyModel
from codesign.accel_model.evaluate import design_fields_read, evaluate
from codesign.accel_model.huffman_decoder import (
    HuffmanDecoderSpec,
    huffman_area_um2,
    huffman_cost,
    huffman_cycles,
)
from codesign.specs import (
    CodesignError,
    Gemm,
    KVFormat,
    Norm,
    PagedDecodeAttention,
    Softmax,
    WeightFormat,
)

E7 = (7 / 45) * (0.75 / 0.9) ** 2  # 45 nm -> 7 nm energy scale (energy.py)
A7 = (7 / 45) ** 2  # area scale
REFRESH = 1 - 310 / 6240  # HBM2E refresh derating, as tests/accel_model/test_design.py derives it
DF11 = WeightFormat("df11", avg_bits=10.75)  # MiniLM's measured bits per weight (issue 11 notes)
N = K = 4096


def test_unit_golden_numbers_at_45nm():
    spec = HuffmanDecoderSpec(
        lanes=4, symbols_per_cycle=2, pipeline_depth=3, lut_tables=4, second_level_fraction=0.25
    )
    em = EnergyModel(45)
    # 100 codes + 25 second-level reads = 125 issue slots over 4 lanes x 2 = 8 per cycle -> ceil(15.6) = 16,
    # + 3 pipeline stages = 19 cycles.
    c = huffman_cost(spec, 100, em)
    assert c.cycles == 19 and c.lut_reads == 125
    # One lane's LUT replica: 4 tables x 512 B = 2048 B; a 64-bit read of 2 KiB interpolates between 8 KiB
    # (10 pJ) and 32 KiB (20 pJ) with slope log(2)/log(4) = 0.5: 10 x (2048 / 8192)^0.5 = 5 pJ; a 16-bit
    # entry is 16/64 of that = 1.25 pJ -> 125 x 1.25 = 156.25 pJ. Logic 100 x 0.3 pJ = 30 pJ.
    assert c.lut_pj == pytest.approx(156.25) and c.logic_pj == pytest.approx(30.0)
    assert c.energy_pj == pytest.approx(186.25)
    # Area: LUT 4 lanes x 2 replicas x 2048 B = 16 KiB = 131,072 bits x 0.346 / 0.7 um^2; logic per read
    # port 137 + 160 x 4 + 64 x 5 = 1097 um^2 x 8 ports.
    assert spec.lut_bytes == 16384
    assert huffman_area_um2(spec, em) == pytest.approx(131_072 * 0.346 / 0.7 + 8 * 1097)


def test_cycles_edges():
    spec = HuffmanDecoderSpec(lanes=8, symbols_per_cycle=1, pipeline_depth=5, second_level_fraction=0.0)
    assert huffman_cycles(spec, 0) == 0  # nothing to decode: no pipeline fill either
    assert huffman_cycles(spec, 1) == 1 + 5
    assert huffman_cycles(spec, 64) == 8 + 5  # exact multiple of the lanes
    assert huffman_cycles(spec, 65) == 9 + 5
    # 0.01 of 800 codes = 8 extra reads: 808 / 8 = 101 exactly (no float rounding up to 102).
    assert huffman_cycles(dataclasses.replace(spec, second_level_fraction=0.01), 800) == 101 + 5
    with pytest.raises(CodesignError, match="n must be a non-negative integer"):
        huffman_cycles(spec, -1)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"lanes": 0}, "huffman_decoder.lanes must be a positive integer"),
        ({"lanes": 4, "symbols_per_cycle": 3}, "symbols_per_cycle must be one of"),
        ({"lanes": 4, "pipeline_depth": -1}, "pipeline_depth must be a non-negative integer"),
        ({"lanes": 4, "lut_tables": 0}, "lut_tables must be a positive integer"),
        ({"lanes": 4, "second_level_fraction": 1.5}, r"second_level_fraction must be in \[0, 1\]"),
    ],
)
def test_bad_spec(kwargs, message):
    with pytest.raises(CodesignError, match=message):
        HuffmanDecoderSpec(**kwargs)


def _yaml(name: str) -> dict:
    return yaml.safe_load((DESIGN_DIR / f"{name}.yaml").read_text())


@pytest.mark.parametrize(
    "edit, message",
    [
        ({"lanes": 0}, "huffman_decoder.lanes: must be a positive integer"),
        (
            {"lanes": 8, "symbols_per_cycle": 3},
            "huffman_decoder: huffman_decoder.symbols_per_cycle must be one",
        ),
        ({"lanes": 8, "colour": 1}, "huffman_decoder.colour: unknown field"),
        (
            {"lanes": 8, "second_level_fraction": -0.1},
            "huffman_decoder.second_level_fraction: must be a non-neg",
        ),
    ],
)
def test_design_yaml_errors_name_the_field(edit, message):
    data = _yaml("gpu_like")
    data["huffman_decoder"] = edit
    with pytest.raises(CodesignError, match=message):
        design_from_dict(data, "x.yaml")


def test_builtin_df11_design_and_area():
    d = load_design("gpu_like_df11")
    assert d.huffman_decoder == HuffmanDecoderSpec(1024, 2, 3, 4, 0.01)
    # Everything but the name and the decoder is gpu_like's.
    g = load_design("gpu_like")
    assert dataclasses.replace(d, name=g.name, source=g.source, huffman_decoder=None) == g
    # LUTs 1024 x 2 x 2048 B = 4 MiB = 33,554,432 bits x 0.346 / 0.7 um^2; logic 2048 ports x 1097 um^2;
    # both x (7/45)^2 for 7 nm.
    want = (33_554_432 * 0.346 / 0.7 + 2048 * 1097) * A7 / 1e6
    assert d.area_mm2()["huffman_decoder"] == pytest.approx(want)
    assert "huffman_decoder" not in g.area_mm2()


def _dram_s(nbytes: int) -> float:
    """HBM2E x5 stream time (dram.py; as tests/accel_model/test_design.py): 32 B bursts over 80 pseudo-channels,
    (tRCD + tRP + nBL = 48 + (busiest - 1) x 2) cycles / REFRESH at 0.625 ns."""
    busiest = math.ceil(nbytes / 32 / 80)
    return (48 + (busiest - 1) * 2) / REFRESH * 0.625e-9


def test_golden_df11_gemv_on_gpu_like_df11():
    r = evaluate(load_design("gpu_like_df11"), Gemm(1, N, K, weight=DF11))
    # DRAM: x 8192 B + W 4096^2 x 10.75 / 8 = 22,544,384 B + y 8192 B; the decoded bf16 weight (32 MiB)
    # fills the 10368 KiB filter buffer 4 times -> x re-read 3 more times (+24,576 B) = 22,585,344 B.
    assert r.traffic["dram"] == 22_585_344
    # 705,792 bursts / 80 channels -> 8823 on the busiest: (48 + 8822 x 2) / REFRESH x 0.625 ns = 11.636 us.
    assert r.seconds == pytest.approx(_dram_s(22_585_344), rel=1e-9)
    assert r.bound == "dram"
    # Decoder: 16,777,216 x 1.01 = 16,944,988.16 slots / (1024 x 2) -> 8274 + 3 = 8277 cycles at 1.41 GHz.
    assert r.utilisation["huffman"] * r.seconds == pytest.approx(8277 / 1.41e9)
    # Arrays as for a dense GEMV: N split over 108 arrays -> 38 columns, os folds 1 x 2 of
    # (32 + 32 + 4096 - 2) -> 8315 cycles.
    assert r.utilisation["systolic"] * r.seconds == pytest.approx(8315 / 1.41e9)
    # Energy: LUT reads 16,944,988.16 x 1.25 pJ, logic 16,777,216 x 0.3 pJ, both x E(7 nm);
    # DRAM 22,585,344 B x 8 x 3.9 pJ/bit.
    assert r.energy_pj["huffman.lut_read"] == pytest.approx(16_944_988.16 * 1.25 * E7)
    assert r.energy_pj["huffman.logic"] == pytest.approx(16_777_216 * 0.3 * E7)
    assert r.energy_pj["dram.access"] == pytest.approx(22_585_344 * 8 * 3.9)
    # The arrays read the decoded bf16 weight from the filter buffer: 4096^2 words x 2 B, 1024-bit words.
    assert r.energy_pj["sram.filter.read"] == pytest.approx(
        16_777_216 * 2 / 128 * EnergyModel(7).sram_read_pj(10368 * 1024 // 108, 1024)
    )


def test_df11_gemv_without_decoder_runs_on_the_vector_lanes():
    r = evaluate(load_design("gpu_like"), Gemm(1, N, K, weight=DF11))
    # Software decode: 16,777,216 x 8 lane-ops / (64 x 108 lanes) -> ceil(19418.07) = 19419 cycles at
    # 1.41 GHz = 13.77 us, longer than the same DRAM stream (11.64 us): vector-bound.
    assert r.bound == "vector"
    assert r.seconds == pytest.approx(19419 / 1.41e9)
    assert r.traffic["dram"] == 22_585_344
    assert r.energy_pj["vector.op"] == pytest.approx(16_777_216 * 8 * (3.7 + 0.9) * E7)


def test_memory_bound_gemv_gains_the_compression_ratio_compute_bound_does_not():
    d = load_design("gpu_like_df11")
    dense, df11 = (
        evaluate(d, Gemm(1, N, K, weight=WeightFormat("bf16"))),
        evaluate(d, Gemm(1, N, K, weight=DF11)),
    )
    assert dense.bound == df11.bound == "dram"
    # Time ratio ~ 10.75 / 16 = 0.672 (the activations and outputs, 0.1% of the bytes, dilute it a hair).
    assert df11.seconds / dense.seconds == pytest.approx(10.75 / 16, rel=0.01)
    # A prefill-sized GEMM is array-bound: the compressed weight saves DRAM traffic but no time.
    dense, df11 = (evaluate(d, Gemm(4096, N, K, weight=w)) for w in (WeightFormat("bf16"), DF11))
    assert dense.bound == df11.bound == "systolic" and df11.seconds == dense.seconds
    # Same activation re-reads (the filter buffer holds decoded bf16 either way): the difference is the
    # weight alone, 4096^2 x (16 - 10.75) / 8 = 11,010,048 B.
    assert dense.traffic["dram"] - df11.traffic["dram"] == 11_010_048
    # A design whose GEMV is compute-bound (tpu_like: weight-stationary arrays idle at M = 1) gains nothing.
    tpu = _yaml("tpu_like")
    tpu["huffman_decoder"] = {"lanes": 512, "symbols_per_cycle": 2}
    t = design_from_dict(tpu, "tpu_like_df11.yaml")
    dense, df11 = (evaluate(t, Gemm(1, N, K, weight=w)) for w in (WeightFormat("bf16"), DF11))
    assert dense.bound == df11.bound == "systolic" and df11.seconds == dense.seconds


def test_small_decoder_becomes_the_bound():
    data = _yaml("gpu_like")
    data["huffman_decoder"] = {
        "lanes": 16,
        "symbols_per_cycle": 1,
        "pipeline_depth": 3,
        "second_level_fraction": 0.0,
    }
    r = evaluate(design_from_dict(data, "slow.yaml"), Gemm(1, N, K, weight=DF11))
    # 16,777,216 codes / 16 per cycle = 1,048,576 + 3 cycles at 1.41 GHz = 743.7 us >> DRAM.
    assert r.bound == "huffman" and r.seconds == pytest.approx(1_048_579 / 1.41e9)


def test_other_ops_cost_the_same_with_the_decoder():
    """The decoder only touches df11 GEMMs: every other op's numbers are gpu_like's, field for field."""
    d, g = load_design("gpu_like_df11"), load_design("gpu_like")
    for spec in (
        Gemm(7, 512, 300),
        Gemm(1, 4096, 4096, weight=WeightFormat.parse("int4-g128")),
        Norm(16, 4096),
        Softmax(8, 1000),
        PagedDecodeAttention(32, 8, 128, context_lens=(700, 33)),
        PagedDecodeAttention(32, 8, 128, context_lens=(700,), kv_format=KVFormat.parse("int8")),
    ):
        assert evaluate(d, spec) == evaluate(g, spec), spec
        assert "huffman_decoder" not in design_fields_read(False, 0, spec)
    assert "huffman_decoder" in design_fields_read(False, 0, Gemm(1, 64, 64, weight=DF11))


def test_df11_cost_reads_only_the_declared_fields():
    """design_fields_read's contract for df11 GEMMs: units outside the list (PIM, KV-quant) change nothing,
    units inside it (the decoder) do."""
    d = load_design("gpu_like_df11")
    spec = Gemm(3, 1024, 768, weight=DF11)
    other = dataclasses.replace(
        d, name="other", kv_quant=load_design("oaken_like").kv_quant, pim=load_design("attacc_like").pim
    )
    assert evaluate(other, spec) == evaluate(d, spec)
    slower = dataclasses.replace(d, huffman_decoder=dataclasses.replace(d.huffman_decoder, lanes=8))
    assert evaluate(slower, spec) != evaluate(d, spec)
