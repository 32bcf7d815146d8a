"""A checkpoint tensor not read yet: a rank reads only the slice it holds (tensor parallelism)."""

from __future__ import annotations

from typing import Any

import torch


class CheckpointTensor:
    """One tensor of an open safetensors file, read on demand, whole or in part."""

    def __init__(self, handle: Any, name: str) -> None:
        self._handle = handle  # an open `safe_open` file
        self.name = name

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self._handle.get_slice(self.name).get_shape())

    def read(self) -> torch.Tensor:
        return self._handle.get_tensor(self.name)

    def read_slice(self, dim: int, start: int, size: int) -> torch.Tensor:
        """`size` entries from `start` along `dim`; only they are read from the file."""
        index = [slice(None)] * len(self.shape)
        index[dim] = slice(start, start + size)
        return self._handle.get_slice(self.name)[tuple(index)]


def narrow(
    tensor: torch.Tensor | CheckpointTensor, dim: int | None, start: int, size: int
) -> torch.Tensor:
    """`tensor` (dim None), or `size` entries from `start` along `dim`; a checkpoint tensor
    is read here, and only that part of it."""
    if isinstance(tensor, CheckpointTensor):
        return tensor.read() if dim is None else tensor.read_slice(dim, start, size)
    return tensor if dim is None else tensor.narrow(dim, start, size)
