"""A `--max-model-len` beyond the model's context is refused with the limit named, as vLLM
refuses it (never silently lowered): `loraplex serve` exits 2, `LLM(...)` raises ValueError."""

from __future__ import annotations

import pytest

from benchmarks.common.server_launch import free_port
from loraplex.platform.models.arch_config import ArchConfig

pytestmark = pytest.mark.slow

_MISTRAL = {
    "architectures": ["MistralForCausalLM"], "hidden_size": 64, "intermediate_size": 128,
    "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2,
    "vocab_size": 128, "max_position_embeddings": 32768, "sliding_window": 4096,
}  # fmt: skip


def test_serve_exits_2_naming_the_models_context(model_dir, capsys):
    from loraplex.cli import main

    status = main(["serve", str(model_dir), "--max-model-len", "100000", "--device", "cpu",
                   "--port", str(free_port()), "--num-kv-blocks", "64"])  # fmt: skip
    assert status == 2
    err = capsys.readouterr().err
    assert "loraplex serve: error:" in err
    assert "100000" in err and "8192" in err and "max_position_embeddings" in err


def test_llm_raises_naming_the_limit(model_dir):
    from loraplex import LLM

    with pytest.raises(ValueError, match=r"max_model_len 100000 .* 8192 tokens"):
        LLM(str(model_dir), device="cpu", dtype="float32", max_model_len=100000, num_kv_blocks=64)


def test_the_models_own_context_and_less_are_served():
    arch = ArchConfig.from_dict(_MISTRAL)
    assert arch.context_length(None) == 4096 == arch.max_position_embeddings
    assert arch.context_length(1024) == 1024
    with pytest.raises(ValueError, match="sliding window"):
        arch.context_length(8192)
