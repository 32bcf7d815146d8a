"""A config field that changes the numbers and that loraplex does not implement is refused at
load, naming the field and value (from `LLM(...)` and from `loraplex serve`); fields that do not
change outputs are ignored; a sliding window caps the context instead of being ignored."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from loraplex import LLM
from loraplex.platform.models.arch_config import ArchConfig

REPO = Path(__file__).resolve().parents[3]
BASE = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 300,
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-5,
    "hidden_act": "silu",
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
    "dtype": "float32",
}
REFUSED = {
    "mlp_bias": ({"mlp_bias": True}, "mlp_bias=True"),
    "softcapping": ({"attn_logit_softcapping": 50.0}, "attn_logit_softcapping=50.0"),
    "final_softcapping": ({"final_logit_softcapping": 30.0}, "final_logit_softcapping=30.0"),
    "gelu": ({"hidden_act": "gelu_pytorch_tanh"}, "hidden_act='gelu_pytorch_tanh'"),
    "moe": ({"num_local_experts": 8}, "num_local_experts=8"),
    "layer_type": (
        {"layer_types": ["full_attention", "linear_attention"]},
        r"layer_types has \['linear_attention'\]",
    ),
    "dynamic_ntk": (
        {"rope_parameters": {"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}},
        "rope_parameters.rope_type='dynamic'",
    ),
    "partial_rotary": ({"partial_rotary_factor": 0.5}, "partial_rotary_factor=0.5"),
    "head_dim": ({"hidden_size": 66, "num_attention_heads": 4}, "hidden_size=66 is not a multiple"),
    "gqa": ({"num_key_value_heads": 3}, "num_key_value_heads=3"),
    "quantization": (
        {"quantization_config": {"quant_method": "bitsandbytes", "load_in_4bit": True}},
        "quantization_config.quant_method='bitsandbytes' is not supported",
    ),
    "architecture": ({"architectures": ["GemmaForCausalLM"]}, "'GemmaForCausalLM'"),
}


def _folder(tmp_path: Path, extra: dict) -> Path:
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({**BASE, **extra}))
    return folder


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_llm_refuses_the_field_by_name(name: str, tmp_path: Path) -> None:
    extra, message = REFUSED[name]
    folder = _folder(tmp_path, extra)
    with pytest.raises(ValueError, match=message):
        LLM(str(folder), device="cpu", num_kv_blocks=8, enable_lora=False)
    # the random-weight path (a bare config.json) goes through the same check
    with pytest.raises(ValueError, match=message):
        LLM(str(folder / "config.json"), device="cpu", num_kv_blocks=8, enable_lora=False)


def test_serve_exits_with_the_message_not_a_traceback(tmp_path: Path) -> None:
    folder = _folder(tmp_path, {"attn_logit_softcapping": 50.0})
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    with socket.socket() as sock:  # a free port, in case the model did load
        sock.bind(("127.0.0.1", 0))
        port = str(sock.getsockname()[1])
    proc = subprocess.run(
        [sys.executable, "-m", "loraplex.cli", "serve", "--model", str(folder),
         "--host", "127.0.0.1", "--port", port, "--device", "cpu"],
        capture_output=True, text=True, timeout=180, env=env, cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    assert "error: config.json attn_logit_softcapping=50.0 is not supported" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_fields_that_do_not_change_outputs_are_ignored() -> None:
    harmless = {
        "attention_dropout": 0.1,
        "initializer_range": 0.5,
        "use_cache": False,
        "pretraining_tp": 2,  # transformers 5 no longer reads it
        "transformers_version": "5.0.0",
        "pad_token_id": None,
        "sliding_window": 16,  # Llama's implementation ignores it
        "mlp_bias": False,
        "attn_logit_softcapping": None,
    }
    arch = ArchConfig.from_dict({**BASE, **harmless})
    assert arch.max_position_embeddings == 256 and arch.sliding_window is None


def test_mistral_sliding_window_caps_the_context(tmp_path: Path) -> None:
    mistral = {**BASE, "architectures": ["MistralForCausalLM"], "model_type": "mistral"}
    assert ArchConfig.from_dict({**mistral, "sliding_window": 64}).max_position_embeddings == 64
    assert ArchConfig.from_dict({**mistral, "sliding_window": None}).sliding_window is None
    # absent: transformers' MistralConfig default, 4096
    long = {**mistral, "max_position_embeddings": 32768}
    assert ArchConfig.from_dict(long).max_position_embeddings == 4096
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**mistral, "sliding_window": 64}))
    llm = LLM(str(path), device="cpu", num_kv_blocks=8, enable_lora=False)
    assert llm.engine.max_model_len == 64


def test_qwen_sliding_window_only_with_use_sliding_window() -> None:
    qwen2 = {**BASE, "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2"}
    off = {**qwen2, "sliding_window": 32, "use_sliding_window": False}
    assert ArchConfig.from_dict(off).max_position_embeddings == 256
    on = {**off, "use_sliding_window": True, "max_window_layers": 1}
    assert ArchConfig.from_dict(on).max_position_embeddings == 32
    below = {**on, "max_window_layers": 2}  # no layer at or past max_window_layers slides
    assert ArchConfig.from_dict(below).sliding_window is None
    typed = {**on, "layer_types": ["full_attention", "full_attention"]}
    assert ArchConfig.from_dict(typed).sliding_window is None


def test_biases_follow_each_architecture() -> None:
    llama = ArchConfig.from_dict({**BASE, "attention_bias": True})
    assert llama.attention_bias and llama.o_proj_bias
    qwen2 = ArchConfig.from_dict({**BASE, "architectures": ["Qwen2ForCausalLM"]})
    assert qwen2.attention_bias and not qwen2.o_proj_bias  # q/k/v always, o never
    mistral = ArchConfig.from_dict(
        {**BASE, "architectures": ["MistralForCausalLM"], "attention_bias": True}
    )
    assert not mistral.attention_bias and not mistral.o_proj_bias  # Mistral has none


def test_dtype_from_either_layout() -> None:
    assert ArchConfig.from_dict({**BASE, "dtype": "bfloat16"}).torch_dtype == "bfloat16"
    old = {k: v for k, v in BASE.items() if k != "dtype"} | {"torch_dtype": "float16"}
    assert ArchConfig.from_dict(old).torch_dtype == "float16"


def test_quantize_refuses_before_writing_anything(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    from loraplex.cli import main

    folder = _folder(tmp_path, {"mlp_bias": True})
    out = tmp_path / "awq"
    argv = ["quantize", "--method", "awq", "--model", str(folder), "--out", str(out)]
    assert main(argv) == 2
    assert "loraplex quantize: error: config.json mlp_bias=True" in capsys.readouterr().err
    assert not out.exists()
