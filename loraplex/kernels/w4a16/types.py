"""Types of the W4A16 / W8A16 family: the packed weight layout and one launch configuration.

The layout (built at load by `loraplex.quant.w4a16_repack`, read by every kernel here):
- `qweight` [N, K_pad / pack] int32, one row of words per output feature, K padded to a multiple
  of `TILE_K` (the padding holds zero values, its activations are masked to zero);
- `scales` [G, N] and `zeros` [G, N] (zero points as floats) with G = K / group_size;
  weight[n, k] = (q[n, k] - zeros[k // group_size, n]) * scales[k // group_size, n];
- `perm` [K] int32 or None: act-order. Weight feature k multiplies input feature perm[k]; the
  load sorted the features by group so groups are contiguous again.

Within each tile of `TILE_K` features of a row, word slot s holds at value position p (bits
[p * bits, (p + 1) * bits)) the feature `tile_features(bits)[s, p]`, chosen for the tensor-core
operand a kernel builds in registers (`triton_mma`):
- value positions p and p + pack / 2 hold two adjacent features 2j, 2j + 1: one shift and one
  AND of a word leave them in the low and high 16 bits, i.e. one bf16x2 / fp16x2 register of
  the MMA operand (with the magic-number OR, the values themselves);
- position pair p covers the features [p * depth, (p + 1) * depth) of the tile, depth =
  TILE_K / (pack / 2): each pair is one dot of depth `depth` over a contiguous slice of x;
- the word of operand column j = 2 * kw + h sits in slot (kw % 4) * (words / 4) + kw // 4, so
  the words one thread of an MMA fragment needs for its row (kw = c, c + 4, c + 8, ...: lane
  c of 4 holds operand columns 2c, 2c + 1, 2c + 8, 2c + 9 of each 16) are adjacent in memory:
  one 128-bit load per thread and row at 4 bits.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

#: Features per layout tile (one K step of the fused kernel).
TILE_K = 128

#: Lanes of an MMA fragment that share one row along K (mma.sync and wgmma alike).
FRAGMENT_LANES = 4

SUPPORTED_BITS = (4, 8)

#: "mma": the fused tensor-core kernel (`triton_mma`), exact integer operands, each group's fp32
#: partial scaled; "mma_wscale": the same with the scale applied to the operand in x's dtype (one
#: accumulator: the large-tile form); "dequant": dequantize to x's dtype once per call and run
#: cuBLAS (`triton_dequant`).
MMA_KINDS = ("mma", "mma_wscale")
KINDS = (*MMA_KINDS, "dequant")


def pack_factor(bits: int) -> int:
    """Values per int32 word."""
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"bits must be 4 or 8, got {bits}")
    return 32 // bits


def tile_words(bits: int) -> int:
    """Words per row and layout tile."""
    return TILE_K // pack_factor(bits)


def pair_depth(bits: int) -> int:
    """Features of one position pair's dot (2 per word)."""
    return 2 * tile_words(bits)


def padded_k(k: int) -> int:
    """K rounded up to whole layout tiles."""
    return -(-k // TILE_K) * TILE_K


def tile_features(bits: int) -> torch.Tensor:
    """[words, pack] int64: the feature (within its tile) at value position p of word slot s."""
    pack = pack_factor(bits)
    words, half = tile_words(bits), pack // 2
    per_lane = words // FRAGMENT_LANES
    slot = torch.arange(words)[:, None]  # [words, 1]
    position = torch.arange(pack)[None, :]  # [1, pack]
    kw = (slot % per_lane) * FRAGMENT_LANES + slot // per_lane
    return pair_depth(bits) * (position % half) + 2 * kw + position // half


def scale_dots(group_size: int, k: int, bits: int) -> int:
    """Position-pair dots per scale of the fused kernel: the dots of a tile are summed and
    scaled in runs that never cross a group. 0: no run fits (the group is not a multiple of a
    dot's depth), the fused kernel cannot take this weight."""
    half = pack_factor(bits) // 2
    if group_size >= k:
        return half  # one group: any run fits
    run = math.gcd(group_size, TILE_K)
    depth = pair_depth(bits)
    return run // depth if run % depth == 0 else 0


@dataclass(frozen=True)
class W4A16Config:
    """One launch. "mma*": `block_m` tokens x `block_n` weight rows per program (the weight on
    the MMA's M side), split-K over `split_k` programs (0: fitted to the SM count), warps and
    software-pipeline stages, and whether each tile's scales and zero points are loaded one
    tile ahead (`prefetch`; groups of 128 features or more). "dequant": `block_n` rows per
    program of the dequantization."""

    kind: str
    block_m: int
    block_n: int
    split_k: int
    num_warps: int
    num_stages: int
    prefetch: bool = False

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {self.kind!r}")
        for name in ("block_m", "block_n"):
            value = getattr(self, name)
            if value < 16 or value & (value - 1):
                raise ValueError(f"{name} must be a power of two >= 16, got {value}")
        if self.split_k < 0 or self.num_warps < 1 or self.num_stages < 1:
            raise ValueError(f"bad split_k / num_warps / num_stages in {self}")
