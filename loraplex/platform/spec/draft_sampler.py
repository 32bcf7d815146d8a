"""What a drafting proposer borrows from the runner: sampling rows exactly as the target
samples them, so that the distribution a draft was drawn from is the one it reports (the
rejection rule divides by it). The runner implements it (`runner/draft_sampler.py`) and hands
it to `build_proposer`; spec/ imports nothing of the runner."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from loraplex.platform.core.sampling_params import SamplingParams


class DraftRows(Protocol):
    """One propose call's rows, their sampling columns on the device (built once; every draft
    position reuses them)."""

    def sample(self, logits: torch.Tensor, position: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's draft at `position` from `logits` [n, vocab] fp32: the row's temperature,
        top-k, top-p and min-p, its seeded noise counted at its step + `position`.
        -> (tokens [n] int64, probs [n, vocab] fp32: the distribution each was drawn from)"""
        ...


class DraftSampler(Protocol):
    """Builds `DraftRows` for a batch of requests."""

    def rows(
        self, params: Sequence[SamplingParams], seeds: Sequence[int], steps: Sequence[int]
    ) -> DraftRows:
        """The rows of these requests' sampling parameters, their noise keyed by `seeds` and
        counted from `steps`."""
        ...
