"""The LoRA kernel family's types: the stacked weights of one `Linear`, the per-step batch
metadata, and the kernel configuration (see the package doc for the math and the layout)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

#: Arrival counters of the one-launch decode kernel (tickets, finished shrinks, finished
#: expands, spare): `[SYNC_COUNTERS]` int32, zero between launches.
SYNC_COUNTERS = 4


@dataclass(frozen=True)
class LoRAKernelMeta:
    """Per-step batch metadata shared by every LoRA layer of one forward pass."""

    lora_slots: torch.Tensor  # [num_tokens] int32, -1 = base model
    token_order: torch.Tensor  # [num_tokens] int32, token indices sorted by slot (base last)
    slot_start: torch.Tensor  # [num_slots] int32, first position of each slot in token_order
    slot_count: torch.Tensor  # [num_slots] int32, tokens carrying each slot
    # NOTE: the distinct adapters the host knows the step to hold (at most; None: unknown, as
    # many as the slots), which picks the kernels' regime (`LoRAKernelConfig.regime`)
    num_adapters: int | None = None


@dataclass(frozen=True)
class LoRAKernelConfig:
    """Which Triton kernels run for how many tokens, and with which tiles (powers of two).

    Three regimes by the step's token count: up to `decode_max_tokens` one launch per `Linear`
    (the decode kernel, needs sync counters), up to `token_kernels_max_tokens` the per-token
    shrink + expand pair, beyond it the grouped pair with `group_block_m` tokens of one slot per
    program. One token through a plain weight with a tuned GEMV skips them all when `fuse_gemv`
    (the GEMV carries the adapter). Reduction splits and expand chunks are run-time values and
    the constexprs depend on the shapes and the regime only, so a step of a new size never
    compiles a kernel."""

    # NOTE: picked by the H200 runs of benchmarks.lora_kernels (results/h200_lora_kernels.json):
    # the one-launch decode kernel adds the least to a layer at one token where no GEMV carries
    # the adapter; from 8 tokens on the per-token pair wins (35 against 49-53 us a layer at 8
    # adapters), at 64 tokens (60 / 84 against 72 / 163 us at 8 / 64 adapters) and at 128 on 64
    # adapters (122 against 156; on 1 and 8 adapters the grouped pair is faster there, 67 / 71
    # against 90 / 100); at 256 the grouped pair wins (81 / 85 / 139 against 153 / 178 / 198 us
    # at 1 / 8 / 64 adapters), and at 2,048 and 8,192 tokens it beat 64-row prefill tiles (346
    # against 419 us, 824 against 1,126), so it serves every larger step. Expands that loop over
    # column tiles until about 256 programs remain beat one tile per program (139 against 218 us
    # at 256 tokens on 64 adapters, 832 against 1,528 at 8,192) and 1,024 programs (175, 837).
    decode_max_tokens: int = 1
    fuse_gemv: bool = True  # one token through a plain weight: the base GEMV carries the LoRA
    decode_pdl: bool = True  # launch it as a programmatic dependent of the base GEMM (sm90)
    decode_block_k: int = 256  # shrink: input features per load
    decode_k_per_split: int = 256  # shrink: input features per work item (a multiple of the above)
    decode_block_n: int = 256  # expand: columns per work item
    token_kernels_max_tokens: int = 128
    # NOTE: a step of group_min_tokens to token_kernels_max_tokens tokens with at least
    # group_tokens_per_adapter tokens per distinct adapter takes the grouped pair: at 96 and 128
    # tokens on 8 adapters 66 / 69 against 86 / 102 us a layer, while at 64 tokens on 8 adapters
    # (60.7 against 67.0) and at 96 / 128 tokens on 64 (110 / 125 against 161 / 160) the
    # per-token pair stays ahead (results/h200_lora_regimes.json)
    group_min_tokens: int = 96
    group_tokens_per_adapter: int = 12
    token_k_per_split: int = 512
    target_programs: int = 512  # grouped shrink: split the reduction until about this many programs
    max_splits: int = 32
    shrink_block_k: int = 128
    expand_block_n: int = 256  # columns per program of the per-token expand
    group_block_m: int = 16  # tokens per program of the grouped kernels
    group_block_n: int = 128
    expand_programs: int = 256  # expands: loop over column tiles until about this many programs
    expand_max_tiles: int = 16  # most column tiles one expand program loops over
    # NOTE: up to this many tokens a two-launch step runs its shrink on a side stream beside the
    # base product (`LoRABatchMeta.side_stream`), which it needs not wait for; 0: never. On the
    # H200 (results/h200_lora_side_stream.json) it took 6 / 8 / 11 / 10 us off a layer's LoRA at
    # 8 / 64 tokens on 8 adapters / 64 on 64 / 128 on 64; at 256 tokens it added 1-2.5 us (the
    # base GEMM fills the GPU), at 2,048 and 8,192 tokens 21 and 47 us.
    overlap_max_tokens: int = 128

    def __post_init__(self) -> None:
        for name in ("decode_block_k", "decode_block_n", "shrink_block_k", "expand_block_n",
                     "group_block_m", "group_block_n"):  # fmt: skip
            value = getattr(self, name)
            if value < 16 or value & (value - 1):
                raise ValueError(f"LoRAKernelConfig.{name} must be a power of two >= 16")
        if self.decode_k_per_split % self.decode_block_k:
            raise ValueError("LoRAKernelConfig.decode_k_per_split must divide by decode_block_k")
        for name in ("max_splits", "target_programs", "token_k_per_split", "expand_max_tiles",
                     "group_tokens_per_adapter"):  # fmt: skip
            if getattr(self, name) < 1:
                raise ValueError(f"LoRAKernelConfig.{name} must be >= 1")
        limits = (self.decode_max_tokens, self.token_kernels_max_tokens, self.expand_programs,
                  self.overlap_max_tokens, self.group_min_tokens)  # fmt: skip
        if min(limits) < 0:
            raise ValueError("LoRAKernelConfig: token limits and expand_programs must be >= 0")

    def overlaps(self, num_tokens: int, has_counters: bool) -> bool:
        """Whether a step of `num_tokens` runs its shrink beside the base product (two launches
        within `overlap_max_tokens`)."""
        two_launches = self.regime(num_tokens, has_counters) != "decode"
        return two_launches and 0 < num_tokens <= self.overlap_max_tokens

    def regime(self, num_tokens: int, has_counters: bool, num_adapters: int | None = None) -> str:
        """ "decode", "token" or "group" for a step of `num_tokens` tokens on at most
        `num_adapters` distinct adapters (None: unknown)."""
        if has_counters and num_tokens <= self.decode_max_tokens:
            return "decode"
        if num_tokens <= self.token_kernels_max_tokens and not self.few_adapters(
            num_tokens, num_adapters
        ):
            return "token"
        return "group"

    def few_adapters(self, num_tokens: int, num_adapters: int | None) -> bool:
        """Whether a step of `num_tokens` tokens is on few enough adapters for the grouped pair
        where many would take the per-token one (see `group_min_tokens`)."""
        return (
            num_adapters is not None
            and max(self.group_min_tokens, self.decode_max_tokens + 1)
            <= num_tokens
            <= self.token_kernels_max_tokens
            and num_adapters * self.group_tokens_per_adapter <= num_tokens
        )


DEFAULT_KERNEL_CONFIG = LoRAKernelConfig()


@dataclass(frozen=True)
class LoRAStack:
    """One `Linear`'s adapter weights for every slot, its slices stacked (see the package doc)."""

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
