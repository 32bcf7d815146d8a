"""`quantize_model` writes a loadable checkpoint folder for each method."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from quant_tiny_model import MERGED, load_tiny, random_weights
from safetensors import safe_open
from safetensors.torch import save_file

from loraplex.cli import build_parser
from loraplex.quant.quantize import quantize_model


@pytest.fixture()
def dense_dir(tmp_path: Path) -> Path:
    src = tmp_path / "dense"
    src.mkdir()
    tensors = random_weights(seed=5) | {"model.norm.weight": torch.ones(128)}
    save_file(tensors, str(src / "model.safetensors"))
    (src / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    (src / "tokenizer.json").write_text("{}")
    return src


def _read(folder: Path) -> dict[str, torch.Tensor]:
    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        return {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118


@pytest.mark.parametrize(
    "options",
    [{"method": "awq", "group_size": 32}, {"method": "gptq", "group_size": 64, "desc_act": True},
     {"method": "gptq", "bits": 8, "sym": False}, {"method": "fp8", "fp8_scheme": "per_tensor"}],
)  # fmt: skip
def test_quantized_folder_loads_and_stays_close(dense_dir: Path, tmp_path: Path, options) -> None:
    out = quantize_model(dense_dir, tmp_path / "q", progress=False, **options)
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert (out / "tokenizer.json").read_text() == "{}"
    tensors = _read(out)
    assert torch.equal(tensors.pop("model.norm.weight"), torch.ones(128))
    model = load_tiny(tensors, config["quantization_config"])
    dense = random_weights(seed=5)
    for merged, parts in MERGED.items():
        layer = model.linear(merged)
        original = torch.cat([dense[f"model.layers.0.{p}.weight"] for p in parts])
        error = (layer.method.dequantized_weight(layer).float() - original).abs().max()
        assert error < 0.15 * original.abs().max()


def test_refuses_bad_requests(dense_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="method must be one of"):
        quantize_model(dense_dir, tmp_path / "x", "int3", progress=False)
    with pytest.raises(ValueError, match="AWQ is 4-bit"):
        quantize_model(dense_dir, tmp_path / "x", "awq", bits=8, progress=False)
    with pytest.raises(ValueError, match="group_size 96 does not divide"):
        quantize_model(dense_dir, tmp_path / "x", "gptq", group_size=96, progress=False)


def test_cli_arguments() -> None:
    parser = build_parser()
    args = parser.parse_args(
        ["quantize", "--method", "gptq", "--out", "out", "--bits", "8", "--no-sym"]
    )
    assert (args.method, args.bits, args.sym, args.group_size) == ("gptq", 8, False, 128)
