"""The latencies of one finished request, handed to timing observers (metrics, tenant budgets)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class RequestTiming:
    """Latencies of one finished request, handed to timing observers (seconds)."""

    ttft_s: float | None  # arrival -> first output token
    inter_token_s: tuple[float, ...]  # gaps between successive outputs after the first
    e2e_s: float  # arrival -> finish
    num_prompt_tokens: int
    num_generation_tokens: int
    finish_reason: str | None
    tenant: str = "default"
    adapter: str | None = None  # the LoRARequest's name, None for the base model


TimingObserver = Callable[[RequestTiming], None]
