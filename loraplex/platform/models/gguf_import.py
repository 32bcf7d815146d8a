"""Convert a llama-architecture GGUF file into a Hugging Face model folder.

The folder holds `config.json`, `generation_config.json`, `model.safetensors`, `tokenizer.json`
and `tokenizer_config.json`, so both our own loader and Hugging Face transformers can read it.
Quantized tensors (Q4_1, Q8_0, ...) are dequantized with the `gguf` package.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGUFReader, ReaderTensor
from gguf.quants import dequantize
from safetensors.torch import save_file
from tqdm import tqdm

from loraplex.platform.models.arch_config import ArchConfig
from loraplex.platform.models.gguf_tokenizer import build_tokenizer, gguf_field, tokenizer_info
from loraplex.platform.models.model_store import TEMP_PREFIX

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}

# GGUF tensor name -> Hugging Face Llama tensor name.
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
_LAYER_PATTERN = re.compile(r"blk\.(\d+)\.(.+)")

"""Temporary build folders are named `<parent>/.tmp-<out_dir name>-<unique>`."""


@dataclass(frozen=True)
class LlamaHParams:
    """Llama hyper-parameters read from GGUF metadata."""

    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    rope_theta: float
    rms_norm_eps: float
    max_position_embeddings: int
    vocab_size: int
    rope_scaling: dict[str, Any] | None = None  # transformers' rope_scaling keys, or None

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads


def _from_float32(value: float) -> float:
    """The shortest decimal that a float32 metadata value stands for (1e-05, not 9.99e-06)."""
    return float(f"{float(value):.7g}")


def read_hparams(reader: GGUFReader) -> LlamaHParams:
    """Hyper-parameters of a llama GGUF file; ValueError for any other architecture."""
    arch = gguf_field(reader, "general.architecture")
    if arch != "llama":
        raise ValueError(f"only 'llama' GGUF files can be imported, this one is {arch!r}")

    def get(key: str) -> Any:
        value = gguf_field(reader, f"llama.{key}")
        if value is None:
            raise ValueError(f"GGUF file lacks metadata 'llama.{key}'")
        return value

    num_heads = int(get("attention.head_count"))
    vocab_size = gguf_field(reader, "llama.vocab_size")
    if vocab_size is None:
        vocab_size = len(gguf_field(reader, "tokenizer.ggml.tokens"))
    hidden = int(get("embedding_length"))
    _check_supported(reader, hidden // num_heads)
    return LlamaHParams(
        num_layers=int(get("block_count")),
        hidden_size=hidden,
        intermediate_size=int(get("feed_forward_length")),
        num_heads=num_heads,
        num_kv_heads=int(gguf_field(reader, "llama.attention.head_count_kv", num_heads)),
        rope_theta=_from_float32(gguf_field(reader, "llama.rope.freq_base", 10000.0)),
        rms_norm_eps=_from_float32(get("attention.layer_norm_rms_epsilon")),
        max_position_embeddings=int(get("context_length")),
        vocab_size=int(vocab_size),
        rope_scaling=_rope_scaling(reader),
    )


def _check_supported(reader: GGUFReader, head_dim: int) -> None:
    """Refuse metadata that changes the numbers in ways the import does not carry over."""
    for key in ("rope.dimension_count", "attention.key_length", "attention.value_length"):
        value = gguf_field(reader, f"llama.{key}")
        if value is not None and int(value) != head_dim:
            raise ValueError(
                f"GGUF llama.{key}={int(value)} differs from embedding_length / head_count = "
                f"{head_dim}; partial rotary and other head sizes are not supported"
            )
    experts = gguf_field(reader, "llama.expert_count")
    if experts:
        raise ValueError(
            f"GGUF llama.expert_count={int(experts)}: mixture of experts is not supported"
        )


def _rope_scaling(reader: GGUFReader) -> dict[str, Any] | None:
    """llama.cpp's rope scaling metadata as transformers' `rope_scaling`; only none and linear."""
    kind = gguf_field(reader, "llama.rope.scaling.type")
    factor = gguf_field(reader, "llama.rope.scaling.factor")
    if kind in (None, "none") and factor in (None, 0.0, 1.0):
        return None
    if kind == "linear" and factor:
        return {"rope_type": "linear", "factor": _from_float32(factor)}
    raise ValueError(
        f"GGUF llama.rope.scaling.type={kind!r} (factor {factor!r}) is not supported; "
        "supported: none, linear"
    )


def _hf_name(gguf_name: str) -> str:
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    match = _LAYER_PATTERN.fullmatch(gguf_name)
    if match is None or match.group(2) not in _LAYER_NAMES:
        raise ValueError(f"unexpected GGUF tensor {gguf_name!r}")
    return f"model.layers.{match.group(1)}.{_LAYER_NAMES[match.group(2)]}"


def _unpermute_rope_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's row order for q/k projections.

    NOTE: llama.cpp's converter interleaves each head's two rotary halves (row h*D + 2i + j holds
    HF row h*D + j*D/2 + i) for its GPT-J style rope; HF Llama rotates halves (rotate_half).
    """
    rows, cols = weight.shape  # [num_heads * head_dim, hidden]
    half = rows // num_heads // 2
    return weight.reshape(num_heads, half, 2, cols).swapaxes(1, 2).reshape(rows, cols)


