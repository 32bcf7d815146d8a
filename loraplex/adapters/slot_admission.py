"""`SlotAdmission`: whether a request's adapter can run now, and the GPU slot it holds meanwhile.

The scheduler sees only this (its `AdapterAdmission` protocol): `can_schedule` for each waiting
request each step (never blocks), `acquire_for_request` / `release_for_request` around a
request's run, `prefetch` for a queued one. Behind it: the slot pool (`adapters.slot_pool`: LRU
GPU slots with pins, the host cache, copies on a side stream) and the loader
(`adapters.loader`: disk reads on a background thread).

Loads never block a step: `can_schedule` is True only once the adapter's slot is written; until
then it starts what is missing (a read on the loader thread, or a copy from the host cache into
a free or idle slot) and the request waits in the queue, while other requests run as usual.

Slots in use are never evicted: a running request holds its adapter's slot until it finishes
(or is preempted or aborted), and so does a `PinAdapter` pin, for as long as it lasts. A slot
copied for a waiting request is held for it (no other waiter's copy takes it) while the
scheduler keeps asking for it, and let go once `HOLD_STEPS` steps pass without a question: with
more waiting adapters than idle slots, each copy runs before its slot is reused, instead of
every waiter's copy evicting the one before it while it is still in flight.

More adapters than slots: requests on resident adapters are admitted first (the scheduler skips
the others for the step). Starvation is bounded: once an adapter has waited `STARVATION_STEPS`
steps for a slot with none free or idle, one slot is drained for it (the resident adapter with
the fewest running requests that no pin holds): no new request is admitted on it until the
waiting adapter has taken a slot. So a waiting adapter gets a slot within `STARVATION_STEPS`
steps plus the remaining length of the drained adapter's running requests, per adapter ahead of
it in the FIFO of waiters.

An adapter that fails to load (its files changed or vanished, or it no longer passes
validation) fails alone: it is marked failed, never raises from `prefetch` or `can_schedule`, is
never schedulable again until registered afresh, and `take_failures` hands it to the engine,
which ends the requests queued on it with the reason; no other adapter's requests notice.
"""

from __future__ import annotations

import logging
import time
from collections import Counter, OrderedDict

from loraplex.adapters.adapter_names import AdapterNames
from loraplex.adapters.adapter_stats import AdapterStats
from loraplex.adapters.errors import without_path
from loraplex.adapters.loader import AdapterLoader
from loraplex.adapters.slot_pool import LoRASlotPool

logger = logging.getLogger(__name__)

#: slot value of a token that runs the base model only
BASE_SLOT = -1
#: steps an adapter waits for a slot, with none free or idle, before one slot is drained for it
STARVATION_STEPS = 16
#: steps a slot copied for a waiting request stays held for it after the last time it was asked
HOLD_STEPS = 8
_PIN_PREFIX = "\x00pin:"  # the holder id of a PinAdapter pin (no request id starts with NUL)


