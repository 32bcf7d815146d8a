"""The GPU slot pool: LRU reuse, pins that block eviction, a bounded host cache."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from loraplex.adapters.peft_format import LoRAWeights
from loraplex.adapters.slot_memory import SlotImage
from loraplex.adapters.slot_pool import LoRASlotPool, NoFreeLoRASlotError


class RecordingWriter:
    """Stands in for the model's LoRA layers: remembers which adapter each slot holds."""

    def __init__(self) -> None:
        self.slots: dict[int, str] = {}
        self.writes = 0

    def write_slot(self, slot: int, image: SlotImage) -> None:
        self.slots[slot] = image.path
        self.writes += 1


def _weights(key: str) -> SlotImage:
    return SlotImage(key, key, torch.zeros(8), torch.zeros(2, 1, dtype=torch.int32))


def _pool(num_slots: int = 2, max_cpu: int = 3) -> tuple[LoRASlotPool, RecordingWriter, list]:
    writer, disk_reads = RecordingWriter(), []

    def loader(key):
        disk_reads.append(key)
        return _weights(key)

    return LoRASlotPool(num_slots, max_cpu, writer, loader, "cpu"), writer, disk_reads


def test_least_recently_released_slot_is_reused():
    pool, writer, _ = _pool()
    a, b = pool.acquire("a"), pool.acquire("b")
    pool.release("b")
    pool.release("a")  # "b" is now the least recently used
    c = pool.acquire("c")
    assert c == b and writer.slots[c] == "c"
    assert pool.slot_of("a") == a and pool.slot_of("b") is None
    assert pool.counters.gpu_evictions == 1


def test_pinned_slot_is_never_evicted():
    pool, writer, _ = _pool()
    a = pool.acquire("a")
    pool.acquire("b")
    pool.release("b")
    assert pool.can_allocate("c")
    pool.acquire("c")
    assert writer.slots[a] == "a"
    assert not pool.can_allocate("d")
    assert pool.can_allocate("a")  # already resident: another request can share it
    with pytest.raises(NoFreeLoRASlotError, match="pinned"):
        pool.acquire("d")


def test_shared_adapter_stays_pinned_until_its_last_request_releases():
    pool, _, _ = _pool(num_slots=1)
    pool.acquire("a")
    pool.acquire("a")
    pool.release("a")
    assert not pool.can_allocate("b")
    pool.release("a")
    assert pool.can_allocate("b")
    with pytest.raises(ValueError, match="holds no pin"):
        pool.release("a")


def test_resident_adapter_is_not_copied_again():
    pool, writer, _ = _pool()
    pool.acquire("a")
    pool.release("a")
    pool.acquire("a")
    assert writer.writes == 1 and pool.counters.gpu_loads == 1


def _read(pool: LoRASlotPool, key: str) -> None:
    """What the loader thread and `SlotAdmission.poll` do: read, then into the host cache."""
    pool.put_host(key, pool.read(key), from_disk=True)


def test_stage_copies_from_the_host_cache_into_a_free_then_an_idle_slot_never_a_pinned_one():
    pool, writer, disk_reads = _pool(num_slots=2)
    assert not pool.stage("a")  # not in the host cache: stage never reads disk
    for key in "abc":
        _read(pool, key)
    assert pool.stage("a") and pool.stage("b") and pool.is_ready("a")
    assert pool.acquire("a") == pool.slot_of("a")  # pinned now; "b" stays idle
    assert pool.stage("c") and pool.slot_of("b") is None  # took the idle slot
    pool.acquire("c")
    _read(pool, "b")
    assert not pool.stage("b") and not pool.can_allocate("b")  # both slots pinned
    assert disk_reads == ["a", "b", "c", "b"] and writer.writes == 3
    assert pool.counters.disk_loads == 4 and pool.counters.gpu_evictions == 1


def test_host_cache_is_bounded_and_lru():
    pool, _, disk_reads = _pool(num_slots=1, max_cpu=2)
    for key in ("a", "b", "c"):
        _read(pool, key)
    assert pool.cpu_resident() == 2 and pool.counters.cpu_evictions == 1
    assert not pool.has_host("a") and pool.has_host("b") and pool.has_host("c")
    pool.acquire("b")  # from host memory
    assert disk_reads == ["a", "b", "c"]
    pool.release("b")
    pool.acquire("a")  # fell out of the host cache: read again
    assert disk_reads == ["a", "b", "c", "a"]


def test_forget_keeps_pinned_adapters():
    pool, _, _ = _pool()
    pool.acquire("a")
    assert not pool.forget("a") and pool.slot_of("a") is not None
    pool.release("a")
    assert pool.forget("a") and pool.slot_of("a") is None and pool.gpu_resident() == 0


def test_adapters_with_module_copies_take_only_the_copy_slots():
    """Slot 0 of 3 holds module copies: adapters with copies take turns there, evicting only
    each other; plain adapters take the other slots first and fall back to slot 0."""
    writer = RecordingWriter()

    def loader(key):
        weights = _weights(key)
        if key.startswith("saved"):
            extras = LoRAWeights(key, key, {}, saved={"lm_head": torch.zeros(8, 4)})
            return dataclasses.replace(weights, extras=extras)
        return weights

    pool = LoRASlotPool(3, 8, writer, loader, "cpu", saved_module_slots=1)
    assert pool.acquire("plain-a") == 1 and pool.acquire("plain-b") == 2
    assert pool.acquire("saved-a") == 0
    _read(pool, "saved-b")
    assert pool.needs_saved_module_slot("saved-b") and not pool.can_allocate("saved-b")
    pool.release("plain-a")  # an idle slot, but not one that holds copies
    assert not pool.can_allocate("saved-b") and not pool.stage("saved-b")
    with pytest.raises(NoFreeLoRASlotError, match="the 1 module-copy LoRA slots"):
        pool.acquire("saved-b")
    pool.release("saved-a")
    assert pool.acquire("saved-b") == 0 and pool.slot_of("saved-a") is None
    pool.release("saved-b")
    pool.release("plain-b")
    assert pool.acquire("plain-c") == 1  # the least recently released of slots 1 and 2
    assert pool.acquire("plain-d") == 2
    assert pool.acquire("plain-e") == 0  # only then the copy slot
