"""Triton sampling kernels: the seeded Gumbel-max draw of `reference.draw_ref`, with the noise
generated in registers (no [n, vocab] noise tensor), a row split over several programs when
the batch is small; and the fused penalties of `reference.apply_penalties_ref`. Thresholds are
in `triton_truncation`, logprobs in `triton_logprobs`."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from loraplex.kernels.sampling.triton_philox import philox_uniform
from loraplex.kernels.sampling.types import GREEDY_TEMPERATURE, MAX_CHUNKS

_GREEDY = tl.constexpr(GREEDY_TEMPERATURE)
_BLOCK = 1024
_MIN_CHUNK = 2048  # tokens per program at least, when a row is split
# Integer arguments that change with the batch (row count, chunks a row is split over, a
# parity bit, k): Triton would otherwise compile one variant for 1 and one for multiples of 16.
VARYING = ("n", "num_chunks", "parity", "k")
# Per-row parameter columns: their alignment depends on where the input batch's column block
# starts, which need not match the warm-up's tensors; each is one scalar load per row.
COLUMNS = ("temp_ptr", "thresh_ptr", "seed_ptr", "step_ptr", "top_k_ptr", "top_p_ptr",
           "min_p_ptr", "max_ptr", "rep_ptr", "presence_ptr", "freq_ptr", "token_ptr")  # fmt: skip


def jit(kernel):
    """`triton.jit` with no specialisation on the batch-dependent arguments above."""
    names = kernel.__code__.co_varnames[: kernel.__code__.co_argcount]
    return triton.jit(
        do_not_specialize=[a for a in VARYING if a in names],
        do_not_specialize_on_alignment=[a for a in (*VARYING, *COLUMNS) if a in names],
    )(kernel)


_INT32_MAX = tl.constexpr(2**31 - 1)


@jit
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


@jit
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
    return max(1, min(want, triton.cdiv(vocab, _MIN_CHUNK), MAX_CHUNKS))


def draw_triton(
    logits: torch.Tensor,  # [n, vocab] fp32, unit stride along vocab
    temperature: torch.Tensor,  # [n] fp32
    thresholds: torch.Tensor | None,  # [n] fp32
    seeds: torch.Tensor,  # [n] int64
    steps: torch.Tensor,  # [n] int64
    num_chunks: int | None = None,
) -> torch.Tensor:
    """`reference.draw_ref` in Triton. -> [n] int64"""
    n, vocab = logits.shape
    if logits.stride(1) != 1:
        raise ValueError("logits must have unit stride along the vocabulary")
    if seeds.dtype != torch.int64 or steps.dtype != torch.int64:
        raise ValueError(f"seeds and steps must be int64, got {seeds.dtype}, {steps.dtype}")
    if not 0 < vocab < 2**31 - _BLOCK:
        raise ValueError(f"vocab must be in [1, 2**31 - {_BLOCK}), got {vocab}")
    chunks = min(num_chunks or num_chunks_for(n, vocab, logits.device), MAX_CHUNKS)
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
    _reduce_kernel[(n,)](best_v, best_i, out, chunks, BLOCK_C=MAX_CHUNKS)
    return out


# -- penalties ------------------------------------------------------------------------------


@jit
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
    """`reference.apply_penalties_ref` in one pass. -> a new [n, vocab] fp32 tensor"""
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
