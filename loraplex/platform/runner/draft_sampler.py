"""The runner's `DraftSampler` (spec/draft_sampler.py): a draft model's rows sampled by the
target's own `Sampler`, through the same `SamplingMetadata` columns."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from loraplex.platform.core.sampling_params import SamplingParams
from loraplex.platform.runner.rejection_sampler import sampling_probs
from loraplex.platform.runner.sampler import Sampler
from loraplex.platform.runner.sampling_metadata import SamplingMetadata, build_sampling_metadata


@dataclass(frozen=True)
class MetadataDraftRows:
    """`DraftRows` over one SamplingMetadata of the propose call's rows."""

    metadata: SamplingMetadata

    def sample(self, logits: torch.Tensor, position: int) -> tuple[torch.Tensor, torch.Tensor]:
        meta = self.metadata
        if position:  # the noise counter moved on by the position
            meta = replace(meta, steps=meta.steps + position)
        return Sampler.sample(logits, meta), sampling_probs(logits, meta)


@dataclass(frozen=True)
class MetadataDraftSampler:
    """`DraftSampler` for rows of `vocab_size` logits on `device`."""

    vocab_size: int
    device: torch.device

    def rows(
        self, params: Sequence[SamplingParams], seeds: Sequence[int], steps: Sequence[int]
    ) -> MetadataDraftRows:
        metadata = build_sampling_metadata(
            len(params), self.vocab_size, self.device,
            temperature=[p.temperature for p in params], top_k=[p.top_k for p in params],
            top_p=[p.top_p for p in params], min_p=[p.min_p for p in params],
            seeds=seeds, steps=steps,
        )  # fmt: skip
        return MetadataDraftRows(metadata)
