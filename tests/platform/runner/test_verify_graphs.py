"""Verification steps replayed from graphs of k + 1 query tokens a row: the padded layout, and
on CPU (graphs replaced by eager re-runs over the same persistent buffers) the very tokens of
eager verification in a batch mixing speculative rows, plain rows and a LoRA adapter."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from benchmarks.random_adapter import write_random_adapter
from loraplex import LLM, LoRARequest, SamplingParams
from loraplex.platform.models.arch_config import ArchConfig
from loraplex.platform.runner.cuda_graph import CudaGraphRunner, capture_sizes, verify_layout


@pytest.mark.parametrize(
    ("query_lens", "query_len", "rows"),
    [
        ([1], 1, [0]),
        ([4], 4, [0, 1, 2, 3]),
        ([1, 4, 2], 4, [3, 4, 5, 6, 7, 10, 11]),  # each row's tokens end its 4 slots
        ([3, 3], 5, [2, 3, 4, 7, 8, 9]),
        ([], 3, []),
    ],
)
def test_verify_layout_puts_each_rows_tokens_last_in_its_slots(query_lens, query_len, rows):
    assert verify_layout(np.array(query_lens), query_len).tolist() == rows


@pytest.mark.parametrize("bad", [[0], [5], [2, 6]])
def test_verify_layout_refuses_a_row_longer_than_the_graph(bad):
    with pytest.raises(ValueError, match="query lengths"):
        verify_layout(np.array(bad), 4)


def test_verify_graph_sizes_stop_at_the_verify_bound():
    runner = CudaGraphRunner(
        torch.nn.Identity(), [], 40, 8, torch.device("cpu"), verify_query_len=4, verify_max_bs=20
    )
    assert runner.sizes == capture_sizes(40) == [1, 2, 4, 8, 16, 32, 40]
    assert runner.verify_sizes == [1, 2, 4, 8, 16, 20]
    assert runner.input_ids.shape == (80,)  # 20 rows x 4 tokens > 40 decode rows
    plain = CudaGraphRunner(torch.nn.Identity(), [], 8, 8, torch.device("cpu"))
    assert plain.verify_sizes == [] and plain.input_ids.shape == (8,)


TEXT = (
    "The committee met on Tuesday to discuss the budget. Members agreed that the library "
    "needs new computers and that the park benches should be repaired before summer."
)
PROMPTS = [
    f"Repeat this text exactly: {TEXT}\n\n{TEXT[:60]}",
    "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):\n",
    "one two three four five one two three four five one two three",
    "The capital of France is",
    f"Copy: {TEXT}\n\n{TEXT[:40]}",
]
N = 16
GREEDY = SamplingParams(temperature=0.0, max_tokens=N, ignore_eos=True)
SAMPLED = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=N, seed=7, ignore_eos=True)
LOGPROBS = SamplingParams(temperature=0.0, max_tokens=N, logprobs=2, ignore_eos=True)


@pytest.mark.slow
def test_graphed_verification_gives_the_tokens_of_eager_verification(model_dir, tmp_path):
    write_random_adapter(
        tmp_path, ArchConfig.from_path(model_dir), rank=8, seed=3, modules=("q_proj", "v_proj"),
        dtype=torch.float32,
    )  # fmt: skip
    adapter = LoRARequest("graph-adapter", str(tmp_path))
    llm = LLM(
        str(model_dir), dtype="float32", device="cpu", max_loras=2, max_lora_rank=8,
        num_kv_blocks=128, max_num_seqs=8, enable_prefix_caching=False,
        speculative_config={"method": "ngram", "num_speculative_tokens": 3},
    )  # fmt: skip
    runner = llm.engine.runner
    assert runner.graphs is None  # CPU: eager unless graphs are installed
    params = [GREEDY, SAMPLED, GREEDY, LOGPROBS, GREEDY, SAMPLED]
    prompts = PROMPTS + PROMPTS[:1]
    loras = [None, None, adapter, None, adapter, None]
    eager = [o.outputs[0].token_ids for o in llm.generate(prompts, params, lora_request=loras)]

    graphs = runner.build_graph_runner()
    graphs.capture()
    assert graphs.verify_query_len == 4 and graphs.verify_sizes == [1, 2, 4, 8]
    runner.graphs = graphs
    replays: dict[int, int] = {}
    run_verify = graphs.run_verify

    def counted(batch):
        size = graphs.verify_padded_size(batch)
        replays[size] = replays.get(size, 0) + 1
        return run_verify(batch)

    graphs.run_verify = counted  # type: ignore[method-assign]
    before = llm.stats().spec_decoding
    graphed = [o.outputs[0].token_ids for o in llm.generate(prompts, params, lora_request=loras)]
    assert graphed == eager
    after = llm.stats().spec_decoding
    assert after.num_accepted_tokens - before.num_accepted_tokens >= N  # drafts were accepted
    assert sum(replays.values()) >= 4 and 8 in replays  # the six rows padded to the 8-row graph
    stats = llm.stats()
    llm.engine.step()
    assert llm.stats().num_free_blocks == stats.num_total_blocks
