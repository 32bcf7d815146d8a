from __future__ import annotations

import pytest

from loraplex import LLM


@pytest.fixture(scope="session")
def llm(model_dir) -> LLM:
    """One fp32 engine on the embedded model, shared by the engine tests."""
    return LLM(str(model_dir), dtype="float32", num_kv_blocks=512, device="cpu")
