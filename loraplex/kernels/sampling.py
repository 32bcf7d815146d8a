"""The sampler's two row-wise kernels, in plain torch: truncation thresholds (top-k, top-p,
min-p as one logit threshold per row) and the seeded draw (Gumbel-max over the kept tokens).
`triton_sampling` computes the same functions on the GPU; `draw` and `truncation_thresholds`
pick the Triton path on CUDA.

Truncation keeps, in each row, the tokens whose logit is >= the row's threshold:
- top-k: the k-th largest logit (ties at it are kept);
- top-p (after top-k, on softmax(logits / T) renormalised over the top-k): the lowest logit v
  whose strictly-higher tokens hold less than top_p of the mass, i.e. the smallest set of
  most likely tokens whose mass reaches top_p (ties at its edge are kept);
- min-p: tokens with p >= min_p * p_max, i.e. logit >= max + T * log(min_p).
The draw is argmax(logit / T + Gumbel(seed, step, token)) over the kept tokens, which samples
softmax(logit / T) renormalised over them exactly; a row whose temperature is below
GREEDY_TEMPERATURE takes the argmax of its logits (the first one on ties, as torch.argmax).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from loraplex.kernels.cpu_philox import philox_uniform_cpu
from loraplex.kernels.philox import gumbel_, philox_uniform_ref

GREEDY_TEMPERATURE = 1e-5  # a row below it is greedy
_NEG_INF = float("-inf")


def _check_rows(logits: torch.Tensor, **columns: torch.Tensor) -> None:
    if logits.dim() != 2 or logits.dtype != torch.float32:
        raise ValueError(f"logits must be [n, vocab] fp32, got {logits.dtype} {logits.shape}")
    for name, col in columns.items():
        if col.shape != (logits.shape[0],) or col.device != logits.device:
            raise ValueError(f"{name} must be [{logits.shape[0]}] on {logits.device}")


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
    return _draw_from_uniforms(logits, temperature, thresholds, uniform)


def _draw_from_uniforms(
    logits: torch.Tensor,  # [n, vocab] fp32
    temperature: torch.Tensor,  # [n] fp32
    thresholds: torch.Tensor | None,  # [n] fp32, or None
    uniform: torch.Tensor,  # [n, vocab] fp32, the rows' Philox uniforms; overwritten
) -> torch.Tensor:
    """`draw_ref` given the uniforms. -> [n] int64"""
    greedy = temperature < GREEDY_TEMPERATURE  # [n]
    inv_t = 1.0 / _safe_temperature(temperature)  # [n]
    scores = gumbel_(uniform).add_(logits * inv_t[:, None])  # [n, vocab]
    if thresholds is not None:
        scores.masked_fill_(logits < thresholds[:, None], _NEG_INF)
    scores = torch.where(greedy[:, None], logits, scores)
    return scores.argmax(dim=-1)


def apply_penalties(
    logits: torch.Tensor,  # [n, vocab] fp32
    output_counts: torch.Tensor,  # [n, vocab] int32
    prompt_mask: torch.Tensor | None,  # [n, vocab] bool
    repetition_penalty: torch.Tensor,  # [n] fp32
    presence_penalty: torch.Tensor,  # [n] fp32
    frequency_penalty: torch.Tensor,  # [n] fp32
) -> torch.Tensor:
    """`apply_penalties_ref`: one fused Triton pass on CUDA. -> a new [n, vocab] tensor"""
    _check_rows(
        logits, repetition_penalty=repetition_penalty, presence_penalty=presence_penalty,
        frequency_penalty=frequency_penalty,
    )  # fmt: skip
    for name, state in (("output_counts", output_counts), ("prompt_mask", prompt_mask)):
        if state is not None and (state.shape != logits.shape or state.device != logits.device):
            raise ValueError(f"{name} must be {tuple(logits.shape)} on {logits.device}")
    args = (
        logits, output_counts, prompt_mask, repetition_penalty, presence_penalty,
        frequency_penalty,
    )  # fmt: skip
    if logits.is_cuda:
        from loraplex.kernels.triton_sampling import apply_penalties_triton

        return apply_penalties_triton(*args)
    return apply_penalties_ref(*args)


def compute_logprobs(
    logits: torch.Tensor,  # [n, vocab] fp32, the raw logits
    token_ids: torch.Tensor,  # [n] int64
    k: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """`logprobs_ref`: on CUDA one Triton pass over the logits (no log_softmax tensor)."""
    _check_rows(logits, token_ids=token_ids)
    if k < 0 or k > logits.shape[1]:
        raise ValueError(f"k must be in [0, vocab], got {k}")
    if logits.is_cuda:
        from loraplex.kernels.triton_logprobs import logprobs_triton

        return logprobs_triton(logits, token_ids, k)
    return logprobs_ref(logits, token_ids, k)


def truncation_thresholds(
    logits: torch.Tensor,  # [n, vocab] fp32
    temperature: torch.Tensor,  # [n] fp32
    top_k: torch.Tensor,  # [n] int32
    top_p: torch.Tensor,  # [n] fp32
    min_p: torch.Tensor,  # [n] fp32
    any_top_k_top_p: bool = True,
    any_top_k_and_top_p: bool = True,
) -> torch.Tensor:
    """`truncation_thresholds_ref`: on CUDA a Triton search (no sort; `any_top_k_top_p=False`
    says no row has top-k or top-p, so only min-p is computed; `any_top_k_and_top_p=False`
    that no row has both, so one search phase is enough). -> [n] fp32"""
    _check_rows(logits, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    if logits.is_cuda:
        from loraplex.kernels.triton_truncation import truncation_thresholds_triton

        return truncation_thresholds_triton(
            logits, temperature, top_k, top_p, min_p, search=any_top_k_top_p,
            both=any_top_k_and_top_p,
        )  # fmt: skip
    return truncation_thresholds_ref(logits, temperature, top_k, top_p, min_p)


def draw(
    logits: torch.Tensor,  # [n, vocab] fp32
    temperature: torch.Tensor,  # [n] fp32
    thresholds: torch.Tensor | None,  # [n] fp32
    seeds: torch.Tensor,  # [n] int64
    steps: torch.Tensor,  # [n] int64
) -> torch.Tensor:
    """`draw_ref`: the Triton kernel on CUDA (no noise tensor in memory), the uniforms in C on
    CPU (`cpu_philox`, ~30x the torch reference), torch elsewhere.
    -> [n] int64 token ids"""
    _check_rows(logits, temperature=temperature, seeds=seeds, steps=steps)
    if thresholds is not None:
        _check_rows(logits, thresholds=thresholds)
    if logits.is_cuda:
        from loraplex.kernels.triton_sampling import draw_triton

        return draw_triton(logits, temperature, thresholds, seeds, steps)
    if logits.device.type == "cpu":
        uniform = philox_uniform_cpu(seeds, steps, logits.shape[1])
        if uniform is not None:
            return _draw_from_uniforms(logits, temperature, thresholds, uniform)
    return draw_ref(logits, temperature, thresholds, seeds, steps)


def warm_up(vocab: int, device: torch.device, max_rows: int, max_logprobs: int = 20) -> int:
    """Compile every variant of the sampler's Triton kernels for this vocabulary, so that no
    batch compiles one while the engine serves (each compile stalls a step for ~0.1 s). A no-op
    off CUDA. -> the number of kernel calls made"""
    if device.type != "cuda":
        return 0
    if max_rows < 1 or vocab < 1:
        raise ValueError(f"max_rows and vocab must be positive, got {max_rows}, {vocab}")
    from loraplex.kernels.triton_truncation import NUM_PIVOTS_BY_SIZE

    # One batch size per pivot-count bucket of the threshold search (the only constexpr that
    # depends on the batch); every other batch-dependent argument is unspecialised.
    sizes = {1, max_rows}
    sizes |= {min(max_rows, max(1, limit // vocab)) for limit, _ in NUM_PIVOTS_BY_SIZE}
    calls = 0
    for n in sorted(sizes):
        gen = torch.Generator(device=device).manual_seed(n)
        logits = torch.randn(n, vocab, generator=gen, device=device)
        temperature = torch.full((n,), 0.7, device=device)
        top_k = torch.full((n,), 50, dtype=torch.int32, device=device)
        top_p = torch.full((n,), 0.9, device=device)
        min_p = torch.full((n,), 0.05, device=device)
        seeds = torch.arange(n, device=device)
        steps = torch.zeros(n, dtype=torch.int64, device=device)
        for search, both in ((True, True), (True, False), (False, False)):
            tau = truncation_thresholds(logits, temperature, top_k, top_p, min_p, search, both)
            calls += 1
        for thresholds in (None, tau):
            tokens = draw(logits, temperature, thresholds, seeds, steps)
            calls += 1
        counts = torch.zeros(n, vocab, dtype=torch.int32, device=device)
        ones = torch.ones(n, device=device)
        for prompt in (None, torch.zeros(n, vocab, dtype=torch.bool, device=device)):
            apply_penalties(logits, counts, prompt, ones, ones, ones)
            calls += 1
        k = 1
        while True:  # the kernels round k up to a power of two
            compute_logprobs(logits, tokens, min(k, vocab))
            calls += 1
            if k >= max_logprobs or k >= vocab:
                break
            k *= 2
    torch.cuda.synchronize(device)
    return calls
