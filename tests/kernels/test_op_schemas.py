"""The torch.ops.codesign operators keep their names and schemas (callers, compiled graphs and saved exports
name them): every op's schema as published (`op_schemas.txt`, one a line; new ops are added, none changes)."""

from __future__ import annotations

from pathlib import Path

import torch

import codesign.kernels.attention.latent  # noqa: F401
import codesign.kernels.attention.quantized  # noqa: F401  (defines the attention ops)
import codesign.kernels.df11.linear  # noqa: F401
import codesign.kernels.gemm.ops  # noqa: F401
import codesign.kernels.kvcache.kvq  # noqa: F401
import codesign.kernels.kvcache.latent  # noqa: F401
import codesign.kernels.kvcache.write  # noqa: F401
import codesign.kernels.layers.ops  # noqa: F401
import codesign.kernels.layers.state_ops  # noqa: F401
import codesign.kernels.layers.tree_state_ops  # noqa: F401

SCHEMAS = (Path(__file__).parent / "op_schemas.txt").read_text().split("\n")


def test_every_op_keeps_its_name_and_schema():
    schemas = [s for s in SCHEMAS if s]
    assert len(schemas) == 27
    for want in schemas:
        name = want.split("(", 1)[0].split("::", 1)[1]
        assert str(getattr(torch.ops.codesign, name).default._schema) == want
