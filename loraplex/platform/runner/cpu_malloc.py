"""glibc malloc settings for a CPU engine: a step's activations reuse memory already mapped.

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
def configure_cpu_malloc() -> bool:
    """Apply SETTINGS through glibc's `mallopt`. -> whether every setting took"""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
        libc.gnu_get_libc_version  # noqa: B018 (glibc only)
    except (OSError, AttributeError, TypeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    done = all(mallopt(param, value) == 1 for param, value in SETTINGS)
    if not done:
        logger.info("glibc refused a malloc setting of the CPU engine; its defaults stay")
    return done
