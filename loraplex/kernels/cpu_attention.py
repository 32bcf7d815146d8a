"""Paged attention over the block-table KV cache on CPU in C (fp32), decode and short prefills.

In torch, a decode step's attention is a gather of every sequence's K and V out of the cache, a
padded mask and one `scaled_dot_product_attention`; at 32 sequences of ~60 tokens that was
14-17 ms of an 82-98 ms step over the embedded model's 30 layers
(benchmarks/cpu_step_profile.py). This kernel reads each query's context in place through the
block table: for every query row and head, the scores against each cached position up to the
row's own (causal), a max-subtracted softmax, and the weighted sum of V, with a query head's
K / V head shared by its group (GQA). Sums over head_dim run in the host's vector lanes (16 floats, 8 on
x86-64 without AVX-512: `cpu_native.vector_lanes`) added up in a fixed tree, so the result does
not depend on what shares the batch.

Sequences with a query longer than `MAX_QUERY_LEN` tokens are left to the caller (torch's SDPA
does a long prefill's quadratic work faster). Built and loaded by `cpu_native` (one build per
host, dispatching to AVX-512, AVX2 or plain code at load); where it cannot be built the caller
keeps the torch path.
"""

from __future__ import annotations

import ctypes

import torch

from loraplex.kernels.cpu_native import VECTOR_PRELUDE, load_library

#: Sequences with more query tokens than this are skipped by the kernel.
MAX_QUERY_LEN = 64

_SOURCE = (
    VECTOR_PRELUDE
    + r"""
#include <math.h>
#include <stdlib.h>

/* out[:n] = sum over positions l < len of w[l] * v[slot(l), :n], v's rows slot_size apart;
   LANES columns at a time in registers, two accumulators over alternate positions */
INLINE void weighted_sum(const float *w, int64_t len, const float *v, const int32_t *table,
                         int64_t block_size, int64_t slot_size, int64_t n, float *out) {
  int64_t d = 0;
  for (; d + LANES <= n; d += LANES) {
    vec a0 = {0}, a1 = {0};
    for (int64_t l0 = 0; l0 < len; l0 += block_size) {
      const float *vb = v + table[l0 / block_size] * block_size * slot_size + d;
      int64_t m = len - l0 < block_size ? len - l0 : block_size, o = 0;
      for (; o + 2 <= m; o += 2) {
        a0 += w[l0 + o] * *(const vec *)(vb + o * slot_size);
        a1 += w[l0 + o + 1] * *(const vec *)(vb + (o + 1) * slot_size);
      }
      if (o < m) a0 += w[l0 + o] * *(const vec *)(vb + o * slot_size);
    }
    *(vec *)(out + d) = a0 + a1;
  }
  for (; d < n; d++) {
    float a = 0.0f;
    for (int64_t l = 0; l < len; l++)
      a += w[l] * v[(table[l / block_size] * block_size + l % block_size) * slot_size + d];
    out[d] = a;
  }
}

/* out [T, H, D] for every query row of every sequence whose query is at most max_query_len
   tokens (other rows are not written). q [T, H, D], caches [num_blocks * block_size, Hk, D],
   all contiguous. -> 0, -1 when a block id is out of range, -2 without memory */
CLONES int paged_attention(const float *q, float *out, int64_t num_heads, int64_t num_kv_heads,
                    int64_t head_dim, const float *k_cache, const float *v_cache,
                    int64_t block_size, int64_t num_blocks, const int32_t *query_start_loc,
                    const int32_t *seq_lens, int64_t num_seqs, const int32_t *block_tables,
                    int64_t max_blocks, int64_t max_seq_len, int64_t max_query_len,
                    float scale) {
  int64_t group = num_heads / num_kv_heads, slot_size = num_kv_heads * head_dim;
  float *scores = malloc(sizeof(float) * (max_seq_len > 0 ? max_seq_len : 1));
  if (!scores) return -2;
  for (int64_t i = 0; i < num_seqs; i++) {
    int64_t start = query_start_loc[i], qlen = query_start_loc[i + 1] - start;
    int64_t ctx = seq_lens[i];
    if (qlen < 1 || qlen > max_query_len) continue;
    if (ctx > max_seq_len || ctx > max_blocks * block_size || qlen > ctx) {
      free(scores);
      return -1;
    }
    const int32_t *table = block_tables + i * max_blocks;
    for (int64_t b = 0; b * block_size < ctx; b++)
      if (table[b] < 0 || table[b] >= num_blocks) { free(scores); return -1; }
    for (int64_t j = 0; j < qlen; j++) {
      int64_t len = ctx - qlen + j + 1; /* positions 0 .. own */
      for (int64_t h = 0; h < num_heads; h++) {
        const float *qh = q + ((start + j) * num_heads + h) * head_dim;
        int64_t kv_off = (h / group) * head_dim;
        float mx = -INFINITY;
        for (int64_t l0 = 0; l0 < len; l0 += block_size) { /* block by block: no division */
          const float *kb = k_cache + table[l0 / block_size] * block_size * slot_size + kv_off;
          int64_t n = len - l0 < block_size ? len - l0 : block_size;
          for (int64_t o = 0; o < n; o++) {
            float s = dot(qh, kb + o * slot_size, head_dim) * scale;
            scores[l0 + o] = s;
            if (s > mx) mx = s;
          }
        }
        float sum = 0.0f;
        for (int64_t l = 0; l < len; l++) {
          scores[l] = expf(scores[l] - mx);
          sum += scores[l];
        }
        float *oh = out + ((start + j) * num_heads + h) * head_dim;
        weighted_sum(scores, len, v_cache + kv_off, table, block_size, slot_size, head_dim, oh);
        float inv = 1.0f / sum;
        for (int64_t d = 0; d < head_dim; d++) oh[d] *= inv;
      }
    }
  }
  free(scores);
  return 0;
}
"""
)
_FLAG_SETS = (("-O3",),)
_SIGNATURES = (
    (
        "paged_attention",
        (ctypes.c_void_p,) * 2 + (ctypes.c_int64,) * 3 + (ctypes.c_void_p,) * 2
        + (ctypes.c_int64,) * 2 + (ctypes.c_void_p,) * 2 + (ctypes.c_int64,) + (ctypes.c_void_p,)
        + (ctypes.c_int64,) * 3 + (ctypes.c_float,),
        ctypes.c_int,
    ),
)  # fmt: skip


