"""Philox uniforms on CPU in C: the same function as `reference.philox_uniform_ref`, bit for bit.

The torch reference runs each of Philox's 10 rounds as a dozen int64 tensor ops over
[rows, vocab / 4] counters, every op a pass through memory: ~100 ms per step for 32 sampled
rows of a 49k vocabulary on one core (benchmarks/results/cpu_step_profile.json). The C loop
keeps a counter's rounds in registers and runs 32-bit lanes (gcc vectorises it): ~3 ms.

Built and loaded by `cpu_native` (`target_clones` picks AVX-512, AVX2 or plain code at load
time, so a cache shared between hosts stays safe); where it cannot be built the caller keeps
the torch reference.
"""

from __future__ import annotations

import ctypes

import torch

from loraplex.kernels.cpu_native import load_library
from loraplex.kernels.sampling.types import (
    PHILOX_KEY_A,
    PHILOX_KEY_B,
    PHILOX_ROUND_A,
    PHILOX_ROUND_B,
    PHILOX_ROUNDS,
    UNIFORM_SHIFT,
)

_SOURCE = f"""
#include <stdint.h>

static inline void philox(uint32_t c0, uint32_t c1, uint32_t c2, uint32_t c3, uint32_t k0,
                          uint32_t k1, uint32_t *w) {{
  for (int i = 0; i < {PHILOX_ROUNDS}; i++) {{
    uint64_t pb = (uint64_t){PHILOX_ROUND_B:#x}u * c2, pa = (uint64_t){PHILOX_ROUND_A:#x}u * c0;
    uint32_t n0 = (uint32_t)(pb >> 32) ^ c1 ^ k0, n2 = (uint32_t)(pa >> 32) ^ c3 ^ k1;
    c1 = (uint32_t)pb;
    c3 = (uint32_t)pa;
    c0 = n0;
    c2 = n2;
    k0 += {PHILOX_KEY_A:#x}u;
    k1 += {PHILOX_KEY_B:#x}u;
  }}
  w[0] = c0; w[1] = c1; w[2] = c2; w[3] = c3;
}}

/* (x >> 9) * 2**-23 + 2**-24: both steps exact in fp32, as in the torch reference. */
static inline float uniform(uint32_t x) {{
  return (float)(x >> {UNIFORM_SHIFT}) * 0x1p-23f + 0x1p-24f;
}}

#ifdef LORAPLEX_CLONES
__attribute__((target_clones("avx512f", "avx2", "default")))
#endif
void philox_uniform(const int64_t *seeds, const int64_t *steps, int64_t n, int64_t vocab,
                    float *out) {{
  for (int64_t r = 0; r < n; r++) {{
    uint32_t k0 = (uint32_t)seeds[r], k1 = (uint32_t)((uint64_t)seeds[r] >> 32);
    uint32_t s_lo = (uint32_t)steps[r], s_hi = (uint32_t)((uint64_t)steps[r] >> 32);
    float *row = out + r * vocab;
    int64_t full = vocab / 4;
    for (int64_t c = 0; c < full; c++) {{
      uint32_t w[4];
      philox((uint32_t)c, s_lo, s_hi, 0, k0, k1, w);
      row[4 * c] = uniform(w[0]);
      row[4 * c + 1] = uniform(w[1]);
      row[4 * c + 2] = uniform(w[2]);
      row[4 * c + 3] = uniform(w[3]);
    }}
    if (vocab % 4) {{
      uint32_t w[4];
      philox((uint32_t)full, s_lo, s_hi, 0, k0, k1, w);
      for (int64_t t = 4 * full; t < vocab; t++) row[t] = uniform(w[t - 4 * full]);
    }}
  }}
}}
"""

# NOTE: first with per-CPU clones (gcc, or clang on ELF hosts), then plain -O3 (any C compiler).
_FLAG_SETS = (("-O3", "-DLORAPLEX_CLONES"), ("-O3",))
_SIGNATURES = (
    ("philox_uniform", (ctypes.c_void_p,) * 2 + (ctypes.c_int64,) * 2 + (ctypes.c_void_p,), None),
)


def load() -> ctypes.CDLL | None:
    """The compiled library (built on first use), or None where it cannot be built."""
    return load_library("philox", _SOURCE, _FLAG_SETS, _SIGNATURES)


def philox_uniform_cpu(
    seeds: torch.Tensor,  # [n] int64, on CPU
    steps: torch.Tensor,  # [n] int64, on CPU
    vocab: int,
) -> torch.Tensor | None:
    """`philox_uniform_ref` in C. -> [n, vocab] fp32, or None where the library cannot load"""
    if seeds.dim() != 1 or seeds.shape != steps.shape:
        raise ValueError(f"seeds and steps must be [n], got {seeds.shape}, {steps.shape}")
    if seeds.device.type != "cpu" or steps.device.type != "cpu":
        raise ValueError("philox_uniform_cpu takes CPU tensors")
    if vocab < 1:
        raise ValueError(f"vocab must be positive, got {vocab}")
    lib = load()
    if lib is None:
        return None
    seeds = seeds.to(torch.int64).contiguous()
    steps = steps.to(torch.int64).contiguous()
    out = torch.empty(seeds.shape[0], vocab, dtype=torch.float32)
    lib.philox_uniform(seeds.data_ptr(), steps.data_ptr(), seeds.shape[0], vocab, out.data_ptr())
    return out
