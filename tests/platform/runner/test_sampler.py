"""Sampler: draws follow softmax(logits / T) and its top-k / top-p / min-p truncations, penalties
change logits as OpenAI and vLLM define them, bans, grammar masks, greedy rows and logprobs, and
seeded rows draw the same token wherever they sit in the batch."""

from __future__ import annotations

import math

import pytest
import torch

from loraplex.grammar.bitmask import allocate_token_bitmask
from loraplex.platform.runner.sampler import Sampler, apply_penalties
from loraplex.platform.runner.sampling_metadata import build_sampling_metadata

INF = float("inf")
LN2 = math.log(2.0)
# 12 tokens with distinct, uneven probabilities
LOGITS12 = torch.tensor([2.0, 1.5, 1.1, 0.9, 0.3, 0.0, -0.2, -0.7, -1.0, -1.6, -2.3, -3.0])
NUM_DRAWS = 20_000


def draw_counts(row: torch.Tensor, **params) -> torch.Tensor:
    """How often each token is drawn in NUM_DRAWS rows of `row`, distinct seeds and steps."""
    logits = row.repeat(NUM_DRAWS, 1)
    meta = build_sampling_metadata(NUM_DRAWS, row.numel(), **params)
    tokens = Sampler()(logits, meta).token_ids
    return torch.bincount(tokens, minlength=row.numel()).double()


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's statistic of counts against probs over probs' support (the rest must be 0)."""
    support = probs > 0
    assert counts[~support].sum() == 0, f"drawn outside the support: {counts}"
    expected = probs[support].double() * counts.sum()
    return float(((counts[support] - expected) ** 2 / expected).sum())


# Chi-square bounds at p ~ 1e-4 by degrees of freedom (draws are seeded: the test is
# deterministic, the bound only says how unlikely a correct sampler is to exceed it).
CHI2_BOUND = [0.0, 15.14, 18.42, 21.11, 23.51, 25.75, 27.86, 29.88, 31.83, 33.72, 35.56, 37.37]


def bound(probs: torch.Tensor) -> float:
    return CHI2_BOUND[int((probs > 0).sum()) - 1]


def renormalised(probs: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    kept = torch.where(keep, probs, 0.0)
    return kept / kept.sum()


@pytest.mark.parametrize("temperature", [0.5, 1.0, 1.7])
def test_draws_follow_softmax_at_temperature(temperature: float) -> None:
    counts = draw_counts(LOGITS12, temperature=temperature)
    probs = torch.softmax(LOGITS12 / temperature, dim=-1)
    assert chi_square(counts, probs) < bound(probs)
    # A sampler off by 15% in temperature fails the same bound.
    wrong = torch.softmax(LOGITS12 / (temperature * 1.15), dim=-1)
    assert chi_square(counts, wrong) > 3 * bound(probs)


def test_top_k_draws_only_the_k_best_renormalised() -> None:
    counts = draw_counts(LOGITS12, temperature=0.8, top_k=4)
    probs = torch.softmax(LOGITS12 / 0.8, dim=-1)
    expected = renormalised(probs, torch.arange(12) < 4)
    assert chi_square(counts, expected) < bound(expected)


def _nucleus(probs: torch.Tensor, p: float) -> torch.Tensor:
    """The smallest set of most likely tokens whose mass reaches p (independent of the code)."""
    order = probs.argsort(descending=True)
    keep = torch.zeros_like(probs, dtype=torch.bool)
    mass = 0.0
    for token in order.tolist():
        if mass >= p:
            break
        keep[token] = True
        mass += float(probs[token])
    return keep


@pytest.mark.parametrize("top_p", [0.6, 0.93])
def test_top_p_draws_the_nucleus_renormalised(top_p: float) -> None:
    counts = draw_counts(LOGITS12, temperature=1.3, top_p=top_p)
    probs = torch.softmax(LOGITS12 / 1.3, dim=-1)
    expected = renormalised(probs, _nucleus(probs, top_p))
    assert 2 <= int((expected > 0).sum()) <= 11
    assert chi_square(counts, expected) < bound(expected)


@pytest.mark.parametrize("top_p,kept", [(0.5, 1), (0.75, 2), (0.7500001, 3), (0.875, 3)])
def test_top_p_exactly_on_a_boundary(top_p: float, kept: int) -> None:
    # softmax is exactly [1/2, 1/4, 1/8, 1/8, 0...]: the nucleus of p = 1/2 or 3/4 is the tokens
    # before the boundary (their mass reaches p), one more token only past it.
    row = torch.tensor([0.0, -LN2, -2 * LN2, -2 * LN2] + [-INF] * 8)
    counts = draw_counts(row, top_p=top_p)
    probs = torch.softmax(row, dim=-1)
    # past 3/4 the tie at the edge (tokens 2 and 3) is kept whole
    expected = renormalised(probs, torch.arange(12) < (4 if kept == 3 else kept))
    assert int((counts > 0).sum()) == int((expected > 0).sum())
    assert chi_square(counts, expected) <= bound(expected)


def test_min_p_draws_tokens_above_a_fraction_of_the_best() -> None:
    counts = draw_counts(LOGITS12, temperature=0.9, min_p=0.15)
    probs = torch.softmax(LOGITS12 / 0.9, dim=-1)
    expected = renormalised(probs, probs >= 0.15 * probs.max())
    assert 2 <= int((expected > 0).sum()) < 12
    assert chi_square(counts, expected) < bound(expected)


def test_top_p_applies_to_the_top_k_renormalised() -> None:
    counts = draw_counts(LOGITS12, temperature=1.0, top_k=6, top_p=0.8)
    probs = torch.softmax(LOGITS12, dim=-1)
    top6 = renormalised(probs, torch.arange(12) < 6)
    expected = renormalised(top6, _nucleus(top6, 0.8))
    assert chi_square(counts, expected) < bound(expected)


def test_penalties_as_openai_and_vllm_define_them() -> None:
    logits = torch.tensor([[2.0, -1.0, 0.5, -0.5, 3.0, 0.0], [1.0, 1.0, -2.0, 4.0, -3.0, 2.0]])
    counts = torch.tensor([[0, 2, 1, 0, 0, 3], [1, 0, 0, 0, 5, 0]], dtype=torch.int32)
    prompt = torch.tensor([[1, 0, 0, 1, 0, 0], [0, 0, 1, 0, 0, 0]], dtype=torch.bool)
    meta = build_sampling_metadata(
        2, 6, repetition_penalty=[2.0, 1.0], presence_penalty=[0.5, 0.25],
        frequency_penalty=[0.1, 1.0], output_counts=counts, prompt_mask=prompt,
    )  # fmt: skip
    out = apply_penalties(logits, meta)
    expected = logits.clone()
    for i, (rep, pres, freq) in enumerate([(2.0, 0.5, 0.1), (1.0, 0.25, 1.0)]):
        for t in range(6):
            c = int(counts[i, t])
            if c > 0 or prompt[i, t]:
                x = float(expected[i, t])
                expected[i, t] = x / rep if x > 0 else x * rep
            expected[i, t] -= freq * c + pres * (c > 0)
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-6)
    assert out[0, 0] == 1.0 and out[0, 3] == -1.0  # prompt-only tokens: repetition only
    assert out[1, 4] == -3.0 - 5 * 1.0 - 0.25


def test_sampler_applies_penalties_before_drawing() -> None:
    logits = torch.tensor([[5.0, 4.0, 0.0]]).repeat(2, 1)
    counts = torch.tensor([[3, 0, 0], [0, 0, 0]], dtype=torch.int32)
    meta = build_sampling_metadata(
        2, 3, temperature=0.0, frequency_penalty=1.0, output_counts=counts
    )
    before = logits.clone()
    assert Sampler()(logits, meta).token_ids.tolist() == [1, 0]
    assert torch.equal(logits, before)  # the caller's logits are left alone


def test_min_tokens_bans_stop_ids_until_enough_tokens() -> None:
    logits = torch.tensor([[0.0, 9.0, 1.0, 8.0]]).repeat(4, 1)
    logits[3] = torch.tensor([9.0, 1.0, 0.0, 0.0])
    banned = torch.tensor([[1, 3], [1, -1], [1, 3], [1, -1]])  # -1 pads; token 0 not banned
    meta = build_sampling_metadata(
        4, 4, temperature=[0.0, 0.0, 0.0, 0.0], steps=[2, 2, 5, 0], min_tokens=[5, 5, 5, 3],
        banned_token_ids=banned,
    )  # fmt: skip
    # below min_tokens: 1 and 3 banned (-> 2), only 1 banned (-> 3); at min_tokens: free (1)
    assert Sampler()(logits, meta).token_ids.tolist() == [2, 3, 1, 0]
    # sampled rows never draw a banned id
    meta = build_sampling_metadata(
        500, 4, temperature=2.0, steps=torch.arange(500) % 5, min_tokens=5,
        banned_token_ids=banned[:1].repeat(500, 1),
    )  # fmt: skip
    tokens = Sampler()(logits[:1].repeat(500, 1), meta).token_ids
    assert set(tokens.tolist()) == {0, 2}


def test_grammar_bitmask_restricts_greedy_and_sampled_rows() -> None:
    vocab = 70
    logits = torch.randn(300, vocab, generator=torch.Generator().manual_seed(1))
    mask = allocate_token_bitmask(300, vocab)
    mask.zero_()
    allowed = [3, 40, 65]
    for t in allowed:
        mask[:, t // 32] |= torch.tensor(1 << (t % 32), dtype=torch.int64).to(torch.int32)
    temperature = [0.0] * 100 + [1.0] * 200
    out = Sampler()(
        logits, build_sampling_metadata(300, vocab, temperature=temperature), mask
    ).token_ids
    assert set(out.tolist()) == set(allowed)
    best = logits[:100, allowed].argmax(dim=-1)
    assert out[:100].tolist() == [allowed[i] for i in best.tolist()]


def test_greedy_rows_in_a_sampled_batch_take_the_argmax() -> None:
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(64, 1000, generator=gen) * 4
    temperature = [0.0 if i % 3 == 0 else 1.0 for i in range(64)]
    meta = build_sampling_metadata(64, 1000, temperature=temperature, top_p=0.9, min_p=0.01)
    out = Sampler()(logits, meta).token_ids
    greedy = torch.tensor(temperature) == 0
    assert torch.equal(out[greedy], logits[greedy].argmax(dim=-1))
    assert not torch.equal(out[~greedy], logits[~greedy].argmax(dim=-1))


def test_logprobs_are_of_the_raw_logits() -> None:
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(8, 50, generator=gen)
    meta = build_sampling_metadata(
        8, 50, temperature=[0.0, 1.0] * 4, logprobs=[0, 3, 5, -1, 1, 2, 0, 5],
        frequency_penalty=2.0, output_counts=torch.randint(0, 3, (8, 50), generator=gen).int(),
    )  # fmt: skip
    out = Sampler()(logits, meta)
    raw = torch.log_softmax(logits, dim=-1)
    lp = out.logprobs
    assert lp is not None and lp.top_ids.shape == (8, 5)
    tokens = out.token_ids
    torch.testing.assert_close(lp.token_logprobs, raw.gather(1, tokens[:, None]).squeeze(1))
    order = raw.argsort(dim=-1, descending=True)
    ranks = (order == tokens[:, None]).int().argmax(dim=-1) + 1
    assert torch.equal(lp.token_ranks, ranks)
    values, ids = raw.topk(5, dim=-1)
    assert torch.equal(lp.top_ids, ids)
    torch.testing.assert_close(lp.top_logprobs, values)
    none = Sampler()(logits, build_sampling_metadata(8, 50))
    assert none.logprobs is None


def test_seeded_row_draws_the_same_token_in_any_batch() -> None:
    gen = torch.Generator().manual_seed(4)
    vocab = 500
    row = torch.randn(vocab, generator=gen) * 2
    params = dict(temperature=0.8, top_p=0.95, top_k=0, min_p=0.0, seeds=123456789)

    def alone(step: int) -> int:
        meta = build_sampling_metadata(1, vocab, **params, steps=step)
        return int(Sampler()(row[None], meta).token_ids[0])

    tokens = [alone(step) for step in range(12)]
    assert len(set(tokens)) > 3  # the step moves the noise
    for position in (0, 17, 63):
        logits = torch.randn(64, vocab, generator=gen) * 2
        logits[position] = row
        columns = {
            "temperature": torch.rand(64, generator=gen) * 1.5,
            "top_k": torch.randint(0, 50, (64,), generator=gen),
            "top_p": torch.rand(64, generator=gen) * 0.5 + 0.5,
            "min_p": torch.rand(64, generator=gen) * 0.1,
            "seeds": torch.randint(0, 2**62, (64,), generator=gen),
            "steps": torch.randint(0, 1000, (64,), generator=gen),
        }
        for name in columns:
            columns[name][position] = params.get(name, 5)
        columns["steps"][position] = 5
        meta = build_sampling_metadata(64, vocab, **columns)
        assert int(Sampler()(logits, meta).token_ids[position]) == tokens[5]


GPU_MIXES = [
    dict(temperature=0.0),
    dict(temperature=1.0),
    dict(temperature=0.7, top_p=0.9),
    dict(temperature=0.7, top_k=50),
    dict(temperature=[0.0, 0.7] * 4, top_k=5, top_p=0.8, min_p=0.05),
    dict(min_p=0.05),
    dict(repetition_penalty=1.1, presence_penalty=0.5, frequency_penalty=0.5),
    dict(logprobs=5),
]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("mix", GPU_MIXES)
def test_cuda_sampler_matches_cpu_and_never_synchronises(mix) -> None:
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(8, 3000, generator=gen) * 3
    counts = torch.randint(0, 3, (8, 3000), generator=gen, dtype=torch.int32)
    state = {}
    if "repetition_penalty" in mix:
        state = dict(output_counts=counts, prompt_mask=counts == 1)
    cpu = Sampler()(logits, build_sampling_metadata(8, 3000, **mix, **state))
    meta = build_sampling_metadata(8, 3000, "cuda", **mix, **state)
    gpu_logits = logits.cuda()
    Sampler()(gpu_logits, meta)  # compile the kernels first
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = Sampler()(gpu_logits, meta)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert out.token_ids.cpu().tolist() == cpu.token_ids.tolist()
