"""The sampling family in plain torch: the functions the Triton kernels (`triton_*`) and the C
twin (`cpu_philox`) compute, bit for bit where the tests say so; CPU serving runs them.

Truncation keeps, in each row, the tokens whose logit is >= the row's threshold:
- top-k: the k-th largest logit (ties at it are kept);
- top-p (after top-k, on softmax(logits / T) renormalised over the top-k): the lowest logit v
  whose strictly-higher tokens hold less than top_p of the mass, i.e. the smallest set of
  most likely tokens whose mass reaches top_p (ties at its edge are kept);
- min-p: tokens with p >= min_p * p_max, i.e. logit >= max + T * log(min_p).
The draw is argmax(logit / T + Gumbel(seed, step, token)) over the kept tokens, which samples
softmax(logit / T) renormalised over them exactly; a row whose temperature is below
GREEDY_TEMPERATURE takes the argmax of its logits (the first one on ties, as torch.argmax).
The noise is Philox4x32-10 (`types` says how it is keyed).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from loraplex.kernels.sampling.types import (
    GREEDY_TEMPERATURE,
    PHILOX_KEY_A,
    PHILOX_KEY_B,
    PHILOX_ROUND_A,
    PHILOX_ROUND_B,
    PHILOX_ROUNDS,
    UNIFORM_OFFSET,
    UNIFORM_SCALE,
    UNIFORM_SHIFT,
)

_M32 = 0xFFFFFFFF
_NEG_INF = float("-inf")


def _mulhilo(a: int, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """High and low 32 bits of a * b, for a 32-bit constant a and b holding uint32 values in
    int64. NOTE: the product can pass 2**63; int64 multiplication wraps modulo 2**64 (two's
    complement) on CPU and CUDA, so its 64 bits are exact, and the masks drop the sign
    extension of the shift (the Random123 known answers in tests/kernels/test_philox.py
    check it)."""
    product = b * a
    return (product >> 32) & _M32, product & _M32


def philox4x32_ref(
    c0: torch.Tensor, c1: torch.Tensor, c2: torch.Tensor, c3: torch.Tensor,
    k0: torch.Tensor, k1: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """Philox4x32-10 of counters (c0..c3) under keys (k0, k1): int64 tensors holding uint32
    values (broadcastable); returns the four output words the same way."""
    for _ in range(PHILOX_ROUNDS):
        hi_b, lo_b = _mulhilo(PHILOX_ROUND_B, c2)
        hi_a, lo_a = _mulhilo(PHILOX_ROUND_A, c0)
        c0, c1, c2, c3 = hi_b ^ c1 ^ k0, lo_b, hi_a ^ c3 ^ k1, lo_a
        k0 = (k0 + PHILOX_KEY_A) & _M32
        k1 = (k1 + PHILOX_KEY_B) & _M32
    return c0, c1, c2, c3


def philox_uniform_ref(
    seeds: torch.Tensor,  # [n] int64
    steps: torch.Tensor,  # [n] int64
    vocab: int,
) -> torch.Tensor:
    """The uniforms of tokens 0..vocab-1 for each row's (seed, step). -> [n, vocab] fp32"""
    if seeds.dim() != 1 or seeds.shape != steps.shape:
        raise ValueError(f"seeds and steps must be [n], got {seeds.shape}, {steps.shape}")
    seeds, steps = seeds.long()[:, None], steps.long()[:, None]  # [n, 1]
    num_counters = (vocab + 3) // 4
    counter = torch.arange(num_counters, dtype=torch.int64, device=seeds.device)[None, :]
    words = philox4x32_ref(
        counter, steps & _M32, (steps >> 32) & _M32, torch.zeros_like(counter),
        seeds & _M32, (seeds >> 32) & _M32,
    )  # fmt: skip
    x = torch.stack(words, dim=-1).flatten(1)[:, :vocab]  # [n, vocab]: token t is word t % 4
    return uniform_from_word(x)


def uniform_from_word(x: torch.Tensor) -> torch.Tensor:
    """The uniform in [2**-24, 1 - 2**-24] of each Philox output word (uint32 in int64),
    exactly. -> fp32, x's shape"""
    return (x >> UNIFORM_SHIFT).to(torch.float32) * UNIFORM_SCALE + UNIFORM_OFFSET


def gumbel_(uniform: torch.Tensor) -> torch.Tensor:
    """Gumbel(0, 1) noise from uniforms in (0, 1): -log(-log(u)), in place (no new tensor).
    -> `uniform`, overwritten, fp32"""
    return uniform.log_().neg_().log_().neg_()


def _safe_temperature(temperature: torch.Tensor) -> torch.Tensor:
    """Greedy rows count as T = 1 where a temperature scales logits (their draw ignores it)."""
    return torch.where(temperature < GREEDY_TEMPERATURE, 1.0, temperature.float())


def apply_penalties_ref(
    logits: torch.Tensor,  # [n, vocab] fp32
    output_counts: torch.Tensor,  # [n, vocab] int32
    prompt_mask: torch.Tensor | None,  # [n, vocab] bool; None: no repetition penalty
    repetition_penalty: torch.Tensor,  # [n] fp32
    presence_penalty: torch.Tensor,  # [n] fp32
    frequency_penalty: torch.Tensor,  # [n] fp32
) -> torch.Tensor:
    """Repetition, then frequency and presence penalties (OpenAI's and vLLM's definitions).
    -> a new [n, vocab] tensor

    repetition_penalty r divides a positive logit of a token seen in the prompt or the output
    by r and multiplies a non-positive one by r; presence_penalty is subtracted once from a
    token that occurs in the output; frequency_penalty is subtracted once per occurrence.
    """
    occurs = output_counts > 0  # [n, vocab]
    if prompt_mask is not None:
        rep = repetition_penalty[:, None]  # [n, 1]
        seen = occurs | prompt_mask
        logits = torch.where(seen, torch.where(logits > 0, logits / rep, logits * rep), logits)
    freq = frequency_penalty[:, None]  # [n, 1]
    return logits - freq * output_counts - presence_penalty[:, None] * occurs


