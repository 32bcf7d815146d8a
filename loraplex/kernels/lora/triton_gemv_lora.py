"""One token through a dense weight and its adapter in one launch: `y = x @ W^T (+ bias)` plus
every slice's `scaling * (x @ A^T) @ B^T` (DoRA: the column rescaled).

At batch 1 a projection is a pure read of its weight (`triton_gemv`), and a LoRA pair or the
one-launch decode kernel after it costs microseconds of launch and latency for a few hundred
kilobytes. Here the GEMV's programs carry the adapter:

- the first `num_splits` programs are shrink items: a chunk of the input features -> its partial
  `t` of every slice into the workspace (`[num_splits, 1, width]` rows), then one count on the
  layer's counter;
- every later program owns `BLOCK_N` output rows: it loads what its rows need of the adapter
  (slice, rank, scaling, B rows: a chain of dependent loads, issued before the weight stream so
  it runs behind it), streams their weight slab as the plain GEMV does, then waits until every
  shrink item has counted (by then, almost always, long done), sums the partials of its rows'
  slice and adds `scaling * t @ B^T` for those rows.

Only the shrink items touch the counter with atomics: thousands of GEMV programs each taking an
arrival ticket and counting its end on one address (as the decode kernel does for its few dozen
programs) measured slower than the GEMV followed by the decode kernel. So the roles follow the
program index (the GPU starts a grid's programs in index order, so the shrink items run first;
the polls are bounded, so a broken order shows as a wrong result, not a hang), the waits are
plain polling loads whose value gates the loads of `t`, and the caller zeroes the counter
before each launch (`LoRABatchMeta.set`, once a step, one counter per layer).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from loraplex.kernels.gemv import GemvConfig
from loraplex.kernels.lora.triton_common import (
    dora_args,
    dora_combine,
    offsets_tensor,
    pad,
    row_lora_delta,
    row_lora_operands,
    shrink_item,
    split_k,
)
from loraplex.kernels.lora.types import LoRAKernelConfig, LoRAKernelMeta, LoRAStack
from loraplex.kernels.triton_gemv import gemv_rows

# NOTE: bounds the polls of the shrink counter, so that a broken counter shows as a wrong
# result instead of a hang (the shrink items end within microseconds).
_MAX_POLLS = 1 << 16


@triton.jit
def _gemv_lora_kernel(
    x_ptr, w_ptr, bias_ptr, out_ptr, a_ptr, b_ptr, t_ptr, count_ptr, slots_ptr, rank_ptr,
    scaling_ptr, offsets_ptr, g_ptr,
    N, K, k_per_split,
    stride_wn, stride_as, stride_ar, stride_bs, stride_br, stride_tm, stride_rs, stride_gs,
    MAX_RANK: tl.constexpr, RANK_PAD: tl.constexpr, WIDTH_PAD: tl.constexpr,
    NUM_SLICES: tl.constexpr, NUM_SPLITS: tl.constexpr, SHRINK_BLOCK_K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    DORA: tl.constexpr, EVEN_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    MAX_POLLS: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    slot = tl.load(slots_ptr)
    if pid < NUM_SPLITS:
        if slot >= 0:
            k_lo = pid * k_per_split
            shrink_item(x_ptr, a_ptr, rank_ptr, t_ptr + pid.to(tl.int64) * stride_tm, slot, k_lo,
                        tl.minimum(k_lo + k_per_split, K), stride_as, stride_ar, stride_rs,
                        MAX_RANK, NUM_SLICES, WIDTH_PAD, SHRINK_BLOCK_K)  # fmt: skip
        # NOTE: every thread's stores before one release: the barrier, then the counter
        tl.debug_barrier()
        tl.atomic_add(count_ptr, 1, sem="release")
    else:
        rows = (pid - NUM_SPLITS) * BLOCK_N + tl.arange(0, BLOCK_N)
        row_ok = rows < N
        # NOTE: before the weight stream, so their dependent loads hide behind it
        safe_slice, in_lora, r_mask, scaling, b = row_lora_operands(
            offsets_ptr, rank_ptr, scaling_ptr, b_ptr, rows, row_ok, slot, stride_rs, stride_bs,
            stride_br, NUM_SLICES, RANK_PAD)  # fmt: skip
        bias = 0.0
        if HAS_BIAS:
            bias = tl.load(bias_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)
        if DORA:
            g = tl.load(g_ptr + tl.maximum(slot, 0).to(tl.int64) * stride_gs + rows,
                        mask=in_lora, other=1.0)  # fmt: skip
        y = gemv_rows(x_ptr, w_ptr, rows, row_ok, K, stride_wn, EVEN_K, BLOCK_N, BLOCK_K)
        if HAS_BIAS:
            y += bias
        if slot >= 0:
            delta = row_lora_delta(t_ptr, count_ptr, safe_slice, r_mask, scaling, b, stride_tm,
                                   MAX_RANK, RANK_PAD, NUM_SPLITS, MAX_POLLS)  # fmt: skip
            if DORA:
                y = dora_combine(y, delta, g, bias)
            else:
                y += delta
        tl.store(out_ptr + rows, y.to(out_ptr.dtype.element_ty), mask=row_ok)


def gemv_lora(
    x: torch.Tensor,  # [1, in]
    weight: torch.Tensor,  # [N, in]
    bias: torch.Tensor | None,  # [N] or None; also DoRA's base bias
    lora: LoRAStack,
    meta: LoRAKernelMeta,
    workspace: torch.Tensor,  # [rows, >= num_slices * max_rank] fp32
    counter: torch.Tensor,  # [1] int32, zero before the launch; the shrink items count on it
    gemv: GemvConfig,
    config: LoRAKernelConfig,
    out: torch.Tensor | None = None,  # [1, N] in x's dtype, else allocated
) -> torch.Tensor:  # out
    """The token's base product and its adapter's delta in one launch (DoRA needs `bias` to be
    the stack's base bias)."""
    n, k = weight.shape
    if counter.shape != (1,) or counter.dtype != torch.int32:
        raise ValueError("lora: the fused GEMV's counter must be int32 [1]")
    if lora.dora_scale is not None and lora.base_bias is not bias:
        raise ValueError("lora: a DoRA stack's base bias must be the GEMV's bias")
    splits = min(triton.cdiv(k, config.decode_k_per_split), config.max_splits, workspace.shape[0])
    splits, k_per_split = split_k(k, splits, config.decode_block_k)
    if out is None:
        out = torch.empty((1, n), dtype=x.dtype, device=x.device)
    width_pad = pad(lora.num_slices * lora.max_rank)
    a, b_t, t = lora.a, lora.b_t, workspace
    (g, _), flags = dora_args(lora)
    _gemv_lora_kernel[(splits + triton.cdiv(n, gemv.block_n),)](
        x, weight, bias if bias is not None else out, out, a, b_t, t, counter,
        meta.lora_slots, lora.ranks, lora.scaling, offsets_tensor(lora.slice_offsets, x.device),
        g, n, k, k_per_split,
        weight.stride(0), a.stride(0), a.stride(1), b_t.stride(0), b_t.stride(1), t.stride(0),
        lora.ranks.stride(0), g.stride(0),
        MAX_RANK=lora.max_rank, RANK_PAD=pad(lora.max_rank), WIDTH_PAD=width_pad,
        NUM_SLICES=lora.num_slices, NUM_SPLITS=splits, SHRINK_BLOCK_K=config.decode_block_k,
        HAS_BIAS=bias is not None, DORA=flags["DORA"], EVEN_K=k % gemv.block_k == 0,
        BLOCK_N=gemv.block_n, BLOCK_K=gemv.block_k, MAX_POLLS=_MAX_POLLS,
        num_warps=gemv.num_warps, num_stages=gemv.num_stages,
    )  # fmt: skip
    return out
