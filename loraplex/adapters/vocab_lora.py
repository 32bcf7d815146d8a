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

from loraplex.adapters.peft_format import EMBED_KEY, LM_HEAD_KEY, LoRAWeights
from loraplex.kernels.lora import LoRAStack, add_lora, lora_kernel_meta

__all__ = ["EmbeddingLoRA", "LMHeadLoRA"]


def _stack(
    num_slots: int, max_rank: int, a_cols: int, out: int, dtype: torch.dtype, device: torch.device
) -> LoRAStack:
    return LoRAStack(
        a=torch.zeros(num_slots, max_rank, a_cols, dtype=dtype, device=device),
        b_t=torch.zeros(num_slots, max_rank, out, dtype=dtype, device=device),
        ranks=torch.zeros(1, num_slots, dtype=torch.int32, device=device),
        scaling=torch.zeros(1, num_slots, dtype=torch.float32, device=device),
        slice_offsets=(0, out),
    )


class EmbeddingLoRA:
    """The `embed_lora` hook of a model: adds each adapter token's embedding delta in place."""

    def __init__(self, meta, vocab_size: int, hidden_size: int, max_rank: int,
                 dtype: torch.dtype, device: torch.device) -> None:  # fmt: skip
        self.meta = meta  # LoRABatchMeta
        slots = meta.num_slots
        self.a_t = torch.zeros(slots, vocab_size, max_rank, dtype=dtype, device=device)
        # NOTE: `weights.a` is the identity, so the shrink copies each token's gathered A row.
        self.weights = _stack(slots, max_rank, max_rank, hidden_size, dtype, device)
        self.weights.a.copy_(
            torch.eye(max_rank, dtype=dtype, device=device).expand_as(self.weights.a)
        )

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
        add_lora(rows, hidden, self.weights, kernel_meta, self.meta.workspace)

    def load_slot(self, slot: int, weights: LoRAWeights) -> None:
        module = weights.modules.get(EMBED_KEY)
        w = self.weights
        if module is None:
            w.ranks[0, slot] = 0
            return
        r = module.rank
        self.a_t[slot, :, :r].copy_(module.a.T, non_blocking=True)
        w.b_t[slot, :r].copy_(module.b.T, non_blocking=True)
        w.ranks[0, slot] = r
        w.scaling[0, slot] = module.scaling


class LMHeadLoRA:
    """The `logits_lora` hook of a model: adds each row's adapter delta to its logits."""

    def __init__(self, meta, vocab_size: int, hidden_size: int, max_rank: int,
                 dtype: torch.dtype, device: torch.device) -> None:  # fmt: skip
        self.meta = meta  # LoRABatchMeta
        self.weights = _stack(meta.num_slots, max_rank, hidden_size, vocab_size, dtype, device)

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
        add_lora(hidden, logits, self.weights, kernel_meta, self.meta.workspace)

    def load_slot(self, slot: int, weights: LoRAWeights) -> None:
        module = weights.modules.get(LM_HEAD_KEY)
        w = self.weights
        if module is None:
            w.ranks[0, slot] = 0
            return
        r = module.rank
        w.a[slot, :r].copy_(module.a, non_blocking=True)
        w.b_t[slot, :r].copy_(module.b.T, non_blocking=True)
        w.ranks[0, slot] = r
        w.scaling[0, slot] = module.scaling
