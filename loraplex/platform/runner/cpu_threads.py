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
"""

from __future__ import annotations

import logging
import os

import torch

import loraplex.envs as envs

logger = logging.getLogger(__name__)


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
