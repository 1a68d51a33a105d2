"""Fixtures the orchestrator's tests share."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def tok():
    """The real SmolLM2 tokenizer (converted on first use), one a module: a test that adds
    tokens to it works on its own copy."""
    from services.common.model_store import load_tokenizer, resolve_model

    return load_tokenizer(resolve_model("smollm2").path)
