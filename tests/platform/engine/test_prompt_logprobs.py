"""Prompt logprobs: every prompt token's logprob under the model, as HF transformers scores it,
whatever the chunking and even when the prompt's blocks are in the prefix cache."""

from __future__ import annotations

import math

import pytest
import torch

from loraplex import LLM, SamplingParams
from loraplex.platform.core.sampling_params import RequestOutputKind

TEXT = (
    "The lighthouse keeper climbed the spiral stairs every evening at dusk, counting each of "
    "the one hundred and twelve steps, and lit the great lamp that warned ships of the rocks."
)


def _check(out, expected: torch.Tensor, k: int, tokenizer) -> None:
    ids = out.prompt_token_ids
    scores = out.prompt_logprobs
    assert scores is not None and len(scores) == len(ids)
    assert scores[0] is None
    got = torch.tensor([scores[i][ids[i]].logprob for i in range(1, len(ids))])
    torch.testing.assert_close(got, expected, atol=2e-4, rtol=0)
    for i in range(1, len(ids)):
        entry = scores[i]
        assert len(entry) in (k, k + 1)  # the prompt token, plus top-k (it may be among them)
        ranked = sorted(entry.values(), key=lambda lp: lp.rank)
        if k:
            assert ranked[0].rank == 1
            assert ranked[0].logprob >= entry[ids[i]].logprob
        assert entry[ids[i]].decoded_token == tokenizer.decode([ids[i]], skip_special_tokens=False)


def test_prompt_logprobs_equal_hf(llm, hf_prompt_logprobs):
    params = SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=3)
    out = llm.generate(TEXT, params)[0]
    _check(out, hf_prompt_logprobs(out.prompt_token_ids), k=3, tokenizer=llm.tokenizer)
    # A second time the prompt's blocks are cached: they are computed again all the same.
    again = llm.generate(TEXT, params)[0]
    _check(again, hf_prompt_logprobs(again.prompt_token_ids), k=3, tokenizer=llm.tokenizer)
    assert again.num_cached_tokens == 0
    assert out.outputs[0].token_ids == again.outputs[0].token_ids


def test_chunked_prefill_scores_every_token_once(model_dir, hf_prompt_logprobs):
    llm = LLM(
        str(model_dir), dtype="float32", num_kv_blocks=64, device="cpu", max_num_batched_tokens=8
    )
    plain = SamplingParams(max_tokens=3, temperature=0.0)
    scored = SamplingParams(max_tokens=3, temperature=0.0, prompt_logprobs=0)
    outs = llm.generate([TEXT, "Once upon a time", TEXT[:40]], [scored, plain, scored])
    assert outs[1].prompt_logprobs is None
    for out in (outs[0], outs[2]):
        _check(out, hf_prompt_logprobs(out.prompt_token_ids), k=0, tokenizer=llm.tokenizer)
        ids = out.prompt_token_ids
        total = sum(out.prompt_logprobs[i][ids[i]].logprob for i in range(1, len(ids)))
        assert math.isfinite(total) and total < 0


def test_n_samples_share_one_scoring_of_the_prompt(llm, hf_prompt_logprobs):
    params = SamplingParams(n=3, max_tokens=3, temperature=1.0, seed=5, prompt_logprobs=1)
    out = llm.generate(TEXT, params)[0]
    assert len(out.outputs) == 3
    _check(out, hf_prompt_logprobs(out.prompt_token_ids), k=1, tokenizer=llm.tokenizer)


def test_streaming_hands_prompt_logprobs_out_once(llm):
    params = SamplingParams(
        max_tokens=4, temperature=0.0, prompt_logprobs=0, output_kind=RequestOutputKind.DELTA
    )
    llm.engine.add_request("stream-1", "Hello there, friend", params)
    outputs = []
    while llm.engine.has_unfinished_requests():
        outputs += [o for o in llm.engine.step() if o.request_id == "stream-1"]
    with_scores = [o for o in outputs if o.prompt_logprobs is not None]
    assert len(with_scores) == 1 and outputs[0] is with_scores[0]


@pytest.mark.parametrize("value", [-1, 21])
def test_out_of_range_prompt_logprobs_are_refused(value):
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=value)
