"""Zeros on the host whose pages become resident only once written.

Adapter slot memory is sized for the most adapters a model may hold, each slot at the largest
rank: 829 MiB for the embedded model's 8 slots of rank 64, and a full embed_tokens / lm_head
copy per saved-module slot. `torch.zeros` writes every byte, so a CPU engine held all of it
from its start, though a slot is read only once an adapter has been written into it. On the
host these tensors come from a private anonymous mapping instead: the OS hands out zero pages,
and a page costs memory when first written (an adapter loaded into its slot). Elsewhere
`torch.zeros`.
"""

from __future__ import annotations

import math
import mmap

import torch


def zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zero tensor of `shape`; on CPU, backed by pages the OS maps on first write."""
    nbytes = math.prod(shape) * dtype.itemsize
    if device.type != "cpu" or nbytes == 0 or not hasattr(mmap, "MAP_PRIVATE"):
        return torch.zeros(shape, dtype=dtype, device=device)
    # NOTE: the tensor holds the mapping (frombuffer keeps its buffer alive); it is unmapped
    # when the tensor's storage is freed.
    pages = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE)
    return torch.frombuffer(pages, dtype=dtype).view(shape)
