"""InputBatch: the persistent state of the running requests, one stable row each.

Host arrays hold what the step's batch layout is built from (token ids, computed counts,
block-table rows, LoRA slots); device columns hold every sampling parameter, the latest
sampled token of each row, and — once a request with a penalty arrives — the occurrence counts
penalties read. A step writes only the rows that changed: requests added (through one pinned
upload per column block), finished, or moved. Rows stay compact (0..num_reqs-1): a freed row
is filled by moving the last row into it, so a step that runs every request in row order needs
no index tensor at all.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
import torch

from loraplex.platform.core.sampling_params import SamplingParams
from loraplex.platform.core.scheduler_output import CachedRequestData, NewRequestData
from loraplex.platform.runner.sampling_metadata import (
    LogitBias,
    SamplingMetadata,
    make_logit_bias,
)

# Rows of the device column blocks (one tensor per dtype, a column per parameter).
_TEMPERATURE, _TOP_P, _MIN_P, _REPETITION, _PRESENCE, _FREQUENCY = range(6)
_TOP_K, _NUM_LOGPROBS = range(2)
_SEED, _STEP, _MIN_TOKENS = range(3)
_INT64_RANGE = 1 << 64
_MIN_BANNED_WIDTH = 4


def to_device(array: np.ndarray, device: torch.device) -> torch.Tensor:
    """A host array on the device without waiting for the device (pinned staging on CUDA)."""
    tensor = torch.from_numpy(np.ascontiguousarray(array))
    if device.type != "cuda":
        return tensor
    return tensor.pin_memory().to(device, non_blocking=True)


def seed_as_int64(seed: int) -> int:
    """Any Python int as a signed 64-bit value (wrapped), the sampler's seed type."""
    value = seed % _INT64_RANGE
    return value - _INT64_RANGE if value >= _INT64_RANGE // 2 else value


@dataclass(frozen=True)
class _RowFlags:
    """Which sampler stages one request needs; summed over the rows into the host flags."""

    random: bool  # temperature above the greedy threshold
    top_k_top_p: bool
    top_k_and_top_p: bool  # both at once (the sampler's threshold search runs twice)
    min_p: bool
    penalties: bool
    repetition: bool
    plain_greedy: bool  # argmax of the raw logits is all its sampling needs
    num_logprobs: int | None
    logit_bias: bool = False

    @classmethod
    def of(cls, p: SamplingParams) -> _RowFlags:
        greedy = p.greedy
        return cls(
            random=not greedy,
            top_k_top_p=not greedy and (p.top_k > 0 or p.top_p < 1.0),
            top_k_and_top_p=not greedy and p.top_k > 0 and p.top_p < 1.0,
            min_p=not greedy and p.min_p > 0.0,
            penalties=p.needs_penalties,
            repetition=p.repetition_penalty != 1.0,
            plain_greedy=greedy and p.logprobs is None and not p.needs_penalties
            and p.min_tokens == 0 and not p.logit_bias,
            num_logprobs=p.logprobs,
            logit_bias=bool(p.logit_bias),
        )  # fmt: skip


