"""Checkpoints as transformers 5.x writes them (`rope_parameters`, `dtype`) and as 4.x wrote them
(`rope_theta`, `rope_scaling`, `torch_dtype`): a tiny random model of each architecture, saved by
the installed transformers, served by loraplex, gives transformers' own greedy tokens in fp32;
the same weights under a hand-written 4.x config give the same tokens. The llama3 and yarn
models have a 64-position original context and prompts that run past it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from loraplex import LLM, SamplingParams
from loraplex.platform.models.arch_config import ArchConfig
from loraplex.platform.models.linear import Linear
from loraplex.quant.quantize import quantize_model

transformers = pytest.importorskip("transformers")

SIZES = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 300,
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-5,
    "initializer_range": 0.1,
}
# name -> (transformers config class, its extra arguments, in transformers 5's own terms)
MODELS = {
    "llama3": (
        "LlamaConfig",
        {
            "rope_parameters": {
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        },
    ),
    "llama2-attention-bias": (
        "LlamaConfig",
        {
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
            "attention_bias": True,
        },
    ),
    "smollm2": (
        "LlamaConfig",
        {
            "rope_parameters": {"rope_type": "default", "rope_theta": 100000.0},
            "tie_word_embeddings": True,
        },
    ),
    # a sliding window longer than every sequence here (served capped at 96 positions)
    "mistral": (
        "MistralConfig",
        {"rope_parameters": {"rope_type": "default", "rope_theta": 1e6}, "sliding_window": 96},
    ),
    "qwen2-yarn": (
        "Qwen2Config",
        {
            "rope_parameters": {
                "rope_type": "yarn",
                "rope_theta": 1e6,
                "factor": 4.0,
                "original_max_position_embeddings": 64,
            },
            "tie_word_embeddings": True,
        },
    ),
    "qwen3": (
        "Qwen3Config",
        {
            "rope_parameters": {"rope_type": "linear", "rope_theta": 1e6, "factor": 2.0},
            "head_dim": 32,
        },
    ),
}
PROMPTS = [[5, 17, 42, 99, 3, 250, 8], [(7 * i + 3) % 300 for i in range(70)]]
MAX_TOKENS = 16


def _save_transformers_model(name: str, folder: Path) -> transformers.PreTrainedModel:
    cls_name, extra = MODELS[name]
    config = getattr(transformers, cls_name)(**SIZES, **extra, dtype="float32")
    torch.manual_seed(sum(map(ord, name)))
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():  # biases and norms away from 0 and 1, so the test sees them
        for pname, param in model.named_parameters():
            if pname.endswith("bias") or "norm" in pname:
                param.normal_(1.0 if "norm" in pname else 0.0, 0.1)
    model.save_pretrained(folder)
    return model


def _as_4x_layout(config: dict) -> dict:
    """The same config as transformers 4.x wrote it."""
    old = {k: v for k, v in config.items() if k not in ("rope_parameters", "dtype")}
    rope = dict(config["rope_parameters"])
    old["rope_theta"] = rope.pop("rope_theta")
    old["rope_scaling"] = None if rope["rope_type"] == "default" else rope
    old["torch_dtype"] = config["dtype"]
    return old


def _greedy(model: str | Path | LLM) -> list[list[int]]:
    llm = model if isinstance(model, LLM) else _llm(model)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    return [out.outputs[0].token_ids for out in llm.generate(PROMPTS, params)]


def _llm(model: str | Path) -> LLM:
    return LLM(str(model), dtype="float32", device="cpu", num_kv_blocks=32, enable_lora=False)


def _hf_greedy(model: transformers.PreTrainedModel) -> list[list[int]]:
    outs = []
    for prompt in PROMPTS:
        with torch.no_grad():
            ref = model.generate(
                torch.tensor([prompt]),
                max_new_tokens=MAX_TOKENS,
                min_new_tokens=MAX_TOKENS,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )
        outs.append(ref[0, len(prompt) :].tolist())
    return outs


@pytest.mark.parametrize("name", sorted(MODELS))
def test_both_layouts_give_transformers_greedy_tokens(name: str, tmp_path: Path) -> None:
    new_dir, old_dir = tmp_path / "v5", tmp_path / "v4"
    hf = _save_transformers_model(name, new_dir)
    config = json.loads((new_dir / "config.json").read_text())
    # what transformers 5 writes: RoPE under rope_parameters, `dtype`, no top-level theta
    assert "rope_parameters" in config and "rope_theta" not in config, config
    assert config["dtype"] == "float32" and "torch_dtype" not in config
    old_dir.mkdir()
    (old_dir / "config.json").write_text(json.dumps(_as_4x_layout(config)))
    (old_dir / "model.safetensors").symlink_to(new_dir / "model.safetensors")
    assert ArchConfig.from_path(old_dir).rope == ArchConfig.from_path(new_dir).rope

    expected = _hf_greedy(hf)
    assert _greedy(new_dir) == expected, name
    assert _greedy(old_dir) == expected, name


@torch.no_grad()
def _dequantized_transformers_model(model: torch.nn.Module, config: dict):
    """transformers' model of `config` (its quantization dropped) holding the weights that
    our quantized `model` dequantizes to."""
    dense_config = {k: v for k, v in config.items() if k != "quantization_config"}
    hf = transformers.AutoModelForCausalLM.from_config(
        transformers.AutoConfig.for_model(**dense_config)
    ).eval()
    renames = {v: k for k, v in model.checkpoint_renames.items()}
    state: dict[str, torch.Tensor] = {}
    for path, module in model.named_modules():
        if isinstance(module, Linear):
            weight = module.method.dequantized_weight(module).float()  # [N, K], shards stacked
            offsets, base = module.shard_offsets(), path.rpartition(".")[0]
            for i, shard in enumerate(module.shard_names):
                state[f"model.{base}.{shard}.weight"] = weight[offsets[i] : offsets[i + 1]]
        elif not any(isinstance(parent, Linear) for parent in _parents(model, path)):
            for name, param in module.named_parameters(recurse=False):
                full = f"{path}.{name}" if path else name
                state[renames.get(full, f"model.{full}")] = param
    missing, unexpected = hf.load_state_dict(state, strict=False)
    assert not unexpected and all("rotary" in m for m in missing), (missing, unexpected)
    return hf


def _parents(model: torch.nn.Module, path: str) -> list[torch.nn.Module]:
    parts = path.split(".") if path else []
    return [model.get_submodule(".".join(parts[:i])) for i in range(1, len(parts))]


@pytest.mark.parametrize("options", [{"method": "awq"}, {"method": "gptq", "desc_act": True}])
def test_quantized_5x_checkpoint_equals_its_dequantized_reference(
    options: dict, tmp_path: Path
) -> None:
    dense = tmp_path / "dense"
    _save_transformers_model("llama3", dense)
    out = quantize_model(dense, tmp_path / "q", progress=False, group_size=32, **options)
    config = json.loads((out / "config.json").read_text())
    dense_config = json.loads((dense / "config.json").read_text())
    assert config["rope_parameters"] == dense_config["rope_parameters"]  # carried as written
    assert ArchConfig.from_path(out).rope == ArchConfig.from_path(dense).rope
    llm = _llm(out)
    reference = _dequantized_transformers_model(llm.engine.runner.model, config)
    assert _greedy(llm) == _hf_greedy(reference)
