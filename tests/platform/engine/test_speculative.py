"""Speculative decoding end to end on the embedded model: the same tokens as without it (greedy,
and seeded sampling with the n-gram proposer) in batches mixing speculative rows, plain rows
and LoRA adapters, for both proposers; rollback under preemption, abort and stop strings
leaves the KV pool free and the prefix cache serving the right K/V (preemption on a tiny
random model, which runs in a fraction of the time)."""

from __future__ import annotations

import json

import pytest
import torch

from benchmarks.common.random_adapter import write_random_adapter
from loraplex import LLM, LoRARequest, SamplingParams
from loraplex.platform.models.arch_config import ArchConfig
from tests.tiny_models import tiny_llama_config

pytestmark = pytest.mark.slow

TEXT = (
    "The committee met on Tuesday to discuss the budget. Members agreed that the library "
    "needs new computers and that the park benches should be repaired before summer."
)
PROMPTS = [
    f"Repeat this text exactly: {TEXT}\n\n{TEXT[:60]}",
    "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):\n",
    "one two three four five one two three four five one two three",
    "The capital of France is",
]
N = 16
GREEDY = SamplingParams(temperature=0.0, max_tokens=N, ignore_eos=True)
SAMPLED = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=N, seed=7, ignore_eos=True)
LOGPROBS = SamplingParams(temperature=0.0, max_tokens=N, logprobs=2, ignore_eos=True)
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}
ENGINE = dict(dtype="float32", device="cpu", max_loras=2, max_lora_rank=8)


def _idle(llm: LLM) -> None:
    """Blocks of finished requests are all free (one empty step delivers the last frees to
    the runner, and the draft model's cache)."""
    llm.engine.step()
    stats = llm.stats()
    assert stats.num_free_blocks == stats.num_total_blocks
    assert not stats.num_running and not stats.num_waiting
    proposer = llm.engine.runner.proposer
    if hasattr(proposer, "num_free_blocks"):
        assert proposer.num_free_blocks == proposer.num_blocks


