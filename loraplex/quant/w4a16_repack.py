"""The load-time repack of AWQ and GPTQ weights into the W4A16 / W8A16 kernels' layout (defined
in `loraplex.kernels.w4a16.types`): each row of output features becomes K-contiguous words,
its values shuffled within tiles of `TILE_K` features so that a tensor-core operand is built
from whole 128-bit loads with one shift and one AND-OR per two weights."""

from __future__ import annotations

import torch

from loraplex.kernels.w4a16.types import TILE_K, padded_k, tile_features
from loraplex.quant.packing import pack_int32


def repack_w4a16(values: torch.Tensor, bits: int) -> torch.Tensor:
    """Integer weights [K, N] in [0, 2**bits) (input features in weight order) -> the kernels'
    `qweight` [N, K_pad / pack] int32 (K zero-padded to whole tiles)."""
    k, n = values.shape
    rows = torch.zeros(n, padded_k(k), dtype=torch.int32, device=values.device)
    rows[:, :k] = values.t()
    order = tile_features(bits).reshape(-1).to(values.device)  # the feature of each (slot, p)
    tiles = rows.view(n, -1, TILE_K)[:, :, order]  # [N, tiles, words * pack]
    return pack_int32(tiles.reshape(n, -1), bits, dim=1)
