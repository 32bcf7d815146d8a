"""`LoRAManager`: the adapters of one engine, owned by the engine alone.

It ties together the registry of known adapters (name -> folder), their validation, the CPU
cache and GPU slot pool, and the model's LoRA layers (through their slot writer). The engine
builds it and runs the adapter commands on it (`register`, `remove_adapter`, `pin`,
`stats_report`); the scheduler sees only its admission interface (`can_schedule`,
`acquire_for_request` / `release_for_request`, `prefetch`); the runner never sees it (it writes
each step's slots into the LoRA layers' batch metadata); prefix caching hashes blocks with
`adapter_key`.

Loads never block a step (with `background_loads`, as the engine builds it): reading and
validating an adapter from disk runs on a loader thread, started by the first request (or the
registration) that needs it; `poll` (once per step) takes the finished reads into the host
cache; the copy into a GPU slot runs on a side stream. `can_schedule` is True only once the
adapter's slot is written, so its requests wait in the queue meanwhile and the step that first
uses it never waits; other requests run as usual.

More adapters than slots: requests on resident adapters are admitted first (the scheduler
skips the others for the step). Starvation is bounded: once an adapter has waited
`STARVATION_STEPS` steps for a slot with none free or idle, the manager drains one slot (the
resident adapter with the fewest running requests that no `PinAdapter` holds): no new request
is admitted on it until the waiting adapter has taken a slot. So a waiting adapter gets a slot
within `STARVATION_STEPS` steps plus the remaining length of the drained adapter's running
requests, per adapter ahead of it in the FIFO of waiters.

A registered adapter that fails to load later (its files changed or vanished, or it no longer
passes validation) fails alone: the manager marks it failed, never raises from `prefetch` or
`can_schedule`, refuses new requests on it, and hands the engine `take_failures()` so that the
requests already queued on it end with the error; no other adapter's requests notice.
"""

from __future__ import annotations

import bisect
import logging
import os
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Hashable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, replace

import torch

from loraplex.adapters.adapter_tokenizer import TOKENIZER_FILES
from loraplex.adapters.errors import (
    AdapterLoadError,
    AdapterNotFoundError,
    AdapterValidationError,
    without_path,
)
from loraplex.adapters.lora_layer import LoRAModelState
from loraplex.adapters.peft_format import (
    CONFIG_FILE,
    WEIGHTS_FILE,
    BaseModelSpec,
    LoRAWeights,
)
from loraplex.adapters.request import LoRARequest
from loraplex.adapters.slot_memory import SlotImage
from loraplex.adapters.slot_pool import LoRASlotPool
from loraplex.adapters.validator import AdapterValidator
from loraplex.config import LoRAConfig
from loraplex.platform.core.commands import (
    LOAD_LATENCY_BUCKETS_S,
    AdapterAdded,
    AdapterStat,
    AdapterStatsReport,
    AddAdapter,
)
from loraplex.platform.core.stats import LoRAStats

logger = logging.getLogger(__name__)

#: slot value of a token that runs the base model only
BASE_SLOT = -1
#: steps an adapter waits for a slot, with none free or idle, before one slot is drained for it
STARVATION_STEPS = 16
_PIN_PREFIX = "\x00pin:"  # the holder id of a PinAdapter pin (no request id starts with NUL)


@dataclass(frozen=True)
class _Entry:
    path: str
    key: str
    fingerprint: tuple[int, ...]  # (mtime_ns, size) of both files, to notice replacement
    managed: bool = False  # registered by an AddAdapter command (not on sight of a request)
    tenant: str = ""
    label: str = ""
    pinned: bool = False


@dataclass
class _KeyStats:
    """Per adapter version: what the counters of the pool do not know."""

    last_used: float = 0.0  # unix time
    load_started: float | None = None  # monotonic time the pending load was asked for
    latency_counts: list[int] = field(default_factory=lambda: [0] * len(LOAD_LATENCY_BUCKETS_S))
    latency_sum_s: float = 0.0
    latency_count: int = 0

    def observe(self, seconds: float) -> None:
        self.latency_counts[bisect.bisect_left(LOAD_LATENCY_BUCKETS_S, seconds)] += 1
        self.latency_sum_s += seconds
        self.latency_count += 1


