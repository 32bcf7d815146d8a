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


@pytest.fixture(scope="session")
def hf_prompt_logprobs(model_dir):
    """HF transformers' fp32 logprob of each prompt token after the first, under the default
    model: `run(prompt_ids) -> [len - 1]` tensor, the reference for prompt logprobs."""
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    model.eval()

    def run(prompt_ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            logits = model(torch.tensor([prompt_ids])).logits[0, :-1].float()
        logprobs = torch.log_softmax(logits, dim=-1)
        return logprobs.gather(1, torch.tensor(prompt_ids[1:])[:, None]).squeeze(1)

    return run
