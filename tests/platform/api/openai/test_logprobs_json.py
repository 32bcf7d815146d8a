"""Logprobs always serialise as strict JSON numbers (no -inf, no NaN)."""

from __future__ import annotations

import json
import math

import pytest

from loraplex.platform.api.openai.logprobs import chat_logprobs, completion_logprobs
from loraplex.platform.core.outputs import Logprob


@pytest.mark.parametrize("value", [float("-inf"), float("nan")])
def test_non_finite_logprobs_become_the_floor_value(value: float) -> None:
    entry = {7: Logprob(value, 1, "a"), 8: Logprob(-0.5, 2, "b")}
    chat = chat_logprobs([entry], top_k=2)
    legacy = completion_logprobs([entry], top_k=2, text_offset=0)
    for body in (chat, legacy):
        text = json.dumps(body, allow_nan=False)  # raises on NaN / inf, as the server would
        assert "-9999.0" in text
    assert chat["content"][0]["logprob"] == -9999.0
    assert chat["content"][0]["top_logprobs"][1]["logprob"] == -0.5
    assert not math.isnan(legacy["token_logprobs"][0])
