"""The warm-up burst a server runs before it reports ready: it fills the batch with requests
of every sampling mix and uneven prompts (one longer than a step), never more than half the KV
cache, and leaves the engine as it found it: nothing running, nothing cached, counters at zero,
and the same outputs as an engine that never warmed up."""

from __future__ import annotations

import pytest
from engine_configs import cpu_engine_config

from loraplex.platform.core.sampling_params import SamplingParams
from loraplex.platform.engine.engine import Engine
from loraplex.platform.engine.warm_up import (
    SAMPLING_MIXES,
    should_warm_up,
    warm_up,
    warm_up_burst,
)


def test_the_burst_fills_the_batch_within_half_the_cache():
    burst = warm_up_burst(64, 512, 1024, 64 * 16 * 16, 49152)
    assert len(burst.prompts) == 64
    assert max(len(p) for p in burst.prompts) > 512  # one prompt prefills over several steps
    assert len({len(p) % 16 for p in burst.prompts}) == 16  # token counts of every residue
    assert sum(len(p) for p in burst.prompts) >= 2 * 512  # several full prefill steps
    assert all(100 <= t < 49152 - 100 for p in burst.prompts for t in p)
    shared = [p for p in burst.prompts[1:] if len(p) > 16 and p[:16] == burst.prompts[0][:16]]
    assert len(shared) >= 2  # prefills over a cached block
    for mix in SAMPLING_MIXES:  # every sampling mix is in the batch
        assert any(all(getattr(p, k) == v for k, v in mix.items()) for p in burst.params)
    assert burst.num_tokens <= 64 * 16 * 16 // 2
    small = warm_up_burst(64, 512, 1024, 40 * 16, 49152)  # a small cache: fewer requests
    assert 0 < len(small.prompts) < 64 and small.num_tokens <= 40 * 16 // 2


def test_on_by_default_on_cuda_only(monkeypatch):
    monkeypatch.delenv("LORAPLEX_WARM_UP", raising=False)
    assert should_warm_up("cuda") and not should_warm_up("cpu")
    monkeypatch.setenv("LORAPLEX_WARM_UP", "1")
    assert should_warm_up("cpu")
    monkeypatch.setenv("LORAPLEX_WARM_UP", "0")
    assert not should_warm_up("cuda")
    monkeypatch.setenv("LORAPLEX_WARM_UP", "yes")
    with pytest.raises(ValueError):
        should_warm_up("cuda")


def test_a_warm_engine_is_left_as_a_cold_one_serves(tiny_llama_dir):
    def engine() -> Engine:
        config = cpu_engine_config(tiny_llama_dir, num_kv_blocks=256, max_model_len=512,
                                   max_num_seqs=16, max_num_batched_tokens=128)  # fmt: skip
        return Engine(config)

    warm, cold = engine(), engine()
    try:
        assert warm_up(warm) > 0
        assert not warm.has_unfinished_requests()
        stats = warm.stats()
        assert stats.num_free_blocks == stats.num_total_blocks
        assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (0, 0)
        assert (warm.prompt_tokens_total, warm.generation_tokens_total) == (0, 0)
        assert not warm.scheduler.kv.pool._cached  # nothing of the burst is reused
        params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
        prompt = [101, 2000, 3000, 4000, 5000]
        for e in (warm, cold):
            e.add_request("r", prompt, params)
        outputs = [e.generate_blocking()[0].outputs[0].token_ids for e in (warm, cold)]
        assert outputs[0] == outputs[1]
    finally:
        warm.shutdown()
        cold.shutdown()
