"""Multi-LoRA for merged projections: every token applies the adapter held in its GPU slot.

A `Linear` made of slices (q/k/v, gate/up, or a single o/down) adds, for each slice `s`,
`scaling[s, slot] * (x @ A_s^T) @ B_s^T` into that slice's output columns. Two steps:

- shrink: `t[i, s * R + r] = x[i] . A[slot_i, s * R + r]` for `r < ranks[s, slot_i]` (fp32),
  one pass over `x` for all slices;
- expand: `out[i, off[s]:off[s+1]] += scaling[s, slot_i] * t[i, s*R : s*R + rank] @ B^T[...]`,
  one pass writing every slice's columns.

Weights are stacked per slot and padded to the largest rank `R` (`LoRAStack`): `A` is
`[num_slots, num_slices * R, in]` (slice `s` in rows `s*R : s*R + R`) and `B^T` is
`[num_slots, R, out]` (slice `s` in columns `off[s] : off[s+1]`), so any slot takes any adapter
and a slot's used rank is a prefix (rows past `ranks[s, slot]` never reach the output). A token
with slot -1 runs the base model only; a slice of rank 0 adds nothing.

DoRA (optional `dora_scale[slot, col]`, fp32, 1.0 where a slot's slice is plain LoRA): the
expand rescales the whole column, `out = g * (out - bias + delta) + bias`, with `g` PEFT's
`magnitude / ||W + scaling * B A||` of that output feature and `bias` the base layer's bias
(`base_bias`), so the base output is scaled by the adapter without a copy of the base weight.

The family: `types` (the stack, the batch metadata, the kernel config), `reference` (plain
torch: the CPU path and the oracle), `ops` (the public entry: checks and dispatch), and the
Triton kernels by regime, which import only the types: `triton_gemv_lora` (one token: the base
GEMV and the delta in one launch), `triton_decode` (one launch for a decode batch),
`triton_token` (per-token shrink + expand), `triton_grouped` (tokens grouped by slot),
`triton_meta` (the per-step grouping).
"""

from loraplex.kernels.lora.ops import (
    add_lora,
    check_lora_args,
    expand_lora,
    fill_kernel_meta,
    fused_gemv_lora,
    lora_triton,
    new_counters,
    shrink_lora,
)
from loraplex.kernels.lora.reference import lora_expand_ref, lora_kernel_meta, lora_shrink_ref
from loraplex.kernels.lora.types import (
    DEFAULT_KERNEL_CONFIG,
    SYNC_COUNTERS,
    LoRAKernelConfig,
    LoRAKernelMeta,
    LoRAStack,
)

__all__ = [
    "DEFAULT_KERNEL_CONFIG",
    "SYNC_COUNTERS",
    "LoRAKernelConfig",
    "LoRAKernelMeta",
    "LoRAStack",
    "add_lora",
    "check_lora_args",
    "expand_lora",
    "fill_kernel_meta",
    "fused_gemv_lora",
    "lora_expand_ref",
    "lora_kernel_meta",
    "lora_shrink_ref",
    "lora_triton",
    "new_counters",
    "shrink_lora",
]
