"""The embedded SmolLM2-135M quantized by `quantize_model` in each format, served by `LLM`:
the checkpoint loads through the real engine and greedy decoding stays with the bf16 model."""

from __future__ import annotations

from pathlib import Path

import pytest

from loraplex import LLM, SamplingParams
from loraplex.quant.quantize import quantize_model

PROMPT = "The capital of France is Paris. The capital of Germany is"
FORMATS = {  # AWQ and GPTQ by default: 4-bit, groups of 64 (128 does not divide SmolLM2's 576)
    "awq": {"method": "awq"},
    "gptq-act-order": {"method": "gptq", "desc_act": True},
    "gptq-8bit": {"method": "gptq", "bits": 8, "group_size": -1},
    "fp8-channel": {"method": "fp8", "fp8_scheme": "per_channel"},
}
# 4-bit round-to-nearest of a 135M model may flip a near tie; 8-bit formats must not.
HIGH_FIDELITY = ("gptq-8bit", "fp8-channel")


def _greedy(model: str | Path) -> tuple[list[int], float]:
    llm = LLM(model=str(model), dtype="float32", device="cpu", num_kv_blocks=64)
    params = SamplingParams(temperature=0.0, max_tokens=6, logprobs=0)
    out = llm.generate([PROMPT], params)[0].outputs[0]
    return out.token_ids, out.cumulative_logprob / len(out.token_ids)


@pytest.fixture(scope="module")
def dense_greedy(model_dir: Path) -> tuple[list[int], float]:
    return _greedy(model_dir)


@pytest.mark.slow
@pytest.mark.parametrize("fmt", FORMATS)
def test_quantized_model_generates_like_the_dense_one(
    fmt: str, model_dir: Path, tmp_path: Path, dense_greedy: tuple[list[int], float]
) -> None:
    out = quantize_model(model_dir, tmp_path / fmt, progress=False, **FORMATS[fmt])
    tokens, mean_logprob = _greedy(out)
    dense_tokens, dense_mean = dense_greedy
    if fmt in HIGH_FIDELITY:
        assert tokens[0] == dense_tokens[0]
    assert mean_logprob > dense_mean - 1.0
