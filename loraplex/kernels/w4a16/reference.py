"""Plain-torch reference of the W4A16 / W8A16 family: unpack the layout of `types`, dequantize,
multiply in fp32. Runs on any device; the CPU path of `w4a16_gemm` and the tests' truth."""

from __future__ import annotations

import torch

from loraplex.kernels.w4a16.types import TILE_K, pack_factor, tile_features, tile_words


def unpack_values(qweight: torch.Tensor, bits: int, k: int) -> torch.Tensor:
    """The integer values [K, N] (int32, input features in weight order) of `qweight`
    [N, K_pad / pack]."""
    pack, words = pack_factor(bits), tile_words(bits)
    n = qweight.shape[0]
    tiles = qweight.shape[1] // words
    shifts = torch.arange(0, 32, bits, dtype=torch.int32, device=qweight.device)
    q = qweight.view(n, tiles, words, 1) >> shifts  # [N, tiles, words, pack]
    q = (q & ((1 << bits) - 1)).reshape(n, tiles, words * pack)
    order = tile_features(bits).reshape(-1).to(qweight.device)  # feature of each (slot, p)
    values = torch.empty_like(q).index_copy_(2, order, q)  # [N, tiles, TILE_K], feature order
    return values.reshape(n, tiles * TILE_K)[:, :k].t()


def dequantize_reference(
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    group_size: int,
    bits: int,
    perm: torch.Tensor | None = None,
) -> torch.Tensor:
    """The weight [K, N] in fp32, rows in input-feature order (perm applied)."""
    groups, n = scales.shape
    k = groups * group_size
    q = unpack_values(qweight, bits, k).float().reshape(groups, group_size, n)
    w = ((q - zeros.float().unsqueeze(1)) * scales.float().unsqueeze(1)).reshape(k, n)
    if perm is None:
        return w
    return torch.empty_like(w).index_copy_(0, perm.long(), w)


def w4a16_gemm_reference(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    group_size: int,
    bits: int,
    perm: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """y = x @ dequant(W) (+ bias), computed in fp32, returned in x's dtype."""
    w = dequantize_reference(qweight, scales, zeros, group_size, bits, perm)  # [K, N]
    y = x.float() @ w
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)
