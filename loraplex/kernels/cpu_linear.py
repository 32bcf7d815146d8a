"""A few-row fp32 GEMM for the CPU engine in C (AVX-512): y = x @ weight^T.

A decode step of 4-32 sequences multiplies a few activation rows by every weight. On one thread
torch's fp32 `F.linear` runs those shapes 1.5-2x slower than one row (it re-packs the weight on
every call), though the weight read is the same: the embedded model's projections took 129 ms
per step at 8 rows against 53 ms at one (benchmarks/results/cpu_step_profile.json). This kernel
streams each weight row once per 4 rows of x, with 4 x 4 output tiles in 16 AVX-512
accumulators: 77 ms at 8 rows, the LM head 20 ms against 43.

Each output is the dot product of one x row and one weight row summed in a fixed order (16
lanes, then the lanes), so a row's result does not depend on what else is in the batch. The
library is built by `cpu_native`; on a CPU without AVX-512 (or without a compiler) the function
returns None and the caller keeps `F.linear`.
"""

from __future__ import annotations

import ctypes

import torch

from loraplex.kernels.cpu_native import load_library

#: The rows of x where the kernel measured faster than `F.linear` on one thread (Sapphire
#: Rapids, the embedded model's shapes): under 4 torch's GEMV path streams the weight as fast.
MIN_ROWS, MAX_ROWS = 4, 32

_SOURCE = r"""
#include <stdint.h>
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>

#define FMA_ROW(xv, a0, a1, a2, a3) \
  a0 = _mm512_fmadd_ps(xv, w0, a0); a1 = _mm512_fmadd_ps(xv, w1, a1); \
  a2 = _mm512_fmadd_ps(xv, w2, a2); a3 = _mm512_fmadd_ps(xv, w3, a3);

/* y[m0 + i, n0 + j] for i < mb, j < nb (<= 4 each); missing rows re-read the first row of the
   tile and are not stored. */
__attribute__((target("avx512f")))
static void tile(const float *x, const float *w, float *y, int64_t m0, int64_t n0, int mb, int nb,
                 int64_t N, int64_t K) {
  const float *x0p = x + m0 * K, *x1p = x + (m0 + (mb > 1)) * K;
  const float *x2p = x + (m0 + (mb > 2) * 2) * K, *x3p = x + (m0 + (mb > 3) * 3) * K;
  const float *w0p = w + n0 * K, *w1p = w + (n0 + (nb > 1)) * K;
  const float *w2p = w + (n0 + (nb > 2) * 2) * K, *w3p = w + (n0 + (nb > 3) * 3) * K;
  __m512 a00 = _mm512_setzero_ps(), a01 = a00, a02 = a00, a03 = a00, a10 = a00, a11 = a00,
         a12 = a00, a13 = a00, a20 = a00, a21 = a00, a22 = a00, a23 = a00, a30 = a00, a31 = a00,
         a32 = a00, a33 = a00;
  for (int64_t k = 0; k < K; k += 16) {
    __mmask16 mask = K - k >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (K - k)) - 1);
    __m512 w0 = _mm512_maskz_loadu_ps(mask, w0p + k), w1 = _mm512_maskz_loadu_ps(mask, w1p + k);
    __m512 w2 = _mm512_maskz_loadu_ps(mask, w2p + k), w3 = _mm512_maskz_loadu_ps(mask, w3p + k);
    __m512 xv = _mm512_maskz_loadu_ps(mask, x0p + k);
    FMA_ROW(xv, a00, a01, a02, a03)
    xv = _mm512_maskz_loadu_ps(mask, x1p + k);
    FMA_ROW(xv, a10, a11, a12, a13)
    xv = _mm512_maskz_loadu_ps(mask, x2p + k);
    FMA_ROW(xv, a20, a21, a22, a23)
    xv = _mm512_maskz_loadu_ps(mask, x3p + k);
    FMA_ROW(xv, a30, a31, a32, a33)
  }
  __m512 acc[4][4] = {{a00, a01, a02, a03}, {a10, a11, a12, a13}, {a20, a21, a22, a23},
                      {a30, a31, a32, a33}};
  for (int i = 0; i < mb; i++)
    for (int j = 0; j < nb; j++) y[(m0 + i) * N + n0 + j] = _mm512_reduce_add_ps(acc[i][j]);
}

/* y [M, N] = x [M, K] @ w [N, K]^T, all contiguous fp32. -> 0 without AVX-512 (nothing
   written), else 1 */
int linear_rows(const float *x, const float *w, float *y, int64_t M, int64_t N, int64_t K) {
  if (!__builtin_cpu_supports("avx512f")) return 0;
  for (int64_t n0 = 0; n0 < N; n0 += 4) {
    int nb = N - n0 < 4 ? (int)(N - n0) : 4;
    for (int64_t m0 = 0; m0 < M; m0 += 4) tile(x, w, y, m0, n0, M - m0 < 4 ? (int)(M - m0) : 4,
                                                nb, N, K);
  }
  return 1;
}
#else
int linear_rows(const float *x, const float *w, float *y, int64_t M, int64_t N, int64_t K) {
  return 0;
}
#endif
"""
_FLAG_SETS = (("-O3",),)
_SIGNATURES = (("linear_rows", (ctypes.c_void_p,) * 3 + (ctypes.c_int64,) * 3, ctypes.c_int),)


def load() -> ctypes.CDLL | None:
    return load_library("linear", _SOURCE, _FLAG_SETS, _SIGNATURES)


def linear_cpu(
    x: torch.Tensor,  # [M, K] fp32 on CPU
    weight: torch.Tensor,  # [N, K] fp32 on CPU, contiguous
) -> torch.Tensor | None:
    """x @ weight^T in C. -> [M, N] fp32, or None where the kernel does not run here (no
    AVX-512, no compiler)"""
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"x [M, K] and weight [N, K] expected, got {x.shape}, {weight.shape}")
    if x.dtype != torch.float32 or weight.dtype != torch.float32:
        raise ValueError(f"fp32 expected, got {x.dtype}, {weight.dtype}")
    if x.device.type != "cpu" or weight.device.type != "cpu":
        raise ValueError("linear_cpu takes CPU tensors")
    if not weight.is_contiguous():
        raise ValueError("the weight must be contiguous")
    lib = load()
    if lib is None:
        return None
    x = x.contiguous()
    (m, k), n = x.shape, weight.shape[0]
    out = torch.empty(m, n, dtype=torch.float32)
    if m and n and not lib.linear_rows(x.data_ptr(), weight.data_ptr(), out.data_ptr(), m, n, k):
        return None
    return out


def wanted(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `linear_cpu` is the faster path for this call: a CPU fp32 layer, MIN_ROWS to
    MAX_ROWS rows, and one intra-op thread (torch parallelises its own GEMM over more)."""
    return (
        x.device.type == "cpu"
        and x.dim() == 2
        and MIN_ROWS <= x.shape[0] <= MAX_ROWS
        and x.dtype == weight.dtype == torch.float32
        and weight.is_contiguous()
        and not x.requires_grad
        and torch.get_num_threads() == 1
    )
