"""ModelRunner: applies a SchedulerOutput to the persistent InputBatch, runs the model, and
samples on the device; batch building, KV sizing and output read-back live beside it.

Under tensor parallelism the runner of rank 0 starts the other ranks and sends each of them
every step it launches; each rank runs its own runner over its shard of the model, mirrors the
input batch, and takes rank 0's sampled tokens from a broadcast (`follow`)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from loraplex.adapters.lora_layer import LoRAModelState, attach_lora_layers
from loraplex.config import EngineConfig
from loraplex.kernels.attention import decode_plan
from loraplex.kernels.bitmask import warm_up as warm_up_bitmask
from loraplex.kernels.cpu_linear import lending
from loraplex.kernels.sampling import greedy_tokens
from loraplex.kernels.sampling import warm_up as warm_up_sampler
from loraplex.platform.core.scheduler_output import (
    ModelRunnerOutput,
    PromptLogprobScores,
    SchedulerOutput,
)
from loraplex.platform.models.attention_metadata import AttentionMetadata
from loraplex.platform.models.model_loader import load_model
from loraplex.platform.parallel.parallel_state import (
    SINGLE,
    TensorParallel,
    destroy_tensor_parallel,
    init_tensor_parallel,
)
from loraplex.platform.parallel.sharding import attention_shard
from loraplex.platform.runner.batch import Batch, build_batch, fill_pending
from loraplex.platform.runner.cpu_threads import SpareCores, configure_cpu_threads, spare_cores
from loraplex.platform.runner.cuda_graph import CudaGraphRunner
from loraplex.platform.runner.draft_sampler import MetadataDraftSampler
from loraplex.platform.runner.input_batch import InputBatch, to_device
from loraplex.platform.runner.kv_sizing import kv_block_bytes, num_kv_blocks
from loraplex.platform.runner.lora_slots import LoRASlotWriter
from loraplex.platform.runner.sampler import Sampler, score_tokens
from loraplex.platform.runner.step_output import StepOutput
from loraplex.platform.runner.tp.lora_state import TensorParallelLoRAState
from loraplex.platform.runner.tp.messages import ExecuteStep
from loraplex.platform.runner.tp.workers import TensorParallelWorkers
from loraplex.platform.runner.verifier import verify
from loraplex.platform.spec.factory import build_proposer
from loraplex.platform.spec.proposer import ProposalRequest

logger = logging.getLogger(__name__)

_SCORE_CHUNK = 1024  # prompt rows whose logits are materialised at once for prompt logprobs
# NOTE: speculation pays at small batches (a large one is compute-bound); each verification
# graph keeps its [bs * (k + 1), vocab] fp32 logits, so larger ones are not captured.
VERIFY_GRAPH_MAX_BS = 64


@dataclass(frozen=True)
class LaunchedStep:
    """A step whose forward pass is launched and whose sampling is not (`ModelRunner.sample`).

    `batch` and `logits` are None for an empty step."""

    batch: Batch | None
    logits: torch.Tensor | None  # [num_sampled, vocab] on the device
    prompt_logprobs: PromptLogprobScores

    @property
    def sample_req_ids(self) -> list[str]:
        """The requests that sample, in logits row order."""
        return self.batch.sample_req_ids if self.batch is not None else []

    def logits_rows(self, batch_rows: np.ndarray) -> np.ndarray:
        """The logits row of each input-batch row, -1 where that row does not sample.
        [k] int64 -> [k] int64"""
        if self.batch is None or not len(self.batch.sample_rows):
            return np.full(len(batch_rows), -1, dtype=np.int64)
        sample_rows = self.batch.sample_rows  # ascending
        at = np.searchsorted(sample_rows, batch_rows).clip(max=len(sample_rows) - 1)
        if self.batch.spec_lens is not None:  # NOTE: rows with a mask never speculate
            return np.where(sample_rows[at] == batch_rows, self.batch.sample_logits_rows[at], -1)
        return np.where(sample_rows[at] == batch_rows, at, -1)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError("device 'cuda' requested but CUDA is not available")
    return torch.device(name)


class ModelRunner:
    def __init__(
        self,
        config: EngineConfig,
        model_dir: Path,
        eos_token_ids: tuple[int, ...],
        tp: TensorParallel | None = None,
        on_loaded: Callable[[], None] | None = None,
    ) -> None:
        """`tp` None: rank 0 (starting the other ranks when tensor_parallel_size > 1); a
        worker rank passes its group, and `on_loaded` to report its model loaded."""
        self.config = config
        self.device = resolve_device(config.model.device)
        self.block_size = config.cache.block_size
        # NOTE: a CPU engine's steps borrow the core it leaves to the API process while that
        # core idles (`SpareCores`)
        self.spare_cores: SpareCores | None = None
        if self.device.type == "cpu":
            configure_cpu_threads(tensor_parallel_size=config.parallel.tensor_parallel_size)
            if tp is None:
                self.spare_cores = spare_cores()
        self.workers: TensorParallelWorkers | None = None
        self._owed_tokens = 0  # rows of a launched step whose tokens were not broadcast
        if tp is None and config.parallel.tensor_parallel_size > 1:
            if self.device.type == "cuda":
                self.device = torch.device("cuda:0")
            self.workers = TensorParallelWorkers(config, model_dir, rank_runner)
        try:
            self._init(config, model_dir, eos_token_ids, tp, on_loaded)
        except BaseException:
            self.shutdown()
            raise

    def _init(
        self,
        config: EngineConfig,
        model_dir: Path,
        eos_token_ids: tuple[int, ...],
        tp: TensorParallel | None,
        on_loaded: Callable[[], None] | None,
    ) -> None:
        if self.workers is not None:
            tp = init_tensor_parallel(0, self.workers.size, self.workers.init_file, self.device)
        self.tp = tp or SINGLE
        self.model, self.arch, self.dtype = load_model(
            model_dir,
            config.model.dtype,
            self.device,
            config.model.quantization,
            random_seed=config.model.seed,
            tp=self.tp,
        )
        # NOTE: every rank reports its load before the first collective below, so a rank that
        # refuses the model (a size that splits a group) fails the start-up, not a hang.
        if on_loaded is not None:
            on_loaded()
        if self.workers is not None:
            self.workers.wait_ready()
        # NOTE: LoRA slots are allocated before the KV cache is sized from what memory is left.
        # The engine builds the adapter manager over `lora_state`; the runner only writes each
        # step's per-token slots (`lora_writer`).
        self.lora_state = self._init_lora() if config.lora.enable_lora else None
        self.lora_writer = (
            LoRASlotWriter(self.lora_state.meta, self.device) if self.lora_state else None
        )
        kv_heads = attention_shard(self.arch.num_heads, self.arch.num_kv_heads, self.tp)
        self.kv_block_bytes = kv_block_bytes(
            self.arch, self.block_size, self.dtype, kv_heads.num_kv_heads
        )
        self.num_blocks = self.tp.min_int(
            num_kv_blocks(config.cache, self.device, self.kv_block_bytes), self.device
        )
        shape = (self.num_blocks, self.block_size, kv_heads.num_kv_heads, self.arch.head_dim)
        self.kv_caches = [
            (
                torch.zeros(shape, dtype=self.dtype, device=self.device),
                torch.zeros(shape, dtype=self.dtype, device=self.device),
            )
            for _ in range(self.arch.num_layers)
        ]
        # Requests asking for prompt logprobs whose prompt is not all computed yet.
        self._scoring: set[str] = set()
        self.sampler = Sampler()
        self.max_model_len = self.arch.context_length(config.model.max_model_len)
        self.max_blocks_per_seq = -(-self.max_model_len // self.block_size)
        max_seqs = config.scheduler.max_num_seqs
        self.input_batch = InputBatch(
            max_seqs, self.max_model_len, self.max_blocks_per_seq, self.arch.vocab_size, self.device
        )
        # NOTE: masked with a request's stop ids until it has sampled min_tokens
        self.input_batch.eos_token_ids = tuple(eos_token_ids)
        self.proposer = build_proposer(
            config, self.arch.vocab_size, self.device,
            MetadataDraftSampler(self.arch.vocab_size, self.device),
        )  # fmt: skip
        self._draft_probs: dict[str, torch.Tensor] | None = None
        self.graphs: CudaGraphRunner | None = None
        if self.device.type == "cuda" and not config.runner.enforce_eager:
            self.graphs = self.build_graph_runner()
            self.graphs.capture()
        if self.device.type == "cuda":
            # NOTE: compiles the sampler's kernels now, not on the first batch of each shape
            start = time.perf_counter()
            calls = warm_up_sampler(self.arch.vocab_size, self.device, max_seqs)
            calls += warm_up_bitmask(self.arch.vocab_size, self.device)
            if self.lora_state is not None:
                calls += self.lora_state.warm_up()  # eager LoRA sizes (graphs met the others)
            logger.info("kernels warmed up: %d calls in %.1f s", calls, time.perf_counter() - start)
        logger.info(
            "model on %s in %s; %d KV blocks of %d tokens",
            self.device,
            self.dtype,
            self.num_blocks,
            self.block_size,
        )

    def build_graph_runner(self) -> CudaGraphRunner:
        """The runner's CUDA graphs (not captured yet): decode at every capture size, and with
        a proposer verification of k + 1 tokens a row at the sizes where speculation runs
        (below `disable_by_batch_size`, at most `VERIFY_GRAPH_MAX_BS`, within the LoRA
        buffers). Off CUDA (tests) its graphs re-run the forward eagerly."""
        cfg = self.config
        max_bs = min(cfg.runner.cuda_graph_max_bs, cfg.scheduler.max_num_seqs)
        spec = cfg.speculative
        query_len, verify_max_bs = None, 0
        if self.proposer is not None and spec is not None:
            query_len = spec.num_speculative_tokens + 1
            verify_max_bs = min(max_bs, VERIFY_GRAPH_MAX_BS)
            if spec.disable_by_batch_size is not None:
                verify_max_bs = min(verify_max_bs, spec.disable_by_batch_size - 1)
            if self.lora_state is not None:
                verify_max_bs = min(verify_max_bs, self.lora_state.meta.max_num_tokens // query_len)
        return CudaGraphRunner(
            self.model,
            self.kv_caches,
            max_bs,
            self.max_blocks_per_seq,
            self.device,
            before_replay=self.lora_writer.for_graph if self.lora_writer is not None else None,
            verify_query_len=query_len,
            verify_max_bs=verify_max_bs,
            few_adapters=(
                self.lora_writer.few_adapters_limit if self.lora_writer is not None else None
            ),
        )

    def _init_lora(self) -> LoRAModelState:
        cfg = self.config
        max_tokens = max(cfg.scheduler.max_num_batched_tokens, cfg.scheduler.max_num_seqs)
        state = attach_lora_layers(
            self.model, cfg.lora, self.device, self.dtype, max_num_tokens=max_tokens
        )
        if self.workers is None:
            return state
        # NOTE: every slot write goes to the other ranks too, ahead of the step that uses it.
        return TensorParallelLoRAState(
            state.meta, state.memory, state.layers, state.vocab, send=self.workers.send
        )

    def shutdown(self) -> None:
        """Stop the other tensor-parallel ranks (rank 0; a no-op otherwise) and any lent
        threads."""
        if self.spare_cores is not None:
            self.spare_cores.close()
        if self.workers is not None:
            self.workers.shutdown()
            destroy_tensor_parallel(getattr(self, "tp", SINGLE))

    # -- one step ------------------------------------------------------------------------

    def _update_states(self, so: SchedulerOutput) -> None:
        """Apply only what changed: rows freed and refilled, rows added, blocks appended."""
        ib = self.input_batch
        for req_id in so.finished_req_ids:
            ib.remove(req_id)
            self._scoring.discard(req_id)
        if self.proposer is not None and so.finished_req_ids:
            self.proposer.remove(so.finished_req_ids)
        ib.condense()
        ib.add(so.new_reqs)
        for new in so.new_reqs:
            if new.sampling_params.prompt_logprobs is not None:
                self._scoring.add(new.req_id)
        ib.update(so.cached_reqs)

    def prepare(self, so: SchedulerOutput, need_sampler: bool = False) -> Batch:
        """The step's Batch, read by the eager path, the CUDA-graph path and the sampler."""
        return build_batch(self.input_batch, so, self.block_size, self._scoring, need_sampler)

    def logits_rows(self, launched: LaunchedStep, req_ids: Iterable[str], count: int) -> np.ndarray:
        """The logits row of each of `count` requests in the launched step (its grammar
        bitmask row goes there), -1 for one that does not sample in it. -> [count] int64"""
        index = self.input_batch.req_index
        batch_rows = np.fromiter((index.get(r, -1) for r in req_ids), np.int64, count)
        return np.where(batch_rows >= 0, launched.logits_rows(batch_rows), -1)

    @torch.inference_mode()
    def launch(self, so: SchedulerOutput, need_sampler: bool = False) -> LaunchedStep:
        """Apply `so` and launch its forward pass; `sample` completes the step.

        Between the two the host may fill grammar masks while the device computes.
        `need_sampler`: a grammar row may sample, so even a plain-greedy step goes through the
        sampler (which applies the mask)."""
        if self.workers is not None:
            if self._owed_tokens:
                # NOTE: the last launched step was never sampled (it failed in between); the
                # other ranks wait in its token broadcast, which this ends.
                self._broadcast_tokens(torch.zeros(self._owed_tokens, dtype=torch.int64))
            self.workers.send(ExecuteStep(so, need_sampler))
        self._update_states(so)
        if self.proposer is not None:
            self.input_batch.set_drafts(so.scheduled_spec_decode_tokens)
        if so.is_empty:
            return LaunchedStep(None, None, {})
        batch = self.prepare(so, need_sampler=need_sampler)
        logits, prompt_logprobs = self._forward(batch)
        if self.workers is not None and batch.sample_req_ids:
            self._owed_tokens = len(batch.sample_rows)
        return LaunchedStep(batch, logits, prompt_logprobs)

    @torch.inference_mode()
    def follow(self, step: ExecuteStep) -> None:
        """A worker rank: run the step rank 0 launched, then take its sampled tokens."""
        launched = self.launch(step.scheduler_output, step.need_sampler)
        batch = launched.batch
        if batch is None or not batch.sample_req_ids:
            return
        ib = self.input_batch
        tokens = torch.empty(len(batch.sample_rows), dtype=torch.int64, device=self.device)
        self.tp.broadcast(tokens)  # [num_sampled]
        generations = ib.generations(batch.sample_rows)
        ib.record_sampled(tokens, batch.sample_rows, batch.sample_index)
        StepOutput(ib, batch.sample_req_ids, generations, tokens, None, [], {}).get()

    def _broadcast_tokens(self, tokens: torch.Tensor) -> None:
        """Rank 0: this step's sampled tokens [num_sampled] to the other ranks."""
        self._owed_tokens = 0
        self.tp.broadcast(tokens.to(device=self.device, dtype=torch.int64).contiguous())

    @torch.inference_mode()
    def sample(
        self,
        launched: LaunchedStep,
        bitmask: torch.Tensor | None = None,  # [k, words] int32, host (pinned on CUDA)
        bitmask_rows: torch.Tensor | None = None,  # [k] int64 host: logits row of each
    ) -> StepOutput:
        """Sample a launched step on the device; `bitmask` row i masks logits row
        `bitmask_rows[i]` (the step launched with need_sampler=True)."""
        batch, logits = launched.batch, launched.logits
        if batch is None or logits is None:
            return StepOutput.ready(ModelRunnerOutput(sampled={}))
        prompt_logprobs = launched.prompt_logprobs
        if not batch.sample_req_ids:
            return StepOutput.ready(ModelRunnerOutput(sampled={}, prompt_logprobs=prompt_logprobs))
        ib = self.input_batch
        if batch.spec_lens is not None:
            return self._verify(launched, bitmask, bitmask_rows)
        logprobs = None
        num_logprobs: list[int | None] = []
        if batch.sampling is None:
            # NOTE: the common decode case: one argmax, read back when the engine asks.
            tokens = greedy_tokens(logits)
        else:
            mask = rows = None
            if bitmask is not None and bitmask_rows is not None and len(bitmask_rows):
                # NOTE: the host buffer is refilled only after this step's tokens were read
                # back (the engine's order), which follows this copy on the stream.
                mask = bitmask.to(logits.device, non_blocking=True)
                rows = bitmask_rows.to(logits.device, non_blocking=True)
            out = self.sampler(logits, batch.sampling, mask, rows)
            tokens, logprobs = out.token_ids, out.logprobs
            if logprobs is not None:
                params = ib.params
                num_logprobs = [params[r].logprobs for r in batch.sample_rows.tolist()]  # type: ignore[union-attr]
        if self.workers is not None:
            self._broadcast_tokens(tokens)
        generations = ib.generations(batch.sample_rows)
        ib.record_sampled(tokens, batch.sample_rows, batch.sample_index)
        return StepOutput(
            ib, batch.sample_req_ids, generations, tokens, logprobs, num_logprobs, prompt_logprobs
        )

    def propose(self, requests: list[tuple[str, int]]) -> dict[str, list[int]]:
        """Draft tokens for the next step's verification of these (request id, most drafts)
        pairs, from the tokens the input batch holds (all known: lock step); the proposer's
        distributions, if it has them, are kept for it. {} without a proposer."""
        self._draft_probs = None
        if self.proposer is None or not requests:
            return {}
        ib = self.input_batch
        batch = []
        for req_id, max_tokens in requests:
            row = ib.req_index.get(req_id)
            if row is None or ib.num_pending[row]:
                continue
            params = ib.params[row]
            assert params is not None
            tokens = ib.token_ids[row, : ib.num_tokens[row]]  # a view: no copy
            step = int(ib.num_tokens[row] - ib.num_prompt_tokens[row])
            batch.append(ProposalRequest(req_id, tokens, params, max_tokens, step))
        proposals = self.proposer.propose(batch)
        self._draft_probs = proposals.probs
        return proposals.token_ids

    def _verify(
        self,
        launched: LaunchedStep,
        bitmask: torch.Tensor | None,
        bitmask_rows: torch.Tensor | None,
    ) -> StepOutput:
        """Sample a speculative step: accept each row's drafts exactly (`rejection_sampler`)."""
        batch, logits = launched.batch, launched.logits
        assert batch is not None and logits is not None and batch.spec_lens is not None
        ib = self.input_batch
        rows, lens = batch.sample_rows, batch.spec_lens
        width = int(lens.max())
        drafts = np.full((len(rows), width), -1, dtype=np.int64)
        for i in np.flatnonzero(lens).tolist():
            start = ib.num_tokens[rows[i]]
            drafts[i, : lens[i]] = ib.token_ids[rows[i], start : start + lens[i]]
        draft_probs = None
        if self._draft_probs is not None:
            vocab = logits.shape[1]
            draft_probs = torch.zeros((len(rows), width, vocab), device=logits.device)
            for i, req_id in enumerate(batch.sample_req_ids):
                q = self._draft_probs.get(req_id)
                if q is not None and lens[i]:
                    draft_probs[i, : lens[i]] = q[: lens[i]]
        mask = mask_rows = None
        if bitmask is not None and bitmask_rows is not None and len(bitmask_rows):
            mask = bitmask.to(logits.device, non_blocking=True)
            mask_rows = bitmask_rows.to(logits.device, non_blocking=True)
        out = verify(logits, lens, drafts, batch.sampling, draft_probs, mask, mask_rows)
        num_logprobs: list[int | None] = []
        if out.logprobs is not None:
            num_logprobs = [ib.params[r].logprobs for r in rows.tolist()]  # type: ignore[union-attr]
        generations = ib.generations(rows)
        ib.record_verified(out.tokens, out.num_emitted, rows, batch.sample_index)
        return StepOutput(
            ib, batch.sample_req_ids, generations, out.tokens, out.logprobs, num_logprobs,
            launched.prompt_logprobs, num_emitted=out.num_emitted,
        )  # fmt: skip

    def _forward(self, batch: Batch) -> tuple[torch.Tensor, dict]:
        """Logits [num_sampled, vocab] of the rows that sample (graph replay for pure decode
        and for verification steps whose every row decodes),
        and the prompt logprobs of the rows `batch.prompt_scores` names."""
        last_token = self.input_batch.last_token
        graphs = self.graphs
        if graphs is not None:
            if batch.is_decode and graphs.padded_size(batch.num_seqs) is not None:
                logits = graphs.run(batch, lambda ids: fill_pending(ids, batch, last_token))
                return logits, {}
            if graphs.verify_padded_size(batch) is not None:
                return graphs.run_verify(batch), {}
        dev = self.device
        if self.lora_writer is not None:
            self.lora_writer.write(batch.lora_slots)
        seq_lens, block_tables = to_device(batch.seq_lens, dev), to_device(batch.block_tables, dev)
        max_seq_len = int(batch.seq_lens.max())
        plan = None
        if dev.type == "cpu" and batch.max_query_len == 1:
            plan = decode_plan(seq_lens, block_tables, self.block_size, max_seq_len)
        meta = AttentionMetadata(
            slot_mapping=to_device(batch.slot_mapping, dev),
            query_start_loc=to_device(batch.query_start_loc, dev),
            seq_lens=seq_lens,
            block_tables=block_tables,
            max_query_len=batch.max_query_len,
            max_seq_len=max_seq_len,
            decode_plan=plan,
        )
        input_ids = to_device(batch.input_ids, dev)
        fill_pending(input_ids, batch, last_token)
        positions = to_device(batch.positions, dev)
        lent = None if self.spare_cores is None else self.spare_cores.lent
        with lending(lent):  # NOTE: the LM head's product shares the lent core too
            hidden = self.model(input_ids, positions, self.kv_caches, meta)
            return self._logits(batch, hidden)

    def _logits(self, batch: Batch, hidden: torch.Tensor) -> tuple[torch.Tensor, dict]:
        """`_forward`'s logits and prompt logprobs from the forward pass's hidden rows."""
        dev = self.device
        prompt_logprobs: PromptLogprobScores = {}
        for req_id, offset, targets, first_pos in batch.prompt_scores:
            row = self.input_batch.req_index[req_id]
            k = self.input_batch.params[row].prompt_logprobs or 0  # type: ignore[union-attr]
            entries = []
            for lo in range(0, len(targets), _SCORE_CHUNK):  # bounds the [rows, vocab] logits
                rows = hidden[offset + lo : offset + min(lo + _SCORE_CHUNK, len(targets))]
                chunk = torch.from_numpy(targets[lo : lo + _SCORE_CHUNK]).to(dev)
                token_rows = torch.arange(offset + lo, offset + lo + rows.shape[0], device=dev)
                entries += score_tokens(self.model.compute_logits(rows, token_rows), chunk, k)
            prompt_logprobs[req_id] = (first_pos, entries)
        if not batch.sample_req_ids:
            return hidden[:0], prompt_logprobs
        if len(batch.logits_indices) == hidden.shape[0]:  # every token samples (decode)
            return self.model.compute_logits(hidden), prompt_logprobs
        indices = to_device(batch.logits_indices, dev)
        return self.model.compute_logits(hidden[indices], indices), prompt_logprobs


def rank_runner(
    config: EngineConfig, model_dir: Path, tp: TensorParallel, on_loaded: Callable[[], None]
) -> ModelRunner:
    """The runner of a rank beyond rank 0 (`TensorParallelWorkers` builds it in the rank's
    process): no EOS ids, it follows rank 0's steps."""
    return ModelRunner(config, model_dir, (), tp=tp, on_loaded=on_loaded)
