"""InprocClient: the engine on its own thread, driven from asyncio."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import pytest
from engine_configs import cpu_engine_config

from loraplex import SamplingParams
from loraplex.config import CacheConfig, EngineConfig, ModelConfig
from loraplex.platform.core.errors import EngineDeadError, PromptTooLongError
from loraplex.platform.core.sampling_params import RequestOutputKind
from loraplex.platform.engine.inproc_client import InprocClient
from tests.waiting import wait_until

DELTA = RequestOutputKind.DELTA


@pytest.fixture(scope="module")
def engine(model_dir):
    engine = InprocClient(cpu_engine_config(model_dir, num_kv_blocks=128))
    timings = []
    engine.add_timing_observer(timings.append)
    engine.timings = timings
    engine.start()
    yield engine
    engine.shutdown()


def _wait_idle(engine: InprocClient) -> None:
    def idle() -> bool:
        stats = engine.snapshot().stats
        return stats.num_running == 0 and stats.num_free_blocks == stats.num_total_blocks

    wait_until(idle, 30, "the engine to go idle (nothing running, every KV block free)")


def test_concurrent_streams_match_the_offline_engine(engine, llm):
    prompts = ["The capital of France is", "def add(a, b):", "Roses are red,"]
    params = SamplingParams(max_tokens=6, temperature=0, output_kind=DELTA)

    async def one(prompt: str) -> str:
        return "".join([o.outputs[0].text async for o in engine.generate(prompt, params)])

    async def run() -> list[str]:
        return await asyncio.gather(*(one(p) for p in prompts))

    offline = llm.generate(prompts, SamplingParams(max_tokens=6, temperature=0))
    assert asyncio.run(run()) == [o.outputs[0].text for o in offline]
    timing = engine.timings[-1]
    assert timing.ttft_s is not None and timing.ttft_s <= timing.e2e_s
    assert len(timing.inter_token_s) == 5 and timing.finish_reason == "length"


def test_add_errors_surface_as_the_original_exception(engine):
    async def run() -> None:
        params = SamplingParams(max_tokens=300)
        async for _ in engine.generate("hello", params):
            pass

    with pytest.raises(PromptTooLongError) as error:
        asyncio.run(run())
    assert error.value.param == "max_tokens" and "256" in str(error.value)
    assert engine.is_running


def test_stopping_early_aborts_and_frees_blocks(engine):
    params = SamplingParams(max_tokens=200, ignore_eos=True, temperature=0, output_kind=DELTA)

    async def run() -> int:
        seen = 0
        async for _ in engine.generate("Count to a thousand:", params):
            seen += 1
            if seen == 2:
                break
        return seen

    assert asyncio.run(run()) == 2
    _wait_idle(engine)
    assert engine.timings[-1].finish_reason == "abort"


def test_a_shut_down_engine_refuses_requests(model_dir):
    engine = InprocClient(EngineConfig(model=ModelConfig(model=str(model_dir), device="cpu"),
                                      cache=CacheConfig(num_kv_blocks=16)))  # fmt: skip
    engine.start()
    engine.shutdown(timeout_s=120)  # NOTE: a loaded CI host can take more than the default 10 s
    assert not engine.is_running

    async def run() -> None:
        await engine.add_request("r", "hi", SamplingParams(max_tokens=2))

    with pytest.raises(EngineDeadError):
        asyncio.run(run())


def test_starting_prepares_structured_output(model_dir, monkeypatch):
    """A started server builds its grammar compiler at once, not on the first JSON request."""
    from loraplex.platform.engine.structured_output import StructuredOutputManager

    calls: list[StructuredOutputManager] = []
    monkeypatch.setattr(StructuredOutputManager, "prepare", lambda self: calls.append(self))
    engine = InprocClient(cpu_engine_config(model_dir, num_kv_blocks=32))
    try:
        assert calls == []
        engine.start()
        engine.start()  # idempotent: once
        assert calls == [engine.engine.structured]
    finally:
        engine.shutdown()
        engine.engine.shutdown()


def test_tenant_stats_count_each_tenants_sequences_and_blocks(engine):
    long = SamplingParams(max_tokens=200, ignore_eos=True, temperature=0, output_kind=DELTA)

    async def run():
        streams = [
            await engine.add_request("a-1", "Count to a thousand:", long, tenant="alpha"),
            await engine.add_request(
                "a-2", "Name every river:", replace(long, n=2), tenant="alpha"
            ),
            await engine.add_request("b-1", "Spell the alphabet:", long, tenant="beta"),
        ]
        try:
            for stream in streams:  # every request has its first token: all of them run
                await anext(stream)
            return await engine.tenant_stats()
        finally:
            for stream in streams:
                stream.abort()

    report = asyncio.run(run())
    stats = {t.tenant: t for t in report.tenants}
    assert set(stats) == {"alpha", "beta"}
    # a request of n samples counts n sequences
    assert (stats["alpha"].running_requests, stats["alpha"].waiting_requests) == (3, 0)
    assert (stats["beta"].running_requests, stats["beta"].waiting_requests) == (1, 0)
    assert stats["alpha"].kv_blocks > stats["beta"].kv_blocks > 0
    _wait_idle(engine)

    async def idle():
        return await engine.tenant_stats()

    assert asyncio.run(idle()).tenants == ()
