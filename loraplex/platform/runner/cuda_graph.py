"""Decode steps replayed from CUDA graphs captured for a set of padded batch sizes.

The graphs read persistent device buffers (token ids, positions, slots, sequence lengths,
block tables); a step copies its inputs into them from pinned host staging, replays the graph
of the next larger captured size, and reads the logits of its real rows. Padded rows write no
K/V (slot -1) and attend to nothing (sequence length 0). Two staging sets alternate, so a step
can be prepared while the device may still be copying the previous step's inputs (async
scheduling keeps at most one step in flight).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn

from loraplex.platform.models.attention_metadata import AttentionMetadata
from loraplex.platform.runner.batch import Batch

logger = logging.getLogger(__name__)


def capture_sizes(max_bs: int) -> list[int]:
    sizes = [s for s in (1, 2, 4, 8) if s <= max_bs]
    sizes += list(range(16, max_bs + 1, 16))
    if sizes[-1] != max_bs:
        sizes.append(max_bs)
    return sizes


class CudaGraphRunner:
    def __init__(
        self,
        model: nn.Module,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        max_bs: int,
        max_blocks_per_seq: int,
        device: torch.device,
        before_replay: Callable[[int, np.ndarray | None], None] | None = None,
    ) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.sizes = capture_sizes(max_bs)
        self.max_bs = self.sizes[-1]
        self.device = device
        # Called with (padded batch size, per-token LoRA slots or None) before capture / replay.
        self.before_replay = before_replay
        n, w = self.max_bs, max_blocks_per_seq

        def dev(shape, dtype):
            return torch.zeros(shape, dtype=dtype, device=device)

        def host(shape, dtype):
            return torch.zeros(shape, dtype=dtype, pin_memory=True)

        self.input_ids = dev(n, torch.long)
        self.positions = dev(n, torch.long)
        self.slot_mapping = dev(n, torch.long)
        self.seq_lens = dev(n, torch.int32)
        self.block_tables = dev((n, w), torch.int32)
        self._staging = [
            _Staging(
                host(n, torch.long),
                host(n, torch.long),
                host(n, torch.long),
                host(n, torch.int32),
                host((n, w), torch.int32),
            )
            for _ in range(2)
        ]
        self._num_runs = 0
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}

    def _forward(self, bs: int) -> torch.Tensor:
        meta = AttentionMetadata(
            slot_mapping=self.slot_mapping[:bs],
            query_start_loc=self.query_start_loc[: bs + 1],
            seq_lens=self.seq_lens[:bs],
            block_tables=self.block_tables[:bs],
            max_query_len=1,
            max_seq_len=None,
        )
        hidden = self.model(self.input_ids[:bs], self.positions[:bs], self.kv_caches, meta)
        return self.model.compute_logits(hidden)

    @torch.inference_mode()
    def capture(self) -> None:
        start = time.monotonic()
        self.slot_mapping.fill_(-1)
        pool = None
        for bs in reversed(self.sizes):
            if self.before_replay is not None:
                self.before_replay(bs, None)
            for _ in range(2):  # compile / autotune Triton kernels outside the capture
                self._forward(bs)
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.logits[bs] = self._forward(bs)
            pool = graph.pool()
            self.graphs[bs] = graph
        torch.cuda.synchronize(self.device)
        logger.info(
            "captured %d decode CUDA graphs (batch sizes %s) in %.1f s",
            len(self.graphs),
            self.sizes,
            time.monotonic() - start,
        )

    def padded_size(self, num_seqs: int) -> int | None:
        for size in self.sizes:
            if size >= num_seqs:
                return size
        return None

    def run(
        self, batch: Batch, fill_input_ids: Callable[[torch.Tensor], None] | None = None
    ) -> torch.Tensor:  # [n, vocab] fp32 logits
        """Replay the decode graph for the batch's n sequences. `fill_input_ids(buffer)` may
        then overwrite inputs on the device (tokens sampled by a step not read back yet)."""
        block_tables = batch.block_tables  # [n, width] int32
        n, width = block_tables.shape
        bs = self.padded_size(n)
        assert bs is not None
        stage = self._staging[self._num_runs % 2]
        self._num_runs += 1
        stage.done.synchronize()  # the copies of the run before last (long finished)
        stage.input_ids.numpy()[:n] = batch.input_ids
        stage.positions.numpy()[:n] = batch.positions
        stage.slot_mapping.numpy()[:n] = batch.slot_mapping
        stage.slot_mapping.numpy()[n:bs] = -1
        stage.seq_lens.numpy()[:n] = batch.seq_lens
        stage.seq_lens.numpy()[n:bs] = 0
        stage.block_tables.numpy()[:n, :width] = block_tables
        self.input_ids[:bs].copy_(stage.input_ids[:bs], non_blocking=True)
        self.positions[:bs].copy_(stage.positions[:bs], non_blocking=True)
        self.slot_mapping[:bs].copy_(stage.slot_mapping[:bs], non_blocking=True)
        self.seq_lens[:bs].copy_(stage.seq_lens[:bs], non_blocking=True)
        self.block_tables[:n, :width].copy_(stage.block_tables[:n, :width], non_blocking=True)
        stage.done.record()
        if fill_input_ids is not None:
            fill_input_ids(self.input_ids)
        if self.before_replay is not None:
            self.before_replay(bs, batch.lora_slots if batch.any_lora else None)
        self.graphs[bs].replay()
        return self.logits[bs][:n]


@dataclass
class _Staging:
    """Pinned host copies of the graph inputs, and when the device finished reading them."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor
    done: torch.cuda.Event = field(default_factory=torch.cuda.Event)
