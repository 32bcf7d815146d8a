"""Adapter slot memory on the host: zeros that cost memory only where an adapter is written."""

from __future__ import annotations

import os
import sys

import pytest
import torch

from loraplex.adapters.zero_pages import zeros

MIB = 2**20


def _resident_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / MIB


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/statm")
def test_slots_become_resident_as_they_are_written() -> None:
    before = _resident_mib()
    slots = zeros((8, 64 * MIB // 4), torch.float32, torch.device("cpu"))  # 8 slots of 64 MiB
    assert slots.sum().item() == 0.0  # read: still the OS's zero pages
    untouched = _resident_mib()
    slots[3].fill_(1.0)
    written = _resident_mib()
    assert untouched - before < 32
    assert 56 < written - untouched < 96
    assert slots.count_nonzero().item() == 64 * MIB // 4


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int32])
def test_zeros_are_zero_contiguous_and_writable(dtype) -> None:
    t = zeros((3, 5, 7), dtype, torch.device("cpu"))
    assert t.shape == (3, 5, 7) and t.dtype == dtype and t.is_contiguous()
    assert torch.equal(t, torch.zeros(3, 5, 7, dtype=dtype))
    t[1, 2] = 4
    assert t.sum().item() == 28
    assert zeros((0, 4), dtype, torch.device("cpu")).shape == (0, 4)
