"""Per-step batch metadata that every attention layer reads (DESIGN.md's batch layout)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from loraplex.kernels.attention import DecodePlan


@dataclass(frozen=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] int64, -1 = padding
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32
    seq_lens: torch.Tensor  # [num_seqs] int32, context incl. new tokens
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int32
    # Host-side bounds the kernels use to size their grids; None under CUDA-graph capture, so
    # the grid follows tensor shapes only and every replay fits.
    max_query_len: int | None
    max_seq_len: int | None
    # CPU, every sequence decoding: the gather indices all layers share (None: none).
    decode_plan: DecodePlan | None = None
