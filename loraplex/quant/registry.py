"""Registry of quantization configs, keyed by the checkpoint's `quant_method`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from loraplex.quant.base import LinearMethod, QuantizationConfig
from loraplex.quant.unquantized import UnquantizedLinearMethod

_REGISTRY: dict[str, type[QuantizationConfig]] = {}

# Files older tools write beside config.json instead of a `quantization_config` entry.
_SIDE_FILES = ("quantize_config.json", "quant_config.json")


def register_quantization(cls: type[QuantizationConfig]) -> type[QuantizationConfig]:
    for name in cls.names:
        _REGISTRY[name] = cls
    return cls


def supported_methods() -> list[str]:
    _load_builtin()
    return sorted(_REGISTRY)


def _load_builtin() -> None:
    # NOTE: imported lazily so that a bf16 model never imports the quantized formats.
    import importlib

    for module in ("awq", "gptq", "fp8"):
        try:
            importlib.import_module(f"loraplex.quant.{module}")
        except ModuleNotFoundError as exc:
            if exc.name != f"loraplex.quant.{module}":
                raise


def find_quantization_config(model_dir: Path, hf_config: dict[str, Any]) -> dict[str, Any] | None:
    """The checkpoint's quantization config: config.json's entry, else an older side file."""
    if "quantization_config" in hf_config:
        return dict(hf_config["quantization_config"])
    for name in _SIDE_FILES:
        path = model_dir / name
        if path.is_file():
            return json.loads(path.read_text())
    return None


def method_name(config: dict[str, Any]) -> str:
    name = config.get("quant_method") or config.get("quant_type")
    if name is None and "bits" in config and ("desc_act" in config or "sym" in config):
        name = "gptq"  # AutoGPTQ's quantize_config.json carries no method name
    if name is None and "w_bit" in config:
        name = "awq"  # AutoAWQ's quant_config.json
    if name is None:
        raise ValueError(f"quantization config has no 'quant_method': {sorted(config)}")
    return str(name).lower()


def get_quantization_config(
    quantization: str | None, checkpoint_config: dict[str, Any] | None
) -> QuantizationConfig | None:
    """Pick the config for a model: the checkpoint's own, or `quantization` applied at load."""
    if checkpoint_config is None and quantization is None:
        return None
    _load_builtin()
    name = method_name(checkpoint_config) if checkpoint_config is not None else quantization
    assert name is not None
    if quantization is not None and checkpoint_config is not None and quantization != name:
        raise ValueError(
            f"--quantization {quantization} given, but the checkpoint is quantized with {name}"
        )
    cls = _REGISTRY.get(name)
    if cls is None:
        field = (
            "quantization_config.quant_method" if checkpoint_config is not None else "quantization"
        )
        raise ValueError(
            f"{field}={name!r} is not supported (unsupported quantization method); "
            f"supported: {sorted(_REGISTRY)}"
        )
    return cls.from_config(checkpoint_config if checkpoint_config is not None else {})


def linear_method_for(quant_config: QuantizationConfig | None, prefix: str) -> LinearMethod:
    if quant_config is None:
        return UnquantizedLinearMethod()
    return quant_config.linear_method(prefix)
