"""LORAPLEX_QUANT_GEMM_TABLE: AWQ / GPTQ layers dispatch their W4A16 kernel from the table file
a GPU sweep wrote, and a bad file stops the load with its name."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from loraplex.kernels.w4a16.dispatch import (
    heuristic_config,
    select_config,
    use_selection_table,
    write_selection_table,
)
from loraplex.kernels.w4a16.types import W4A16Config
from loraplex.quant.awq import AWQLinearMethod


def _load_awq_layer() -> None:
    method = AWQLinearMethod("model.layers.0.mlp.down_proj", 128)
    layer = nn.Module()
    method.create_weights(layer, 256, [512], torch.float16)
    for param in (layer.qweight, layer.qzeros, layer.scales):
        param.data.zero_()
    method.process_weights_after_loading(layer)


def test_layers_dispatch_from_the_table_the_environment_names(tmp_path, monkeypatch) -> None:
    path = tmp_path / "table.json"
    config = W4A16Config("mma", 16, 256, 4, 8, 4)
    write_selection_table(path, {(4, 1, 512, 256): config})
    monkeypatch.setenv("LORAPLEX_QUANT_GEMM_TABLE", str(path))
    assert select_config(1, 512, 256, 4) == heuristic_config(1)
    try:
        _load_awq_layer()
        assert select_config(1, 512, 256, 4) == config
    finally:
        use_selection_table(None)


def test_a_missing_table_file_stops_the_load_with_its_name(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("LORAPLEX_QUANT_GEMM_TABLE", str(tmp_path / "missing.json"))
    with pytest.raises(ValueError, match="missing.json"):
        _load_awq_layer()
