"""C kernels for the CPU engine: compiled once per host, loaded through ctypes.

Where plain torch spends a step in many small passes through memory (Philox noise, the rotary
embedding and KV write, RMSNorm, paged attention) or a library call costs more than the work
(oneDNN's for one row), a short C function does the work in one pass. Each kernel module holds
its C source; `load_library` compiles it with the host's C compiler (`CC`, else `cc`) into
`<cache_dir>/cpu_kernels/<name>-<machine>-<hash>.so` on first use (atomically, so concurrent
processes never clash), and later processes load the cached file without a compiler. Each flag
set is tried in turn; where none builds or loads, it returns None and the caller keeps its torch
path (logged once per kernel).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

import loraplex.envs as envs

logger = logging.getLogger(__name__)

#: (function name, argument types, return type) of each exported function
Signature = tuple[str, tuple[type, ...], type | None]


#: C shared by the vectorised kernels: CLONES (one build dispatching to AVX-512, AVX2 or plain
#: code at load, GCC on x86-64), 16 / 8 / 4-float vectors read unaligned, `vec` (a vector of
#: LANES floats, the host's width: `vector_lanes`), `hsum` (a fixed tree) and `dot`.
VECTOR_PRELUDE = r"""
#include <stdint.h>
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define CLONES __attribute__((target_clones("avx512f", "avx2,fma", "default")))
#else
#define CLONES
#endif
#define INLINE static inline __attribute__((always_inline))
#ifndef LANES
#define LANES 16
#endif

typedef float v16 __attribute__((vector_size(64), aligned(4)));
typedef float v8 __attribute__((vector_size(32), aligned(4)));
typedef float v4 __attribute__((vector_size(16), aligned(4)));
typedef float vec __attribute__((vector_size(LANES * 4), aligned(4)));
typedef int32_t ivec __attribute__((vector_size(LANES * 4), aligned(4)));

INLINE float hsum(vec a) {
#if LANES == 16
  v8 b = __builtin_shufflevector(a, a, 0, 1, 2, 3, 4, 5, 6, 7) +
         __builtin_shufflevector(a, a, 8, 9, 10, 11, 12, 13, 14, 15);
#else
  v8 b = a;
#endif
  v4 c = __builtin_shufflevector(b, b, 0, 1, 2, 3) + __builtin_shufflevector(b, b, 4, 5, 6, 7);
  return (c[0] + c[2]) + (c[1] + c[3]);
}

/* a . b over n floats: LANES lanes, their hsum, then the tail */
INLINE float dot(const float *a, const float *b, int64_t n) {
  vec acc = {0};
  int64_t d = 0;
  for (; d + LANES <= n; d += LANES) acc += *(const vec *)(a + d) * *(const vec *)(b + d);
  float s = hsum(acc);
  for (; d < n; d++) s += a[d] * b[d];
  return s;
}
"""


def _compile(compiler: str, source: str, flag_sets: tuple[tuple[str, ...], ...],
             target: Path) -> bool:  # fmt: skip
    """Compile `source` into the shared library `target`. -> whether a flag set worked"""
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        src = Path(tmp) / "kernel.c"
        src.write_text(source)
        built = Path(tmp) / target.name
        for flags in flag_sets:
            cmd = [compiler, *flags, "-shared", "-fPIC", "-o", str(built), str(src)]
            try:
                done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
            except (OSError, subprocess.TimeoutExpired) as exc:
                logger.warning("CPU kernel %s: %s failed: %s", target.name, compiler, exc)
                return False
            if done.returncode == 0:
                os.replace(built, target)  # NOTE: atomic: a concurrent builder never clashes
                return True
            logger.debug("CPU kernel %s: %s %s: %s", target.name, compiler, flags,
                         done.stderr[-400:])  # fmt: skip
    return False


@functools.cache
def vector_lanes() -> int:
    """The vector width, in floats, the kernels are built for on this host (LANES in
    VECTOR_PRELUDE): 8 on x86-64 without AVX-512, where GCC keeps 16-float vectors on the stack
    (an AVX2 Zen 3 host ran the 16-lane paged attention 4.6x slower: 1.41 against 0.31 ms at 32
    sequences of 48 positions), else 16 (AVX-512's registers; other machines as before)."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return 16
    return 16 if torch.backends.cpu.get_cpu_capability().startswith("AVX512") else 8


@functools.cache
def load_library(
    name: str,
    source: str,
    flag_sets: tuple[tuple[str, ...], ...],
    signatures: tuple[Signature, ...],
) -> ctypes.CDLL | None:
    """The compiled `source` (built on first use, with LANES set to `vector_lanes()`), or None
    where it cannot be built or loaded."""
    flag_sets = tuple((*flags, f"-DLANES={vector_lanes()}") for flags in flag_sets)
    key = hashlib.sha256(f"{source}{flag_sets}".encode()).hexdigest()[:16]
    target = envs.cache_dir() / "cpu_kernels" / f"{name}-{platform.machine()}-{key}.so"
    try:
        if not target.exists():
            compiler = shutil.which(envs.c_compiler())
            if compiler is None:
                logger.info("CPU kernel %s: no C compiler (%s); torch runs it", name,
                            envs.c_compiler())  # fmt: skip
                return None
            if not _compile(compiler, source, flag_sets, target):
                logger.warning("CPU kernel %s: %s could not build it; torch runs it", name,
                               compiler)  # fmt: skip
                return None
        lib = ctypes.CDLL(str(target))
    except OSError as exc:
        logger.warning("CPU kernel %s: %s; torch runs it", name, exc)
        return None
    for fn_name, argtypes, restype in signatures:
        fn = getattr(lib, fn_name)
        fn.argtypes = list(argtypes)
        fn.restype = restype
    return lib
