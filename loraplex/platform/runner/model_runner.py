"""ModelRunner: turns a SchedulerOutput into batch tensors, runs the model, samples."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from loraplex.config import EngineConfig
from loraplex.platform.models.attention_metadata import AttentionMetadata
from loraplex.platform.models.model_loader import load_model
from loraplex.platform.runner.cuda_graph import CudaGraphRunner
from loraplex.platform.runner.request_state import CachedRequestState
from loraplex.platform.runner.sampler import Sampler, SamplingRow, score_tokens
from loraplex.platform.scheduler.output import ModelRunnerOutput, SchedulerOutput

logger = logging.getLogger(__name__)

_ACTIVATION_RESERVE_BYTES = 2 << 30  # headroom kept free on CUDA for activations and graphs
_SCORE_CHUNK = 1024  # prompt rows whose logits are materialised at once for prompt logprobs


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError("device 'cuda' requested but CUDA is not available")
    return torch.device(name)


class ModelRunner:
    def __init__(
        self, config: EngineConfig, model_dir: Path, eos_token_ids: tuple[int, ...]
    ) -> None:
        self.config = config
        self.device = resolve_device(config.model.device)
        self.block_size = config.cache.block_size
        self.model, self.arch, self.dtype = load_model(
            model_dir,
            config.model.dtype,
            self.device,
            config.model.quantization,
            random_seed=config.model.seed,
        )
        self.eos_token_ids = eos_token_ids
        # NOTE: LoRA slots are allocated before the KV cache is sized from what memory is left.
        self.lora_manager = self._init_lora(model_dir) if config.lora.enable_lora else None
        self.num_blocks = self._num_kv_blocks()
        shape = (self.num_blocks, self.block_size, self.arch.num_kv_heads, self.arch.head_dim)
        self.kv_caches = [
            (
                torch.zeros(shape, dtype=self.dtype, device=self.device),
                torch.zeros(shape, dtype=self.dtype, device=self.device),
            )
            for _ in range(self.arch.num_layers)
        ]
        self.requests: dict[str, CachedRequestState] = {}
        # Requests asking for prompt logprobs whose prompt is not all computed yet.
        self._scoring: set[str] = set()
        self.sampler = Sampler(config.model.seed)
        self.max_model_len = min(
            config.model.max_model_len or self.arch.max_position_embeddings,
            self.arch.max_position_embeddings,
        )
        self.max_blocks_per_seq = -(-self.max_model_len // self.block_size)
        # One row per running request, updated as blocks are added (never rebuilt per step).
        max_seqs = config.scheduler.max_num_seqs
        self.block_table = np.zeros((max_seqs, self.max_blocks_per_seq), dtype=np.int32)
        self._free_rows = list(range(max_seqs - 1, -1, -1))
        # The latest step's sampled tokens, on the device, and whose they are (in order): the
        # input of a request whose token is still pending when the next step is launched.
        self._last_sampled: torch.Tensor | None = None
        self._last_sample_ids: list[str] = []
        self.graphs = None
        if self.device.type == "cuda" and not config.runner.enforce_eager:
            self.graphs = CudaGraphRunner(
                self.model,
                self.kv_caches,
                min(config.runner.cuda_graph_max_bs, max_seqs),
                self.max_blocks_per_seq,
                self.device,
                before_replay=self._lora_for_graph if self.lora_manager is not None else None,
            )
            self.graphs.capture()
        logger.info(
            "model on %s in %s; %d KV blocks of %d tokens",
            self.device,
            self.dtype,
            self.num_blocks,
            self.block_size,
        )

    def _init_lora(self, model_dir: Path):
        from loraplex.adapters.lora_layer import attach_lora_layers
        from loraplex.adapters.manager import LoRAManager
        from loraplex.adapters.peft_format import BaseModelSpec

        cfg = self.config
        max_tokens = max(cfg.scheduler.max_num_batched_tokens, cfg.scheduler.max_num_seqs)
        state = attach_lora_layers(
            self.model, cfg.lora, self.device, self.dtype, max_num_tokens=max_tokens
        )
        spec = BaseModelSpec.from_hf_config(self.arch.raw, name_or_path=str(model_dir))
        return LoRAManager(cfg.lora, spec, state, self.dtype)

    def _lora_for_graph(self, padded_bs: int, lora_slots: np.ndarray | None) -> None:
        assert self.lora_manager is not None
        slots = torch.full((padded_bs,), -1, dtype=torch.int32)
        if lora_slots is not None:
            slots[: len(lora_slots)] = torch.from_numpy(lora_slots)
        self.lora_manager.set_batch(slots, always_apply=True)

    @property
    def kv_block_bytes(self) -> int:
        a = self.arch
        elem = torch.empty((), dtype=self.dtype).element_size()
        return 2 * a.num_layers * self.block_size * a.num_kv_heads * a.head_dim * elem

    def _num_kv_blocks(self) -> int:
        cache = self.config.cache
        if cache.num_kv_blocks is not None:
            return cache.num_kv_blocks
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            used = total - free
            budget = total * cache.gpu_memory_utilization - used - _ACTIVATION_RESERVE_BYTES
        else:
            budget = cache.cpu_kv_cache_gib * (1 << 30)
        num = int(budget // self.kv_block_bytes)
        if num < 1:
            raise ValueError(
                "no memory left for the KV cache; lower the model size or raise "
                "--gpu-memory-utilization / cpu_kv_cache_gib"
            )
        return num

    # -- request bookkeeping -------------------------------------------------------------

    def _update_states(self, so: SchedulerOutput) -> None:
        for req_id in so.finished_req_ids:
            state = self.requests.pop(req_id, None)
            if state is not None:
                self._free_rows.append(state.row)
            self._scoring.discard(req_id)
        for new in so.new_reqs:
            params = new.sampling_params
            if params.prompt_logprobs is not None:
                self._scoring.add(new.req_id)
            row = self._free_rows.pop()
            self.block_table[row, : len(new.block_ids)] = new.block_ids
            self.requests[new.req_id] = CachedRequestState(
                req_id=new.req_id,
                token_ids=list(new.prompt_token_ids) + list(new.output_token_ids),
                num_prompt_tokens=len(new.prompt_token_ids),
                sampling_params=params,
                num_blocks=len(new.block_ids),
                row=row,
                num_computed_tokens=new.num_computed_tokens,
                lora_slot=new.lora_slot,
                banned_until_min=tuple(self.eos_token_ids) + tuple(params.stop_token_ids),
                plain_greedy=params.greedy
                and params.logprobs is None
                and not params.needs_penalties
                and params.min_tokens == 0,
            )
        for cached in so.cached_reqs:
            state = self.requests[cached.req_id]
            if cached.new_block_ids:
                k = len(cached.new_block_ids)
                self.block_table[state.row, state.num_blocks : state.num_blocks + k] = (
                    cached.new_block_ids
                )
                state.num_blocks += k
            state.num_computed_tokens = cached.num_computed_tokens

    # -- one step ------------------------------------------------------------------------

    @torch.inference_mode()
    def execute(
        self, so: SchedulerOutput, bitmasks: dict[str, torch.Tensor] | None = None
    ) -> StepOutput:
        """Launch one step. `bitmasks` maps req_id -> packed allowed-token row for grammars.

        The device may still be running the step when this returns, and the next step may be
        launched before `get()` reads its sampled tokens (async scheduling): a request's pending
        token is then the next step's input, taken on the device."""
        self._update_states(so)
        if so.is_empty:
            return StepOutput.ready(ModelRunnerOutput(sampled={}))
        host = self._prepare_host(so)
        logits, prompt_logprobs = self._forward(host)
        if not host.sample_req_ids:
            return StepOutput.ready(ModelRunnerOutput(sampled={}, prompt_logprobs=prompt_logprobs))
        states = [self.requests[r] for r in host.sample_req_ids]
        logprobs = {}
        if not bitmasks and all(s.plain_greedy for s in states):
            # NOTE: the common decode case: one argmax, read back when the engine asks.
            tokens = logits.argmax(dim=-1)
            host_tokens: torch.Tensor | list[int] = tokens
        else:
            rows = [self._sampling_row(s) for s in states]
            mask = None
            if bitmasks:
                mask = _stack_bitmasks(
                    bitmasks, host.sample_req_ids, logits.shape[1], logits.device
                )
            out = self.sampler(logits, rows, mask)
            tokens, host_tokens = out.device_token_ids, out.token_ids
            logprobs = {r: lp for r, lp in zip(host.sample_req_ids, out.logprobs) if lp is not None}
        for state in states:
            state.num_pending += 1
        self._last_sampled, self._last_sample_ids = tokens, host.sample_req_ids
        return StepOutput(self, states, host_tokens, logprobs, prompt_logprobs)

    def _receive(self, states: list[CachedRequestState], token_ids: list[int]) -> dict[str, int]:
        """Append a step's sampled tokens to the requests that are still the runner's."""
        sampled = {}
        for state, token in zip(states, token_ids):
            sampled[state.req_id] = token
            if self.requests.get(state.req_id) is state:
                state.token_ids.append(token)
                state.num_pending -= 1
        return sampled

    def _to_device(self, array: np.ndarray) -> torch.Tensor:
        """A host array on the device, without waiting for the device (pinned staging)."""
        tensor = torch.from_numpy(array)
        if self.device.type != "cuda":
            return tensor
        return tensor.pin_memory().to(self.device, non_blocking=True)

    def _fill_pending(self, input_ids: torch.Tensor, host: _HostBatch) -> None:
        """Write the input tokens still pending from the previous step, from the device."""
        rows, src = host.pending_rows, host.pending_src
        k = len(rows)
        if k == 0:
            return
        assert self._last_sampled is not None
        if rows[-1] == k - 1 and np.array_equal(rows, src):  # the same requests, in order
            input_ids[:k].copy_(self._last_sampled[:k])
        else:
            input_ids[self._to_device(rows)] = self._last_sampled[self._to_device(src)]

    def _forward(self, host: _HostBatch) -> tuple[torch.Tensor, dict]:
        """Logits [num_sampled, vocab] of the rows that sample (graph replay for pure decode),
        and the prompt logprobs of the rows `host.prompt_scores` names."""
        num_seqs = len(host.seq_lens)
        lora = host.lora_slots if (host.lora_slots >= 0).any() else None
        if (
            self.graphs is not None
            and host.is_decode
            and self.graphs.padded_size(num_seqs) is not None
        ):
            logits = self.graphs.run(
                host.input_ids, host.positions, host.slot_mapping, host.seq_lens,
                host.block_tables, lora, lambda ids: self._fill_pending(ids, host),
            )  # fmt: skip
            return logits, {}
        dev = self.device
        if self.lora_manager is not None:
            slots = torch.from_numpy(host.lora_slots)
            self.lora_manager.set_batch(slots.to(dev) if lora is not None else slots)
        meta = AttentionMetadata(
            slot_mapping=self._to_device(host.slot_mapping),
            query_start_loc=self._to_device(host.query_start_loc),
            seq_lens=self._to_device(host.seq_lens),
            block_tables=self._to_device(host.block_tables),
            max_query_len=host.max_query_len,
            max_seq_len=int(host.seq_lens.max()),
        )
        input_ids = self._to_device(host.input_ids)
        self._fill_pending(input_ids, host)
        positions = self._to_device(host.positions)
        hidden = self.model(input_ids, positions, self.kv_caches, meta)
        prompt_logprobs = {}
        for req_id, offset, targets, first_pos in host.prompt_scores:
            k = self.requests[req_id].sampling_params.prompt_logprobs or 0
            entries = []
            for lo in range(0, len(targets), _SCORE_CHUNK):  # bounds the [rows, vocab] logits
                rows = hidden[offset + lo : offset + min(lo + _SCORE_CHUNK, len(targets))]
                chunk = torch.from_numpy(targets[lo : lo + _SCORE_CHUNK]).to(dev)
                entries += score_tokens(self.model.compute_logits(rows), chunk, k)
            prompt_logprobs[req_id] = (first_pos, entries)
        if not host.sample_req_ids:
            return hidden[:0], prompt_logprobs
        indices = self._to_device(host.logits_indices)
        return self.model.compute_logits(hidden[indices]), prompt_logprobs

    def _sampling_row(self, state: CachedRequestState) -> SamplingRow:
        p = state.sampling_params
        below_min = state.num_output_tokens < p.min_tokens
        return SamplingRow(
            temperature=p.temperature,
            top_p=p.top_p,
            top_k=p.top_k,
            min_p=p.min_p,
            repetition_penalty=p.repetition_penalty,
            presence_penalty=p.presence_penalty,
            frequency_penalty=p.frequency_penalty,
            seed=p.seed,
            step=state.num_output_tokens,
            logprobs=p.logprobs,
            prompt_token_ids=state.token_ids[: state.num_prompt_tokens]
            if p.needs_penalties
            else [],
            output_token_ids=state.token_ids[state.num_prompt_tokens :]
            if p.needs_penalties
            else [],
            banned_token_ids=state.banned_until_min if below_min else (),
        )

    def _prepare_host(self, so: SchedulerOutput) -> _HostBatch:
        """The step's batch as host arrays (DESIGN.md's layout), built vectorised."""
        req_ids = list(so.num_scheduled_tokens)
        states = [self.requests[r] for r in req_ids]
        if so.total_num_scheduled_tokens == len(req_ids) and not self._scoring:
            return self._prepare_decode(req_ids, states)
        counts = np.fromiter((so.num_scheduled_tokens[r] for r in req_ids), np.int64, len(req_ids))
        starts = np.fromiter((s.num_computed_tokens for s in states), np.int64, len(states))
        rows = np.fromiter((s.row for s in states), np.int64, len(states))
        query_start = np.zeros(len(req_ids) + 1, dtype=np.int32)
        np.cumsum(counts, out=query_start[1:])
        total = int(query_start[-1])
        # Per token: which request, and its position.
        seq_of_token = np.repeat(np.arange(len(req_ids)), counts)
        positions = (
            np.arange(total, dtype=np.int64) - query_start[seq_of_token] + starts[seq_of_token]
        )
        block_ids = self.block_table[rows[seq_of_token], positions // self.block_size]
        slot_mapping = block_ids.astype(np.int64) * self.block_size + positions % self.block_size
        if int(counts.max()) == 1:
            input_ids = _decode_input_ids(states)
        else:
            # NOTE: a request with a pending token is decoding: its one input is that token.
            input_ids = np.fromiter(
                (t for s, n in zip(states, counts.tolist())
                 for t in (s.token_ids[s.num_computed_tokens : s.num_computed_tokens + n]
                           if not s.num_pending else (_PENDING,))),
                np.int64, total,
            )  # fmt: skip
        seq_lens = (starts + counts).astype(np.int32)
        max_blocks = int(max(s.num_blocks for s in states))
        sampling = [i for i, s in enumerate(states) if seq_lens[i] == s.num_tokens]
        pending_rows = np.flatnonzero(input_ids == _PENDING)
        lora_slots = np.repeat(
            np.fromiter((s.lora_slot for s in states), np.int32, len(states)), counts
        )
        prompt_scores = []
        for i in (i for i, r in enumerate(req_ids) if r in self._scoring):
            # Row p scores the prompt token at p + 1; the prompt's last row samples instead.
            state, start = states[i], int(starts[i])
            n = min(int(counts[i]), state.num_prompt_tokens - 1 - start)
            if n > 0:
                targets = np.asarray(state.token_ids[start + 1 : start + 1 + n], dtype=np.int64)
                prompt_scores.append((req_ids[i], int(query_start[i]), targets, start + 1))
            if start + int(counts[i]) >= state.num_prompt_tokens:
                self._scoring.discard(req_ids[i])
        return _HostBatch(
            input_ids=input_ids,
            positions=positions,
            slot_mapping=slot_mapping,
            query_start_loc=query_start,
            seq_lens=seq_lens,
            block_tables=self.block_table[rows, :max_blocks],
            lora_slots=lora_slots,
            sample_req_ids=[req_ids[i] for i in sampling],
            logits_indices=query_start[1:][sampling].astype(np.int64) - 1,
            max_query_len=int(counts.max()),
            is_decode=int(counts.max()) == 1 and len(sampling) == len(req_ids),
            prompt_scores=tuple(prompt_scores),
            pending_rows=pending_rows,
            pending_src=self._pending_sources([req_ids[i] for i in seq_of_token[pending_rows]]),
        )

    def _pending_sources(self, req_ids: list[str]) -> np.ndarray:
        """Where each of these requests' pending token sits in the latest step's samples."""
        if not req_ids:
            return _NO_ROWS
        last = self._last_sample_ids
        if req_ids == last[: len(req_ids)]:
            return np.arange(len(req_ids), dtype=np.int64)
        index = {r: i for i, r in enumerate(last)}
        return np.fromiter((index[r] for r in req_ids), np.int64, len(req_ids))

    def _prepare_decode(self, req_ids: list[str], states: list[CachedRequestState]) -> _HostBatch:
        """`_prepare_host` for a step of one token per sequence (the decode hot path)."""
        n = len(states)
        positions = np.fromiter((s.num_computed_tokens for s in states), np.int64, n)
        rows = np.fromiter((s.row for s in states), np.int64, n)
        block_ids = self.block_table[rows, positions // self.block_size]
        input_ids = _decode_input_ids(states)
        seq_lens = (positions + 1).astype(np.int32)
        sampling = [i for i, s in enumerate(states) if s.num_computed_tokens + 1 == s.num_tokens]
        pending_rows = np.flatnonzero(input_ids == _PENDING)
        return _HostBatch(
            input_ids=input_ids,
            positions=positions,
            slot_mapping=block_ids.astype(np.int64) * self.block_size + positions % self.block_size,
            query_start_loc=np.arange(n + 1, dtype=np.int32),
            seq_lens=seq_lens,
            block_tables=self.block_table[rows, : max(s.num_blocks for s in states)],
            lora_slots=np.fromiter((s.lora_slot for s in states), np.int32, n),
            sample_req_ids=req_ids if len(sampling) == n else [req_ids[i] for i in sampling],
            logits_indices=np.asarray(sampling, dtype=np.int64),
            max_query_len=1,
            is_decode=len(sampling) == n,
            pending_rows=pending_rows,
            pending_src=self._pending_sources(
                req_ids if len(pending_rows) == n else [req_ids[i] for i in pending_rows]
            ),
        )


@dataclass(frozen=True)
class _HostBatch:
    input_ids: np.ndarray  # [num_tokens] int64
    positions: np.ndarray  # [num_tokens] int64
    slot_mapping: np.ndarray  # [num_tokens] int64
    query_start_loc: np.ndarray  # [num_seqs + 1] int32
    seq_lens: np.ndarray  # [num_seqs] int32
    block_tables: np.ndarray  # [num_seqs, max_blocks] int32
    lora_slots: np.ndarray  # [num_tokens] int32, -1 = base
    sample_req_ids: list[str]
    logits_indices: np.ndarray  # [num_sampled] int64
    max_query_len: int
    is_decode: bool  # one new token per sequence, and every sequence samples
    # (req_id, batch row of its first scored token, the prompt tokens those rows score
    # [n] int64, prompt position of the first of them), for prompt logprobs
    prompt_scores: tuple[tuple[str, int, np.ndarray, int], ...] = ()
    # Token rows whose input is still pending on the device [k] int64 (ascending), and where
    # each sits in the latest step's sampled tokens [k] int64.
    pending_rows: np.ndarray = field(default_factory=lambda: _NO_ROWS)
    pending_src: np.ndarray = field(default_factory=lambda: _NO_ROWS)


_PENDING = -1  # input id placeholder of a token still on the device
_NO_ROWS = np.zeros(0, dtype=np.int64)


def _decode_input_ids(states: list[CachedRequestState]) -> np.ndarray:
    """The one input token of each decoding request; _PENDING where it is still on the device."""
    return np.fromiter(
        (s.token_ids[s.num_computed_tokens] if not s.num_pending else _PENDING for s in states),
        np.int64,
        len(states),
    )


class StepOutput:
    """A launched step's output. `get()` reads its sampled tokens back from the device (the
    step's one synchronisation) and hands them to the runner's request states."""

    def __init__(
        self,
        runner: ModelRunner | None,
        states: list[CachedRequestState],
        tokens: torch.Tensor | list[int],  # [num_sampled] int64
        logprobs: dict[str, list[tuple[int, float, int]]],
        prompt_logprobs: dict,
    ) -> None:
        self._runner, self._states = runner, states
        self._logprobs, self._prompt_logprobs = logprobs, prompt_logprobs
        self._event = None
        if isinstance(tokens, torch.Tensor) and tokens.is_cuda:
            host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
            tokens = host.copy_(tokens, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()
        self._tokens = tokens
        self._output: ModelRunnerOutput | None = None

    @classmethod
    def ready(cls, output: ModelRunnerOutput) -> StepOutput:
        step = cls(None, [], [], {}, {})
        step._output = output
        return step

    def get(self) -> ModelRunnerOutput:
        if self._output is None:
            if self._event is not None:
                self._event.synchronize()
            tokens = self._tokens
            token_ids = tokens.tolist() if isinstance(tokens, torch.Tensor) else tokens
            assert self._runner is not None
            self._output = ModelRunnerOutput(
                sampled=self._runner._receive(self._states, token_ids),
                logprobs=self._logprobs,
                prompt_logprobs=self._prompt_logprobs,
            )
        return self._output


def _stack_bitmasks(
    bitmasks: dict[str, torch.Tensor], req_ids: list[str], vocab: int, device: torch.device
) -> torch.Tensor:
    """One packed row per sampled request; unconstrained rows allow everything (all ones)."""
    words = -(-vocab // 32)
    mask = torch.full((len(req_ids), words), -1, dtype=torch.int32)
    for i, req_id in enumerate(req_ids):
        row = bitmasks.get(req_id)
        if row is not None:
            mask[i, : row.shape[-1]] = row
    return mask.to(device, non_blocking=True)
