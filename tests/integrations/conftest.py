"""Fixtures the Hugging Face integration tests share."""

from __future__ import annotations

import pytest

from codesign.integrations.hf.support import ATTN_NAME


@pytest.fixture
def paged():
    """Switch a model to codesign_paged for the test, back afterwards."""
    used = []

    def use(model):
        used.append((model, model.config._attn_implementation))
        model.set_attn_implementation(ATTN_NAME)
        return model

    yield use
    for model, prev in used:
        model.set_attn_implementation(prev)
