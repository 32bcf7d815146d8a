"""Rank 0's LoRA layers under tensor parallelism: each slot write also goes to the other ranks."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from loraplex.adapters.lora_layer import LoRAModelState
from loraplex.adapters.slot_memory import SlotImage
from loraplex.platform.runner.tp.messages import LoadLoRASlot


@dataclass(frozen=True)
class TensorParallelLoRAState(LoRAModelState):
    """`write_slot` writes rank 0's slices and sends every other rank a `LoadLoRASlot`; the
    ranks read the adapter's folder themselves (checked against its digest), so an adapter's
    tensors never cross the pipes. The pipe keeps the order, so a slot is written on every
    rank before any step that reads it."""

    send: Callable[[object], None] = field(kw_only=True)

    def write_slot(self, slot: int, image: SlotImage) -> None:
        self.send(LoadLoRASlot(slot, image.path, image.digest))
        super().write_slot(slot, image)
