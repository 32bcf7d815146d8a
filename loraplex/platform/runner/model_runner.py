"""ModelRunner: turns a SchedulerOutput into batch tensors, runs the model, samples."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from loraplex.config import EngineConfig
from loraplex.platform.models.attention_metadata import AttentionMetadata
from loraplex.platform.models.model_loader import load_model
from loraplex.platform.runner.request_state import CachedRequestState
from loraplex.platform.runner.sampler import Sampler, SamplingRow
from loraplex.platform.scheduler.output import ModelRunnerOutput, SchedulerOutput

logger = logging.getLogger(__name__)

_ACTIVATION_RESERVE_BYTES = 2 << 30  # headroom kept free on CUDA for activations and graphs


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
            model_dir, config.model.dtype, self.device, config.model.quantization
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
        self.sampler = Sampler(config.model.seed)
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
            self.requests.pop(req_id, None)
        for new in so.new_reqs:
            params = new.sampling_params
            self.requests[new.req_id] = CachedRequestState(
                req_id=new.req_id,
                token_ids=list(new.prompt_token_ids) + list(new.output_token_ids),
                num_prompt_tokens=len(new.prompt_token_ids),
                sampling_params=params,
                block_ids=list(new.block_ids),
                num_computed_tokens=new.num_computed_tokens,
                lora_slot=new.lora_slot,
                banned_until_min=tuple(self.eos_token_ids) + tuple(params.stop_token_ids),
            )
        for cached in so.cached_reqs:
            state = self.requests[cached.req_id]
            state.block_ids.extend(cached.new_block_ids)
            state.num_computed_tokens = cached.num_computed_tokens

    # -- one step ------------------------------------------------------------------------

    @torch.inference_mode()
    def execute(
        self, so: SchedulerOutput, bitmasks: dict[str, torch.Tensor] | None = None
    ) -> ModelRunnerOutput:
        """Run one step. `bitmasks` maps req_id -> packed allowed-token row for grammars."""
        self._update_states(so)
        if so.is_empty:
            return ModelRunnerOutput(sampled={})
        batch = self._prepare_inputs(so)
        if self.lora_manager is not None:
            self.lora_manager.set_batch(batch.lora_slots)
        hidden = self.model(batch.input_ids, batch.positions, self.kv_caches, batch.meta)
        if not batch.sample_req_ids:
            return ModelRunnerOutput(sampled={})
        logits = self.model.compute_logits(hidden[batch.logits_indices])
        rows = [self._sampling_row(self.requests[r]) for r in batch.sample_req_ids]
        mask = None
        if bitmasks:
            mask = _stack_bitmasks(bitmasks, batch.sample_req_ids, logits.shape[1], logits.device)
        out = self.sampler(logits, rows, mask)
        sampled, logprobs = {}, {}
        for req_id, token, lp in zip(batch.sample_req_ids, out.token_ids, out.logprobs):
            self.requests[req_id].token_ids.append(token)
            sampled[req_id] = token
            if lp is not None:
                logprobs[req_id] = lp
        return ModelRunnerOutput(sampled=sampled, logprobs=logprobs)

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

    def _prepare_inputs(self, so: SchedulerOutput) -> _Batch:
        bs = self.block_size
        req_ids = list(so.num_scheduled_tokens)
        num_seqs = len(req_ids)
        input_ids: list[int] = []
        lora_slots = np.full(so.total_num_scheduled_tokens, -1, dtype=np.int32)
        positions = np.empty(so.total_num_scheduled_tokens, dtype=np.int64)
        slots = np.empty(so.total_num_scheduled_tokens, dtype=np.int64)
        query_start = np.zeros(num_seqs + 1, dtype=np.int32)
        seq_lens = np.empty(num_seqs, dtype=np.int32)
        max_blocks = max(len(self.requests[r].block_ids) for r in req_ids)
        block_tables = np.zeros((num_seqs, max_blocks), dtype=np.int32)
        sample_req_ids: list[str] = []
        logits_indices: list[int] = []
        offset = 0
        for i, req_id in enumerate(req_ids):
            state = self.requests[req_id]
            n = so.num_scheduled_tokens[req_id]
            start = state.num_computed_tokens
            input_ids.extend(state.token_ids[start : start + n])
            pos = np.arange(start, start + n)
            blocks = np.asarray(state.block_ids, dtype=np.int64)
            positions[offset : offset + n] = pos
            lora_slots[offset : offset + n] = state.lora_slot
            slots[offset : offset + n] = blocks[pos // bs] * bs + pos % bs
            block_tables[i, : len(blocks)] = blocks
            offset += n
            query_start[i + 1] = offset
            seq_lens[i] = start + n
            if start + n == len(state.token_ids):
                sample_req_ids.append(req_id)
                logits_indices.append(offset - 1)
        dev = self.device
        meta = AttentionMetadata(
            slot_mapping=torch.from_numpy(slots).to(dev),
            query_start_loc=torch.from_numpy(query_start).to(dev),
            seq_lens=torch.from_numpy(seq_lens).to(dev),
            block_tables=torch.from_numpy(block_tables).to(dev),
            max_query_len=int(np.diff(query_start).max()),
            max_seq_len=int(seq_lens.max()),
        )
        return _Batch(
            input_ids=torch.tensor(input_ids, dtype=torch.long, device=dev),
            positions=torch.from_numpy(positions).to(dev),
            meta=meta,
            sample_req_ids=sample_req_ids,
            logits_indices=torch.tensor(logits_indices, dtype=torch.long, device=dev),
            lora_slots=torch.from_numpy(lora_slots).to(dev)
            if (lora_slots >= 0).any()
            else torch.from_numpy(lora_slots),
        )


@dataclass(frozen=True)
class _Batch:
    input_ids: torch.Tensor  # [num_tokens]
    positions: torch.Tensor  # [num_tokens]
    meta: AttentionMetadata
    sample_req_ids: list[str]
    logits_indices: torch.Tensor  # [num_sampled]
    # [num_tokens] int32, -1 = base; left on the CPU when no token has an adapter
    lora_slots: torch.Tensor


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
