"""The proposer interface: what the engine asks for before a speculative step."""

from __future__ import annotations

import abc
from dataclasses import dataclass

import numpy as np
import torch

from loraplex.platform.core.sampling_params import SamplingParams


def can_speculate(params: SamplingParams) -> bool:
    """Whether a request's sampling lets it verify drafts. Not: grammar requests (their
    matcher would have to walk every draft for a mask per position; they decode one token a
    step), requests asking for logprobs, and those with penalties or logit biases (whose
    per-token state would need updating between draft positions)."""
    return (
        params.structured_outputs is None
        and params.logprobs is None
        and params.prompt_logprobs is None
        and not params.needs_penalties
        and not params.logit_bias
    )


@dataclass(frozen=True)
class ProposalRequest:
    """One running request that may speculate this step: its tokens so far (prompt and
    output) and how many tokens it may be proposed (`max_tokens` <= k)."""

    req_id: str
    token_ids: np.ndarray  # [num_tokens] int
    sampling_params: SamplingParams
    max_tokens: int
    step: int = 0  # tokens the request has sampled: the noise counter of its first draft


@dataclass(frozen=True)
class Proposals:
    """Draft tokens per request (absent or empty: no proposal) and, for a proposer that
    samples them, the distribution each was drawn from (None: point masses, as n-gram)."""

    token_ids: dict[str, list[int]]
    # req_id -> [len(token_ids[req_id]), vocab] fp32 on the device, the draft's probabilities
    probs: dict[str, torch.Tensor] | None = None


class Proposer(abc.ABC):
    """Bets the next tokens of running requests; the target model verifies them.

    Contract: `propose` is called between steps, with every request's tokens known on the
    host; the proposals need not be right (a wrong one costs verification work only), but a
    proposer with a distribution must report the one it sampled from exactly, since the
    rejection rule divides by it. `remove` forgets per-request state (finished, aborted or
    preempted requests)."""

    @abc.abstractmethod
    def propose(self, requests: list[ProposalRequest]) -> Proposals: ...

    def remove(self, req_ids: set[str] | frozenset[str]) -> None:  # noqa: B027
        """Forget these requests (a stateless proposer keeps nothing)."""
