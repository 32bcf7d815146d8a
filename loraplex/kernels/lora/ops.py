"""The LoRA family's public entry: checks one application's tensors and dispatches, on CUDA to
the Triton kernel of the step's regime (`LoRAKernelConfig.regime`), elsewhere to the torch
reference; its two halves apart where they are two launches (`shrink_lora`, which reads only
the input and so may run beside the base product on another stream, and `expand_lora`); and,
for one token through a plain weight, the base GEMV with the delta in one launch
(`fused_gemv_lora`)."""

from __future__ import annotations

import torch

from loraplex.kernels.lora.reference import lora_expand_ref, lora_kernel_meta, lora_shrink_ref
from loraplex.kernels.lora.types import (
    DEFAULT_KERNEL_CONFIG,
    SYNC_COUNTERS,
    LoRAKernelConfig,
    LoRAKernelMeta,
    LoRAStack,
)


def new_counters(device: torch.device | str) -> torch.Tensor:
    """Arrival counters for the one-launch decode kernel: `[SYNC_COUNTERS]` int32 zeros. Launches
    that may run at the same time (two streams) need counters of their own."""
    return torch.zeros(SYNC_COUNTERS, dtype=torch.int32, device=device)


def fill_kernel_meta(meta: LoRAKernelMeta, num_slots: int) -> None:
    """Recompute `meta`'s order, starts and counts from its `lora_slots`, in place. On CUDA this
    is one kernel launch with no host synchronisation, so it can be captured in a CUDA graph."""
    if meta.lora_slots.is_cuda:
        from loraplex.kernels.lora.triton_meta import kernel_meta_triton

        kernel_meta_triton(meta, num_slots)
        return
    fresh = lora_kernel_meta(meta.lora_slots, num_slots)
    meta.token_order.copy_(fresh.token_order)
    meta.slot_start.copy_(fresh.slot_start)
    meta.slot_count.copy_(fresh.slot_count)


def check_lora_args(
    x: torch.Tensor,
    out: torch.Tensor | None,
    lora: LoRAStack,
    meta: LoRAKernelMeta,
    t: torch.Tensor,
) -> None:
    """Raise `ValueError` unless the tensors of one LoRA application fit together (`out`
    None: all but the output, as for a shrink alone)."""
    if x.dim() != 2 or x.shape[1] != lora.a.shape[2] or x.dtype != lora.a.dtype:
        raise ValueError(f"lora: x {tuple(x.shape)} {x.dtype} does not match A {lora.a.dtype}")
    if x.stride(1) != 1:
        raise ValueError("lora: x needs contiguous rows")
    if out is not None:
        check_lora_out(out, x.shape[0], lora)
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


def check_lora_out(out: torch.Tensor, num_tokens: int, lora: LoRAStack) -> None:
    """Raise `ValueError` unless `out` holds `num_tokens` rows of every slice's columns."""
    if out.dim() != 2 or out.shape[0] != num_tokens:
        raise ValueError(f"lora: out {tuple(out.shape)} must be 2-D with {num_tokens} rows")
    if lora.slice_offsets[-1] > out.shape[1] or out.stride(1) != 1:
        raise ValueError(
            f"lora: slices {lora.slice_offsets} outside out {tuple(out.shape)} "
            "or a non-contiguous row"
        )


def add_lora(
    x: torch.Tensor,  # [num_tokens, in]
    out: torch.Tensor,  # [num_tokens, >= slice_offsets[-1]], updated in place
    lora: LoRAStack,
    meta: LoRAKernelMeta,
    workspace: torch.Tensor,  # [rows >= num_tokens, >= num_slices * max_rank] fp32
    config: LoRAKernelConfig | None = None,
    counters: torch.Tensor | None = None,  # [SYNC_COUNTERS] int32 (`new_counters`)
) -> None:
    """Add every token's adapter delta, all slices of one `Linear`: on CUDA the Triton kernels
    (one launch for decode batches when `counters` are given, else a shrink and an expand; the
    shrink may split its reduction over the workspace's spare rows), the torch reference
    elsewhere."""
    check_lora_args(x, out, lora, meta, workspace)
    if x.is_cuda:
        lora_triton(x, out, lora, meta, workspace, config or DEFAULT_KERNEL_CONFIG, counters)
        return
    t = workspace[: x.shape[0]]
    lora_shrink_ref(x, lora, t, meta)
    lora_expand_ref(t, lora, out, meta)


def shrink_lora(
    x: torch.Tensor,  # [num_tokens, in]
    lora: LoRAStack,
    meta: LoRAKernelMeta,
    workspace: torch.Tensor,  # [rows >= num_tokens, >= num_slices * max_rank] fp32
    config: LoRAKernelConfig | None = None,
) -> int:
    """`add_lora`'s first half, as its two-launch regimes run it (`LoRAKernelConfig.regime`
    "token" or "group"; the reference off CUDA): every token's `x @ A^T` into the workspace.
    It reads only `x`, so it may run beside the base product on another stream. Returns the
    split count that `expand_lora` takes."""
    check_lora_args(x, None, lora, meta, workspace)
    num_tokens = x.shape[0]
    if not x.is_cuda:
        lora_shrink_ref(x, lora, workspace[:num_tokens], meta)
        return 1
    return _shrink_triton(x, lora, meta, workspace, config or DEFAULT_KERNEL_CONFIG)


