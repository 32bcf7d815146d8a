"""The CPU engine's malloc settings: an activation-sized block comes from the heap, not from a
fresh mapping (which glibc's defaults give it, page faults and all, each time); and freed heap
blocks under a live one go back to the OS when asked, not at their free."""

from __future__ import annotations

import platform
import subprocess
import sys

import pytest

glibc = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's mallopt")

# NOTE: in a fresh interpreter, where glibc's dynamic mmap threshold has not moved yet
_MAPPED_BLOCKS = """
import ctypes, sys
from loraplex.platform.runner.cpu_malloc import configure_cpu_malloc
class Info(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks",
                 "uordblks", "fordblks", "keepcost")]
libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = Info
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
if sys.argv[1] == "1":
    assert configure_cpu_malloc() and configure_cpu_malloc()  # idempotent
before = libc.mallinfo2().hblks
block = libc.malloc(24 << 20)  # a 2048-token step's gate-up output
print(libc.mallinfo2().hblks - before)
"""

# NOTE: 64 weight-sized blocks (4 MiB) from the heap, as after glibc's threshold has followed a
# freed 16 MiB block up; a small live block above them keeps the heap from shrinking at its top.
_RELEASED_MIB = """
import ctypes, os
from loraplex.platform.runner.cpu_malloc import release_free_memory
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes, libc.memset.argtypes = [ctypes.c_void_p], [ctypes.c_void_p, ctypes.c_int,
                                                                ctypes.c_size_t]
def resident_mib():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
libc.free(libc.malloc(16 << 20))
blocks = [libc.malloc(4 << 20) for _ in range(64)]
for block in blocks:
    libc.memset(block, 1, 4 << 20)
live = libc.malloc(1024)
held = resident_mib()
for block in blocks:
    libc.free(block)
freed = resident_mib()
assert release_free_memory()
print(held - freed, freed - resident_mib())
"""


def _run(script: str, *args: str) -> list[str]:
    done = subprocess.run([sys.executable, "-c", script, *args],
                          capture_output=True, text=True, timeout=120, check=True)  # fmt: skip
    return done.stdout.split()


@glibc
def test_an_activation_sized_block_comes_from_the_heap() -> None:
    assert int(_run(_MAPPED_BLOCKS, "1")[-1]) == 0
    assert int(_run(_MAPPED_BLOCKS, "0")[-1]) == 1  # glibc's default: a mapping of its own


@glibc
def test_freed_heap_blocks_stay_resident_until_released() -> None:
    at_free, at_release = (float(v) for v in _run(_RELEASED_MIB)[-2:])
    assert at_free < 32  # of 256 MiB freed
    assert at_release > 224
