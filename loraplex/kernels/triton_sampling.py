"""Triton sampling kernels: the seeded Gumbel-max draw of `sampling.draw_ref`, with the noise
generated in registers (no [n, vocab] noise tensor), a row split over several programs when
the batch is small."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from loraplex.kernels.sampling import GREEDY_TEMPERATURE
from loraplex.kernels.triton_philox import philox_uniform

_GREEDY = tl.constexpr(GREEDY_TEMPERATURE)
_BLOCK = 1024
_MIN_CHUNK = 2048  # tokens per program at least, when a row is split
_INT32_MAX = tl.constexpr(2**31 - 1)


@triton.jit
def _draw_kernel(
    logits_ptr, stride_l, temp_ptr, thresh_ptr, seed_ptr, step_ptr, best_v_ptr, best_i_ptr,
    vocab, chunk, num_chunks,
    HAS_THRESH: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    # One program: tokens [start, start + chunk) of one row -> its best score and token.
    row = tl.program_id(0).to(tl.int64)
    part = tl.program_id(1)
    start = part * chunk
    end = tl.minimum(start + chunk, vocab)
    lane = tl.arange(0, BLOCK)
    row_ptr = logits_ptr + row * stride_l
    t = tl.load(temp_ptr + row)
    best_v = tl.full([BLOCK], float("-inf"), tl.float32)
    best_i = start + lane
    if t < _GREEDY:
        for base in range(start, end, BLOCK):
            idx = base + lane
            score = tl.load(row_ptr + idx, mask=idx < end, other=float("-inf"))
            better = score > best_v
            best_v = tl.where(better, score, best_v)
            best_i = tl.where(better, idx, best_i)
    else:
        inv_t = 1.0 / t
        seed = tl.load(seed_ptr + row)
        step = tl.load(step_ptr + row)
        tau = float("-inf")
        if HAS_THRESH:
            tau = tl.load(thresh_ptr + row)
        for base in range(start, end, BLOCK):
            idx = base + lane
            logit = tl.load(row_ptr + idx, mask=idx < end, other=float("-inf"))
            u = philox_uniform(seed, step, idx)
            score = logit * inv_t - tl.log(-tl.log(u))
            score = tl.where((logit >= tau) & (idx < end), score, float("-inf"))
            better = score > best_v
            best_v = tl.where(better, score, best_v)
            best_i = tl.where(better, idx, best_i)
    top = tl.max(best_v, axis=0)
    # NOTE: the smallest index among the lanes holding the maximum: torch.argmax's tie rule.
    token = tl.min(tl.where(best_v == top, best_i, _INT32_MAX), axis=0)
    tl.store(best_v_ptr + row * num_chunks + part, top)
    tl.store(best_i_ptr + row * num_chunks + part, token.to(tl.int64))


@triton.jit
def _reduce_kernel(best_v_ptr, best_i_ptr, out_ptr, num_chunks, BLOCK_C: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, BLOCK_C)
    v = tl.load(best_v_ptr + row * num_chunks + c, mask=c < num_chunks, other=float("-inf"))
    i = tl.load(best_i_ptr + row * num_chunks + c, mask=c < num_chunks, other=2**62)
    top = tl.max(v, axis=0)
    tl.store(out_ptr + row, tl.min(tl.where(v == top, i, 2**62), axis=0))


def num_chunks_for(n: int, vocab: int, device: torch.device) -> int:
    """How many programs split each row: enough for ~2 programs per SM, >= _MIN_CHUNK each."""
    sms = (
        torch.cuda.get_device_properties(device).multi_processor_count
        if device.type == "cuda"
        else 8
    )
    want = triton.cdiv(2 * sms, max(n, 1))
    return max(1, min(want, triton.cdiv(vocab, _MIN_CHUNK)))


def draw_triton(
    logits: torch.Tensor,  # [n, vocab] fp32, unit stride along vocab
    temperature: torch.Tensor,  # [n] fp32
    thresholds: torch.Tensor | None,  # [n] fp32
    seeds: torch.Tensor,  # [n] int64
    steps: torch.Tensor,  # [n] int64
    num_chunks: int | None = None,
) -> torch.Tensor:
    """`sampling.draw_ref` in Triton. -> [n] int64"""
    n, vocab = logits.shape
    if logits.stride(1) != 1:
        raise ValueError("logits must have unit stride along the vocabulary")
    if seeds.dtype != torch.int64 or steps.dtype != torch.int64:
        raise ValueError(f"seeds and steps must be int64, got {seeds.dtype}, {steps.dtype}")
    if not 0 < vocab < 2**31 - _BLOCK:
        raise ValueError(f"vocab must be in [1, 2**31 - {_BLOCK}), got {vocab}")
    chunks = num_chunks or num_chunks_for(n, vocab, logits.device)
    chunk = triton.cdiv(triton.cdiv(vocab, chunks), _BLOCK) * _BLOCK
    chunks = triton.cdiv(vocab, chunk)  # every program starts inside the row
    best_v = torch.empty(n, chunks, dtype=torch.float32, device=logits.device)
    best_i = torch.empty(n, chunks, dtype=torch.int64, device=logits.device)
    if n == 0:
        return best_i[:, 0]
    temperature = temperature.float().contiguous()
    _draw_kernel[(n, chunks)](
        logits, logits.stride(0), temperature,
        temperature if thresholds is None else thresholds.float().contiguous(),
        seeds.contiguous(), steps.contiguous(), best_v, best_i, vocab, chunk, chunks,
        HAS_THRESH=thresholds is not None, BLOCK=_BLOCK,
    )  # fmt: skip
    if chunks == 1:
        return best_i[:, 0]
    out = torch.empty(n, dtype=torch.int64, device=logits.device)
    _reduce_kernel[(n,)](best_v, best_i, out, chunks, BLOCK_C=triton.next_power_of_2(chunks))
    return out


# -- penalties ------------------------------------------------------------------------------


@triton.jit
def _penalties_kernel(
    logits_ptr, stride_l, counts_ptr, stride_c, prompt_ptr, stride_p, out_ptr, stride_o,
    rep_ptr, presence_ptr, freq_ptr, vocab,
    HAS_PROMPT: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    idx = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = idx < vocab
    logit = tl.load(logits_ptr + row * stride_l + idx, mask=mask, other=0.0)
    count = tl.load(counts_ptr + row * stride_c + idx, mask=mask, other=0)
    occurs = count > 0
    if HAS_PROMPT:
        seen = occurs | (tl.load(prompt_ptr + row * stride_p + idx, mask=mask, other=0) != 0)
        rep = tl.load(rep_ptr + row)
        # NOTE: div_rn, the correctly rounded division torch uses (Triton's `/` may not be)
        scaled = tl.where(logit > 0, tl.math.div_rn(logit, rep), logit * rep)
        logit = tl.where(seen, scaled, logit)
    logit = logit - tl.load(freq_ptr + row) * count.to(tl.float32)
    logit = logit - tl.load(presence_ptr + row) * occurs.to(tl.float32)
    tl.store(out_ptr + row * stride_o + idx, logit, mask=mask)


def apply_penalties_triton(
    logits: torch.Tensor,  # [n, vocab] fp32
    output_counts: torch.Tensor,  # [n, vocab] int32
    prompt_mask: torch.Tensor | None,  # [n, vocab] bool
    repetition_penalty: torch.Tensor,  # [n] fp32
    presence_penalty: torch.Tensor,  # [n] fp32
    frequency_penalty: torch.Tensor,  # [n] fp32
) -> torch.Tensor:
    """`sampling.apply_penalties_ref` in one pass. -> a new [n, vocab] fp32 tensor"""
    n, vocab = logits.shape
    for t in (logits, output_counts, prompt_mask):
        if t is not None and t.stride(1) != 1:
            raise ValueError("penalty inputs must have unit stride along the vocabulary")
    if output_counts.dtype != torch.int32:
        raise ValueError(f"output_counts must be int32, got {output_counts.dtype}")
    out = torch.empty(n, vocab, dtype=torch.float32, device=logits.device)
    if n == 0:
        return out
    block = 2048
    prompt = prompt_mask.view(torch.uint8) if prompt_mask is not None else output_counts
    _penalties_kernel[(n, triton.cdiv(vocab, block))](
        logits, logits.stride(0), output_counts, output_counts.stride(0),
        prompt, prompt.stride(0), out, out.stride(0),
        repetition_penalty.float().contiguous(), presence_penalty.float().contiguous(),
        frequency_penalty.float().contiguous(), vocab,
        HAS_PROMPT=prompt_mask is not None, BLOCK=block,
    )  # fmt: skip
    return out


# -- truncation thresholds ------------------------------------------------------------------
#
# Each row's top-k / top-p threshold is found by a search over the 2**32 ordered keys of fp32
# values (`_key`: monotone in the value), NP - 1 pivots per pass: a pass counts (top-k) or sums
# the masses exp((l - max) / T) (top-p) of the tokens above each pivot, in every program of the
# row over its chunk, and the next pass (or the finishing launch) adds the programs' partial
# sums and narrows [lo, hi] to the two pivots around the boundary; after `search_passes(NP)`
# passes hi is the threshold's key. Top-k is searched first, then top-p within it (its total
# mass, the sum above the initial lo, comes from slot 0 of the first top-p pass). Rows need
# no host reads: a row that has converged (or needs no search) skips its remaining passes.

_K_PHASE = tl.constexpr(0)
_P_PHASE = tl.constexpr(1)
_DONE = tl.constexpr(2)
_KEY_LO = tl.constexpr(-(2**31))  # below the key of every value but NaN
_ROW_SEARCH_MAX = 2**20  # logits (n * vocab) up to which one program searches a whole row


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


@triton.jit
def _search_row_kernel(
    logits_ptr, stride_l, temp_ptr, top_k_ptr, top_p_ptr, min_p_ptr, thresh_ptr, vocab,
    SEARCH: tl.constexpr, NP: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    # One program searches one whole row, all passes in one launch (small batches).
    row = tl.program_id(0).to(tl.int64)
    row_ptr = logits_ptr + row * stride_l
    top = tl.full([BLOCK], float("-inf"), tl.float32)
    for base in range(0, vocab, BLOCK):
        idx = base + tl.arange(0, BLOCK)
        top = tl.maximum(top, tl.load(row_ptr + idx, mask=idx < vocab, other=float("-inf")))
    m = tl.max(top, axis=0)
    t = tl.load(temp_ptr + row)
    k = tl.load(top_k_ptr + row)
    p = tl.load(top_p_ptr + row)
    inv_t = 1.0 / tl.where(t >= _GREEDY, t, 1.0)
    live = (t >= _GREEDY) & (m > float("-inf"))
    k_on = live & (k > 0) & (k < vocab)
    p_on = live & (p < 1.0)
    lo = tl.full([], _KEY_LO, tl.int64)
    hi = _key(m).to(tl.int64)
    if SEARCH:
        if k_on:
            while hi - lo > 1:
                f = _pivot_sums(row_ptr, 0, vocab, lo, hi, m, inv_t, True, NP, BLOCK)
                lo, hi = _narrow(f, lo, hi, k.to(tl.float32), NP)
        if p_on:
            hi = _key(m).to(tl.int64)  # top-p within the top-k: above the k-th value
            f = _pivot_sums(row_ptr, 0, vocab, lo, hi, m, inv_t, False, NP, BLOCK)
            target = p * _first(f, NP)  # slot 0: the mass above lo, all the top-k's
            lo, hi = _narrow(f, lo, hi, target, NP)
            while hi - lo > 1:
                f = _pivot_sums(row_ptr, 0, vocab, lo, hi, m, inv_t, False, NP, BLOCK)
                lo, hi = _narrow(f, lo, hi, target, NP)
    min_p = tl.load(min_p_ptr + row)
    tl.store(thresh_ptr + row, _threshold(hi, k_on | p_on, m, t, min_p, SEARCH))


@triton.jit
def _search_kernel(
    logits_ptr, stride_l, max_ptr, temp_ptr, top_k_ptr, top_p_ptr, min_p_ptr,
    lo_ptr, hi_ptr, phase_ptr, target_ptr, part_ptr, thresh_ptr,
    n, vocab, chunk, num_chunks, parity,
    FIRST: tl.constexpr, FINISH: tl.constexpr, SEARCH: tl.constexpr,
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
        phase = tl.full([], _DONE, tl.int32)
        if SEARCH:
            searched = (t >= _GREEDY) & (m > float("-inf"))
            phase = tl.where(searched & p_on, _P_PHASE, phase)
            phase = tl.where(searched & (k > 0) & (k < vocab), _K_PHASE, phase)
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
        tl.store(thresh_ptr + row, _threshold(hi, searched, m, t, min_p, SEARCH))
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
    num_chunks: int | None = None,
    num_pivots: int | None = None,
) -> torch.Tensor:
    """`sampling.truncation_thresholds_ref` in Triton, without sorting. `search=False` (no
    row has top-k or top-p) computes min-p alone. -> [n] fp32"""
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
    size = n * vocab
    if size <= _ROW_SEARCH_MAX and num_chunks is None:
        # NOTE: a small batch is bound by launches: one program a row, every pass in one launch
        _search_row_kernel[(n,)](
            logits, logits.stride(0), *columns, out, vocab,
            SEARCH=search, NP=16, BLOCK=1024, num_warps=8,
        )  # fmt: skip
        return out
    row_max = logits.max(dim=-1).values  # [n]
    if num_pivots is None:
        # NOTE: measured on the H200 (benchmarks/results/h200_sampler.json): a full batch is
        # compute-bound (8 pivots: 11 passes a phase); a small one is bound by launches
        num_pivots = 64 if size <= 2**20 else 16 if size <= 2**23 else 8
    block = 16384 // num_pivots
    chunks = num_chunks or num_chunks_for(n, vocab, dev)
    chunk = triton.cdiv(triton.cdiv(vocab, chunks), block) * block
    chunks = triton.cdiv(vocab, chunk)
    lo = torch.empty(2, n, dtype=torch.int64, device=dev)
    hi = torch.empty(2, n, dtype=torch.int64, device=dev)
    phase = torch.empty(2, n, dtype=torch.int32, device=dev)
    target = torch.empty(2, n, dtype=torch.float32, device=dev)
    partials = torch.empty(2, n, chunks, num_pivots, dtype=torch.float32, device=dev)
    passes = 2 * search_passes(num_pivots) if search else 0

    def launch(grid, parity: int, first: bool, finish: bool) -> None:
        _search_kernel[grid](
            logits, logits.stride(0), row_max, *columns, lo, hi, phase, target, partials, out,
            n, vocab, chunk, chunks, parity,
            FIRST=first, FINISH=finish, SEARCH=search, NP=num_pivots, BLOCK=block,
            BLOCK_C=triton.next_power_of_2(chunks), num_warps=8,
        )  # fmt: skip

    for i in range(passes):
        launch((n, chunks), i % 2, i == 0, False)
    launch((n, 1), passes % 2, passes == 0, True)
    return out


# -- logprobs -------------------------------------------------------------------------------

_BIG_INDEX = tl.constexpr(2**31 - 1)


@triton.jit
def _take_top(values, ids, top_v, top_i, K: tl.constexpr):
    # Merge a block's K best (value, id) into the running best [K] (which holds the K best
    # seen so far, any order): each round moves the block's best into the running worst slot.
    slots = tl.arange(0, K)
    for _ in tl.static_range(K):
        best = tl.max(values, axis=0)
        best_id = tl.min(tl.where(values == best, ids, _BIG_INDEX), axis=0)
        worst = tl.min(top_v, axis=0)
        worst_slot = tl.min(tl.where(top_v == worst, slots, K), axis=0)
        hit = (slots == worst_slot) & (top_v < best)
        top_v = tl.where(hit, best, top_v)
        top_i = tl.where(hit, best_id, top_i)
        values = tl.where(ids == best_id, float("-inf"), values)
    return top_v, top_i


@triton.jit
def _logprobs_kernel(
    logits_ptr, stride_l, token_ptr, part_m_ptr, part_s_ptr, part_rank_ptr, part_v_ptr,
    part_i_ptr, vocab, chunk, num_chunks, K: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    # One program: tokens [start, start + chunk) of a row -> its max, sum of exp(l - max),
    # number of tokens above the sampled one, and its K best tokens.
    row = tl.program_id(0).to(tl.int64)
    part = tl.program_id(1)
    row_ptr = logits_ptr + row * stride_l
    chosen = tl.load(row_ptr + tl.load(token_ptr + row))
    start = part * chunk
    end = tl.minimum(start + chunk, vocab)
    lane = tl.arange(0, BLOCK)
    m = tl.full([], float("-inf"), tl.float32)
    s = tl.zeros([], tl.float32)
    above = tl.zeros([], tl.int32)
    top_v = tl.full([K], float("-inf"), tl.float32)
    top_i = tl.full([K], _BIG_INDEX, tl.int32)
    for base in range(start, end, BLOCK):
        idx = base + lane
        x = tl.load(row_ptr + idx, mask=idx < end, other=float("-inf"))
        new_m = tl.maximum(m, tl.max(x, axis=0))
        scale = tl.where(m == float("-inf"), 0.0, tl.exp(m - new_m))
        s = s * scale + tl.sum(tl.where(x == float("-inf"), 0.0, tl.exp(x - new_m)), axis=0)
        m = new_m
        above += tl.sum((x > chosen).to(tl.int32), axis=0)
        if tl.max(x, axis=0) > tl.min(top_v, axis=0):
            top_v, top_i = _take_top(x, idx, top_v, top_i, K)
    at = row * num_chunks + part
    tl.store(part_m_ptr + at, m)
    tl.store(part_s_ptr + at, s)
    tl.store(part_rank_ptr + at, above)
    tl.store(part_v_ptr + at * K + tl.arange(0, K), top_v)
    tl.store(part_i_ptr + at * K + tl.arange(0, K), top_i)


@triton.jit
def _logprobs_combine_kernel(
    logits_ptr, stride_l, token_ptr, part_m_ptr, part_s_ptr, part_rank_ptr, part_v_ptr,
    part_i_ptr, token_lp_ptr, rank_ptr, top_id_ptr, top_lp_ptr, num_chunks, k,
    K: tl.constexpr, BLOCK_C: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, BLOCK_C)
    at = row * num_chunks + c
    pm = tl.load(part_m_ptr + at, mask=c < num_chunks, other=float("-inf"))
    ps = tl.load(part_s_ptr + at, mask=c < num_chunks, other=0.0)
    m = tl.max(pm, axis=0)
    s = tl.sum(tl.where(pm == float("-inf"), 0.0, ps * tl.exp(pm - m)), axis=0)
    lse = m + tl.log(s)
    rank = tl.sum(tl.load(part_rank_ptr + at, mask=c < num_chunks, other=0), axis=0) + 1
    chosen = tl.load(logits_ptr + row * stride_l + tl.load(token_ptr + row))
    tl.store(token_lp_ptr + row, chosen - lse)
    tl.store(rank_ptr + row, rank.to(tl.int64))
    # the K best of the chunks' candidates, best first
    cand = (row * num_chunks) * K + tl.arange(0, BLOCK_C * K)
    valid = tl.arange(0, BLOCK_C * K) < num_chunks * K
    values = tl.load(part_v_ptr + cand, mask=valid, other=float("-inf"))
    ids = tl.load(part_i_ptr + cand, mask=valid, other=_BIG_INDEX)
    for r in tl.static_range(K):
        best = tl.max(values, axis=0)
        best_id = tl.min(tl.where(values == best, ids, _BIG_INDEX), axis=0)
        if r < k:
            tl.store(top_lp_ptr + row * k + r, best - lse)
            tl.store(top_id_ptr + row * k + r, best_id.to(tl.int64))
        values = tl.where(ids == best_id, float("-inf"), values)


def logprobs_triton(
    logits: torch.Tensor,  # [n, vocab] fp32, unit stride along vocab
    token_ids: torch.Tensor,  # [n] int64
    k: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """`sampling.logprobs_ref` in two launches. -> token logprobs [n], ranks [n] int64, top-k
    ids [n, k] int64 and logprobs [n, k]"""
    n, vocab = logits.shape
    if logits.stride(1) != 1:
        raise ValueError("logits must have unit stride along the vocabulary")
    dev = logits.device
    token_lp = torch.empty(n, dtype=torch.float32, device=dev)
    ranks = torch.empty(n, dtype=torch.int64, device=dev)
    top_ids = torch.empty(n, k, dtype=torch.int64, device=dev)
    top_lp = torch.empty(n, k, dtype=torch.float32, device=dev)
    if n == 0:
        return token_lp, ranks, top_ids, top_lp
    kp = triton.next_power_of_2(max(k, 1))
    chunks = num_chunks_for(n, vocab, dev)
    chunk = triton.cdiv(triton.cdiv(vocab, chunks), _BLOCK) * _BLOCK
    chunks = triton.cdiv(vocab, chunk)
    part_m = torch.empty(n, chunks, dtype=torch.float32, device=dev)
    part_s = torch.empty(n, chunks, dtype=torch.float32, device=dev)
    part_rank = torch.empty(n, chunks, dtype=torch.int32, device=dev)
    part_v = torch.empty(n, chunks, kp, dtype=torch.float32, device=dev)
    part_i = torch.empty(n, chunks, kp, dtype=torch.int32, device=dev)
    tokens = token_ids.contiguous()
    parts = (part_m, part_s, part_rank, part_v, part_i)
    _logprobs_kernel[(n, chunks)](
        logits, logits.stride(0), tokens, *parts, vocab, chunk, chunks, K=kp, BLOCK=_BLOCK
    )
    _logprobs_combine_kernel[(n,)](
        logits, logits.stride(0), tokens, *parts, token_lp, ranks, top_ids, top_lp, chunks, k,
        K=kp, BLOCK_C=triton.next_power_of_2(chunks),
    )  # fmt: skip
    return token_lp, ranks, top_ids, top_lp
