"""Flat options (as `LLM(...)` and `loraplex serve` take them) reach the right part."""

from __future__ import annotations

import pytest

from loraplex.config import EngineConfig


def test_options_land_in_their_parts():
    config = EngineConfig.from_options(
        max_num_seqs=4, max_loras=2, block_size=32, enforce_eager=True, grammar_compile_timeout=5.0
    )
    assert config.scheduler.max_num_seqs == 4
    assert config.lora.max_loras == 2
    assert config.cache.block_size == 32
    assert config.runner.enforce_eager
    assert config.grammar.compile_timeout_s == 5.0


def test_unknown_or_bad_options_are_refused():
    with pytest.raises(ValueError, match="unknown engine option 'max_batch'"):
        EngineConfig.from_options(max_batch=4)
    with pytest.raises(ValueError, match="max_num_seqs"):
        EngineConfig.from_options(max_num_seqs=0)


def test_speculative_decoding_with_tensor_parallelism_is_refused_clearly() -> None:
    with pytest.raises(ValueError, match="speculative_config cannot be combined"):
        EngineConfig.from_options(
            tensor_parallel_size=2,
            speculative_config={"method": "ngram", "num_speculative_tokens": 2},
        )


def test_module_copy_slots_are_bounded_by_the_lora_slots() -> None:
    config = EngineConfig.from_options(max_loras=4, max_saved_module_loras=2)
    assert config.lora.max_saved_module_loras == 2
    with pytest.raises(ValueError, match=r"max_saved_module_loras must be in \[0, max_loras=4\]"):
        EngineConfig.from_options(max_loras=4, max_saved_module_loras=5)
    with pytest.raises(ValueError, match="max_saved_module_loras cannot be combined"):
        EngineConfig.from_options(max_saved_module_loras=1, tensor_parallel_size=2)
