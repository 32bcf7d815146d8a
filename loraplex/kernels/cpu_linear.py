"""fp32 linears on CPU through oneDNN, each weight packed once (one row in C): y = x @ w^T (+ b).

torch's `F.linear` in fp32 goes to MKL's SGEMM, which on the AMD hosts we measured runs well
below the core's AVX-512 peak and re-packs the weight on every call: on one Zen 5 thread the
embedded model's 30 decoder layers took 41 ms at 8 rows (the few-row C kernel this replaced) /
48 ms (F.linear) and 70 / 104 ms at 32 rows, against 21 and 44 ms through oneDNN's matmul on a
weight packed into its own blocked layout ahead of time; a 256-row prefill chunk 574 ms against
253. One row (a batch-1 decode step) goes to a C GEMV instead (`cpu_native`; four weight rows
streamed at a time): oneDNN's call costs ~17 us whatever its size, 121 calls a step, and the
embedded model's batch-1 step measured medians of 22.1 and 22.6 ms through the GEMV against
25.5 and 23.7 through oneDNN (two runs of six alternating pairs on one engine).

A loaded model's linear weights are held packed only (`pack` -> `PackedWeight`, `linear_packed`,
used by `quant.unquantized`): the one-row GEMV reads oneDNN's blocked layout itself
(`[ceil(N / 64)][K'][64]`, 64 output rows side by side per K step, K' >= K; where oneDNN picks
another layout for a weight, as for very small ones or on other CPUs, `pack` declines and the
caller keeps the plain weight). A model then costs one copy of its fp32 weights, not two, and
one row is no slower: the linears of the embedded model's batch-1 step measured medians of
13.4 and 14.9 ms read packed against 15.8 and 19.4 read plain (`benchmarks.cpu_step_profile`,
greedy and temperature 1, three alternating runs a side on one host). A few rows (2 to
`FEW_ROWS_MAX`) on one compute thread, a decode batch on the default 2-core engine, go to a C
kernel on the same layout that streams each block's weights once for four rows at a time, about
a tenth faster than oneDNN there (see `FEW_ROWS_MAX`).

Any other weight (a test's, a layer built outside the model loader, an LM head that is also the
embedding) keeps its plain tensor and a packed copy cached on it (`packed_weight`), keyed by the
tensor's version counter, so a weight changed in place is packed again before its next use
rather than read stale. Where torch was built without oneDNN, or for other dtypes, `wanted`
says no and the caller keeps `F.linear`.
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass

import torch

from loraplex.kernels.cpu_native import VECTOR_PRELUDE, load_library

#: The attribute of a weight tensor that holds (its version when packed, the packed weight).
_PACKED = "_loraplex_onednn_packed"


@functools.cache
def available() -> bool:
    """Whether this torch has oneDNN's packed-weight linear."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def packed_weight(weight: torch.Tensor) -> torch.Tensor:
    """The oneDNN-packed form of `weight` ([N, K] fp32 on CPU), packed on first use and again
    after any in-place change."""
    cached = getattr(weight, _PACKED, None)
    if cached is not None and cached[0] == weight._version:
        return cached[1]
    with torch.no_grad():
        packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous())
    setattr(weight, _PACKED, (weight._version, packed))
    return packed


def prepack(weight: torch.Tensor) -> None:
    """Pack `weight` now if `linear_cpu` would take it ([N, K] fp32 on CPU, no autograd), so
    the first request does not pay for it."""
    if (
        weight.device.type == "cpu"
        and weight.dim() == 2
        and weight.dtype == torch.float32
        and not weight.requires_grad
        and available()
    ):
        packed_weight(weight)


_BLOCK = 64  # output rows interleaved per K step in oneDNN's blocked fp32 weight layout


@dataclass(frozen=True, eq=False)
class PackedWeight:
    """A [N, K] fp32 weight held only in oneDNN's blocked layout (see the module doc)."""

    tensor: torch.Tensor  # oneDNN's (opaque) packed tensor, what its matmul takes
    n: int
    k: int
    k_padded: int  # K': the K steps stored per 64-row block (zeros past K)
    data_ptr: int  # where its [ceil(N / 64), K', 64] floats start

    @property
    def shape(self) -> tuple[int, int]:
        return self.n, self.k

    def to_dense(self) -> torch.Tensor:
        """The weight as a plain [N, K] tensor (a new copy)."""
        return self.tensor.to_dense()


