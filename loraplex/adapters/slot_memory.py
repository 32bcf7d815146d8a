"""Slot memory: every LoRA hook's per-slot weights in one slot-major device tensor, so writing an
adapter into a slot is one host-to-device copy of one staged image plus two small writes.

Layout. `weights [num_slots, slot_elems]` in the model dtype: slot `s`'s row holds, one region
after another, every hook's per-slot tensors (a layer's stacked `A` and `B^T`, the vocabulary
hooks' `A^T` / `B^T`); each hook sees its region as a strided view `[num_slots, *shape]` (the
slot stride is `slot_elems`; regions start on 64-element boundaries, so the kernels' pointers
stay 128-byte aligned). `params [2, rows, num_slots]` int32 holds every shard's rank (plane 0)
and scaling (plane 1, fp32 bits), so a hook's `ranks` and `scaling` are `[shards, num_slots]`
views with the strides the kernels expect. `dora [num_slots, cols]` fp32 holds every layer's
DoRA column scale (1.0 = plain LoRA).

A `SlotImage` is one slot's row and params column, staged in host memory (page-locked on CUDA)
by the loader thread from a validated adapter: the engine thread's write of a slot is then
`weights[s] <- image`, `params[:, :, s] <- image.params` and `dora[s] <- 1` (a DoRA adapter
then computes its column scales on the device from the written slot). Slots are padded to the
largest rank, so an image is as large as a slot whatever the adapter's rank.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

from loraplex.adapters import zero_pages
from loraplex.adapters.peft_format import LoRAWeights

_ALIGN = 64  # elements: region offsets (and the slot stride) stay 128-byte aligned in bf16


def _aligned(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


@dataclass(frozen=True)
class SlotShapes:
    """What one hook keeps per slot: weight tensors, rank/scaling rows and DoRA columns."""

    weights: tuple[tuple[int, ...], ...]
    params: int
    dora: int = 0

    @property
    def weight_elems(self) -> int:
        return sum(_aligned(_numel(shape)) for shape in self.weights)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


@dataclass(frozen=True)
class SlotImage:
    """One adapter staged as a slot: `weights [slot_elems]` in the model dtype and
    `params [2, rows]` int32 (ranks, then scaling's fp32 bits), zero where the adapter has no
    module. `extras` holds what is not laid out in the image but written per slot by its hook
    after the copy, if the adapter has any: the DoRA modules' ranks, scalings and magnitudes
    (their column scales are computed on the device from the copied A and B), and the full
    embed_tokens / lm_head copies and trained token rows (`adapters.saved_modules`)."""

    path: str
    digest: str
    weights: torch.Tensor  # [slot_elems]
    params: torch.Tensor  # [2, rows] int32
    extras: LoRAWeights | None = None

    @property
    def needs_saved_module_slot(self) -> bool:
        """Whether it must sit in one of the slots holding embed_tokens / lm_head copies."""
        return self.extras is not None and self.extras.needs_saved_module_slot

    @property
    def nbytes(self) -> int:
        extras = 0 if self.extras is None else self.extras.nbytes
        return self.weights.nbytes + self.params.nbytes + extras


@dataclass(frozen=True)
class SlotRegion:
    """A hook's share of the slot memory: device views, and where its part of an image is."""

    weights: tuple[torch.Tensor, ...]  # each [num_slots, *shape]
    ranks: torch.Tensor  # [rows, num_slots] int32
    scaling: torch.Tensor  # [rows, num_slots] fp32
    dora: torch.Tensor | None  # [num_slots, cols] fp32
    _offsets: tuple[int, ...]
    _shapes: tuple[tuple[int, ...], ...]
    _rows: slice

    def host_weights(self, image: SlotImage) -> tuple[torch.Tensor, ...]:
        """The hook's tensors inside `image`, shaped as one slot of the device views."""
        return tuple(
            image.weights[off : off + _numel(shape)].view(shape)
            for off, shape in zip(self._offsets, self._shapes)
        )

    def host_params(self, image: SlotImage) -> tuple[torch.Tensor, torch.Tensor]:
        """(ranks [rows] int32, scaling [rows] fp32) views into `image.params`."""
        return image.params[0, self._rows], image.params[1, self._rows].view(torch.float32)


class SlotMemory:
    """The slot-major device memory of all hooks of one model (see the module doc)."""

    def __init__(
        self,
        num_slots: int,
        shapes: Iterable[SlotShapes],
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        shapes = list(shapes)
        self.num_slots = num_slots
        self.slot_elems = sum(s.weight_elems for s in shapes)
        self.param_rows = sum(s.params for s in shapes)
        self.dtype = dtype
        device = torch.device(device)
        # NOTE: on the host a slot's pages become resident when an adapter is written into it
        self.weights = zero_pages.zeros((num_slots, self.slot_elems), dtype, device)
        self.params = torch.zeros(2, self.param_rows, num_slots, dtype=torch.int32, device=device)
        self.dora = torch.ones(
            num_slots, sum(s.dora for s in shapes), dtype=torch.float32, device=device
        )
        self._next = [0, 0, 0]  # weight elems, param rows, dora cols taken so far

    @property
    def nbytes(self) -> int:
        return self.weights.nbytes + self.params.nbytes + self.dora.nbytes

    def take(self, shapes: SlotShapes) -> SlotRegion:
        """The next region, in the order the shapes were given to the constructor."""
        elems, rows, cols = self._next
        if (
            elems + shapes.weight_elems > self.slot_elems
            or rows + shapes.params > self.param_rows
            or cols + shapes.dora > self.dora.shape[1]
        ):
            raise ValueError("SlotMemory.take: more regions taken than the memory was sized for")
        offsets, views = [], []
        for shape in shapes.weights:
            n = _numel(shape)
            offsets.append(elems)
            views.append(self.weights[:, elems : elems + n].view(self.num_slots, *shape))
            elems += _aligned(n)
        row_slice = slice(rows, rows + shapes.params)
        dora = self.dora[:, cols : cols + shapes.dora] if shapes.dora else None
        self._next = [elems, rows + shapes.params, cols + shapes.dora]
        return SlotRegion(
            weights=tuple(views),
            ranks=self.params[0, row_slice],
            scaling=self.params[1, row_slice].view(torch.float32),
            dora=dora,
            _offsets=tuple(offsets),
            _shapes=tuple(shapes.weights),
            _rows=row_slice,
        )

    def new_image(self, path: str, digest: str, *, pin_memory: bool = False) -> SlotImage:
        """An empty (all-zero: every shard at rank 0) host image of one slot."""
        weights = torch.zeros(self.slot_elems, dtype=self.dtype, pin_memory=pin_memory)
        params = torch.zeros(2, self.param_rows, dtype=torch.int32, pin_memory=pin_memory)
        return SlotImage(path, digest, weights, params)

    def write(self, slot: int, image: SlotImage) -> None:
        """Copy `image` into `slot` on the current stream (non-blocking from pinned memory):
        one copy of the weights, one of the ranks and scalings, one fill of the DoRA scales."""
        if image.weights.shape != (self.slot_elems,) or image.params.shape != (2, self.param_rows):
            raise ValueError(
                f"slot image of {tuple(image.weights.shape)} elements and params "
                f"{tuple(image.params.shape)} does not fit slots of {self.slot_elems} and "
                f"{(2, self.param_rows)}"
            )
        self.weights[slot].copy_(image.weights, non_blocking=True)
        self.params[:, :, slot].copy_(image.params, non_blocking=True)
        self.dora[slot].fill_(1.0)
