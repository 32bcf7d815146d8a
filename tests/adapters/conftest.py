"""Fixtures for adapter tests: a tiny Llama spec and fresh PEFT adapters under tmp_path."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from lora_fixtures import HF_CONFIG, make_peft_adapter

from loraplex.adapters.peft_format import BaseModelSpec


@pytest.fixture(scope="session")
def spec() -> BaseModelSpec:
    return BaseModelSpec.from_hf_config(HF_CONFIG, name_or_path="tiny-llama")


@pytest.fixture
def make_adapter(tmp_path: Path) -> Callable[..., Path]:
    """`make_adapter(name, seed=..., r=..., ...)` -> a fresh PEFT folder under tmp_path."""

    def make(name: str = "adapter", **kwargs) -> Path:
        return make_peft_adapter(tmp_path / name, **kwargs)

    return make
