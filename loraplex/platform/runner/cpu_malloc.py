"""glibc malloc for CPU engines: settings under which a step's activations reuse memory already
mapped, and handing freed memory back to the OS.

By default glibc serves a large request (above a threshold that starts at 128 KiB and follows the
largest block freed) with a fresh `mmap` and returns freed memory at the heap's top to the OS
past a trim threshold. A prefill step's activations are a few MiB to tens of MiB each, so a CPU
engine paid for page faults on memory it had just freed: on the 2-core host a 1024-token prefill
of the embedded model took 1.53 s with 124k page faults in its second run, and 1.28 s with ~400
once the heap keeps what it frees (a batch-8 decode step, warm, ~0 either way). So the engine
raises the mmap threshold to glibc's maximum (32 MiB on 64-bit: every activation of a
2048-token step fits under it), keeps up to 1 GiB free at the heap's top, and grows the heap by
64 MiB at a time. It costs resident memory up to the largest step's activations, kept after the
step.

Process-wide and idempotent; a no-op where the C library is not glibc. Applied by the engine-core
process of `loraplex serve`, which owns its process; an in-process engine (the offline `LLM`,
tests, Ray Serve) leaves its caller's allocator alone: threads' arenas that keep up to 1 GiB free
each grew a test process past 10 GB.

Under glibc's defaults a block above the dynamic mmap threshold is mapped and unmapped on its
own, but the threshold follows the largest mapped block freed (up to 32 MiB), so after the first
few steps a model's weights and their oneDNN-packed copies (a few MiB each) come from the heap
too. Freed, they stay in the heap (free, but resident) wherever a live block sits above them:
a process that builds engines and drops them (a test process) keeps the high-water mark of all
its engines so far. `release_free_memory` hands those pages back (`malloc_trim`).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging

logger = logging.getLogger(__name__)

# mallopt parameters (malloc.h)
M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_THRESHOLD = -1, -2, -3
SETTINGS = ((M_MMAP_THRESHOLD, 32 << 20), (M_TRIM_THRESHOLD, 1 << 30), (M_TOP_PAD, 64 << 20))


@functools.cache
def _glibc() -> ctypes.CDLL | None:
    """The C library where it is glibc, else None."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c"))
        libc.gnu_get_libc_version  # noqa: B018 (glibc only)
    except (OSError, AttributeError, TypeError):
        return None
    libc.mallopt.argtypes, libc.mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    libc.malloc_trim.argtypes, libc.malloc_trim.restype = [ctypes.c_size_t], ctypes.c_int
    return libc


@functools.cache
def configure_cpu_malloc() -> bool:
    """Apply SETTINGS through glibc's `mallopt`. -> whether every setting took"""
    libc = _glibc()
    if libc is None:
        return False
    mallopt = libc.mallopt
    done = all(mallopt(param, value) == 1 for param, value in SETTINGS)
    if not done:
        logger.info("glibc refused a malloc setting of the CPU engine; its defaults stay")
    return done


def release_free_memory() -> bool:
    """Return the pages of every free heap block to the OS (glibc's `malloc_trim(0)`; each
    arena is locked in turn, a few ms for gigabytes of heap). -> whether any memory was
    released (False where the C library is not glibc)"""
    libc = _glibc()
    return libc is not None and libc.malloc_trim(0) == 1
