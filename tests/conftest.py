"""Fixtures shared by the whole test suite."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

# NOTE: set before any test reads `loraplex.envs.cache_dir()`, so every run shares one converted
# default model in the git-ignored `.cache/` at the repository root instead of the user's cache.
os.environ.setdefault("LORAPLEX_CACHE_DIR", str(Path(__file__).resolve().parents[1] / ".cache"))
# Servers started by tests keep their registries under the same ignored folder, not in $HOME.
os.environ.setdefault(
    "LORAPLEX_DATA_DIR", str(Path(__file__).resolve().parents[1] / ".cache" / "data")
)


@pytest.fixture(scope="session")
def model_dir() -> Path:
    """The default model (SmolLM2-135M-Instruct) as a Hugging Face folder, converted once."""
    from loraplex.platform.models.model_store import ensure_default_model

    return ensure_default_model(progress=False)
