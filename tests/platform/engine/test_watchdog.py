"""The watchdog: a request that makes no progress for `request_stall_timeout_s` is ended with a
clear error and its resources freed, while requests that progress (however slowly) carry on."""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import Future

import pytest
from engine_configs import cpu_engine_config

from loraplex import SamplingParams, StructuredOutputs
from loraplex.config import SchedulerConfig
from loraplex.platform.api.errors import request_failed
from loraplex.platform.api.metrics.server_metrics import ServerMetrics
from loraplex.platform.core.errors import RequestStalledError
from loraplex.platform.engine.inproc_client import InprocClient
from loraplex.platform.engine.structured_output import GrammarJob
from tests.waiting import wait_until

TIMEOUT_S = 1.0


@pytest.fixture(scope="module")
def engine(model_dir):
    engine = InprocClient(
        cpu_engine_config(model_dir, num_kv_blocks=64, request_stall_timeout_s=TIMEOUT_S)
    )
    timings = []
    engine.add_timing_observer(timings.append)
    engine.timings = timings
    engine.start()
    yield engine
    engine.shutdown()


def test_a_stalled_request_is_ended_and_freed_while_others_progress(engine, monkeypatch):
    # A grammar whose compile never finishes: the request waits forever, making no progress.
    structured = engine.engine.structured
    monkeypatch.setattr(structured, "submit", lambda spec: GrammarJob(Future()))
    stuck = SamplingParams(max_tokens=8, structured_outputs=StructuredOutputs(choice=["a", "b"]))
    # Takes longer than the timeout on CPU, but makes progress every step.
    busy = SamplingParams(max_tokens=80, ignore_eos=True, temperature=0)

    async def last(prompt: str, params: SamplingParams):
        final = None
        async for output in engine.generate(prompt, params):
            final = output
        return final, time.monotonic()

    async def run():
        start = time.monotonic()
        results = await asyncio.gather(last("Pick:", stuck), last("Count to fifty:", busy))
        return start, results

    start, ((stalled, stalled_at), (finished, finished_at)) = asyncio.run(run())
    assert stalled.finished and stalled.outputs[0].finish_reason == "error"
    assert "no progress for 1 s" in stalled.error
    assert isinstance(stalled.failure, RequestStalledError)
    assert TIMEOUT_S <= stalled_at - start <= TIMEOUT_S + 5
    assert finished.error is None and finished.outputs[0].finish_reason == "length"
    assert len(finished.outputs[0].token_ids) == 80
    assert finished_at - start > TIMEOUT_S  # it outlived the timeout by making progress
    error = request_failed(stalled.error, stalled.failure)  # what the API answers
    assert (error.status, error.code) == (503, "request_stalled")

    wait_until(
        lambda: (s := engine.snapshot().stats).num_free_blocks == s.num_total_blocks,
        10,
        "every KV block to be free again",
    )
    snapshot = engine.snapshot()
    assert snapshot.stats.num_waiting == 0 and snapshot.stats.num_running == 0
    assert snapshot.watchdog_aborted_total == 1
    assert not engine.engine.scheduler.requests and not structured._waiting
    assert "error" in {t.finish_reason for t in engine.timings}
    metrics = ServerMetrics(engine.served_model_name).render(snapshot)
    assert 'loraplex:requests_watchdog_aborted_total{model_name="' in metrics
    assert metrics.split("loraplex:requests_watchdog_aborted_total{")[1].split()[1] == "1"


def test_a_bad_timeout_is_a_value_error():
    with pytest.raises(ValueError, match="request_stall_timeout_s"):
        SchedulerConfig(request_stall_timeout_s=-1)
    assert SchedulerConfig().request_stall_timeout_s == 600
