"""SlotAdmission: slots in use never evicted, LRU reuse of idle slots, pins, the starvation bound,
reads on the real loader thread, and failures that stay with their adapter. Adapters here are
tiny stand-in slot images (no model): what is tested is who gets which slot when."""

from __future__ import annotations

import dataclasses
import threading

import pytest
import torch
from lora_fixtures import finish_reads

from loraplex.adapters.adapter_names import AdapterNames, key_from_digest
from loraplex.adapters.adapter_stats import AdapterStats
from loraplex.adapters.loader import AdapterLoader
from loraplex.adapters.peft_format import LoRAWeights
from loraplex.adapters.slot_admission import HOLD_STEPS, STARVATION_STEPS, SlotAdmission
from loraplex.adapters.slot_memory import SlotImage
from loraplex.adapters.slot_pool import LoRASlotPool
from loraplex.platform.core.commands import AddAdapter

ADAPTERS = "abcde"  # adapter names; "e" needs a slot holding module copies


def key(name: str) -> str:
    return key_from_digest(name * 64)


class RecordingWriter:
    """Stands in for the model's LoRA layers: remembers which adapter each slot holds."""

    def __init__(self) -> None:
        self.slots: dict[int, str] = {}

    def write_slot(self, slot: int, image: SlotImage) -> None:
        self.slots[slot] = image.path


class World:
    """A `SlotAdmission` over a real pool and loader thread, with `ADAPTERS` registered."""

    def __init__(self, num_slots: int = 2, saved_module_slots: int = 0) -> None:
        self.reads: list[str] = []
        self.broken: set[str] = set()  # names whose reads fail
        self.gate = threading.Event()  # reads of "slow" adapters wait for it
        self.slow: set[str] = set()
        self.gate.set()
        self.names = AdapterNames()
        for name in ADAPTERS:
            self.names.add(AddAdapter(name, f"/srv/adapters/{name}"), key(name), on_sight=False)
        self.writer = RecordingWriter()
        self.pool = LoRASlotPool(num_slots, 8, self.writer, self._read, "cpu", saved_module_slots)
        self.loader = AdapterLoader(self.pool.read)
        self.stats = AdapterStats()
        self.admission = SlotAdmission(self.pool, self.names, self.loader, self.stats)

    def _read(self, adapter_key: str) -> SlotImage:
        name = next(n for n in ADAPTERS if key(n) == adapter_key)
        if name in self.slow:
            assert self.gate.wait(60)
        self.reads.append(name)
        if name in self.broken:
            raise OSError(f"/srv/adapters/{name}/adapter_model.safetensors: I/O error")
        image = SlotImage(name, name * 64, torch.zeros(8), torch.zeros(2, 1, dtype=torch.int32))
        if name == "e":
            extras = LoRAWeights(name, name, {}, saved={"lm_head": torch.zeros(8, 4)})
            image = dataclasses.replace(image, extras=extras)
        return image

    def cache_all(self) -> None:
        """Every adapter into the host cache (what the loader thread's reads lead to), no slot
        written yet."""
        for name in ADAPTERS:
            self.pool.put_host(key(name), self.pool.read(key(name)))

    def resident(self) -> set[str]:
        return {n for n in ADAPTERS if self.pool.slot_of(key(n)) is not None}

    def run(self, op: tuple[str, ...]) -> None:
        """One step of a table: ("run", request, adapter) asserts the adapter is schedulable
        and acquires it; ("end", request); ("waits", adapter) asserts it is not schedulable;
        ("pin", adapter), ("unpin", adapter); ("poll",) one engine step."""
        verb, *args = op
        if verb == "run":
            request, name = args
            assert self.admission.can_schedule(key(name)), op
            slot = self.admission.acquire_for_request(request, key(name))
            assert self.writer.slots[slot] == name
        elif verb == "end":
            self.admission.release_for_request(args[0])
        elif verb == "waits":
            assert not self.admission.can_schedule(key(args[0])), op
        elif verb == "pin":
            self.admission.pin(args[0], key(args[0]))
        elif verb == "unpin":
            self.admission.unpin(args[0])
        elif verb == "poll":
            self.admission.poll()
        else:
            raise ValueError(op)


@pytest.fixture
def world():
    world = World()
    yield world
    world.loader.shutdown()


