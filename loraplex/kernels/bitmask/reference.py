"""The bitmask kernel in plain torch (CPU and CUDA): disallowed logits set to -inf."""

from __future__ import annotations

import numpy as np
import torch

from loraplex.kernels.bitmask.types import BITS_PER_WORD


def unpack_bitmask(bitmask: torch.Tensor, width: int) -> torch.Tensor:
    """Booleans, True where allowed. bitmask [rows, words] int32 -> [rows, width] bool"""
    if bitmask.device.type == "cpu":
        # NOTE: numpy's unpackbits is ~20x faster than shifting on the CPU; same bit order.
        packed = bitmask.contiguous().numpy().view(np.uint8)  # [rows, words * 4]
        bits = np.unpackbits(packed, axis=1, bitorder="little")  # [rows, words * 32]
        allowed = torch.from_numpy(bits.view(np.bool_))
    else:
        shifts = torch.arange(BITS_PER_WORD, device=bitmask.device, dtype=torch.int32)  # [32]
        bits = (bitmask.unsqueeze(-1) >> shifts) & 1  # [rows, words, 32]
        allowed = bits.flatten(1).bool()  # [rows, words * 32]
    if allowed.shape[1] >= width:
        return allowed[:, :width]
    pad = torch.zeros(
        allowed.shape[0], width - allowed.shape[1], dtype=torch.bool, device=allowed.device
    )
    return torch.cat([allowed, pad], dim=1)


def apply_token_bitmask_ref(
    logits: torch.Tensor, bitmask: torch.Tensor, rows_index: torch.Tensor | None = None
) -> None:
    """Set disallowed logits to -inf in place.

    logits: [num_seqs, vocab]. bitmask: [num_masked, words]. rows_index: [num_masked] int64,
    the logits row of each bitmask row (None: bitmask row i masks logits row i).
    """
    allowed = unpack_bitmask(bitmask, logits.shape[1])  # [num_masked, vocab]
    if rows_index is None:
        logits.masked_fill_(~allowed, float("-inf"))
        return
    masked = logits.index_select(0, rows_index).masked_fill_(~allowed, float("-inf"))
    logits.index_copy_(0, rows_index, masked)