def _blocked(weight: torch.Tensor, k_padded: int) -> torch.Tensor:
    """`weight` [N, K] laid out as [ceil(N / 64), K', 64], zero-padded."""
    n, k = weight.shape
    n_padded = -(-n // _BLOCK) * _BLOCK
    padded = torch.zeros(n_padded, k_padded, dtype=weight.dtype)
    padded[:n, :k] = weight
    return padded.view(-1, _BLOCK, k_padded).transpose(1, 2).contiguous()


def pack(weight: torch.Tensor) -> PackedWeight | None:
    """`weight` ([N, K] fp32 on CPU, no autograd) packed for oneDNN, for the caller to hold
    instead of it; None where `linear_cpu` would not take it or oneDNN's layout is not the
    blocked one the one-row GEMV reads (the caller then keeps the plain weight)."""
    if not (
        weight.device.type == "cpu"
        and weight.dim() == 2
        and weight.dtype == torch.float32
        and not weight.requires_grad
        and available()
    ):
        return None
    n, k = weight.shape
    with torch.no_grad():
        packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous())
    floats, n_padded = torch.ops.mkldnn._nbytes(packed) // 4, -(-n // _BLOCK) * _BLOCK
    k_padded = floats // n_padded
    if n == 0 or floats != n_padded * k_padded or k_padded < k:
        return None
    address = torch.ops.mkldnn.data_ptr(packed)
    # NOTE: every stored float compared with where the GEMV reads it, so a layout oneDNN
    # chose otherwise is never read as this one
    stored = torch.frombuffer((ctypes.c_float * floats).from_address(address), dtype=torch.float32)
    if not torch.equal(stored, _blocked(weight.detach(), k_padded).view(-1)):
        return None
    return PackedWeight(packed, n, k, k_padded, address)