EVICTION_CASES = {
    "the least recently released idle slot is reused": (
        [("run", "r1", "a"), ("run", "r2", "b"), ("end", "r2"), ("end", "r1"),
         ("run", "r3", "c")], {"a", "c"}),
    "released the other way round": (
        [("run", "r1", "a"), ("run", "r2", "b"), ("end", "r1"), ("end", "r2"),
         ("run", "r3", "c")], {"b", "c"}),
    "slots in use are never evicted": (
        [("run", "r1", "a"), ("run", "r2", "b"), ("waits", "c"), ("waits", "c")], {"a", "b"}),
    "a shared slot is in use until its last request ends": (
        [("run", "r1", "a"), ("run", "r2", "a"), ("run", "r3", "b"), ("end", "r1"),
         ("waits", "c"), ("end", "r2"), ("run", "r4", "c")], {"b", "c"}),
    "an idle slot is taken once its request ends": (
        [("run", "r1", "a"), ("run", "r2", "b"), ("waits", "c"), ("end", "r2"),
         ("run", "r3", "c")], {"a", "c"}),
    "a pinned adapter is never evicted": (
        [("pin", "a"), ("run", "r1", "b"), ("end", "r1"), ("run", "r2", "c"), ("end", "r2"),
         ("run", "r3", "d")], {"a", "d"}),
    "an unpinned adapter is evictable again": (
        [("pin", "a"), ("run", "r1", "b"), ("unpin", "a"), ("end", "r1"), ("run", "r2", "c")],
        {"b", "c"}),
    "a pinned adapter's requests share its slot": (
        [("pin", "a"), ("run", "r1", "a"), ("run", "r2", "b"), ("end", "r1"), ("waits", "c")],
        {"a", "b"}),
}  # fmt: skip


@pytest.mark.parametrize("case", EVICTION_CASES)
def test_slots_in_use_stay_and_idle_ones_are_reused_least_recently_released_first(world, case):
    ops, resident = EVICTION_CASES[case]
    world.cache_all()
    for op in ops:
        world.run(op)
    assert world.resident() == resident


# (ops before the bound, adapter that drains, request ends that let the waiter in)
STARVATION_CASES = {
    "the adapter with the fewest running requests drains": (
        [("run", "a1", "a"), ("run", "b1", "b"), ("run", "b2", "b")], "a", ["a1"]),
    "a pinned adapter never drains, however few its requests": (
        [("pin", "a"), ("run", "a1", "a"), ("run", "b1", "b"), ("run", "b2", "b")], "b",
        ["b1", "b2"]),
    "on a tie, the adapter used least recently drains": (
        [("run", "a1", "a"), ("run", "b1", "b"), ("end", "a1"), ("run", "a2", "a")], "b",
        ["b1"]),
}  # fmt: skip


@pytest.mark.parametrize("case", STARVATION_CASES)
def test_a_waiting_adapter_gets_a_slot_within_the_starvation_bound(world, case):
    ops, drains, ends = STARVATION_CASES[case]
    world.cache_all()
    for op in ops:
        world.run(op)
    other = ({"a", "b"} - {drains}).pop()
    world.run(("waits", "c"))  # every slot in use: c waits from this step on
    for _ in range(STARVATION_STEPS - 1):
        world.run(("poll",))
        world.run(("waits", "c"))
        assert world.admission.can_schedule(key(drains))  # no drain before the bound
    world.run(("poll",))  # c has waited long enough: one slot drains
    world.run(("waits", drains))
    world.run(("run", "more", other))  # the other adapter keeps admitting
    world.run(("waits", "c"))
    for request in ends:
        world.run(("end", request))
    world.run(("run", "c1", "c"))
    assert world.resident() == {other, "c"}
    world.run(("waits", drains))  # the drained adapter now waits its turn like c did


def test_an_adapter_with_module_copies_drains_a_copy_slot():
    """Slot 0 of 2 holds module copies: "e" (trained token rows) waiting for it drains the
    copy slot's adapter, not the plain one with fewer requests."""
    world = World(saved_module_slots=1)
    world.cache_all()
    world.run(("run", "b1", "b"))  # plain adapters leave slot 0 free
    world.run(("run", "a1", "a"))  # ...until they have to take it
    world.run(("run", "a2", "a"))
    assert world.pool.slot_of(key("a")) == 0 and world.pool.slot_of(key("b")) == 1
    world.run(("waits", "e"))
    for _ in range(STARVATION_STEPS):
        world.run(("poll",))
    world.run(("waits", "a"))
    world.run(("run", "b2", "b"))
    world.run(("end", "a1"))
    world.run(("end", "a2"))
    world.run(("run", "e1", "e"))
    assert world.pool.slot_of(key("e")) == 0
    world.loader.shutdown()


def test_reads_run_on_the_loader_thread_and_the_request_waits_meanwhile(world):
    world.slow.add("a")
    world.gate.clear()
    world.run(("waits", "a"))  # starts the read: a waits in the queue, b is not held up
    world.run(("waits", "b"))
    assert world.loader.is_reading(key("a")) and world.loader.num_in_flight == 2
    world.run(("poll",))
    assert world.reads == [] and world.admission.can_schedule(key("a")) is False
    world.gate.set()
    finish_reads(world.admission, world.loader)
    assert world.reads == ["a", "b"] and world.resident() == {"a", "b"}  # copied ahead
    world.run(("run", "r1", "a"))
    stats = world.stats.of(key("a"))
    assert stats.latency_count == 1 and stats.load_started is None and stats.last_used > 0


