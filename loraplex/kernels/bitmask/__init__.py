"""The grammar bitmask kernel: a packed token bitmask (`types` says its layout) applied to
logits in place. The entry checks shapes, dtypes and devices, then runs the Triton kernel on
CUDA (`triton_bitmask`) and the plain-torch reference elsewhere (`reference`). Allocating and
filling masks is grammar's (`loraplex.grammar.bitmask`)."""

from __future__ import annotations

import torch

from loraplex.kernels.bitmask.reference import apply_token_bitmask_ref
from loraplex.kernels.bitmask.types import BITMASK_DTYPE, bitmask_words


def check_bitmask_args(
    logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor | None
) -> None:
    if logits.dim() != 2 or bitmask.dim() != 2:
        raise ValueError(f"logits and bitmask must be 2-D, got {logits.shape}, {bitmask.shape}")
    if bitmask.dtype != BITMASK_DTYPE:
        raise ValueError(f"bitmask must be int32, got {bitmask.dtype}")
    if bitmask.device != logits.device:
        raise ValueError(f"bitmask on {bitmask.device}, logits on {logits.device}")
    num_rows = bitmask.shape[0] if rows is None else rows.shape[0]
    if rows is not None and (rows.dim() != 1 or rows.device != logits.device):
        raise ValueError("rows_index must be a 1-D tensor on the logits' device")
    if rows is None and num_rows != logits.shape[0]:
        raise ValueError(f"bitmask has {num_rows} rows, logits {logits.shape[0]}")
    if rows is not None and num_rows != bitmask.shape[0]:
        raise ValueError(f"rows_index has {num_rows} entries, bitmask {bitmask.shape[0]} rows")


def apply_token_bitmask_(
    logits: torch.Tensor, bitmask: torch.Tensor, rows_index: torch.Tensor | None = None
) -> None:
    """Set disallowed logits to -inf in place: the Triton kernel on CUDA, torch elsewhere.

    logits: [num_seqs, vocab] (float32/bf16/fp16). bitmask: [num_masked, words] int32 on the
    logits' device. rows_index: [num_masked] int, the logits row of each bitmask row, or None.
    """
    check_bitmask_args(logits, bitmask, rows_index)
    if logits.is_cuda:
        from loraplex.kernels.bitmask.triton_bitmask import apply_token_bitmask_triton

        apply_token_bitmask_triton(logits, bitmask, rows_index)
        return
    apply_token_bitmask_ref(logits, bitmask, rows_index)


def warm_up(vocab_size: int, device: torch.device) -> int:
    """Compile the mask kernel now, as the sampler's warm-up does its kernels, so the first
    grammar request of a server does not wait for a compile (it did: 1-2 s on the H200). A
    no-op off CUDA. -> the number of kernel calls made"""
    if device.type != "cuda":
        return 0
    logits = torch.zeros(2, vocab_size, device=device)
    bitmask = torch.full((1, bitmask_words(vocab_size)), -1, dtype=BITMASK_DTYPE, device=device)
    rows = torch.ones(1, dtype=torch.int64, device=device)
    apply_token_bitmask_(logits, bitmask, rows)  # the sampler's call: masks by logits row
    torch.cuda.synchronize(device)
    return 1
