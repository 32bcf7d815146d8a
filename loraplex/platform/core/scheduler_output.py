"""The typed hand-overs between the scheduler and the model runner."""

from __future__ import annotations

from dataclasses import dataclass, field

from loraplex.platform.core.sampling_params import SamplingParams

# One scored token: (token id, logprob, rank); the sampled (or prompt) token first, then the
# top-k alternatives.
TokenScores = list[tuple[int, float, int]]
# req_id -> (prompt position of the first scored token, one `TokenScores` per scored token).
PromptLogprobScores = dict[str, tuple[int, list[TokenScores]]]


@dataclass(frozen=True)
class NewRequestData:
    """A request the runner has not seen (or saw before it was preempted): everything it needs."""

    req_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    lora_slot: int = -1


@dataclass(frozen=True)
class CachedRequestData:
    """A request the runner already holds: only what changed."""

    req_id: str
    new_block_ids: list[int]
    num_computed_tokens: int


@dataclass(frozen=True)
class SchedulerOutput:
    new_reqs: list[NewRequestData]
    cached_reqs: list[CachedRequestData]
    num_scheduled_tokens: dict[str, int]  # req_id -> tokens to compute this step
    total_num_scheduled_tokens: int
    # Requests the runner must forget before this step (finished, aborted or preempted).
    finished_req_ids: frozenset[str] = field(default_factory=frozenset)
    # req_id -> draft tokens this step verifies after the request's last token (vLLM's name);
    # num_scheduled_tokens counts them.
    scheduled_spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0


@dataclass(frozen=True)
class ModelRunnerOutput:
    """Sampled tokens of the requests whose prompt (or chunk) reached its end this step."""

    sampled: dict[str, int]  # req_id -> token id
    logprobs: dict[str, TokenScores] = field(default_factory=dict)
    prompt_logprobs: PromptLogprobScores = field(default_factory=dict)
    # req_id -> the tokens a speculative step emitted after `sampled[req_id]` (its accepted
    # drafts after the first, then the recovered or bonus token).
    extra_token_ids: dict[str, list[int]] = field(default_factory=dict)


@dataclass(frozen=True)
class EngineCoreOutput:
    req_id: str
    new_token_ids: list[int]
    new_logprobs: TokenScores | None
    finish_reason: str | None
    stop_reason: int | str | None
    num_cached_tokens: int
