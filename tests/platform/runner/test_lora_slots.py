"""LoRASlotWriter: each step's per-token slots reach the LoRA layers' batch metadata."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from loraplex.adapters.lora_layer import LoRABatchMeta
from loraplex.platform.runner.lora_slots import LoRASlotWriter


@pytest.fixture
def writer() -> LoRASlotWriter:
    meta = LoRABatchMeta(num_slots=4, max_rank=8, max_num_tokens=16, device=torch.device("cpu"))
    return LoRASlotWriter(meta, torch.device("cpu"))


def test_slots_are_installed_and_grouped_by_slot(writer):
    writer.write(np.array([2, -1, 0, 2, 2], dtype=np.int32))
    meta = writer.meta.kernel_meta
    assert writer.meta.active
    assert meta.lora_slots.tolist() == [2, -1, 0, 2, 2]
    assert meta.slot_count.tolist() == [1, 0, 3, 0]
    start = meta.slot_start.tolist()
    assert meta.token_order[start[2] : start[2] + 3].tolist() == [0, 3, 4]


def test_a_step_without_adapters_switches_lora_off_unless_told(writer):
    writer.write(np.array([1, 1], dtype=np.int32))
    writer.write(np.full(3, -1, dtype=np.int32))
    assert not writer.meta.active
    writer.write(np.full(3, -1, dtype=np.int32), 8, always_apply=True)  # a graph replay
    assert writer.meta.active and writer.meta.kernel_meta.lora_slots.tolist() == [-1] * 8


def test_padding_and_alternating_buffers_never_mix_steps(writer):
    writer.write(np.array([3, 3, 3, 3], dtype=np.int32), 6, always_apply=True)
    writer.write(np.array([0], dtype=np.int32), 4, always_apply=True)
    assert writer.meta.kernel_meta.lora_slots.tolist() == [0, -1, -1, -1]
    writer.write(np.array([1, 2], dtype=np.int32))
    assert writer.meta.kernel_meta.lora_slots.tolist() == [1, 2]


def test_more_tokens_than_the_buffers_hold_is_refused(writer):
    with pytest.raises(ValueError, match="hold 16"):
        writer.write(np.zeros(17, dtype=np.int32))
    with pytest.raises(ValueError, match="padded to 2"):
        writer.write(np.zeros(3, dtype=np.int32), 2)


def test_the_kernels_plan_for_the_step_s_distinct_adapters(monkeypatch):
    """Where the count can change the kernels (96-128 tokens on CUDA), an eager step's
    metadata carries its distinct adapters (the base not counted); a graph carries the most it
    was captured for (a few-adapter graph) or a count past any step (the graph for many);
    elsewhere (other sizes, the CPU's torch reference) the count stays unknown."""
    from loraplex.platform.runner.lora_slots import distinct_adapters

    meta = LoRABatchMeta(num_slots=64, max_rank=8, max_num_tokens=256, device=torch.device("cpu"))
    writer = LoRASlotWriter(meta, torch.device("cpu"))
    slots = np.array([5, -1, 5, 7, 63, 7] * 16, dtype=np.int32)  # 96 tokens, 3 adapters
    assert distinct_adapters(slots) == 3 and writer.few_adapters_limit(96) is None
    writer.write(slots)
    assert meta.kernel_meta.num_adapters is None
    monkeypatch.setattr(writer, "_cuda", True)
    assert [writer.few_adapters_limit(n) for n in (64, 95, 96, 128, 129)] == [
        None, None, 8, 10, None
    ]  # fmt: skip
    writer.write(slots)
    assert meta.kernel_meta.num_adapters == 3
    writer.write(slots[:64])
    assert meta.kernel_meta.num_adapters is None
    writer.for_graph(112, slots[:100], 9)
    assert meta.kernel_meta.num_adapters == 9
    writer.for_graph(112, slots[:100])
    assert not meta.kernel_meta.num_adapters * 12 <= 112  # planned for many
