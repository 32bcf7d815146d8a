"""What rank 0 sends the other ranks, in order, over one pipe per rank (pickled)."""

from __future__ import annotations

from dataclasses import dataclass

from loraplex.platform.core.scheduler_output import SchedulerOutput


@dataclass(frozen=True)
class ExecuteStep:
    """Run the step rank 0 launched: apply `scheduler_output` to the rank's input batch and run
    the same forward pass; if rows sample, receive rank 0's sampled tokens (a broadcast)."""

    scheduler_output: SchedulerOutput
    need_sampler: bool


@dataclass(frozen=True)
class LoadLoRASlot:
    """Write the adapter in folder `path` (its files' `digest`) into LoRA slot `slot`, each rank
    its slices."""

    slot: int
    path: str
    digest: str


@dataclass(frozen=True)
class Shutdown:
    """Leave the loop and exit."""


@dataclass(frozen=True)
class WorkerReady:
    """A rank's answer once its model is loaded (`error`: why it could not load)."""

    rank: int
    error: str | None = None