def test_an_adapter_that_fails_to_load_fails_alone(world):
    world.broken.add("a")
    world.run(("waits", "a"))
    world.admission.prefetch(key("b"))
    finish_reads(world.admission, world.loader)
    failures = world.admission.take_failures()
    assert list(failures) == [key("a")] and world.admission.take_failures() == {}
    assert "failed to load" in failures[key("a")] and "I/O error" in failures[key("a")]
    assert "/srv/adapters" not in failures[key("a")]  # no server path in what a tenant sees
    world.run(("waits", "a"))
    world.admission.prefetch(key("a"))  # never raises, never reads again
    assert world.loader.num_in_flight == 0 and world.reads == ["a", "b"]
    world.run(("run", "r1", "b"))
    world.broken.clear()
    world.admission.clear_failure(key("a"))  # registered afresh
    world.run(("waits", "a"))
    finish_reads(world.admission, world.loader)
    world.run(("run", "r2", "a"))


def test_a_request_is_admitted_only_once_its_slot_copy_has_completed(world, monkeypatch):
    class PendingCopy:  # stands in for the side stream's CUDA event
        done = False

        def query(self) -> bool:
            return self.done

    copy = PendingCopy()
    load = world.pool._load

    def load_on_a_side_stream(k, slot):
        load(k, slot)
        world.pool._slots[slot].ready = copy

    monkeypatch.setattr(world.pool, "_load", load_on_a_side_stream)
    world.pool.put_host(key("a"), world.pool.read(key("a")))
    world.run(("waits", "a"))  # the copy starts: the request waits in the queue
    slot = world.pool.slot_of(key("a"))
    assert slot is not None
    world.run(("waits", "a"))
    copy.done = True
    assert world.admission.can_schedule(key("a")) and world.pool.slot_of(key("a")) == slot


def test_a_version_no_name_and_no_request_uses_is_dropped(world):
    world.cache_all()
    world.run(("run", "r1", "a"))
    world.names.remove("a")
    world.admission.drop_if_unused(key("a"))
    assert "a" in world.resident()  # still serving r1
    world.run(("end", "r1"))
    assert "a" not in world.resident() and not world.pool.has_host(key("a"))


class _PendingCopy:  # stands in for the side stream's CUDA event
    def query(self) -> bool:
        return False


def _copies_in_flight(world, monkeypatch) -> None:
    """Every slot copy stays pending until `_copies_done`."""
    load = world.pool._load

    def load_on_a_side_stream(k, slot):
        load(k, slot)
        world.pool._slots[slot].ready = _PendingCopy()

    monkeypatch.setattr(world.pool, "_load", load_on_a_side_stream)


def _copies_done(world) -> None:
    for slot in world.pool._slots:
        slot.ready = None


def test_waiters_on_more_adapters_than_slots_do_not_evict_each_others_copies(world, monkeypatch):
    """Two slots, four waiting adapters asked in queue order every step while the first two
    copies are in flight: the later two wait instead of evicting them (the H200's 256 adapters
    on 64 slots made 31,880 slot copies for 256 requests before), and take the slots as the
    first two's requests end."""
    _copies_in_flight(world, monkeypatch)
    world.cache_all()
    for _ in range(3):
        for name in "abcd":
            world.run(("waits", name))
        world.run(("poll",))
    assert world.pool.counters.gpu_loads == 2 and world.resident() == {"a", "b"}
    _copies_done(world)
    world.run(("run", "a1", "a"))
    world.run(("run", "b1", "b"))
    world.run(("waits", "c"))
    world.run(("waits", "d"))
    world.run(("end", "a1"))
    world.run(("waits", "c"))  # its copy into a's slot starts
    world.run(("waits", "d"))  # ... and d's does not take it over
    assert world.resident() == {"b", "c"}
    _copies_done(world)
    world.run(("run", "c1", "c"))
    assert world.pool.counters.gpu_loads == 3


def test_a_hold_nobody_asks_for_any_more_is_let_go(world, monkeypatch):
    """A waiter that stops asking (its request aborted) holds its slot for `HOLD_STEPS` steps
    only; then another waiter's copy takes it."""
    _copies_in_flight(world, monkeypatch)
    world.cache_all()
    world.run(("waits", "a"))
    world.run(("waits", "b"))
    for _ in range(HOLD_STEPS):
        world.run(("poll",))
        world.run(("waits", "b"))
        world.run(("waits", "c"))
        assert world.resident() == {"a", "b"}
    world.run(("poll",))
    world.run(("waits", "b"))
    world.run(("waits", "c"))
    assert world.resident() == {"b", "c"}