_GEMV_SOURCE = (
    VECTOR_PRELUDE
    + r"""
/* y[n] = x . w[n] (+ bias[n]) for n < N, w's rows K floats apart; four rows at a time */
CLONES void gemv(const float *x, const float *w, const float *bias, float *y, int64_t N,
                 int64_t K) {
  int64_t n = 0;
  for (; n + 4 <= N; n += 4) {
    const float *w0 = w + n * K, *w1 = w0 + K, *w2 = w1 + K, *w3 = w2 + K;
    v16 a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};
    int64_t k = 0;
    for (; k + 16 <= K; k += 16) {
      v16 xv = *(const v16 *)(x + k);
      a0 += xv * *(const v16 *)(w0 + k);
      a1 += xv * *(const v16 *)(w1 + k);
      a2 += xv * *(const v16 *)(w2 + k);
      a3 += xv * *(const v16 *)(w3 + k);
    }
    float s[4] = {hsum(a0), hsum(a1), hsum(a2), hsum(a3)};
    for (; k < K; k++) {
      s[0] += x[k] * w0[k];
      s[1] += x[k] * w1[k];
      s[2] += x[k] * w2[k];
      s[3] += x[k] * w3[k];
    }
    for (int i = 0; i < 4; i++) y[n + i] = s[i];
  }
  for (; n < N; n++) y[n] = dot(x, w + n * K, K);
  if (bias)
    for (n = 0; n < N; n++) y[n] += bias[n];
}

/* the same product with w in oneDNN's blocked layout [ceil(N / 64)][Kp][64]: each block's 64
   outputs in four vectors, x[k] times the block's row k added in */
CLONES void gemv_blocked(const float *x, const float *w, const float *bias, float *y, int64_t N,
                         int64_t K, int64_t Kp) {
  for (int64_t n0 = 0; n0 < N; n0 += 64) {
    const float *p = w + n0 * Kp;
    v16 a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};
    for (int64_t k = 0; k < K; k++, p += 64) {
      float xk = x[k];
      a0 += xk * *(const v16 *)p;
      a1 += xk * *(const v16 *)(p + 16);
      a2 += xk * *(const v16 *)(p + 32);
      a3 += xk * *(const v16 *)(p + 48);
    }
    float s[64];
    *(v16 *)s = a0;
    *(v16 *)(s + 16) = a1;
    *(v16 *)(s + 32) = a2;
    *(v16 *)(s + 48) = a3;
    int64_t m = N - n0 < 64 ? N - n0 : 64;
    for (int64_t i = 0; i < m; i++) y[n0 + i] = bias ? s[i] + bias[n0 + i] : s[i];
  }
}

#define ROW_TIMES_BLOCK(r, s)                                                                   \
  a##r##0 += s * w0;                                                                            \
  a##r##1 += s * w1;                                                                            \
  a##r##2 += s * w2;                                                                            \
  a##r##3 += s * w3;
#define STORE_ROW(r)                                                                            \
  *(v16 *)t[r] = a##r##0;                                                                       \
  *(v16 *)(t[r] + 16) = a##r##1;                                                                \
  *(v16 *)(t[r] + 32) = a##r##2;                                                                \
  *(v16 *)(t[r] + 48) = a##r##3;

/* y [M, N] = x [M, K] @ w^T (+ bias) for a few rows, w in the blocked layout: each block's
   weights are streamed once from memory for four rows at a time (the next four read them from
   cache); a last group of fewer rows repeats its first row and stores only its own */
CLONES void gemm_blocked(const float *x, int64_t M, const float *w, const float *bias,
                         float *y, int64_t N, int64_t K, int64_t Kp) {
  for (int64_t n0 = 0; n0 < N; n0 += 64) {
    const float *wb = w + n0 * Kp;
    int64_t cols = N - n0 < 64 ? N - n0 : 64;
    for (int64_t m0 = 0; m0 < M; m0 += 4) {
      const float *x0 = x + m0 * K;
      const float *x1 = x + (m0 + 1 < M ? m0 + 1 : m0) * K;
      const float *x2 = x + (m0 + 2 < M ? m0 + 2 : m0) * K;
      const float *x3 = x + (m0 + 3 < M ? m0 + 3 : m0) * K;
      v16 a00 = {0}, a01 = {0}, a02 = {0}, a03 = {0}, a10 = {0}, a11 = {0}, a12 = {0};
      v16 a13 = {0}, a20 = {0}, a21 = {0}, a22 = {0}, a23 = {0}, a30 = {0}, a31 = {0};
      v16 a32 = {0}, a33 = {0};
      const float *p = wb;
      for (int64_t k = 0; k < K; k++, p += 64) {
        v16 w0 = *(const v16 *)p, w1 = *(const v16 *)(p + 16);
        v16 w2 = *(const v16 *)(p + 32), w3 = *(const v16 *)(p + 48);
        ROW_TIMES_BLOCK(0, x0[k])
        ROW_TIMES_BLOCK(1, x1[k])
        ROW_TIMES_BLOCK(2, x2[k])
        ROW_TIMES_BLOCK(3, x3[k])
      }
      float t[4][64];
      STORE_ROW(0)
      STORE_ROW(1)
      STORE_ROW(2)
      STORE_ROW(3)
      for (int64_t r = 0; r < 4 && m0 + r < M; r++)
        for (int64_t i = 0; i < cols; i++)
          y[(m0 + r) * N + n0 + i] = bias ? t[r][i] + bias[n0 + i] : t[r][i];
    }
  }
}
"""
)
_GEMV_SIGNATURES = (
    ("gemv", (ctypes.c_void_p,) * 4 + (ctypes.c_int64,) * 2, None),
    ("gemv_blocked", (ctypes.c_void_p,) * 4 + (ctypes.c_int64,) * 3, None),
    (
        "gemm_blocked",
        (ctypes.c_void_p, ctypes.c_int64) + (ctypes.c_void_p,) * 3 + (ctypes.c_int64,) * 3,
        None,
    ),
)

#: Most rows the few-row C kernel takes on one compute thread; past that, or on more threads,
#: oneDNN. NOTE: on one thread of the 2-core AVX-512 test host the embedded model's 120
#: decoder linears measured 18.9 against 21.6 ms through oneDNN at 8 rows, 42.6 against 45.8 at
#: 32 (16.1 / 17.3 at 4); one row keeps the one-row GEMV (11.9 ms, 14.4 through this kernel).
FEW_ROWS_MAX = 32


