"""Multi-LoRA serving end to end: mixed batches equal HF PEFT per adapter, adapters never share
KV blocks, two slots serve six adapters without a token running on another request's adapter,
and broken adapters are refused while the engine keeps serving."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from engine_lora_helpers import (
    ADAPTER_SPECS,
    PeftReference,
    SlotRecorder,
    embed_tokens_tensors,
    lm_head_target,
    nan_weights,
    pickle_only,
    rank_over,
    rot_in_place,
    truncated,
    wrong_shape,
)
from lora_fixtures import registered_adapters

from loraplex import LLM, LoRARequest, RequestOutputKind, SamplingParams
from loraplex.adapters.errors import AdapterLoadError
from loraplex.adapters.peft_format import AdapterValidationError

pytestmark = pytest.mark.slow

NUM_TOKENS = 12
MAX_RANK = 64
GREEDY = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True)
LONG_PROMPT = (
    "Once upon a time, in a village at the edge of a great forest, there lived an old "
    "clockmaker who had never once been late for anything. One morning"
)
#: One prompt per adapter (the long one spans several KV blocks), and one for the base model.
PROMPTS = {
    None: "The capital of France is",
    "r4-qv": LONG_PROMPT,
    "r8-all": "def quicksort(xs):",
    "r16-o-gate-rslora": "Q: What is 17 * 3?\nA:",
    "r32-k-up-down": "List three primary colors:",
    "r2-v-down": "Write a haiku about the sea:",
    "r12-q-k-up": "The quick brown fox",
}
MIXED = ["r4-qv", "r8-all", "r16-o-gate-rslora", "r32-k-up-down"]


@pytest.fixture(scope="module")
def peft(model_dir, tmp_path_factory) -> PeftReference:
    return PeftReference(model_dir, tmp_path_factory.mktemp("peft-adapters"), NUM_TOKENS)


@pytest.fixture(scope="module")
def llm(model_dir) -> LLM:
    """Async scheduling on (the GPU default), so every PEFT comparison runs overlapped steps."""
    llm = LLM(str(model_dir), dtype="float32", device="cpu", num_kv_blocks=64, max_loras=8,
              max_lora_rank=MAX_RANK, max_cpu_loras=32, async_scheduling=True)  # fmt: skip
    assert llm.engine.async_scheduling
    return llm


def lora(peft: PeftReference, name: str) -> LoRARequest:
    return LoRARequest(name, str(peft.paths[name]))


def tokens(output) -> list[int]:
    return output.outputs[0].token_ids


def assert_idle(llm: LLM) -> None:
    stats = llm.stats()
    assert stats.num_running == stats.num_waiting == 0
    assert stats.num_free_blocks == stats.num_total_blocks
    assert stats.lora is not None and stats.lora.gpu_pinned == 0


def test_mixed_batch_of_base_and_four_adapters_equals_peft(llm, peft):
    # Each adapter's prompt also runs on the base model in the same batch, to show it changes
    # the output.
    names = [None, *MIXED, *([None] * len(MIXED))]
    prompts = [PROMPTS[None], *(PROMPTS[n] for n in MIXED), *(PROMPTS[n] for n in MIXED)]
    requests = [None if n is None else lora(peft, n) for n in names]
    outputs = llm.generate(prompts, GREEDY, lora_request=requests)

    assert tokens(outputs[0]) == peft.greedy(None, outputs[0].prompt_token_ids)
    for i, name in enumerate(MIXED, start=1):
        out, base = outputs[i], outputs[i + len(MIXED)]
        assert tokens(out) == peft.greedy(name, out.prompt_token_ids), name
        assert tokens(out) != tokens(base), f"{name} does not change the output"
    ranks = {ADAPTER_SPECS[n]["r"] for n in MIXED}
    assert ranks == {4, 8, 16, 32}
    assert llm.stats().lora.gpu_loads >= len(MIXED)
    assert_idle(llm)


def test_same_prompt_under_two_adapters_shares_no_kv_blocks(llm, peft):
    engine, kv = llm.engine, llm.engine.scheduler.kv
    kv.reset_prefix_cache()
    first, second = "r4-qv", "r8-all"
    params = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True,
                            output_kind=RequestOutputKind.FINAL_ONLY)  # fmt: skip
    for name in (first, second):
        engine.add_request(f"same-{name}", LONG_PROMPT, params, lora_request=lora(peft, name))
    engine.step()  # both prompts prefilled in one step
    requests = [engine.scheduler.requests[f"same-{n}"] for n in (first, second)]
    assert all(r.num_computed_tokens > 2 * kv.block_size for r in requests)
    held = [set(kv.block_ids(r.request_id)) for r in requests]
    hashes = [set(r.block_hashes) for r in requests]
    assert len(hashes[0]) >= 2 and not held[0] & held[1] and not hashes[0] & hashes[1]
    outputs = {o.request_id: o for o in engine.generate_blocking(deadline_s=600)}
    for name in (first, second):
        out = outputs[f"same-{name}"]
        assert out.num_cached_tokens == 0
        assert tokens(out) == peft.greedy(name, out.prompt_token_ids), name

    # Both finished and their blocks sit in the prefix cache: the same adapter hits them, the
    # base model and a third adapter do not.
    short = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    again = llm.generate(LONG_PROMPT, short, lora_request=lora(peft, first))[0]
    assert again.num_cached_tokens >= 2 * kv.block_size
    assert tokens(again) == peft.greedy(first, again.prompt_token_ids)[:2]
    for other in (None, lora(peft, "r16-o-gate-rslora")):
        assert llm.generate(LONG_PROMPT, short, lora_request=other)[0].num_cached_tokens == 0
    assert_idle(llm)


def test_two_slots_serve_six_adapters_each_token_on_its_own_adapter(model_dir, peft, monkeypatch):
    small = LLM(str(model_dir), dtype="float32", device="cpu", num_kv_blocks=64,
                max_loras=2, max_lora_rank=MAX_RANK, max_cpu_loras=32)  # fmt: skip
    names = list(ADAPTER_SPECS)
    assert len(names) == 6
    keys = [small.engine.lora_manager.adapter_key(lora(peft, n)) for n in names]
    recorder = SlotRecorder(small.engine, keys, monkeypatch)
    order = [names[i] for i in (0, 2, 4, 1, 3, 5)] * 2  # two requests per adapter, interleaved
    num_tokens = 8
    params = SamplingParams(temperature=0.0, max_tokens=num_tokens, ignore_eos=True)
    outputs = small.generate([PROMPTS[n] for n in order], params,
                             lora_request=[lora(peft, n) for n in order])  # fmt: skip

    for name, out in zip(order, outputs):
        assert tokens(out) == peft.greedy(name, out.prompt_token_ids)[:num_tokens], name
    assert recorder.tokens and {t.request_key for t in recorder.tokens} == set(keys)
    wrong = [t for t in recorder.tokens if t.slot < 0 or t.slot_key != t.request_key]
    assert not wrong, f"tokens ran on another adapter's slot: {wrong[:3]}"
    assert max(len({t.slot_key for t in recorder.tokens if t.step == s})
               for s in {t.step for t in recorder.tokens}) <= 2  # fmt: skip
    assert recorder.moved_while_running == [] and recorder.unpinned_in_batch == []
    stats = small.stats()
    assert stats.lora.gpu_evictions >= len(names) - 2
    assert recorder.acquisitions == len(order)
    assert_idle(small)


class _LoRACalls:
    """Counts calls of the LoRA entry (`add_lora`) from every LoRA hook of the model."""

    def __init__(self, monkeypatch) -> None:
        from loraplex.kernels.lora import add_lora

        self.count = 0

        def counted(*args, **kwargs) -> None:
            self.count += 1
            add_lora(*args, **kwargs)

        for module in ("lora_layer", "vocab_lora"):
            monkeypatch.setattr(f"loraplex.adapters.{module}.add_lora", counted)


def _count_replays(graphs: dict, replays: list[int]) -> None:
    for bs, graph in graphs.items():
        run = graph.replay

        def counted(run=run, bs=bs) -> None:
            replays.append(bs)
            run()

        graph.replay = counted


def test_base_requests_on_a_lora_engine_run_no_lora_work(model_dir, peft, monkeypatch):
    """A LoRA-enabled engine serving only base-model requests runs the base path: eager steps
    and decode graphs (their CPU stand-ins) make no LoRA call, the graphs captured without LoRA
    kernels replay, and the tokens are the LoRA-less engine's. A request on an adapter in the
    batch brings the LoRA work (and the graphs with it) back, with PEFT's tokens."""
    params = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True)
    prompts = [PROMPTS[None], LONG_PROMPT, PROMPTS["r8-all"]]
    plain = LLM(str(model_dir), dtype="float32", device="cpu", num_kv_blocks=64,
                enable_lora=False)  # fmt: skip
    expected = [tokens(o) for o in plain.generate(prompts, params)]
    small = LLM(str(model_dir), dtype="float32", device="cpu", num_kv_blocks=64, max_num_seqs=4,
                max_loras=2, max_lora_rank=MAX_RANK, async_scheduling=True)  # fmt: skip
    calls = _LoRACalls(monkeypatch)
    assert [tokens(o) for o in small.generate(prompts, params)] == expected  # eager
    assert calls.count == 0

    runner = small.engine.runner
    graphs = runner.build_graph_runner()
    graphs.capture()
    assert set(graphs.base_graphs) == set(graphs.graphs) == {1, 2, 4}
    runner.graphs = graphs
    lora_replays: list[int] = []
    base_replays: list[int] = []
    _count_replays(graphs.graphs, lora_replays)
    _count_replays(graphs.base_graphs, base_replays)
    calls.count = 0
    assert [tokens(o) for o in small.generate(prompts, params)] == expected
    assert calls.count == 0 and lora_replays == [] and len(base_replays) >= NUM_TOKENS - 1

    requests = [None, None, lora(peft, "r8-all")]
    outputs = small.generate(prompts, params, lora_request=requests)
    assert [tokens(o) for o in outputs[:2]] == expected[:2]
    assert tokens(outputs[2]) == peft.greedy("r8-all", outputs[2].prompt_token_ids)
    assert calls.count > 0 and len(lora_replays) >= NUM_TOKENS - 1
    assert_idle(small)


