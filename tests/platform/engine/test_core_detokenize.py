"""The EngineCore process ships token ids; the API side (EngineCoreClient) detokenizes, matches
stop strings and stops the core's request. What a caller gets matches the in-process engine:
text, finish and stop reasons, token counts, streamed deltas, logprob texts."""

from __future__ import annotations

import asyncio
import dataclasses
import multiprocessing

import pytest

from loraplex import LLM, SamplingParams
from loraplex.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from loraplex.platform.core.sampling_params import RequestOutputKind
from loraplex.platform.engine.core_client import EngineCoreClient, default_address
from loraplex.platform.engine.core_process import run_engine_core
from tests.waiting import async_wait_until

PROMPT = "The capital of France is"
MAX_MODEL_LEN = 512


def _config(model_dir) -> EngineConfig:
    return EngineConfig(
        model=ModelConfig(
            model=str(model_dir), dtype="float32", max_model_len=MAX_MODEL_LEN, device="cpu"
        ),
        cache=CacheConfig(num_kv_blocks=256),
        # NOTE: async scheduling, as the core runs on a GPU: a Stop reaches the core while
        # the request's next step is already launched.
        scheduler=SchedulerConfig(max_num_seqs=16, async_scheduling=True),
    )


@pytest.fixture(scope="module")
def core_address(model_dir):
    address = default_address()
    process = multiprocessing.get_context("spawn").Process(
        target=run_engine_core, args=(_config(model_dir), address), daemon=True
    )
    process.start()
    yield address
    process.terminate()
    process.join(30)
    assert not process.is_alive()


@pytest.fixture(scope="module")
def local(model_dir) -> LLM:
    """The in-process engine on the same model, to compare against."""
    return LLM(
        str(model_dir), dtype="float32", device="cpu", max_model_len=MAX_MODEL_LEN,
        num_kv_blocks=256,
    )  # fmt: skip


def _run(address: str, calls) -> list:
    """Start `clients` EngineCoreClients on a fresh event loop and run `calls(clients)`."""

    async def main():
        clients = [EngineCoreClient(address, handshake_timeout_s=300) for _ in range(2)]
        for client in clients:
            client.start()
        try:
            return await calls(clients)
        finally:
            for client in clients:
                client.shutdown()

    return asyncio.run(main())


async def _collect(client, prompt, params, request_id):
    outputs = [o async for o in client.generate(prompt, params, request_id)]
    return outputs


def _boundary_stop(local: LLM) -> tuple[str, list[int], str]:
    """A stop string that starts inside one generated token and ends inside the next, and the
    greedy text and tokens without it."""
    out = local.generate([PROMPT], SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))
    sample = out[0].outputs[0]
    tok = local.engine.tokenizer
    pieces = [tok.decode([t]) for t in sample.token_ids]
    # the first pair of neighbouring tokens from the fourth on with two visible characters each
    for k in range(3, len(pieces) - 1):
        left, right = pieces[k].strip(), pieces[k + 1]
        if len(left) >= 2 and len(right.strip()) >= 2 and pieces[k].endswith(left[-2:]):
            return left[-2:] + right[:2], sample.token_ids, sample.text
    raise AssertionError(f"no two-character token pair in {pieces}")


