"""Verification of one speculative step on the device: the target's logits at each draft
position go through the row's full sampling pipeline, then `rejection_sampler` decides what
each row emits."""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import torch

from loraplex.kernels.bitmask import apply_token_bitmask_
from loraplex.kernels.sampling import compute_logprobs
from loraplex.platform.runner.rejection_sampler import (
    sampling_probs,
    verify_point_drafts,
    verify_sampled_drafts,
)
from loraplex.platform.runner.sampler import Sampler
from loraplex.platform.runner.sampling_metadata import LogprobsTensors, SamplingMetadata


@dataclass(frozen=True)
class VerifiedStep:
    """What a speculative step emits, on the device."""

    tokens: torch.Tensor  # [n, K + 1] int64, row i valid up to num_emitted[i]
    num_emitted: torch.Tensor  # [n] int64, 1..spec_lens[i] + 1
    logprobs: LogprobsTensors | None  # of each row's first emitted token (rows that ask)


def expand_metadata(
    metadata: SamplingMetadata,
    row_of_logit: torch.Tensor,  # [L] int64, the sampled row of each logits row
    position: torch.Tensor,  # [L] int64, the logits row's position in its row's run (0..k_i)
) -> SamplingMetadata:
    """The metadata of a speculative step's logits rows: each row's columns repeated per
    position, its step counter advanced by the position (the noise and min_tokens count the
    tokens before it). Rows with penalties or logit biases never speculate, so their state
    needs no per-position update."""

    def take(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t[row_of_logit]

    lb = metadata.logit_bias
    if lb is not None:  # entries of a non-speculative row (one logits row) are moved to it
        first = torch.zeros(int(row_of_logit.max()) + 1, dtype=torch.int64, device=lb.rows.device)
        first.scatter_reduce_(
            0, row_of_logit, torch.arange(len(row_of_logit), device=first.device), "amin",
            include_self=False,
        )  # fmt: skip
        lb = replace(lb, rows=first[lb.rows])
    return replace(
        metadata,
        temperature=take(metadata.temperature),
        top_k=take(metadata.top_k),
        top_p=take(metadata.top_p),
        min_p=take(metadata.min_p),
        repetition_penalty=take(metadata.repetition_penalty),
        presence_penalty=take(metadata.presence_penalty),
        frequency_penalty=take(metadata.frequency_penalty),
        seeds=take(metadata.seeds),
        steps=metadata.steps[row_of_logit] + position,
        output_counts=take(metadata.output_counts),
        prompt_mask=take(metadata.prompt_mask),
        banned_token_ids=take(metadata.banned_token_ids),
        min_tokens=take(metadata.min_tokens),
        num_logprobs=take(metadata.num_logprobs),
        logit_bias=lb,
    )  # type: ignore[arg-type]


def verify(
    logits: torch.Tensor,  # [L, vocab], L = sum(spec_lens + 1): each row's k_i + 1 positions
    spec_lens: np.ndarray,  # [n] int64, drafts per sampled row (0: a plain row)
    drafts: np.ndarray,  # [n, K] int64 host, -1 padded
    metadata: SamplingMetadata | None,  # of the n sampled rows; None: all plain greedy
    draft_probs: torch.Tensor | None,  # [n, K, vocab] fp32, or None: point-mass drafts
    bitmask: torch.Tensor | None = None,  # [m, words] int32 on the device
    bitmask_rows: torch.Tensor | None = None,  # [m] int64: logits row of each mask row
) -> VerifiedStep:
    """Run each logits row through its row's sampling pipeline and accept drafts exactly."""
    dev = logits.device
    n, k = drafts.shape
    lens = spec_lens + 1
    first = np.cumsum(lens) - lens  # [n] first logits row of each sampled row
    # [n, K + 1]: the logits row of each position (padding repeats the last one)
    pad_idx = first[:, None] + np.minimum(np.arange(k + 1)[None, :], spec_lens[:, None])
    host = np.concatenate([pad_idx.reshape(-1), drafts.reshape(-1), spec_lens])
    up = torch.from_numpy(host.astype(np.int64)).to(dev, non_blocking=True)
    pad_dev = up[: n * (k + 1)].view(n, k + 1)
    drafts_dev = up[n * (k + 1) : n * (k + 1) + n * k].view(n, k)
    lens_dev = up[n * (k + 1) + n * k :]
    logprobs = None
    if metadata is None:
        targets = logits.argmax(dim=-1)[pad_dev]  # [n, K + 1]
        return VerifiedStep(*verify_point_drafts(targets, drafts_dev, lens_dev), None)
    raw = logits.float()
    if bitmask is not None:
        raw = raw.clone() if raw is logits else raw
        apply_token_bitmask_(raw, bitmask, bitmask_rows)
    num_logits = int(lens.sum())
    row_of_logit = torch.repeat_interleave(  # [L]; NOTE: output_size: no device read
        torch.arange(n, device=dev), lens_dev + 1, output_size=num_logits
    )
    position = torch.arange(len(row_of_logit), device=dev) - pad_dev[:, 0][row_of_logit]
    expanded = expand_metadata(metadata, row_of_logit, position)
    processed = Sampler.process_logits(raw, expanded)
    targets = Sampler.sample(processed, expanded)[pad_dev]  # [n, K + 1]
    if draft_probs is None or metadata.all_greedy:
        tokens, emitted = verify_point_drafts(targets, drafts_dev, lens_dev)
    else:
        probs = sampling_probs(processed, expanded)[pad_dev[:, :k]]  # [n, K, vocab]
        tokens, emitted = verify_sampled_drafts(
            targets, drafts_dev, lens_dev, probs, draft_probs,
            metadata.temperature < 1e-5, metadata.seeds, metadata.steps,
        )  # fmt: skip
    if metadata.max_num_logprobs is not None:
        # NOTE: rows asking for logprobs never speculate: their one token is at position 0.
        logprobs = LogprobsTensors(
            *compute_logprobs(raw[pad_dev[:, 0]], tokens[:, 0], metadata.max_num_logprobs)
        )
    return VerifiedStep(tokens, emitted, logprobs)