def logprobs_ref(
    logits: torch.Tensor,  # [n, vocab] fp32, the raw logits
    token_ids: torch.Tensor,  # [n] int64
    k: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Under log_softmax(logits): each token's logprob [n] and rank [n] int64 (1 + the number
    of tokens with a higher logit), and the top-k ids [n, k] int64 and logprobs [n, k]."""
    raw = torch.log_softmax(logits, dim=-1)  # [n, vocab]
    chosen = logits.gather(1, token_ids[:, None])  # [n, 1]
    ranks = (logits > chosen).sum(dim=-1) + 1
    top_logprobs, top_ids = raw.topk(k, dim=-1)
    return raw.gather(1, token_ids[:, None]).squeeze(1), ranks, top_ids, top_logprobs


def truncation_thresholds_ref(
    logits: torch.Tensor,  # [n, vocab] fp32
    temperature: torch.Tensor,  # [n] fp32
    top_k: torch.Tensor,  # [n] int; 0 or >= vocab: off
    top_p: torch.Tensor,  # [n] fp32; >= 1: off
    min_p: torch.Tensor,  # [n] fp32; 0: off
) -> torch.Tensor:
    """Each row's logit threshold for top-k, then top-p, then min-p (-inf: keep all; greedy
    rows: -inf). -> [n]"""
    n, vocab = logits.shape
    t = _safe_temperature(temperature)  # [n]
    row_max = logits.max(dim=-1).values  # [n]
    row_max = torch.where(torch.isfinite(row_max), row_max, 0.0)
    sorted_l = logits.sort(dim=-1, descending=True).values  # [n, vocab]
    k = top_k.long()
    kth = sorted_l.gather(1, (k.clamp(1, vocab) - 1)[:, None]).squeeze(1)  # [n]
    tau_k = torch.where((k > 0) & (k < vocab), kth, _NEG_INF)
    # Top-p on unnormalised masses: keep sorted position r iff the mass before it < p * Z.
    e = torch.exp((sorted_l - row_max[:, None]) / t[:, None])  # [n, vocab]
    e = e.masked_fill(sorted_l < tau_k[:, None], 0.0)
    cum = e.cumsum(dim=-1)  # [n, vocab]
    before = F.pad(cum[:, :-1], (1, 0))  # mass of the positions before each one
    z = cum[:, -1]  # [n]
    num_kept = (before < (top_p * z)[:, None]).sum(dim=-1).clamp(min=1)  # [n]
    tau_p = sorted_l.gather(1, (num_kept - 1)[:, None]).squeeze(1)
    tau_p = torch.where(top_p < 1.0, tau_p, _NEG_INF)
    log_min_p = torch.log(min_p.clamp(min=1e-30))
    tau_m = torch.where(min_p > 0.0, row_max + t * log_min_p, _NEG_INF)
    tau = torch.maximum(torch.maximum(tau_k, tau_p), tau_m)
    return torch.where(temperature < GREEDY_TEMPERATURE, _NEG_INF, tau)  # greedy: unused


def draw_ref(
    logits: torch.Tensor,  # [n, vocab] fp32
    temperature: torch.Tensor,  # [n] fp32
    thresholds: torch.Tensor | None,  # [n] fp32, or None: keep every token
    seeds: torch.Tensor,  # [n] int64
    steps: torch.Tensor,  # [n] int64
) -> torch.Tensor:
    """argmax(logit / T + Gumbel) over each row's kept tokens; argmax for greedy rows. -> [n]"""
    uniform = philox_uniform_ref(seeds, steps, logits.shape[1])  # [n, vocab]
    return draw_from_uniforms(logits, temperature, thresholds, uniform)


def draw_from_uniforms(
    logits: torch.Tensor,  # [n, vocab] fp32
    temperature: torch.Tensor,  # [n] fp32
    thresholds: torch.Tensor | None,  # [n] fp32, or None
    uniform: torch.Tensor,  # [n, vocab] fp32, the rows' Philox uniforms; overwritten
) -> torch.Tensor:
    """`draw_ref` given the uniforms. -> [n] int64"""
    return gumbel_scores(logits, temperature, thresholds, uniform).argmax(dim=-1)


def gumbel_scores(
    logits: torch.Tensor,  # [n, vocab] fp32
    temperature: torch.Tensor,  # [n] fp32
    thresholds: torch.Tensor | None,  # [n] fp32, or None
    uniform: torch.Tensor,  # [n, vocab] fp32, the rows' Philox uniforms; overwritten
    any_greedy: bool = True,
) -> torch.Tensor:  # [n, vocab] fp32
    """What `draw_from_uniforms` takes the argmax of: logit / T + Gumbel noise over the kept
    tokens, a greedy row's logits as they are. `any_greedy=False`: the caller knows no row is
    greedy (that pass is skipped)."""
    inv_t = 1.0 / _safe_temperature(temperature)  # [n]
    scores = gumbel_(uniform).add_(logits * inv_t[:, None])  # [n, vocab]
    if thresholds is not None:
        scores.masked_fill_(logits < thresholds[:, None], _NEG_INF)
    if not any_greedy:
        return scores
    greedy = temperature < GREEDY_TEMPERATURE  # [n]
    return torch.where(greedy[:, None], logits, scores)
