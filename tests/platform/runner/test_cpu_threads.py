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


class _Clock:
    """Stands in for the `time` module of `cpu_threads`: wall and process-CPU seconds set by
    the test."""

    def __init__(self) -> None:
        self.wall, self.cpu = 100.0, 10.0

    def monotonic(self) -> float:
        return self.wall

    def process_time(self) -> float:
        return self.cpu


def _stat(path, ticks: dict[int, tuple[int, int]]) -> None:
    """A /proc/stat with each core's (busy, idle) ticks (user and idle columns)."""
    lines = ["cpu  0 0 0 0 0 0 0 0 0 0"]
    lines += [f"cpu{c} {busy} 0 0 {idle} 0 0 0 0 0 0" for c, (busy, idle) in ticks.items()]
    path.write_text("\n".join(lines) + "\nintr 1 2 3\n")


def test_products_borrow_the_spare_core_only_while_it_idles(tmp_path, monkeypatch):
    """The engine computes on core 1 and leaves core 0 to the API process: a product borrows core 0
    while, over the last window, it went idle (the engine's own CPU time, its helper's spinning
    included, aside), not while the API process or another program keeps it busy."""
    clock = _Clock()
    monkeypatch.setattr(cpu_threads, "time", clock)
    stat = tmp_path / "stat"
    _stat(stat, {0: (0, 0), 1: (0, 0)})
    cores = cpu_threads.SpareCores((0, 1), (1,), threads=1, stat=stat)
    try:
        assert cores.spare == 1 and cores.lent is not None and cores.lent.count == 1
        assert cores.lent.gate == cores.lendable  # asked before each shared product

        def window(core0: tuple[int, int], core1: tuple[int, int], ours: float) -> None:
            """One second of ticks (100 a core) and the engine's own CPU seconds."""
            clock.wall += 1.0
            clock.cpu += ours
            _stat(stat, {0: core0, 1: core1})

        window((5, 95), (95, 5), ours=0.95)  # one stream: the API process near idle
        assert cores.lendable()
        window((65, 135), (190, 10), ours=1.55)  # the engine's helper on core 0
        assert cores.lendable()
        window((125, 175), (285, 15), ours=0.95)  # many streams: core 0 60 % busy
        assert not cores.lendable()
        window((225, 180), (290, 110), ours=0.0)  # another program on core 0, engine idle
        assert not cores.lendable()
        window((230, 275), (295, 205), ours=0.0)  # the host idle
        assert cores.lendable()
        clock.wall += cpu_threads.WINDOW_S / 2  # too short a window: the last answer holds
        _stat(stat, {0: (330, 275), 1: (395, 205)})
        assert cores.lendable()
    finally:
        cores.close()


def test_only_a_default_one_thread_engine_lends_its_spare_core(monkeypatch, restore_threads):
    """`spare_cores` gives a lender where the engine chose its one thread on a 2-core placement
    itself, and none where the user set the threads or cores, turned lending off, or the engine
    computes on more threads (oneDNN's own parallel path there)."""
    for name in ("LORAPLEX_CPU_THREADS", "OMP_NUM_THREADS", "LORAPLEX_CPU_LEND_IDLE_CORES"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(cpu_threads, "_placement", ((0, 1), (1,), True))
    torch.set_num_threads(1)
    lender = cpu_threads.spare_cores()
    assert lender is not None and lender.spare == 1
    lender.close()
    monkeypatch.setenv("LORAPLEX_CPU_LEND_IDLE_CORES", "0")
    assert cpu_threads.spare_cores() is None
    monkeypatch.delenv("LORAPLEX_CPU_LEND_IDLE_CORES")
    monkeypatch.setattr(cpu_threads, "_placement", ((0, 1), (1,), False))  # the user's choice
    assert cpu_threads.spare_cores() is None
    monkeypatch.setattr(cpu_threads, "_placement", ((0, 1, 2, 3), None, True))
    torch.set_num_threads(3)
    assert cpu_threads.spare_cores() is None


def test_the_first_configuration_records_who_chose_the_threads(monkeypatch, restore_threads):
    """`configure_cpu_threads` records the placement lending needs: chosen by the engine by
    default, not where OMP_NUM_THREADS (the test runner's, say) set the count."""
    monkeypatch.setattr(cpu_threads, "_placement", None)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("LORAPLEX_CPU_OMP_THREADS_BIND", "nobind")
    configure_cpu_threads()
    usable, bound, chosen = cpu_threads._placement
    assert usable == tuple(sorted(os.sched_getaffinity(0))) and bound is None and not chosen
    assert cpu_threads.spare_cores() is None


@pytest.mark.parametrize("few_rows_in_c", [True, False], ids=["c", "onednn"])
def test_a_prompt_filled_with_a_lent_core_gives_the_very_same_tokens(
    model_dir, tmp_path, monkeypatch, few_rows_in_c
):
    """End to end on the embedded model: prompts whose steps borrow the spare core (forced idle
    here) share their linears with the lent thread (decode steps and 64 tokens: the few-row
    kernel where it runs, else oneDNN on two threads; 150: oneDNN on two threads) and answer
    with exactly the tokens and logprobs the engine gives on its own thread."""
    from loraplex import LLM, SamplingParams
    from loraplex.kernels import cpu_linear

    monkeypatch.setattr(cpu_linear, "few_rows_in_c", lambda: few_rows_in_c)

    llm = LLM(str(model_dir), dtype="float32", device="cpu", num_kv_blocks=64,
              enable_prefix_caching=False)  # fmt: skip
    runner = llm.engine.runner
    stat = tmp_path / "stat"
    _stat(stat, {0: (0, 0), 1: (0, 0)})
    lender = cpu_threads.SpareCores((0, 1), None, threads=1, stat=stat)
    lender.free = lambda: lender.spare  # type: ignore[method-assign]
    assert lender.lent is not None
    shares, product = [0], lender.lent.product

    def counted(*args) -> bool:
        shares[0] += 1
        return product(*args)

    lender.lent.product = counted  # type: ignore[method-assign]
    parallel, regions = lender.lent.parallel, [0]

    def counted_parallel():
        regions[0] += 1
        return parallel()

    lender.lent.parallel = counted_parallel  # type: ignore[method-assign]
    # NOTE: 64 tokens run the few-row kernel, 150 oneDNN
    prompts = [[(i * 7919) % 30000 + 100 for i in range(n)] for n in (64, 150)]
    params = SamplingParams(max_tokens=8, temperature=0, logprobs=2)

    def run() -> list:
        return [llm.generate([p], params)[0].outputs[0] for p in prompts]

    try:
        runner.spare_cores = None
        alone = run()
        runner.spare_cores = lender
        shared = run()
    finally:
        runner.spare_cores = None
        lender.close()
        llm.engine.shutdown()
    # NOTE: every decoder layer's linears were shared: the 64-token prompt's and the decode
    # steps' in C where it runs, through oneDNN on the lent thread where not; the 150-token
    # prompt's through oneDNN
    if few_rows_in_c:
        assert shares[0] >= (1 + 2 * 7) * 4 * 30 and regions[0] >= 4 * 30
    else:
        assert shares[0] == 0 and regions[0] >= 2 * 4 * 30
    for one, other in zip(shared, alone):
        assert one.token_ids == other.token_ids
        assert [{t: lp.logprob for t, lp in step.items()} for step in one.logprobs] == [
            {t: lp.logprob for t, lp in step.items()} for step in other.logprobs
        ]
