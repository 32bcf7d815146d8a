"""Tensor parallelism over gloo on CPU: the same greedy tokens with 2 and 4 ranks as with one
(fp32), for dense, AWQ, GPTQ (act-order) and FP8 random checkpoints; with 3 LoRA adapters mixed
in a batch, prefix caching, preemption and a grammar request; and head counts or group sizes a
size cannot split are refused with the count in the message."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from loraplex import LLM, SamplingParams, StructuredOutputs
from loraplex.adapters.request import LoRARequest
from tests.tiny_models import tiny_llama_config

# A Llama-3 shape at toy size: GQA (2 KV heads, so 4 ranks replicate them), K of 256 and 512
# in groups of 64 (whole groups on each of 4 ranks), a vocabulary 4 ranks split with padding.
QUANT_MODEL = tiny_llama_config(
    hidden_size=256, intermediate_size=512, num_hidden_layers=1, vocab_size=250
)
QUANT_CONFIGS: dict[str, dict[str, Any] | None] = {
    "dense": None,
    "awq": {"quant_method": "awq", "bits": 4, "group_size": 64, "zero_point": True,
            "version": "gemm"},
    "gptq-act-order": {"quant_method": "gptq", "bits": 4, "group_size": 64, "desc_act": True},
    "fp8-block": {"quant_method": "fp8", "activation_scheme": "dynamic",
                  "weight_block_size": [32, 32]},
    # NOTE: static activation scales: a dynamic per-token scale is taken over each rank's
    # slice of a row-parallel input (as in vLLM), which rounds differently from one rank.
    "fp8-channel": {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "config_groups": {"group_0": {
            "targets": ["Linear"],
            "weights": {"num_bits": 8, "type": "float", "strategy": "channel"},
            "input_activations": {"num_bits": 8, "type": "float", "dynamic": False,
                                  "strategy": "tensor"},
        }},
    },
}  # fmt: skip
PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9], [10, 11, 12, 13, 14, 15, 16, 200, 100, 50]]
# The tokenizer's vocabulary (SmolLM2's, for text and grammar requests) on a tiny model.
TEXT_MODEL = dict(
    QUANT_MODEL, hidden_size=64, intermediate_size=128, num_hidden_layers=2, vocab_size=49152
)
ADAPTER_SHAPE = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                 "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 49152}  # fmt: skip


def _llm(model: Path, tp: int, **options: Any) -> LLM:
    options = {"num_kv_blocks": 64, "max_num_seqs": 8, "enable_lora": False, **options}
    return LLM(str(model), device="cpu", dtype="float32", tensor_parallel_size=tp, **options)


def _greedy(llm: LLM, prompts: list, max_tokens: int = 8, **kwargs: Any) -> list[list[int]]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, **kwargs)]


@pytest.fixture(scope="module")
def quant_models(tmp_path_factory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("tp-quant")
    paths = {}
    for name, quant in QUANT_CONFIGS.items():
        config = dict(QUANT_MODEL, **({"quantization_config": quant} if quant else {}))
        paths[name] = folder / f"{name}.json"
        paths[name].write_text(json.dumps(config))
    return paths


@pytest.fixture(scope="module")
def one_rank_tokens(quant_models) -> dict[str, list[list[int]]]:
    tokens = {}
    for name, path in quant_models.items():
        llm = _llm(path, 1)
        tokens[name] = _greedy(llm, PROMPTS)
        llm.shutdown()
    return tokens


@pytest.mark.parametrize("tp", [2, 4])
def test_greedy_tokens_equal_one_rank_for_every_weight_format(quant_models, one_rank_tokens, tp):
    for name, path in quant_models.items():
        llm = _llm(path, tp)
        try:
            assert _greedy(llm, PROMPTS) == one_rank_tokens[name], name
        finally:
            llm.shutdown()


@pytest.fixture(scope="module")
def text_model(model_dir, tmp_path_factory) -> Path:
    """A tiny random model beside the embedded model's tokenizer."""
    folder = tmp_path_factory.mktemp("tp-text")
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (Path(model_dir) / name).is_file():
            shutil.copy(Path(model_dir) / name, folder / name)
    path = folder / "tiny.json"
    path.write_text(json.dumps(dict(TEXT_MODEL, eos_token_id=2)))
    return path