class InputBatch:
    """Per-request state of the running batch in preallocated host arrays and device columns.

    Rows 0..num_reqs-1 are occupied. Call `remove` for finished requests, then `condense`, then
    `add` (appends rows) and `update`; `sampling_metadata` gathers a step's sampled rows;
    `record_sampled` writes a step's tokens into the device state right after sampling, and
    `receive` appends them on the host when they are read back."""

    def __init__(
        self,
        max_num_seqs: int,
        max_model_len: int,
        max_blocks_per_seq: int,
        vocab_size: int,
        device: torch.device,
    ) -> None:
        if max_num_seqs < 1 or max_model_len < 1 or vocab_size < 1:
            raise ValueError("max_num_seqs, max_model_len and vocab_size must be positive")
        n = max_num_seqs
        self.max_num_seqs = n
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.device = device
        self.eos_token_ids: tuple[int, ...] = ()
        # -- host ------------------------------------------------------------------------
        self.num_reqs = 0
        self.req_ids: list[str | None] = [None] * n
        self.req_index: dict[str, int] = {}
        self.params: list[SamplingParams | None] = [None] * n
        self._flags: list[_RowFlags | None] = [None] * n
        # NOTE: one spare column: a request that reaches max_model_len samples one past it.
        self.token_ids = np.zeros((n, max_model_len + 1), dtype=np.int32)
        self.num_tokens = np.zeros(n, dtype=np.int64)  # tokens known on the host
        self.num_pending = np.zeros(n, dtype=np.int64)  # sampled, not read back yet
        # Draft tokens written after a row's known tokens for this step's verification.
        self.num_spec = np.zeros(n, dtype=np.int64)
        self.num_prompt_tokens = np.zeros(n, dtype=np.int64)
        self.num_computed_tokens = np.zeros(n, dtype=np.int64)
        self.block_table = np.zeros((n, max_blocks_per_seq), dtype=np.int32)
        self.num_blocks = np.zeros(n, dtype=np.int64)
        self.lora_slots = np.full(n, -1, dtype=np.int32)
        # Which add of a request a row holds: a token read back for an earlier add (before a
        # preemption) is not appended to the new one.
        self.generation = np.zeros(n, dtype=np.int64)
        self._num_adds = 0
        self._counts: Counter[str] = Counter()  # host flags, as counts of rows
        self._logprob_ks: Counter[int] = Counter()
        self._below_min_tokens: set[str] = set()
        self._freed: list[int] = []  # rows `remove` emptied since the last `condense`
        # -- device ----------------------------------------------------------------------
        self._float = torch.zeros((6, n), dtype=torch.float32, device=device)  # [6, n]
        self._int32 = torch.zeros((2, n), dtype=torch.int32, device=device)  # [2, n]
        self._int64 = torch.zeros((3, n), dtype=torch.int64, device=device)  # [3, n]
        self.last_token = torch.zeros(n, dtype=torch.int64, device=device)  # [n]
        self.banned = torch.full((n, _MIN_BANNED_WIDTH), -1, dtype=torch.int64, device=device)
        # NOTE: [n, vocab] each, allocated the first time a request with a penalty arrives
        # (5 bytes per entry: ~160 MB at 256 rows of a 128k vocabulary, inside the headroom
        # the KV sizing leaves free).
        self.output_counts: torch.Tensor | None = None  # [n, vocab] int32
        self.prompt_mask: torch.Tensor | None = None  # [n, vocab] bool

    # -- host flags ----------------------------------------------------------------------

    @property
    def plain_greedy(self) -> bool:
        """Every row samples by argmax of its raw logits (no sampler stage needed)."""
        return self._counts["not_plain"] == 0

    @property
    def any_penalties(self) -> bool:
        return self._counts["penalties"] > 0

    def _count(self, flags: _RowFlags, sign: int) -> None:
        c = self._counts
        c["random"] += sign * flags.random
        c["top_k_top_p"] += sign * flags.top_k_top_p
        c["top_k_and_top_p"] += sign * flags.top_k_and_top_p
        c["min_p"] += sign * flags.min_p
        c["penalties"] += sign * flags.penalties
        c["repetition"] += sign * flags.repetition
        c["not_plain"] += sign * (not flags.plain_greedy)
        c["logit_bias"] += sign * flags.logit_bias
        if flags.num_logprobs is not None:
            self._logprob_ks[flags.num_logprobs] += sign
            if not self._logprob_ks[flags.num_logprobs]:
                del self._logprob_ks[flags.num_logprobs]

    # -- rows in and out -----------------------------------------------------------------

    def remove(self, req_id: str) -> None:
        """Free a request's row (the hole is filled by `condense`); unknown ids are ignored."""
        row = self.req_index.pop(req_id, None)
        if row is None:
            return
        flags = self._flags[row]
        assert flags is not None
        self._count(flags, -1)
        self._below_min_tokens.discard(req_id)
        self.req_ids[row] = self.params[row] = self._flags[row] = None
        self._freed.append(row)

    def condense(self) -> None:
        """Move the last occupied rows into the holes `remove` left, so rows stay 0..n-1
        (work proportional to the rows removed)."""
        if not self._freed:
            return
        live = len(self.req_index)
        holes = sorted(r for r in self._freed if r < live)
        self._freed.clear()
        if not holes:
            self.num_reqs = live
            return
        sources = [r for r in range(live, self.num_reqs) if self.req_ids[r] is not None]
        assert len(sources) == len(holes)
        dst, src = np.asarray(holes), np.asarray(sources)
        for array in (
            self.num_tokens, self.num_pending, self.num_spec, self.num_prompt_tokens,
            self.num_computed_tokens,
            self.block_table, self.num_blocks, self.lora_slots, self.generation,
        ):  # fmt: skip
            array[dst] = array[src]
        for d, s in zip(holes, sources):
            self.token_ids[d, : self.num_tokens[d]] = self.token_ids[s, : self.num_tokens[d]]
            req_id = self.req_ids[s]
            assert req_id is not None
            self.req_ids[d], self.params[d], self._flags[d] = req_id, self.params[s], self._flags[s]
            self.req_ids[s] = self.params[s] = self._flags[s] = None
            self.req_index[req_id] = d
        # NOTE: sources are all >= live and holes all < live, so one gather-scatter per
        # tensor moves them (no chain of moves).
        idx = to_device(np.stack([dst, src]).astype(np.int64), self.device)
        d_idx, s_idx = idx[0], idx[1]
        for col in (self._float, self._int32, self._int64):
            col[:, d_idx] = col[:, s_idx]
        for tensor in (self.last_token, self.banned, self.output_counts, self.prompt_mask):
            if tensor is not None:
                tensor[d_idx] = tensor[s_idx]
        self.num_reqs = live

    def add(self, new_reqs: list[NewRequestData]) -> None:
        """Append rows for requests the runner has not seen (or saw before a preemption);
        every parameter column of the new rows is written in one upload per dtype, and their
        penalty state is rebuilt from their tokens."""
        if not new_reqs:
            return
        if self.num_reqs != len(self.req_index):
            raise ValueError("condense() the batch before adding rows")
        start, k = self.num_reqs, len(new_reqs)
        if start + k > self.max_num_seqs:
            raise ValueError(f"more than max_num_seqs={self.max_num_seqs} running requests")
        floats = np.zeros((6, k), dtype=np.float32)
        ints32 = np.zeros((2, k), dtype=np.int32)
        ints64 = np.zeros((3, k), dtype=np.int64)
        banned_rows = []
        penalised = []
        for i, new in enumerate(new_reqs):
            row, p = start + i, new.sampling_params
            if p.seed is None:
                raise ValueError("every request needs a seed (the engine draws one at admission)")
            if new.req_id in self.req_index:
                raise ValueError(f"request {new.req_id!r} is already in the batch")
            tokens = list(new.prompt_token_ids) + list(new.output_token_ids)
            num_out = len(new.output_token_ids)
            self.req_ids[row], self.params[row] = new.req_id, p
            self.req_index[new.req_id] = row
            flags = _RowFlags.of(p)
            self._flags[row] = flags
            self._count(flags, +1)
            self.token_ids[row, : len(tokens)] = tokens
            self.num_tokens[row] = len(tokens)
            self.num_pending[row] = 0
            self.num_spec[row] = 0
            self.num_prompt_tokens[row] = len(new.prompt_token_ids)
            self.num_computed_tokens[row] = new.num_computed_tokens
            self.block_table[row, : len(new.block_ids)] = new.block_ids
            self.num_blocks[row] = len(new.block_ids)
            self.lora_slots[row] = new.lora_slot
            self._num_adds += 1
            self.generation[row] = self._num_adds
            floats[:, i] = (
                p.temperature, p.top_p, p.min_p,
                p.repetition_penalty, p.presence_penalty, p.frequency_penalty,
            )  # fmt: skip
            ints32[:, i] = (min(p.top_k, self.vocab_size), -1 if p.logprobs is None else p.logprobs)
            ints64[:, i] = (seed_as_int64(p.seed), num_out, p.min_tokens)
            banned = (*self.eos_token_ids, *p.stop_token_ids) if p.min_tokens else ()
            banned_rows.append(banned)
            if p.min_tokens > num_out:
                self._below_min_tokens.add(new.req_id)
            if flags.penalties:
                penalised.append((row, new.prompt_token_ids, new.output_token_ids))
        dev = self.device
        self._float[:, start : start + k] = to_device(floats, dev)
        self._int32[:, start : start + k] = to_device(ints32, dev)
        self._int64[:, start : start + k] = to_device(ints64, dev)
        self._write_banned(start, banned_rows)
        if penalised:
            self._rebuild_penalty_state(penalised)
        self.num_reqs = start + k

    def _write_banned(self, start: int, rows: list[tuple[int, ...]]) -> None:
        width = max(len(r) for r in rows)
        if width > self.banned.shape[1]:
            grown = torch.full(
                (self.max_num_seqs, width), -1, dtype=torch.int64, device=self.device
            )
            grown[:, : self.banned.shape[1]] = self.banned
            self.banned = grown
        host = np.full((len(rows), self.banned.shape[1]), -1, dtype=np.int64)
        for i, r in enumerate(rows):
            host[i, : len(r)] = r
        self.banned[start : start + len(rows)] = to_device(host, self.device)

    def _rebuild_penalty_state(self, rows: list[tuple[int, list[int], list[int]]]) -> None:
        """Output counts and prompt mask of (re-)added penalty rows, from their tokens."""
        if self.output_counts is None:
            shape = (self.max_num_seqs, self.vocab_size)
            self.output_counts = torch.zeros(shape, dtype=torch.int32, device=self.device)
            self.prompt_mask = torch.zeros(shape, dtype=torch.bool, device=self.device)
        assert self.prompt_mask is not None
        row_ids = [r for r, _, _ in rows]
        num_prompt = sum(len(p) for _, p, _ in rows)
        num_out = sum(len(o) for _, _, o in rows)
        # One upload: the rows, then (row, token) pairs of the prompts, then of the outputs.
        host = np.empty((2, len(rows) + num_prompt + num_out), dtype=np.int64)
        host[:, : len(rows)] = row_ids
        at = len(rows)
        for part in (1, 2):
            for r, *tokens in rows:
                toks = tokens[part - 1]
                host[0, at : at + len(toks)] = r
                host[1, at : at + len(toks)] = toks
                at += len(toks)
        idx = to_device(host, self.device)
        row_idx = idx[0, : len(rows)]
        self.output_counts[row_idx] = 0
        self.prompt_mask[row_idx] = False
        lo, mid = len(rows), len(rows) + num_prompt
        self.prompt_mask[idx[0, lo:mid], idx[1, lo:mid]] = True
        ones = torch.ones(num_out, dtype=torch.int32, device=self.device)
        self.output_counts.index_put_((idx[0, mid:], idx[1, mid:]), ones, accumulate=True)

    def update(self, cached_reqs: Iterable[CachedRequestData]) -> None:
        """Apply what changed for requests the batch holds: new blocks, computed counts."""
        for cached in cached_reqs:
            row = self.req_index[cached.req_id]
            if cached.new_block_ids:
                n, k = self.num_blocks[row], len(cached.new_block_ids)
                self.block_table[row, n : n + k] = cached.new_block_ids
                self.num_blocks[row] = n + k
            self.num_computed_tokens[row] = cached.num_computed_tokens

    # -- one step ------------------------------------------------------------------------

    def sampling_metadata(self, rows: np.ndarray, index: torch.Tensor | None) -> SamplingMetadata:
        """The sampling columns of `rows` (the step's sampled rows, in logits order); `index`
        is them on the device, or None when rows are 0..n-1 (the columns are sliced)."""
        n = len(rows)
        self._refresh_min_tokens()

        def take(t: torch.Tensor | None) -> torch.Tensor | None:
            if t is None:
                return None
            return t[:n] if index is None else t[index]

        def cols(block: torch.Tensor) -> torch.Tensor:
            return block[:, :n] if index is None else block[:, index]

        f, i32, i64 = cols(self._float), cols(self._int32), cols(self._int64)
        c = self._counts
        max_k = max(self._logprob_ks) if self._logprob_ks else None
        return SamplingMetadata(
            temperature=f[_TEMPERATURE],
            top_k=i32[_TOP_K],
            top_p=f[_TOP_P],
            min_p=f[_MIN_P],
            repetition_penalty=f[_REPETITION],
            presence_penalty=f[_PRESENCE],
            frequency_penalty=f[_FREQUENCY],
            seeds=i64[_SEED],
            steps=i64[_STEP],
            output_counts=take(self.output_counts) if c["penalties"] else None,
            prompt_mask=take(self.prompt_mask) if c["repetition"] else None,
            banned_token_ids=take(self.banned) if self._below_min_tokens else None,
            min_tokens=i64[_MIN_TOKENS],
            all_greedy=c["random"] == 0,
            any_top_k_top_p=c["top_k_top_p"] > 0,
            any_top_k_and_top_p=c["top_k_and_top_p"] > 0,
            any_min_p=c["min_p"] > 0,
            any_penalties=c["penalties"] > 0,
            max_num_logprobs=max_k,
            num_logprobs=i32[_NUM_LOGPROBS] if max_k is not None else None,
            logit_bias=self._logit_bias(rows) if c["logit_bias"] else None,
        )

    def _logit_bias(self, rows: np.ndarray) -> LogitBias | None:
        """The biases of the step's sampled `rows` (logits row i is rows[i]); ids past the
        vocabulary are left out."""
        entries = []
        for i, row in enumerate(rows.tolist()):
            flags, params = self._flags[row], self.params[row]
            if flags is not None and flags.logit_bias and params is not None:
                entries += [(i, t, v) for t, v in params.logit_bias if t < self.vocab_size]
        return make_logit_bias(entries, self.device) if entries else None

    def _refresh_min_tokens(self) -> None:
        for req_id in list(self._below_min_tokens):
            row = self.req_index[req_id]
            params = self.params[row]
            assert params is not None
            sampled = self.num_tokens[row] + self.num_pending[row] - self.num_prompt_tokens[row]
            if sampled >= params.min_tokens:
                self._below_min_tokens.discard(req_id)

    def record_sampled(
        self,
        tokens: torch.Tensor,  # [k] int64 on the device
        rows: np.ndarray,  # [k] int64, the rows that sampled them
        index: torch.Tensor | None,  # rows on the device, or None when rows are 0..k-1
    ) -> None:
        """Right after sampling, on the device: each row's latest token (the next step's
        input while it is pending), its step counter, and its output counts."""
        k = len(rows)
        self.num_pending[rows] += 1
        penalties = self.output_counts is not None and self.any_penalties
        if index is None:
            self.last_token[:k] = tokens
            self._int64[_STEP, :k] += 1
            if penalties:
                assert self.output_counts is not None
                ones = torch.ones((k, 1), dtype=torch.int32, device=self.device)
                self.output_counts[:k].scatter_add_(1, tokens[:, None], ones)
            return
        self.last_token[index] = tokens
        self._int64[_STEP].index_add_(0, index, torch.ones_like(tokens))
        if penalties:
            assert self.output_counts is not None
            ones = torch.ones(k, dtype=torch.int32, device=self.device)
            self.output_counts.index_put_((index, tokens), ones, accumulate=True)

    def set_drafts(self, drafts: dict[str, list[int]]) -> None:
        """Write this step's draft tokens after each request's known tokens (the step
        verifies them); rows not named propose nothing."""
        self.num_spec[: self.num_reqs] = 0
        for req_id, tokens in drafts.items():
            row = self.req_index[req_id]
            start = self.num_tokens[row]
            self.token_ids[row, start : start + len(tokens)] = tokens
            self.num_spec[row] = len(tokens)

    def record_verified(
        self,
        tokens: torch.Tensor,  # [k, K + 1] int64 on the device, valid up to num_emitted
        num_emitted: torch.Tensor,  # [k] int64 on the device, 1..K + 1
        rows: np.ndarray,  # [k] int64, the rows that verified drafts and sampled
        index: torch.Tensor | None,  # rows on the device, or None when rows are 0..k-1
    ) -> None:
        """`record_sampled` for a step that emitted several tokens per row: each row's last
        emitted token and its step counter advanced by the tokens it emitted (rows with
        penalties never speculate, so output counts are untouched)."""
        self.num_pending[rows] += 1
        self.num_spec[rows] = 0
        last = tokens.gather(1, (num_emitted - 1)[:, None]).squeeze(1)  # [k]
        dev_rows = index if index is not None else torch.arange(len(rows), device=self.device)
        self.last_token[dev_rows] = last
        self._int64[_STEP].index_add_(0, dev_rows, num_emitted)

    def generations(self, rows: np.ndarray) -> np.ndarray:
        return self.generation[rows].copy()

    def receive(
        self,
        req_ids: list[str],
        generations: np.ndarray,
        token_ids: list[int],
        extra: dict[str, list[int]] | None = None,
    ) -> dict[str, int]:
        """Append a step's tokens, read back, to the rows that still hold the same requests;
        `extra` holds the tokens a speculative row emitted after its first."""
        sampled = {}
        for req_id, gen, token in zip(req_ids, generations.tolist(), token_ids):
            sampled[req_id] = token
            row = self.req_index.get(req_id)
            if row is not None and self.generation[row] == gen:
                more = extra.get(req_id, ()) if extra else ()
                at = self.num_tokens[row]
                self.token_ids[row, at] = token
                self.token_ids[row, at + 1 : at + 1 + len(more)] = more
                self.num_tokens[row] += 1 + len(more)
                self.num_pending[row] -= 1
        return sampled
