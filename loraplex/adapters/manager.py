"""`LoRAManager`: the one object the engine talks to about adapters.

It ties together the registry of known adapters (name -> folder), their validation, the CPU
cache and GPU slot pool, and the model's LoRA layers. The scheduler asks `can_schedule` and
`acquire_for_request` / `release_for_request`; the runner calls `set_batch` before each forward;
prefix caching hashes blocks with `adapter_key`.

A registered adapter that fails to load later (its files changed or vanished, or it no longer
passes validation) fails alone: the manager marks it failed, never raises from `prefetch` or
`can_schedule`, refuses new requests on it, and hands the engine `take_failures()` so that the
requests already queued on it end with the error; no other adapter's requests notice.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Hashable
from dataclasses import dataclass

import torch

from loraplex.adapters.errors import AdapterLoadError, AdapterValidationError, without_path
from loraplex.adapters.lora_layer import LoRAModelState
from loraplex.adapters.peft_format import (
    CONFIG_FILE,
    WEIGHTS_FILE,
    BaseModelSpec,
    LoRAWeights,
    load_peft_adapter,
)
from loraplex.adapters.request import LoRARequest
from loraplex.adapters.slot_pool import LoRASlotPool
from loraplex.config import LoRAConfig

logger = logging.getLogger(__name__)

#: slot value of a token that runs the base model only
BASE_SLOT = -1


@dataclass(frozen=True)
class LoRAStats:
    """A snapshot for metrics."""

    registered: int
    gpu_resident: int
    gpu_pinned: int
    cpu_resident: int
    gpu_loads: int
    gpu_evictions: int
    disk_loads: int
    cpu_evictions: int


@dataclass(frozen=True)
class _Entry:
    path: str
    key: str
    fingerprint: tuple[int, ...]  # (mtime_ns, size) of both files, to notice replacement


def _fingerprint(path: str) -> tuple[int, ...]:
    try:
        stats = [os.stat(os.path.join(path, f)) for f in (CONFIG_FILE, WEIGHTS_FILE)]
    except OSError:
        return ()
    return tuple(v for st in stats for v in (st.st_mtime_ns, st.st_size))


class LoRAManager:
    """Registry, validation, caches and slots of the LoRA adapters of one model."""

    def __init__(
        self,
        config: LoRAConfig,
        spec: BaseModelSpec,
        model_state: LoRAModelState,
        dtype: torch.dtype,
    ) -> None:
        model_state.check_spec(spec)
        self.config = config
        self.spec = spec
        self._state = model_state
        self._dtype = dtype
        self._device = model_state.meta.workspace.device
        self._entries: dict[str, _Entry] = {}
        self._paths: dict[str, str] = {}  # key -> folder, for reloads after CPU eviction
        self._held: dict[str, str] = {}  # request id -> key
        self._failed: dict[str, str] = {}  # key -> why it failed to load (tenant-safe text)
        self._new_failures: dict[str, str] = {}  # failed since the last `take_failures`
        self.pool = LoRASlotPool(
            config.max_loras, config.max_cpu_loras, model_state, self._reload, self._device
        )

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
        self.pool.put_host(key, weights)
        if old is not None and old.key != key and not self._key_in_use(old.key):
            self.pool.forget(old.key)
        return key

    def remove_adapter(self, lora_name: str) -> bool:
        """Unregister an adapter; running requests keep their slot until they finish."""
        entry = self._entries.pop(lora_name, None)
        if entry is None:
            return False
        if not self._key_in_use(entry.key):
            self.pool.forget(entry.key)
            if not any(e.key == entry.key for e in self._entries.values()):
                self._failed.pop(entry.key, None)
        return True

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
        if (
            entry is None
            or entry.path != request.lora_path
            or entry.fingerprint != _fingerprint(request.lora_path)
        ):
            return self.add_adapter(request)
        failure = self._failed.get(entry.key)
        if failure is not None:
            raise AdapterLoadError(failure)
        return entry.key

    # -- scheduling ---------------------------------------------------------------------------

    def can_schedule(self, key: str | None) -> bool:
        """Whether a request with this adapter can get a slot now.

        An adapter not on the device is read into the host cache here (from disk if it was
        evicted), so that `acquire_for_request` finds it; one that fails to load is marked
        failed (see `take_failures`) and is never schedulable."""
        if key is None:
            return True
        if key in self._failed or not self.pool.can_allocate(key):
            return False
        if self.pool.slot_of(key) is None:
            try:
                self.pool.load_host(key)
            except Exception as error:
                self._fail(key, error)
                return False
        return True

    def acquire_for_request(self, request_id: str, key: str | None) -> int:
        """Pin the adapter's slot for a request (idempotent); returns the slot, -1 for base.

        Ask `can_schedule` first: it leaves the weights in the host cache, so what is left here
        is the copy into the slot. A copy that fails marks the adapter failed and raises."""
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
        return slot

    def release_for_request(self, request_id: str) -> None:
        """Unpin the request's adapter (finished, aborted or preempted); no-op for base."""
        key = self._held.pop(request_id, None)
        if key is None:
            return
        self.pool.release(key)
        registered = any(e.key == key for e in self._entries.values())
        if not registered and not self._key_in_use(key):
            self.pool.forget(key)  # removed or replaced while this request ran

    def prefetch(self, key: str | None) -> None:
        """Warm the caches for a waiting request's adapter without evicting a resident one."""
        if key is None or key in self._failed:
            return
        try:
            self.pool.prefetch(key)
        except Exception as error:
            self._fail(key, error)

    def take_failures(self) -> dict[str, str]:
        """Adapters (key -> reason) that failed to load since the last call; the engine ends
        the requests queued on them with the reason. Requests added later are refused."""
        failures, self._new_failures = self._new_failures, {}
        return failures

    def is_ready(self, key: str | None) -> bool:
        """Whether the adapter's weights are on the device already (never blocks)."""
        return key is None or self.pool.is_ready(key)

    # -- per step -----------------------------------------------------------------------------

    def set_batch(self, lora_slots: torch.Tensor, *, always_apply: bool = False) -> None:
        """Install the step's per-token slots (`[num_tokens]` int32, -1 = base) before the
        forward pass; the forward then waits (on the device) for loads of pinned slots."""
        self.pool.wait_ready()
        self._state.meta.set(lora_slots, always_apply=always_apply)

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

    # -- internals ----------------------------------------------------------------------------

    def _key_in_use(self, key: str) -> bool:
        return key in self._held.values()

    def validate(self, path: str | os.PathLike[str]) -> LoRAWeights:
        """Load and validate a PEFT folder for this model: its spec, `max_lora_rank` and the
        serving dtype (fp32 tensors come back). Reads no manager state: any thread may call it.

        Raises `AdapterValidationError` naming the field, tensor or module at fault."""
        return load_peft_adapter(path, self.spec, self.config.max_lora_rank, self._dtype)

    def _fail(self, key: str, error: Exception) -> None:
        path = self._paths.get(key, "")
        reason = without_path(str(error), path) if path else str(error)
        message = f"the adapter failed to load: {reason}"
        logger.warning("adapter %s (%s) failed to load: %s", key, path, error)
        self._failed[key] = message
        self._new_failures[key] = message
        self.pool.forget(key)

    def _load(self, path: str) -> LoRAWeights:
        weights = self.validate(path)
        return weights.to(self._dtype, pin_memory=self._device.type == "cuda")

    def _reload(self, key: Hashable) -> LoRAWeights:
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
