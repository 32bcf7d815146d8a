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
    # Where the time went (vLLM's request phases); None when the request never got there.
    queue_s: float | None = None  # arrival -> first scheduled (waiting for a place in the batch)
    prefill_s: float | None = None  # first scheduled -> first output token
    decode_s: float | None = None  # first output token -> finish

    @property
    def inference_s(self) -> float | None:
        """First scheduled -> finish: prefill plus decode (vLLM's inference time)."""
        if self.prefill_s is None or self.decode_s is None:
            return None
        return self.prefill_s + self.decode_s


TimingObserver = Callable[[RequestTiming], None]
