"""Packed token bitmasks: allocate them on the CPU and fill their rows there; the kernel family
`loraplex.kernels.bitmask` applies them to logits on any device (re-exported here, so grammar's
users have one place for masks).

A bitmask is `[num_rows, ceil(vocab_size / 32)]` int32; bit `t % 32` of word `t // 32` set means
token `t` is allowed. Logits columns past the mask's width are disallowed.
"""

from __future__ import annotations

import numpy as np
import torch

from loraplex.kernels.bitmask import apply_token_bitmask_
from loraplex.kernels.bitmask.types import BITMASK_DTYPE, bitmask_words

__all__ = ["allocate_token_bitmask", "apply_token_bitmask_", "bitmask_array", "bitmask_words"]


def allocate_token_bitmask(
    num_rows: int, vocab_size: int, pin_memory: bool = False
) -> torch.Tensor:
    """A CPU bitmask with every token allowed. # [num_rows, ceil(vocab_size / 32)] int32

    `pin_memory=True` (on CUDA machines) lets the copy to the device run asynchronously.
    """
    if num_rows < 0 or vocab_size <= 0:
        raise ValueError(f"need num_rows >= 0 and vocab_size > 0, got {num_rows}, {vocab_size}")
    return torch.full(
        (num_rows, bitmask_words(vocab_size)), -1, dtype=BITMASK_DTYPE, pin_memory=pin_memory
    )


def bitmask_array(bitmask: torch.Tensor) -> np.ndarray:
    """The numpy view (shared memory) of a CPU bitmask, for fast row writes."""
    if bitmask.dtype != BITMASK_DTYPE or bitmask.dim() != 2 or bitmask.device.type != "cpu":
        raise ValueError(
            f"bitmask must be a 2-D int32 CPU tensor, got {bitmask.dtype} "
            f"{tuple(bitmask.shape)} on {bitmask.device}"
        )
    return bitmask.numpy()