def _gemv_library() -> ctypes.CDLL | None:
    return load_library("gemv", _GEMV_SOURCE, (("-O3",),), _GEMV_SIGNATURES)


def _gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor | None:
    """One row: x [1, K] @ weight [N, K]^T in C. -> [1, N], or None where it cannot build"""
    lib = _gemv_library()
    if lib is None or not weight.is_contiguous() or (bias is not None and not bias.is_contiguous()):
        return None
    x = x.contiguous()
    out = torch.empty(1, weight.shape[0], dtype=torch.float32)
    lib.gemv(x.data_ptr(), weight.data_ptr(), None if bias is None else bias.data_ptr(),
             out.data_ptr(), weight.shape[0], weight.shape[1])  # fmt: skip
    return out


def linear_cpu(
    x: torch.Tensor,  # [M, K] fp32 on CPU
    weight: torch.Tensor,  # [N, K] fp32 on CPU
    bias: torch.Tensor | None = None,  # [N] fp32
) -> torch.Tensor:  # [M, N] fp32
    """x @ weight^T (+ bias): one row in C, more through oneDNN on the packed weight."""
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"x [M, K] and weight [N, K] expected, got {x.shape}, {weight.shape}")
    if x.dtype != torch.float32 or weight.dtype != torch.float32:
        raise ValueError(f"fp32 expected, got {x.dtype}, {weight.dtype}")
    if x.device.type != "cpu" or weight.device.type != "cpu":
        raise ValueError("linear_cpu takes CPU tensors")
    if x.shape[0] == 0:
        return x.new_empty(0, weight.shape[0])
    if x.shape[0] == 1:
        out = _gemv(x, weight, bias)
        if out is not None:
            return out
    return _onednn(x.contiguous(), packed_weight(weight), bias)


def linear_packed(
    x: torch.Tensor,  # [..., K] fp32 on CPU
    weight: PackedWeight,  # [N, K]
    bias: torch.Tensor | None = None,  # [N] fp32
) -> torch.Tensor:  # [..., N] fp32
    """x @ weight^T (+ bias) on the blocked layout: one row through the C GEMV, up to
    `FEW_ROWS_MAX` on one compute thread through the few-row C kernel, more through oneDNN."""
    if x.shape[-1] != weight.k or x.dtype != torch.float32 or x.device.type != "cpu":
        raise ValueError(f"fp32 CPU x [..., {weight.k}] expected, got {x.dtype} {x.shape}")
    rows = x.reshape(-1, weight.k)
    if rows.shape[0] == 0:
        return x.new_empty(*x.shape[:-1], weight.n)
    m, lib = rows.shape[0], _gemv_library()
    few = m == 1 or (m <= FEW_ROWS_MAX and torch.get_num_threads() == 1)
    if few and lib is not None and (bias is None or bias.is_contiguous()):
        rows = rows.contiguous()
        out = torch.empty(m, weight.n, dtype=torch.float32)
        b = None if bias is None else bias.data_ptr()
        if m == 1:
            lib.gemv_blocked(rows.data_ptr(), weight.data_ptr, b, out.data_ptr(), weight.n,
                             weight.k, weight.k_padded)  # fmt: skip
        else:
            lib.gemm_blocked(rows.data_ptr(), m, weight.data_ptr, b, out.data_ptr(), weight.n,
                             weight.k, weight.k_padded)  # fmt: skip
    else:
        out = _onednn(rows.contiguous(), weight.tensor, bias)
    return out.view(*x.shape[:-1], weight.n)


def _onednn(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def wanted(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether `linear_cpu` runs this call: CPU fp32 tensors, x of 2 dimensions, no autograd,
    and a torch built with oneDNN."""
    return (
        x.device.type == "cpu"
        and x.dim() == 2
        and weight.dim() == 2
        and x.dtype == weight.dtype == torch.float32
        and (bias is None or bias.dtype == torch.float32)
        and not (x.requires_grad or weight.requires_grad)
        and available()
    )
