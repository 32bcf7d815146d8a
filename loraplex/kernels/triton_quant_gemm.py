"""Triton kernels of the W4A16 / W8A16 dequant-GEMM (layout and dispatch: `quant_gemm_w4a16`).

Every kernel loads each int32 word once and unpacks it in registers with shifts and masks. A K
tile never crosses a group, so zero point and scale are applied once per tile to the partial
product: sum_k x_k (q_k - z) s = s (sum_k x_k q_k - z sum_k x_k). The integers q are exact in
the activation dtype; 4-bit values become floats by OR-ing them into the mantissa of a "magic"
constant (no int-to-float conversion), the constant folded into z. Split-K programs add fp32
partials into a workspace with atomics; the last program of a tile writes the output and zeroes
the workspace again, so a call is one launch.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _unpack(q, BITS: tl.constexpr):
    """[KW, BN] int32 words -> [KW, PACK, BN] int32 values (row kw * PACK + p of the tile)."""
    PACK: tl.constexpr = 32 // BITS
    shifts = tl.arange(0, PACK) * BITS
    return (q[:, None, :] >> shifts[None, :, None]) & ((1 << BITS) - 1)


@triton.jit
def _tile_offsets(tile, M, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Token rows and output columns of tile `tile`. The M tiles sharing a weight tile are
    consecutive programs, so the weight tile is read from HBM once."""
    num_pid_m = tl.cdiv(M, BLOCK_M)
    offs_m = (tile % num_pid_m) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = (tile // num_pid_m) * BLOCK_N + tl.arange(0, BLOCK_N)
    return offs_m, offs_n


@triton.jit
def _source_k(perm_ptr, k, HAS_PERM: tl.constexpr):
    """The activation columns of weight rows k: perm[k] with act-order, else k."""
    if HAS_PERM:
        k = tl.load(perm_ptr + k)
    return k


@triton.jit
def _load_words(qw_ptr, k0, offs_w, offs_n, mask_n, stride_qk, BITS: tl.constexpr):
    """The packed int32 words [BLOCK_KW, BLOCK_N] of the K tile starting at feature k0."""
    rows = k0 // (32 // BITS) + offs_w
    return tl.load(
        qw_ptr + rows[:, None] * stride_qk + offs_n[None, :], mask=mask_n[None, :], other=0
    )


@triton.jit
def _load_group(scales_ptr, zeros_ptr, k0, group_size, offs_n, mask_n, stride_sg):
    """Scales and zero points [BLOCK_N] of the group holding feature k0 (a K tile never crosses
    a group), in their stored dtype."""
    g = k0 // group_size
    s = tl.load(scales_ptr + g * stride_sg + offs_n, mask=mask_n, other=0.0)
    z = tl.load(zeros_ptr + g * stride_sg + offs_n, mask=mask_n, other=0.0)
    return s, z


@triton.jit
def _store_tile(
    acc, offs_m, offs_n, mask_m, mask_n, tile, bias_ptr, out_ptr, ws_ptr, lock_ptr,
    N, stride_om, HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr,
):  # fmt: skip
    """Write an fp32 [BM, BN] tile; with split-K, reduce through the workspace first."""
    mask = mask_m[:, None] & mask_n[None, :]
    out_ptrs = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :]
    if HAS_BIAS:
        bias = tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)
    if SPLIT_K == 1:
        if HAS_BIAS:
            acc += bias[None, :]
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        ws_ptrs = ws_ptr + offs_m[:, None] * N + offs_n[None, :]
        tl.atomic_add(ws_ptrs, acc, mask=mask, sem="release")
        tl.debug_barrier()
        # NOTE: the last of the SPLIT_K programs of this tile sees every partial.
        if tl.atomic_add(lock_ptr + tile, 1, sem="acq_rel") == SPLIT_K - 1:
            total = tl.load(ws_ptrs, mask=mask, other=0.0, cache_modifier=".cg")
            if HAS_BIAS:
                total += bias[None, :]
            tl.store(out_ptrs, total.to(out_ptr.dtype.element_ty), mask=mask)
            tl.store(ws_ptrs, tl.zeros_like(total), mask=mask, cache_modifier=".cg")
            tl.atomic_xchg(lock_ptr + tile, 0)


