"""The per-step token grouping of the grouped LoRA kernels (`LoRAKernelMeta`) in one launch: a
stable counting sort by slot, base tokens last, with no host synchronisation (graph-safe)."""

from __future__ import annotations

import triton
import triton.language as tl

from loraplex.kernels.lora.types import LoRAKernelMeta


@triton.jit(do_not_specialize=["num_tokens"])
def _kernel_meta_kernel(
    slots_ptr, order_ptr, start_ptr, count_ptr, num_tokens, num_slots,
    SLOTS: tl.constexpr, CHUNK: tl.constexpr,
):  # fmt: skip
    """One program: a stable counting sort of the tokens by slot (base tokens last)."""
    bins = tl.arange(0, SLOTS)
    lane = tl.arange(0, CHUNK)
    counts = tl.zeros((SLOTS,), dtype=tl.int32)
    for c0 in range(0, num_tokens, CHUNK):
        valid = c0 + lane < num_tokens
        s = tl.load(slots_ptr + c0 + lane, mask=valid, other=0)
        key = tl.where(valid, tl.where(s < 0, num_slots, s), SLOTS)
        counts += tl.sum((key[:, None] == bins[None, :]).to(tl.int32), 0)
    cursor = tl.cumsum(counts, 0) - counts
    tl.store(start_ptr + bins, cursor, mask=bins < num_slots)
    tl.store(count_ptr + bins, counts, mask=bins < num_slots)
    for c0 in range(0, num_tokens, CHUNK):
        valid = c0 + lane < num_tokens
        s = tl.load(slots_ptr + c0 + lane, mask=valid, other=0)
        key = tl.where(valid, tl.where(s < 0, num_slots, s), SLOTS)
        onehot = key[:, None] == bins[None, :]  # [CHUNK, SLOTS]
        same_before = (key[:, None] == key[None, :]) & (lane[None, :] < lane[:, None])
        pos = tl.sum(tl.where(onehot, cursor[None, :], 0), 1)
        pos += tl.sum(same_before.to(tl.int32), 1)
        tl.store(order_ptr + pos, c0 + lane, mask=valid)
        cursor += tl.sum(onehot.to(tl.int32), 0)


def kernel_meta_triton(meta: LoRAKernelMeta, num_slots: int) -> None:
    """Fill `meta`'s token_order, slot_start and slot_count from its lora_slots, in place, in
    one launch (no host synchronisation; graph-safe)."""
    num_tokens = meta.lora_slots.shape[0]
    _kernel_meta_kernel[(1,)](
        meta.lora_slots, meta.token_order, meta.slot_start, meta.slot_count,
        num_tokens, num_slots, SLOTS=triton.next_power_of_2(num_slots + 1), CHUNK=64,
    )  # fmt: skip