def _load_tensor(tensor: ReaderTensor, hparams: LlamaHParams) -> np.ndarray:
    # NOTE: GGUF lists dims innermost-first (ne order); the dequantized array is already in
    # torch's [out_features, in_features] order, so reshape to the reversed ne shape.
    shape = tuple(int(dim) for dim in reversed(tensor.shape))
    weight = dequantize(tensor.data, tensor.tensor_type).reshape(shape)
    if tensor.name.endswith("attn_q.weight"):
        weight = _unpermute_rope_rows(weight, hparams.num_heads)
    elif tensor.name.endswith("attn_k.weight"):
        weight = _unpermute_rope_rows(weight, hparams.num_kv_heads)
    return weight


def _load_state_dict(
    reader: GGUFReader, hparams: LlamaHParams, dtype: torch.dtype, progress: bool
) -> dict[str, torch.Tensor]:
    state_dict: dict[str, torch.Tensor] = {}
    for tensor in tqdm(reader.tensors, desc="import", unit="tensor", disable=not progress):
        weight = _load_tensor(tensor, hparams)
        state_dict[_hf_name(tensor.name)] = torch.from_numpy(
            np.require(weight, requirements="CW")
        ).to(dtype)
    expected = 2 + len(_LAYER_NAMES) * hparams.num_layers
    missing = expected - len(state_dict.keys() - {"lm_head.weight"})
    if missing:
        raise ValueError(f"GGUF file is missing {missing} of the {expected} llama tensors")
    return state_dict


def _config(hparams: LlamaHParams, reader: GGUFReader, dtype: str, tied: bool) -> dict[str, Any]:
    """config.json for the imported folder, readable by transformers 4.x and 5.x alike.

    NOTE: RoPE and dtype are written in both layouts (4.x: `rope_theta`, `rope_scaling`,
    `torch_dtype`; 5.x: `rope_parameters`, `dtype`), with the same values, so neither version
    of transformers falls back to a default.
    """

    def token_id(key: str) -> int | None:
        value = gguf_field(reader, f"tokenizer.ggml.{key}_token_id")
        return None if value is None else int(value)

    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hparams.hidden_size,
        "intermediate_size": hparams.intermediate_size,
        "num_hidden_layers": hparams.num_layers,
        "num_attention_heads": hparams.num_heads,
        "num_key_value_heads": hparams.num_kv_heads,
        "head_dim": hparams.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": hparams.rms_norm_eps,
        "rope_theta": hparams.rope_theta,
        "rope_scaling": hparams.rope_scaling,
        "rope_parameters": {
            "rope_type": "default",
            **(hparams.rope_scaling or {}),
            "rope_theta": hparams.rope_theta,
        },
        "attention_bias": False,
        "mlp_bias": False,
        "max_position_embeddings": hparams.max_position_embeddings,
        "vocab_size": hparams.vocab_size,
        "tie_word_embeddings": tied,
        "bos_token_id": token_id("bos"),
        "eos_token_id": token_id("eos"),
        "pad_token_id": token_id("padding"),
        "torch_dtype": dtype,
        "dtype": dtype,
    }