BAD_ADAPTERS = {
    "pickle": (pickle_only, r"\[.adapter_model.bin.\] are pickle checkpoints and are refused"),
    "truncated": (truncated, r"unreadable safetensors file \(truncated or corrupt\)"),
    "wrong-shape": (wrong_shape, r"has lora_A \(\d+, \d+\) .* expected"),
    "lm-head": (lm_head_target, r"lm_head has lora_A \(\d+, \d+\) and lora_B \(\d+, \d+\)"),
    "embed-tokens": (embed_tokens_tensors, r"embed_tokens has LoRA weights, but"),
    "rank-over-max": (rank_over(MAX_RANK), rf"rank {MAX_RANK + 16}, over max_lora_rank={MAX_RANK}"),
    "nan": (nan_weights, r"lora_B holds NaN"),
}


@pytest.mark.parametrize("kind", list(BAD_ADAPTERS))
def test_bad_adapter_is_refused_and_leaves_nothing_behind(llm, peft, tmp_path, kind):
    make, message = BAD_ADAPTERS[kind]
    folder = make(peft.paths["r8-all"], tmp_path / kind)
    registered = registered_adapters(llm.engine.lora_manager)
    with pytest.raises(AdapterValidationError, match=message) as refused:
        llm.generate(PROMPTS[None], GREEDY, lora_request=LoRARequest(f"bad-{kind}", str(folder)))
    assert isinstance(refused.value, ValueError) and str(folder) in str(refused.value)
    assert registered_adapters(llm.engine.lora_manager) == registered
    assert_idle(llm)


