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
`FEW_ROWS_MAX`) on one compute thread, a decode batch or a short prompt on the default 2-core
engine, go to a C kernel on the same layout: 6-row register tiles over each 64-column block (the
block streamed from memory once, then read from cache), prefetching the next block while it
computes, so the weight stream overlaps the arithmetic; about a tenth faster than oneDNN there
(see `FEW_ROWS_MAX`). Both C kernels are built for AVX-512: on x86-64 hosts without it (AVX2)
oneDNN takes every product, one row included (`few_rows_in_c`).

Any other weight (a test's, a layer built outside the model loader, an LM head that is also the
embedding) keeps its plain tensor and a packed copy cached on it (`packed_weight`), keyed by the
tensor's version counter, so a weight changed in place is packed again before its next use
rather than read stale. Where torch was built without oneDNN, or for other dtypes, `wanted`
says no and the caller keeps `F.linear`.
"""

from __future__ import annotations

import ctypes
import functools
import os
import platform
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from contextvars import ContextVar
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

#define TILE_ROWS 6

/* rows [R] of x [R, K] times one 64-column block `p` ([K][64] floats) into y [R, N] (`cols` of
   the block's columns kept). R * 4 accumulators, four weight vectors and one broadcast: 29 of
   AVX-512's 32 registers at R = 6. Each k step also prefetches one k step (four cache lines)
   of `pf`, the next block's, while any of its `pf_steps` are left. Every output is summed over
   k in order, as `gemv_blocked` sums it. */
INLINE void block_rows(const int R, const float *x, int64_t K, const float *p, const float *bias,
                       float *y, int64_t N, int64_t cols, const float *pf, int64_t pf_steps) {
  v16 acc[TILE_ROWS][4];
  for (int r = 0; r < R; r++)
    for (int j = 0; j < 4; j++) acc[r][j] = (v16){0};
  for (int64_t k = 0; k < K; k++, p += 64) {
    v16 w0 = *(const v16 *)p, w1 = *(const v16 *)(p + 16);
    v16 w2 = *(const v16 *)(p + 32), w3 = *(const v16 *)(p + 48);
    if (k < pf_steps) {
      const float *q = pf + k * 64;
      __builtin_prefetch(q, 0, 3);
      __builtin_prefetch(q + 16, 0, 3);
      __builtin_prefetch(q + 32, 0, 3);
      __builtin_prefetch(q + 48, 0, 3);
    }
    for (int r = 0; r < R; r++) {
      float s = x[r * K + k];
      acc[r][0] += s * w0;
      acc[r][1] += s * w1;
      acc[r][2] += s * w2;
      acc[r][3] += s * w3;
    }
  }
  for (int r = 0; r < R; r++) {
    float t[64];
    for (int j = 0; j < 4; j++) *(v16 *)(t + 16 * j) = acc[r][j];
    for (int64_t i = 0; i < cols; i++) y[r * N + i] = bias ? t[i] + bias[i] : t[i];
  }
}

/* y [M, N] = x [M, K] @ w^T (+ bias) for a few rows, w in the blocked layout, the columns
   [n_begin, n_end) only (n_begin a multiple of 64), so threads can share a product by column
   blocks: every output is computed alike whoever computes it. Per 64-column block, the rows go
   in groups of at most TILE_ROWS (sizes balanced, so 8 rows are 4 + 4, not 6 + 2): the first
   group streams the block from memory, the others read it from cache. Each group also
   prefetches its share of the next block, so the memory stream overlaps the arithmetic instead
   of waiting for the first group of the next block. */
CLONES void gemm_blocked(const float *x, int64_t M, const float *w, const float *bias,
                         float *y, int64_t N, int64_t K, int64_t Kp, int64_t n_begin,
                         int64_t n_end) {
  int64_t groups = (M + TILE_ROWS - 1) / TILE_ROWS;
  for (int64_t n0 = n_begin; n0 < n_end; n0 += 64) {
    const float *block = w + n0 * Kp, *next = n0 + 64 < n_end ? block + 64 * Kp : 0;
    const float *b = bias ? bias + n0 : 0;
    int64_t cols = N - n0 < 64 ? N - n0 : 64;
    for (int64_t g = 0, m0 = 0; g < groups; g++) {
      int64_t rows = (M - m0) / (groups - g);
      int64_t lo = g * K / groups, hi = (g + 1) * K / groups;
      const float *pf = next ? next + lo * 64 : 0;
      int64_t steps = next ? hi - lo : 0;
      const float *xr = x + m0 * K;
      float *yr = y + m0 * N + n0;
      switch (rows) {
        case 1: block_rows(1, xr, K, block, b, yr, N, cols, pf, steps); break;
        case 2: block_rows(2, xr, K, block, b, yr, N, cols, pf, steps); break;
        case 3: block_rows(3, xr, K, block, b, yr, N, cols, pf, steps); break;
        case 4: block_rows(4, xr, K, block, b, yr, N, cols, pf, steps); break;
        case 5: block_rows(5, xr, K, block, b, yr, N, cols, pf, steps); break;
        default: block_rows(6, xr, K, block, b, yr, N, cols, pf, steps); break;
      }
      m0 += rows;
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
        (ctypes.c_void_p, ctypes.c_int64) + (ctypes.c_void_p,) * 3 + (ctypes.c_int64,) * 5,
        None,
    ),
)

#: Most rows the few-row C kernel takes on one compute thread; past that, or on more threads,
#: oneDNN. NOTE: on one thread of the 2-core AVX-512 host (Sapphire Rapids, one other process
#: busy), the embedded model's 120 decoder linears measured (medians of seven interleaved runs
#: a side against oneDNN or the 4-row kernel before this one) 50.6-61.3 against 59.9-71.5 ms at
#: 8 rows, 91.7-116.0 against 101.6-122.7 at 32 and 179-210 against 197-233 through oneDNN at
#: 64 (a prompt of 64 tokens); at 96 and 128 rows the two were within 3%.
FEW_ROWS_MAX = 64


def _gemv_library() -> ctypes.CDLL | None:
    return load_library("gemv", _GEMV_SOURCE, (("-O3",),), _GEMV_SIGNATURES)


@functools.cache
def few_rows_in_c() -> bool:
    """Whether products of 1 to `FEW_ROWS_MAX` rows take the C kernels on this host (else
    oneDNN takes every product). Not on x86-64 without AVX-512: the kernels' 16-float vectors
    and 6-row tiles are built for its 32 registers, and on a 2-core AVX2 Zen 3 host they measured
    5-25x oneDNN's time (3072 x 576: one row 1,431 against 176 us, 8 rows 11.4 against 0.88 ms;
    `-march=native` builds no better: GCC's AVX2 code keeps the 16-float vectors on the stack,
    8,442 stack references in its assembly against 424 in the AVX-512 build), where on AVX-512
    hosts they beat it (see the module doc)."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return True
    return torch.backends.cpu.get_cpu_capability().startswith("AVX512")