def check_config(config: dict[str, Any], hparams: LlamaHParams) -> ArchConfig:
    """The ArchConfig loraplex reads back from `config`; ValueError unless it is what the GGUF
    file says (so a written folder never loads with a defaulted value)."""
    arch = ArchConfig.from_dict(config)
    read = (
        arch.num_layers, arch.hidden_size, arch.intermediate_size, arch.num_heads,
        arch.num_kv_heads, arch.head_dim, arch.rope.theta, arch.rope.scaling(),
        arch.rms_norm_eps, arch.max_position_embeddings, arch.vocab_size,
    )  # fmt: skip
    wanted = (
        hparams.num_layers, hparams.hidden_size, hparams.intermediate_size, hparams.num_heads,
        hparams.num_kv_heads, hparams.head_dim, hparams.rope_theta, hparams.rope_scaling,
        hparams.rms_norm_eps, hparams.max_position_embeddings, hparams.vocab_size,
    )  # fmt: skip
    if read != wanted:
        raise ValueError(f"imported config.json reads back as {read}, not {wanted}")
    return arch


def _write_json(path: Path, value: dict[str, Any]) -> None:
    path.write_text(json.dumps(value, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def _write_folder(reader: GGUFReader, folder: Path, dtype: str, progress: bool) -> None:
    hparams = read_hparams(reader)
    tied = all(tensor.name != "output.weight" for tensor in reader.tensors)
    config = _config(hparams, reader, dtype, tied)
    check_config(config, hparams)
    state_dict = _load_state_dict(reader, hparams, _DTYPES[dtype], progress)
    save_file(state_dict, str(folder / "model.safetensors"), metadata={"format": "pt"})
    del state_dict

    _write_json(folder / "config.json", config)
    generation = {key: config[key] for key in ("bos_token_id", "eos_token_id", "pad_token_id")}
    _write_json(folder / "generation_config.json", generation)

    build_tokenizer(reader).save(str(folder / "tokenizer.json"))
    info = tokenizer_info(reader)
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": info.bos_token,
        "eos_token": info.eos_token,
        "unk_token": info.unk_token,
        "pad_token": info.pad_token,
        "add_bos_token": info.add_bos_token,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": hparams.max_position_embeddings,
        "chat_template": info.chat_template,
    }
    _write_json(folder / "tokenizer_config.json", tokenizer_config)


def temp_dir_for(out_dir: Path) -> Path:
    """A fresh, unique temporary sibling of `out_dir` to build into."""
    return out_dir.parent / f"{TEMP_PREFIX}{out_dir.name}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


def import_gguf(
    gguf_path: Path, out_dir: Path, dtype: str = "float32", progress: bool = True
) -> Path:
    """Convert the llama GGUF file `gguf_path` into a Hugging Face folder at `out_dir`.

    The folder is built in a temporary sibling and renamed into place, so `out_dir` either does
    not exist or is complete, even if the process is killed. Returns `out_dir`.

    Raises ValueError for an unsupported file or dtype, FileNotFoundError when `gguf_path` does
    not exist, and FileExistsError when `out_dir` already exists.
    """
    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")
    if not gguf_path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {gguf_path}")
    if out_dir.exists():
        raise FileExistsError(f"{out_dir} already exists; remove it to import again")

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    temp_dir = temp_dir_for(out_dir)
    temp_dir.mkdir()
    try:
        _write_folder(GGUFReader(gguf_path), temp_dir, dtype, progress)
        os.rename(temp_dir, out_dir)
    except BaseException:
        shutil.rmtree(temp_dir, ignore_errors=True)
        raise
    return out_dir