def test_engine_serves_normally_after_a_refused_adapter(llm, peft, tmp_path):
    bad = LoRARequest("bad-in-batch", str(nan_weights(peft.paths["r4-qv"], tmp_path / "nan")))
    with pytest.raises(AdapterValidationError, match="NaN"):
        llm.generate([PROMPTS[None], PROMPTS["r4-qv"]], GREEDY, lora_request=[None, bad])
    assert_idle(llm)  # the good request queued before the bad one was withdrawn
    outputs = llm.generate([PROMPTS[None], PROMPTS["r8-all"]], GREEDY,
                           lora_request=[None, lora(peft, "r8-all")])  # fmt: skip
    assert tokens(outputs[0]) == peft.greedy(None, outputs[0].prompt_token_ids)
    assert tokens(outputs[1]) == peft.greedy("r8-all", outputs[1].prompt_token_ids)
    assert_idle(llm)


def test_an_adapter_failing_to_load_ends_only_its_own_requests(llm, peft, tmp_path):
    engine = llm.engine
    rotten = LoRARequest("rots", str(_copy_of(peft, "r8-all", tmp_path)))
    key = engine.lora_manager.adapter_key(rotten)  # registered and validated while sound
    engine.lora_manager.pool.forget(key)  # evicted from the caches...
    rot_in_place(Path(rotten.lora_path))  # ...and the files rot, unseen by the fingerprint
    good = {"base": None, "r4-qv": lora(peft, "r4-qv")}
    for name, request in good.items():
        engine.add_request(name, PROMPTS[None if request is None else name], GREEDY,
                           lora_request=request)  # fmt: skip
    engine.add_request("rotten", PROMPTS[None], SamplingParams(max_tokens=4, n=2),
                       lora_request=rotten)  # fmt: skip
    outputs = {o.request_id: o for o in engine.generate_blocking(deadline_s=300)}
    failed = outputs["rotten"]
    assert failed.error is not None and "failed to load" in failed.error and "NaN" in failed.error
    assert [c.finish_reason for c in failed.outputs] == ["error", "error"]
    for name, request in good.items():
        assert outputs[name].error is None
        assert tokens(outputs[name]) == peft.greedy(
            None if request is None else name, outputs[name].prompt_token_ids
        )
    assert_idle(llm)
    with pytest.raises(AdapterLoadError, match="failed to load"):
        engine.add_request("again", PROMPTS[None], GREEDY, lora_request=rotten)
    assert_idle(llm)


def _copy_of(peft: PeftReference, name: str, tmp_path: Path) -> Path:
    return Path(shutil.copytree(peft.paths[name], tmp_path / name))
