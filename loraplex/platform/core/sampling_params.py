"""SamplingParams: how one request samples and when it stops (vLLM's names and defaults)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field, replace

from loraplex.platform.core.structured_outputs import StructuredOutputs

_GREEDY_EPS = 1e-5
MAX_STOP_STRINGS = 16
# NOTE: every new token of every sample is searched for each stop string over a window as long as
# the longest one; bounding both keeps that search small whatever a request asks for.
MAX_STOP_CHARS = 1024


class RequestOutputKind(enum.Enum):
    CUMULATIVE = 0  # every output carries the whole text so far
    DELTA = 1  # every output carries only what is new (streaming)
    FINAL_ONLY = 2  # one output, when the request finishes


@dataclass(frozen=True)
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    # Per prompt token after the first: its logprob and the top-k alternatives. The request
    # computes its whole prompt (no prefix-cache hits), as vLLM does.
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    structured_outputs: StructuredOutputs | None = None
    # OpenAI's logit_bias: (token id, value in [-100, 100]) pairs added to the logits before
    # sampling; a dict {token: value} is accepted too. Ids past the vocabulary are ignored by
    # the runner (the API refuses them with a 400).
    logit_bias: tuple[tuple[int, float], ...] = ()
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    extra: dict = field(default_factory=dict, compare=False, hash=False)

    def __post_init__(self) -> None:
        # Accept lists and single strings for stop / stop_token_ids, as vLLM does.
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        elif not isinstance(self.stop, tuple):
            object.__setattr__(self, "stop", tuple(self.stop or ()))
        if not isinstance(self.stop_token_ids, tuple):
            object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids or ()))
        if self.top_k == -1:
            object.__setattr__(self, "top_k", 0)
        if isinstance(self.logit_bias, dict):
            object.__setattr__(self, "logit_bias", tuple(sorted(self.logit_bias.items())))
        self._validate()

    def _validate(self) -> None:
        def bad(name: str, why: str, got: object = None) -> ValueError:
            shown = getattr(self, name) if got is None else got
            err = ValueError(f"{name} {why}, got {shown!r}")
            err.param = name  # type: ignore[attr-defined]
            return err

        if not isinstance(self.n, int) or self.n < 1:
            raise bad("n", "must be an integer >= 1")
        if not 0.0 <= self.temperature <= 2.0 or self.temperature != self.temperature:
            raise bad("temperature", "must be in [0, 2]")
        if not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", "must be in (0, 1]")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise bad("top_k", "must be 0 or -1 (disabled) or a positive integer")
        if not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", "must be in [0, 1]")
        if not 0.0 < self.repetition_penalty <= 2.0:
            raise bad("repetition_penalty", "must be in (0, 2]")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise bad("presence_penalty", "must be in [-2, 2]")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise bad("frequency_penalty", "must be in [-2, 2]")
        if self.max_tokens is not None and (
            not isinstance(self.max_tokens, int) or self.max_tokens < 1
        ):
            raise bad("max_tokens", "must be a positive integer")
        if self.min_tokens < 0 or (
            self.max_tokens is not None and self.min_tokens > self.max_tokens
        ):
            raise bad("min_tokens", "must be in [0, max_tokens]")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise bad("logprobs", "must be in [0, 20]")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= 20:
            raise bad("prompt_logprobs", "must be in [0, 20]")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise bad("stop", "must be non-empty strings")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise bad("stop", f"may hold at most {MAX_STOP_STRINGS} strings", len(self.stop))
        longest = max((len(s) for s in self.stop), default=0)
        if longest > MAX_STOP_CHARS:
            raise bad("stop", f"strings may be at most {MAX_STOP_CHARS} characters", longest)
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids", "must be non-negative integers")
        if self.seed is not None and not isinstance(self.seed, int):
            raise bad("seed", "must be an integer")
        if any(
            not isinstance(t, int) or t < 0 or not -100.0 <= v <= 100.0 for t, v in self.logit_bias
        ):
            raise bad("logit_bias", "must map token ids >= 0 to values in [-100, 100]")

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    @property
    def needs_penalties(self) -> bool:
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )

    def for_child(self, index: int) -> SamplingParams:
        """The params of the index-th of n samples: n=1, a distinct seed if seeded, and prompt
        logprobs computed by the first sample alone (the others may reuse its prompt blocks)."""
        seed = None if self.seed is None else self.seed + index
        prompt_logprobs = self.prompt_logprobs if index == 0 else None
        return replace(self, n=1, seed=seed, prompt_logprobs=prompt_logprobs)
