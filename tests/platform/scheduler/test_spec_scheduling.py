"""The scheduler's side of speculative decoding: drafts scheduled within limits, rejected
drafts' K/V rolled back, stop conditions inside an accepted run, prefix hashes over accepted
tokens only."""

from __future__ import annotations

from loraplex.config import CacheConfig, SchedulerConfig
from loraplex.platform.core.request import Request, RequestStatus
from loraplex.platform.core.sampling_params import SamplingParams
from loraplex.platform.core.scheduler_output import ModelRunnerOutput
from loraplex.platform.scheduler.scheduler import Scheduler

EOS = 0
PROMPT = [10, 11, 12, 13, 14, 15]


def _setup(max_tokens: int = 20, num_blocks: int = 32, **config):
    sched = Scheduler(
        SchedulerConfig(**config), CacheConfig(block_size=4), num_blocks, max_model_len=64
    )
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    request = Request("a", list(PROMPT), params, (EOS,), max_tokens=max_tokens)
    sched.add_request(request)
    first = sched.schedule()  # the prompt
    sched.update_from_output(first, ModelRunnerOutput(sampled={"a": 20}))
    return sched, request


def _step(sched, request, drafts, emitted):
    request.spec_token_ids = list(drafts)
    so = sched.schedule()
    out = ModelRunnerOutput(
        sampled={"a": emitted[0]}, extra_token_ids={"a": emitted[1:]} if emitted[1:] else {}
    )
    return so, sched.update_from_output(so, out)


def test_drafts_are_verified_in_one_step_and_rejected_ones_rolled_back():
    sched, request = _setup()
    so, outs = _step(sched, request, [21, 22, 23], [21, 22, 99])  # 2 accepted, 1 recovered
    assert so.num_scheduled_tokens == {"a": 4}
    assert so.scheduled_spec_decode_tokens == {"a": [21, 22, 23]}
    assert outs[0].new_token_ids == [21, 22, 99]
    assert request.output_token_ids == [20, 21, 22, 99]
    # computed: the prompt, 20, 21, 22 (the rejected draft 23's slot is recomputed as 99)
    assert request.num_computed_tokens == len(PROMPT) + 3 == request.num_tokens - 1
    assert request.num_pending == 0
    stats = sched.spec_stats
    assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens) == (1, 3, 2)
    assert stats.num_accepted_tokens_per_pos == [1, 1, 0]
    so, _ = _step(sched, request, [], [50])  # a plain step after: one token, no drafts
    assert so.num_scheduled_tokens == {"a": 1} and not so.scheduled_spec_decode_tokens


def test_prefix_hashes_cover_accepted_tokens_only():
    sched, request = _setup()
    _step(sched, request, [21, 22, 23], [77, 78][:1])  # all rejected: emits 77
    # known tokens: 6 prompt + 20, 77 = 8 -> two full blocks of 4, hashed over those tokens
    known = request.all_token_ids
    assert known == [*PROMPT, 20, 77]
    assert len(request.block_hashes) <= 2
    _step(sched, request, [], [30])
    sched.finish_requests(["a"], RequestStatus.FINISHED_ABORTED)
    # a new request with the same known prefix hits the blocks that hold it, not the drafts
    again = Request("b", [*PROMPT, 20, 77, 30], SamplingParams(max_tokens=4), (EOS,), max_tokens=4)
    blocks, hit = sched.kv.get_computed_blocks(again)
    assert hit == 8  # [10..15, 20, 77]: computed as accepted tokens, never from drafts
    assert sched.kv.num_free_blocks == sched.kv.num_blocks


def test_eos_inside_an_accepted_run_ends_it_there():
    sched, request = _setup()
    _, outs = _step(sched, request, [21, EOS, 23], [21, EOS, 23, 24])
    assert outs[0].new_token_ids == [21, EOS]
    assert outs[0].finish_reason == "stop"
    assert request.output_token_ids == [20, 21, EOS]
    assert sched.kv.num_free_blocks == sched.kv.num_blocks
    assert not sched.running


def test_drafts_fit_max_tokens_and_the_step_budget():
    sched, request = _setup(max_tokens=3)
    so, outs = _step(sched, request, [21, 22, 23, 24], [21, 22])
    # one token out, 3 allowed: the step may emit 2, so one draft
    assert so.scheduled_spec_decode_tokens == {"a": [21]}
    assert outs[0].new_token_ids == [21, 22] and outs[0].finish_reason == "length"
    sched, request = _setup(max_num_batched_tokens=6, long_prefill_token_threshold=0)
    so, _ = _step(sched, request, [21, 22, 23, 24, 25, 26], [21])
    assert so.scheduled_spec_decode_tokens == {"a": [21, 22, 23, 24, 25]}


def test_drafts_never_preempt_and_are_dropped_when_blocks_run_out():
    sched, request = _setup(num_blocks=2)  # 8 slots: the prompt and its token fill 7
    so, outs = _step(sched, request, [21, 22, 23], [21])
    assert so.num_scheduled_tokens == {"a": 1} and not so.scheduled_spec_decode_tokens
    assert outs[0].new_token_ids == [21] and sched.num_preemptions == 0


def test_preemption_clears_drafts():
    sched, request = _setup()
    request.spec_token_ids = [1, 2]
    sched._preempt(request)
    assert request.spec_token_ids == [] and request.num_computed_tokens == 0
    assert sched.kv.num_free_blocks == sched.kv.num_blocks
