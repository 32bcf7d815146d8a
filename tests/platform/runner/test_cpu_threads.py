"""The CPU engine's thread count: one core left to the API process, explicit choices kept."""

from __future__ import annotations

import pytest
import torch

from loraplex.platform.runner import cpu_threads
from loraplex.platform.runner.cpu_threads import configure_cpu_threads, default_cpu_threads


@pytest.fixture
def restore_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_default_leaves_one_core_and_keeps_at_least_one_thread() -> None:
    assert [default_cpu_threads(n) for n in (1, 2, 4, 64)] == [1, 1, 3, 63]


def test_loraplex_cpu_threads_wins(monkeypatch, restore_threads) -> None:
    monkeypatch.setenv("LORAPLEX_CPU_THREADS", "1")
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    assert configure_cpu_threads() == 1
    assert torch.get_num_threads() == 1


def test_omp_num_threads_or_an_earlier_set_num_threads_is_kept(
    monkeypatch, restore_threads
) -> None:
    monkeypatch.delenv("LORAPLEX_CPU_THREADS", raising=False)
    monkeypatch.setattr(cpu_threads, "usable_cores", lambda: 8)
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    torch.set_num_threads(3)
    assert configure_cpu_threads() == 3
    monkeypatch.delenv("OMP_NUM_THREADS")
    torch.set_num_threads(5)  # a runner's own choice, not torch's default of 8
    assert configure_cpu_threads() == 5 and torch.get_num_threads() == 5


def test_torch_default_is_lowered_to_one_core_less(monkeypatch, restore_threads) -> None:
    monkeypatch.delenv("LORAPLEX_CPU_THREADS", raising=False)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(cpu_threads, "usable_cores", lambda: 4)
    torch.set_num_threads(4)  # what torch starts with on a 4-core host
    assert configure_cpu_threads() == 3 and torch.get_num_threads() == 3


@pytest.mark.parametrize("value", ["0", "two", "-1"])
def test_a_bad_loraplex_cpu_threads_is_refused(monkeypatch, value: str) -> None:
    monkeypatch.setenv("LORAPLEX_CPU_THREADS", value)
    with pytest.raises(ValueError, match="LORAPLEX_CPU_THREADS"):
        configure_cpu_threads()