#: The fewest rows, and multiply-adds, of a few-row product shared with lent threads
#: (`lending`): below, a thread's share is too short to pay for handing it over (~50 us).
SHARE_MIN_ROWS = 16
SHARE_MIN_MACS = 1 << 22


class LentThreads:
    """Threads an engine on one compute thread borrows for some of its steps (`lending`): the
    few-row kernel splits a product's 64-column blocks between the calling thread and them
    (each output is summed over k in order whoever computes it, so the product is the same to
    the bit as on one thread), and oneDNN's products run on `1 + count` OpenMP threads (its
    blocks of outputs shared out, K whole: equal to the bit on the embedded model's shapes on
    the 2-core AVX-512 host, which a test checks)."""

    def __init__(self, count: int, cores: tuple[int, ...] | None = None) -> None:
        """`count` threads, bound to `cores` where given (else placed by the OS)."""
        if count < 1:
            raise ValueError(f"LentThreads needs at least one thread, got {count}")
        self.count, self.cores = count, cores
        self._pool = ThreadPoolExecutor(
            count, "loraplex-lent", initializer=_bind_thread, initargs=(cores,)
        )
        self._omp_started = False

    @contextmanager
    def parallel(self) -> Iterator[None]:
        """torch's intra-op threads raised by `count` within the block. NOTE: OpenMP starts its
        worker threads on the first parallel region and they keep the affinity of the thread
        that started them; an engine bound to its own core would have them share it, so they are
        started once with that thread's affinity widened to the lent cores."""
        before = torch.get_num_threads()
        if not self._omp_started:
            self._omp_started = True
            self._start_omp(before)
        torch.set_num_threads(before + self.count)
        try:
            yield
        finally:
            torch.set_num_threads(before)

    def _start_omp(self, threads: int) -> None:
        own = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
        widen = own is not None and self.cores is not None and not set(self.cores) <= own
        if widen:
            os.sched_setaffinity(0, own | set(self.cores))  # type: ignore[arg-type, operator]
        try:
            torch.set_num_threads(threads + self.count)
            torch.ones(1 << 20).add_(1.0)  # NOTE: a parallel region: the workers start here
        finally:
            torch.set_num_threads(threads)
            if widen:
                os.sched_setaffinity(0, own)  # type: ignore[arg-type]

    def gemm(
        self, lib: ctypes.CDLL, rows: torch.Tensor, weight: PackedWeight, bias: int | None,
        out: torch.Tensor,
    ) -> None:  # fmt: skip
        """`gemm_blocked` of contiguous `rows` into `out`, the column blocks shared out."""
        n, parts = weight.n, self.count + 1
        blocks = -(-n // 64)
        edges = [min(n, blocks * i // parts * 64) for i in range(parts)] + [n]
        args = (rows.data_ptr(), rows.shape[0], weight.data_ptr, bias, out.data_ptr(), n,
                weight.k, weight.k_padded)  # fmt: skip
        # NOTE: ctypes lets go of the GIL for the call, so the shares run side by side
        shares = [self._pool.submit(lib.gemm_blocked, *args, lo, hi)
                  for lo, hi in zip(edges[1:-1], edges[2:]) if hi > lo]  # fmt: skip
        lib.gemm_blocked(*args, edges[0], edges[1])
        for share in shares:
            share.result()

    def close(self) -> None:
        self._pool.shutdown(wait=True)


def _worth_sharing(m: int, weight: PackedWeight) -> bool:
    return m >= SHARE_MIN_ROWS and weight.n > 64 and m * weight.n * weight.k >= SHARE_MIN_MACS


def _bind_thread(cores: tuple[int, ...] | None) -> None:
    if cores is not None and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, cores)  # NOTE: 0 is the calling thread on Linux


_LENT: ContextVar[LentThreads | None] = ContextVar("loraplex_lent_threads", default=None)


@contextmanager
def lending(threads: LentThreads | None) -> Iterator[None]:
    """Within the block, on an engine of one compute thread, few-row products of at least
    `SHARE_MIN_ROWS` rows share their work with `threads` and oneDNN's run on them too (None:
    none lent)."""
    token = _LENT.set(threads)
    try:
        yield
    finally:
        _LENT.reset(token)


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
    """x @ weight^T (+ bias): one row in C, more through oneDNN on the packed weight.
    NOTE: the few-row C kernel on this packed copy measured no faster than oneDNN for the tied
    LM head (49152 x 576) in the engine: 29.6-29.9 against 28.9-29.1 ms at 32 rows."""
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"x [M, K] and weight [N, K] expected, got {x.shape}, {weight.shape}")
    if x.dtype != torch.float32 or weight.dtype != torch.float32:
        raise ValueError(f"fp32 expected, got {x.dtype}, {weight.dtype}")
    if x.device.type != "cpu" or weight.device.type != "cpu":
        raise ValueError("linear_cpu takes CPU tensors")
    if x.shape[0] == 0:
        return x.new_empty(0, weight.shape[0])
    if x.shape[0] == 1 and few_rows_in_c():
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
    m, lib, lent = rows.shape[0], _gemv_library(), _LENT.get()
    few = few_rows_in_c() and (m == 1 or (m <= FEW_ROWS_MAX and torch.get_num_threads() == 1))
    if few and lib is not None and (bias is None or bias.is_contiguous()):
        rows = rows.contiguous()
        out = torch.empty(m, weight.n, dtype=torch.float32)
        b = None if bias is None else bias.data_ptr()
        if m == 1:
            lib.gemv_blocked(rows.data_ptr(), weight.data_ptr, b, out.data_ptr(), weight.n,
                             weight.k, weight.k_padded)  # fmt: skip
        elif lent is not None and _worth_sharing(m, weight):
            lent.gemm(lib, rows, weight, b, out)
        else:
            lib.gemm_blocked(rows.data_ptr(), m, weight.data_ptr, b, out.data_ptr(), weight.n,
                             weight.k, weight.k_padded, 0, weight.n)  # fmt: skip
    elif (
        lent is not None
        and torch.get_num_threads() == 1
        and (m > FEW_ROWS_MAX or _worth_sharing(m, weight))
    ):
        with lent.parallel():
            out = _onednn(rows.contiguous(), weight.tensor, bias)
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
