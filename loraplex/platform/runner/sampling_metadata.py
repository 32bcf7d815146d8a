"""SamplingMetadata: what the Sampler reads for one step, as device tensors.

The persistent InputBatch keeps every sampling parameter as a column indexed by a stable row;
each step it gathers the columns of the rows that sample into one SamplingMetadata (row i
here is logits row i). The host flags let the sampler skip whole stages without reading the
device: they are kept on the host by the InputBatch as requests come and go.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingMetadata:
    temperature: torch.Tensor  # [n] fp32; a row below 1e-5 is greedy
    top_k: torch.Tensor  # [n] int32; 0 = off
    top_p: torch.Tensor  # [n] fp32; 1.0 = off
    min_p: torch.Tensor  # [n] fp32; 0.0 = off
    repetition_penalty: torch.Tensor  # [n] fp32; 1.0 = off
    presence_penalty: torch.Tensor  # [n] fp32; 0.0 = off
    frequency_penalty: torch.Tensor  # [n] fp32; 0.0 = off
    # Every row has a seed: a request without one is given one drawn from the engine's
    # generator when it is added, so noise is counter-based for all rows alike.
    seeds: torch.Tensor  # [n] int64
    steps: torch.Tensor  # [n] int64: tokens the request has sampled so far (the noise counter)
    # Occurrences of each token in the output so far; None when no row has a penalty.
    output_counts: torch.Tensor | None  # [n, vocab] int32
    # Whether each token occurs in the prompt; None when no row has a repetition penalty.
    prompt_mask: torch.Tensor | None  # [n, vocab] bool
    # Token ids masked while steps < min_tokens (EOS and stop ids), -1 padded; None when no
    # row is below its min_tokens.
    banned_token_ids: torch.Tensor | None  # [n, k] int64
    min_tokens: torch.Tensor  # [n] int64
    # Host flags (no device reads): which stages any row needs.
    all_greedy: bool
    any_top_k_top_p: bool
    any_min_p: bool
    any_penalties: bool
    # The largest top-k logprobs any row asks for (0: only the sampled token's); None: no row
    # wants logprobs.
    max_num_logprobs: int | None
    # Per row, how many top logprobs it asked for (-1: none); only read when max_num_logprobs
    # is not None.
    num_logprobs: torch.Tensor | None  # [n] int32


@dataclass(frozen=True)
class LogprobsTensors:
    """Logprobs of one step on the device: the sampled token's first, then the top-k."""

    token_logprobs: torch.Tensor  # [n] fp32, the sampled token's logprob
    token_ranks: torch.Tensor  # [n] int64, its rank (1 = most likely)
    top_ids: torch.Tensor  # [n, k] int64
    top_logprobs: torch.Tensor  # [n, k] fp32


@dataclass(frozen=True)
class SamplerOutput:
    token_ids: torch.Tensor  # [n] int64 on the logits' device
    logprobs: LogprobsTensors | None
