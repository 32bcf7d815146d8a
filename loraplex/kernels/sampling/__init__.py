"""The sampler's kernels: penalties, logprobs, truncation thresholds (top-k, top-p, min-p as
one logit threshold per row) and the seeded draw (Gumbel-max over the kept tokens). Each entry
checks shapes, dtypes and devices, then runs the Triton kernel on CUDA (`triton_*`), the C
Philox twin for the draw's noise on CPU (`cpu_philox`), or the plain-torch reference
(`reference`, which says what each computes). `warm_up` compiles every Triton variant.
"""

from __future__ import annotations

import torch

from loraplex.kernels.sampling.cpu_argmax import argmax_rows
from loraplex.kernels.sampling.cpu_philox import philox_uniform_cpu
from loraplex.kernels.sampling.reference import (
    apply_penalties_ref,
    draw_ref,
    gumbel_scores,
    logprobs_ref,
    truncation_thresholds_ref,
)
from loraplex.kernels.sampling.types import GREEDY_TEMPERATURE, NUM_PIVOTS_BY_SIZE


def _check_rows(logits: torch.Tensor, **columns: torch.Tensor) -> None:
    if logits.dim() != 2 or logits.dtype != torch.float32:
        raise ValueError(f"logits must be [n, vocab] fp32, got {logits.dtype} {logits.shape}")
    for name, col in columns.items():
        if col.shape != (logits.shape[0],) or col.device != logits.device:
            raise ValueError(f"{name} must be [{logits.shape[0]}] on {logits.device}")


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
        from loraplex.kernels.sampling.triton_sampling import apply_penalties_triton

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
        from loraplex.kernels.sampling.triton_logprobs import logprobs_triton

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
        from loraplex.kernels.sampling.triton_truncation import truncation_thresholds_triton

        return truncation_thresholds_triton(
            logits, temperature, top_k, top_p, min_p, search=any_top_k_top_p,
            both=any_top_k_and_top_p,
        )  # fmt: skip
    return truncation_thresholds_ref(logits, temperature, top_k, top_p, min_p)


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:  # [n] int64
    """`logits.argmax(dim=-1)` ([n, vocab]): in C for fp32 on CPU (`cpu_argmax`, ~10x torch's
    at a 49k vocabulary), torch's elsewhere."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.dim() == 2:
        return argmax_rows(logits)
    return logits.argmax(dim=-1)


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
        from loraplex.kernels.sampling.triton_sampling import draw_triton

        return draw_triton(logits, temperature, thresholds, seeds, steps)
    if logits.device.type == "cpu":
        return _draw_cpu(logits, temperature, thresholds, seeds, steps)
    return draw_ref(logits, temperature, thresholds, seeds, steps)


def _draw_cpu(
    logits: torch.Tensor,  # [n, vocab] fp32
    temperature: torch.Tensor,  # [n] fp32
    thresholds: torch.Tensor | None,  # [n] fp32
    seeds: torch.Tensor,  # [n] int64
    steps: torch.Tensor,  # [n] int64
) -> torch.Tensor:  # [n] int64
    """`draw_ref` with the C uniforms, drawn for the sampled rows only: a greedy row's token is
    its argmax, and a row's uniforms depend on its own seed and step alone, so a batch half
    greedy makes half the noise for the same tokens."""
    greedy = temperature < GREEDY_TEMPERATURE  # [n]
    sampled = (~greedy).nonzero().squeeze(1)  # [m]
    if len(sampled) == 0:
        return argmax_rows(logits)
    if len(sampled) < len(greedy):
        tokens = argmax_rows(logits)
        tokens[sampled] = _draw_cpu(
            logits[sampled], temperature[sampled],
            None if thresholds is None else thresholds[sampled], seeds[sampled], steps[sampled],
        )  # fmt: skip
        return tokens
    uniform = philox_uniform_cpu(seeds, steps, logits.shape[1])
    if uniform is None:
        return draw_ref(logits, temperature, thresholds, seeds, steps)
    # NOTE: every row is sampled here: no greedy rows to put back
    return argmax_rows(gumbel_scores(logits, temperature, thresholds, uniform, any_greedy=False))


def warm_up(vocab: int, device: torch.device, max_rows: int, max_logprobs: int = 20) -> int:
    """Compile every variant of the sampler's Triton kernels for this vocabulary, so that no
    batch compiles one while the engine serves (each compile stalls a step for ~0.1 s). A no-op
    off CUDA. -> the number of kernel calls made"""
    if device.type != "cuda":
        return 0
    if max_rows < 1 or vocab < 1:
        raise ValueError(f"max_rows and vocab must be positive, got {max_rows}, {vocab}")
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
