"""The packed token bitmask's layout, shared by the entry, the reference and the Triton kernel.

A bitmask is `[num_rows, ceil(vocab_size / 32)]` int32; bit `t % 32` of word `t // 32` set means
token `t` is allowed. Logits columns past the mask's width are disallowed.
"""

from __future__ import annotations

import torch

BITMASK_DTYPE = torch.int32
BITS_PER_WORD = 32


def bitmask_words(vocab_size: int) -> int:
    """int32 words a packed mask of `vocab_size` tokens needs."""
    return (vocab_size + BITS_PER_WORD - 1) // BITS_PER_WORD
