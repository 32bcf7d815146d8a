"""Preemption, prefix caching and chunked prefill leave greedy outputs unchanged."""

from __future__ import annotations

from engine_prompts import PROMPTS

from loraplex import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


def _texts(outputs):
    return [o.outputs[0].token_ids for o in outputs]


def test_preemption_under_a_quarter_of_the_kv_budget(llm, model_dir):
    reference = llm.generate(PROMPTS, GREEDY)
    needed = sum(-(-(len(o.prompt_token_ids) + 24) // 16) for o in reference)
    small = LLM(str(model_dir), dtype="float32", device="cpu", num_kv_blocks=max(needed // 4, 6))
    outputs = small.generate(PROMPTS, GREEDY)
    assert _texts(outputs) == _texts(reference)
    stats = small.stats()
    assert stats.num_preemptions > 0
    assert stats.num_free_blocks == stats.num_total_blocks


def test_shared_prefix_reports_cached_tokens_and_same_output(llm, model_dir):
    prefix_ids = llm.tokenizer.encode(" ".join(f"item{i}" for i in range(120)))[:200]
    assert len(prefix_ids) == 200
    first = prefix_ids + llm.tokenizer.encode(" The first question is")
    second = prefix_ids + llm.tokenizer.encode(" Another question is")
    llm.generate([first], GREEDY)
    cached = llm.generate([second], GREEDY)[0]
    assert cached.num_cached_tokens >= 192  # 12 full blocks of 16
    uncached_llm = LLM(
        str(model_dir), dtype="float32", device="cpu", num_kv_blocks=64, enable_prefix_caching=False
    )
    uncached = uncached_llm.generate([second], GREEDY)[0]
    assert uncached.num_cached_tokens == 0
    assert cached.outputs[0].token_ids == uncached.outputs[0].token_ids
    stats = llm.stats()
    assert stats.num_free_blocks == stats.num_total_blocks
    assert stats.prefix_cache_hits > 0


def test_chunked_prefill_matches_one_shot(llm, model_dir):
    long_prompt = PROMPTS[4] * 4
    one_shot = llm.generate([long_prompt], GREEDY)[0]
    assert len(one_shot.prompt_token_ids) > 100
    chunked_llm = LLM(
        str(model_dir),
        dtype="float32",
        device="cpu",
        num_kv_blocks=64,
        max_num_batched_tokens=24,
        enable_prefix_caching=False,
    )
    chunked = chunked_llm.generate([long_prompt], GREEDY)[0]
    assert chunked.outputs[0].token_ids == one_shot.outputs[0].token_ids


def test_token_id_prompts_and_blocks_freed(llm):
    ids = llm.tokenizer.encode("The quick brown fox")
    by_ids = llm.generate([ids], GREEDY)[0]
    by_text = llm.generate(["The quick brown fox"], GREEDY)[0]
    assert by_ids.prompt_token_ids == ids
    assert by_ids.outputs[0].token_ids == by_text.outputs[0].token_ids
    stats = llm.stats()
    assert stats.num_free_blocks == stats.num_total_blocks
    assert stats.num_running == stats.num_waiting == 0
