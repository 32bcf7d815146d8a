"""Triton truncation thresholds: `reference.truncation_thresholds_ref` (top-k, then top-p
within it, then min-p, as one logit threshold per row) without sorting."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from loraplex.kernels.sampling.triton_sampling import jit, num_chunks_for
from loraplex.kernels.sampling.types import GREEDY_TEMPERATURE, MAX_CHUNKS, NUM_PIVOTS_BY_SIZE

# Each row's top-k / top-p threshold is found by a search over the 2**32 ordered keys of fp32
# values (`_key`: monotone in the value), NP - 1 pivots per pass: a pass counts (top-k) or sums
# the masses exp((l - max) / T) (top-p) of the tokens above each pivot, in every program of the
# row over its chunk, and the next pass (or the finishing launch) adds the programs' partial
# sums and narrows [lo, hi] to the two pivots around the boundary; after `search_passes(NP)`
# passes hi is the threshold's key. Top-k is searched first, then top-p within it (its total
# mass, the sum above the initial lo, comes from slot 0 of the first top-p pass). Rows need
# no host reads: a row that has converged (or needs no search) skips its remaining passes.

_GREEDY = tl.constexpr(GREEDY_TEMPERATURE)
_K_PHASE = tl.constexpr(0)
_P_PHASE = tl.constexpr(1)
_DONE = tl.constexpr(2)
_KEY_LO = tl.constexpr(-(2**31))  # below the key of every value but NaN


@triton.jit
def _key(x):
    bits = x.to(tl.int32, bitcast=True)
    return tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)


@triton.jit
def _value(key):
    return tl.where(key >= 0, key, key ^ 0x7FFFFFFF).to(tl.float32, bitcast=True)


@triton.jit
def _pivots(lo, hi, NP: tl.constexpr):
    # slot 0: lo itself; slots 1..NP-1 split (lo, hi) evenly. -> [NP] int64
    j = tl.arange(0, NP).to(tl.int64)
    return lo + ((hi - lo) * j) // NP


@triton.jit
def _pivot_sums(
    row_ptr, start, end, lo, hi, m, inv_t, count, NP: tl.constexpr, BLOCK: tl.constexpr
):
    # Over tokens [start, end): per pivot (slot 0: lo), how many tokens (count) or how much
    # mass exp((l - m) / T) lies above it. -> [NP] fp32
    # NOTE: [NP, BLOCK] tiles, tokens along the fast axis: each thread compares its own tokens
    # with every pivot, with no exchange of tokens between threads.
    pivot = _pivots(lo, hi, NP).to(tl.int32)[:, None]  # [NP, 1]
    lane = tl.arange(0, BLOCK)[None, :]  # [1, BLOCK]
    acc = tl.zeros([NP, BLOCK], tl.float32)
    if count:
        for base in range(start, end, BLOCK):
            idx = base + lane
            logit = tl.load(row_ptr + idx, mask=idx < end, other=float("-inf"))
            weight = tl.where(idx < end, 1.0, 0.0)
            acc += tl.where(_key(logit) > pivot, weight, 0.0)
    else:
        for base in range(start, end, BLOCK):
            idx = base + lane
            logit = tl.load(row_ptr + idx, mask=idx < end, other=float("-inf"))
            weight = tl.where(idx < end, tl.exp((logit - m) * inv_t), 0.0)
            acc += tl.where(_key(logit) > pivot, weight, 0.0)
    return tl.sum(acc, axis=1)


@triton.jit
def _narrow(f, lo, hi, target, NP: tl.constexpr):
    # f[j]: the weight above pivot j. -> the pivots (lo, hi) around the boundary: the smallest
    # pivot under the target (fewer than k tokens / less than p of the mass above it) and the
    # largest one not under it
    pivot = _pivots(lo, hi, NP)
    inner = tl.arange(0, NP) > 0
    new_hi = tl.min(tl.where(inner & (f < target), pivot, hi), axis=0)
    new_lo = tl.max(tl.where(inner & (f >= target), pivot, lo), axis=0)
    return new_lo, new_hi


@triton.jit
def _first(f, NP: tl.constexpr):
    return tl.sum(tl.where(tl.arange(0, NP) == 0, f, 0.0), axis=0)


@triton.jit
def _threshold(hi, searched, m, t, min_p, SEARCH: tl.constexpr):
    # The row's threshold: the searched key's value (when a search ran), min-p's bound.
    tau = float("-inf")
    if SEARCH:
        tau = tl.where(searched, _value(hi.to(tl.int32)), tau)
    t_safe = tl.where(t >= _GREEDY, t, 1.0)
    tau_m = tl.where(min_p > 0.0, m + t_safe * tl.log(tl.maximum(min_p, 1e-30)), tau)
    return tl.where(t >= _GREEDY, tl.maximum(tau, tau_m), float("-inf"))  # greedy: unused


@jit
def _min_p_kernel(
    logits_ptr, stride_l, temp_ptr, min_p_ptr, thresh_ptr, vocab, BLOCK: tl.constexpr
):
    # No row has top-k or top-p: one launch, a program a row, its max and min-p's bound.
    row = tl.program_id(0).to(tl.int64)
    row_ptr = logits_ptr + row * stride_l
    top = tl.full([BLOCK], float("-inf"), tl.float32)
    for base in range(0, vocab, BLOCK):
        idx = base + tl.arange(0, BLOCK)
        top = tl.maximum(top, tl.load(row_ptr + idx, mask=idx < vocab, other=float("-inf")))
    m = tl.max(top, axis=0)
    t = tl.load(temp_ptr + row)
    min_p = tl.load(min_p_ptr + row)
    tl.store(thresh_ptr + row, _threshold(m, False, m, t, min_p, False))


@jit
def _search_kernel(
    logits_ptr, stride_l, max_ptr, temp_ptr, top_k_ptr, top_p_ptr, min_p_ptr,
    lo_ptr, hi_ptr, phase_ptr, target_ptr, part_ptr, thresh_ptr,
    n, vocab, chunk, num_chunks, parity,
    FIRST: tl.constexpr, FINISH: tl.constexpr,
    NP: tl.constexpr, BLOCK: tl.constexpr, BLOCK_C: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    part = tl.program_id(1)
    m = tl.load(max_ptr + row)
    t = tl.load(temp_ptr + row)
    k = tl.load(top_k_ptr + row)
    p = tl.load(top_p_ptr + row)
    p_on = p < 1.0
    # state buffers [2, n]: this launch reads slot `parity`, writes slot 1 - parity
    src = parity * n + row
    dst = (1 - parity) * n + row
    if FIRST:
        searched = (t >= _GREEDY) & (m > float("-inf"))
        phase = tl.where(searched & p_on, _P_PHASE, _DONE)
        phase = tl.where(searched & (k > 0) & (k < vocab), _K_PHASE, phase).to(tl.int32)
        lo = tl.full([], _KEY_LO, tl.int64)
        hi = _key(m).to(tl.int64)
        # top-k: k tokens; top-p: unknown until the first pass has summed the mass (< 0)
        target = tl.where(phase == _K_PHASE, k.to(tl.float32), -1.0)
    else:
        phase = tl.load(phase_ptr + src)
        lo = tl.load(lo_ptr + src)
        hi = tl.load(hi_ptr + src)
        target = tl.load(target_ptr + src)
        fresh = target < 0.0  # a top-p phase whose total mass is not known yet
        if phase != _DONE:
            # add the partial sums of the previous pass -> f[j]: weight above pivot j
            c = tl.arange(0, BLOCK_C)[:, None]
            j = tl.arange(0, NP)[None, :]
            prev = part_ptr + ((parity * n + row) * num_chunks) * NP
            f = tl.sum(tl.load(prev + c * NP + j, mask=c < num_chunks, other=0.0), axis=0)
            if phase == _P_PHASE:
                target = tl.where(fresh, p * _first(f, NP), target)
            lo, hi = _narrow(f, lo, hi, target, NP)
            if hi - lo <= 1:
                if (phase == _K_PHASE) & p_on:
                    # top-p within the top-k: search above the k-th value
                    phase = tl.full([], _P_PHASE, tl.int32)
                    hi = _key(m).to(tl.int64)
                    target = tl.full([], -1.0, tl.float32)
                else:
                    phase = tl.full([], _DONE, tl.int32)
    if FINISH:
        searched = (phase == _DONE) & (((k > 0) & (k < vocab)) | p_on)
        min_p = tl.load(min_p_ptr + row)
        tl.store(thresh_ptr + row, _threshold(hi, searched, m, t, min_p, True))
    else:
        if part == 0:
            tl.store(phase_ptr + dst, phase)
            tl.store(lo_ptr + dst, lo)
            tl.store(hi_ptr + dst, hi)
            tl.store(target_ptr + dst, target)
        if phase != _DONE:
            start = part * chunk
            end = tl.minimum(start + chunk, vocab)
            f = _pivot_sums(
                logits_ptr + row * stride_l, start, end, lo, hi, m, 1.0 / t,
                phase == _K_PHASE, NP, BLOCK,
            )  # fmt: skip
            out = part_ptr + (((1 - parity) * n + row) * num_chunks + part) * NP
            tl.store(out + tl.arange(0, NP), f)


def search_passes(num_pivots: int) -> int:
    """Passes after which (NP - 1) pivots a pass have narrowed 2**32 keys to one, per phase."""
    passes, width = 0, 2**32
    while width > 1:
        width = -(-width // num_pivots)
        passes += 1
    return passes


def truncation_thresholds_triton(
    logits: torch.Tensor,  # [n, vocab] fp32, unit stride along vocab
    temperature: torch.Tensor,  # [n] fp32
    top_k: torch.Tensor,  # [n] int32
    top_p: torch.Tensor,  # [n] fp32
    min_p: torch.Tensor,  # [n] fp32
    search: bool = True,
    both: bool = True,
    num_chunks: int | None = None,
    num_pivots: int | None = None,
) -> torch.Tensor:
    """`reference.truncation_thresholds_ref` in Triton, without sorting. `search=False` (no
    row has top-k or top-p) computes min-p alone; `both=False` (no row has top-k and top-p)
    launches one phase of passes instead of two. -> [n] fp32"""
    n, vocab = logits.shape
    if logits.stride(1) != 1:
        raise ValueError("logits must have unit stride along the vocabulary")
    dev = logits.device
    out = torch.empty(n, dtype=torch.float32, device=dev)
    if n == 0:
        return out
    columns = (
        temperature.float().contiguous(), top_k.int().contiguous(),
        top_p.float().contiguous(), min_p.float().contiguous(),
    )  # fmt: skip
    if not search:
        _min_p_kernel[(n,)](
            logits, logits.stride(0), columns[0], columns[3], out, vocab, BLOCK=2048, num_warps=8
        )
        return out
    size = n * vocab
    row_max = logits.max(dim=-1).values  # [n]
    if num_pivots is None:
        num_pivots = next((np_ for limit, np_ in NUM_PIVOTS_BY_SIZE if size <= limit), 8)
    block = 16384 // num_pivots
    chunks = min(num_chunks or num_chunks_for(n, vocab, dev), MAX_CHUNKS)
    chunk = triton.cdiv(triton.cdiv(vocab, chunks), block) * block
    chunks = triton.cdiv(vocab, chunk)
    lo = torch.empty(2, n, dtype=torch.int64, device=dev)
    hi = torch.empty(2, n, dtype=torch.int64, device=dev)
    phase = torch.empty(2, n, dtype=torch.int32, device=dev)
    target = torch.empty(2, n, dtype=torch.float32, device=dev)
    partials = torch.empty(2, n, chunks, num_pivots, dtype=torch.float32, device=dev)
    passes = (2 if both else 1) * search_passes(num_pivots)

    def launch(grid, parity: int, first: bool, finish: bool) -> None:
        _search_kernel[grid](
            logits, logits.stride(0), row_max, *columns, lo, hi, phase, target, partials, out,
            n, vocab, chunk, chunks, parity,
            FIRST=first, FINISH=finish, NP=num_pivots, BLOCK=block,
            BLOCK_C=MAX_CHUNKS, num_warps=8,
        )  # fmt: skip

    for i in range(passes):
        launch((n, chunks), i % 2, i == 0, False)
    launch((n, 1), passes % 2, passes == 0, True)
    return out
