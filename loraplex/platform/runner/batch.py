"""Batch: one step's inputs in DESIGN.md's layout, built from the persistent InputBatch.

The step's sequences are taken in row order, so a step that runs every request of a compact
batch (the common decode step) reads rows 0..n-1 and needs no index tensor on the device: its
sampling columns are slices, and its pending input tokens are the first n of the batch's
latest tokens. Otherwise one index upload carries the rows that sample and where the pending
tokens go.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from loraplex.platform.core.scheduler_output import SchedulerOutput
from loraplex.platform.runner.input_batch import InputBatch, to_device
from loraplex.platform.runner.sampling_metadata import SamplingMetadata

PENDING = -1  # input id placeholder of a token still on the device


@dataclass(frozen=True)
class Batch:
    """What the eager path, the CUDA-graph path and the sampler read for one step."""

    input_ids: np.ndarray  # [num_tokens] int64; PENDING where the token is on the device
    positions: np.ndarray  # [num_tokens] int64
    slot_mapping: np.ndarray  # [num_tokens] int64
    query_start_loc: np.ndarray  # [num_seqs + 1] int32
    seq_lens: np.ndarray  # [num_seqs] int32
    block_tables: np.ndarray  # [num_seqs, max_blocks] int32
    lora_slots: np.ndarray  # [num_tokens] int32, -1 = base model
    any_lora: bool
    max_query_len: int
    is_decode: bool  # one new token per sequence, and every sequence samples
    sample_req_ids: list[str]
    sample_rows: np.ndarray  # [num_sampled] int64, input-batch rows, ascending
    # [num_sampled] int64 on the device: sample_rows, or None when they are 0..num_sampled-1
    sample_index: torch.Tensor | None
    logits_indices: np.ndarray  # [num_sampled] int64, token row of each sampled sequence
    # Token rows whose input is still on the device [k] int64, and the input-batch row whose
    # latest token each one is [k] int64 (host, and on the device or None when both are 0..k-1).
    pending_tokens: np.ndarray
    pending_rows: np.ndarray
    pending_index: tuple[torch.Tensor, torch.Tensor] | None
    # None for a plain-greedy step (argmax of the raw logits, no sampler stage).
    sampling: SamplingMetadata | None
    # (req_id, token row of its first scored token, the prompt tokens those rows score
    # [n] int64, prompt position of the first of them), for prompt logprobs
    prompt_scores: tuple[tuple[str, int, np.ndarray, int], ...] = ()
    # Speculative steps: drafts each sampled row verifies [num_sampled] int64 (its logits
    # rows are its last spec_lens + 1 token rows, in order); None when no row has drafts.
    spec_lens: np.ndarray | None = None

    @property
    def sample_logits_rows(self) -> np.ndarray:
        """The first logits row of each sampled row. [num_sampled] int64"""
        if self.spec_lens is None:
            return np.arange(len(self.sample_rows), dtype=np.int64)
        return np.cumsum(self.spec_lens + 1) - (self.spec_lens + 1)

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens)


def build_batch(
    ib: InputBatch,
    so: SchedulerOutput,
    block_size: int,
    scoring: set[str],
    need_sampler: bool,
) -> Batch:
    """The step's batch, vectorised over rows. `scoring` names the requests whose prompt
    logprobs are still being computed (a request leaves it once its prompt is scored);
    `need_sampler` asks for sampling metadata even when every row is plain greedy."""
    n = len(so.num_scheduled_tokens)
    index = ib.req_index
    rows = np.fromiter((index[r] for r in so.num_scheduled_tokens), np.int64, n)
    counts = np.fromiter(so.num_scheduled_tokens.values(), np.int64, n)
    if n > 1 and not bool((rows[1:] > rows[:-1]).all()):
        order = np.argsort(rows)
        rows, counts = rows[order], counts[order]
    starts = ib.num_computed_tokens[rows]
    spec = ib.num_spec[rows]
    known = ib.num_tokens[rows] + spec  # NOTE: a step's draft tokens are inputs on the host
    max_query_len = int(counts.max())
    if max_query_len == 1:
        positions = starts
        query_start = np.arange(n + 1, dtype=np.int32)
        token_rows = rows
        seq_of_token = None
    else:
        query_start = np.zeros(n + 1, dtype=np.int32)
        np.cumsum(counts, out=query_start[1:])
        seq_of_token = np.repeat(np.arange(n), counts)
        positions = (
            np.arange(int(query_start[-1]), dtype=np.int64)
            - query_start[seq_of_token]
            + starts[seq_of_token]
        )
        token_rows = rows[seq_of_token]
    # NOTE: a token at or past what the host knows is the pending one (a decoding request's
    # one input, sampled by the step before and still on the device).
    on_host = positions < (ib.num_tokens + ib.num_spec)[token_rows]
    input_ids = np.where(on_host, ib.token_ids[token_rows, positions], PENDING).astype(np.int64)
    block_ids = ib.block_table[token_rows, positions // block_size]
    slot_mapping = block_ids.astype(np.int64) * block_size + positions % block_size
    seq_lens = (starts + counts).astype(np.int32)
    samples = np.flatnonzero(seq_lens == known + ib.num_pending[rows])
    sample_rows = rows[samples]
    pending_tokens = np.flatnonzero(~on_host)
    pending_rows = token_rows[pending_tokens]
    lora_slots = ib.lora_slots[token_rows]
    prompt_scores = _prompt_scores(ib, rows, starts, counts, query_start, scoring)

    # One upload of whichever row indices are not 0..k-1.
    k, p = len(sample_rows), len(pending_tokens)
    sample_compact = k == 0 or sample_rows[-1] == k - 1
    pending_compact = p == 0 or (pending_tokens[-1] == p - 1 and pending_rows[-1] == p - 1)
    parts = ([] if sample_compact else [sample_rows]) + (
        [] if pending_compact else [pending_tokens, pending_rows]
    )
    sample_index = pending_index = None
    if parts:
        dev = to_device(np.concatenate(parts), ib.device)
        at = 0
        if not sample_compact:
            sample_index, at = dev[:k], k
        if not pending_compact:
            pending_index = (dev[at : at + p], dev[at + p : at + 2 * p])
    ends = query_start[1:][samples].astype(np.int64)
    spec_lens = spec[samples] if bool(spec.any()) else None
    if spec_lens is None:
        logits_indices = ends - 1
    else:  # each sampled row's last spec_lens + 1 tokens
        lens = spec_lens + 1
        logits_indices = np.repeat(ends - lens, lens) + (
            np.arange(int(lens.sum())) - np.repeat(np.cumsum(lens) - lens, lens)
        )
    sampling = None
    if k and (need_sampler or not ib.plain_greedy):
        sampling = ib.sampling_metadata(sample_rows, sample_index)
    req_ids = ib.req_ids
    return Batch(
        input_ids=input_ids,
        positions=positions,
        slot_mapping=slot_mapping,
        query_start_loc=query_start,
        seq_lens=seq_lens,
        block_tables=ib.block_table[rows, : int(ib.num_blocks[rows].max())],
        lora_slots=lora_slots,
        any_lora=bool((lora_slots >= 0).any()),
        max_query_len=max_query_len,
        is_decode=max_query_len == 1 and k == n,
        sample_req_ids=[req_ids[r] for r in sample_rows.tolist()],  # type: ignore[misc]
        sample_rows=sample_rows,
        sample_index=sample_index,
        logits_indices=logits_indices,
        pending_tokens=pending_tokens,
        pending_rows=pending_rows,
        pending_index=pending_index,
        sampling=sampling,
        prompt_scores=prompt_scores,
        spec_lens=spec_lens,
    )


def _prompt_scores(
    ib: InputBatch,
    rows: np.ndarray,
    starts: np.ndarray,
    counts: np.ndarray,
    query_start: np.ndarray,
    scoring: set[str],
) -> tuple[tuple[str, int, np.ndarray, int], ...]:
    if not scoring:
        return ()
    scores = []
    for i, row in enumerate(rows.tolist()):
        req_id = ib.req_ids[row]
        if req_id not in scoring:
            continue
        # Row p scores the prompt token at p + 1; the prompt's last row samples instead.
        start, num_prompt = int(starts[i]), int(ib.num_prompt_tokens[row])
        n = min(int(counts[i]), num_prompt - 1 - start)
        if n > 0:
            targets = ib.token_ids[row, start + 1 : start + 1 + n].astype(np.int64)
            scores.append((req_id, int(query_start[i]), targets, start + 1))
        if start + int(counts[i]) >= num_prompt:
            scoring.discard(req_id)
    return tuple(scores)


def fill_pending(input_ids: torch.Tensor, batch: Batch, last_token: torch.Tensor) -> None:
    """Write the inputs still pending from the previous step, from the device."""
    k = len(batch.pending_tokens)
    if k == 0:
        return
    if batch.pending_index is None:  # the first k tokens are rows 0..k-1's
        input_ids[:k].copy_(last_token[:k])
    else:
        tokens, rows = batch.pending_index
        input_ids[tokens] = last_token[rows]
