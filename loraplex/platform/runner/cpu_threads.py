"""How many threads a CPU engine computes on.

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


def configure_cpu_threads() -> int:
    """Set torch's intra-op (and, where still possible, inter-op) threads for a CPU engine.
    -> the intra-op thread count in effect"""
    explicit = envs.cpu_threads()
    cores = usable_cores()
    if explicit is not None:
        threads = explicit
    elif envs.omp_num_threads_set() or torch.get_num_threads() != cores:
        # NOTE: torch's default equals the usable cores on hosts without SMT; anything else was
        # chosen by someone (or is torch's physical-core count on an SMT host): kept as it is.
        return torch.get_num_threads()
    else:
        threads = default_cpu_threads(cores)
    torch.set_num_threads(threads)
    try:
        # NOTE: the engine runs no inter-op parallel work; a second pool only adds threads. Fails
        # once any inter-op work has run in this process, which is then left as it is.
        torch.set_num_interop_threads(1)
    except RuntimeError:
        pass
    logger.info("CPU engine on %d thread(s) of %d usable core(s)", threads, cores)
    return threads
