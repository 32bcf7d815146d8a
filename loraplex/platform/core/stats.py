"""What the engine reports about itself: gauges and counters, as one frozen snapshot per step."""

from __future__ import annotations

from dataclasses import dataclass

from loraplex.platform.core.spec_stats import SpecDecodingStats


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
class EngineStats:
    num_running: int
    num_waiting: int
    num_free_blocks: int
    num_total_blocks: int
    kv_usage: float
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int
    lora: LoRAStats | None = None
    spec_decoding: SpecDecodingStats | None = None  # None: speculative decoding is off

    @property
    def prefix_cache_hit_rate(self) -> float:
        return (
            self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0
        )


@dataclass(frozen=True)
class EngineSnapshot:
    """What the engine thread last published: gauges and token counters for /metrics."""

    stats: EngineStats
    prompt_tokens_total: int
    generation_tokens_total: int
    watchdog_aborted_total: int = 0  # requests the watchdog ended (no progress)
    num_steps: int = 0  # engine steps run
    step_seconds_total: float = 0.0  # wall time inside those steps
