"""Rotary embedding and the KV-cache write on CPU in C: `rotary.rotary_write_kv_ref`, bit for bit.

In torch, one layer's rotary and KV write is a dozen small ops (gather the cos/sin rows, cat q
and k, two chunks, four multiplies, two adds, a cat, two index copies, a contiguous copy); at
batch 1 each costs tens of microseconds of dispatch for a few hundred floats, ~9 ms of a ~110 ms
decode step over the embedded model's 30 layers (benchmarks/results/cpu_step_profile.json). One
C call per layer does the same float operations in the same order (`-ffp-contract=off`: no
fused multiply-add, so every element rounds as torch's does).

fp32 only (the CPU engine's dtype); q, k and v may be strided views of the fused qkv projection
(unit stride along head_dim). Built and loaded by `cpu_native`; where it cannot be built, or for
other dtypes and layouts, the caller keeps the torch path.
"""

from __future__ import annotations

import ctypes

import torch

from loraplex.kernels.cpu_native import load_library

_SOURCE = """
#include <stdint.h>

static void rotate(const float *x, const float *cs, int64_t half, float *out) {
  const float *sn = cs + half;
  for (int64_t i = 0; i < half; i++) {
    float x1 = x[i], x2 = x[i + half];
    out[i] = x1 * cs[i] - x2 * sn[i];
    out[i + half] = x2 * cs[i] + x1 * sn[i];
  }
}

/* -> 0, or -1 when a position or a slot is out of range (nothing past it is written) */
int rotary_write_kv(const int64_t *positions, int64_t num_tokens, int64_t max_positions,
                    const float *cache, int64_t head_dim, const float *q, int64_t q_token,
                    int64_t q_head, int64_t num_heads, const float *k, int64_t k_token,
                    int64_t k_head, const float *v, int64_t v_token, int64_t v_head,
                    int64_t num_kv_heads, const int64_t *slots, int64_t num_slots,
                    float *k_cache, float *v_cache, float *q_out) {
  int64_t half = head_dim / 2, slot_size = num_kv_heads * head_dim;
  for (int64_t t = 0; t < num_tokens; t++) {
    int64_t pos = positions[t], slot = slots[t];
    if (pos < 0 || pos >= max_positions || slot >= num_slots) return -1;
    const float *cs = cache + pos * head_dim;
    for (int64_t h = 0; h < num_heads; h++)
      rotate(q + t * q_token + h * q_head, cs, half, q_out + (t * num_heads + h) * head_dim);
    if (slot < 0) continue; /* padding */
    for (int64_t h = 0; h < num_kv_heads; h++) {
      rotate(k + t * k_token + h * k_head, cs, half, k_cache + slot * slot_size + h * head_dim);
      const float *vs = v + t * v_token + h * v_head;
      float *vd = v_cache + slot * slot_size + h * head_dim;
      for (int64_t i = 0; i < head_dim; i++) vd[i] = vs[i];
    }
  }
  return 0;
}
"""

# NOTE: -ffp-contract=off keeps a * b - c * d as two roundings and a subtraction, as torch.
_FLAG_SETS = (("-O3", "-ffp-contract=off"),)
_I64, _PTR = ctypes.c_int64, ctypes.c_void_p
_ARGS = (_PTR, _I64, _I64, _PTR, _I64, _PTR, _I64, _I64, _I64, _PTR, _I64, _I64, _PTR, _I64,
         _I64, _I64, _PTR, _I64, _PTR, _PTR, _PTR)  # fmt: skip
_SIGNATURES = (("rotary_write_kv", _ARGS, ctypes.c_int),)


def load() -> ctypes.CDLL | None:
    """The compiled library (built on first use), or None where it cannot be built."""
    return load_library("rotary", _SOURCE, _FLAG_SETS, _SIGNATURES)


def supports(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: torch.Tensor,
    k_cache: torch.Tensor, v_cache: torch.Tensor,
) -> bool:  # fmt: skip
    """Whether the C kernel takes these: fp32 CPU tensors of matching shapes, unit stride along
    head_dim, an even head_dim, contiguous cos/sin and KV caches."""
    # NOTE: called per layer per step: few, cheap attribute reads (each costs ~0.5 us here)
    f32 = torch.float32
    return (
        q.dtype == k.dtype == v.dtype == cache.dtype == k_cache.dtype == v_cache.dtype == f32
        and q.is_cpu
        and k.is_cpu
        and v.is_cpu
        and cache.is_cpu
        and k_cache.is_cpu
        and v_cache.is_cpu
        and q.dim() == k.dim() == v.dim() == 3
        and k_cache.dim() == 4
        and q.stride(2) == k.stride(2) == v.stride(2) == 1
        and k.shape == v.shape
        and k_cache.shape == v_cache.shape
        and k_cache.shape[2:] == k.shape[1:]
        and q.shape[0] == k.shape[0]
        and q.shape[2] == k.shape[2] == cache.shape[-1]
        and q.shape[2] % 2 == 0
        and k_cache.is_contiguous()
        and v_cache.is_contiguous()
        and cache.is_contiguous()
    )


def rotary_write_kv_c(
    positions: torch.Tensor,  # [num_tokens] int
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim] fp32
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim] fp32
    v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim] fp32
    cache: torch.Tensor,  # [max_positions, head_dim] fp32
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim] fp32
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [num_tokens] int, -1 = padding (skipped)
) -> torch.Tensor | None:
    """`rotary_write_kv_ref` in one C call (`supports` must hold). -> the rotated q
    [num_tokens, num_heads, head_dim] (new, contiguous), or None where the library cannot load.
    Raises IndexError for a position or slot out of range, as torch's indexing does."""
    lib = load()
    if lib is None:
        return None
    num_tokens, num_heads, head_dim = q.shape
    positions = positions.to(torch.int64).contiguous()
    slots = slot_mapping.to(torch.int64).contiguous()
    out = torch.empty(num_tokens, num_heads, head_dim, dtype=torch.float32)
    status = lib.rotary_write_kv(
        positions.data_ptr(), num_tokens, cache.shape[0], cache.data_ptr(), head_dim,
        q.data_ptr(), q.stride(0), q.stride(1), num_heads,
        k.data_ptr(), k.stride(0), k.stride(1), v.data_ptr(), v.stride(0), v.stride(1),
        k.shape[1], slots.data_ptr(), k_cache.shape[0] * k_cache.shape[1],
        k_cache.data_ptr(), v_cache.data_ptr(), out.data_ptr(),
    )  # fmt: skip
    if status != 0:
        raise IndexError("rotary_write_kv: a position or a KV slot is out of range")
    return out
