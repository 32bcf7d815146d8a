"""SamplingMetadata: what the Sampler reads for one step, as device tensors.

The persistent InputBatch keeps every sampling parameter as a column indexed by a stable row;
each step it gathers the columns of the rows that sample into one SamplingMetadata (row i
here is logits row i). The host flags let the sampler skip whole stages without reading the
device: they are kept on the host by the InputBatch as requests come and go.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class LogitBias:
    """OpenAI's logit_bias of the rows that have one, as a sparse list of entries: the value
    is added to logits[row, token] (no dense [n, vocab] tensor)."""

    rows: torch.Tensor  # [e] int64, logits row of each entry
    token_ids: torch.Tensor  # [e] int64
    values: torch.Tensor  # [e] fp32

    def apply_(self, logits: torch.Tensor) -> None:
        """Add the biases to `logits` [n, vocab] in place."""
        logits.index_put_((self.rows, self.token_ids), self.values, accumulate=True)


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
    # Whether a sampled row has both top-k and top-p (its two threshold searches run one after
    # the other, twice the launches); True is always safe, False lets the sampler skip them.
    # NOTE: added after the first version, with a default, so older constructors still work.
    any_top_k_and_top_p: bool = True
    # Biases of the rows that have one; None when no row has (added later, with a default).
    logit_bias: LogitBias | None = None


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


def build_sampling_metadata(
    n: int,
    vocab: int,
    device: torch.device | str = "cpu",
    *,
    temperature: float | Sequence[float] | torch.Tensor = 1.0,
    top_k: int | Sequence[int] | torch.Tensor = 0,
    top_p: float | Sequence[float] | torch.Tensor = 1.0,
    min_p: float | Sequence[float] | torch.Tensor = 0.0,
    repetition_penalty: float | Sequence[float] | torch.Tensor = 1.0,
    presence_penalty: float | Sequence[float] | torch.Tensor = 0.0,
    frequency_penalty: float | Sequence[float] | torch.Tensor = 0.0,
    seeds: int | Sequence[int] | torch.Tensor | None = None,
    steps: int | Sequence[int] | torch.Tensor | None = None,
    output_counts: torch.Tensor | None = None,
    prompt_mask: torch.Tensor | None = None,
    banned_token_ids: torch.Tensor | None = None,
    min_tokens: int | Sequence[int] | torch.Tensor = 0,
    logprobs: int | Sequence[int] | torch.Tensor | None = None,
    logit_bias: Sequence[tuple[int, int, float]] | None = None,
) -> SamplingMetadata:
    """SamplingMetadata from host values (scalars apply to every row), with the host flags
    derived from them: for tests and benchmarks (the InputBatch builds it in serving).

    Default seeds and steps differ per row; penalties get zero counts / an empty prompt mask
    unless given; `logprobs` -1 in a row: none for it; `logit_bias` as (row, token, value)."""

    def col(value, dtype: torch.dtype) -> torch.Tensor:
        if isinstance(value, torch.Tensor):
            return value.to("cpu", dtype)
        if isinstance(value, (int, float)):
            return torch.full((n,), value, dtype=dtype)
        return torch.tensor(list(value), dtype=dtype)

    t = col(temperature, torch.float32)
    k, p, mp = col(top_k, torch.int32), col(top_p, torch.float32), col(min_p, torch.float32)
    rep = col(repetition_penalty, torch.float32)
    pres, freq = col(presence_penalty, torch.float32), col(frequency_penalty, torch.float32)
    sampled = t >= 1e-5
    any_penalties = bool(((rep != 1) | (pres != 0) | (freq != 0)).any())
    if any_penalties and output_counts is None:
        output_counts = torch.zeros(n, vocab, dtype=torch.int32)
    if bool((rep != 1).any()) and prompt_mask is None:
        prompt_mask = torch.zeros(n, vocab, dtype=torch.bool)
    num_logprobs = col(-1 if logprobs is None else logprobs, torch.int32)
    dev = torch.device(device)

    def on(x: torch.Tensor | None) -> torch.Tensor | None:
        return None if x is None else x.to(dev)

    return SamplingMetadata(
        temperature=t.to(dev),
        top_k=k.to(dev),
        top_p=p.to(dev),
        min_p=mp.to(dev),
        repetition_penalty=rep.to(dev),
        presence_penalty=pres.to(dev),
        frequency_penalty=freq.to(dev),
        seeds=col(torch.arange(n) * 7919 + 11 if seeds is None else seeds, torch.int64).to(dev),
        steps=col(torch.arange(n) % 97 if steps is None else steps, torch.int64).to(dev),
        output_counts=on(output_counts),
        prompt_mask=on(prompt_mask),
        banned_token_ids=on(banned_token_ids),
        min_tokens=col(min_tokens, torch.int64).to(dev),
        all_greedy=not bool(sampled.any()),
        any_top_k_top_p=bool((sampled & ((k > 0) | (p < 1))).any()),
        any_top_k_and_top_p=bool((sampled & (k > 0) & (k < vocab) & (p < 1)).any()),
        any_min_p=bool((sampled & (mp > 0)).any()),
        any_penalties=any_penalties,
        max_num_logprobs=None if logprobs is None else int(num_logprobs.max()),
        num_logprobs=None if logprobs is None else num_logprobs.to(dev),
        logit_bias=None if not logit_bias else make_logit_bias(logit_bias, dev),
    )


def make_logit_bias(
    entries: Sequence[tuple[int, int, float]], device: torch.device | str
) -> LogitBias:
    """LogitBias from (logits row, token id, value) entries, uploaded in one copy per column."""
    rows, tokens, values = zip(*entries, strict=True)
    return LogitBias(
        rows=torch.tensor(rows, dtype=torch.int64).to(device),
        token_ids=torch.tensor(tokens, dtype=torch.int64).to(device),
        values=torch.tensor(values, dtype=torch.float32).to(device),
    )
