"""How many threads a CPU engine computes on, and on which cores.

torch starts with one intra-op thread per physical core and spins each one while it waits for
work. A 2-core host then runs the engine's two threads beside the API process and anything else
on the machine, and every thread that is preempted stalls the others at each of the ~400 small
ops of a decode step: on the 2-core test host under a load of ~10, a batch-1 step took 4.3 s on
two threads against 0.64 s on one (benchmarks/results/cpu_step_profile.json has the idle
figures). So a CPU engine leaves one core to the API process and the host (vLLM's CPU backend
likewise computes on one thread by default on small hosts), never using more threads than torch
would.

Overrides, strongest first: LORAPLEX_CPU_THREADS; OMP_NUM_THREADS (torch already honours it); a
thread count set with `torch.set_num_threads` before the engine starts, where it differs from
torch's own default (the test runner's choice, say).

Placement (LORAPLEX_CPU_OMP_THREADS_BIND, vLLM's VLLM_CPU_OMP_THREADS_BIND): `auto` binds the
compute thread(s) of an engine-core process (the server's) to the last usable cores, as many as
it computes on (core 1 of a 2-core host), leaving the first to the API process, which stays
unbound; an engine inside the caller's process (the offline `LLM`) is not bound by `auto`, so a
user's own thread is not pinned behind their back. `nobind` leaves placement to the OS; a CPU
list (`1`, `0-3,6`) binds any engine to those cores and, unless a thread count is given, computes
on one thread per listed core. On the shared 2-core host, a pinned engine core kept its
throughput when the other core was busy where an unbound one halved
(benchmarks/results/cpu_serving_bind.json).

Lending (`SpareCores`, LORAPLEX_CPU_LEND_IDLE_CORES): an engine that chose its one thread itself
lends the core it leaves over to its steps while that core is idle.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import torch

import loraplex.envs as envs
from loraplex.kernels.cpu_linear import LentThreads

logger = logging.getLogger(__name__)

#: (the cores usable before any binding, the compute thread's binding or None, whether the
#: engine chose its threads and placement itself) of the process's first
#: `configure_cpu_threads` (an engine core's own, where it has one).
_placement: tuple[tuple[int, ...], tuple[int, ...] | None, bool] | None = None


def usable_cores() -> int:
    """Cores this process may run on (its affinity mask, where the OS has one)."""
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return max(1, os.cpu_count() or 1)


def default_cpu_threads(cores: int) -> int:
    """One core left to the API process and the host, at least one thread."""
    return max(1, cores - 1)


def parse_cpu_list(text: str) -> tuple[int, ...]:
    """`0-3,6` -> (0, 1, 2, 3, 6), sorted and without repeats; ValueError for anything else."""
    cpus: set[int] = set()
    for part in text.split(","):
        first, dash, last = part.strip().partition("-")
        if not first.isdigit() or (dash and not last.isdigit()):
            raise ValueError(f"not a CPU list: {text!r} (e.g. '1' or '0-3,6')")
        low, high = int(first), int(last) if dash else int(first)
        if high < low:
            raise ValueError(f"not a CPU list: {text!r} ({part.strip()!r} runs backwards)")
        cpus.update(range(low, high + 1))
    return tuple(sorted(cpus))


def bind_cores(value: str, usable: set[int], own_process: bool) -> tuple[int, ...] | None:
    """The cores a LORAPLEX_CPU_OMP_THREADS_BIND value binds the compute threads to; None:
    unbound (`nobind`, or `auto` in the caller's process). `auto` here returns every usable
    core: `configure_cpu_threads` narrows it to the thread count."""
    if value == "nobind" or (value == "auto" and not own_process):
        return None
    if not hasattr(os, "sched_setaffinity"):
        if value == "auto":
            return None
        raise ValueError("LORAPLEX_CPU_OMP_THREADS_BIND: this OS cannot bind threads to CPUs")
    if value == "auto":
        return tuple(sorted(usable))
    if "|" in value:
        raise ValueError(
            f"LORAPLEX_CPU_OMP_THREADS_BIND={value!r}: one CPU list per tensor-parallel rank "
            "('|') is not supported; give one list, 'auto' or 'nobind'"
        )
    try:
        cores = parse_cpu_list(value)
    except ValueError as exc:
        raise ValueError(
            f"LORAPLEX_CPU_OMP_THREADS_BIND must be 'auto', 'nobind' or a CPU list: {exc}"
        ) from None
    outside = sorted(set(cores) - usable)
    if outside:
        raise ValueError(
            f"LORAPLEX_CPU_OMP_THREADS_BIND={value!r} names CPUs this process may not run on: "
            f"{outside} (usable: {sorted(usable)})"
        )
    return cores


def configure_cpu_threads(own_process: bool = False, tensor_parallel_size: int = 1) -> int:
    """Set torch's intra-op (and, where still possible, inter-op) threads for a CPU engine, and
    bind the calling thread (the one that runs the steps; threads it starts later inherit the
    binding) as LORAPLEX_CPU_OMP_THREADS_BIND says. `own_process`: the engine has a process of
    its own (the server's engine core). Idempotent. -> the intra-op thread count in effect"""
    explicit = envs.cpu_threads()
    usable = _usable_set()
    cores = usable_cores()
    value = envs.cpu_omp_threads_bind()
    bound = bind_cores(value, usable, own_process)
    if bound is not None and tensor_parallel_size > 1:
        if value != "auto":
            raise ValueError(
                "LORAPLEX_CPU_OMP_THREADS_BIND with tensor_parallel_size > 1 is not supported "
                "(every rank would share the list); use 'auto' or 'nobind'"
            )
        bound = None  # NOTE: forked ranks inherit the binding: all of them on one core
    if explicit is not None:
        threads = explicit
    elif envs.omp_num_threads_set() or torch.get_num_threads() != cores:
        # NOTE: torch's default equals the usable cores on hosts without SMT; anything else was
        # chosen by someone (or is torch's physical-core count on an SMT host): kept as it is.
        threads = torch.get_num_threads()
    elif bound is not None and value != "auto":
        threads = len(bound)
    else:
        threads = default_cpu_threads(cores)
    chosen = explicit is None and not envs.omp_num_threads_set() and value in ("auto", "nobind")
    if bound is not None:
        if value == "auto":
            bound = bound[-min(threads, len(bound)) :]
        elif threads > len(bound):
            raise ValueError(
                f"{threads} compute threads on {len(bound)} bound core(s) "
                f"(LORAPLEX_CPU_OMP_THREADS_BIND={value!r}) would "
                "oversubscribe them; bind more cores or compute on fewer threads"
            )
        if set(bound) != usable:
            os.sched_setaffinity(0, bound)
    global _placement
    if _placement is None or own_process:
        _placement = (tuple(sorted(usable)), bound, chosen and tensor_parallel_size == 1)
    torch.set_num_threads(threads)
    try:
        # NOTE: the engine runs no inter-op parallel work; a second pool only adds threads. Fails
        # once any inter-op work has run in this process, which is then left as it is.
        torch.set_num_interop_threads(1)
    except RuntimeError:
        pass
    logger.info(
        "CPU engine on %d thread(s), CPU(s) %s of %d usable before binding",
        threads,
        sorted(_usable_set()),
        cores,
    )
    return threads


def _usable_set() -> set[int]:
    if hasattr(os, "sched_getaffinity"):
        return set(os.sched_getaffinity(0))
    return set(range(usable_cores()))


#: A spare core counts as free when at least this share of it went idle over the last window,
#: the engine's own use apart.
FREE_SHARE = 0.8
#: The shortest window over which idleness is measured (/proc/stat counts in 10 ms ticks).
WINDOW_S = 0.1


class SpareCores:
    """Lends the cores a CPU engine leaves to the API process and the host (one of two on a
    2-core machine) to its steps while nothing else uses them: a step's linears then run on a
    lent thread too (`kernels.cpu_linear.lending`; the same result to the bit). The API process
    mostly idles, streaming a token per sequence a step, so its core would otherwise sit unused:
    a 64-token prompt of the embedded model took 259 ms to its first token on one thread here,
    and a decode step's weights stream in from memory faster on two cores than on one (the
    embedded model's decoder linears on the 2-core AVX2 host: 33.2 against 20.9 ms at one row,
    48.8 / 26.9 at 8, 113.8 / 60.1 at 32). Idleness is read from /proc/stat
    over the last window (at least `WINDOW_S`): the usable cores' idle share plus the engine's
    own CPU time, less its own threads; a busy API process (many streams) or another program on
    the spare core keeps the step on the engine's own thread."""

    def __init__(self, usable: tuple[int, ...], bound: tuple[int, ...] | None, threads: int,
                 stat: Path = Path("/proc/stat")) -> None:  # fmt: skip
        self.usable, self.threads, self._stat = usable, threads, stat
        self.spare = len(usable) - threads
        spare_cores = tuple(c for c in usable if c not in bound) if bound is not None else None
        self.lent = LentThreads(self.spare, spare_cores or None) if self.spare > 0 else None
        if self.lent is not None:
            self.lent.gate = self.lendable
        self._free = 0
        self._mark = self._sample()

    def _sample(self) -> tuple[float, float, dict[int, tuple[int, int]]] | None:
        """(wall clock, this process's CPU seconds, {core: (idle ticks, total ticks)})."""
        try:
            text = self._stat.read_text()
        except OSError:
            return None
        ticks: dict[int, tuple[int, int]] = {}
        for line in text.splitlines():
            name, _, rest = line.partition(" ")
            if not name.startswith("cpu") or not name[3:].isdigit():
                continue
            core = int(name[3:])
            if core in self.usable:
                fields = [int(f) for f in rest.split()[:8]]
                ticks[core] = (fields[3] + fields[4], sum(fields))  # idle + iowait, all
        return time.monotonic(), time.process_time(), ticks

    def free(self) -> int:
        """How many spare cores are free now (see the class doc), 0..spare."""
        if self.lent is None or self._mark is None:
            return 0
        now = time.monotonic()
        if now - self._mark[0] < WINDOW_S:
            return self._free
        sample = self._sample()
        if sample is None:
            return 0
        (t0, cpu0, ticks0), (t1, cpu1, ticks1) = self._mark, sample
        idle = 0.0
        for core, (idle1, total1) in ticks1.items():
            idle0, total0 = ticks0.get(core, (idle1, total1))
            idle += (idle1 - idle0) / (total1 - total0) if total1 > total0 else 1.0
        ours = (cpu1 - cpu0) / (t1 - t0)
        self._free = max(0, min(self.spare, int(idle + ours - self.threads + 1 - FREE_SHARE)))
        self._mark = sample
        return self._free

    def lendable(self) -> bool:
        """Whether a product may borrow the lent threads now: every spare core free (`free`,
        measured again at most every `WINDOW_S`). Asked product by product (`LentThreads.gate`),
        so a long step (a burst of prompts filling, while the API process took them in) starts
        sharing once the core goes idle, not only from its next step."""
        return self.lent is not None and self.free() >= self.spare

    def close(self) -> None:
        if self.lent is not None:
            self.lent.close()


def spare_cores() -> SpareCores | None:
    """The lender of this engine's idle spare cores to its steps (`SpareCores`), or None
    where there is none to lend: LORAPLEX_CPU_LEND_IDLE_CORES=0, a thread count or CPU list set
    by the user (LORAPLEX_CPU_THREADS, OMP_NUM_THREADS, LORAPLEX_CPU_OMP_THREADS_BIND), tensor
    parallelism, an engine on more than one thread or with no core left over, or no /proc/stat.
    Call after `configure_cpu_threads`."""
    if _placement is None or not envs.cpu_lend_idle_cores():
        return None
    usable, bound, chosen = _placement
    threads = torch.get_num_threads()
    # NOTE: lending widens an engine of one compute thread (the default of a 2-core host); one
    # of more threads already runs oneDNN in parallel
    if not chosen or threads != 1 or len(usable) <= threads:
        return None
    lender = SpareCores(usable, bound, threads)
    if lender._mark is None:
        lender.close()
        return None
    return lender
