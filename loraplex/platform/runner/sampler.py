"""Sampler: penalties, grammar masks, temperature / top-k / top-p / min-p, seeded sampling,
and top-k logprobs, for a batch of rows that each carry their own parameters."""

from __future__ import annotations

from dataclasses import dataclass

import torch

_MASK = float("-inf")
_SEED_MIX = 0x9E3779B97F4A7C15  # spreads (seed, step) pairs over the generator's seed space


@dataclass
class SamplingRow:
    """One row of the batch: the request's parameters and the token history penalties need."""

    temperature: float
    top_p: float
    top_k: int
    min_p: float
    repetition_penalty: float
    presence_penalty: float
    frequency_penalty: float
    seed: int | None
    step: int  # how many tokens this request has sampled so far
    logprobs: int | None
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    banned_token_ids: tuple[int, ...]  # EOS / stop ids while below min_tokens


@dataclass(frozen=True)
class SamplerOutput:
    token_ids: list[int]
    # per row: [(token_id, logprob, rank)] with the sampled token first, or None
    logprobs: list[list[tuple[int, float, int]] | None]
    device_token_ids: torch.Tensor  # [num_rows] int64, the same tokens on the logits' device


class Sampler:
    def __init__(self, seed: int = 0) -> None:
        self._generator = torch.Generator(device="cpu").manual_seed(seed)

    def __call__(
        self,
        logits: torch.Tensor,  # [num_rows, vocab] fp32
        rows: list[SamplingRow],
        bitmask: torch.Tensor | None = None,  # [num_rows, ceil(vocab / 32)] int32, or None
    ) -> SamplerOutput:
        want_logprobs = any(r.logprobs is not None for r in rows)
        raw_logprobs = torch.log_softmax(logits, dim=-1) if want_logprobs else None
        logits = logits.clone()
        self._apply_penalties(logits, rows)
        for i, row in enumerate(rows):
            if row.banned_token_ids:
                logits[i, list(row.banned_token_ids)] = _MASK
        if bitmask is not None:
            from loraplex.grammar.bitmask import apply_token_bitmask_

            apply_token_bitmask_(logits, bitmask)
        token_ids = self._sample(logits, rows)
        return SamplerOutput(
            token_ids.tolist(), self._logprobs(raw_logprobs, token_ids, rows), token_ids
        )

    @staticmethod
    def _apply_penalties(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
        vocab = logits.shape[1]
        for i, row in enumerate(rows):
            if row.repetition_penalty != 1.0:
                seen = torch.tensor(
                    row.prompt_token_ids + row.output_token_ids,
                    dtype=torch.long,
                    device=logits.device,
                ).unique()
                values = logits[i, seen]
                logits[i, seen] = torch.where(
                    values > 0, values / row.repetition_penalty, values * row.repetition_penalty
                )
            if (row.presence_penalty or row.frequency_penalty) and row.output_token_ids:
                out = torch.tensor(row.output_token_ids, dtype=torch.long, device=logits.device)
                counts = torch.bincount(out, minlength=vocab)[:vocab].to(logits.dtype)
                logits[i] -= row.frequency_penalty * counts
                logits[i] -= row.presence_penalty * (counts > 0).to(logits.dtype)

    def _sample(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        num_rows, vocab = logits.shape
        device = logits.device
        greedy = torch.tensor([r.temperature < 1e-5 for r in rows], device=device)
        out = logits.argmax(dim=-1)
        if bool(greedy.all()):
            return out
        temps = torch.tensor([max(r.temperature, 1e-5) for r in rows], device=device)
        logits = logits / temps[:, None]
        if any(r.top_k > 0 or r.top_p < 1.0 for r in rows):
            logits = _top_k_top_p(logits, rows)
        probs = torch.softmax(logits, dim=-1)
        if any(r.min_p > 0.0 for r in rows):
            min_p = torch.tensor([r.min_p for r in rows], device=device)
            keep = probs >= min_p[:, None] * probs.max(dim=-1, keepdim=True).values
            probs = torch.where(keep, probs, torch.zeros_like(probs))
        # Exponential-race sampling: argmax(p / q), q ~ Exp(1), draws from p exactly. Each
        # seeded row draws its noise from (seed, step) alone, so its text does not depend on
        # what else shares the batch.
        noise = torch.empty(num_rows, vocab)
        for i, row in enumerate(rows):
            if row.seed is not None:
                gen = torch.Generator().manual_seed((row.seed * _SEED_MIX + row.step) % 2**63)
                noise[i].exponential_(generator=gen)
            else:
                noise[i].exponential_(generator=self._generator)
        sampled = (probs / noise.to(device)).argmax(dim=-1)
        return torch.where(greedy, out, sampled)

    @staticmethod
    def _logprobs(
        raw: torch.Tensor | None, token_ids: torch.Tensor, rows: list[SamplingRow]
    ) -> list[list[tuple[int, float, int]] | None]:
        if raw is None:
            return [None] * len(rows)
        result: list[list[tuple[int, float, int]] | None] = []
        chosen = raw.gather(1, token_ids[:, None]).squeeze(1)
        ranks = (raw > chosen[:, None]).sum(dim=-1) + 1
        max_k = max(r.logprobs or 0 for r in rows)
        top_vals, top_ids = raw.topk(max_k, dim=-1) if max_k else (None, None)
        for i, row in enumerate(rows):
            if row.logprobs is None:
                result.append(None)
                continue
            entry = [(int(token_ids[i]), float(chosen[i]), int(ranks[i]))]
            if row.logprobs and top_vals is not None and top_ids is not None:
                entry += [
                    (int(t), float(v), r + 1)
                    for r, (t, v) in enumerate(
                        zip(
                            top_ids[i, : row.logprobs].tolist(),
                            top_vals[i, : row.logprobs].tolist(),
                        )
                    )
                ]
            result.append(entry)
        return result


def _top_k_top_p(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """Mask everything outside each row's top-k and top-p nucleus (at least one token kept)."""
    vocab = logits.shape[1]
    device = logits.device
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(vocab, device=device)[None, :]
    top_k = torch.tensor([r.top_k if r.top_k > 0 else vocab for r in rows], device=device)
    mask = ranks >= top_k[:, None]
    sorted_logits = sorted_logits.masked_fill(mask, _MASK)
    top_p = torch.tensor([r.top_p for r in rows], device=device)
    probs = torch.softmax(sorted_logits, dim=-1)
    before = probs.cumsum(dim=-1) - probs  # mass strictly above each token
    mask = (before > top_p[:, None]) & (ranks > 0)
    sorted_logits = sorted_logits.masked_fill(mask, _MASK)
    return torch.full_like(logits, _MASK).scatter(1, order, sorted_logits)


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
