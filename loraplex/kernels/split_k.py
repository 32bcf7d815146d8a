"""Split-K for the quantized GEMMs (W4A16 and FP8): how far to split, and the persistent device
workspace the split programs reduce through (`triton_split_k.store_split_k_tile`).

The workspace is fp32 partial sums and one arrival counter per output tile, both zero between
calls (the kernel's last program of a tile zeroes them again). Buffers only grow; replaced ones
are kept alive because a captured CUDA graph may still use them. Warm a shape up before
capturing a graph so no allocation happens inside the capture.
"""

from __future__ import annotations

import torch

#: Without a device (the interpreter), an H200's count, so CPU tests split as the GPU does.
DEFAULT_SMS = 132

_SPLIT_K: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}
_RETIRED: list[torch.Tensor] = []


def num_sms(device: torch.device) -> int:
    """Multiprocessors of a CUDA device (`DEFAULT_SMS` elsewhere)."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return DEFAULT_SMS
    return torch.cuda.get_device_properties(device).multi_processor_count


def fit_split_k(tiles: int, k_blocks: int, sms: int, per_sm: float = 2) -> int:
    """The power-of-two split giving about `per_sm` programs per SM over `tiles` output tiles,
    keeping every split at least one of the `k_blocks` K blocks."""
    split = 1
    while tiles * split < per_sm * sms and split * 2 <= k_blocks:
        split *= 2
    return split


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


def retain(buffer: torch.Tensor) -> None:
    """Keep a replaced persistent buffer alive (a captured CUDA graph may still use it)."""
    _RETIRED.append(buffer)
