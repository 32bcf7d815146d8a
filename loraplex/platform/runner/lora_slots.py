"""`LoRASlotWriter`: the runner's one view of adapters — it writes each step's per-token slots.

The scheduler gives each new request its adapter's slot (`NewRequestData.lora_slot`); the
persistent `InputBatch` keeps it as a per-row column, and `build_batch` expands it per token.
Before the forward pass (eager) or before a graph replay, this writer copies those slots into
the LoRA layers' shared batch metadata on the device, and regroups tokens by slot there.

No host synchronisation: the slots go through one of two pinned staging buffers (alternating,
like the graph inputs), copied with `non_blocking=True`; a buffer is refilled only after the
event recorded behind its previous copy has passed (one step back, long done under async
scheduling). The runner never learns which adapter sits in a slot, and never loads one.
"""

from __future__ import annotations

import numpy as np
import torch

from loraplex.adapters.lora_layer import LoRABatchMeta
from loraplex.kernels.lora import DEFAULT_KERNEL_CONFIG

#: More distinct adapters than any step holds: what a graph for any number of them plans for.
_MANY = 1 << 30


def distinct_adapters(lora_slots: np.ndarray) -> int:
    """How many distinct adapters a step's per-token slots hold (-1, the base, not counted)."""
    return int(np.unique(lora_slots[lora_slots >= 0]).size)


class LoRASlotWriter:
    """Installs a step's `[num_tokens]` slots (-1 = base) into `LoRABatchMeta`."""

    def __init__(self, meta: LoRABatchMeta, device: torch.device) -> None:
        self.meta = meta
        self._cuda = device.type == "cuda"
        n = meta.max_num_tokens
        self._staging = [
            torch.full((n,), -1, dtype=torch.int32, pin_memory=self._cuda) for _ in range(2)
        ]  # 2 x [max_num_tokens] int32, host
        self._done = [torch.cuda.Event() if self._cuda else None for _ in range(2)]
        self._num_writes = 0

    def write(
        self,
        lora_slots: np.ndarray,  # [num_tokens] int32, -1 = base model
        num_padded: int | None = None,
        *,
        always_apply: bool = False,
        num_adapters: int | None = None,
    ) -> None:
        """Install the slots of the step's tokens; `num_padded` (>= num_tokens) pads with -1
        rows (graph replay). Without `always_apply` a step with no adapter token switches the
        LoRA layers off; CUDA-graph capture and replay pass it, so the kernels are recorded
        and replayed whatever the batch holds. `num_adapters`: the most distinct adapters the
        kernels plan for (a graph's); None counts them where the count can change the kernels
        (`few_adapters_limit`)."""
        n = len(lora_slots)
        total = n if num_padded is None else num_padded
        if total < n or total > self.meta.max_num_tokens:
            raise ValueError(
                f"{n} slots padded to {total}: the LoRA buffers hold {self.meta.max_num_tokens}"
            )
        active = always_apply or bool((lora_slots >= 0).any())
        if not active:
            self.meta.active = False
            return
        i = self._num_writes % 2
        self._num_writes += 1
        done = self._done[i]
        if done is not None:
            done.synchronize()  # the copy of two writes ago (finished long since)
        host = self._staging[i].numpy()
        host[:n] = lora_slots
        host[n:total] = -1
        if num_adapters is None and self.few_adapters_limit(total) is not None:
            num_adapters = distinct_adapters(lora_slots)
        self.meta.set(self._staging[i][:total], always_apply=True, staged=True,
                      num_adapters=num_adapters)  # fmt: skip
        if done is not None:
            done.record()

    def for_graph(
        self, num_padded: int, lora_slots: np.ndarray | None, num_adapters: int | None = None
    ) -> None:
        """Before a CUDA graph's capture or replay (`CudaGraphRunner.before_replay`): None
        switches the LoRA layers off (a graph without LoRA work, for steps with no adapter
        token); slots are padded with -1 to `num_padded` and the LoRA kernels always run, those
        for at most `num_adapters` distinct adapters where given (a few-adapter graph), else
        for any number."""
        if lora_slots is None:
            self.meta.active = False
            return
        self.write(lora_slots, num_padded, always_apply=True,
                   num_adapters=_MANY if num_adapters is None else num_adapters)  # fmt: skip

    def few_adapters_limit(self, num_tokens: int) -> int | None:
        """The most distinct adapters with which a step of `num_tokens` tokens runs other
        kernels than with many (the grouped pair, `LoRAKernelConfig.few_adapters`), None where
        the count changes nothing (or off CUDA, where the torch reference runs): a CUDA-graph
        runner captures a second LoRA graph for such sizes."""
        config = DEFAULT_KERNEL_CONFIG
        most = num_tokens // config.group_tokens_per_adapter
        if not self._cuda or not config.few_adapters(num_tokens, most):
            return None
        return most
