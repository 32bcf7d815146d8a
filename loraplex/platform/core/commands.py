"""Engine commands: the typed admin operations on adapters and tenants, and their results.

Nothing outside the engine touches its objects: the API (and anything else) asks for an adapter
to be added, removed or pinned, a tenant's weight to change, or the adapter statistics, by
handing one of these commands to `EngineClient.command`; the engine loop runs it on the step
thread between steps (`Engine.handle_command`). Every command and every result is a frozen
dataclass of plain values (str, int, float, bool, tuples of those), so the same objects cross a
process boundary unchanged (as msgpack, by the engine-core client).

The names of these classes and of their fields are stable: other parts (the engine-process IPC,
the dashboard) depend on them.

Results, by command:

- `AddAdapter` -> `AdapterAdded`. Registering is cheap (no file is read on the step thread when
  `digest` is given): the weights are read, validated and copied to a GPU slot by the adapter
  loader ahead of the first request that needs them.
- `RemoveAdapter` -> bool (False: no adapter of that name). Requests already running on it
  finish on its weights; new requests naming it are refused (404 at the API).
- `PinAdapter` -> bool (False: no adapter of that name). A pinned adapter stays in its GPU slot
  (loaded now if it is not) and is never evicted while pinned.
- `SetTenantWeight` -> None. The tenant's share in the scheduler's weighted fair queuing.
- `GetAdapterStats` -> `AdapterStatsReport`.
- `GetTenantStats` -> `TenantStatsReport`: each tenant's sequences in the scheduler now.

Errors are raised, not returned: `ValueError` for a command the engine refuses (LoRA disabled, a
bad value), `AdapterValidationError` (a `ValueError`) for an adapter that cannot be served.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

#: upper bounds (seconds) of the adapter load-latency histogram buckets; the last is +Inf
LOAD_LATENCY_BUCKETS_S: tuple[float, ...] = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, math.inf,
)  # fmt: skip

#: where an adapter's weights are: in a GPU slot, in the host cache, or only on disk
RESIDENCIES = ("gpu", "cpu", "disk")


def _check_name(name: object, field: str = "name") -> None:
    if not isinstance(name, str) or not name:
        raise ValueError(f"{field} must be a non-empty string, got {name!r}")


@dataclass(frozen=True)
class AddAdapter:
    """Register (or replace) the adapter `name`, a PEFT folder at `path`.

    `digest` is the sha256 of the folder's two files (`adapter_config.json` then
    `adapter_model.safetensors`) as the content-addressed store computed it; with it the engine
    reads nothing on its step thread, and a folder whose files no longer match fails its load.
    Without it (a folder given by path, as `LoRARequest` does) the engine hashes the files.
    `tenant` and `label` (the tenant-facing name) are for statistics only."""

    name: str
    path: str
    digest: str = ""
    pinned: bool = False
    tenant: str = ""
    label: str = ""

    def __post_init__(self) -> None:
        _check_name(self.name)
        _check_name(self.path, "path")
        if self.digest and (
            len(self.digest) != 64 or any(c not in "0123456789abcdef" for c in self.digest)
        ):
            raise ValueError(f"digest must be 64 lowercase hex digits, got {self.digest!r}")


@dataclass(frozen=True)
class RemoveAdapter:
    """Unregister the adapter `name`; its running requests finish on its weights."""

    name: str

    def __post_init__(self) -> None:
        _check_name(self.name)


@dataclass(frozen=True)
class PinAdapter:
    """Keep the adapter `name` in a GPU slot (`pinned=True`) or let it be evicted again."""

    name: str
    pinned: bool = True

    def __post_init__(self) -> None:
        _check_name(self.name)


@dataclass(frozen=True)
class SetTenantWeight:
    """The tenant's weight in weighted fair queuing (a positive number; 1.0 by default)."""

    tenant: str
    weight: float

    def __post_init__(self) -> None:
        _check_name(self.tenant, "tenant")
        if not (isinstance(self.weight, (int, float)) and 0 < self.weight < math.inf):
            raise ValueError(f"weight must be a positive number, got {self.weight!r}")


@dataclass(frozen=True)
class GetAdapterStats:
    """Ask for an `AdapterStatsReport`."""


@dataclass(frozen=True)
class GetTenantStats:
    """Ask for a `TenantStatsReport`."""


EngineCommand = (
    AddAdapter | RemoveAdapter | PinAdapter | SetTenantWeight | GetAdapterStats | GetTenantStats
)


@dataclass(frozen=True)
class AdapterAdded:
    """The result of `AddAdapter`: the adapter's key (the identity of its weights, part of its
    KV blocks' hashes) and whether it replaced an adapter of the same name."""

    name: str
    key: str
    replaced: bool


@dataclass(frozen=True)
class AdapterStat:
    """One registered adapter (or one removed but still serving running requests)."""

    name: str  # the engine name (the API's is "<tenant>/<name>@<digest[:12]>")
    key: str  # "lora-" + the first 32 hex digits of the content digest
    tenant: str  # "" when registered without one
    label: str  # the tenant-facing name ("" when registered without one)
    residency: str  # "gpu" | "cpu" | "disk" (see RESIDENCIES)
    loading: bool  # a load (disk -> host, or host -> GPU) is under way
    pinned: bool  # kept in its GPU slot by PinAdapter
    registered: bool  # False once removed while requests still run on it
    failed: str  # why its last load failed ("" when it did not)
    last_used: float  # unix time a request last started or ended on it, 0.0 if never
    gpu_loads: int  # host -> GPU slot copies
    disk_loads: int  # disk -> host reads (validated)
    evictions: int  # times it lost its GPU slot to another adapter
    # Disk-or-host -> GPU-ready latency of its loads: counts per LOAD_LATENCY_BUCKETS_S bucket
    # (not cumulative), their sum and count.
    load_latency_buckets: tuple[int, ...]
    load_latency_sum_s: float
    load_latency_count: int
    running_requests: int  # requests running on it now
    waiting_requests: int  # requests queued for it


@dataclass(frozen=True)
class AdapterStatsReport:
    """The result of `GetAdapterStats`: every adapter, and the pools behind them."""

    adapters: tuple[AdapterStat, ...]
    gpu_slots_used: int  # slots holding an adapter
    gpu_slots_total: int  # max_loras
    gpu_slots_in_use: int  # slots pinned by running requests or PinAdapter
    cpu_cache_used: int  # adapters in the host cache
    cpu_cache_total: int  # max_cpu_loras
    loads_in_flight: int  # disk reads and GPU copies under way


@dataclass(frozen=True)
class TenantStat:
    """One tenant's sequences in the scheduler (a request of n samples counts n)."""

    tenant: str
    running_requests: int  # in the running batch
    waiting_requests: int  # queued: not admitted yet, preempted, or waiting for a grammar
    kv_blocks: int  # KV-cache blocks its running sequences hold (shared prefix blocks once)


@dataclass(frozen=True)
class TenantStatsReport:
    """The result of `GetTenantStats`: every tenant with a sequence running or waiting."""

    tenants: tuple[TenantStat, ...]
