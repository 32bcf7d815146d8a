"""The quality figures of `benchmarks.common.quality`: the perplexity the engine measures is the
model's own, and each quantized format of the embedded model stays near the dense one."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest

from benchmarks.common.quality import (
    GREEDY_PROMPTS,
    QUALITY_TEXT,
    greedy_agreement,
    greedy_continuations,
    perplexity,
    perplexity_from_logprobs,
    token_logprobs,
)
from loraplex import LLM
from loraplex.quant.quantize import quantize_model

# The whole fixed text is one prefill with prompt logprobs; short continuations keep the greedy
# part quick (the benchmark runs 32 tokens).
TEXT = QUALITY_TEXT
MAX_TOKENS = 4
FORMATS: dict[str, dict[str, Any]] = {  # SmolLM2's hidden size 576 takes groups of 64, not 128
    "awq_w4g64": {"method": "awq", "group_size": 64},
    "gptq_w4g64": {"method": "gptq", "bits": 4, "group_size": 64},
    "gptq_w8": {"method": "gptq", "bits": 8, "group_size": -1},
    "fp8_channel": {"method": "fp8", "fp8_scheme": "per_channel"},
}
# Bounds on perplexity / dense perplexity. Measured on this text (benchmarks/quant_quality.py,
# cpu_quant_quality.json): 4-bit RTN 1.20-1.25x, GPTQ 8-bit 1.006x, FP8 per-channel 1.024x. A
# broken format (a wrong zero point, scale layout or packing order) multiplies perplexity
# tenfold or more, far past these bounds.
MAX_PPL_RATIO = {"awq_w4g64": 1.5, "gptq_w4g64": 1.5, "gptq_w8": 1.05, "fp8_channel": 1.1}
# 8-bit weights move the dense logits by less than the gap between the top two tokens on almost
# every first step (measured: 8 of 8 first tokens equal for both), but a 135M model flips near
# ties soon after (even fp32 against bf16 shares only ~37% of 32-token prefixes). So: at most one
# first token may differ, and the 4-token prefixes must mostly agree (measured >= 0.39 at 12).
MIN_8BIT_FIRST_TOKENS = 7
MIN_8BIT_PREFIX_AGREEMENT = 0.3


def _serve(model: Path) -> LLM:
    return LLM(str(model), dtype="float32", device="cpu", num_kv_blocks=256, enable_lora=False)


@pytest.fixture(scope="module")
def dense(model_dir: Path) -> tuple[float, list[list[int]]]:
    """The dense model's perplexity on TEXT and its greedy continuations."""
    llm = _serve(model_dir)
    return perplexity(llm, TEXT), greedy_continuations(llm, GREEDY_PROMPTS, MAX_TOKENS)


@pytest.fixture(scope="module")
def quantized(
    model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, tuple[float, list[list[int]]]]:
    """Each format's perplexity on TEXT and greedy continuations, quantized once per module."""
    root = tmp_path_factory.mktemp("quality")
    scores = {}
    for name, options in FORMATS.items():
        llm = _serve(quantize_model(model_dir, root / name, progress=False, **options))
        scores[name] = (
            perplexity(llm, TEXT),
            greedy_continuations(llm, GREEDY_PROMPTS, MAX_TOKENS),
        )
    return scores


def test_perplexity_from_logprobs_is_exp_of_mean_nll() -> None:
    assert perplexity_from_logprobs([math.log(0.5)] * 4) == pytest.approx(2.0)
    assert perplexity_from_logprobs([0.0, 0.0]) == pytest.approx(1.0)
    assert perplexity_from_logprobs([math.log(0.25), math.log(1.0)]) == pytest.approx(2.0)


@pytest.mark.parametrize("bad", [[], [0.1], [float("nan")]])
def test_perplexity_from_logprobs_rejects_bad_input(bad: list[float]) -> None:
    with pytest.raises(ValueError):
        perplexity_from_logprobs(bad)


def test_greedy_agreement_counts_positions_up_to_the_first_divergence() -> None:
    reference = [[1, 2, 3, 4], [5, 6, 7, 8], [9, 9]]
    candidate = [[1, 2, 3, 4], [5, 0, 7, 8], [9, 9, 9, 9]]  # same, differs at 1, runs longer
    result = greedy_agreement(reference, candidate)
    assert result.prefix_agreement == pytest.approx((4 + 1 + 2) / (4 + 4 + 4))
    assert result.exact_matches == 1
    assert result.first_token_matches == 3
    assert result.num_prompts == 3
    assert greedy_agreement(reference, reference).prefix_agreement == 1.0


def test_greedy_agreement_rejects_mismatched_sets() -> None:
    with pytest.raises(ValueError, match="2 reference continuations but 1"):
        greedy_agreement([[1], [2]], [[1]])
    with pytest.raises(ValueError):
        greedy_agreement([], [])


@pytest.mark.slow
def test_teacher_forced_logprobs_match_transformers(model_dir: Path, hf_prompt_logprobs) -> None:
    # Rare words: some tokens the model finds very unlikely are scored exactly too.
    text = "The zebra played a quiet xylophone sonata for the astonished lighthouse keeper."
    llm = _serve(model_dir)
    ours = token_logprobs(llm, text)
    theirs = hf_prompt_logprobs(llm.tokenizer.encode(text)).tolist()
    assert min(theirs) < -10.0  # at least one token the model finds very unlikely
    assert ours == pytest.approx(theirs, abs=1e-3)


@pytest.mark.slow
@pytest.mark.parametrize("fmt", FORMATS)
def test_quantized_perplexity_stays_near_the_dense_one(
    fmt: str,
    dense: tuple[float, list[list[int]]],
    quantized: dict[str, tuple[float, list[list[int]]]],
) -> None:
    dense_ppl, quant_ppl = dense[0], quantized[fmt][0]
    assert quant_ppl <= MAX_PPL_RATIO[fmt] * dense_ppl, (fmt, quant_ppl, dense_ppl)


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["gptq_w8", "fp8_channel"])
def test_8bit_formats_decode_greedily_like_the_dense_model(
    fmt: str,
    dense: tuple[float, list[list[int]]],
    quantized: dict[str, tuple[float, list[list[int]]]],
) -> None:
    agreement = greedy_agreement(dense[1], quantized[fmt][1])
    assert agreement.first_token_matches >= MIN_8BIT_FIRST_TOKENS, agreement
    assert agreement.prefix_agreement >= MIN_8BIT_PREFIX_AGREEMENT, agreement