@triton.jit
def _wna16_gemm_kernel(
    x_ptr, qw_ptr, scales_ptr, zeros_ptr, perm_ptr, bias_ptr, out_ptr, ws_ptr, lock_ptr,
    M, N, group_size, k_per_split, stride_xm, stride_qk, stride_sg, stride_om,
    BITS: tl.constexpr, MAGIC: tl.constexpr, OFFSET: tl.constexpr, HAS_PERM: tl.constexpr,
    HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    """Tiled tensor-core kernel: program (tile, split) covers BLOCK_M x BLOCK_N outputs over
    k_per_split features. MAGIC (16-bit pattern) > 0: value v becomes OFFSET + v by bits."""
    BLOCK_KW: tl.constexpr = BLOCK_K // (32 // BITS)
    tile = tl.program_id(0)
    offs_m, offs_n = _tile_offsets(tile, M, BLOCK_M, BLOCK_N)
    mask_m = offs_m < M
    mask_n = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    offs_w = tl.arange(0, BLOCK_KW)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_begin = tl.program_id(1) * k_per_split
    for k0 in range(k_begin, k_begin + k_per_split, BLOCK_K):
        src_k = _source_k(perm_ptr, k0 + offs_k, HAS_PERM)
        x = tl.load(
            x_ptr + offs_m[:, None] * stride_xm + src_k[None, :], mask=mask_m[:, None], other=0.0
        )  # [BLOCK_M, BLOCK_K]
        q = _load_words(qw_ptr, k0, offs_w, offs_n, mask_n, stride_qk, BITS)  # [BLOCK_KW, BLOCK_N]
        v = _unpack(q, BITS)  # [BLOCK_KW, PACK, BLOCK_N]
        if MAGIC > 0:
            w = (v | MAGIC).to(tl.int16).to(x.dtype, bitcast=True)
        else:
            w = v.to(x.dtype)
        part = tl.dot(x, tl.reshape(w, (BLOCK_K, BLOCK_N)), input_precision=DOT_PRECISION)
        s, z = _load_group(scales_ptr, zeros_ptr, k0, group_size, offs_n, mask_n, stride_sg)
        s = s.to(tl.float32)
        z = z.to(tl.float32)
        x_sum = tl.sum(x.to(tl.float32), axis=1)  # [BLOCK_M]
        acc += (part - x_sum[:, None] * (z + OFFSET)[None, :]) * s[None, :]
    _store_tile(
        acc, offs_m, offs_n, mask_m, mask_n, tile, bias_ptr, out_ptr, ws_ptr, lock_ptr,
        N, stride_om, HAS_BIAS, SPLIT_K,
    )  # fmt: skip


@triton.jit
def _wna16_gemv_kernel(
    x_ptr, qw_ptr, scales_ptr, zeros_ptr, perm_ptr, bias_ptr, out_ptr, ws_ptr, lock_ptr,
    N, group_size, k_per_split, stride_xm, stride_qk, stride_sg, stride_om,
    BITS: tl.constexpr, HAS_PERM: tl.constexpr, HAS_BIAS: tl.constexpr,
    SPLIT_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """FMA kernel for one token row per program (axis 2): per-word partial sums stay in
    registers along K and are reduced across threads once, after the loop."""
    PACK: tl.constexpr = 32 // BITS
    BLOCK_KW: tl.constexpr = BLOCK_K // PACK
    pid_n = tl.program_id(0)
    row = tl.program_id(2)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    offs_w = tl.arange(0, BLOCK_KW)
    offs_kp = offs_w[:, None] * PACK + tl.arange(0, PACK)[None, :]  # [BLOCK_KW, PACK]
    acc = tl.zeros((BLOCK_KW, BLOCK_N), dtype=tl.float32)
    k_begin = tl.program_id(1) * k_per_split
    for k0 in range(k_begin, k_begin + k_per_split, BLOCK_K):
        src_k = _source_k(perm_ptr, k0 + offs_kp, HAS_PERM)
        x = tl.load(x_ptr + row * stride_xm + src_k).to(tl.float32)  # [BLOCK_KW, PACK]
        q = _load_words(qw_ptr, k0, offs_w, offs_n, mask_n, stride_qk, BITS)  # [BLOCK_KW, BLOCK_N]
        # NOTE: 2**23 + v as fp32 bits, minus 2**23: exact, and cheaper than I2F.
        v = (_unpack(q, BITS) | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0
        part = tl.sum(v * x[:, :, None], axis=1)  # [BLOCK_KW, BLOCK_N]
        s, z = _load_group(scales_ptr, zeros_ptr, k0, group_size, offs_n, mask_n, stride_sg)
        s = s.to(tl.float32)
        z = z.to(tl.float32)
        x_sum = tl.sum(x, axis=1)  # [BLOCK_KW]
        acc += (part - x_sum[:, None] * z[None, :]) * s[None, :]
    total = tl.sum(acc, axis=0)[None, :]  # [1, BLOCK_N]
    offs_m = row + tl.arange(0, 1)
    tile = row * tl.num_programs(0) + pid_n
    _store_tile(
        total, offs_m, offs_n, offs_m >= 0, mask_n, tile, bias_ptr, out_ptr, ws_ptr, lock_ptr,
        N, stride_om, HAS_BIAS, SPLIT_K,
    )  # fmt: skip


@triton.jit
def _wna16_dequant_kernel(
    qw_ptr, scales_ptr, zeros_ptr, perm_ptr, out_ptr,
    N, group_size, stride_qk, stride_sg, stride_ok,
    BITS: tl.constexpr, HAS_PERM: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """out[k, n] = weight of input feature k (perm applied); one group per K tile."""
    PACK: tl.constexpr = 32 // BITS
    BLOCK_KW: tl.constexpr = BLOCK_K // PACK
    k0 = tl.program_id(0) * BLOCK_K
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    offs_w = tl.arange(0, BLOCK_KW)
    q = _load_words(qw_ptr, k0, offs_w, offs_n, mask_n, stride_qk, BITS)  # [BLOCK_KW, BLOCK_N]
    s, z = _load_group(scales_ptr, zeros_ptr, k0, group_size, offs_n, mask_n, stride_sg)
    s = s.to(tl.float32)
    z = z.to(tl.float32)
    v = _unpack(q, BITS).to(tl.float32)  # [BLOCK_KW, PACK, BLOCK_N]
    w = v * s[None, None, :] - (z * s)[None, None, :]
    rows = k0 + offs_w[:, None] * PACK + tl.arange(0, PACK)[None, :]  # [BLOCK_KW, PACK]
    if HAS_PERM:
        rows = tl.load(perm_ptr + rows)
    out_ptrs = out_ptr + rows[:, :, None] * stride_ok + offs_n[None, None, :]
    tl.store(out_ptrs, w.to(out_ptr.dtype.element_ty), mask=mask_n[None, None, :])
