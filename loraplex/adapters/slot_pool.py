"""The GPU slot pool: which adapter sits in which of the `max_loras` slots, and its CPU cache.

- A slot holding an adapter that a running request uses is pinned (a per-adapter count) and is
  never evicted; unpinned resident slots are reused in least-recently-released order.
- A slot copied for a waiting request (`stage(..., hold=True)`) is held for it: no other stage
  takes it until the request pins it or the hold is let go (`unhold`), so waiters on more
  adapters than there are idle slots do not evict each other's copies before they run.
- Behind the slots, an LRU cache of up to `max_cpu_loras` adapters in host memory, each staged
  as a slot image (`adapters.slot_memory`: pinned, in the model dtype, laid out as a slot)
  spares disk reads; a miss calls the loader the pool was built with.
- The first `saved_module_slots` slots also hold full embed_tokens / lm_head copies
  (`adapters.saved_modules`): an adapter that needs them (`modules_to_save`, trained token rows)
  goes only there; other adapters take the other slots first.
- On CUDA, the writer's few copies run on a side stream, after the work already queued on the
  main stream (an evicted slot may still be read by the step in flight). A CUDA event marks
  each load; `is_ready` (what admission asks) is true only once it has completed, and
  `wait_ready` makes the main stream wait for the loads of pinned slots before the forward that
  first uses them, so requests whose adapters are already resident never wait.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Protocol

import torch

from loraplex.adapters.slot_memory import SlotImage


class SlotWriter(Protocol):
    """Writes a staged adapter (a `SlotImage`, what the loader returns) into one slot of every
    LoRA layer, on the current stream."""

    def write_slot(self, slot: int, image: SlotImage) -> None: ...


class NoFreeLoRASlotError(RuntimeError):
    """Every slot is pinned by running requests; ask `can_allocate` before `acquire`."""


@dataclass
class _Slot:
    key: Hashable | None = None
    pins: int = 0
    ready: torch.cuda.Event | None = None  # pending host-to-device copy
    held: bool = False  # copied for a waiting request: other stages leave it
    source: SlotImage | None = None  # host tensors kept alive until the copy completes


@dataclass
class PoolCounters:
    """Monotonic counters for metrics, in total and per adapter key."""

    gpu_loads: int = 0
    gpu_evictions: int = 0
    disk_loads: int = 0
    cpu_evictions: int = 0
    gpu_loads_by_key: Counter = field(default_factory=Counter)
    gpu_evictions_by_key: Counter = field(default_factory=Counter)
    disk_loads_by_key: Counter = field(default_factory=Counter)


class LoRASlotPool:
    """LRU GPU slots with per-adapter pins, backed by an LRU host cache."""

    def __init__(
        self,
        num_slots: int,
        max_cpu_loras: int,
        writer: SlotWriter,
        loader: Callable[[Hashable], SlotImage],
        device: torch.device | str,
        saved_module_slots: int = 0,
    ) -> None:
        if max_cpu_loras < 1 or num_slots < 1:
            raise ValueError(
                f"need at least one slot and one CPU entry, got {num_slots}, {max_cpu_loras}"
            )
        if not 0 <= saved_module_slots <= num_slots:
            raise ValueError(f"{saved_module_slots} saved-module slots of {num_slots} slots")
        self.num_slots = num_slots
        self.saved_module_slots = saved_module_slots
        self.max_cpu_loras = max_cpu_loras
        self._writer = writer
        self._loader = loader
        self._device = torch.device(device)
        self._slots = [_Slot() for _ in range(num_slots)]
        self._where: dict[Hashable, int] = {}
        self._idle: OrderedDict[int, None] = OrderedDict()  # unpinned resident slots, LRU first
        self._host: OrderedDict[Hashable, SlotImage] = OrderedDict()
        self._stream = torch.cuda.Stream(self._device) if self._device.type == "cuda" else None
        self.counters = PoolCounters()

    # -- queries ------------------------------------------------------------------------------

    def slot_of(self, key: Hashable) -> int | None:
        return self._where.get(key)

    def can_allocate(self, key: Hashable) -> bool:
        """True if the adapter is resident, or a slot it may take is free or evictable without
        taking one held for another waiting request (an adapter not in the host cache yet
        counts as needing no copy slot)."""
        if key in self._where:
            return True
        wide = self._needs_wide(key)
        return (
            self._free_slot(wide) is not None or self._lru_idle(wide, spare_held=True) is not None
        )

    def needs_saved_module_slot(self, key: Hashable) -> bool:
        """Whether the host-cached adapter must sit in one of the first `saved_module_slots`."""
        return self._needs_wide(key)

    def is_ready(self, key: Hashable) -> bool:
        """True if the adapter is resident and its copy has finished (never blocks)."""
        slot = self._where.get(key)
        if slot is None:
            return False
        ready = self._slots[slot].ready
        return ready is None or ready.query()

    def gpu_resident(self) -> int:
        return len(self._where)

    def pinned(self) -> int:
        return sum(1 for s in self._slots if s.pins > 0)

    def cpu_resident(self) -> int:
        return len(self._host)

    # -- pins ---------------------------------------------------------------------------------

    def acquire(self, key: Hashable) -> int:
        """Pin `key`'s slot, loading the adapter first if it is not resident; returns the slot."""
        slot = self._where.get(key)
        if slot is None:
            wide = self._host_weights(key).needs_saved_module_slot
            slot = self._free_slot(wide)
            if slot is None:
                spare = self._lru_idle(wide, spare_held=True) is not None
                slot = self._evict_lru(wide, spare_held=spare)
            self._load(key, slot)
        self._slots[slot].pins += 1
        self._slots[slot].held = False
        self._idle.pop(slot, None)
        return slot

    def release(self, key: Hashable) -> None:
        """Drop one pin of `key`; at zero pins its slot becomes the most recently used idle one."""
        slot = self._where.get(key)
        if slot is None or self._slots[slot].pins == 0:
            raise ValueError(f"release of adapter {key!r}, which holds no pin")
        self._slots[slot].pins -= 1
        if self._slots[slot].pins == 0:
            self._idle[slot] = None

    def stage(self, key: Hashable, hold: bool = False) -> bool:
        """Start copying a host-cached adapter into a slot (a free one, else the least recently
        used idle one that no waiting request holds), without pinning it; True if it is
        resident afterwards. With `hold`, the slot is held for the caller's waiting request
        until it pins it or `unhold`. Never evicts a pinned or held slot and never reads disk
        (the adapter must be in the host cache)."""
        slot = self._where.get(key)
        if slot is None:
            if key not in self._host:
                return False
            wide = self._needs_wide(key)
            slot = self._free_slot(wide)
            if slot is None:
                if self._lru_idle(wide, spare_held=True) is None:
                    return False
                slot = self._evict_lru(wide, spare_held=True)
            self._load(key, slot)
            self._idle[slot] = None
        if hold and self._slots[slot].pins == 0:
            self._slots[slot].held = True
        return True

    def unhold(self, key: Hashable) -> None:
        """Let go of the hold a waiting request had on the adapter's slot (no-op without one)."""
        slot = self._where.get(key)
        if slot is not None:
            self._slots[slot].held = False

    def read(self, key: Hashable) -> SlotImage:
        """Read an adapter through the pool's loader, touching no cache (any thread may call
        it; the caller hands the result to `put_host`)."""
        return self._loader(key)

    def has_host(self, key: Hashable) -> bool:
        """Whether the adapter's weights are in the host cache."""
        return key in self._host

    def pins(self, key: Hashable) -> int:
        """How many pins hold the adapter's slot (0 when it is not resident)."""
        slot = self._where.get(key)
        return 0 if slot is None else self._slots[slot].pins

    def wait_ready(self) -> None:
        """Order the current stream after the pending loads of pinned slots (no host wait)."""
        for s in self._slots:
            if s.ready is not None and s.pins > 0:
                torch.cuda.current_stream(self._device).wait_event(s.ready)
                s.ready, s.source = None, None

    # -- host cache ---------------------------------------------------------------------------

    def put_host(self, key: Hashable, weights: SlotImage, *, from_disk: bool = False) -> None:
        """Insert an adapter already in host memory (e.g. just validated) into the CPU cache;
        `from_disk` counts it as a disk load (one read by a background loader)."""
        if from_disk:
            self.counters.disk_loads += 1
            self.counters.disk_loads_by_key[key] += 1
        self._host[key] = weights
        self._host.move_to_end(key)
        self._trim_host()

    def forget(self, key: Hashable) -> bool:
        """Drop an adapter from the host cache and, unless pinned, from its GPU slot.

        Returns False when a running request still pins it (it then ages out normally)."""
        self._host.pop(key, None)
        slot = self._where.get(key)
        if slot is None:
            return True
        if self._slots[slot].pins > 0:
            return False
        self._idle.pop(slot, None)
        del self._where[key]
        self._slots[slot] = _Slot()
        return True

    # -- internals ----------------------------------------------------------------------------

    def _needs_wide(self, key: Hashable) -> bool:
        weights = self._host.get(key)
        return weights is not None and weights.needs_saved_module_slot

    def _candidates(self, wide: bool) -> range | list[int]:
        """The slots an adapter may take, in order of preference: one needing module copies
        only the first `saved_module_slots`; another the rest first (keeping those free)."""
        k = self.saved_module_slots
        return range(k) if wide else [*range(k, self.num_slots), *range(k)]

    def _free_slot(self, wide: bool = False) -> int | None:
        for i in self._candidates(wide):
            if self._slots[i].key is None:
                return i
        return None

    def _lru_idle(self, wide: bool, spare_held: bool = False) -> int | None:
        """The least recently released idle slot the adapter may take (one without module
        copies first, unless it needs them), with `spare_held` none held for a waiter."""
        k = self.saved_module_slots
        first = None
        for slot in self._idle:
            if spare_held and self._slots[slot].held:
                continue
            if (slot < k) == wide:
                return slot
            if first is None:
                first = slot
        return None if wide else first

    def _evict_lru(self, wide: bool = False, spare_held: bool = False) -> int:
        slot = self._lru_idle(wide, spare_held)
        if slot is None:
            where = (
                f"the {self.saved_module_slots} module-copy" if wide else f"all {self.num_slots}"
            )
            raise NoFreeLoRASlotError(f"{where} LoRA slots are pinned by running requests")
        del self._idle[slot]
        key = self._slots[slot].key
        del self._where[key]
        self._slots[slot] = _Slot()
        self.counters.gpu_evictions += 1
        self.counters.gpu_evictions_by_key[key] += 1
        return slot

    def _host_weights(self, key: Hashable) -> SlotImage:
        weights = self._host.get(key)
        if weights is None:
            weights = self._loader(key)
            self.counters.disk_loads += 1
            self.counters.disk_loads_by_key[key] += 1
            self._host[key] = weights
            self._trim_host()
        self._host.move_to_end(key)
        return weights

    def _trim_host(self) -> None:
        while len(self._host) > self.max_cpu_loras:
            self._host.popitem(last=False)
            self.counters.cpu_evictions += 1

    def _load(self, key: Hashable, slot: int) -> None:
        weights = self._host_weights(key)
        state = _Slot(key=key)
        if self._stream is None:
            self._writer.write_slot(slot, weights)
        else:
            self._stream.wait_stream(torch.cuda.current_stream(self._device))
            with torch.cuda.stream(self._stream):
                self._writer.write_slot(slot, weights)
                state.ready = torch.cuda.Event()
                state.ready.record(self._stream)
            state.source = weights
        self._slots[slot] = state
        self._where[key] = slot
        self.counters.gpu_loads += 1
        self.counters.gpu_loads_by_key[key] += 1
