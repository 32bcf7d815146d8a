"""Draft-model proposer: a smaller model of the same tokenizer runs k steps ahead of the
target, with its own small paged KV cache and no adapters, sampling each draft from the
request's own sampling distribution (temperature, top-k, top-p, min-p) and reporting it."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import numpy as np
import torch

from loraplex.config import EngineConfig
from loraplex.platform.models.attention_metadata import AttentionMetadata
from loraplex.platform.models.model_loader import load_model
from loraplex.platform.models.model_store import resolve_model_path
from loraplex.platform.spec.config import SpeculativeConfig
from loraplex.platform.spec.draft_sampler import DraftSampler
from loraplex.platform.spec.proposer import ProposalRequest, Proposals, Proposer

logger = logging.getLogger(__name__)

# NOTE: the draft's noise comes from the request's seed under another key, so its draws are
# independent of the target's (whose noise decides acceptance and recovery).
_DRAFT_SEED_SALT = 0x5DEECE66D


@dataclass
class _DraftState:
    """One request in the draft's cache: its blocks and the tokens whose K/V they hold."""

    blocks: list[int] = field(default_factory=list)
    tokens: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))


class DraftModelProposer(Proposer):
    """Proposes k tokens per request by running the draft model k steps (batched over the
    requests); rejected drafts' K/V is dropped by trimming each request's cached tokens to
    the prefix it shares with the request's tokens at the next call. Each draft is sampled by
    `sampler` (the runner's), as the target samples its row."""

    def __init__(
        self,
        spec: SpeculativeConfig,
        config: EngineConfig,
        vocab_size: int,
        device: torch.device,
        sampler: DraftSampler,
    ) -> None:
        assert spec.model is not None
        self.k = spec.num_speculative_tokens
        self.device = device
        self.sampler = sampler
        self.model, self.arch, dtype = load_model(
            resolve_model_path(spec.model), config.model.dtype, device, None,
            random_seed=config.model.seed + 1,
        )  # fmt: skip
        if self.arch.vocab_size != vocab_size:
            raise ValueError(
                f"the draft model's vocabulary ({self.arch.vocab_size} tokens) differs from the "
                f"target's ({vocab_size}); a draft must share the target's tokenizer"
            )
        self.block_size = config.cache.block_size
        self.num_blocks = spec.draft_num_kv_blocks
        shape = (self.num_blocks, self.block_size, self.arch.num_kv_heads, self.arch.head_dim)
        self.kv_caches = [
            (torch.zeros(shape, dtype=dtype, device=device),
             torch.zeros(shape, dtype=dtype, device=device))
            for _ in range(self.arch.num_layers)
        ]  # fmt: skip
        self._free = list(range(self.num_blocks - 1, -1, -1))
        self._states: dict[str, _DraftState] = {}
        logger.info("draft model %s: %d KV blocks", spec.model, self.num_blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def remove(self, req_ids: set[str] | frozenset[str]) -> None:
        for req_id in req_ids:
            state = self._states.pop(req_id, None)
            if state is not None:
                self._free.extend(reversed(state.blocks))

    def _prepare(self, req: ProposalRequest, k: int) -> tuple[_DraftState, int] | None:
        """The request's state with room for k more tokens, and how many of its tokens the
        cache already holds; None when the draft's pool is full."""
        state = self._states.setdefault(req.req_id, _DraftState())
        tokens = req.token_ids
        n = min(len(state.tokens), len(tokens) - 1)
        same = state.tokens[:n] == tokens[:n]
        common = n if bool(same.all()) else int(np.argmin(same))
        need = -(-(len(tokens) + k - 1) // self.block_size) - len(state.blocks)
        if need > len(self._free):
            return None
        state.blocks += [self._free.pop() for _ in range(max(need, 0))]
        return state, common

    @torch.inference_mode()
    def propose(self, requests: list[ProposalRequest]) -> Proposals:
        rows: list[tuple[ProposalRequest, _DraftState, int, int]] = []
        for req in requests:
            k = min(self.k, req.max_tokens)
            # NOTE: room for the longest run: every row is fed the batch's k_max - 1 drafts
            prepared = self._prepare(req, self.k) if k > 0 else None
            if prepared is not None:
                rows.append((req, *prepared, k))
        if not rows:
            return Proposals({}, {})
        n, k_max, dev = len(rows), max(r[3] for r in rows), self.device
        params = [r[0].sampling_params for r in rows]
        vocab = self.arch.vocab_size
        sampling = self.sampler.rows(
            params, [(p.seed or 0) ^ _DRAFT_SEED_SALT for p in params], [r[0].step for r in rows]
        )
        # Step 0 catches each request's cache up to its tokens; steps 1.. feed the last draft.
        inputs = [r[0].token_ids[r[2] :] for r in rows]
        starts = [r[2] for r in rows]
        drafts = torch.zeros((n, k_max), dtype=torch.int64, device=dev)  # [n, K]
        probs = torch.zeros((n, k_max, vocab), dtype=torch.float32, device=dev)  # [n, K, V]
        for j in range(k_max):
            logits = self._forward(rows, inputs, starts).float()  # [n, vocab]
            drafts[:, j], probs[:, j] = sampling.sample(logits, j)
            starts = [s + len(x) for s, x in zip(starts, inputs)]
            inputs = drafts[:, j : j + 1]  # [n, 1] on the device
        host = drafts.tolist()
        out_tokens: dict[str, list[int]] = {}
        out_probs: dict[str, torch.Tensor] = {}
        for i, (req, state, _, k) in enumerate(rows):
            out_tokens[req.req_id] = host[i][:k]
            out_probs[req.req_id] = probs[i, :k]
            # NOTE: the cache holds the request's tokens and the drafts fed back (all but the
            # last); the next call keeps only the prefix the request then shares with them.
            state.tokens = np.concatenate([req.token_ids, np.asarray(host[i][: k_max - 1])])
        return Proposals(out_tokens, out_probs)

    def _forward(
        self,
        rows: list[tuple[ProposalRequest, _DraftState, int, int]],
        inputs: list[np.ndarray] | torch.Tensor,
        starts: list[int],
    ) -> torch.Tensor:
        """One draft forward of each row's `inputs` after its first `starts` cached tokens;
        the logits of each row's last input. -> [n, vocab]"""
        dev, bs = self.device, self.block_size
        counts = np.asarray([len(x) for x in inputs], dtype=np.int64)
        starts_np = np.asarray(starts, dtype=np.int64)
        query_start = np.zeros(len(rows) + 1, dtype=np.int32)
        np.cumsum(counts, out=query_start[1:])
        seq = np.repeat(np.arange(len(rows)), counts)
        positions = np.arange(int(query_start[-1])) - query_start[seq] + starts_np[seq]
        width = max(len(r[1].blocks) for r in rows)
        tables = np.zeros((len(rows), width), dtype=np.int32)
        for i, r in enumerate(rows):
            tables[i, : len(r[1].blocks)] = r[1].blocks
        slots = tables[seq, positions // bs].astype(np.int64) * bs + positions % bs
        if isinstance(inputs, torch.Tensor):
            ids = inputs.reshape(-1)
        else:
            ids = torch.from_numpy(np.concatenate(inputs).astype(np.int64)).to(dev)
        seq_lens = (starts_np + counts).astype(np.int32)
        meta = AttentionMetadata(
            slot_mapping=torch.from_numpy(slots).to(dev),
            query_start_loc=torch.from_numpy(query_start).to(dev),
            seq_lens=torch.from_numpy(seq_lens).to(dev),
            block_tables=torch.from_numpy(tables).to(dev),
            max_query_len=int(counts.max()),
            max_seq_len=int(seq_lens.max()),
        )
        hidden = self.model(ids, torch.from_numpy(positions).to(dev), self.kv_caches, meta)
        last = torch.from_numpy(query_start[1:].astype(np.int64) - 1).to(dev)
        return self.model.compute_logits(hidden[last])
