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
(see `FEW_ROWS_MAX`). The kernels are built for the host's vector width
(`cpu_native.vector_lanes`): AVX-512's 32 registers hold a tile of 6 rows by 64 columns; on AVX2
hosts (16 registers) the 8-lane build sums 16-column strips in chunks of k, its prefetch spread
over every pass, and beats oneDNN by more (a third at 8 rows; `FEW_ROWS_MAX`).

Any other weight (a test's, a layer built outside the model loader, an LM head that is also the
embedding) keeps its plain tensor and a packed copy cached on it (`packed_weight`), keyed by the
tensor's version counter, so a weight changed in place is packed again before its next use
rather than read stale; the copy in the blocked layout takes the same C kernels. Where torch was
built without oneDNN, or for other dtypes, `wanted` says no and the caller keeps `F.linear`.
"""

from __future__ import annotations

import ctypes
import functools
import os
import platform
from collections.abc import Callable, Iterator
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


def packed_weight(weight: torch.Tensor) -> PackedWeight | torch.Tensor:
    """The packed form of `weight` ([N, K] fp32 on CPU): a `PackedWeight` where oneDNN chose the
    blocked layout the C kernels read, else oneDNN's opaque tensor; packed on first use and
    again after any in-place change."""
    cached = getattr(weight, _PACKED, None)
    if cached is not None and cached[0] == weight._version:
        return cached[1]
    packed: PackedWeight | torch.Tensor | None = pack(weight)
    if packed is None:
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


_GEMV_SOURCE = (
    VECTOR_PRELUDE
    + r"""
