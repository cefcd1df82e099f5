"""Measured A100 latencies from the LLMCompass artifact, as operator specs, for checking our models.

Source: PrincetonUniversity/LLMCompass (BSD-3-Clause), `ae/figure5/*/real_hardware/`,
measured by its authors on an NVIDIA A100 80GB in fp16. The rows are copied
here (the full files are in the project's shared reference data) so the checks
run on any clone. The GPT-3 175B layer runs with tensor parallelism over 4 GPUs,
batch 8, sequence 2048 (prefill) or one new token at context 2048 (decode).

Run `python -m codesign.dataflow.llmcompass_ref` to print roofline/measured ratios.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from codesign.specs import AllReduce, CodesignError, Elementwise, Gemm, Norm, OpSpec, Softmax

# (M, N, K, measured seconds) from matmul_A100.csv.
MATMUL_A100: tuple[tuple[int, int, int, float], ...] = (
    (64, 12288, 12288, 0.1900e-3),
    (128, 12288, 12288, 0.2003e-3),
    (256, 12288, 12288, 0.3185e-3),
    (512, 12288, 12288, 0.6118e-3),
    (1024, 12288, 12288, 1.1990e-3),
    (2048, 12288, 12288, 2.3586e-3),
    (4096, 12288, 12288, 4.4576e-3),
    (8192, 12288, 12288, 8.6216e-3),
    (16384, 12288, 12288, 17.0307e-3),
    (32768, 12288, 12288, 35.4407e-3),
    (8192, 64, 64, 0.0296e-3),
    (8192, 128, 128, 0.0310e-3),
    (8192, 256, 256, 0.0356e-3),
    (8192, 512, 512, 0.0471e-3),
    (8192, 1024, 1024, 0.0927e-3),
    (8192, 2048, 2048, 0.2818e-3),
    (8192, 4096, 4096, 1.0210e-3),
    (8192, 8192, 8192, 3.9614e-3),
    (8192, 16384, 16384, 15.0087e-3),
    (8192, 32768, 32768, 61.1346e-3),
)

# (M, N, measured G elements/s) from softmax_A100.csv and layernorm_A100.csv;
# (N, G elements/s) from gelu_A100.csv.
SOFTMAX_A100: tuple[tuple[int, int, float], ...] = (
    (4096, 32, 9.9956),
    (4096, 64, 19.6341),
    (4096, 128, 37.2716),
    (4096, 256, 68.7195),
    (4096, 512, 111.3429),
    (4096, 1024, 152.9755),
    (4096, 2048, 167.5446),
    (4096, 4096, 204.5603),
    (4096, 8192, 216.5192),
    (4096, 16384, 242.0249),
    (4096, 32768, 240.8857),
    (32, 4096, 8.4578),
    (64, 4096, 16.6593),
    (128, 4096, 30.9722),
    (256, 4096, 57.1175),
    (512, 4096, 96.6604),
    (1024, 4096, 137.439),
    (2048, 4096, 166.7506),
    (4096, 4096, 203.9674),
    (8192, 4096, 229.9632),
    (16384, 4096, 247.1247),
    (32768, 4096, 278.8261),
)
LAYERNORM_A100: tuple[tuple[int, int, float], ...] = (
    (4096, 32, 2.4764),
    (4096, 64, 4.8437),
    (4096, 128, 10.0642),
    (4096, 256, 19.5904),
    (4096, 512, 39.2683),
    (4096, 1024, 78.8887),
    (4096, 2048, 139.0687),
    (4096, 4096, 211.3176),
    (4096, 8192, 265.2922),
    (4096, 16384, 210.4486),
    (4096, 32768, 199.2743),
    (32, 4096, 2.4989),
    (64, 4096, 5.0206),
    (128, 4096, 9.9956),
    (256, 4096, 20.0824),
    (512, 4096, 40.1648),
    (1024, 4096, 79.6027),
    (2048, 4096, 141.8725),
    (4096, 4096, 211.6353),
    (8192, 4096, 284.8937),
    (16384, 4096, 345.7924),
    (32768, 4096, 385.8464),
)
GELU_A100: tuple[tuple[int, float], ...] = (
    (1024, 0.0213),
    (2048, 0.0434),
    (4096, 0.0855),
    (8192, 0.1701),
    (16384, 0.3369),
    (32768, 0.6889),
    (65536, 1.3813),
    (131072, 2.7351),
    (262144, 5.5252),
    (524288, 11.191),
    (1048576, 21.9354),
    (2097152, 43.9805),
    (4194304, 86.661),
    (8388608, 141.8725),
    (16777216, 210.3699),
    (33554432, 277.0423),
    (67108864, 328.2507),
    (134217728, 360.1727),
    (268435456, 379.5381),
    (536870912, 390.3276),
)


# The operator set: each op's dims, in its CSV's order, as a spec (fp16, as measured).
OP_SPECS: dict[str, Callable[..., OpSpec]] = {
    "matmul": lambda m, n, k: Gemm(m, n, k),
    "softmax": lambda m, n: Softmax(m, n),
    "layernorm": lambda m, n: Norm(m, n, "layer"),
    "gelu": lambda n: Elementwise("gelu", n),
}


def op_shapes() -> dict[str, list[tuple[int, ...]]]:
    """The single-operator shapes of the A100 rows, per op of `OP_SPECS` (what another GPU is timed on)."""
    return {
        "matmul": [(m, n, k) for m, n, k, _ in MATMUL_A100],
        "softmax": [(m, n) for m, n, _ in SOFTMAX_A100],
        "layernorm": [(m, n) for m, n, _ in LAYERNORM_A100],
        "gelu": [(n,) for n, _ in GELU_A100],
    }


def measured_a100() -> list[tuple[OpSpec, float]]:
    """Every single-operator A100 measurement as (spec, seconds): the calibration set of the GPU model."""
    out: list[tuple[OpSpec, float]] = [(OP_SPECS["matmul"](m, n, k), t) for m, n, k, t in MATMUL_A100]
    for op, rows in (("softmax", SOFTMAX_A100), ("layernorm", LAYERNORM_A100)):
        out += [(OP_SPECS[op](m, n), m * n / (g * 1e9)) for m, n, g in rows]
    out += [(OP_SPECS["gelu"](n), n / (g * 1e9)) for n, g in GELU_A100]
    return out


def load_llmcompass_csvs(folder: str | Path, tag: str) -> list[tuple[OpSpec, float]]:
    """(spec, seconds) rows of the artifact's per-operator CSVs for one device (`tag`: "A100", "MI210").

    Formats: matmul "M, N, K, <t>ms, <r>Tflops"; softmax/layernorm "M, N, <G elements/s>";
    gelu "N, <G elements/s>". Used to check the GPU model on a device whose rows are not copied here.
    """
    folder = Path(folder)
    out: list[tuple[OpSpec, float]] = []

    def rows(op: str) -> list[list[str]]:
        path = folder / f"{op}_{tag}.csv"
        if not path.is_file():
            raise CodesignError(f"{path}: no LLMCompass {op} CSV for {tag!r} in {folder}")
        return [
            [c.strip() for c in line.split(",")] for line in path.read_text().splitlines() if line.strip()
        ]

    for m, n, k, t, *_ in rows("matmul"):
        out.append((OP_SPECS["matmul"](int(m), int(n), int(k)), float(t.removesuffix("ms")) * 1e-3))
    for op in ("softmax", "layernorm"):
        for m, n, g in rows(op):
            out.append((OP_SPECS[op](int(m), int(n)), int(m) * int(n) / (float(g) * 1e9)))
    for n, g in rows("gelu"):
        out.append((OP_SPECS["gelu"](int(n)), int(n) / (float(g) * 1e9)))
    return out


# Row order of transformer_A100.csv / transformerAR_A100.csv (seconds).
LAYER_ROWS = (
    "Q_K_V",
    "Q_mul_K",
    "A_mul_V",
    "Wo_proj",
    "W1_proj",
    "W2_proj",
    "Softmax",
    "LayerNorm_MHA",
    "LayerNorm_FFN",
    "GeLU",
    "AllReduce_MHA",
    "AllReduce_FFN",
)
GPT3_PREFILL_A100 = (
    0.013721823692321777,
    0.0018811225891113281,
    0.001183152198791504,
    0.0045403242111206055,
    0.017464280128479004,
    0.017485618591308594,
    0.00280153751373291,
    0.0006816387176513672,
    0.0006816387176513672,
    0.0005242824554443359,
    0.0028909,
    0.0028909,
)
GPT3_DECODE_A100 = (
    0.0002124309539794922,
    0.00010609626770019531,
    0.0001386404037475586,
    6.890296936035156e-05,
    0.00018596649169921875,
    0.00018608570098876953,
    1.6689300537109375e-05,
    4.8041343688964844e-05,
    4.8041343688964844e-05,
    4.792213439941406e-05,
    26.04e-06,
    26.04e-06,
)


def gpt3_layer_specs(phase: str) -> dict[str, OpSpec]:
    """Specs of the LLMCompass GPT-3 layer rows (one of 4 tensor-parallel ranks), keyed by row name."""
    d, heads, hd, tp, b, s = 12288, 96, 128, 4, 8, 2048
    h = heads // tp
    t = b * s if phase == "prefill" else b  # tokens in this step
    q = s if phase == "prefill" else 1  # queries per sequence
    ln = Norm(t, d, "layer")
    ar = AllReduce(t * d, tp)
    return {
        "Q_K_V": Gemm(t, 3 * d // tp, d),
        "Q_mul_K": Gemm(q, s, hd, batch=b * h),
        "A_mul_V": Gemm(q, hd, s, batch=b * h),
        "Wo_proj": Gemm(t, d, d // tp),
        "W1_proj": Gemm(t, 4 * d // tp, d),
        "W2_proj": Gemm(t, d, 4 * d // tp),
        "Softmax": Softmax(b * h * q, s),
        "LayerNorm_MHA": ln,
        "LayerNorm_FFN": ln,
        "GeLU": Elementwise("gelu", t * 4 * d // tp),
        "AllReduce_MHA": ar,
        "AllReduce_FFN": ar,
    }


def _main() -> None:
    from codesign.catalog.gpus import load_gpu
    from codesign.dataflow.roofline import op_time

    gpu = load_gpu("a100-80gb")
    print("matmul (M, N, K): roofline / measured on A100 80GB")
    for m, n, k, meas in MATMUL_A100:
        t, bound = op_time(Gemm(m, n, k), gpu)
        print(f"  {m:>6} {n:>6} {k:>6}  {t / meas:6.3f}  ({bound})")
    for phase, measured in (("prefill", GPT3_PREFILL_A100), ("decode", GPT3_DECODE_A100)):
        print(f"GPT-3 175B layer, {phase}, TP=4: roofline / measured")
        for (name, spec), meas in zip(gpt3_layer_specs(phase).items(), measured):
            t, bound = op_time(spec, gpu)
            print(f"  {name:<14} {t / meas:6.3f}  ({bound})")


if __name__ == "__main__":
    _main()
