"""Chunked prefill shares the step: a long prompt never keeps waiting or decoding requests out."""

from __future__ import annotations

import pytest

from loraplex.config import CacheConfig, SchedulerConfig
from loraplex.platform.core.request import Request
from loraplex.platform.core.sampling_params import SamplingParams
from loraplex.platform.core.scheduler_output import ModelRunnerOutput
from loraplex.platform.scheduler.scheduler import Scheduler

BUDGET = 64


def _scheduler(**config) -> Scheduler:
    return Scheduler(
        SchedulerConfig(max_num_batched_tokens=BUDGET, **config),
        CacheConfig(block_size=16),
        num_blocks=1024,
        max_model_len=4096,
    )


def _request(req_id: str, prompt_len: int, max_tokens: int = 1, tenant: str = "t") -> Request:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    base = 1000 * (1 + sum(map(ord, req_id)))  # no shared prefix between requests
    prompt = [base + i for i in range(prompt_len)]
    return Request(req_id, prompt, params, (0,), max_tokens=max_tokens, tenant=tenant)


def test_a_long_prompt_alone_takes_the_whole_budget():
    sched = _scheduler()
    sched.add_request(_request("long", 2000))
    assert sched.schedule().num_scheduled_tokens == {"long": BUDGET}
    assert sched.schedule().num_scheduled_tokens == {"long": BUDGET}


def test_a_waiting_request_gets_its_first_chunk_in_the_next_step():
    sched = _scheduler()
    sched.add_request(_request("long", 2000))
    sched.schedule()
    sched.add_request(_request("short", 10))
    step = sched.schedule().num_scheduled_tokens
    assert step["short"] == 10  # its whole prompt: it samples this step
    # The cap (a quarter of the budget) shares the step; the long prompt then takes what the
    # short one left, so no budget idles.
    assert step["long"] == BUDGET - 10


def test_many_long_prefills_still_leave_room_to_admit():
    sched = _scheduler(max_num_seqs=16)
    for i in range(6):
        sched.add_request(_request(f"long{i}", 3000))
    for _ in range(3):
        sched.schedule()
    assert sched.num_running == 6
    sched.add_request(_request("late", 12))
    step = sched.schedule().num_scheduled_tokens
    assert step["late"] == 12
    assert sum(step.values()) <= BUDGET


def test_decoding_requests_behind_a_prompt_chunk_keep_getting_tokens():
    sched = _scheduler(long_prefill_token_threshold=BUDGET)  # the cap alone would not do it
    for i in range(3):
        sched.add_request(_request(f"d{i}", 4, max_tokens=50))
    first = sched.schedule()
    sched.update_from_output(first, ModelRunnerOutput(sampled={f"d{i}": 7 for i in range(3)}))
    # A long prompt admitted ahead of them in the running list, by preemption order.
    long = _request("long", 2000)
    sched.add_request(long)
    sched.schedule()
    sched.running.remove(long)
    sched.running.insert(0, long)
    step = sched.schedule().num_scheduled_tokens
    assert all(step[f"d{i}"] == 1 for i in range(3))
    assert step["long"] == BUDGET - 3


def test_a_threshold_of_zero_restores_first_come_first_served():
    sched = _scheduler(long_prefill_token_threshold=0)
    sched.add_request(_request("long", 2000))
    sched.schedule()
    sched.add_request(_request("short", 10))
    assert sched.schedule().num_scheduled_tokens == {"long": BUDGET}


def test_a_bad_threshold_is_a_value_error():
    with pytest.raises(ValueError, match="long_prefill_token_threshold"):
        SchedulerConfig(long_prefill_token_threshold=-1)
    assert SchedulerConfig(max_num_batched_tokens=100).prefill_chunk_cap == 25
    assert SchedulerConfig(enable_chunked_prefill=False).prefill_chunk_cap == 0


def test_serve_options_reach_the_scheduler_config():
    from loraplex.cli import build_parser
    from loraplex.entrypoints.serve_cli import engine_config, resolve_options

    argv = ["serve", "--long-prefill-token-threshold", "100", "--request-stall-timeout-s", "5"]
    config = engine_config(resolve_options(build_parser().parse_args(argv))).scheduler
    assert (config.long_prefill_token_threshold, config.request_stall_timeout_s) == (100, 5.0)
    defaults = engine_config(resolve_options(build_parser().parse_args(["serve"]))).scheduler
    assert defaults.prefill_chunk_cap == 512 and defaults.request_stall_timeout_s == 600


def test_no_budget_is_held_back_when_no_sequence_slot_is_free():
    sched = _scheduler(max_num_seqs=1)
    sched.add_request(_request("long", 2000))
    sched.schedule()
    sched.add_request(_request("short", 10))  # cannot be admitted: the batch is full
    assert sched.schedule().num_scheduled_tokens == {"long": BUDGET}
