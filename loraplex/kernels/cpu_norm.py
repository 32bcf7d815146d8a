"""RMSNorm on CPU in C (fp32), optionally with the residual add before it, in one pass per row.

torch's CPU `rms_norm` is a composite of half a dozen ops (pow, mean, add, rsqrt, two
multiplies), ~30 us a call at a few rows; the embedded model calls it 61 times a step, and the
residual add beside most of them, ~2 ms of a 26 ms batch-1 step
(benchmarks/cpu_step_profile.py). Here each row's sum of squares runs in the host's vector lanes (`cpu_native.vector_lanes`)
added up in a fixed tree, so a row's result does not depend on what shares the batch. Built and loaded by
`cpu_native`; where it cannot be built the caller keeps the torch path.
"""

from __future__ import annotations

import ctypes

import torch

from loraplex.kernels.cpu_native import VECTOR_PRELUDE, load_library

_SOURCE = (
    VECTOR_PRELUDE
    + r"""
#include <math.h>

/* out[i] = s * rsqrt(mean(s^2) + eps) * w with s = x[i] (+ res[i], then written to new_res[i]),
   for rows i < n of d floats; rows x_stride / res_stride apart, out and new_res contiguous. */
CLONES void rms_norm(const float *x, int64_t x_stride, const float *res, int64_t res_stride,
                     const float *w, float *out, float *new_res, int64_t n, int64_t d,
                     float eps) {
  for (int64_t i = 0; i < n; i++) {
    const float *xi = x + i * x_stride;
    float *oi = out + i * d;
    const float *s = xi;
    if (res) {
      const float *ri = res + i * res_stride;
      float *si = new_res + i * d;
      for (int64_t j = 0; j < d; j++) si[j] = xi[j] + ri[j];
      s = si;
    }
    vec acc = {0};
    int64_t j = 0;
    for (; j + LANES <= d; j += LANES) {
      vec v = *(const vec *)(s + j);
      acc += v * v;
    }
    float ss = hsum(acc);
    for (; j < d; j++) ss += s[j] * s[j];
    float inv = 1.0f / sqrtf(ss / (float)d + eps);
    for (j = 0; j < d; j++) oi[j] = (s[j] * inv) * w[j];
  }
}
"""
)
_FLAG_SETS = (("-O3",),)
_SIGNATURES = (
    (
        "rms_norm",
        (ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64)
        + (ctypes.c_void_p,) * 3 + (ctypes.c_int64,) * 2 + (ctypes.c_float,),
        None,
    ),
)  # fmt: skip


def load() -> ctypes.CDLL | None:
    return load_library("rms_norm", _SOURCE, _FLAG_SETS, _SIGNATURES)


def supports(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None = None) -> bool:
    """Whether `rms_norm_c` takes these: fp32 CPU rows of unit stride, a contiguous weight."""
    tensors = (x, weight) if residual is None else (x, weight, residual)
    return (
        all(t.device.type == "cpu" and t.dtype == torch.float32 for t in tensors)
        and x.dim() == 2
        and x.stride(1) == 1
        and weight.dim() == 1
        and weight.is_contiguous()
        and weight.shape[0] == x.shape[1]
        and (residual is None or (residual.shape == x.shape and residual.stride(1) == 1))
    )


def rms_norm_c(
    x: torch.Tensor,  # [n, d] fp32
    weight: torch.Tensor,  # [d] fp32
    eps: float,
    residual: torch.Tensor | None = None,  # [n, d] fp32
) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """(rms_norm(s) * weight, s) with s = x + residual (None without a residual: s is x), as
    new tensors (`supports` must hold). -> None where the library cannot load."""
    lib = load()
    if lib is None:
        return None
    n, d = x.shape
    out = torch.empty(n, d, dtype=torch.float32)
    new_res = None if residual is None else torch.empty(n, d, dtype=torch.float32)
    lib.rms_norm(
        x.data_ptr(), x.stride(0),
        None if residual is None else residual.data_ptr(),
        0 if residual is None else residual.stride(0),
        weight.data_ptr(), out.data_ptr(), None if new_res is None else new_res.data_ptr(),
        n, d, eps,
    )  # fmt: skip
    return out, new_res
