"""`quantize_model` writes a loadable checkpoint folder for each method."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch
from quant_tiny_model import MERGED, load_tiny, random_weights
from safetensors import safe_open
from safetensors.torch import save_file

from loraplex.cli import build_parser, main
from loraplex.quant import quantize
from loraplex.quant.quantize import quantize_model, rtn_quantize
from loraplex.quant.quantize_options import default_group_size

# Like SmolLM2-135M (hidden 576 = 9 x 64, intermediate 1536): 128 does not divide the hidden size.
ODD = {"hidden": 192, "inter": 384}


def _dense_folder(folder: Path, seed: int, hidden: int = 128, inter: int = 256) -> Path:
    folder.mkdir()
    weights = random_weights(seed=seed, hidden=hidden, inter=inter)
    save_file(
        weights | {"model.norm.weight": torch.ones(hidden)}, str(folder / "model.safetensors")
    )
    (folder / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    (folder / "tokenizer.json").write_text("{}")
    return folder


@pytest.fixture()
def dense_dir(tmp_path: Path) -> Path:
    return _dense_folder(tmp_path / "dense", seed=5)


@pytest.fixture()
def odd_dir(tmp_path: Path) -> Path:
    return _dense_folder(tmp_path / "odd", seed=6, **ODD)


def _rtn_reference(weight: torch.Tensor, bits: int, group_size: int, sym: bool) -> torch.Tensor:
    """weight [N, K] quantized round-to-nearest and dequantized again, in fp32."""
    q, scales, zeros = rtn_quantize(weight, bits, group_size, sym)
    rows = torch.arange(weight.shape[1]) // group_size  # [K]: the group of each input
    return ((q.t() - zeros[rows]) * scales.float()[rows]).t()  # [N, K]


def _leftovers(parent: Path) -> list[str]:
    return sorted(path.name for path in parent.iterdir())


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


@pytest.mark.parametrize(
    ("request_", "error"),
    [({"method": "int3"}, "method must be one of"),
     ({"method": "awq", "bits": 8}, "AWQ is 4-bit"),
     ({"method": "awq", "sym": True}, "AWQ is asymmetric"),
     ({"method": "awq", "desc_act": True}, "desc_act .* does not apply to AWQ"),
     ({"method": "awq", "group_size": 16}, "AWQ group_size=16 is not supported"),
     ({"method": "gptq", "group_size": 96}, "group_size 96 does not divide"),
     ({"method": "gptq", "group_size": 0}, "group_size must be positive or -1"),
     ({"method": "gptq", "fp8_scheme": "block"}, "fp8_scheme .* does not apply to GPTQ"),
     ({"method": "fp8", "group_size": 64}, "group_size .* does not apply to FP8")],
)  # fmt: skip
def test_refuses_bad_requests_and_writes_nothing(
    dense_dir: Path, tmp_path: Path, request_: dict, error: str
) -> None:
    with pytest.raises(ValueError, match=error):
        quantize_model(dense_dir, tmp_path / "new" / "x", progress=False, **request_)
    assert _leftovers(tmp_path) == ["dense"]


def test_refuses_a_quantized_source_and_a_full_output_folder(
    dense_dir: Path, tmp_path: Path
) -> None:
    out = quantize_model(dense_dir, tmp_path / "q", "fp8", progress=False)
    with pytest.raises(ValueError, match="already quantized"):
        quantize_model(out, tmp_path / "qq", "gptq", progress=False)
    with pytest.raises(ValueError, match="not an empty folder"):
        quantize_model(dense_dir, out, "gptq", progress=False)
    assert json.loads((out / "config.json").read_text())["quantization_config"]["quant_method"] == (
        "compressed-tensors"
    )
    assert _leftovers(tmp_path) == ["dense", "q"]


@pytest.mark.parametrize(("method", "sym"), [("awq", False), ("gptq", True)])
def test_cli_defaults_fit_a_hidden_size_128_does_not_divide(
    odd_dir: Path, tmp_path: Path, method: str, sym: bool, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="loraplex.quant.quantize_options")
    out = tmp_path / "out"
    assert main(["quantize", "--method", method, "--model", str(odd_dir), "--out", str(out)]) == 0
    assert "group size 64 (the largest of" in caplog.text
    config = json.loads((out / "config.json").read_text())["quantization_config"]
    assert (config["bits"], config["group_size"]) == (4, 64)
    assert config.get("sym", False) == sym
    tensors = _read(out)
    assert torch.equal(tensors.pop("model.norm.weight"), torch.ones(ODD["hidden"]))
    model = load_tiny(tensors, config, **ODD)
    dense = random_weights(seed=6, **ODD)
    for merged, parts in MERGED.items():
        layer = model.linear(merged)
        original = torch.cat([dense[f"model.layers.0.{p}.weight"] for p in parts])  # [N, K]
        expected = _rtn_reference(original, 4, 64, sym)
        torch.testing.assert_close(layer.method.dequantized_weight(layer), expected)
    assert _leftovers(tmp_path) == ["odd", "out"]


def test_cli_error_leaves_no_folder(
    odd_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    out = tmp_path / "made" / "for" / "out"
    base = ["quantize", "--model", str(odd_dir), "--out", str(out)]
    assert main([*base, "--method", "awq", "--sym"]) == 2
    assert "AWQ is asymmetric" in capsys.readouterr().err
    assert main([*base, "--method", "gptq", "--group-size", "128"]) == 2
    assert "group_size 128 does not divide the input size 192" in capsys.readouterr().err
    assert _leftovers(tmp_path) == ["odd"]


def test_crash_while_writing_leaves_no_folder(
    odd_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def write_then_fail(shards: list, out_dir: Path) -> None:
        (out_dir / "model.safetensors").write_bytes(b"torn")
        raise OSError("disk full")

    monkeypatch.setattr(quantize, "_write_shards", write_then_fail)
    with pytest.raises(OSError, match="disk full"):
        quantize_model(odd_dir, tmp_path / "new" / "out", "gptq", progress=False)
    assert _leftovers(tmp_path) == ["odd"]
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(OSError, match="disk full"):
        quantize_model(odd_dir, empty, "awq", progress=False)
    assert _leftovers(tmp_path) == ["empty", "odd"] and _leftovers(empty) == []
    monkeypatch.undo()
    quantize_model(odd_dir, empty, "awq", progress=False)  # an empty folder may be the output
    assert _leftovers(tmp_path) == ["empty", "odd"]
    assert _leftovers(empty) == ["config.json", "model.safetensors", "tokenizer.json"]


@pytest.mark.parametrize(
    ("method", "input_sizes", "expected"),
    [("awq", {576, 1536}, 64), ("gptq", {576, 1536}, 64), ("awq", {4096, 11008}, 128),
     ("gptq", {48, 96}, 16), ("awq", {48, 96}, -1), ("gptq", {40}, -1)],
)  # fmt: skip
def test_default_group_size_is_the_largest_that_divides_every_input(
    method: str, input_sizes: set[int], expected: int
) -> None:
    assert default_group_size(method, input_sizes) == expected


def test_cli_arguments() -> None:
    parser = build_parser()
    args = parser.parse_args(
        ["quantize", "--method", "gptq", "--out", "out", "--bits", "8", "--no-sym"]
    )
    assert (args.method, args.bits, args.sym, args.group_size) == ("gptq", 8, False, None)
    defaults = parser.parse_args(["quantize", "--method", "awq", "--out", "out"])
    assert (defaults.bits, defaults.group_size, defaults.sym, defaults.fp8_scheme) == (
        (None, None, None, None)
    )
