"""Every registered architecture gives HF transformers' greedy tokens on the same random weights
(tiny configs, fp32): Llama 3 with llama3 rope scaling and GQA, Mistral, Qwen2 with qkv bias,
Qwen3 with q/k norms, tied and untied embeddings."""

from __future__ import annotations

import json

import pytest
import torch

from loraplex import LLM, SamplingParams
from loraplex.platform.models.dummy_weights import hf_state_dict
from tests.tiny_models import tiny_llama_config

transformers = pytest.importorskip("transformers")

BASE = tiny_llama_config(hidden_act="silu")  # each architecture sets its own type and ties
CONFIGS = {
    "llama3": {
        **BASE,
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "rope_theta": 500000.0,
        "tie_word_embeddings": False,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32,
        },
    },
    "mistral": {
        **BASE,
        "architectures": ["MistralForCausalLM"],
        "model_type": "mistral",
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
    },
    "qwen2": {
        **BASE,
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "rope_theta": 1000000.0,
        "tie_word_embeddings": True,
    },
    "qwen3": {
        **BASE,
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "head_dim": 32,
        "rope_theta": 1000000.0,
        "tie_word_embeddings": True,
    },
}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_random_weights_match_hf(name, tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(CONFIGS[name]))
    llm = LLM(str(path), dtype="float32", device="cpu", num_kv_blocks=64, seed=3, enable_lora=False)
    model = llm.engine.runner.model
    # Give the biases and norms non-trivial values, so the test sees them.
    for pname, param in model.named_parameters():
        if pname.endswith("bias") or "norm" in pname:
            param.data.normal_(1.0 if "norm" in pname else 0.0, 0.1)
    config = transformers.AutoConfig.for_model(**CONFIGS[name])
    hf = transformers.AutoModelForCausalLM.from_config(config).eval()
    missing, unexpected = hf.load_state_dict(hf_state_dict(model), strict=False)
    tied = CONFIGS[name]["tie_word_embeddings"]
    assert not unexpected
    assert all("rotary" in m or (tied and m == "lm_head.weight") for m in missing), missing
    prompts = [[5, 17, 42, 99, 3, 250, 8], [7] * 40 + [1, 2, 3]]
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    for prompt, out in zip(prompts, outs):
        with torch.no_grad():
            ref = hf.generate(
                torch.tensor([prompt]),
                max_new_tokens=12,
                min_new_tokens=12,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )
        assert out.outputs[0].token_ids == ref[0, len(prompt) :].tolist(), name
        assert out.outputs[0].text == ""  # no tokenizer: token ids only
