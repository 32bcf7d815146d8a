"""The proposer an engine's `SpeculativeConfig` asks for."""

from __future__ import annotations

import torch

from loraplex.config import EngineConfig
from loraplex.platform.spec.draft_sampler import DraftSampler
from loraplex.platform.spec.ngram import NgramProposer
from loraplex.platform.spec.proposer import Proposer


def build_proposer(
    config: EngineConfig, vocab_size: int, device: torch.device, sampler: DraftSampler
) -> Proposer | None:
    """None when speculative decoding is off; a draft model samples its drafts with `sampler`
    (the runner's)."""
    spec = config.speculative
    if spec is None:
        return None
    if spec.method == "ngram":
        return NgramProposer(
            spec.num_speculative_tokens, spec.prompt_lookup_min, spec.prompt_lookup_max
        )
    from loraplex.platform.spec.draft_model import DraftModelProposer

    return DraftModelProposer(spec, config, vocab_size, device, sampler)
