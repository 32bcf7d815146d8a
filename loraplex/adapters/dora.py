"""DoRA (weight-decomposed LoRA) as a per-output-column scale, computed once per adapter load.

PEFT's DoRA layer outputs `m / ||W + s B A||_row * (x W^T + s x A^T B^T)` plus the base bias,
where `m` is the adapter's `lora_magnitude_vector` and the norm is taken over each output
feature's row of the adapted weight (PEFT: `torch.linalg.norm(W + s * B @ A, dim=1)`, with the
norm detached). So the adapter only rescales each output column of the LoRA layer's result:
the LoRA kernels apply `g = m / norm` per slot and column (see `loraplex.kernels.lora`).

The norm needs the base weight, but never a per-adapter copy of it:
`||W_i + s (BA)_i||^2 = ||W_i||^2 + 2 s B_i . (A W^T)_i + s^2 B_i (A A^T) B_i^T`, where
`||W_i||^2` is computed once per layer (from the dequantized weight for a quantized base) and
`A W^T` is the base layer's own forward pass over the `rank` rows of `A`.
"""

from __future__ import annotations

import torch


def row_sq_norms(weight: torch.Tensor, chunk_rows: int = 4096) -> torch.Tensor:
    """`||W_i||^2` of every output row, fp32, a chunk of rows at a time.
    [out, in] -> [out]"""
    out = torch.empty(weight.shape[0], dtype=torch.float32, device=weight.device)
    for lo in range(0, weight.shape[0], chunk_rows):
        rows = weight[lo : lo + chunk_rows].float()
        out[lo : lo + chunk_rows] = (rows * rows).sum(dim=1)
    return out


def dora_column_scale(
    w_sq: torch.Tensor,  # [out] fp32, ||W_i||^2
    a_w: torch.Tensor,  # [rank, out], A @ W^T (the base layer applied to A's rows)
    a: torch.Tensor,  # [rank, in]
    b: torch.Tensor,  # [out, rank]
    scaling: float,
    magnitude: torch.Tensor,  # [out]
) -> torch.Tensor:  # [out] fp32
    """PEFT's `magnitude / ||W + scaling * B A||` per output feature, without forming `W + BA`."""
    a32, b32 = a.float(), b.float()
    cross = (b32 * a_w.float().T).sum(dim=1)  # [out], B_i . (A W^T)_i
    gram = a32 @ a32.T  # [rank, rank]
    lora_sq = ((b32 @ gram) * b32).sum(dim=1)  # [out], ||(B A)_i||^2
    norm_sq = w_sq + 2.0 * scaling * cross + scaling * scaling * lora_sq
    return magnitude.float() / norm_sq.clamp_min(0.0).sqrt()
