"""Adapters under churn, through engine commands, with async scheduling on: 40 adapters through
4 GPU slots while adapters are replaced and removed under their running requests, a slow
adapter read that delays no one else, and the statistics the dashboard reads."""

from __future__ import annotations

import json
import random
import threading
import time
from pathlib import Path

import pytest
from engine_lora_helpers import SlotRecorder
from random_adapters import add_command, write_adapter

from loraplex.adapters.adapter_names import key_from_digest
from loraplex.adapters.errors import AdapterNotFoundError
from loraplex.adapters.request import LoRARequest
from loraplex.config import (
    CacheConfig,
    EngineConfig,
    LoRAConfig,
    ModelConfig,
    SchedulerConfig,
)
from loraplex.platform.core.commands import (
    LOAD_LATENCY_BUCKETS_S,
    AdapterStatsReport,
    GetAdapterStats,
    PinAdapter,
    RemoveAdapter,
    SetTenantWeight,
)
from loraplex.platform.core.sampling_params import SamplingParams
from loraplex.platform.engine.engine import Engine

pytestmark = pytest.mark.slow

NUM_TOKENS = 4
GREEDY = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True)
PROMPTS = ["The capital of France is", "def add(a, b):", "Three colors:", "Once upon a time"]
TARGETS = [("q_proj", "v_proj"), ("o_proj", "down_proj"), ("q_proj", "k_proj", "up_proj"),
           ("v_proj", "gate_proj", "down_proj")]  # fmt: skip


@pytest.fixture(scope="module")
def engine(tiny_llama_dir) -> Engine:
    config = EngineConfig(
        model=ModelConfig(
            model=str(tiny_llama_dir), dtype="float32", max_model_len=128, device="cpu"
        ),
        cache=CacheConfig(num_kv_blocks=96),
        scheduler=SchedulerConfig(max_num_seqs=8, async_scheduling=True),
        lora=LoRAConfig(max_loras=4, max_lora_rank=8, max_cpu_loras=6),
    )
    engine = Engine(config)
    assert engine.async_scheduling
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def hf_config(tiny_llama_dir) -> dict:
    return json.loads((tiny_llama_dir / "config.json").read_text())


def _run_alone(engine: Engine, name: str, prompt: str) -> list[int]:
    request_id = f"alone-{name}-{prompt}"
    engine.add_request(request_id, prompt, GREEDY, lora_request=LoRARequest(name, "/unused"))
    (out,) = engine.generate_blocking(deadline_s=120)
    assert out.request_id == request_id and out.outputs[0].finish_reason == "length"
    return out.outputs[0].token_ids


def _wait_idle(engine: Engine) -> None:
    engine.generate_blocking(deadline_s=120)
    report = engine.handle_command(GetAdapterStats())
    assert report.gpu_slots_in_use == sum(a.pinned for a in report.adapters)


def test_forty_adapters_churn_through_four_slots(engine, hf_config, tmp_path, monkeypatch):
    rng = random.Random(7)
    folders: dict[str, Path] = {}  # adapter key -> its files
    live: dict[str, str] = {}  # registered name -> key

    def register(name: str, seed: int) -> None:
        folder = write_adapter(tmp_path / f"{name}-{seed}", hf_config, seed,
                               r=rng.choice([2, 4, 8]), targets=rng.choice(TARGETS))  # fmt: skip
        added = engine.handle_command(add_command(name, folder, tenant="t", label=name))
        folders[added.key] = folder
        live[name] = added.key

    for i in range(40):
        register(f"churn-{i}", seed=100 + i)
    recorder = SlotRecorder(engine, list(folders), monkeypatch)
    requests: dict[str, tuple[str, str]] = {}  # request id -> (key, prompt)
    changed_under: set[str] = set()  # requests whose adapter was replaced or removed meanwhile
    order = [f"churn-{i}" for i in range(40)]
    rng.shuffle(order)
    done: dict[str, list[int]] = {}
    steps = 0
    while order or engine.has_unfinished_requests():
        steps += 1
        assert steps < 2000, "the churn did not finish"
        for _ in range(rng.choice([0, 1, 1, 2, 3])):
            if order:
                name = order.pop()
                if name not in live:
                    continue
                request_id, prompt = f"r{len(requests)}", rng.choice(PROMPTS)
                engine.add_request(request_id, prompt, GREEDY,
                                   lora_request=LoRARequest(name, "/unused"))  # fmt: skip
                requests[request_id] = (live[name], prompt)
        running = {r.request_id: r for r in engine.scheduler.running if r.adapter_key}
        if running and steps % 5 == 0:
            victim_key = rng.choice(sorted(r.adapter_key for r in running.values()))
            name = next(n for n, k in live.items() if k == victim_key)
            changed_under |= {i for i, r in running.items() if r.adapter_key == victim_key}
            if steps % 10 == 0:
                assert engine.handle_command(RemoveAdapter(name))
                del live[name]
                with pytest.raises(AdapterNotFoundError, match="was removed"):
                    engine.add_request("refused", "Hi", GREEDY,
                                       lora_request=LoRARequest(name, "/unused"))  # fmt: skip
            else:
                register(name, seed=1000 + steps)  # a new version under the same name
                recorder._keys.append(live[name])
                order.append(name)  # one more request, on the new version
        for out in engine.step():
            if out.finished:
                assert out.error is None, out.error
                done[out.request_id] = out.outputs[0].token_ids

    assert set(done) == set(requests) and len(requests) >= 40
    assert changed_under, "no adapter was replaced or removed under a running request"
    wrong = [t for t in recorder.tokens if t.request_key and t.slot_key != t.request_key]
    assert not wrong, f"tokens ran on another adapter's weights: {wrong[:3]}"
    assert recorder.moved_while_running == []
    assert recorder.overwritten_in_use == [], "a slot was written under a running request"
    assert recorder.slot_writes >= 40
    assert engine.stats().lora.gpu_evictions >= 40 - 4
    monkeypatch.undo()

    for key, folder in folders.items():  # each version once more, under a name of its own
        engine.handle_command(add_command(f"ref-{key}", folder))
    alone = {}
    for request_id, (key, prompt) in requests.items():
        if (key, prompt) not in alone:
            alone[key, prompt] = _run_alone(engine, f"ref-{key}", prompt)
        assert done[request_id] == alone[key, prompt], request_id
    assert len({tuple(v) for v in alone.values()}) > len(alone) // 2  # adapters change text
    _wait_idle(engine)


