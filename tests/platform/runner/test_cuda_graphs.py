"""On a GPU: decode replayed from CUDA graphs computes what eager execution computes."""

from __future__ import annotations

import pytest
import torch

from loraplex import LLM, SamplingParams

pytestmark = pytest.mark.gpu

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _qwen3_engine(**options) -> LLM:
    """Qwen3-0.6B's shape with random weights (seed 1), small enough to build twice per test."""
    return LLM(
        "configs/models/qwen3-0.6b.json",
        dtype="bfloat16",
        enable_lora=False,
        max_model_len=1024,
        max_num_seqs=32,
        # NOTE: a fixed cache, not a share of the GPU: the GPU suite runs several test processes
        # on one card, and a share of its memory is whatever the others left.
        num_kv_blocks=512,
        seed=1,
        **options,
    )


@needs_cuda
def test_graph_decode_equals_eager():
    # NOTE: random weights give near-flat logits, so greedy tokens of the two runs may part at a
    # near-tie; compare the sampled tokens' logprobs wherever both runs saw the same prefix.
    prompts = [[(7 * i + j) % 5000 + 10 for j in range(5 + 9 * i)] for i in range(11)]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=1)
    runs = {}
    for eager in (True, False):
        llm = _qwen3_engine(enforce_eager=eager)
        assert (llm.engine.runner.graphs is None) == eager
        runs[eager] = [o.outputs[0] for o in llm.generate(prompts, params)]
        del llm
        torch.cuda.empty_cache()
    compared = 0
    for eager_out, graph_out in zip(runs[True], runs[False]):
        for pos, (a, b) in enumerate(zip(eager_out.token_ids, graph_out.token_ids)):
            lp_a = eager_out.logprobs[pos][a].logprob
            lp_b = graph_out.logprobs[pos].get(a)
            if lp_b is not None:
                assert abs(lp_a - lp_b.logprob) < 0.05, (pos, lp_a, lp_b)
                compared += pos > 0  # position 0 comes from the (eager) prefill
            if a != b:
                break
    assert compared >= 2 * len(prompts)


@needs_cuda
def test_async_scheduling_equals_lock_step():
    # Equal lengths: both modes run the very same batches, so greedy tokens agree exactly.
    # Unequal lengths with logprobs: async steps also carry rows of requests that just ended
    # (and read inputs by index), so compare logprobs where the prefixes agree, as above.
    prompts = [[(7 * i + j) % 5000 + 10 for j in range(5 + 9 * i)] for i in range(11)]
    same = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    varied = [
        SamplingParams(temperature=0.0, max_tokens=4 + 3 * i, ignore_eos=True, logprobs=1)
        for i in range(len(prompts))
    ]
    runs = {}
    for async_scheduling in (False, True):
        llm = _qwen3_engine(async_scheduling=async_scheduling)
        assert llm.engine.async_scheduling == async_scheduling
        runs[async_scheduling] = (
            [o.outputs[0] for o in llm.generate(prompts, same)],
            [o.outputs[0] for o in llm.generate(prompts, varied)],
        )
        stats = llm.stats()
        assert stats.num_free_blocks == stats.num_total_blocks
        del llm
        torch.cuda.empty_cache()
    (lock_same, lock_varied), (async_same, async_varied) = runs[False], runs[True]
    assert [o.token_ids for o in async_same] == [o.token_ids for o in lock_same]
    assert [len(o.token_ids) for o in async_varied] == [4 + 3 * i for i in range(len(prompts))]
    compared = 0
    for a_out, b_out in zip(lock_varied, async_varied):
        for pos, (a, b) in enumerate(zip(a_out.token_ids, b_out.token_ids)):
            lp_b = b_out.logprobs[pos].get(a)
            if lp_b is not None:
                assert abs(a_out.logprobs[pos][a].logprob - lp_b.logprob) < 0.05, (pos, a)
                compared += 1
            if a != b:
                break
    assert compared >= sum(4 + 3 * i for i in range(len(prompts))) // 2
