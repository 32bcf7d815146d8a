"""The CPU engine's malloc settings: an activation-sized block comes from the heap, not from a
fresh mapping (which glibc's defaults give it, page faults and all, each time)."""

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
before = libc.mallinfo2().hblks
block = libc.malloc(24 << 20)  # a 2048-token step's gate-up output
print(libc.mallinfo2().hblks - before)
"""


def _mapped_blocks(configure: bool) -> int:
    done = subprocess.run([sys.executable, "-c", _MAPPED_BLOCKS, "1" if configure else "0"],
                          capture_output=True, text=True, timeout=120, check=True)  # fmt: skip
    return int(done.stdout.split()[-1])


@glibc
def test_an_activation_sized_block_comes_from_the_heap() -> None:
    assert _mapped_blocks(configure=True) == 0
    assert _mapped_blocks(configure=False) == 1  # glibc's default: a mapping of its own