class SlotAdmission:
    """Admission of requests by their adapters' GPU slots, pins and the starvation bound."""

    def __init__(
        self,
        pool: LoRASlotPool,
        names: AdapterNames,
        loader: AdapterLoader,
        stats: AdapterStats,
    ) -> None:
        self.pool = pool
        self._names = names
        self._loader = loader
        self._stats = stats
        self._held: dict[str, str] = {}  # holder (request id, or a pin's) -> key
        self._pins: dict[str, str] = {}  # pinned name -> key
        self._unheld_pins: set[str] = set()  # pinned names whose slot is not held yet
        self._failed: dict[str, str] = {}  # key -> why it failed to load (tenant-safe text)
        self._new_failures: dict[str, str] = {}  # failed since the last `take_failures`
        self._steps = 0
        self._waiters: OrderedDict[str, int] = OrderedDict()  # key -> step it began waiting
        self._draining: str | None = None  # a resident key admitting no new request
        self._holds: dict[str, int] = {}  # key staged for a waiter -> the step it was last asked

    # -- the scheduler's interface ------------------------------------------------------------

    def can_schedule(self, key: str | None) -> bool:
        """Whether a request with this adapter can run now: its slot is written (never blocks).

        Otherwise its load is started (disk -> host on the loader thread, or host -> a free or
        idle GPU slot on the side stream) and the request waits in the queue; an adapter that
        fails to load is marked failed (see `take_failures`) and is never schedulable."""
        if key is None:
            return True
        if key in self._failed or key == self._draining:
            return False
        if self.pool.slot_of(key) is None:
            if not self.pool.has_host(key):
                self._start_read(key)
                return False
            self._stats.of(key).load_asked()
            if not self.pool.stage(key, hold=True):
                self._waiters.setdefault(key, self._steps)
                return False
        if self.pool.pins(key) == 0:
            self._holds[key] = self._steps  # a waiter asks for it: no other waiter's copy takes it
            self.pool.stage(key, hold=True)
        self._waiters.pop(key, None)
        if self._draining is not None and not self._waiters:
            self._draining = None
        if not self.pool.is_ready(key):
            return False
        stats = self._stats.of(key)
        if stats.load_started is not None:
            stats.load_ready()
        return True

    def acquire_for_request(self, request_id: str, key: str | None) -> int:
        """Pin the adapter's slot for a request (idempotent); returns the slot, -1 for base.

        Ask `can_schedule` first: then the adapter is resident and this only pins it. A copy
        that fails (an adapter acquired without asking) marks the adapter failed and raises."""
        if key is None:
            return BASE_SLOT
        held = self._held.get(request_id)
        if held is not None:
            if held != key:
                raise ValueError(f"request {request_id} already holds adapter {held}")
            return self.pool.slot_of(key)  # type: ignore[return-value]
        try:
            slot = self.pool.acquire(key)
        except Exception as error:
            self._fail(key, error)
            raise
        self._holds.pop(key, None)
        self._held[request_id] = key
        self._stats.of(key).last_used = time.time()
        # NOTE: a slot written without `can_schedule` may still be copying: the device waits
        # for it before the next step's work (no host wait).
        self.pool.wait_ready()
        return slot

    def release_for_request(self, request_id: str) -> None:
        """Unpin the request's adapter (finished, aborted or preempted); no-op for base."""
        key = self._held.pop(request_id, None)
        if key is None:
            return
        self.pool.release(key)
        self._stats.of(key).last_used = time.time()
        self.drop_if_unused(key)  # removed or replaced while this request ran

    def prefetch(self, key: str | None) -> None:
        """Start reading a queued request's adapter into the host cache, evicting nothing."""
        if key is None or key in self._failed:
            return
        if not self.pool.has_host(key) and self.pool.slot_of(key) is None:
            self._start_read(key)

    # -- the owner's interface ----------------------------------------------------------------

    def poll(self) -> None:
        """Once per step, on the engine thread: take the loader's finished reads into the host
        cache (copying one ahead into a free slot) or mark their adapters failed, give pinned
        adapters their slots, and drain a slot for an adapter that waited too long."""
        self._steps += 1
        for key, result in self._loader.take_finished():
            if isinstance(result, Exception):
                self._fail(key, result)
            elif key not in self._failed:
                self.pool.put_host(key, result, from_disk=True)
                if self.pool.num_slots > self.pool.gpu_resident():
                    self.pool.stage(key)  # a free slot: copy ahead of need, evicting nothing
        self._hold_pins()
        self._check_starvation()
        for key, asked in list(self._holds.items()):
            if self._steps - asked > HOLD_STEPS:
                del self._holds[key]
                self.pool.unhold(key)

    def pin(self, name: str, key: str) -> None:
        """Hold the slot of `name`'s adapter (loading it as soon as it can be) until `unpin`."""
        self._pins[name] = key
        self._unheld_pins.add(name)
        self.prefetch(key)
        self._hold_pins()

    def unpin(self, name: str) -> None:
        """Let `name`'s slot go (no-op when it is not pinned)."""
        if self._pins.pop(name, None) is not None:
            self._unheld_pins.discard(name)
            self.release_for_request(_PIN_PREFIX + name)

    def is_pinned(self, name: str) -> bool:
        return name in self._pins

    @property
    def num_pins(self) -> int:
        return len(self._pins)

    def drop_if_unused(self, key: str) -> None:
        """Forget a version no registered name and no running request or pin uses any more."""
        if self._names.uses(key) or self.pool.pins(key):
            return
        self.pool.forget(key)
        self._failed.pop(key, None)
        self._waiters.pop(key, None)
        self._holds.pop(key, None)
        if self._draining == key:
            self._draining = None

    def failure(self, key: str) -> str | None:
        """Why the adapter failed to load (None: it did not)."""
        return self._failed.get(key)

    def clear_failure(self, key: str) -> None:
        """Give a version registered afresh a new chance."""
        self._failed.pop(key, None)

    def take_failures(self) -> dict[str, str]:
        """Adapters (key -> reason) that failed to load since the last call; the engine ends
        the requests queued on them with the reason. Requests added later are refused."""
        failures, self._new_failures = self._new_failures, {}
        return failures

    def running_requests(self) -> Counter[str]:
        """Requests running per adapter key (pins not counted)."""
        return Counter(k for holder, k in self._held.items() if not holder.startswith("\x00"))

    def held_keys(self) -> set[str]:
        """The adapter keys whose slots a running request or a pin holds."""
        return set(self._held.values())

    # -- internals ----------------------------------------------------------------------------

    def _start_read(self, key: str) -> None:
        if self._loader.start(key):
            self._stats.of(key).load_asked()

    def _hold_pins(self) -> None:
        """Give each pinned adapter its pin as soon as its slot is written (per step: only the
        pins not taken yet are looked at)."""
        for name in list(self._unheld_pins):
            key = self._pins[name]
            if self.can_schedule(key):
                self.acquire_for_request(_PIN_PREFIX + name, key)
                self._unheld_pins.discard(name)

    def _check_starvation(self) -> None:
        """Drain one slot for the adapter that has waited longest, once it waited too long."""
        if self._draining is not None and not self._waiters:
            self._draining = None
        if self._draining is not None or not self._waiters:
            return
        key, since = next(iter(self._waiters.items()))
        if self._steps - since < STARVATION_STEPS or self.pool.can_allocate(key):
            return
        pinned_keys = set(self._pins.values())
        running = self.running_requests()
        candidates = [k for k in running if k not in pinned_keys and k != key]
        if self.pool.needs_saved_module_slot(key):  # only a module-copy slot will do
            limit = self.pool.saved_module_slots
            candidates = [k for k in candidates if (self.pool.slot_of(k) or 0) < limit]
        if candidates:
            self._draining = min(
                candidates, key=lambda k: (running[k], self._stats.of(k).last_used)
            )
            logger.info("adapter %s waited %d steps for a slot; draining %s", key,
                        self._steps - since, self._draining)  # fmt: skip

    def _fail(self, key: str, error: Exception) -> None:
        path = self._names.path_of(key) or ""
        reason = without_path(str(error), path) if path else str(error)
        message = f"the adapter failed to load: {reason}"
        logger.warning("adapter %s (%s) failed to load: %s", key, path, error)
        self._failed[key] = message
        self._new_failures[key] = message
        self._waiters.pop(key, None)
        self._holds.pop(key, None)
        self._stats.of(key).load_started = None
        self.pool.forget(key)
