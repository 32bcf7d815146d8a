"""`speculative_config`: vLLM's JSON shape, and clear errors for bad ones."""

from __future__ import annotations

import pytest

from loraplex.config import EngineConfig
from loraplex.platform.spec.config import SpeculativeConfig


def test_vllm_shapes_parse():
    ngram = SpeculativeConfig.parse(
        '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, '
        '"prompt_lookup_min": 1}'
    )
    assert (ngram.method, ngram.num_speculative_tokens, ngram.prompt_lookup_max) == (
        "ngram", 4, 4,
    )  # fmt: skip
    draft = SpeculativeConfig.parse({"model": "/models/small", "num_speculative_tokens": 3})
    assert (draft.method, draft.model, draft.num_speculative_tokens) == (
        "draft_model", "/models/small", 3,
    )  # fmt: skip
    config = EngineConfig.from_options(speculative_config={"num_speculative_tokens": 2})
    assert config.speculative == SpeculativeConfig(num_speculative_tokens=2)
    assert EngineConfig.from_options().speculative is None


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("{not json", "not valid JSON"),
        ("[1]", "JSON object"),
        ({"method": "eagle", "num_speculative_tokens": 2}, "method must be one of"),
        ({"method": "ngram"}, "needs 'num_speculative_tokens'"),
        ({"num_speculative_tokens": 0}, r"in \[1, 16\]"),
        ({"num_speculative_tokens": 2.5}, r"in \[1, 16\]"),
        ({"num_speculative_tokens": 2, "prompt_lookup_min": 3, "prompt_lookup_max": 2}, "min <="),
        ({"method": "draft_model", "num_speculative_tokens": 2}, "needs a 'model'"),
        ({"num_speculative_tokens": 2, "speculative_model": "x"}, "unknown speculative config"),
        ({"num_speculative_tokens": 2, "disable_by_batch_size": 0}, "disable_by_batch_size"),
    ],
)
def test_bad_configs_raise_value_error(value, message):
    with pytest.raises(ValueError, match=message):
        SpeculativeConfig.parse(value)
