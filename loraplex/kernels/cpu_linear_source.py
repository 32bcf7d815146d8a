"""The C source of the CPU linears (`cpu_linear` builds and calls it): the one-row GEMV on a
plain or oneDNN-blocked weight, the few-row GEMM on the blocked layout in two builds (AVX-512's
16-lane tiles, AVX2's 8-lane strips; `cpu_native.vector_lanes` picks), and the team of helper
threads that shares a product's column blocks (`cpu_linear.LentThreads`)."""

from __future__ import annotations

import ctypes

from loraplex.kernels.cpu_native import VECTOR_PRELUDE

GEMV_SOURCE = (
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
GEMV_SIGNATURES = (
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
