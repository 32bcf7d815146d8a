"""Plain-torch LoRA: the CPU path and the oracle of the Triton kernels (same arguments)."""

from __future__ import annotations

import torch

from loraplex.kernels.lora.types import LoRAKernelMeta, LoRAStack


def lora_kernel_meta(lora_slots: torch.Tensor, num_slots: int) -> LoRAKernelMeta:
    """Group a batch's tokens by slot (plain torch; stable, base tokens last)."""
    if lora_slots.dim() != 1:
        raise ValueError(f"lora_slots must be 1-D, got shape {tuple(lora_slots.shape)}")
    slots = lora_slots.to(torch.int64)
    key = torch.where(slots < 0, torch.full_like(slots, num_slots), slots)
    order = torch.sort(key, stable=True).indices
    counts = torch.zeros(num_slots + 1, dtype=torch.int64, device=slots.device)
    counts.scatter_add_(0, key, torch.ones_like(key))
    starts = torch.cumsum(counts, 0) - counts
    return LoRAKernelMeta(
        lora_slots=lora_slots.to(torch.int32),
        token_order=order.to(torch.int32),
        slot_start=starts[:num_slots].to(torch.int32),
        slot_count=counts[:num_slots].to(torch.int32),
    )


def _slot_rows(meta: LoRAKernelMeta) -> list[tuple[int, torch.Tensor]]:
    slots = meta.lora_slots
    return [
        (slot, (slots == slot).nonzero().squeeze(1))
        for slot in torch.unique(slots).tolist()
        if slot >= 0
    ]


def lora_shrink_ref(
    x: torch.Tensor, lora: LoRAStack, t: torch.Tensor, meta: LoRAKernelMeta
) -> None:
    """Plain-torch shrink: `t[:num_tokens, :num_slices * max_rank]` (fp32) for adapter tokens."""
    r_max = lora.max_rank
    for slot, rows in _slot_rows(meta):
        t[rows, : lora.num_slices * r_max] = 0.0
        for s in range(lora.num_slices):
            r = int(lora.ranks[s, slot])
            a = lora.a[slot, s * r_max : s * r_max + r].float()  # [r, in]
            t[rows, s * r_max : s * r_max + r] = x[rows].float() @ a.T


def lora_expand_ref(
    t: torch.Tensor, lora: LoRAStack, out: torch.Tensor, meta: LoRAKernelMeta
) -> None:
    """Plain-torch expand: adds each slice's `scaling * t_s @ B_s^T` into its columns of `out`
    (DoRA slices: `g * (out - bias + delta) + bias`)."""
    r_max, offsets = lora.max_rank, lora.slice_offsets
    for slot, rows in _slot_rows(meta):
        for s in range(lora.num_slices):
            r, lo, hi = int(lora.ranks[s, slot]), offsets[s], offsets[s + 1]
            if r == 0:
                continue
            b_t = lora.b_t[slot, :r, lo:hi].float()  # [r, hi - lo]
            delta = (t[rows, s * r_max : s * r_max + r] @ b_t) * lora.scaling[s, slot].float()
            base = out[rows, lo:hi].float()  # [rows, hi - lo]
            if lora.dora_scale is None:
                out[rows, lo:hi] = (base + delta).to(out.dtype)
                continue
            g = lora.dora_scale[slot, lo:hi]  # [hi - lo]
            bias = 0.0 if lora.base_bias is None else lora.base_bias[lo:hi].float()
            dora = g * (base - bias + delta) + bias
            out[rows, lo:hi] = torch.where(g == 1.0, base + delta, dora).to(out.dtype)
