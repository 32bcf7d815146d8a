"""Request: one sequence's state as the scheduler sees it."""

from __future__ import annotations

import enum
import time
from collections.abc import Hashable
from typing import Any

from loraplex.platform.core.sampling_params import SamplingParams


class RequestStatus(enum.IntEnum):
    WAITING = 0
    WAITING_FOR_GRAMMAR = 1
    RUNNING = 2
    PREEMPTED = 3
    FINISHED_STOPPED = 4
    FINISHED_LENGTH = 5
    FINISHED_ABORTED = 6
    FINISHED_ERROR = 7  # ended by a failure of its own (e.g. its adapter failed to load)

    @property
    def finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED


FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


class Request:
    """A single sequence: its tokens, how many have K/V in the cache, and how it must stop.

    `adapter_key` identifies the LoRA adapter (None = base model); it is part of every block
    hash, so KV computed under one adapter is never reused under another. `tenant` and
    `weight` drive fair sharing between tenants.
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        eos_token_ids: tuple[int, ...],
        *,
        max_tokens: int,
        arrival_time: float | None = None,
        lora_request: Any = None,
        adapter_key: Hashable | None = None,
        tenant: str = "default",
        grammar: Any = None,
    ) -> None:
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids
        self.sampling_params = sampling_params
        self.eos_token_ids = eos_token_ids
        self.max_tokens = max_tokens
        self.arrival_time = arrival_time if arrival_time is not None else time.monotonic()
        self.lora_request = lora_request
        self.adapter_key = adapter_key
        self.tenant = tenant
        self.grammar = grammar  # a GrammarMatcher once its grammar compiled, else None

        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.num_computed_tokens = 0
        # Tokens sampled by scheduled steps whose results have not come back yet (0 or 1 in
        # lock-step scheduling, up to 2 with async scheduling).
        self.num_pending = 0
        # Whether a step may be scheduled before its previous token is known: not when its
        # sampling reads the request's own tokens on the host. Penalties, min_tokens, logprobs
        # and seeds read the runner's device state only; a grammar's mask is filled on the
        # host from the tokens its matcher accepted (the engine sets True when it fills masks
        # while the next forward pass runs: `GrammarConfig.overlap`).
        self.async_ok = sampling_params.structured_outputs is None
        self.num_cached_tokens = -1  # prefix-cache hits at first scheduling; -1 until then
        self.status = RequestStatus.WAITING
        self.stop_reason: int | str | None = None
        self.num_preemptions = 0
        self.block_hashes: list[bytes] = []  # hashes of this request's full blocks, in order
        # Draft tokens a proposer bet for the next step (speculative decoding); the scheduler
        # verifies them in its next step if the request decodes, and clears them.
        self.spec_token_ids: list[int] = []

    @property
    def output_token_ids(self) -> list[int]:
        return self.all_token_ids[self.num_prompt_tokens :]

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.all_token_ids) - self.num_prompt_tokens

    def append_output_token(self, token_id: int) -> None:
        self.all_token_ids.append(token_id)

    @property
    def finish_reason(self) -> str | None:
        return FINISH_REASONS.get(self.status)

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, {self.status.name}, prompt={self.num_prompt_tokens}, "
            f"out={self.num_output_tokens}, computed={self.num_computed_tokens})"
        )
