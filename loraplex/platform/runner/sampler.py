"""Sampler: one step of sampling for the whole batch, on the logits' device.

Stages, in vLLM's order: the raw logprobs (log_softmax of the model's logits, before any
processing: what `logprobs` returns, except that a grammar's bitmask is applied first, as vLLM
does: a constrained row's logprobs are those of the masked distribution), penalties, min_tokens
bans, then greedy rows take the argmax and sampled rows draw from softmax(logits / T) truncated by top-k,
top-p and min-p. Every stage is a batched tensor op over all rows: no per-row Python, no host
tensors, no read of the device (the host flags of SamplingMetadata decide which stages run).
Noise is counter-based (Philox keyed by each row's seed, counted by its step and the token), so
a seeded request draws the same tokens whatever shares its batch.
"""

from __future__ import annotations

import torch

from loraplex.kernels.bitmask import apply_token_bitmask_
from loraplex.kernels.sampling import apply_penalties as penalties_kernel
from loraplex.kernels.sampling import compute_logprobs, draw, greedy_tokens, truncation_thresholds
from loraplex.platform.runner.sampling_metadata import (
    LogprobsTensors,
    SamplerOutput,
    SamplingMetadata,
)

_NEG_INF = float("-inf")


def apply_penalties(
    logits: torch.Tensor,  # [n, vocab] fp32
    metadata: SamplingMetadata,
) -> torch.Tensor:
    """Repetition, then frequency and presence penalties, as OpenAI and vLLM define them
    (`kernels.sampling.reference.apply_penalties_ref`). -> a new [n, vocab] tensor"""
    if metadata.output_counts is None:
        raise ValueError("penalties need SamplingMetadata.output_counts")
    return penalties_kernel(
        logits, metadata.output_counts, metadata.prompt_mask, metadata.repetition_penalty,
        metadata.presence_penalty, metadata.frequency_penalty,
    )  # fmt: skip


def apply_min_tokens_(
    logits: torch.Tensor,  # [n, vocab] fp32, modified in place
    banned_token_ids: torch.Tensor,  # [n, k] int64, -1 padded
    steps: torch.Tensor,  # [n] int64
    min_tokens: torch.Tensor,  # [n] int64
) -> None:
    """-inf at each row's banned ids (EOS, stop ids) while it has sampled < min_tokens."""
    active = (steps < min_tokens)[:, None] & (banned_token_ids >= 0)  # [n, k]
    # NOTE: a min-reduction, so that padding (pointed at token 0, +inf) can never undo a ban
    # of token 0 whatever order the scatter writes in.
    values = torch.where(active, _NEG_INF, float("inf"))  # [n, k]
    logits.scatter_reduce_(1, banned_token_ids.clamp(min=0), values, reduce="amin")


class Sampler:
    """Samples one token per row from logits that each row's SamplingMetadata columns shape.

    Call: `sampler(logits, metadata, bitmask, bitmask_rows)` -> SamplerOutput, everything on
    the logits' device; the caller reads tokens (and logprobs) back when it needs them. The
    logits are not modified.
    """

    def __call__(
        self,
        logits: torch.Tensor,  # [n, vocab] fp32
        metadata: SamplingMetadata,
        bitmask: torch.Tensor | None = None,  # [k, ceil(vocab / 32)] int32, or None
        bitmask_rows: torch.Tensor | None = None,  # [k] int64: logits row of each mask row
    ) -> SamplerOutput:
        if logits.dim() != 2:
            raise ValueError(f"logits must be [n, vocab], got {tuple(logits.shape)}")
        raw = logits.float()
        if raw.stride(1) != 1:
            raw = raw.contiguous()
        if bitmask is not None:
            # NOTE: before the logprobs, as vLLM (which masks the logits before its sampler):
            # a constrained row reports the distribution it was allowed to sample from.
            raw = raw.clone() if raw is logits else raw
            apply_token_bitmask_(raw, bitmask, bitmask_rows)
        token_ids = self.sample(self.process_logits(raw, metadata), metadata)
        logprobs = None
        if metadata.max_num_logprobs is not None:
            # NOTE: of the raw logits (the model's distribution, grammar-masked), as vLLM
            # returns by default; process_logits never writes into them.
            logprobs = LogprobsTensors(*compute_logprobs(raw, token_ids, metadata.max_num_logprobs))
        return SamplerOutput(token_ids, logprobs)

    @staticmethod
    def process_logits(
        logits: torch.Tensor,  # [n, vocab] fp32
        metadata: SamplingMetadata,
    ) -> torch.Tensor:
        """Penalties and min_tokens bans. -> [n, vocab] (the input itself when no stage
        runs, else a new tensor)"""
        owned = False
        if metadata.any_penalties:
            logits, owned = apply_penalties(logits, metadata), True
        if metadata.logit_bias is not None:
            logits, owned = (logits if owned else logits.clone()), True
            metadata.logit_bias.apply_(logits)
        if metadata.banned_token_ids is not None:
            logits = logits if owned else logits.clone()
            owned = True
            apply_min_tokens_(
                logits, metadata.banned_token_ids, metadata.steps, metadata.min_tokens
            )
        return logits

    @staticmethod
    def sample(
        logits: torch.Tensor,  # [n, vocab] fp32, processed
        metadata: SamplingMetadata,
    ) -> torch.Tensor:
        """Greedy rows: argmax; the others: temperature, top-k, top-p, min-p, then the seeded
        draw. -> [n] int64"""
        if metadata.all_greedy:
            return greedy_tokens(logits)
        thresholds = None
        if metadata.any_top_k_top_p or metadata.any_min_p:
            thresholds = truncation_thresholds(
                logits, metadata.temperature, metadata.top_k, metadata.top_p, metadata.min_p,
                metadata.any_top_k_top_p, metadata.any_top_k_and_top_p,
            )  # fmt: skip
        return draw(logits, metadata.temperature, thresholds, metadata.seeds, metadata.steps)


def score_tokens(
    logits: torch.Tensor,  # [n, vocab]
    targets: torch.Tensor,  # [n] int64, the token that follows each row
    k: int,
) -> list[list[tuple[int, float, int]]]:
    """Each target's logprob and rank under its row, then the row's top-k (prompt logprobs)."""
    raw = torch.log_softmax(logits.float(), dim=-1)
    chosen = raw.gather(1, targets[:, None]).squeeze(1)
    ranks = (raw > chosen[:, None]).sum(dim=-1) + 1
    entries = [
        [(t, v, r)]
        for t, v, r in zip(targets.tolist(), chosen.tolist(), ranks.tolist(), strict=True)
    ]
    if k:
        top_vals, top_ids = raw.topk(k, dim=-1)
        for entry, ids, vals in zip(entries, top_ids.tolist(), top_vals.tolist(), strict=True):
            entry += [(t, v, r + 1) for r, (t, v) in enumerate(zip(ids, vals, strict=True))]
    return entries