def expand_lora(
    workspace: torch.Tensor,  # the partials `shrink_lora` wrote
    splits: int,  # what it returned
    out: torch.Tensor,  # [num_tokens, >= slice_offsets[-1]], updated in place
    lora: LoRAStack,
    meta: LoRAKernelMeta,
    config: LoRAKernelConfig | None = None,
) -> None:
    """`add_lora`'s second half after `shrink_lora` (same tokens, config and workspace): adds
    every token's delta into `out`."""
    check_lora_out(out, meta.lora_slots.shape[0], lora)
    if not out.is_cuda:
        lora_expand_ref(workspace[: out.shape[0]], lora, out, meta)
        return
    _expand_triton(workspace, splits, out, lora, meta, config or DEFAULT_KERNEL_CONFIG)


def fused_gemv_lora(
    x: torch.Tensor,  # [1, in]
    weight: torch.Tensor,  # [out, in], plain (unquantized)
    bias: torch.Tensor | None,  # [out] or None (for DoRA: the stack's base bias)
    lora: LoRAStack,
    meta: LoRAKernelMeta,
    workspace: torch.Tensor,  # [rows, >= num_slices * max_rank] fp32
    counter: torch.Tensor | None,  # [1] int32, zeroed by the caller before each launch
    config: LoRAKernelConfig | None = None,
) -> torch.Tensor | None:
    """`x @ weight^T (+ bias)` with the token's adapter delta, in one launch, where a kernel
    serves the batch: one token on CUDA through a weight with tuned tiles (the fused kernel's own,
    `FUSED_GEMV_CONFIGS`, else the plain GEMV's, `kernels.gemv.GEMV_CONFIGS`). None elsewhere:
    the caller runs its base product, then `add_lora`. `counter` is this call's own (one per
    layer), zero when the launch starts."""
    config = config or DEFAULT_KERNEL_CONFIG
    if not (config.fuse_gemv and x.is_cuda and x.dim() == 2 and x.shape[0] == 1):
        return None
    from loraplex.kernels.gemv import GEMV_CONFIGS
    from loraplex.kernels.lora.triton_gemv_lora import FUSED_GEMV_CONFIGS, gemv_lora

    shape = (weight.shape[0], weight.shape[1])
    gemv = FUSED_GEMV_CONFIGS.get(shape, GEMV_CONFIGS.get(shape))
    if (
        gemv is None
        or counter is None
        or x.dtype != weight.dtype
        or x.stride(1) != 1
        or weight.stride(1) != 1
        or (bias is not None and not bias.is_contiguous())
        or (lora.dora_scale is not None and lora.base_bias is not bias)
    ):
        return None
    out = torch.empty((1, weight.shape[0]), dtype=x.dtype, device=x.device)
    check_lora_args(x, out, lora, meta, workspace)
    return gemv_lora(x, weight, bias, lora, meta, workspace, counter, gemv, out)


def lora_triton(
    x: torch.Tensor,
    out: torch.Tensor,
    lora: LoRAStack,
    meta: LoRAKernelMeta,
    workspace: torch.Tensor,
    config: LoRAKernelConfig,
    counters: torch.Tensor | None = None,
) -> None:
    """`add_lora`'s Triton path on any device (CPU tensors run under `TRITON_INTERPRET=1`)."""
    if x.shape[0] == 0:
        return
    if config.regime(x.shape[0], counters is not None, meta.num_adapters) == "decode":
        from loraplex.kernels.lora.triton_decode import lora_decode

        assert counters is not None
        lora_decode(x, out, lora, meta, workspace, counters, config)
        return
    splits = _shrink_triton(x, lora, meta, workspace, config)
    _expand_triton(workspace, splits, out, lora, meta, config)


def _shrink_triton(
    x: torch.Tensor,
    lora: LoRAStack,
    meta: LoRAKernelMeta,
    workspace: torch.Tensor,
    config: LoRAKernelConfig,
) -> int:
    """The shrink of the step's two-launch regime; its split count."""
    if x.shape[0] == 0:
        return 0
    if config.regime(x.shape[0], False, meta.num_adapters) == "token":
        from loraplex.kernels.lora.triton_token import shrink_tokens

        return shrink_tokens(x, lora, meta, workspace, config)
    from loraplex.kernels.lora.triton_grouped import shrink_grouped

    return shrink_grouped(x, lora, meta, workspace, config)


def _expand_triton(
    workspace: torch.Tensor,
    splits: int,
    out: torch.Tensor,
    lora: LoRAStack,
    meta: LoRAKernelMeta,
    config: LoRAKernelConfig,
) -> None:
    """The expand of the step's two-launch regime over `splits` partials."""
    if out.shape[0] == 0:
        return
    if config.regime(out.shape[0], False, meta.num_adapters) == "token":
        from loraplex.kernels.lora.triton_token import expand_tokens

        expand_tokens(workspace, splits, out, lora, meta, config)
        return
    from loraplex.kernels.lora.triton_grouped import expand_grouped

    expand_grouped(workspace, splits, out, lora, meta, config)
