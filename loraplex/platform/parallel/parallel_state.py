"""A rank's tensor-parallel group and the three collectives the model needs.

Megatron-style tensor parallelism needs an all-reduce after each row-parallel layer, an
all-gather of the vocabulary-parallel logits, and a broadcast of rank 0's sampled tokens. On
CUDA they run over NCCL (plain ring all-reduce: NVLink multicast stays off, see
`set_collective_env`), on CPU over gloo, so the whole path runs in CI.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

#: How long a collective may wait for a peer before it fails (a rank that hangs, not dies).
COLLECTIVE_TIMEOUT = timedelta(minutes=10)


def set_collective_env() -> None:
    """Turn NVLink multicast (NVLS, symmetric-memory multicast) off before NCCL starts: the
    lent machines do not support it, and the plain all-reduce is what CUDA graphs capture."""
    os.environ["NCCL_NVLS_ENABLE"] = "0"
    os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] = "1"


@dataclass(frozen=True)
class TensorParallel:
    """One rank's place in its tensor-parallel group. `size == 1` is the unsplit model (no
    process group, every collective a no-op)."""

    rank: int = 0
    size: int = 1
    group: dist.ProcessGroup | None = None

    def __post_init__(self) -> None:
        if self.size < 1 or not 0 <= self.rank < self.size:
            raise ValueError(f"tensor-parallel rank {self.rank} of {self.size} is invalid")
        if self.size > 1 and self.group is None:
            raise ValueError("a tensor-parallel group of several ranks needs a process group")

    @property
    def enabled(self) -> bool:
        return self.size > 1

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum `x` over the ranks, in place (returns it)."""
        if self.enabled:
            dist.all_reduce(x, group=self.group)
        return x

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """Concatenate every rank's `x` along the last dim: [..., n] -> [..., size * n]."""
        if not self.enabled:
            return x
        x = x.contiguous()
        rows = x.shape[0] if x.dim() else 1
        out = torch.empty((self.size * rows, *x.shape[1:]), dtype=x.dtype, device=x.device)
        _all_gather_single(out, x, group=self.group)  # [tp * rows, ..., n]
        out = out.view(self.size, *x.shape)  # [tp, ..., n]
        return out.movedim(0, -2).reshape(*x.shape[:-1], self.size * x.shape[-1])

    def broadcast(self, x: torch.Tensor) -> torch.Tensor:
        """Rank 0's `x` on every rank, in place (returns it)."""
        if self.enabled:
            dist.broadcast(x, src=0, group=self.group)
        return x

    def min_int(self, value: int, device: torch.device) -> int:
        """The smallest of every rank's `value` (e.g. how many KV blocks fit)."""
        if not self.enabled:
            return value
        t = torch.tensor([value], dtype=torch.int64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.group)
        return int(t.item())


SINGLE = TensorParallel()


def init_tensor_parallel(
    rank: int, size: int, init_file: str, device: torch.device
) -> TensorParallel:
    """Join the group of `size` ranks that rendezvous through `init_file` (a path no rank has
    created yet), over NCCL on CUDA and gloo on CPU."""
    if size == 1:
        return SINGLE
    backend = "nccl" if device.type == "cuda" else "gloo"
    if backend == "nccl":
        set_collective_env()
        torch.cuda.set_device(device)
    dist.init_process_group(
        backend,
        init_method=f"file://{init_file}",
        rank=rank,
        world_size=size,
        timeout=COLLECTIVE_TIMEOUT,
        device_id=device if backend == "nccl" else None,
    )
    return TensorParallel(rank, size, dist.group.WORLD)


def destroy_tensor_parallel(tp: TensorParallel) -> None:
    if tp.enabled and dist.is_initialized():
        dist.destroy_process_group()


# NOTE: newer torch renames all_gather_into_tensor (and warns on the old name).
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
