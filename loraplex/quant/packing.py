"""Packing small integers into int32 words: the one copy shared by AWQ, GPTQ and the quantizer.

A 4-bit format packs 8 values per int32, an 8-bit format 4. Value i of a word sits at bits
[i * bits, (i + 1) * bits). AWQ's "gemm" layout packs along the output dim and stores the 8
nibbles of a word in the order 0, 2, 4, 6, 1, 3, 5, 7 (word position p holds column
AWQ_PACK_ORDER[p]); GPTQ packs in plain order, its weight along the input dim and its zero
points along the output dim.
"""

from __future__ import annotations

import torch

#: AutoAWQ "gemm": nibble p of a word holds column AWQ_PACK_ORDER[p] of its group of 8.
AWQ_PACK_ORDER: tuple[int, ...] = (0, 2, 4, 6, 1, 3, 5, 7)

SUPPORTED_BITS = (4, 8)


def pack_factor(bits: int) -> int:
    """How many `bits`-wide values one int32 holds."""
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"only {SUPPORTED_BITS}-bit packing is supported, got {bits}")
    return 32 // bits


def pack_int32(
    values: torch.Tensor, bits: int, dim: int, order: tuple[int, ...] | None = None
) -> torch.Tensor:
    """Pack integer `values` in [0, 2**bits) along `dim` into int32 words.

    `order[p]` names which of a word's values goes to bit position p (None: plain order).
    The size of `dim` must be a multiple of the pack factor.
    """
    factor = pack_factor(bits)
    dim = dim % values.dim()
    if values.shape[dim] % factor:
        raise ValueError(
            f"cannot pack {values.shape[dim]} values along dim {dim} into words of {factor}"
        )
    if values.dtype.is_floating_point or values.dtype == torch.bool:
        raise ValueError(f"pack_int32 takes an integer tensor, got {values.dtype}")
    if values.numel() and (int(values.min()) < 0 or int(values.max()) >= 1 << bits):
        raise ValueError(f"values out of the {bits}-bit range [0, {(1 << bits) - 1}]")
    moved = values.movedim(dim, -1).to(torch.int32)
    words = moved.reshape(*moved.shape[:-1], -1, factor)  # [..., n / factor, factor]
    if order is not None:
        words = words[..., list(order)]
    packed = torch.zeros(words.shape[:-1], dtype=torch.int32, device=values.device)
    for position in range(factor):
        # NOTE: int32 shifts wrap into the sign bit, which is what the packed word wants.
        packed |= words[..., position] << (position * bits)
    return packed.movedim(-1, dim).contiguous()


def unpack_int32(
    packed: torch.Tensor, bits: int, dim: int, order: tuple[int, ...] | None = None
) -> torch.Tensor:
    """Inverse of `pack_int32`: int32 words -> int32 values in [0, 2**bits), `dim` grows by
    the pack factor."""
    factor = pack_factor(bits)
    if packed.dtype != torch.int32:
        raise ValueError(f"packed tensor must be int32, got {packed.dtype}")
    dim = dim % packed.dim()
    moved = packed.movedim(dim, -1)
    shifts = torch.arange(0, 32, bits, dtype=torch.int32, device=packed.device)
    values = (moved.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)  # [..., words, factor]
    if order is not None:
        inverse = [0] * factor
        for position, column in enumerate(order):
            inverse[column] = position
        values = values[..., inverse]
    values = values.reshape(*moved.shape[:-1], -1)
    return values.movedim(-1, dim).contiguous()
