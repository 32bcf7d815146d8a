"""LoRA on the vocabulary ends of the model: `embed_tokens` (PEFT's `lora_embedding_A/B`) and
`lm_head`, batched by each token's slot like the projections.

- `EmbeddingLoRA` adds `scaling * A^T[token] @ B^T` to each adapter token's embedding. The
  lookup `A^T[slot, token]` gathers one `[rank]` row per token; the rest is the projections'
  grouped LoRA kernels over an identity `A` (the shrink copies the row, the expand applies B),
  so it costs one gather and two launches per step and replays from CUDA graphs.
- `LMHeadLoRA` adds `scaling * (h @ A^T) @ B^T` to each row's logits, the LoRA kernels with
  one slice as wide as the vocabulary; the rows' slots are the slots of the tokens they were
  computed from (`token_rows`).

Each keeps `[max_loras, max_rank]`-padded weights: about `2 * vocab * max_rank` elements of the
model dtype per slot each, whether or not an adapter uses them.
"""

from __future__ import annotations

import torch

from loraplex.adapters.peft_format import (
    EMBED_KEY,
    LM_HEAD_KEY,
    LoRAModuleWeights,
    LoRAWeights,
)
from loraplex.adapters.slot_memory import SlotImage, SlotMemory, SlotRegion, SlotShapes
from loraplex.kernels.lora import LoRAStack, add_lora, lora_kernel_meta

__all__ = ["EmbeddingLoRA", "LMHeadLoRA"]


def _stack(region: SlotRegion, out: int, a: torch.Tensor | None = None) -> LoRAStack:
    """The hook's kernel weights: its region's A (or the given one), B^T, ranks, scalings."""
    a_slots, b_t = region.weights
    return LoRAStack(
        a=a_slots if a is None else a,
        b_t=b_t,
        ranks=region.ranks,
        scaling=region.scaling,
        slice_offsets=(0, out),
    )


def _take(memory: SlotMemory | None, shapes: SlotShapes, num_slots: int, dtype, device):
    """The hook's region of the model's slot memory (of memory of its own when None)."""
    if memory is None:
        memory = SlotMemory(num_slots, [shapes], dtype, device)
    return memory.take(shapes)


def _stage(region: SlotRegion, image: SlotImage, module: LoRAModuleWeights | None,
           *, a_transposed: bool) -> None:  # fmt: skip
    """Write a vocabulary module into the hook's part of a host slot image: A (as `[r, in]`
    rows, or `[in, r]` columns when the hook keeps A^T), B^T, rank and scaling."""
    if module is None:
        return
    r = module.rank
    a_img, b_img = region.host_weights(image)
    ranks, scaling = region.host_params(image)
    if a_transposed:
        a_img[:, :r].copy_(module.a.T)
    else:
        a_img[:r].copy_(module.a)
    b_img[:r].copy_(module.b.T)
    ranks[0] = r
    scaling[0] = module.scaling


class EmbeddingLoRA:
    """The `embed_lora` hook of a model: adds each adapter token's embedding delta in place."""

    def __init__(self, meta, vocab_size: int, hidden_size: int, max_rank: int,
                 dtype: torch.dtype, device: torch.device,
                 memory: SlotMemory | None = None) -> None:  # fmt: skip
        self.meta = meta  # LoRABatchMeta
        slots = meta.num_slots
        self.region = _take(
            memory, self.slot_shapes(vocab_size, hidden_size, max_rank), slots, dtype, device
        )
        self.a_t = self.region.weights[0]  # [slots, vocab, max_rank]
        # NOTE: `weights.a` is the identity, so the shrink copies each token's gathered A row.
        eye = torch.eye(max_rank, dtype=dtype, device=device)
        self.weights = _stack(self.region, hidden_size, eye.expand(slots, -1, -1).contiguous())

    @staticmethod
    def slot_shapes(vocab_size: int, hidden_size: int, max_rank: int) -> SlotShapes:
        """Per slot: A^T [vocab, max_rank] and B^T [max_rank, hidden]; one rank row."""
        return SlotShapes(((vocab_size, max_rank), (max_rank, hidden_size)), 1)

    @property
    def nbytes(self) -> int:
        return self.a_t.nbytes + self.weights.a.nbytes + self.weights.b_t.nbytes

    def __call__(self, input_ids: torch.Tensor, hidden: torch.Tensor) -> None:
        # input_ids: [num_tokens], hidden: [num_tokens, hidden], updated in place
        if not self.meta.active:
            return
        kernel_meta = self.meta.kernel_meta
        slots = kernel_meta.lora_slots.clamp_min(0).long()  # base tokens: masked by the kernels
        rows = self.a_t[slots, input_ids]  # [num_tokens, max_rank]
        add_lora(rows, hidden, self.weights, kernel_meta, self.meta.workspace,
                 counters=self.meta.counters)  # fmt: skip

    def stage(self, image: SlotImage, weights: LoRAWeights) -> None:
        """Write the adapter's embedding LoRA (if any) into a host slot image."""
        _stage(self.region, image, weights.modules.get(EMBED_KEY), a_transposed=True)


class LMHeadLoRA:
    """The `logits_lora` hook of a model: adds each row's adapter delta to its logits."""

    def __init__(self, meta, vocab_size: int, hidden_size: int, max_rank: int,
                 dtype: torch.dtype, device: torch.device,
                 memory: SlotMemory | None = None) -> None:  # fmt: skip
        self.meta = meta  # LoRABatchMeta
        shapes = self.slot_shapes(vocab_size, hidden_size, max_rank)
        self.region = _take(memory, shapes, meta.num_slots, dtype, device)
        self.weights = _stack(self.region, vocab_size)

    @staticmethod
    def slot_shapes(vocab_size: int, hidden_size: int, max_rank: int) -> SlotShapes:
        """Per slot: A [max_rank, hidden] and B^T [max_rank, vocab]; one rank row."""
        return SlotShapes(((max_rank, hidden_size), (max_rank, vocab_size)), 1)

    @property
    def nbytes(self) -> int:
        return self.weights.a.nbytes + self.weights.b_t.nbytes

    def __call__(
        self,
        hidden: torch.Tensor,  # [num_rows, hidden]
        logits: torch.Tensor,  # [num_rows, vocab] fp32, updated in place
        token_rows: torch.Tensor | None,  # [num_rows] int64: each row's token; None: all, in order
    ) -> None:
        if not self.meta.active:
            return
        kernel_meta = self.meta.kernel_meta
        if token_rows is not None:
            slots = kernel_meta.lora_slots[token_rows.long()]  # [num_rows]
            kernel_meta = lora_kernel_meta(slots, self.meta.num_slots)
        add_lora(hidden, logits, self.weights, kernel_meta, self.meta.workspace,
                 counters=self.meta.counters)  # fmt: skip

    def stage(self, image: SlotImage, weights: LoRAWeights) -> None:
        """Write the adapter's lm_head LoRA (if any) into a host slot image."""
        _stage(self.region, image, weights.modules.get(LM_HEAD_KEY), a_transposed=False)
