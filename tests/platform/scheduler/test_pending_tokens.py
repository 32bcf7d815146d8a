"""The scheduler with a step in flight (async scheduling): pending tokens, and what may run ahead."""

from __future__ import annotations

from loraplex.config import CacheConfig, SchedulerConfig
from loraplex.platform.core.request import Request, RequestStatus
from loraplex.platform.core.sampling_params import SamplingParams
from loraplex.platform.core.scheduler_output import ModelRunnerOutput
from loraplex.platform.core.structured_outputs import StructuredOutputs
from loraplex.platform.scheduler.scheduler import Scheduler

EOS = 0


def _scheduler() -> Scheduler:
    return Scheduler(SchedulerConfig(), CacheConfig(block_size=4), num_blocks=32, max_model_len=64)


def _request(req_id: str, max_tokens: int, **params) -> Request:
    sampling = SamplingParams(temperature=0.0, max_tokens=max_tokens, **params)
    prompt = [ord(req_id) + i for i in range(6)]  # no shared prefix between requests
    return Request(req_id, prompt, sampling, (EOS,), max_tokens=max_tokens)


def _tokens(token: int, *req_ids: str) -> ModelRunnerOutput:
    return ModelRunnerOutput(sampled={r: token for r in req_ids})


def test_next_step_is_scheduled_before_the_last_token_is_known_and_stops_at_max_tokens():
    sched = _scheduler()
    request = _request("a", max_tokens=3)
    sched.add_request(request)
    first = sched.schedule()
    assert first.num_scheduled_tokens == {"a": 6}
    assert (request.num_computed_tokens, request.num_pending) == (6, 1)
    second = sched.schedule()  # before the first step's token is back: its input is pending
    assert second.num_scheduled_tokens == {"a": 1}
    assert (request.num_computed_tokens, request.num_pending) == (7, 2)
    assert sched.update_from_output(first, _tokens(42, "a"))[0].new_token_ids == [42]
    assert request.num_pending == 1
    third = sched.schedule()
    assert third.num_scheduled_tokens == {"a": 1}
    sched.update_from_output(second, _tokens(43, "a"))
    # Two tokens out, one pending: the third is the last, so nothing more is scheduled.
    assert sched.schedule().is_empty
    (last,) = sched.update_from_output(third, _tokens(44, "a"))
    assert last.finish_reason == "length"
    assert request.output_token_ids == [42, 43, 44]
    assert sched.kv.num_free_blocks == 32 and not sched.has_unfinished_requests()


def test_a_request_that_stops_drops_its_step_in_flight():
    sched = _scheduler()
    request = _request("a", max_tokens=10)
    sched.add_request(request)
    first = sched.schedule()
    second = sched.schedule()
    (out,) = sched.update_from_output(first, _tokens(EOS, "a"))
    assert out.finish_reason == "stop" and request.status == RequestStatus.FINISHED_STOPPED
    assert sched.update_from_output(second, _tokens(77, "a")) == []  # computed, thrown away
    assert request.output_token_ids == [EOS]
    assert sched.kv.num_free_blocks == 32
    assert "a" in sched.schedule().finished_req_ids  # the runner forgets it


def test_penalised_requests_run_ahead_like_any_other():
    # Penalties read occurrence counts kept on the device, so they need no token on the host.
    sched = _scheduler()
    sched.add_request(_request("a", 10))
    sched.add_request(_request("b", 10, repetition_penalty=1.2, presence_penalty=0.5))
    assert sched.num_lock_step == 0
    first = sched.schedule()
    assert first.num_scheduled_tokens == {"a": 6, "b": 6}
    assert sched.schedule().num_scheduled_tokens == {"a": 1, "b": 1}


def test_grammar_requests_wait_for_their_token_and_count_as_lock_step():
    sched = _scheduler()
    plain = _request("a", 10)
    constrained = _request("b", 10, structured_outputs=StructuredOutputs(choice=("yes", "no")))
    sched.add_request(plain)
    sched.add_request(constrained)
    assert sched.num_lock_step == 1
    first = sched.schedule()
    assert first.num_scheduled_tokens == {"a": 6, "b": 6}
    assert sched.schedule().num_scheduled_tokens == {"a": 1}  # b needs its token first
    sched.update_from_output(first, _tokens(42, "a", "b"))
    assert sched.schedule().num_scheduled_tokens == {"a": 1, "b": 1}
    sched.finish_requests(["b"], RequestStatus.FINISHED_ABORTED)
    assert sched.num_lock_step == 0
