"""Row argmax on CPU in C: the same indices as torch's `argmax(dim=-1)` for fp32 rows.

torch's CPU argmax over [32, 49152] logits took 4.4 ms on one core of the 2-core test host,
~3 ns a float; the sampler runs one a step (the greedy rows' tokens, or the Gumbel-max draw of
the sampled rows). Here each row is two passes, both in the host's vector lanes: its maximum (and whether it
holds a NaN), then the first index that holds it. torch's rules are kept: the first of equal
maxima wins, and a row with a NaN gives its first NaN. Built and loaded by `cpu_native`; where
it cannot be built the caller keeps torch's argmax.
"""

from __future__ import annotations

import ctypes

import torch

from loraplex.kernels.cpu_native import VECTOR_PRELUDE, load_library

_SOURCE = (
    VECTOR_PRELUDE
    + r"""
/* out[r] = the first index of row r's maximum (of its first NaN, if it has one), rows of n
   floats `stride` apart */
CLONES void argmax_rows(const float *x, int64_t rows, int64_t stride, int64_t n, int64_t *out) {
  for (int64_t r = 0; r < rows; r++) {
    const float *row = x + r * stride;
    float mx = row[0];
    int nan = 0;
    int64_t i = 0;
    if (n >= LANES) {
      vec m = *(const vec *)row;
      ivec bad = m != m;
      for (i = LANES; i + LANES <= n; i += LANES) {
        vec v = *(const vec *)(row + i);
        bad |= v != v;
        ivec gt = v > m;
        m = (vec)(((ivec)v & gt) | ((ivec)m & ~gt));
      }
      for (int j = 0; j < LANES; j++) {
        nan |= bad[j] != 0;
        if (m[j] > mx) mx = m[j];
      }
    } else {
      i = 1;
    }
    for (; i < n; i++) {
      nan |= row[i] != row[i];
      if (row[i] > mx) mx = row[i];
    }
    nan |= mx != mx;
    int64_t at = 0;
    if (nan)
      while (row[at] == row[at]) at++;
    else
      while (row[at] != mx) at++;
    out[r] = at;
  }
}
"""
)
_FLAG_SETS = (("-O3",),)
_SIGNATURES = (
    ("argmax_rows", (ctypes.c_void_p,) + (ctypes.c_int64,) * 3 + (ctypes.c_void_p,), None),
)


def load() -> ctypes.CDLL | None:
    """The compiled library (built on first use), or None where it cannot be built."""
    return load_library("argmax", _SOURCE, _FLAG_SETS, _SIGNATURES)


def argmax_rows(x: torch.Tensor) -> torch.Tensor:  # [rows] int64
    """`x.argmax(dim=-1)` for [rows, n] fp32 CPU rows of unit stride, n >= 1; in C where the
    library loads, else torch's."""
    if x.dim() != 2 or x.dtype != torch.float32 or x.device.type != "cpu":
        raise ValueError(f"[rows, n] fp32 CPU rows expected, got {x.dtype} {tuple(x.shape)}")
    lib = load()
    if lib is None or x.shape[1] == 0 or x.stride(1) != 1:
        return x.argmax(dim=-1)
    out = torch.empty(x.shape[0], dtype=torch.int64)
    lib.argmax_rows(x.data_ptr(), x.shape[0], x.stride(0), x.shape[1], out.data_ptr())
    return out