def test_a_slow_adapter_read_delays_no_other_request(engine, hf_config, tmp_path, monkeypatch):
    fast = add_command("fast", write_adapter(tmp_path / "fast", hf_config, seed=1))
    slow = add_command("slow", write_adapter(tmp_path / "slow", hf_config, seed=2, r=8))
    engine.handle_command(fast)
    _run_alone(engine, "fast", PROMPTS[0])  # resident from now on
    pool = engine.lora_manager.pool
    read = pool._loader
    slow_key = key_from_digest(slow.digest)
    release = threading.Event()

    def slow_read(key):
        if key == slow_key:  # NOTE: the read lasts until the other requests have finished
            assert release.wait(120), "the slow read was never released"
        return read(key)

    monkeypatch.setattr(pool, "_loader", slow_read)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    engine.handle_command(slow)  # the read starts now, on the loader thread
    engine.add_request("on-slow", PROMPTS[1], params, lora_request=LoRARequest("slow", "/x"))
    read_started = time.monotonic()  # by now: at registration, or at the request's arrival
    engine.add_request("base", PROMPTS[2], params)
    engine.add_request("on-fast", PROMPTS[3], params, lora_request=LoRARequest("fast", "/x"))
    outputs: dict[str, list[int]] = {}
    deadline = time.monotonic() + 120
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = out.outputs[0].token_ids
        if {"base", "on-fast"} <= set(outputs) and not release.is_set():
            assert "on-slow" not in outputs and engine.scheduler.num_waiting == 1
            released_at = time.monotonic()
            release.set()
        assert time.monotonic() < deadline, f"only {sorted(outputs)} finished"
    assert len(outputs["base"]) == len(outputs["on-fast"]) == len(outputs["on-slow"]) == 8
    monkeypatch.undo()
    assert outputs["on-slow"][:NUM_TOKENS] == _run_alone(engine, "slow", PROMPTS[1])

    report: AdapterStatsReport = engine.handle_command(GetAdapterStats())
    stat = next(a for a in report.adapters if a.name == "slow")
    assert stat.residency == "gpu" and stat.disk_loads == 1 and stat.gpu_loads >= 1
    assert stat.load_latency_count >= 1
    assert stat.load_latency_sum_s >= released_at - read_started  # asked for -> slot written
    assert sum(stat.load_latency_buckets) == stat.load_latency_count
    assert len(stat.load_latency_buckets) == len(LOAD_LATENCY_BUCKETS_S)
    assert stat.last_used > 0 and stat.running_requests == 0 and not stat.loading
    _wait_idle(engine)


def test_pin_remove_and_tenant_weight_commands(engine, hf_config, tmp_path):
    engine.handle_command(add_command("kept", write_adapter(tmp_path / "k", hf_config, seed=3)))
    assert engine.handle_command(PinAdapter("kept")) is True
    assert engine.handle_command(PinAdapter("nobody")) is False
    names = [f"filler-{i}" for i in range(8)]
    for i, name in enumerate(names):  # more adapters than the three slots left
        engine.handle_command(add_command(name, write_adapter(tmp_path / name, hf_config, 50 + i)))
        _run_alone(engine, name, PROMPTS[0])
    report = engine.handle_command(GetAdapterStats())
    kept = next(a for a in report.adapters if a.name == "kept")
    assert kept.pinned and kept.residency == "gpu" and kept.evictions == 0
    assert (report.gpu_slots_used, report.gpu_slots_total) == (4, 4)
    assert report.cpu_cache_total == 6 and report.cpu_cache_used <= 6
    fillers = [a for a in report.adapters if a.name in names]
    assert all(a.disk_loads >= 1 for a in fillers)
    assert any(a.residency == "disk" for a in fillers)  # read, then evicted from both tiers
    with pytest.raises(ValueError, match="must stay for the other adapters"):
        for name in names[:3]:
            engine.handle_command(PinAdapter(name))
    for name in names[:3]:
        engine.handle_command(PinAdapter(name, pinned=False))
    assert engine.handle_command(PinAdapter("kept", pinned=False))
    assert engine.handle_command(RemoveAdapter("kept")) is True
    assert engine.handle_command(RemoveAdapter("kept")) is False
    report = engine.handle_command(GetAdapterStats())
    assert "kept" not in {a.name for a in report.adapters} and report.gpu_slots_in_use == 0
    engine.handle_command(SetTenantWeight("gold", 3.0))
    assert engine.scheduler.waiting.weights["gold"] == 3.0
    with pytest.raises(ValueError, match="positive"):
        SetTenantWeight("gold", -1.0)