def load() -> ctypes.CDLL | None:
    return load_library("paged_attention", _SOURCE, _FLAG_SETS, _SIGNATURES)


def supports(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """Whether `paged_attention_c` takes these tensors: fp32 on CPU, contiguous, matching heads."""
    return (
        q.device.type == "cpu"
        and q.dtype == k_cache.dtype == v_cache.dtype == torch.float32
        and q.dim() == 3
        and k_cache.dim() == 4
        and k_cache.shape == v_cache.shape
        and q.shape[2] == k_cache.shape[3]
        and q.shape[1] % k_cache.shape[2] == 0
        and q.is_contiguous()
        and k_cache.is_contiguous()
        and v_cache.is_contiguous()
    )


def paged_attention_c(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim] fp32
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim] fp32
    v_cache: torch.Tensor,
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32
    scale: float,
    max_seq_len: int,
    out: torch.Tensor,  # [num_tokens, num_heads, head_dim] fp32, contiguous
) -> bool:
    """Write `out`'s rows of every sequence whose query is at most MAX_QUERY_LEN tokens
    (`supports` must hold). -> False where the library cannot load (nothing written). Raises
    IndexError for a block id or a length out of range."""
    lib = load()
    if lib is None:
        return False
    qsl = query_start_loc.to(torch.int32).contiguous()
    lens = seq_lens.to(torch.int32).contiguous()
    tables = block_tables.to(torch.int32).contiguous()
    num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
    status = lib.paged_attention(
        q.data_ptr(), out.data_ptr(), q.shape[1], num_kv_heads, head_dim,
        k_cache.data_ptr(), v_cache.data_ptr(), block_size, num_blocks,
        qsl.data_ptr(), lens.data_ptr(), lens.shape[0], tables.data_ptr(), tables.shape[1],
        max_seq_len, MAX_QUERY_LEN, scale,
    )  # fmt: skip
    if status == -2:
        raise MemoryError("paged_attention: no memory for the scores")
    if status != 0:
        raise IndexError("paged_attention: a block id or a sequence length is out of range")
    return True
