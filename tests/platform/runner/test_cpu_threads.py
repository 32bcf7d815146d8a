"""The CPU engine's thread count (one core left to the API process, explicit choices kept) and
where its threads run (LORAPLEX_CPU_OMP_THREADS_BIND, read back from the OS)."""

from __future__ import annotations

import multiprocessing
import os
import threading

import pytest
import torch

from loraplex.config import EngineConfig, ModelConfig
from loraplex.platform.engine.core_client import default_address
from loraplex.platform.engine.core_process import STARTUP_REFUSED_EXIT, run_engine_core
from loraplex.platform.runner import cpu_threads
from loraplex.platform.runner.cpu_threads import (
    configure_cpu_threads,
    default_cpu_threads,
    parse_cpu_list,
)


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


# -- placement: LORAPLEX_CPU_OMP_THREADS_BIND -----------------------------------------------


@pytest.fixture
def restore_affinity(restore_threads):
    before = os.sched_getaffinity(0)
    yield
    os.sched_setaffinity(0, before)


def _affinity_of_a_new_thread() -> set[int]:
    seen: list[set[int]] = []
    thread = threading.Thread(target=lambda: seen.append(os.sched_getaffinity(0)))
    thread.start()
    thread.join()
    return seen[0]


@pytest.mark.parametrize(
    ("text", "cpus"),
    [("1", (1,)), ("0-3,6", (0, 1, 2, 3, 6)), (" 2 , 0,2", (0, 2)), ("4-4", (4,))],
)
def test_cpu_lists_parse(text: str, cpus: tuple[int, ...]) -> None:
    assert parse_cpu_list(text) == cpus


@pytest.mark.parametrize("text", ["", "a", "3-1", "1-", "-1", "1,,2", "0x1", "1.5"])
def test_a_bad_cpu_list_is_refused(text: str) -> None:
    with pytest.raises(ValueError, match="CPU list"):
        parse_cpu_list(text)


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("sometimes", "must be 'auto', 'nobind' or a CPU list"),
        ("0|1", "per tensor-parallel rank"),
        ("4096", r"may not run on: \[4096\]"),
    ],
)
def test_a_bad_binding_is_refused_before_anything_is_bound(
    monkeypatch, restore_affinity, value: str, message: str
) -> None:
    before = os.sched_getaffinity(0)
    monkeypatch.setenv("LORAPLEX_CPU_OMP_THREADS_BIND", value)
    with pytest.raises(ValueError, match=message):
        configure_cpu_threads(own_process=True)
    assert os.sched_getaffinity(0) == before


def test_a_cpu_list_binds_the_step_thread_and_the_threads_it_starts(
    monkeypatch, restore_affinity
) -> None:
    core = max(os.sched_getaffinity(0))
    monkeypatch.delenv("LORAPLEX_CPU_THREADS", raising=False)
    monkeypatch.setenv("LORAPLEX_CPU_OMP_THREADS_BIND", str(core))
    assert configure_cpu_threads() == 1  # one listed core: one thread, even offline
    assert os.sched_getaffinity(0) == {core}
    assert _affinity_of_a_new_thread() == {core}
    assert configure_cpu_threads() == 1 and os.sched_getaffinity(0) == {core}  # idempotent


def test_more_threads_than_bound_cores_is_refused(monkeypatch, restore_affinity) -> None:
    monkeypatch.setenv("LORAPLEX_CPU_OMP_THREADS_BIND", str(max(os.sched_getaffinity(0))))
    monkeypatch.setenv("LORAPLEX_CPU_THREADS", "2")
    with pytest.raises(ValueError, match="oversubscribe"):
        configure_cpu_threads()


@pytest.mark.skipif(
    len(os.sched_getaffinity(0)) < 2, reason="auto leaves a core to the API: needs two cores"
)
def test_auto_binds_an_engine_core_to_the_last_cores_and_leaves_the_caller_alone(
    monkeypatch, restore_affinity
) -> None:
    usable = sorted(os.sched_getaffinity(0))
    for name in ("LORAPLEX_CPU_THREADS", "OMP_NUM_THREADS", "LORAPLEX_CPU_OMP_THREADS_BIND"):
        monkeypatch.delenv(name, raising=False)  # unset: auto
    torch.set_num_threads(len(usable))  # torch's own default
    configure_cpu_threads()  # the offline LLM, in the caller's process
    assert os.sched_getaffinity(0) == set(usable)
    torch.set_num_threads(len(usable))
    threads = configure_cpu_threads(own_process=True)
    assert threads == len(usable) - 1
    assert os.sched_getaffinity(0) == set(usable[-threads:])
    assert usable[0] not in _affinity_of_a_new_thread()


def test_nobind_and_tensor_parallel_auto_leave_placement_to_the_os(
    monkeypatch, restore_affinity
) -> None:
    before = os.sched_getaffinity(0)
    monkeypatch.setenv("LORAPLEX_CPU_OMP_THREADS_BIND", "nobind")
    configure_cpu_threads(own_process=True)
    assert os.sched_getaffinity(0) == before
    monkeypatch.setenv("LORAPLEX_CPU_OMP_THREADS_BIND", "auto")
    configure_cpu_threads(own_process=True, tensor_parallel_size=2)
    assert os.sched_getaffinity(0) == before
    monkeypatch.setenv("LORAPLEX_CPU_OMP_THREADS_BIND", str(max(before)))
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        configure_cpu_threads(own_process=True, tensor_parallel_size=2)


def test_a_server_with_a_bad_binding_refuses_to_start_with_the_reason(monkeypatch) -> None:
    """`loraplex serve` prints the refusal and exits 2 (the launcher's path), no traceback."""
    monkeypatch.setenv("LORAPLEX_CPU_OMP_THREADS_BIND", "0-")
    context = multiprocessing.get_context("spawn")
    refusals, writer = context.Pipe(duplex=False)
    config = EngineConfig(model=ModelConfig(device="cpu"))
    process = context.Process(target=run_engine_core, args=(config, default_address(), writer))
    process.start()
    writer.close()
    process.join(120)
    assert process.exitcode == STARTUP_REFUSED_EXIT
    assert "LORAPLEX_CPU_OMP_THREADS_BIND" in refusals.recv()
