"""Packed token bitmasks: allocate them on the CPU, apply them to logits on any device.

A bitmask is `[num_rows, ceil(vocab_size / 32)]` int32; bit `t % 32` of word `t // 32` set means
token `t` is allowed. Logits columns past the mask's width are disallowed.
"""

from __future__ import annotations

import numpy as np
import torch


def bitmask_words(vocab_size: int) -> int:
    """int32 words a packed mask of `vocab_size` tokens needs."""
    return (vocab_size + 31) // 32


def allocate_token_bitmask(
    num_rows: int, vocab_size: int, pin_memory: bool = False
) -> torch.Tensor:
    """A CPU bitmask with every token allowed. # [num_rows, ceil(vocab_size / 32)] int32

    `pin_memory=True` (on CUDA machines) lets the copy to the device run asynchronously.
    """
    if num_rows < 0 or vocab_size <= 0:
        raise ValueError(f"need num_rows >= 0 and vocab_size > 0, got {num_rows}, {vocab_size}")
    return torch.full(
        (num_rows, bitmask_words(vocab_size)), -1, dtype=torch.int32, pin_memory=pin_memory
    )


def bitmask_array(bitmask: torch.Tensor) -> np.ndarray:
    """The numpy view (shared memory) of a CPU bitmask, for fast row writes."""
    if bitmask.dtype != torch.int32 or bitmask.dim() != 2 or bitmask.device.type != "cpu":
        raise ValueError(
            f"bitmask must be a 2-D int32 CPU tensor, got {bitmask.dtype} "
            f"{tuple(bitmask.shape)} on {bitmask.device}"
        )
    return bitmask.numpy()


def check_bitmask_args(
    logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor | None
) -> None:
    if logits.dim() != 2 or bitmask.dim() != 2:
        raise ValueError(f"logits and bitmask must be 2-D, got {logits.shape}, {bitmask.shape}")
    if bitmask.dtype != torch.int32:
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


def unpack_bitmask(bitmask: torch.Tensor, width: int) -> torch.Tensor:
    """Booleans, True where allowed. bitmask [rows, words] int32 -> [rows, width] bool"""
    if bitmask.device.type == "cpu":
        # NOTE: numpy's unpackbits is ~20x faster than shifting on the CPU; same bit order.
        packed = bitmask.contiguous().numpy().view(np.uint8)  # [rows, words * 4]
        bits = np.unpackbits(packed, axis=1, bitorder="little")  # [rows, words * 32]
        allowed = torch.from_numpy(bits.view(np.bool_))
    else:
        shifts = torch.arange(32, device=bitmask.device, dtype=torch.int32)  # [32]
        bits = (bitmask.unsqueeze(-1) >> shifts) & 1  # [rows, words, 32]
        allowed = bits.flatten(1).bool()  # [rows, words * 32]
    if allowed.shape[1] >= width:
        return allowed[:, :width]
    pad = torch.zeros(
        allowed.shape[0], width - allowed.shape[1], dtype=torch.bool, device=allowed.device
    )
    return torch.cat([allowed, pad], dim=1)


def apply_token_bitmask_ref(
    logits: torch.Tensor, bitmask: torch.Tensor, rows_index: torch.Tensor | None = None
) -> None:
    """Set disallowed logits to -inf in place (plain torch; CPU and CUDA).

    logits: [num_seqs, vocab]. bitmask: [num_masked, words]. rows_index: [num_masked] int64,
    the logits row of each bitmask row (None: bitmask row i masks logits row i).
    """
    check_bitmask_args(logits, bitmask, rows_index)
    allowed = unpack_bitmask(bitmask, logits.shape[1])  # [num_masked, vocab]
    if rows_index is None:
        logits.masked_fill_(~allowed, float("-inf"))
        return
    masked = logits.index_select(0, rows_index).masked_fill_(~allowed, float("-inf"))
    logits.index_copy_(0, rows_index, masked)


def apply_token_bitmask_(
    logits: torch.Tensor, bitmask: torch.Tensor, rows_index: torch.Tensor | None = None
) -> None:
    """Set disallowed logits to -inf in place: the Triton kernel on CUDA, torch elsewhere.

    logits: [num_seqs, vocab] (float32/bf16/fp16). bitmask: [num_masked, words] int32 on the
    logits' device. rows_index: [num_masked] int, the logits row of each bitmask row, or None.
    """
    if logits.is_cuda:
        from loraplex.grammar.bitmask_kernel import apply_token_bitmask_triton

        apply_token_bitmask_triton(logits, bitmask, rows_index)
        return
    apply_token_bitmask_ref(logits, bitmask, rows_index)


def warm_up_bitmask(vocab_size: int, device: torch.device) -> int:
    """Compile the mask kernel now, as the sampler's warm-up does its kernels, so the first
    grammar request of a server does not wait for a compile (it did: 1-2 s on the H200). A
    no-op off CUDA. -> the number of kernel calls made"""
    if device.type != "cuda":
        return 0
    logits = torch.zeros(2, vocab_size, device=device)
    bitmask = allocate_token_bitmask(1, vocab_size).to(device)
    rows = torch.ones(1, dtype=torch.int64, device=device)
    apply_token_bitmask_(logits, bitmask, rows)  # the sampler's call: masks by logits row
    torch.cuda.synchronize(device)
    return 1
