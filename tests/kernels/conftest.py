"""Fixtures shared by the kernel tests."""

from __future__ import annotations

import pytest

from loraplex.kernels import cpu_native


@pytest.fixture(params=[8, 16], ids=["lanes8", "lanes16"])
def lanes(request, monkeypatch) -> int:
    """The C kernels built for both vector widths (`cpu_native.vector_lanes`: 8 on AVX2 hosts,
    16 on AVX-512 and others) whatever this host's own, each build checked here (the other
    width runs too, only slower)."""
    cpu_native.load_library.cache_clear()
    monkeypatch.setattr(cpu_native, "vector_lanes", lambda: request.param)
    yield request.param
    cpu_native.load_library.cache_clear()
