"""Greedy outputs of a mixed batch equal HF transformers run one prompt at a time."""

from __future__ import annotations

import pytest
import torch
from engine_prompts import PROMPTS

from loraplex import SamplingParams

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def hf_greedy(model_dir):
    model = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    model.eval()

    def run(prompt_ids: list[int], max_new_tokens: int) -> list[int]:
        with torch.no_grad():
            out = model.generate(
                torch.tensor([prompt_ids]),
                max_new_tokens=max_new_tokens,
                do_sample=False,
                pad_token_id=2,
                eos_token_id=None,
                min_new_tokens=max_new_tokens,
            )
        return out[0, len(prompt_ids) :].tolist()

    return run


def test_batched_greedy_equals_hf_one_at_a_time(llm, hf_greedy):
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    outputs = llm.generate(PROMPTS, params)
    assert len({len(o.prompt_token_ids) for o in outputs}) > 4  # lengths really differ
    for out in outputs:
        expected = hf_greedy(out.prompt_token_ids, 16)
        assert out.outputs[0].token_ids == expected, out.prompt
        assert out.outputs[0].finish_reason == "length"


def test_chat_applies_the_template_and_answers(llm):
    out = llm.chat(
        [{"role": "user", "content": "What is the capital of France?"}],
        SamplingParams(temperature=0.0, max_tokens=24),
    )
    assert "Paris" in out[0].outputs[0].text
    assert out[0].outputs[0].finish_reason == "stop"  # <|im_end|> ended it
    prompt = llm.tokenizer.decode(out[0].prompt_token_ids, skip_special_tokens=False)
    assert prompt.endswith("<|im_start|>assistant\n")
