"""Speculative-decoding counters: vLLM's `spec_decode_*` names under our prefix, carried from
the engine core to the API process in the snapshot."""

from __future__ import annotations

from loraplex.platform.api.metrics.server_metrics import ServerMetrics
from loraplex.platform.core.spec_stats import SpecDecodingStats
from loraplex.platform.core.stats import EngineSnapshot, EngineStats
from loraplex.platform.engine.ipc import Codec, CoreBatch


def _snapshot(spec: SpecDecodingStats | None) -> EngineSnapshot:
    stats = EngineStats(1, 0, 10, 20, 0.5, 0, 0, 0, spec_decoding=spec)
    return EngineSnapshot(stats, prompt_tokens_total=5, generation_tokens_total=9)


def test_counters_render_with_vllm_names_and_survive_the_core_to_api_codec():
    spec = SpecDecodingStats()
    spec.observe(3, 2)
    spec.observe(4, 0)
    spec.observe(2, 2)
    assert (spec.acceptance_rate, spec.mean_acceptance_length) == (4 / 9, 1 + 4 / 3)
    codec = Codec()
    batch = codec.decode_core(codec.encode(CoreBatch(snapshot=_snapshot(spec))))
    assert batch.snapshot.stats.spec_decoding == spec
    text = ServerMetrics("m").render(batch.snapshot)
    label = '{model_name="m"}'
    assert f"loraplex:spec_decode_num_drafts_total{label} 3" in text
    assert f"loraplex:spec_decode_num_draft_tokens_total{label} 9" in text
    assert f"loraplex:spec_decode_num_accepted_tokens_total{label} 4" in text
    per_pos = "loraplex:spec_decode_num_accepted_tokens_per_pos_total"
    assert f'{per_pos}{{model_name="m",position="0"}} 2' in text
    assert f'{per_pos}{{model_name="m",position="1"}} 2' in text
    assert f'{per_pos}{{model_name="m",position="3"}} 0' in text


def test_no_speculation_no_series():
    assert "spec_decode" not in ServerMetrics("m").render(_snapshot(None))
