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
and a slot's used rank is a prefix (kernels stop at `ranks[s, slot]`; no stale tail is read).
A token with slot -1 runs the base model only; a slice of rank 0 adds nothing.

DoRA (optional `dora_scale[slot, col]`, fp32, 1.0 where a slot's slice is plain LoRA): the
expand rescales the whole column, `out = g * (out - bias + delta) + bias`, with `g` PEFT's
`magnitude / ||W + scaling * B A||` of that output feature and `bias` the base layer's bias
(`base_bias`), so the base output is scaled by the adapter without a copy of the base weight.

The grouped kernels visit tokens by slot (`LoRAKernelMeta`, filled once per step and shared by
every layer), so tokens that share an adapter share weight loads and tensor-core tiles.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class LoRAKernelMeta:
    """Per-step batch metadata shared by every LoRA layer of one forward pass."""

    lora_slots: torch.Tensor  # [num_tokens] int32, -1 = base model
    token_order: torch.Tensor  # [num_tokens] int32, token indices sorted by slot (base last)
    slot_start: torch.Tensor  # [num_slots] int32, first position of each slot in token_order
    slot_count: torch.Tensor  # [num_slots] int32, tokens carrying each slot


@dataclass(frozen=True)
class LoRAKernelConfig:
    """Which Triton kernels run and with which tiles (all sizes powers of two)."""

    token_kernels_max_tokens: int = 64  # up to this many tokens: one program per token
    # NOTE: up to this many tokens one fused shrink + expand launch; 0 (the default): never. On
    # the H200 the pair beat it at 1 and 8 tokens on every 8B projection (31 against 64 us a
    # layer at one token, benchmarks/results/h200_lora_fused.json): each fused program re-reads
    # its slice's A, which costs more than the launch it saves.
    fused_max_tokens: int = 0
    fused_programs: int = 256  # widen the fused kernel's column tiles until about this many
    fused_block_elems: int = 32768  # A elements per fused shrink iteration (rank x block_k)
    # NOTE: each fused program reads its slice's whole A (rank x in); past this many input
    # features that read outlasts the pair's split reduction, so wide inputs keep the pair.
    fused_max_k: int = 8192
    target_programs: int = 512  # split the shrink's reduction until about this many programs
    max_splits: int = 32
    shrink_block_k: int = 128
    expand_block_n: int = 256  # columns per program of the per-token expand
    group_block_m: int = 16  # tokens per program of the grouped kernels
    group_block_n: int = 128
    group_expand_max_chunks: int = 8  # column chunks of group_block_n per grouped expand program
    group_expand_programs: int = 1024  # ... as long as about this many programs remain

    def __post_init__(self) -> None:
        for name in ("shrink_block_k", "expand_block_n", "group_block_m", "group_block_n",
                     "fused_block_elems"):  # fmt: skip
            value = getattr(self, name)
            if value < 16 or value & (value - 1):
                raise ValueError(f"LoRAKernelConfig.{name} must be a power of two >= 16")
        if self.group_expand_max_chunks < 1 or self.group_expand_programs < 1:
            raise ValueError(
                "LoRAKernelConfig: group_expand_max_chunks and group_expand_programs must be >= 1"
            )
        if self.target_programs < 1 or self.max_splits < 1 or self.fused_programs < 1:
            raise ValueError(
                "LoRAKernelConfig: target_programs, max_splits and fused_programs must be >= 1"
            )
        if self.fused_max_tokens < 0:
            raise ValueError("LoRAKernelConfig.fused_max_tokens must be >= 0")

    def use_token_kernels(self, num_tokens: int) -> bool:
        return num_tokens <= self.token_kernels_max_tokens

    def use_fused_kernel(self, num_tokens: int, in_features: int) -> bool:
        return num_tokens <= self.fused_max_tokens and in_features <= self.fused_max_k


@dataclass(frozen=True)
class LoRAStack:
    """One `Linear`'s adapter weights for every slot, its slices stacked (see module doc)."""

    a: torch.Tensor  # [num_slots, num_slices * max_rank, in]
    b_t: torch.Tensor  # [num_slots, max_rank, >= slice_offsets[-1]]
    ranks: torch.Tensor  # [num_slices, num_slots] int32
    scaling: torch.Tensor  # [num_slices, num_slots] fp32
    slice_offsets: tuple[int, ...]  # slice s owns output columns offsets[s]:offsets[s + 1]
    dora_scale: torch.Tensor | None = None  # [num_slots, >= offsets[-1]] fp32, 1.0 = no DoRA
    base_bias: torch.Tensor | None = None  # [>= offsets[-1]], the base layer's bias (DoRA)

    def __post_init__(self) -> None:
        s = len(self.slice_offsets) - 1
        slots = self.a.shape[0] if self.a.dim() == 3 else -1
        if (
            s < 1
            or self.a.dim() != 3
            or self.b_t.dim() != 3
            or self.a.shape[1] != s * self.b_t.shape[1]
            or self.b_t.shape[0] != slots
            or self.b_t.shape[2] < self.slice_offsets[-1]
            or any(lo > hi for lo, hi in zip(self.slice_offsets, self.slice_offsets[1:]))
        ):
            raise ValueError(
                f"LoRAStack: A {tuple(self.a.shape)} and B^T {tuple(self.b_t.shape)} do not fit "
                f"slice offsets {self.slice_offsets}"
            )
        if self.ranks.shape != (s, slots) or self.ranks.dtype != torch.int32:
            raise ValueError(f"LoRAStack: ranks must be int32 [{s}, {slots}]")
        if self.scaling.shape != (s, slots) or self.scaling.dtype != torch.float32:
            raise ValueError(f"LoRAStack: scaling must be fp32 [{s}, {slots}]")
        if self.a.stride(2) != 1 or self.b_t.stride(2) != 1 or self.ranks.stride(1) != 1:
            raise ValueError("LoRAStack: weights need a contiguous last dimension")
        if self.ranks.stride() != self.scaling.stride():
            raise ValueError("LoRAStack: ranks and scaling need the same strides")
        g = self.dora_scale
        if g is not None and (
            g.dim() != 2
            or g.shape[0] != slots
            or g.shape[1] < self.slice_offsets[-1]
            or g.dtype != torch.float32
            or g.stride(1) != 1
        ):
            raise ValueError(f"LoRAStack: dora_scale must be contiguous fp32 [{slots}, >= out]")
        bias = self.base_bias
        if bias is not None and (
            g is None or bias.dim() != 1 or bias.shape[0] < self.slice_offsets[-1]
        ):
            raise ValueError("LoRAStack: base_bias must be [>= out] beside a dora_scale")

    @property
    def num_slices(self) -> int:
        return len(self.slice_offsets) - 1

    @property
    def max_rank(self) -> int:
        return self.b_t.shape[1]

    @property
    def slice_sizes(self) -> tuple[int, ...]:
        return tuple(hi - lo for lo, hi in zip(self.slice_offsets, self.slice_offsets[1:]))


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


def fill_kernel_meta(meta: LoRAKernelMeta, num_slots: int) -> None:
    """Recompute `meta`'s order, starts and counts from its `lora_slots`, in place. On CUDA this
    is one kernel launch with no host synchronisation, so it can be captured in a CUDA graph."""
    if meta.lora_slots.is_cuda:
        from loraplex.kernels.triton_lora import kernel_meta_triton

        kernel_meta_triton(meta, num_slots)
        return
    fresh = lora_kernel_meta(meta.lora_slots, num_slots)
    meta.token_order.copy_(fresh.token_order)
    meta.slot_start.copy_(fresh.slot_start)
    meta.slot_count.copy_(fresh.slot_count)


def check_lora_args(
    x: torch.Tensor, out: torch.Tensor, lora: LoRAStack, meta: LoRAKernelMeta, t: torch.Tensor
) -> None:
    """Raise `ValueError` unless the tensors of one LoRA application fit together."""
    if x.dim() != 2 or out.dim() != 2 or x.shape[0] != out.shape[0]:
        raise ValueError(
            f"lora: x {tuple(x.shape)} and out {tuple(out.shape)} must be 2-D, aligned"
        )
    if x.shape[1] != lora.a.shape[2] or x.dtype != lora.a.dtype:
        raise ValueError(f"lora: x {tuple(x.shape)} {x.dtype} does not match A {lora.a.dtype}")
    if lora.slice_offsets[-1] > out.shape[1] or x.stride(1) != 1 or out.stride(1) != 1:
        raise ValueError(
            f"lora: slices {lora.slice_offsets} outside out {tuple(out.shape)} "
            "or a non-contiguous row"
        )
    if meta.lora_slots.shape[0] != x.shape[0]:
        raise ValueError(f"lora: {meta.lora_slots.shape[0]} slots for {x.shape[0]} tokens")
    width = lora.num_slices * lora.max_rank
    if t.dtype != torch.float32 or t.dim() != 2 or t.shape[0] < x.shape[0] or t.shape[1] < width:
        raise ValueError(
            f"lora: workspace must be fp32 [>= {x.shape[0]}, >= {width}], "
            f"got {tuple(t.shape)} {t.dtype}"
        )
    if t.stride(1) != 1:
        raise ValueError("lora: workspace rows must be contiguous")


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


def add_lora(
    x: torch.Tensor,  # [num_tokens, in]
    out: torch.Tensor,  # [num_tokens, >= slice_offsets[-1]], updated in place
    lora: LoRAStack,
    meta: LoRAKernelMeta,
    workspace: torch.Tensor,  # [rows >= num_tokens, >= num_slices * max_rank] fp32
    config: LoRAKernelConfig | None = None,
) -> None:
    """Add every token's adapter delta, all slices of one `Linear`: on CUDA one fused Triton
    launch for up to `fused_max_tokens` tokens (and `fused_max_k` input features), else two (the shrink may split its reduction
    over the workspace's spare rows); the torch reference elsewhere."""
    check_lora_args(x, out, lora, meta, workspace)
    if x.is_cuda:
        from loraplex.kernels.triton_lora import lora_triton

        lora_triton(x, out, lora, meta, workspace, config or DEFAULT_KERNEL_CONFIG)
        return
    t = workspace[: x.shape[0]]
    lora_shrink_ref(x, lora, t, meta)
    lora_expand_ref(t, lora, out, meta)


DEFAULT_KERNEL_CONFIG = LoRAKernelConfig()