def tokens(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


@pytest.fixture(scope="module")
def adapter(model_dir, tmp_path_factory) -> LoRARequest:
    folder = tmp_path_factory.mktemp("spec-adapter")
    write_random_adapter(
        folder, ArchConfig.from_path(model_dir), rank=8, seed=3, modules=("q_proj", "v_proj"),
        dtype=torch.float32,
    )  # fmt: skip
    return LoRARequest("spec-adapter", str(folder))


@pytest.fixture(scope="module")
def baseline(model_dir) -> LLM:
    return LLM(str(model_dir), num_kv_blocks=256, **ENGINE)


@pytest.fixture(scope="module")
def ngram(model_dir) -> LLM:
    return LLM(str(model_dir), num_kv_blocks=128, speculative_config=NGRAM, **ENGINE)


@pytest.fixture(scope="module")
def self_draft(model_dir) -> LLM:
    spec = {"model": str(model_dir), "num_speculative_tokens": 3, "draft_num_kv_blocks": 64}
    return LLM(str(model_dir), num_kv_blocks=128, speculative_config=spec, **ENGINE)


@pytest.fixture(scope="module")
def mixed_batch(adapter):
    """Prompts, params and adapters of a batch mixing speculative rows (greedy and seeded),
    rows that never speculate (logprobs), and rows on an adapter."""
    prompts = PROMPTS + PROMPTS[:3]
    params = [GREEDY, GREEDY, GREEDY, LOGPROBS, GREEDY, SAMPLED, GREEDY]
    loras = [None, None, None, None, adapter, None, adapter]
    return prompts, params, loras


@pytest.fixture(scope="module")
def expected(baseline, mixed_batch) -> list[list[int]]:
    prompts, params, loras = mixed_batch
    return tokens(baseline.generate(prompts, params, lora_request=loras))


def test_ngram_gives_the_same_tokens_in_a_mixed_batch(ngram, mixed_batch, expected):
    prompts, params, loras = mixed_batch
    before = ngram.stats().spec_decoding
    assert tokens(ngram.generate(prompts, params, lora_request=loras)) == expected
    after = ngram.stats().spec_decoding
    assert after.num_accepted_tokens - before.num_accepted_tokens >= N  # it did speculate
    _idle(ngram)


def test_draft_model_gives_the_same_greedy_tokens_and_reproducible_samples(
    self_draft, mixed_batch, expected
):
    prompts, params, loras = mixed_batch
    greedy = [i for i, p in enumerate(params) if p is not SAMPLED]
    out = tokens(self_draft.generate(prompts, params, lora_request=loras))
    assert [out[i] for i in greedy] == [expected[i] for i in greedy]
    stats = self_draft.stats().spec_decoding
    # its own draft: base-model rows accept (nearly) everything
    assert stats.acceptance_rate > 0.6 and stats.num_accepted_tokens_per_pos[2] > 0
    again = tokens(self_draft.generate(prompts, params, lora_request=loras))
    assert again == out  # seeded rows too
    _idle(self_draft)


def test_a_random_draft_of_the_same_vocabulary_keeps_greedy_tokens(model_dir, tmp_path):
    arch = json.loads((model_dir / "config.json").read_text())
    tiny = {
        **arch, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16,
    }  # fmt: skip
    (tmp_path / "draft.json").write_text(json.dumps(tiny))
    spec = {"model": str(tmp_path / "draft.json"), "num_speculative_tokens": 2}
    llm = LLM(
        str(model_dir), num_kv_blocks=64, speculative_config=spec, enable_lora=False,
        dtype="float32", device="cpu",
    )  # fmt: skip
    base = LLM(str(model_dir), num_kv_blocks=64, enable_lora=False, dtype="float32", device="cpu")
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    assert tokens(llm.generate(PROMPTS[:2], params)) == tokens(base.generate(PROMPTS[:2], params))
    assert llm.stats().spec_decoding.num_draft_tokens > 0
    _idle(llm)


def test_a_draft_of_another_vocabulary_is_refused(model_dir, tmp_path):
    arch = json.loads((model_dir / "config.json").read_text())
    (tmp_path / "draft.json").write_text(json.dumps({**arch, "vocab_size": 1000}))
    spec = {"model": str(tmp_path / "draft.json"), "num_speculative_tokens": 2}
    with pytest.raises(ValueError, match="vocabulary"):
        LLM(str(model_dir), speculative_config=spec, enable_lora=False, device="cpu")


def test_stop_string_inside_an_accepted_run(ngram, baseline):
    # "library" comes back in the copied text: the run that completes it is cut there
    params = SamplingParams(temperature=0.0, max_tokens=40, stop=["library"])
    expected = baseline.generate(PROMPTS[0], params)[0].outputs[0]
    out = ngram.generate(PROMPTS[0], params)[0].outputs[0]
    assert (out.text, out.token_ids, out.finish_reason) == (
        expected.text, expected.token_ids, expected.finish_reason,
    )  # fmt: skip
    assert out.stop_reason == "library"
    _idle(ngram)


def test_graphed_verification_gives_the_same_tokens(model_dir, mixed_batch, expected):
    """Verification replayed from graphs (on CPU their eager stand-ins, over the same padded
    persistent buffers): the mixed batch's seven rows run in the 8-row graph."""
    llm = LLM(str(model_dir), num_kv_blocks=128, speculative_config=NGRAM, max_num_seqs=8, **ENGINE)
    runner = llm.engine.runner
    assert runner.graphs is None  # CPU: eager unless graphs are installed
    graphs = runner.build_graph_runner()
    graphs.capture()
    assert graphs.verify_query_len == 4 and graphs.verify_sizes == [1, 2, 4, 8]
    runner.graphs = graphs
    replays: list[int | None] = []
    run_verify = graphs.run_verify

    def counted(batch):
        replays.append(graphs.verify_padded_size(batch))
        return run_verify(batch)

    graphs.run_verify = counted  # type: ignore[method-assign]
    prompts, params, loras = mixed_batch
    assert tokens(llm.generate(prompts, params, lora_request=loras)) == expected
    assert llm.stats().spec_decoding.num_accepted_tokens >= N  # drafts were accepted
    assert len(replays) >= 4 and 8 in replays
    _idle(llm)


@pytest.fixture(scope="module")
def ngram_async(model_dir) -> LLM:
    return LLM(
        str(model_dir), num_kv_blocks=128, speculative_config=NGRAM, async_scheduling=True,
        **ENGINE,
    )  # fmt: skip


def test_async_scheduling_keeps_a_verification_in_flight_and_the_same_tokens(
    ngram_async, baseline, mixed_batch, expected
):
    """Under async scheduling a speculative step reads the step before it first, yet stays in
    flight itself while its caller handles the step before's outputs: the same tokens, stop
    strings cut where they do without speculation, and the pool ends free."""
    engine = ngram_async.engine
    prompts, params, loras = mixed_batch
    in_flight_drafts = 0
    step = engine.step

    def counting_step():
        nonlocal in_flight_drafts
        out = step()
        in_flight = engine._in_flight
        in_flight_drafts += in_flight is not None and bool(
            in_flight[0].scheduled_spec_decode_tokens
        )
        return out

    engine.step = counting_step  # type: ignore[method-assign]
    try:
        assert tokens(ngram_async.generate(prompts, params, lora_request=loras)) == expected
    finally:
        del engine.step
    assert in_flight_drafts >= 3
    stop = SamplingParams(temperature=0.0, max_tokens=40, stop=["library"])
    want = baseline.generate(PROMPTS[0], stop)[0].outputs[0]
    out = ngram_async.generate(PROMPTS[0], stop)[0].outputs[0]
    assert (out.text, out.token_ids, out.stop_reason) == (want.text, want.token_ids, "library")
    _idle(ngram_async)


TINY = tiny_llama_config(head_dim=16, vocab_size=512, rope_theta=10000.0, hidden_act="silu",
                         max_position_embeddings=4096, bos_token_id=1, eos_token_id=2)  # fmt: skip


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_preemption_and_abort_roll_back_and_the_prefix_cache_stays_right(
    tmp_path, async_scheduling
):
    """A tiny random model (it loops, so prompt lookup gets accepted): ten requests of 32
    prompt tokens and 40 new (5 blocks each) in a pool of 30 blocks are preempted in the
    middle of speculative runs and recomputed; one is aborted midway. The others give the
    tokens of an engine without speculation, every block is free after, and the same prompts
    served from the prefix cache still give those tokens."""
    model = tmp_path / "tiny.json"
    model.write_text(json.dumps(TINY))
    options = dict(dtype="float32", device="cpu", enable_lora=False)
    base = LLM(str(model), num_kv_blocks=200, **options)
    spec = LLM(
        str(model), num_kv_blocks=30, speculative_config=NGRAM,
        async_scheduling=async_scheduling, **options,
    )  # fmt: skip
    prompts = [[100 + (i + 3 * j) % 20 for j in range(32)] for i in range(10)]
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    expected = tokens(base.generate(prompts, params))
    engine = spec.engine
    ids = [engine.add_request(None, p, params) for p in prompts]
    for _ in range(6):
        engine.step()
    engine.abort_request(ids[3])
    done = {o.request_id: o.outputs[0].token_ids for o in engine.generate_blocking(300)}
    assert spec.stats().num_preemptions > 0
    assert spec.stats().spec_decoding.num_accepted_tokens > 0
    assert [done[i] for i in ids if i != ids[3]] == [e for i, e in enumerate(expected) if i != 3]
    _idle(spec)
    hits = spec.stats().prefix_cache_hits
    assert tokens(spec.generate(prompts, params)) == expected
    assert spec.stats().prefix_cache_hits > hits
    _idle(spec)