/* y[n] = x . w[n] (+ bias[n]) for n < N, w's rows K floats apart; four rows at a time */
CLONES void gemv(const float *x, const float *w, const float *bias, float *y, int64_t N,
                 int64_t K) {
  int64_t n = 0;
  for (; n + 4 <= N; n += 4) {
    const float *w0 = w + n * K, *w1 = w0 + K, *w2 = w1 + K, *w3 = w2 + K;
    vec a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};
    int64_t k = 0;
    for (; k + LANES <= K; k += LANES) {
      vec xv = *(const vec *)(x + k);
      a0 += xv * *(const vec *)(w0 + k);
      a1 += xv * *(const vec *)(w1 + k);
      a2 += xv * *(const vec *)(w2 + k);
      a3 += xv * *(const vec *)(w3 + k);
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

#define BLOCK_VECS (64 / LANES)

/* the same product with w in oneDNN's blocked layout [ceil(N / 64)][Kp][64]: each block's 64
   outputs in BLOCK_VECS vectors, x[k] times the block's row k added in */
CLONES void gemv_blocked(const float *x, const float *w, const float *bias, float *y, int64_t N,
                         int64_t K, int64_t Kp) {
  for (int64_t n0 = 0; n0 < N; n0 += 64) {
    const float *p = w + n0 * Kp;
    vec a[BLOCK_VECS];
    for (int j = 0; j < BLOCK_VECS; j++) a[j] = (vec){0};
    for (int64_t k = 0; k < K; k++, p += 64) {
      float xk = x[k];
#if LANES == 8
      /* NOTE: four cache lines a step, eight steps ahead: AVX2 hosts stream weights slower */
      for (int j = 0; j < 4; j++) __builtin_prefetch(p + 8 * 64 + 16 * j, 0, 0);
#endif
      for (int j = 0; j < BLOCK_VECS; j++) a[j] += xk * *(const vec *)(p + LANES * j);
    }
    float s[64];
    for (int j = 0; j < BLOCK_VECS; j++) *(vec *)(s + LANES * j) = a[j];
    int64_t m = N - n0 < 64 ? N - n0 : 64;
    for (int64_t i = 0; i < m; i++) y[n0 + i] = bias ? s[i] + bias[n0 + i] : s[i];
  }
}

#if LANES == 16

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
#else /* LANES == 8: AVX2's 16 registers */

#define TILE_ROWS 6
#define CHUNK_K 32 /* k steps of a block's 16-column strip summed per pass */
#define AHEAD 2048 /* floats of the weight stream prefetched ahead of the chunk in use */
#define SLAB_ROWS 64 /* rows whose partial sums one block keeps on the stack */

/* R rows of x [., K] times 16 of a block's columns (`p`, the block's row k at p + 64 k) over
   k in [k0, k1): R * 2 accumulators, two weight vectors and one broadcast, 15 of AVX2's 16
   registers at R = 6. The sums start at zero (`first`) or from t (rows 64 floats apart), and
   go back there. Each k step prefetches one cache line of the stream at *pf while it is below
   pf_end, so the weight keeps streaming in at an even rate whichever pass runs. */
INLINE void strip_rows(const int R, const float *x, int64_t K, const float *p, int64_t k0,
                       int64_t k1, float *t, int first, const float **pf, const float *pf_end) {
  v8 acc[TILE_ROWS][2];
  const float *f = *pf;
  for (int r = 0; r < R; r++) {
    acc[r][0] = first ? (v8){0} : *(const v8 *)(t + 64 * r);
    acc[r][1] = first ? (v8){0} : *(const v8 *)(t + 64 * r + 8);
  }
  p += k0 * 64;
  for (int64_t k = k0; k < k1; k++, p += 64) {
    if (f < pf_end) {
      __builtin_prefetch(f, 0, 2);
      f += 16;
    }
    v8 w0 = *(const v8 *)p, w1 = *(const v8 *)(p + 8);
    for (int r = 0; r < R; r++) {
      float s = x[r * K + k];
      acc[r][0] += s * w0;
      acc[r][1] += s * w1;
    }
  }
  *pf = f;
  for (int r = 0; r < R; r++) {
    *(v8 *)(t + 64 * r) = acc[r][0];
    *(v8 *)(t + 64 * r + 8) = acc[r][1];
  }
}

/* gemm_blocked (above) for AVX2. A 64-column block's outputs do not fit its registers, so per
   block and CHUNK_K k steps, each 16-column strip is summed for each group of at most
   TILE_ROWS rows (sizes balanced), the partial sums kept in t between chunks (stored and
   reloaded exactly: every output is still summed over k in order, as `gemv_blocked` sums it).
   The blocks [n_begin, n_end) are one run of memory, prefetched AHEAD floats beyond the chunk
   in use, a line per k step of every pass: on a 2-core Zen 3 host this took the embedded
   model's 120 decoder linears from DRAM to 38 ms at 8 rows against oneDNN's 54-61 (prefetching
   only in a block's first pass: 57-61). */
CLONES void gemm_blocked(const float *x, int64_t M, const float *w, const float *bias,
                         float *y, int64_t N, int64_t K, int64_t Kp, int64_t n_begin,
                         int64_t n_end) {
  float t[SLAB_ROWS * 64] __attribute__((aligned(64)));
  const float *stream_end = w + n_end * Kp;
  for (int64_t r0 = 0; r0 < M; r0 += SLAB_ROWS) {
    int64_t rows_in = M - r0 < SLAB_ROWS ? M - r0 : SLAB_ROWS;
    int64_t groups = (rows_in + TILE_ROWS - 1) / TILE_ROWS;
    const float *pf = w + n_begin * Kp + AHEAD;
    for (int64_t n0 = n_begin; n0 < n_end; n0 += 64) {
      const float *block = w + n0 * Kp;
      int64_t cols = N - n0 < 64 ? N - n0 : 64;
      for (int64_t k0 = 0; k0 < K; k0 += CHUNK_K) {
        int64_t k1 = k0 + CHUNK_K < K ? k0 + CHUNK_K : K;
        const float *pf_end = block + (k1 < K ? k1 : Kp) * 64 + AHEAD;
        if (pf_end > stream_end) pf_end = stream_end;
        for (int q = 0; q < 4; q++) {
          for (int64_t g = 0, m0 = 0; g < groups; g++) {
            int64_t rows = (rows_in - m0) / (groups - g);
            const float *xr = x + (r0 + m0) * K, *strip = block + 16 * q;
            float *tr = t + m0 * 64 + 16 * q;
            int first = k0 == 0;
            switch (rows) {
              case 1: strip_rows(1, xr, K, strip, k0, k1, tr, first, &pf, pf_end); break;
              case 2: strip_rows(2, xr, K, strip, k0, k1, tr, first, &pf, pf_end); break;
              case 3: strip_rows(3, xr, K, strip, k0, k1, tr, first, &pf, pf_end); break;
              case 4: strip_rows(4, xr, K, strip, k0, k1, tr, first, &pf, pf_end); break;
              case 5: strip_rows(5, xr, K, strip, k0, k1, tr, first, &pf, pf_end); break;
              default: strip_rows(6, xr, K, strip, k0, k1, tr, first, &pf, pf_end); break;
            }
            m0 += rows;
          }
        }
      }
      for (int64_t r = 0; r < rows_in; r++) {
        float *yr = y + (r0 + r) * N + n0;
        for (int64_t i = 0; i < cols; i++) yr[i] = bias ? t[r * 64 + i] + bias[n0 + i] : t[r * 64 + i];
      }
    }
  }
}

#endif

/* ---- a team of helper threads sharing few-row products by column blocks (`LentThreads`) --- */
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <time.h>
#include <unistd.h>

#define SPIN_NS 200000 /* a helper waits this long spinning for its next share, then sleeps */

typedef struct {
  const float *x, *w, *bias;
  float *y;
  int64_t M, N, K, Kp, n0, n1;
} share_t;

typedef struct {
  pthread_t thread;
  pthread_mutex_t mu;
  pthread_cond_t cv;
  atomic_long posted, done; /* the last share handed over / finished; posted < 0: stop */
  atomic_int asleep;
  share_t share;
  const int32_t *cpus; /* the cores it may run on (ncpus of them), or none: any */
  int64_t ncpus;
} helper_t;

typedef struct {
  int64_t count;
  pid_t pid;            /* the process whose helpers these are (a forked child has none) */
  pthread_mutex_t busy; /* one product at a time: another caller computes alone */
  int32_t *cpus;        /* the team's own copy of its cores */
  helper_t h[];
} team_t;

/* columns [n0, n1) of the product: one row through gemv_blocked, more through gemm_blocked;
   either computes each output as it would for the whole product */
static void run_share(const share_t *s) {
  if (s->n1 <= s->n0) return;
  if (s->M == 1)
    gemv_blocked(s->x, s->w + s->n0 * s->Kp, s->bias ? s->bias + s->n0 : 0, s->y + s->n0,
                 s->n1 - s->n0, s->K, s->Kp);
  else
    gemm_blocked(s->x, s->M, s->w, s->bias, s->y, s->N, s->K, s->Kp, s->n0, s->n1);
}

static int64_t now_ns(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

static void relax(void) {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#endif
}

static void *helper_main(void *arg) {
  helper_t *h = arg;
#ifdef __linux__
  if (h->ncpus > 0) {
    cpu_set_t set;
    CPU_ZERO(&set);
    for (int64_t i = 0; i < h->ncpus; i++)
      if (h->cpus[i] >= 0 && h->cpus[i] < CPU_SETSIZE) CPU_SET(h->cpus[i], &set);
    pthread_setaffinity_np(pthread_self(), sizeof set, &set);
  }
#endif
  long seen = 0;
  for (;;) {
    long p = atomic_load_explicit(&h->posted, memory_order_acquire);
    if (p == seen) { /* spin a while: the step's next product comes within microseconds */
      int64_t until = now_ns() + SPIN_NS;
      for (int i = 0; (p = atomic_load_explicit(&h->posted, memory_order_acquire)) == seen; i++) {
        relax();
        if ((i & 63) == 63 && now_ns() > until) break;
      }
    }
    if (p == seen) { /* then sleep until the next share (the core is free for others) */
      pthread_mutex_lock(&h->mu);
      atomic_store(&h->asleep, 1);
      while ((p = atomic_load(&h->posted)) == seen) pthread_cond_wait(&h->cv, &h->mu);
      atomic_store(&h->asleep, 0);
      pthread_mutex_unlock(&h->mu);
    }
    if (p < 0) return 0;
    seen = p;
    run_share(&h->share);
    atomic_store_explicit(&h->done, p, memory_order_release);
  }
}

static void post(helper_t *h, long p) {
  atomic_store(&h->posted, p);
  if (atomic_load(&h->asleep)) {
    pthread_mutex_lock(&h->mu);
    pthread_cond_signal(&h->cv);
    pthread_mutex_unlock(&h->mu);
  }
}

void team_stop(void *team);

/* `count` helper threads, each bound to the `ncpus` cores `cpus` (none: placed by the OS).
   -> the team, or 0 where a thread could not start (none is left running) */
void *team_start(int64_t count, const int32_t *cpus, int64_t ncpus) {
  if (count < 1 || count > 64) return 0;
  team_t *t = calloc(1, sizeof(team_t) + count * sizeof(helper_t));
  if (!t) return 0;
  if (cpus && ncpus > 0) {
    t->cpus = malloc(ncpus * sizeof(int32_t));
    if (!t->cpus) {
      free(t);
      return 0;
    }
    for (int64_t i = 0; i < ncpus; i++) t->cpus[i] = cpus[i];
  }
  t->pid = getpid();
  pthread_mutex_init(&t->busy, 0);
  for (int64_t i = 0; i < count; i++) {
    helper_t *h = &t->h[i];
    pthread_mutex_init(&h->mu, 0);
    pthread_cond_init(&h->cv, 0);
    h->cpus = t->cpus;
    h->ncpus = t->cpus ? ncpus : 0;
    if (pthread_create(&h->thread, 0, helper_main, h) != 0) {
      t->count = i;
      team_stop(t);
      return 0;
    }
    t->count = i + 1;
  }
  return t;
}

/* y [M, N] = x [M, K] @ w^T (+ bias), w blocked: the column blocks split in count + 1 nearly
   equal runs, the first computed by the caller, the others by the helpers */
void team_product(void *team, const float *x, int64_t M, const float *w, const float *bias,
                  float *y, int64_t N, int64_t K, int64_t Kp) {
  team_t *t = team;
  share_t all = {x, w, bias, y, M, N, K, Kp, 0, N};
  if (t->pid != getpid() || pthread_mutex_trylock(&t->busy) != 0) {
    run_share(&all);
    return;
  }
  int64_t parts = t->count + 1, blocks = (N + 63) / 64;
  long ids[64];
  for (int64_t i = 1; i < parts; i++) {
    helper_t *h = &t->h[i - 1];
    h->share = all;
    h->share.n0 = blocks * i / parts * 64 < N ? blocks * i / parts * 64 : N;
    h->share.n1 = blocks * (i + 1) / parts * 64 < N ? blocks * (i + 1) / parts * 64 : N;
    ids[i - 1] = atomic_load(&h->posted) + 1;
    post(h, ids[i - 1]);
  }
  all.n1 = blocks / parts * 64 < N ? blocks / parts * 64 : N;
  run_share(&all);
  for (int64_t i = 1; i < parts; i++)
    while (atomic_load_explicit(&t->h[i - 1].done, memory_order_acquire) != ids[i - 1]) relax();
  pthread_mutex_unlock(&t->busy);
}

/* stop and join the helpers, free the team (in a forked child: only free it) */
void team_stop(void *team) {
  team_t *t = team;
  for (int64_t i = 0; t->pid == getpid() && i < t->count; i++) {
    post(&t->h[i], -1);
    pthread_join(t->h[i].thread, 0);
  }
  free(t->cpus);
  free(t);
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
    ("team_start", (ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64), ctypes.c_void_p),
    (
        "team_product",
        (ctypes.c_void_p,) * 2 + (ctypes.c_int64,) + (ctypes.c_void_p,) * 3
        + (ctypes.c_int64,) * 3,
        None,
    ),
    ("team_stop", (ctypes.c_void_p,), None),
)  # fmt: skip

#: Most rows the few-row C kernel takes on one compute thread; past that, or on more threads,
#: oneDNN. NOTE: on one thread of the 2-core AVX-512 host (Sapphire Rapids, one other process
#: busy), the embedded model's 120 decoder linears measured (medians of seven interleaved runs
#: a side against oneDNN or the 4-row kernel before this one) 50.6-61.3 against 59.9-71.5 ms at
#: 8 rows, 91.7-116.0 against 101.6-122.7 at 32 and 179-210 against 197-233 through oneDNN at
#: 64 (a prompt of 64 tokens); at 96 and 128 rows the two were within 3%. On the 2-core AVX2
#: Zen 3 host (the 8-lane build, weights from DRAM, medians of five): 28.3 against 30.2 ms at
#: one row, 37.3 / 52.5 at 8, 105.4 / 115.9 at 32, 191.5 / 195.6 at 64; the tied LM head
#: (49152 x 576) 10.3 / 13.0 at 8 rows and 50.4 / 51.4 at 64.
FEW_ROWS_MAX = 64


def _gemv_library() -> ctypes.CDLL | None:
    return load_library(
        "gemv", _GEMV_SOURCE, (("-O3", "-pthread", "-D_GNU_SOURCE"),), _GEMV_SIGNATURES
    )


@functools.cache
def few_rows_in_c() -> bool:
    """Whether products of 1 to `FEW_ROWS_MAX` rows take the C kernels on this host (else
    oneDNN takes every product): everywhere but x86-64 below AVX2, where the kernels' plain
    build was never measured against oneDNN's. On AVX2 they are the 8-lane build
    (`cpu_native.vector_lanes`); the 16-lane one ran 5-25x oneDNN's time there (GCC keeps
    16-float vectors on the stack)."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return True
    return torch.backends.cpu.get_cpu_capability() != "DEFAULT"


#: The fewest multiply-adds of a few-row product shared with lent threads (`lending`): below,
#: a share is too short to pay for handing it over (~1 us to a helper still spinning from the
#: last product, some tens of us to wake one).
SHARE_MIN_MACS = 1 << 17


class LentThreads:
    """Threads an engine on one compute thread borrows for some of its steps (`lending`): the
    few-row C kernels split a product's 64-column blocks between the calling thread and a team
    of C helper threads (each output is summed over k in order whoever computes it, so the
    product is the same to the bit as on one thread), and oneDNN's products run on `1 + count`
    OpenMP threads (its blocks of outputs shared out, K whole: equal to the bit on the embedded
    model's shapes on the 2-core AVX-512 host, which a test checks). A helper spins for its next
    share for a while (`SPIN_NS`, a fifth of a millisecond) after each one, so the ~120 products
    of a step each hand over in about a microsecond, then sleeps, leaving the core to others
    between steps."""

    def __init__(self, count: int, cores: tuple[int, ...] | None = None) -> None:
        """`count` threads, bound to `cores` where given (else placed by the OS)."""
        if count < 1:
            raise ValueError(f"LentThreads needs at least one thread, got {count}")
        self.count, self.cores = count, cores
        #: asked before each product that would share: whether the threads may be used now
        #: (None: always; `SpareCores` sets it to its idleness check)
        self.gate: Callable[[], bool] | None = None
        self.shared = 0  # products shared so far
        self._omp_started = False
        self._lib = _gemv_library()
        self._team: int | None = None
        if self._lib is not None:
            cpus = (ctypes.c_int32 * len(cores))(*cores) if cores else None
            self._team = self._lib.team_start(count, cpus, len(cores) if cores else 0) or None

    @contextmanager
    def parallel(self) -> Iterator[None]:
        """torch's intra-op threads raised by `count` within the block. NOTE: OpenMP starts its
        worker threads on the first parallel region and they keep the affinity of the thread
        that started them; an engine bound to its own core would have them share it, so they are
        started once with that thread's affinity widened to the lent cores."""
        self.shared += 1
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

    def product(
        self, rows: torch.Tensor, weight: PackedWeight, bias: int | None, out: torch.Tensor
    ) -> bool:
        """The few-row product of contiguous `rows` into `out`, its column blocks shared with
        the helper team. -> False where there is no team (nothing written)."""
        if self._team is None:
            return False
        self.shared += 1
        self._lib.team_product(self._team, rows.data_ptr(), rows.shape[0], weight.data_ptr,
                               bias, out.data_ptr(), weight.n, weight.k, weight.k_padded)  # fmt: skip
        return True

    def close(self) -> None:
        if self._team is not None:
            self._lib.team_stop(self._team)
            self._team = None


def _share_with(m: int, weight: PackedWeight) -> LentThreads | None:
    """The lent threads this product shares its work with: those of `lending`, where the product
    is big enough to pay for the hand-off and their gate lets it."""
    lent = _LENT.get()
    if lent is None or weight.n <= 64 or m * weight.n * weight.k < SHARE_MIN_MACS:
        return None
    return lent if lent.gate is None or lent.gate() else None


_LENT: ContextVar[LentThreads | None] = ContextVar("loraplex_lent_threads", default=None)


@contextmanager
def lending(threads: LentThreads | None) -> Iterator[None]:
    """Within the block, on an engine of one compute thread, products of at least
    `SHARE_MIN_MACS` multiply-adds share their work with `threads`, through the C helper team
    (1 to `FEW_ROWS_MAX` rows) or oneDNN's OpenMP threads (more; None: none lent)."""
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
    """x @ weight^T (+ bias) on the cached packed copy: as `linear_packed` where oneDNN chose
    the blocked layout, else one row through the C GEMV on the plain weight, more through
    oneDNN."""
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"x [M, K] and weight [N, K] expected, got {x.shape}, {weight.shape}")
    if x.dtype != torch.float32 or weight.dtype != torch.float32:
        raise ValueError(f"fp32 expected, got {x.dtype}, {weight.dtype}")
    if x.device.type != "cpu" or weight.device.type != "cpu":
        raise ValueError("linear_cpu takes CPU tensors")
    if x.shape[0] == 0:
        return x.new_empty(0, weight.shape[0])
    packed = packed_weight(weight)
    if isinstance(packed, PackedWeight):
        return linear_packed(x, packed, bias)
    if x.shape[0] == 1 and few_rows_in_c():
        out = _gemv(x, weight, bias)
        if out is not None:
            return out
    return _onednn(x.contiguous(), packed, bias)


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
    one_thread = torch.get_num_threads() == 1
    few = few_rows_in_c() and (m == 1 or (m <= FEW_ROWS_MAX and one_thread))
    if few and lib is not None and (bias is None or bias.is_contiguous()):
        rows = rows.contiguous()
        out = torch.empty(m, weight.n, dtype=torch.float32)
        b = None if bias is None else bias.data_ptr()
        lent = _share_with(m, weight)
        if lent is not None and lent.product(rows, weight, b, out):
            pass
        elif m == 1:
            lib.gemv_blocked(rows.data_ptr(), weight.data_ptr, b, out.data_ptr(), weight.n,
                             weight.k, weight.k_padded)  # fmt: skip
        else:
            lib.gemm_blocked(rows.data_ptr(), m, weight.data_ptr, b, out.data_ptr(), weight.n,
                             weight.k, weight.k_padded, 0, weight.n)  # fmt: skip
    elif one_thread and (lent := _share_with(m, weight)) is not None:
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