def _fingerprint(path: str) -> tuple[int, ...]:
    """The adapter files' times and sizes (its tokenizer's too): a change re-registers it."""
    try:
        stats = [os.stat(os.path.join(path, f)) for f in (CONFIG_FILE, WEIGHTS_FILE)]
    except OSError:
        return ()
    for name in TOKENIZER_FILES:
        try:
            stats.append(os.stat(os.path.join(path, name)))
        except OSError:
            pass
    return tuple(v for st in stats for v in (st.st_mtime_ns, st.st_size))


class LoRAManager:
    """Registry, validation, caches and slots of the LoRA adapters of one model."""

    def __init__(
        self,
        config: LoRAConfig,
        spec: BaseModelSpec,
        model_state: LoRAModelState,
        dtype: torch.dtype,
        *,
        background_loads: bool = False,
        base_tokenizer: str = "",
    ) -> None:
        """`background_loads`: read adapters from disk on a loader thread (the engine's way);
        without it `can_schedule` reads them inline (simple, for tests and tools).
        `base_tokenizer`: the folder of the base model's tokenizer.json ("": none), which an
        adapter's own tokenizer must agree with."""
        model_state.check_spec(spec)
        if model_state.saved_module_slots != config.max_saved_module_loras:
            raise ValueError(
                f"max_saved_module_loras={config.max_saved_module_loras}, but the model holds "
                f"{model_state.saved_module_slots} slots of embed_tokens / lm_head copies"
            )
        self.config = config
        self.spec = spec
        self.base_tokenizer = base_tokenizer
        self._state = model_state
        self._dtype = dtype
        self._device = model_state.meta.workspace.device
        self._entries: dict[str, _Entry] = {}
        self._paths: dict[str, str] = {}  # key -> folder, for reloads after CPU eviction
        self._held: dict[str, str] = {}  # request id -> key
        self._failed: dict[str, str] = {}  # key -> why it failed to load (tenant-safe text)
        self._new_failures: dict[str, str] = {}  # failed since the last `take_failures`
        self.pool = LoRASlotPool(
            config.max_loras,
            config.max_cpu_loras,
            model_state,
            self._reload,
            self._device,
            config.max_saved_module_loras,
        )
        self._removed: set[str] = set()  # names a RemoveAdapter command took away
        self._stats: dict[str, _KeyStats] = {}
        self._executor = (
            ThreadPoolExecutor(1, thread_name_prefix="loraplex-adapter-loader")
            if background_loads
            else None
        )
        self._pending: dict[str, Future] = {}  # key -> read under way on the loader thread
        self._load_done = threading.Event()  # set by the loader thread when a read finishes
        self._steps = 0
        self._waiters: OrderedDict[str, int] = OrderedDict()  # key -> step it began waiting
        self._draining: str | None = None  # a resident key admitting no new request
        self._unheld_pins: set[str] = set()  # pinned names whose pin is not taken yet

    # -- registry -----------------------------------------------------------------------------

    def add_adapter(self, request: LoRARequest) -> str:
        """Validate and register an adapter (replacing one of the same name); returns its key.

        Raises `AdapterValidationError` if the adapter cannot be served."""
        weights = self._load(request.lora_path)
        key = "lora-" + weights.digest[:32]
        self._failed.pop(key, None)  # validated afresh: a new chance
        old = self._entries.get(request.lora_name)
        self._entries[request.lora_name] = _Entry(
            request.lora_path, key, _fingerprint(request.lora_path)
        )
        self._paths[key] = request.lora_path
        self._removed.discard(request.lora_name)
        self.pool.put_host(key, weights)
        if old is not None and old.key != key and not self._key_in_use(old.key):
            self._drop_if_unused(old.key)
        return key

    def register(self, command: AddAdapter) -> AdapterAdded:
        """Run an `AddAdapter` command: register (or replace) the adapter under its name.

        With the content digest given, nothing is read here: the key follows from the digest
        and the loader reads and validates the files ahead of the first request (a mismatch
        fails the adapter's load). Without it the files are read and validated now.
        Raises `AdapterValidationError`."""
        if command.digest:
            key = "lora-" + command.digest[:32]
        else:
            weights = self._load(command.path)
            key = "lora-" + weights.digest[:32]
            self.pool.put_host(key, weights)
        old = self._entries.get(command.name)
        if old is not None and old.pinned:
            self._unpin(command.name)
        self._failed.pop(key, None)
        self._entries[command.name] = _Entry(
            command.path, key, _fingerprint(command.path), True,
            command.tenant, command.label, False,
        )  # fmt: skip
        self._paths[key] = command.path
        self._removed.discard(command.name)
        if old is not None and old.key != key and not self._key_in_use(old.key):
            self._drop_if_unused(old.key)
        if command.pinned:
            self.pin(command.name, True)
        elif self.pool.cpu_resident() < self.pool.max_cpu_loras:
            self.prefetch(key)  # room in the host cache: read it ahead of its first request
        return AdapterAdded(command.name, key, old is not None)

    def pin(self, name: str, pinned: bool = True) -> bool:
        """Keep the adapter in a GPU slot (loaded as soon as it can be) or release it; False if
        no adapter has that name. Raises ValueError when pinning would leave no slot for the
        other adapters."""
        entry = self._entries.get(name)
        if entry is None:
            return False
        if pinned == entry.pinned:
            return True
        if pinned:
            num_pinned = sum(e.pinned for e in self._entries.values())
            if num_pinned + 1 >= self.pool.num_slots:
                raise ValueError(
                    f"cannot pin {name!r}: {num_pinned} of {self.pool.num_slots} GPU slots are "
                    "pinned already, and one must stay for the other adapters"
                )
            self._entries[name] = replace(entry, pinned=True)
            self._unheld_pins.add(name)
            self.prefetch(entry.key)
            self._hold_pins()
        else:
            self._unpin(name)
        return True

    def _unpin(self, name: str) -> None:
        entry = self._entries[name]
        self._entries[name] = replace(entry, pinned=False)
        self._unheld_pins.discard(name)
        self.release_for_request(_PIN_PREFIX + name)

    def _hold_pins(self) -> None:
        """Give each pinned adapter its pin as soon as its slot is written (per step: only the
        pins not taken yet are looked at)."""
        for name in list(self._unheld_pins):
            key = self._entries[name].key
            if self.can_schedule(key):
                self.acquire_for_request(_PIN_PREFIX + name, key)
                self._unheld_pins.discard(name)

    def remove_adapter(self, lora_name: str) -> bool:
        """Unregister an adapter; running requests keep their slot until they finish."""
        entry = self._entries.get(lora_name)
        if entry is None:
            return False
        if entry.pinned:
            self._unpin(lora_name)
        del self._entries[lora_name]
        if entry.managed:
            self._removed.add(lora_name)
        if not self._key_in_use(entry.key):
            self._drop_if_unused(entry.key)
        return True

    def _drop_if_unused(self, key: str) -> None:
        """Forget a key no registered name and no running request uses any more."""
        if any(e.key == key for e in self._entries.values()) or self._key_in_use(key):
            return
        self.pool.forget(key)
        self._failed.pop(key, None)
        self._waiters.pop(key, None)
        if self._draining == key:
            self._draining = None

    def list_adapters(self) -> dict[str, str]:
        """Registered adapter names and their keys."""
        return {name: e.key for name, e in self._entries.items()}

    def adapter_key(self, request: LoRARequest | None) -> str | None:
        """The identity of the adapter's weights (a content hash), None for the base model.

        Registers the adapter on first sight, and again when its folder or files changed.
        Raises `AdapterValidationError` (`AdapterLoadError` for one that failed to load)."""
        if request is None:
            return None
        entry = self._entries.get(request.lora_name)
        if entry is None and request.lora_name in self._removed:
            raise AdapterNotFoundError(f"The adapter `{request.lora_name}` was removed.")
        if entry is None or (
            not entry.managed
            and (
                entry.path != request.lora_path
                or entry.fingerprint != _fingerprint(request.lora_path)
            )
        ):
            return self.add_adapter(request)
        failure = self._failed.get(entry.key)
        if failure is not None:
            raise AdapterLoadError(failure)
        return entry.key

    # -- scheduling ---------------------------------------------------------------------------

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
                if not self.pool.has_host(key):
                    return False
            self._stats_of(key).load_started = self._stats_of(key).load_started or time.monotonic()
            if not self.pool.stage(key):
                self._wait_for_slot(key)
                return False
        self._waiters.pop(key, None)
        if self._draining is not None and not self._waiters:
            self._draining = None
        if not self.pool.is_ready(key):
            return False
        stats = self._stats_of(key)
        if stats.load_started is not None:
            stats.observe(time.monotonic() - stats.load_started)
            stats.load_started = None
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
        self._held[request_id] = key
        self._stats_of(key).last_used = time.time()
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
        self._stats_of(key).last_used = time.time()
        self._drop_if_unused(key)  # removed or replaced while this request ran

    def prefetch(self, key: str | None) -> None:
        """Warm the caches for a waiting request's adapter without evicting a resident one."""
        if key is None or key in self._failed:
            return
        if self._executor is not None:
            if not self.pool.has_host(key) and self.pool.slot_of(key) is None:
                self._start_read(key)
            return
        try:
            self.pool.prefetch(key)
        except Exception as error:
            self._fail(key, error)

    def poll(self) -> None:
        """Once per step, on the engine thread: take the loader's finished reads into the host
        cache (or mark their adapters failed), and give pinned adapters their slots."""
        self._steps += 1
        self._load_done.clear()
        for key, future in list(self._pending.items()):
            if not future.done():
                continue
            del self._pending[key]
            try:
                weights = future.result()
            except Exception as error:
                self._fail(key, error)
                continue
            if key in self._paths and key not in self._failed:
                self.pool.put_host(key, weights, from_disk=True)
                if self.pool.num_slots > self.pool.gpu_resident():
                    self.pool.stage(key)  # a free slot: copy ahead of need, evicting nothing
        self._hold_pins()
        self._check_starvation()

    def wait_for_loads(self, timeout_s: float) -> bool:
        """Block up to `timeout_s` for a read under way to finish (the engine calls this when
        a step had nothing to run but requests wait for adapters); False on timeout."""
        if not self._pending:
            return False
        return self._load_done.wait(timeout_s)

    def _start_read(self, key: str) -> None:
        """Read the adapter into the host cache: on the loader thread, or now without one."""
        if key in self._pending:
            return
        if self._executor is None:
            try:
                self.pool.load_host(key)
            except Exception as error:
                self._fail(key, error)
            return
        stats = self._stats_of(key)
        stats.load_started = stats.load_started or time.monotonic()
        future = self._executor.submit(self.pool.read, key)
        future.add_done_callback(lambda _: self._load_done.set())
        self._pending[key] = future

    def _wait_for_slot(self, key: str) -> None:
        self._waiters.setdefault(key, self._steps)

    def _check_starvation(self) -> None:
        """Drain one slot for the adapter that has waited longest, once it waited too long."""
        if self._draining is not None and not self._waiters:
            self._draining = None
        if self._draining is not None or not self._waiters:
            return
        key, since = next(iter(self._waiters.items()))
        if self._steps - since < STARVATION_STEPS or self.pool.can_allocate(key):
            return
        pinned_keys = {e.key for e in self._entries.values() if e.pinned}
        running = Counter(k for holder, k in self._held.items() if not holder.startswith("\x00"))
        candidates = [k for k in running if k not in pinned_keys and k != key]
        if self.pool.needs_saved_module_slot(key):  # only a module-copy slot will do
            limit = self.pool.saved_module_slots
            candidates = [k for k in candidates if (self.pool.slot_of(k) or 0) < limit]
        if candidates:
            self._draining = min(
                candidates, key=lambda k: (running[k], self._stats_of(k).last_used)
            )
            logger.info("adapter %s waited %d steps for a slot; draining %s", key,
                        self._steps - since, self._draining)  # fmt: skip

    def _stats_of(self, key: str) -> _KeyStats:
        stats = self._stats.get(key)
        if stats is None:
            stats = self._stats[key] = _KeyStats()
        return stats

    def take_failures(self) -> dict[str, str]:
        """Adapters (key -> reason) that failed to load since the last call; the engine ends
        the requests queued on them with the reason. Requests added later are refused."""
        failures, self._new_failures = self._new_failures, {}
        return failures

    def is_ready(self, key: str | None) -> bool:
        """Whether the adapter's weights are on the device already (never blocks)."""
        return key is None or self.pool.is_ready(key)

    # -- statistics -------------------------------------------------------------------------

    def stats(self) -> LoRAStats:
        c = self.pool.counters
        return LoRAStats(
            registered=len(self._entries),
            gpu_resident=self.pool.gpu_resident(),
            gpu_pinned=self.pool.pinned(),
            cpu_resident=self.pool.cpu_resident(),
            gpu_loads=c.gpu_loads,
            gpu_evictions=c.gpu_evictions,
            disk_loads=c.disk_loads,
            cpu_evictions=c.cpu_evictions,
        )

    def stats_report(self, waiting: Counter | None = None) -> AdapterStatsReport:
        """The `GetAdapterStats` result; `waiting` counts queued requests per adapter key."""
        waiting = waiting or Counter()
        running = Counter(k for holder, k in self._held.items() if not holder.startswith("\x00"))
        c = self.pool.counters
        rows: list[tuple[str, str, _Entry | None]] = [
            (name, e.key, e) for name, e in self._entries.items()
        ]
        registered = {e.key for e in self._entries.values()}
        rows += [(key, key, None) for key in sorted(set(self._held.values()) - registered)]
        adapters = []
        for name, key, entry in rows:
            stats = self._stats_of(key)
            if self.pool.slot_of(key) is not None:
                residency = "gpu"
            elif self.pool.has_host(key):
                residency = "cpu"
            else:
                residency = "disk"
            adapters.append(
                AdapterStat(
                    name=name,
                    key=key,
                    tenant=entry.tenant if entry else "",
                    label=entry.label if entry else "",
                    residency=residency,
                    loading=key in self._pending or stats.load_started is not None,
                    pinned=bool(entry and entry.pinned),
                    registered=entry is not None,
                    failed=self._failed.get(key, ""),
                    last_used=stats.last_used,
                    gpu_loads=c.gpu_loads_by_key[key],
                    disk_loads=c.disk_loads_by_key[key],
                    evictions=c.gpu_evictions_by_key[key],
                    load_latency_buckets=tuple(stats.latency_counts),
                    load_latency_sum_s=stats.latency_sum_s,
                    load_latency_count=stats.latency_count,
                    running_requests=running[key],
                    waiting_requests=waiting[key],
                )
            )
        return AdapterStatsReport(
            adapters=tuple(adapters),
            gpu_slots_used=self.pool.gpu_resident(),
            gpu_slots_total=self.pool.num_slots,
            gpu_slots_in_use=self.pool.pinned(),
            cpu_cache_used=self.pool.cpu_resident(),
            cpu_cache_total=self.pool.max_cpu_loras,
            loads_in_flight=len(self._pending),
        )

    def shutdown(self) -> None:
        """Stop the loader thread (reads under way are dropped)."""
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)

    # -- internals ----------------------------------------------------------------------------

    def _key_in_use(self, key: str) -> bool:
        return key in self._held.values()

    def validate(self, path: str | os.PathLike[str]) -> LoRAWeights:
        """Load and validate a PEFT folder for this model (see `AdapterValidator.validate`).
        Reads no manager state: any thread may call it."""
        return self.validator.validate(path)

    @property
    def validator(self) -> AdapterValidator:
        """The checks of this manager's adapters, as a value to hand to other processes."""
        dtype = str(self._dtype).removeprefix("torch.")
        return AdapterValidator(
            self.spec, self.config.max_lora_rank, dtype, self.config.max_saved_module_loras,
            self.base_tokenizer,
        )  # fmt: skip

    def _fail(self, key: str, error: Exception) -> None:
        path = self._paths.get(key, "")
        reason = without_path(str(error), path) if path else str(error)
        message = f"the adapter failed to load: {reason}"
        logger.warning("adapter %s (%s) failed to load: %s", key, path, error)
        self._failed[key] = message
        self._new_failures[key] = message
        self._waiters.pop(key, None)
        self._stats_of(key).load_started = None
        self.pool.forget(key)

    def _load(self, path: str) -> SlotImage:
        """Read, validate and stage an adapter as a slot image (on the loader thread with
        `background_loads`): the engine thread's slot write is then a few copies."""
        weights = self.validate(path)
        return self._state.stage(weights, pin_memory=self._device.type == "cuda")

    def _reload(self, key: Hashable) -> SlotImage:
        path = self._paths.get(key)  # type: ignore[arg-type]
        if path is None:
            raise KeyError(f"unknown adapter key {key!r}")
        weights = self._load(path)
        if "lora-" + weights.digest[:32] != key:
            raise AdapterValidationError(
                f"{path}: adapter files changed on disk since they "
                "were registered; register it again"
            )
        return weights
