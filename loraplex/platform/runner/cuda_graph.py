"""Decode and verification steps replayed from CUDA graphs captured for padded batch sizes.

The graphs read persistent device buffers (token ids, positions, slots, sequence lengths,
block tables); a step copies its inputs into them from pinned host staging, replays the graph
of the next larger captured size, and reads the logits of its real rows. Padded rows write no
K/V (slot -1) and attend to nothing (sequence length 0). Two staging sets alternate, so a step
can be prepared while the device may still be copying the previous step's inputs (async
scheduling keeps at most one step in flight).

A decode graph runs one query token per row. With a proposer, verification graphs run
`verify_query_len` = k + 1 query tokens per row (`verify_layout`): a row verifying fewer
drafts (or none) fills the front of its k + 1 slots with padding tokens (slot -1), so its real
tokens stay the last of its query, where the attention kernels look for a sequence's new
tokens; the padding queries attend to earlier context only and their logits are never read.

With LoRA enabled every shape is captured twice: with the LoRA kernels (whatever slots the
step holds; their work follows the adapters present) and without them, which a step with no
adapter token replays, so base-model requests on a LoRA engine cost what they cost without
LoRA. Sizes where a step on few distinct adapters takes other LoRA kernels (`few_adapters`:
the grouped pair where many adapters take the per-token one) get a third graph, which a step
on at most that many adapters replays.

Off CUDA (tests) `_EagerGraph` stands in for a captured graph: replay re-runs the forward on
the same persistent buffers, so the CPU walks the staging, padding and read-back of the GPU.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from loraplex.platform.models.attention_metadata import AttentionMetadata
from loraplex.platform.runner.batch import PENDING, Batch
from loraplex.platform.runner.lora_slots import distinct_adapters

logger = logging.getLogger(__name__)


def capture_sizes(max_bs: int) -> list[int]:
    sizes = [s for s in (1, 2, 4, 8) if s <= max_bs]
    sizes += list(range(16, max_bs + 1, 16))
    if sizes[-1] != max_bs:
        sizes.append(max_bs)
    return sizes


def verify_layout(query_lens: np.ndarray, query_len: int) -> np.ndarray:
    """The padded token row of each real token of a verification step: sequence i owns rows
    [i * query_len, (i + 1) * query_len) and its query_lens[i] tokens take the last of them.
    [num_seqs] int (each in 1..query_len) -> [sum(query_lens)] int64"""
    lens = np.asarray(query_lens, dtype=np.int64)
    if len(lens) and (lens.min() < 1 or lens.max() > query_len):
        raise ValueError(f"query lengths must lie in [1, {query_len}], got {lens.tolist()}")
    first = (np.arange(1, len(lens) + 1) * query_len) - lens  # [num_seqs]
    offset = np.arange(int(lens.sum())) - np.repeat(np.cumsum(lens) - lens, lens)
    return np.repeat(first, lens) + offset


class _EagerGraph:
    """A CPU stand-in for `torch.cuda.CUDAGraph`: `replay` re-runs the forward that capture ran
    and writes its logits into the same output tensor."""

    def __init__(self, forward: Callable[[], torch.Tensor]) -> None:
        self._forward = forward
        self.output = forward()

    def replay(self) -> None:
        self.output.copy_(self._forward())


@dataclass
class _Staging:
    """Host copies of the graph inputs (pinned on CUDA), and when the device finished reading
    them (None off CUDA, where copies are synchronous)."""

    input_ids: torch.Tensor  # [max_tokens] int64
    positions: torch.Tensor  # [max_tokens] int64
    slot_mapping: torch.Tensor  # [max_tokens] int64
    seq_lens: torch.Tensor  # [max_bs] int32
    block_tables: torch.Tensor  # [max_bs, width] int32
    logits_index: torch.Tensor  # [max_tokens] int64, verification: padded row of each logit
    done: torch.cuda.Event | None


class CudaGraphRunner:
    def __init__(
        self,
        model: nn.Module,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        max_bs: int,
        max_blocks_per_seq: int,
        device: torch.device,
        before_replay: Callable[[int, np.ndarray | None, int | None], None] | None = None,
        verify_query_len: int | None = None,
        verify_max_bs: int = 0,
        few_adapters: Callable[[int], int | None] | None = None,
    ) -> None:
        """`verify_query_len` (k + 1 with a proposer of k drafts) adds verification graphs for
        the capture sizes up to `verify_max_bs`. `few_adapters(num_tokens)`: the most distinct
        adapters for which a LoRA step of that many tokens runs other kernels, None where the
        count changes nothing (`LoRASlotWriter.few_adapters_limit`)."""
        self.model = model
        self.kv_caches = kv_caches
        self.sizes = capture_sizes(max_bs)
        self.max_bs = self.sizes[-1]
        self.device = device
        self._cuda = device.type == "cuda"
        # Called with (padded token count, per-token LoRA slots or None, the most distinct
        # adapters the kernels plan for or None: any) before capture / replay.
        # NOTE: the slots are None for a step (or graph) with no adapter token: the LoRA layers
        # skip their work; an array (-1 padded) records and replays the LoRA kernels.
        self.before_replay = before_replay
        self.with_lora = before_replay is not None  # two graphs per shape, with and without
        self.few_adapters = few_adapters if self.with_lora else None
        self.verify_query_len = verify_query_len or 0
        if self.verify_query_len > 1 and verify_max_bs >= 1:
            self.verify_sizes = capture_sizes(min(verify_max_bs, self.max_bs))
        else:
            self.verify_sizes = []
        verify_tokens = self.verify_query_len * (self.verify_sizes or [0])[-1]
        t, n, w = max(self.max_bs, verify_tokens), self.max_bs, max_blocks_per_seq

        def dev(shape, dtype):
            return torch.zeros(shape, dtype=dtype, device=device)

        def host(shape, dtype):
            return torch.zeros(shape, dtype=dtype, pin_memory=self._cuda)

        self.input_ids = dev(t, torch.long)
        self.positions = dev(t, torch.long)
        self.slot_mapping = dev(t, torch.long)
        self.seq_lens = dev(n, torch.int32)
        self.block_tables = dev((n, w), torch.int32)
        self.logits_index = dev(t, torch.long)
        self._staging = [
            _Staging(
                host(t, torch.long), host(t, torch.long), host(t, torch.long),
                host(n, torch.int32), host((n, w), torch.int32), host(t, torch.long),
                torch.cuda.Event() if self._cuda else None,
            )
            for _ in range(2)
        ]  # fmt: skip
        self._num_runs = 0
        # query_start_loc of each query length: sequence i's tokens start at i * query_len
        self._query_start = {
            q: torch.arange(n + 1, dtype=torch.int32, device=device) * q
            for q in {1, self.verify_query_len or 1}
        }
        self.graphs: dict[int, torch.cuda.CUDAGraph | _EagerGraph] = {}  # decode, by batch size
        self.logits: dict[int, torch.Tensor] = {}
        self.verify_graphs: dict[int, torch.cuda.CUDAGraph | _EagerGraph] = {}
        self.verify_logits: dict[int, torch.Tensor] = {}  # [bs * query_len, vocab]
        # With LoRA: the same shapes without the LoRA kernels (steps with no adapter token).
        self.base_graphs: dict[int, torch.cuda.CUDAGraph | _EagerGraph] = {}
        self.base_logits: dict[int, torch.Tensor] = {}
        self.base_verify_graphs: dict[int, torch.cuda.CUDAGraph | _EagerGraph] = {}
        self.base_verify_logits: dict[int, torch.Tensor] = {}
        # The shapes `few_adapters` names, with the LoRA kernels for at most that many adapters.
        self.few_graphs: dict[int, torch.cuda.CUDAGraph | _EagerGraph] = {}
        self.few_logits: dict[int, torch.Tensor] = {}
        self.few_verify_graphs: dict[int, torch.cuda.CUDAGraph | _EagerGraph] = {}
        self.few_verify_logits: dict[int, torch.Tensor] = {}
        self._verify_out: torch.Tensor | None = None  # CUDA: the buffer they all write

    def _forward(self, bs: int, query_len: int) -> torch.Tensor:
        t = bs * query_len
        meta = AttentionMetadata(
            slot_mapping=self.slot_mapping[:t],
            query_start_loc=self._query_start[query_len][: bs + 1],
            seq_lens=self.seq_lens[:bs],
            block_tables=self.block_tables[:bs],
            max_query_len=query_len,
            max_seq_len=None,
        )
        hidden = self.model(self.input_ids[:t], self.positions[:t], self.kv_caches, meta)
        return self.model.compute_logits(hidden)

    @torch.inference_mode()
    def capture(self) -> None:
        start = time.monotonic()
        self.slot_mapping.fill_(-1)
        self.seq_lens.zero_()
        pool = None
        shapes = [(bs, 1) for bs in self.sizes] + [
            (bs, self.verify_query_len) for bs in self.verify_sizes
        ]
        variants = ("lora", "base") if self.with_lora else ("base",)
        for (bs, q), kind in (
            (shape, kind) for shape in sorted(shapes, key=lambda s: -s[0] * s[1])
            for kind in variants + (("few",) if self._few_limit(shape[0] * shape[1]) else ())
        ):  # fmt: skip
            if self.before_replay is not None:
                slots = None if kind == "base" else np.full(bs * q, -1, np.int32)
                few = self._few_limit(bs * q) if kind == "few" else None
                self.before_replay(bs * q, slots, few)
            graph: torch.cuda.CUDAGraph | _EagerGraph
            if self._cuda:
                for _ in range(2):  # compile / autotune Triton kernels outside the capture
                    logits = self._forward(bs, q)
                if q > 1 and self._verify_out is None:  # the largest verification shape
                    self._verify_out = torch.empty_like(logits)
                torch.cuda.synchronize(self.device)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    logits = self._forward(bs, q)
                    if q > 1:
                        # NOTE: every verification graph writes one shared buffer, so their
                        # [bs * (k + 1), vocab] logits do not each stay allocated in the pool
                        assert self._verify_out is not None
                        logits = self._verify_out[: bs * q].copy_(logits)
                pool = graph.pool()
            else:
                graph = _EagerGraph(lambda bs=bs, q=q: self._forward(bs, q))
                logits = graph.output
            graphs, outputs = self._set(q > 1, kind if self.with_lora else "lora")
            graphs[bs], outputs[bs] = graph, logits
        if self._cuda:
            torch.cuda.synchronize(self.device)
        logger.info(
            "captured %d decode CUDA graphs (batch sizes %s) and %d verification graphs of %d "
            "tokens a row (batch sizes %s)%s in %.1f s",
            len(self.graphs), self.sizes, len(self.verify_graphs), self.verify_query_len,
            self.verify_sizes,
            (f", each with and without LoRA ({len(self.few_graphs)} + "
             f"{len(self.few_verify_graphs)} also for few adapters)") if self.with_lora else "",
            time.monotonic() - start,
        )  # fmt: skip

    def _set(
        self, verify: bool, kind: str
    ) -> tuple[dict[int, torch.cuda.CUDAGraph | _EagerGraph], dict[int, torch.Tensor]]:
        """The graphs and their logits of one kind, decode or verification: "lora" with the
        LoRA kernels (or on an engine without LoRA), "few" with those for few adapters, "base"
        without them."""
        if verify:
            return {
                "lora": (self.verify_graphs, self.verify_logits),
                "few": (self.few_verify_graphs, self.few_verify_logits),
                "base": (self.base_verify_graphs, self.base_verify_logits),
            }[kind]
        return {
            "lora": (self.graphs, self.logits),
            "few": (self.few_graphs, self.few_logits),
            "base": (self.base_graphs, self.base_logits),
        }[kind]

    def _few_limit(self, num_tokens: int) -> int | None:
        return self.few_adapters(num_tokens) if self.few_adapters is not None else None

    def _kind(self, num_tokens: int, lora: np.ndarray | None) -> tuple[str, int | None]:
        """Which graph a step of `num_tokens` padded tokens with these slots replays, and the
        adapter count its kernels were captured for."""
        if not self.with_lora:
            return "lora", None
        if lora is None:
            return "base", None
        few = self._few_limit(num_tokens)
        if few is not None and distinct_adapters(lora) <= few:
            return "few", few
        return "lora", None

    def _lora_slots(
        self, batch: Batch, num_tokens: int, rows: np.ndarray | None
    ) -> np.ndarray | None:
        """The padded per-token slots a replay installs (`rows`: the padded row of each real
        token, None for the first rows in order), None when no token carries an adapter."""
        if not batch.any_lora:
            return None
        if rows is None:
            return batch.lora_slots
        slots = np.full(num_tokens, -1, dtype=np.int32)
        slots[rows] = batch.lora_slots
        return slots

    def padded_size(self, num_seqs: int) -> int | None:
        return _padded(self.sizes, num_seqs)

    def verify_padded_size(self, batch: Batch) -> int | None:
        """The verification graph that can run `batch`, None if none can: every sequence
        decodes its pending token and verifies its drafts (all sample, no prompt logprobs),
        within k + 1 tokens, and no input waits on the device."""
        if batch.spec_lens is None or not self.verify_sizes:
            return None
        n = batch.num_seqs
        if (
            len(batch.sample_rows) != n
            or batch.max_query_len > self.verify_query_len
            or len(batch.pending_tokens)
            or batch.prompt_scores
            or not np.array_equal(np.diff(batch.query_start_loc), batch.spec_lens + 1)
        ):
            return None
        return _padded(self.verify_sizes, n)

    def _stage(self) -> _Staging:
        stage = self._staging[self._num_runs % 2]
        self._num_runs += 1
        if stage.done is not None:
            stage.done.synchronize()  # the copies of the run before last (long finished)
        return stage

    def _upload(self, stage: _Staging, bs: int, num_tokens: int, n: int, width: int) -> None:
        """Copy the staged inputs of `num_tokens` token rows and `bs` sequences (the first n
        real, with blocks up to `width`) to the graph's buffers."""
        for name in ("input_ids", "positions", "slot_mapping"):
            getattr(self, name)[:num_tokens].copy_(
                getattr(stage, name)[:num_tokens], non_blocking=True
            )
        self.seq_lens[:bs].copy_(stage.seq_lens[:bs], non_blocking=True)
        self.block_tables[:n, :width].copy_(stage.block_tables[:n, :width], non_blocking=True)

    def run(
        self, batch: Batch, fill_input_ids: Callable[[torch.Tensor], None] | None = None
    ) -> torch.Tensor:  # [n, vocab] fp32 logits
        """Replay the decode graph for the batch's n sequences. `fill_input_ids(buffer)` may
        then overwrite inputs on the device (tokens sampled by a step not read back yet)."""
        block_tables = batch.block_tables  # [n, width] int32
        n, width = block_tables.shape
        bs = self.padded_size(n)
        assert bs is not None
        stage = self._stage()
        stage.input_ids.numpy()[:n] = batch.input_ids
        stage.positions.numpy()[:n] = batch.positions
        stage.slot_mapping.numpy()[:n] = batch.slot_mapping
        stage.slot_mapping.numpy()[n:bs] = -1
        stage.seq_lens.numpy()[:n] = batch.seq_lens
        stage.seq_lens.numpy()[n:bs] = 0
        stage.block_tables.numpy()[:n, :width] = block_tables
        self._upload(stage, bs, bs, n, width)
        if stage.done is not None:
            stage.done.record()
        if fill_input_ids is not None:
            fill_input_ids(self.input_ids)
        lora = self._lora_slots(batch, bs, None)
        kind, few = self._kind(bs, lora)
        if self.before_replay is not None:
            self.before_replay(bs, lora, few)
        graphs, logits = self._set(False, kind)
        graphs[bs].replay()
        return logits[bs][:n]

    def run_verify(self, batch: Batch) -> torch.Tensor:  # [sum(spec_lens + 1), vocab] fp32
        """Replay the verification graph for the batch (`verify_padded_size` must accept
        it); the logits of its real tokens, in the batch's `logits_indices` order."""
        bs = self.verify_padded_size(batch)
        assert bs is not None and batch.spec_lens is not None
        block_tables = batch.block_tables  # [n, width] int32
        n, width = block_tables.shape
        q = self.verify_query_len
        t = bs * q
        dest = verify_layout(batch.spec_lens + 1, q)  # [num_tokens] padded row of each token
        assert not bool((batch.input_ids == PENDING).any())
        stage = self._stage()
        ids, pos = stage.input_ids.numpy(), stage.positions.numpy()
        slots = stage.slot_mapping.numpy()
        ids[:t] = 0
        # NOTE: padding tokens take their sequence's first position (any valid one would do)
        first = batch.positions[batch.query_start_loc[:-1]]  # [n]
        pos[: n * q] = np.repeat(first, q)
        pos[n * q : t] = 0
        slots[:t] = -1
        ids[dest], pos[dest], slots[dest] = batch.input_ids, batch.positions, batch.slot_mapping
        stage.seq_lens.numpy()[:n] = batch.seq_lens
        stage.seq_lens.numpy()[n:bs] = 0
        stage.block_tables.numpy()[:n, :width] = block_tables
        num_logits = len(batch.logits_indices)
        stage.logits_index.numpy()[:num_logits] = dest[batch.logits_indices]
        self._upload(stage, bs, t, n, width)
        self.logits_index[:num_logits].copy_(stage.logits_index[:num_logits], non_blocking=True)
        if stage.done is not None:
            stage.done.record()
        lora = self._lora_slots(batch, t, dest)
        kind, few = self._kind(t, lora)
        if self.before_replay is not None:
            self.before_replay(t, lora, few)
        graphs, logits = self._set(True, kind)
        graphs[bs].replay()
        return logits[bs][self.logits_index[:num_logits]]


def _padded(sizes: list[int], num_seqs: int) -> int | None:
    for size in sizes:
        if size >= num_seqs:
            return size
    return None