@pytest.mark.parametrize("include", [False, True], ids=["cut", "included"])
def test_a_stop_string_across_tokens_ends_the_text_as_in_process(core_address, local, include):
    stop, _, _ = _boundary_stop(local)
    params = SamplingParams(
        max_tokens=24, temperature=0, ignore_eos=True, stop=(stop,),
        include_stop_str_in_output=include,
    )  # fmt: skip
    expected = local.generate([PROMPT], params)[0].outputs[0]
    assert expected.finish_reason == "stop" and expected.stop_reason == stop
    streamed = dataclasses.replace(params, output_kind=RequestOutputKind.DELTA)

    async def calls(clients):
        whole = await _collect(clients[0], PROMPT, params, "whole")
        deltas = await _collect(clients[1], PROMPT, streamed, "deltas")
        return whole, deltas

    whole, deltas = _run(core_address, calls)
    final = whole[-1].outputs[0]
    assert (final.text, final.token_ids) == (expected.text, expected.token_ids)
    assert (final.finish_reason, final.stop_reason) == ("stop", stop)
    chunks = [o.outputs[0].text for o in deltas if o.outputs]
    assert "".join(chunks) == expected.text
    assert [t for o in deltas for c in o.outputs for t in c.token_ids] == expected.token_ids
    if not include:  # no chunk ever showed a piece of the stop string that was cut
        assert all(stop not in c for c in chunks)
    assert deltas[-1].finished and deltas[-1].outputs[0].finish_reason == "stop"


def test_a_stop_string_stops_the_core_from_generating(core_address, local):
    stop, token_ids, _ = _boundary_stop(local)
    kept = next(
        n
        for n in range(1, len(token_ids) + 1)
        if stop in local.engine.tokenizer.decode(token_ids[:n])
    )
    params = SamplingParams(max_tokens=400, temperature=0, ignore_eos=True, stop=(stop,))

    async def calls(clients):
        client = clients[0]
        timings = []
        client.add_timing_observer(timings.append)
        await async_wait_until(
            lambda: client._snapshot is not None, 30, "the core's first snapshot"
        )
        before = client.snapshot().generation_tokens_total
        outputs = await _collect(client, PROMPT, params, "stopped")
        # the core's finish (after the Stop) reaches the observers; a later snapshot shows the
        # request's blocks back
        await async_wait_until(lambda: timings, 10, "the stopped request's timing")
        await async_wait_until(
            lambda: (s := client.snapshot().stats).num_free_blocks == s.num_total_blocks,
            10,
            "every KV block to be free again",
        )
        return outputs[-1], timings, client.snapshot(), before

    final, timings, snapshot, before = _run(core_address, calls)
    assert len(final.outputs[0].token_ids) == kept
    assert len(timings) == 1
    # the core ended it with the stop string after the kept tokens, not after max_tokens
    assert (timings[0].finish_reason, timings[0].num_generation_tokens) == ("stop", kept)
    assert snapshot.stats.num_running == 0
    assert snapshot.stats.num_free_blocks == snapshot.stats.num_total_blocks
    # a few tokens may run ahead of the Stop message, never the 400 asked for
    assert snapshot.generation_tokens_total - before < kept + 8


def test_two_api_clients_each_get_their_own_text_and_logprobs(core_address, local):
    stop, _, _ = _boundary_stop(local)
    prompts = [PROMPT, "Once upon a time", "def add(a, b):"]
    params = SamplingParams(
        max_tokens=16, temperature=0, ignore_eos=True, stop=(stop,), logprobs=2, n=2
    )
    expected = local.generate(prompts, params)

    async def calls(clients):
        jobs = [
            _collect(clients[i % 2], prompt, params, f"c{i}") for i, prompt in enumerate(prompts)
        ]
        return await asyncio.gather(*jobs)

    results = _run(core_address, calls)
    for outputs, want in zip(results, expected):
        got = outputs[-1]
        assert got.finished
        for sample, expected_sample in zip(got.outputs, want.outputs):
            assert sample.text == expected_sample.text
            assert sample.token_ids == expected_sample.token_ids
            assert sample.finish_reason == expected_sample.finish_reason
            # each token's logprobs: the same tokens, ranks and texts (decoded here)
            assert sample.logprobs is not None and expected_sample.logprobs is not None
            for got_lp, want_lp in zip(sample.logprobs, expected_sample.logprobs, strict=True):
                assert list(got_lp) == list(want_lp)
                for token_id, lp in got_lp.items():
                    want = want_lp[token_id]
                    assert (lp.rank, lp.decoded_token) == (want.rank, want.decoded_token)
                    assert lp.logprob == pytest.approx(want.logprob, abs=1e-4)
