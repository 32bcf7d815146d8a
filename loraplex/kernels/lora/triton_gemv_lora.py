"""One token through a dense weight and its adapter in one launch: `y = x @ W^T (+ bias)` plus
every slice's `scaling * (x @ A^T) @ B^T` (DoRA: the column rescaled).

At batch 1 a projection is a pure read of its weight (`triton_gemv`), and a LoRA pair or the
one-launch decode kernel after it costs microseconds of launch and latency for a few hundred
kilobytes. Here the GEMV's programs carry the adapter:

- the first programs are the shrink: the slot's A rows (`num_slices * max_rank` of them, the
  columns of `t`) are `BLOCK_N` more rows of the GEMV, streamed as the weight is, so `t` is
  whole when they end (no partials to sum); each then counts once on the layer's counter;
- every later program owns `BLOCK_N` output rows: it loads what its rows need of the adapter
  (slice, rank, scaling, B rows: a chain of dependent loads, issued before the weight stream so
  it runs behind it), streams their weight slab as the plain GEMV does, then waits until every
  shrink program has counted (by then, almost always, long done), loads its rows' slice of `t`
  and adds `scaling * t @ B^T` for those rows.

Only the shrink programs touch the counter with atomics: thousands of GEMV programs each taking
an arrival ticket and counting its end on one address measured slower than the GEMV followed by
the decode kernel. So the roles follow the program index (the GPU starts a grid's programs in
index order, so the shrink runs in the first wave; the polls are bounded, so a broken order
shows as a wrong result, not a hang), the wait is a plain polling load whose value gates the
load of `t`, and the caller zeroes the counter before each launch (`LoRABatchMeta.set`, once a
step, one counter per layer).

NOTE: measured on the H200 at batch 1 (`python -m benchmarks.lora_kernels`, time added to a
Llama-3.1-8B layer by the four fused projections): 18.1 us when the shrink was split over the
input features (work items of 256 features whose partials every output program summed;
`h200_lora_fused_w4a16.json`), 15.8 us with the shrink as rows of the GEMV
(`h200_lora_fused_shrink_rows.json`), 12.2 us with down_proj's tiles below
(`h200_lora_fused_final.json`). Loading the adapter's operands after the weight stream
instead of before, all in one round trip with the counter, was 2.1-2.5 us a layer slower in a
side-by-side comparison, so they stay before it.
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
)
from loraplex.kernels.lora.types import LoRAKernelMeta, LoRAStack
from loraplex.kernels.triton_gemv import gemv_rows

#: (out_features, in_features) -> the fused kernel's GEMV tiles where they differ from the plain
#: GEMV's (`kernels.gemv.GEMV_CONFIGS`). NOTE: Llama-3.1-8B's down_proj with 32 rows a program
#: instead of 16 took 31.0 against 34.4 us a layer (plain GEMV 28.9) in two side-by-side runs on
#: the H200, and the fused layer went from 15.8 to 12.2 us added (`h200_lora_fused_final.json`);
#: wider tiles lost on the other projections.
FUSED_GEMV_CONFIGS: dict[tuple[int, int], GemvConfig] = {
    (4096, 14336): GemvConfig(32, 1024, 8, 2),
}

# NOTE: bounds the polls of the shrink counter, so that a broken counter shows as a wrong
# result instead of a hang (the shrink programs end with the first wave).
_MAX_POLLS = 1 << 16


@triton.jit
def _gemv_lora_kernel(
    x_ptr, w_ptr, bias_ptr, out_ptr, a_ptr, b_ptr, t_ptr, count_ptr, slots_ptr, rank_ptr,
    scaling_ptr, offsets_ptr, g_ptr, N, K,
    stride_wn, stride_as, stride_ar, stride_bs, stride_br, stride_rs, stride_gs,
    MAX_RANK: tl.constexpr, RANK_PAD: tl.constexpr, NUM_SLICES: tl.constexpr,
    SHRINK_PROGRAMS: tl.constexpr, HAS_BIAS: tl.constexpr, DORA: tl.constexpr,
    EVEN_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, MAX_POLLS: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    slot = tl.load(slots_ptr)
    if pid < SHRINK_PROGRAMS:
        if slot >= 0:
            cols = pid * BLOCK_N + tl.arange(0, BLOCK_N)  # t column: slice * MAX_RANK + r
            col_ok = cols < NUM_SLICES * MAX_RANK
            a_slot = a_ptr + slot.to(tl.int64) * stride_as
            t = gemv_rows(x_ptr, a_slot, cols, col_ok, K, stride_ar, EVEN_K, BLOCK_N, BLOCK_K)
            rank = tl.load(rank_ptr + (cols // MAX_RANK) * stride_rs + slot, mask=col_ok,
                           other=0)  # fmt: skip
            tl.store(t_ptr + cols, tl.where(cols % MAX_RANK < rank, t, 0.0), mask=col_ok)
        # NOTE: every thread's stores before one release: the barrier, then the counter
        tl.debug_barrier()
        tl.atomic_add(count_ptr, 1, sem="release")
    else:
        rows = (pid - SHRINK_PROGRAMS) * BLOCK_N + tl.arange(0, BLOCK_N)
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
            delta = row_lora_delta(t_ptr, count_ptr, safe_slice, r_mask, scaling, b, MAX_RANK,
                                   RANK_PAD, SHRINK_PROGRAMS, MAX_POLLS)  # fmt: skip
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
    workspace: torch.Tensor,  # [rows, >= num_slices * max_rank] fp32; row 0 takes t
    counter: torch.Tensor,  # [1] int32, zero before the launch; the shrink programs count on it
    gemv: GemvConfig,
    out: torch.Tensor | None = None,  # [1, N] in x's dtype, else allocated
) -> torch.Tensor:  # out
    """The token's base product and its adapter's delta in one launch (DoRA needs `bias` to be
    the stack's base bias)."""
    n, k = weight.shape
    if counter.shape != (1,) or counter.dtype != torch.int32:
        raise ValueError("lora: the fused GEMV's counter must be int32 [1]")
    if lora.dora_scale is not None and lora.base_bias is not bias:
        raise ValueError("lora: a DoRA stack's base bias must be the GEMV's bias")
    if out is None:
        out = torch.empty((1, n), dtype=x.dtype, device=x.device)
    a, b_t, t = lora.a, lora.b_t, workspace
    (g, _), flags = dora_args(lora)
    shrink_programs = triton.cdiv(lora.num_slices * lora.max_rank, gemv.block_n)
    _gemv_lora_kernel[(shrink_programs + triton.cdiv(n, gemv.block_n),)](
        x, weight, bias if bias is not None else out, out, a, b_t, t, counter,
        meta.lora_slots, lora.ranks, lora.scaling, offsets_tensor(lora.slice_offsets, x.device),
        g, n, k,
        weight.stride(0), a.stride(0), a.stride(1), b_t.stride(0), b_t.stride(1),
        lora.ranks.stride(0), g.stride(0),
        MAX_RANK=lora.max_rank, RANK_PAD=pad(lora.max_rank), NUM_SLICES=lora.num_slices,
        SHRINK_PROGRAMS=shrink_programs, HAS_BIAS=bias is not None, DORA=flags["DORA"],
        EVEN_K=k % gemv.block_k == 0, BLOCK_N=gemv.block_n, BLOCK_K=gemv.block_k,
        MAX_POLLS=_MAX_POLLS, num_warps=gemv.num_warps, num_stages=gemv.num_stages,
    )  # fmt: skip
    return out
