"""Triton kernel applying a packed token bitmask to logits in place (`reference` says what it
computes; the entry checks the arguments)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_BLOCK = 1024


@triton.jit
def _apply_bitmask_kernel(
    logits_ptr,
    bitmask_ptr,
    rows_ptr,
    vocab_size,
    num_words,
    logits_stride,
    bitmask_stride,
    HAS_ROWS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    mask_row = tl.program_id(0)
    block = tl.program_id(1)
    if HAS_ROWS:
        logits_row = tl.load(rows_ptr + mask_row).to(tl.int64)
    else:
        logits_row = mask_row.to(tl.int64)
    tokens = block * BLOCK + tl.arange(0, BLOCK)
    in_vocab = tokens < vocab_size
    word_index = tokens // 32
    words = tl.load(
        bitmask_ptr + mask_row * bitmask_stride + word_index,
        mask=in_vocab & (word_index < num_words),
        other=0,
    )
    allowed = ((words >> (tokens % 32)) & 1) != 0
    tl.store(
        logits_ptr + logits_row * logits_stride + tokens,
        float("-inf"),
        mask=in_vocab & ~allowed,
    )


def apply_token_bitmask_triton(
    logits: torch.Tensor, bitmask: torch.Tensor, rows_index: torch.Tensor | None = None
) -> None:
    """Same contract as `apply_token_bitmask_ref`; logits rows must be contiguous."""
    if logits.stride(1) != 1 or bitmask.stride(1) != 1:
        raise ValueError("logits and bitmask rows must be contiguous")
    num_masked = bitmask.shape[0]
    if num_masked == 0:
        return
    vocab_size = logits.shape[1]
    rows = rows_index if rows_index is not None else bitmask  # unused pointer when no rows
    grid = (num_masked, triton.cdiv(vocab_size, _BLOCK))
    _apply_bitmask_kernel[grid](
        logits,
        bitmask,
        rows,
        vocab_size,
        bitmask.shape[1],
        logits.stride(0),
        bitmask.stride(0),
        HAS_ROWS=rows_index is not None,
        BLOCK=_BLOCK,
    )
