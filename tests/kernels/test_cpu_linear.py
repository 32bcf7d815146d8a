"""The few-row CPU GEMM: F.linear's results at odd shapes, batch-independent rows, the dispatch
in `gemv.linear`, and F.linear where the kernel cannot run."""

from __future__ import annotations

import os
import shutil

import pytest
import torch
import torch.nn.functional as F

from loraplex.kernels import cpu_linear, cpu_native, gemv


def _host_runs_the_kernel() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            avx512 = "avx512f" in f.read().split()
    except OSError:
        avx512 = False
    return avx512 and shutil.which(os.environ.get("CC", "cc")) is not None


needs_kernel = pytest.mark.skipif(
    not _host_runs_the_kernel(),
    reason="needs a C compiler and an AVX-512 CPU; elsewhere gemv.linear keeps F.linear "
    "(test_without_a_compiler_linear_keeps_f_linear)",
)


@pytest.fixture
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@needs_kernel
def test_the_kernel_runs_here() -> None:
    out = cpu_linear.linear_cpu(torch.ones(4, 16), torch.ones(8, 16))
    assert out is not None and torch.equal(out, torch.full((4, 8), 16.0))


@needs_kernel
@pytest.mark.parametrize(
    "m,n,k",
    [(1, 1, 1), (3, 5, 17), (4, 4, 16), (5, 7, 33), (7, 9, 15), (9, 13, 576), (32, 30, 100)],
)
def test_matches_f_linear(m: int, n: int, k: int) -> None:
    # Odd m, n and k cover the partial tiles and the masked tail of K.
    gen = torch.Generator().manual_seed(m * n * k)
    x, w = torch.randn(m, k, generator=gen), torch.randn(n, k, generator=gen)
    out = cpu_linear.linear_cpu(x, w)
    assert out is not None and out.shape == (m, n) and out.dtype == torch.float32
    torch.testing.assert_close(out, F.linear(x, w), atol=1e-4, rtol=1e-5)


@needs_kernel
def test_a_row_is_the_same_whatever_shares_the_batch() -> None:
    gen = torch.Generator().manual_seed(1)
    x, w = torch.randn(11, 200, generator=gen), torch.randn(37, 200, generator=gen)
    full = cpu_linear.linear_cpu(x, w)
    for rows in (slice(0, 1), slice(3, 7), slice(5, 11)):
        assert torch.equal(cpu_linear.linear_cpu(x[rows], w), full[rows])


@needs_kernel
def test_strided_x_is_read_as_its_values() -> None:
    x = torch.randn(6, 64)[:, :40]  # row stride 64
    w = torch.randn(8, 40)
    torch.testing.assert_close(cpu_linear.linear_cpu(x, w), F.linear(x, w), atol=1e-4, rtol=0)


def test_bad_inputs_are_refused() -> None:
    with pytest.raises(ValueError, match="weight"):
        cpu_linear.linear_cpu(torch.zeros(4, 8), torch.zeros(3, 9))
    with pytest.raises(ValueError, match="fp32"):
        cpu_linear.linear_cpu(torch.zeros(4, 8, dtype=torch.bfloat16), torch.zeros(3, 8))
    with pytest.raises(ValueError, match="contiguous"):
        cpu_linear.linear_cpu(torch.zeros(4, 8), torch.zeros(8, 3).t())


@needs_kernel
def test_linear_takes_the_kernel_for_a_few_rows_on_one_thread(one_thread, monkeypatch) -> None:
    calls = []
    kernel = cpu_linear.linear_cpu
    monkeypatch.setattr(cpu_linear, "linear_cpu", lambda x, w: calls.append(len(x)) or kernel(x, w))
    gen = torch.Generator().manual_seed(2)
    w, b = torch.randn(24, 48, generator=gen), torch.randn(24, generator=gen)
    for m in (1, 2, 3, 4, 8, 32, 33):
        x = torch.randn(m, 48, generator=gen)
        torch.testing.assert_close(gemv.linear(x, w, b), F.linear(x, w, b), atol=1e-4, rtol=1e-5)
    assert calls == [4, 8, 32]
    torch.set_num_threads(2)  # torch's GEMM parallelises over threads; the kernel does not
    gemv.linear(torch.randn(8, 48), w, None)
    assert calls == [4, 8, 32]


def test_without_a_compiler_linear_keeps_f_linear(one_thread, monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("CC", "loraplex-no-such-compiler")
    monkeypatch.setenv("LORAPLEX_CACHE_DIR", str(tmp_path))
    cpu_native.load_library.cache_clear()
    try:
        x, w = torch.randn(8, 32), torch.randn(16, 32)
        assert cpu_linear.linear_cpu(x, w) is None
        assert torch.equal(gemv.linear(x, w, None), F.linear(x, w))
    finally:
        cpu_native.load_library.cache_clear()