@pytest.fixture(scope="module")
def adapters(tmp_path_factory) -> list[LoRARequest]:
    from tests.adapters.lora_fixtures import make_peft_adapter

    folder = tmp_path_factory.mktemp("tp-adapters")
    requests = []
    for seed in (1, 2, 3):
        path = make_peft_adapter(folder / f"a{seed}", seed=seed, model_overrides=ADAPTER_SHAPE)
        requests.append(LoRARequest(f"a{seed}", str(path)))
    return requests


SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}
SHARED = "The quick brown fox jumps over the lazy dog. " * 4


def _scenario(text_model: Path, adapters: list[LoRARequest], tp: int) -> dict[str, Any]:
    """What a user sees of one engine: a batch mixing 3 adapters and the base model under too
    few KV blocks (preemption), a grammar request, and a prompt whose prefix is cached."""
    llm = _llm(text_model, tp, enable_lora=True, max_loras=4, max_lora_rank=8, num_kv_blocks=9,
               block_size=16)  # fmt: skip
    try:
        prompts = [f"Request {i}: tell me a story" for i in range(6)]
        loras = [adapters[0], adapters[1], None, adapters[2], adapters[0], None]
        mixed = _greedy(llm, prompts, max_tokens=24, lora_request=loras)
        preemptions = llm.stats().num_preemptions
        grammar = SamplingParams(
            max_tokens=24, temperature=0, structured_outputs=StructuredOutputs(json=SCHEMA)
        )
        # NOTE: compiled first, so no engine starts it under a cold-start grammar.
        llm.engine.structured.compiler.compile(grammar.structured_outputs, timeout=120)
        constrained = llm.generate(["A JSON name:"], grammar)[0].outputs[0]
        _greedy(llm, [SHARED + "first"])
        before = llm.stats().prefix_cache_hits
        cached = _greedy(llm, [SHARED + "second"], lora_request=[adapters[1]])
        _greedy(llm, [SHARED + "third"], lora_request=[adapters[1]])
        hits = llm.stats().prefix_cache_hits - before
        return {
            "mixed": mixed,
            "preemptions": preemptions,
            "grammar": (constrained.token_ids, constrained.text),
            "cached": cached,
            "hits": hits,
        }
    finally:
        llm.shutdown()


@pytest.fixture(scope="module")
def one_rank_scenario(text_model, adapters) -> dict[str, Any]:
    return _scenario(text_model, adapters, 1)


@pytest.mark.parametrize("tp", [2, 4])
def test_adapters_preemption_grammar_and_prefix_cache_behave_as_one_rank(
    text_model, adapters, one_rank_scenario, tp
):
    seen = _scenario(text_model, adapters, tp)
    assert one_rank_scenario["preemptions"] > 0  # the scenario does preempt
    assert one_rank_scenario["hits"] > 0  # and does hit the prefix cache
    assert seen["grammar"][1].replace(" ", "").startswith('{"name":"')  # the grammar holds
    assert seen == one_rank_scenario
    base = _greedy_base_only(text_model, tp)
    assert seen["mixed"][2] == base  # an adapter-free row of the mixed batch is the base model


def _greedy_base_only(text_model: Path, tp: int) -> list[int]:
    llm = _llm(text_model, tp)
    try:
        return _greedy(llm, ["Request 2: tell me a story"], max_tokens=24)[0]
    finally:
        llm.shutdown()


@pytest.mark.parametrize(
    ("overrides", "tp", "message"),
    [
        (
            {"hidden_size": 192, "num_attention_heads": 6, "num_key_value_heads": 6},
            4,
            "attention heads (6)",
        ),
        (
            {"hidden_size": 384, "num_attention_heads": 12, "num_key_value_heads": 3},
            4,
            "3 KV heads",
        ),
    ],
)
def test_sizes_that_do_not_divide_the_heads_are_refused(tmp_path, overrides, tp, message):
    path = tmp_path / "model.json"
    path.write_text(json.dumps(dict(QUANT_MODEL, **overrides)))
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        _llm(path, tp)


def test_a_size_that_splits_quantization_groups_is_refused(tmp_path):
    # o_proj's 256 inputs over 8 ranks are slices of 32, inside AWQ's groups of 64
    path = tmp_path / "awq.json"
    config = dict(QUANT_MODEL, num_attention_heads=8, num_key_value_heads=8,
                  quantization_config=QUANT_CONFIGS["awq"])  # fmt: skip
    path.write_text(json.dumps(config))
    with pytest.raises(ValueError, match="group"):
        _llm(path, 8)
