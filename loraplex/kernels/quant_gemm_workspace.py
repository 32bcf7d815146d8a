"""Persistent device buffers of the quantized GEMM, allocated on first use and kept.

- the split-K workspace: fp32 partial sums and one arrival counter per output tile, both zero
  between calls (the kernel's last program of a tile zeroes them again);
- the dequant buffer: one column chunk of a dequantized weight, reused chunk after chunk and
  layer after layer so it stays in L2.

Buffers only grow; replaced ones are kept alive because a captured CUDA graph may still use
them. Warm a shape up before capturing a graph so no allocation happens inside the capture.
"""

from __future__ import annotations

import torch

_SPLIT_K: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}
_DEQUANT: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}
_RETIRED: list[torch.Tensor] = []


def split_k_workspace(
    device: torch.device, numel: int, tiles: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Zeroed fp32 [>= numel] partials and int32 [>= tiles] counters on `device`."""
    ws, locks = _SPLIT_K.get(device, (None, None))
    if ws is None or locks is None or ws.numel() < numel or locks.numel() < tiles:
        if ws is not None and locks is not None:
            _RETIRED.extend((ws, locks))
        ws = torch.zeros(max(numel, 1 << 20), dtype=torch.float32, device=device)
        locks = torch.zeros(max(tiles, 1 << 14), dtype=torch.int32, device=device)
        _SPLIT_K[device] = (ws, locks)
    return ws, locks


def dequant_buffer(device: torch.device, numel: int, dtype: torch.dtype) -> torch.Tensor:
    """A flat [>= numel] buffer of `dtype` for one dequantized column chunk."""
    buf = _DEQUANT.get((device, dtype))
    if buf is None or buf.numel() < numel:
        if buf is not None:
            _RETIRED.append(buf)
        buf = torch.empty(numel, dtype=dtype, device=device)
        _DEQUANT[(device, dtype)] = buf
    return buf
