"""Per-adapter full copies of `embed_tokens` and `lm_head`: PEFT's `modules_to_save`, and the
rows an adapter trained with `trainable_token_indices` (held as the base weight with those rows
replaced).

The copies live beside the first `num_slots` of the `max_loras` LoRA slots
(`LoRAConfig.max_saved_module_loras`); the slot pool puts every adapter that needs a copy in
one of those slots, so a token's or row's LoRA slot also names its copy. Each slot costs
`2 * vocab * hidden` elements of the model dtype (both modules), reserved at start-up.

- Embedding: after the base lookup, each token of a slot holding an embed_tokens copy takes its
  row from that copy (one gather over the step's tokens).
- Logits: each row of a slot holding an lm_head copy gets `hidden @ copy^T`: one matmul per
  copy over the step's rows, so rows sharing a copy share one weight read; the row's base
  logits are replaced. An eager step runs only the copies resident now; a CUDA graph is
  captured over every copy slot, with a per-slot flag, so it replays right whatever is loaded.

Every buffer has a fixed address (CUDA-graph safe); nothing waits for the host.
"""

from __future__ import annotations

import logging

import torch
from torch.nn import functional as F

from loraplex.adapters import zero_pages
from loraplex.adapters.peft_config import VOCAB_MODULES
from loraplex.adapters.peft_format import LoRAWeights

__all__ = ["SavedModules"]

logger = logging.getLogger(__name__)


class SavedModules:
    """The `embed_lora` / `logits_lora` stage of the adapters' full embed_tokens / lm_head copies."""

    def __init__(self, meta, num_slots: int, embed_weight: torch.Tensor,
                 lm_head_weight: torch.Tensor, vocab_size: int) -> None:  # fmt: skip
        self.meta = meta  # LoRABatchMeta
        if not 1 <= num_slots <= meta.num_slots:
            raise ValueError(f"{num_slots} saved-module slots, LoRA has {meta.num_slots}")
        self.num_slots = num_slots
        hidden, dtype, device = embed_weight.shape[1], embed_weight.dtype, embed_weight.device
        self._base = {"embed_tokens": embed_weight, "lm_head": lm_head_weight}
        # module -> [num_slots, vocab, hidden]: the copy held beside LoRA slot k
        self.copies = {
            m: zero_pages.zeros((num_slots, vocab_size, hidden), dtype, device)
            for m in VOCAB_MODULES
        }
        # module -> [max_loras] bool: whether the adapter in LoRA slot s uses its copy
        self.used = {
            m: torch.zeros(meta.num_slots, dtype=torch.bool, device=device) for m in VOCAB_MODULES
        }
        self._resident: dict[str, set[int]] = {m: set() for m in VOCAB_MODULES}
        logger.info(
            "%d LoRA slots hold embed_tokens / lm_head copies (modules_to_save, trained token "
            "rows): %.1f MiB",
            num_slots,
            self.nbytes / 2**20,
        )

    @property
    def nbytes(self) -> int:
        return sum(c.nbytes for c in self.copies.values())

    def _uses(self, module: str, slots: torch.Tensor) -> torch.Tensor:
        """[n] bool: whether each slot's adapter has a copy of `module` (-1: base, never)."""
        return (slots >= 0) & self.used[module][slots.clamp_min(0).long()]

    @staticmethod
    def _capturing(device: torch.device) -> bool:
        """Whether a CUDA graph is being captured (it must cover every copy slot)."""
        return device.type == "cuda" and torch.cuda.is_current_stream_capturing()

    def _skip(self, module: str, device: torch.device) -> bool:
        return not self.meta.active or (not self._capturing(device) and not self._resident[module])

    def embed(self, input_ids: torch.Tensor, hidden: torch.Tensor) -> None:
        # input_ids: [num_tokens], hidden: [num_tokens, hidden], updated in place
        if self._skip("embed_tokens", hidden.device):
            return
        slots = self.meta.kernel_meta.lora_slots  # [num_tokens] int32
        copy = slots.clamp(0, self.num_slots - 1).long()
        rows = self.copies["embed_tokens"][copy, input_ids]  # [num_tokens, hidden]
        hidden.copy_(torch.where(self._uses("embed_tokens", slots)[:, None], rows, hidden))

    def logits(
        self,
        hidden: torch.Tensor,  # [num_rows, hidden]
        logits: torch.Tensor,  # [num_rows, vocab] fp32, updated in place
        token_rows: torch.Tensor | None,  # [num_rows] int64: each row's token; None: all
    ) -> None:
        if self._skip("lm_head", hidden.device):
            return
        slots = self.meta.kernel_meta.lora_slots  # [num_tokens] int32
        if token_rows is not None:
            slots = slots[token_rows.long()]  # [num_rows]
        uses = self._uses("lm_head", slots)  # [num_rows]
        every = self._capturing(hidden.device)
        copies = range(self.num_slots) if every else sorted(self._resident["lm_head"])
        for k in copies:
            out = F.linear(hidden, self.copies["lm_head"][k]).float()  # [num_rows, vocab]
            logits.copy_(torch.where((uses & (slots == k))[:, None], out, logits))

    def load_slot(self, slot: int, weights: LoRAWeights) -> None:
        """Write the adapter's copies beside LoRA slot `slot` (on the caller's stream), or mark
        the slot as using the base modules."""
        for module in VOCAB_MODULES:
            copy, rows = weights.saved.get(module), weights.tokens.get(module)
            if copy is None and rows is None:
                self.used[module][slot] = False
                self._resident[module].discard(slot)
                continue
            if slot >= self.num_slots:
                raise ValueError(
                    f"LoRA slot {slot} holds no {module} copy (the first {self.num_slots} do)"
                )
            target = self.copies[module][slot]  # [vocab, hidden]
            if copy is not None:
                target.copy_(copy, non_blocking=True)
            else:
                assert rows is not None
                base = self._base[module]
                if base.shape != target.shape:
                    raise ValueError(
                        f"trained token rows of {module} need the whole base weight, this rank "
                        f"holds {tuple(base.shape)} of {tuple(target.shape)}"
                    )
                target.copy_(base)
                values = rows.values.to(target.device, target.dtype, non_blocking=True)
                target.index_copy_(0, rows.indices.to(target.device), values)
            self.used[module][slot] = True
            self._resident[module].add(slot)
