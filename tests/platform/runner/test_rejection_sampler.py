"""Exactness of the acceptance rule: over many seeded rows on a tiny vocabulary, the emitted
tokens follow the target's distribution (chi-square), and a biased rule is caught."""

from __future__ import annotations

import pytest
import torch

from loraplex.kernels.sampling import draw
from loraplex.platform.runner.rejection_sampler import (
    acceptance_uniforms,
    emit_tokens,
    verify_point_drafts,
    verify_sampled_drafts,
)

V, N, K = 6, 20000, 2
# chi-square critical value, 5 degrees of freedom, p = 0.001
CHI2_CRIT_DF5 = 20.52
P = torch.tensor([[0.35, 0.25, 0.15, 0.12, 0.08, 0.05], [0.05, 0.1, 0.4, 0.2, 0.15, 0.1]])
Q = torch.tensor([[0.1, 0.4, 0.1, 0.2, 0.1, 0.1], [0.3, 0.1, 0.2, 0.1, 0.2, 0.1]])


def chi2(tokens: torch.Tensor, probs: torch.Tensor) -> float:
    counts = torch.bincount(tokens, minlength=V).double()
    expected = probs.double() * len(tokens)
    return float(((counts - expected) ** 2 / expected).sum())


def target_draws(seeds: torch.Tensor) -> torch.Tensor:
    """The target's own draw at each of the K + 1 positions (noise keyed by (seed, j)).
    -> [N, K + 1]"""
    logits = torch.log(torch.cat([P, P[1:]]))  # position K repeats the last distribution
    cols = []
    for j in range(K + 1):
        rows = logits[j].expand(len(seeds), V).contiguous()
        steps = torch.full_like(seeds, j)
        cols.append(draw(rows, torch.ones(len(seeds)), None, seeds, steps))
    return torch.stack(cols, dim=1)


@pytest.fixture(scope="module")
def rows():
    seeds = torch.arange(N, dtype=torch.int64) * 7919 + 3
    gen = torch.Generator().manual_seed(0)
    drafts = torch.stack([torch.multinomial(Q[j], N, True, generator=gen) for j in range(K)], 1)
    return seeds, drafts, target_draws(seeds)


def _check(tokens: torch.Tensor, emitted: torch.Tensor) -> tuple[float, float]:
    """chi-square of the first emitted token against p_0 and of the second (rows that
    accepted their first draft) against p_1."""
    second = emitted >= 2
    assert 1000 < int(second.sum()) < N  # both branches are exercised
    return chi2(tokens[:, 0], P[0]), chi2(tokens[second, 1], P[1])


def test_draft_distribution_rule_keeps_the_target_distribution(rows):
    seeds, drafts, targets = rows
    lens = torch.full((N,), K)
    tokens, emitted = verify_sampled_drafts(
        targets, drafts, lens, P.expand(N, K, V), Q.expand(N, K, V),
        torch.zeros(N, dtype=torch.bool), seeds, torch.zeros(N, dtype=torch.int64),
    )  # fmt: skip
    first, second = _check(tokens, emitted)
    assert first < CHI2_CRIT_DF5 and second < CHI2_CRIT_DF5


def test_point_mass_rule_keeps_the_target_distribution(rows):
    seeds, drafts, targets = rows
    tokens, emitted = verify_point_drafts(targets, drafts, torch.full((N,), K))
    first, second = _check(tokens, emitted)
    assert first < CHI2_CRIT_DF5 and second < CHI2_CRIT_DF5


def test_a_biased_acceptance_rule_fails_the_same_test(rows):
    """Accepting with min(1, 1.5 p / q) instead of min(1, p / q): the check must notice."""
    seeds, drafts, targets = rows
    p_x = P.expand(N, K, V).gather(2, drafts[..., None]).squeeze(2)
    q_x = Q.expand(N, K, V).gather(2, drafts[..., None]).squeeze(2)
    u = acceptance_uniforms(seeds, torch.zeros(N, dtype=torch.int64), K)
    residual = (P - Q).clamp(min=0)
    recovered = torch.stack(
        [torch.multinomial(residual[j], N, True, generator=torch.Generator().manual_seed(j))
         for j in range(K)], 1,
    )  # fmt: skip
    tokens, emitted = emit_tokens(
        u * q_x < 1.5 * p_x, drafts, recovered, targets, torch.full((N,), K)
    )
    first, _ = _check(tokens, emitted)
    assert first > 10 * CHI2_CRIT_DF5


def test_a_point_mass_rule_that_always_accepts_a_likely_draft_fails(rows):
    seeds, _, targets = rows
    drafts = torch.zeros((N, K), dtype=torch.int64)  # token 0: p_0 = 0.35
    biased = torch.ones((N, K), dtype=torch.bool)
    tokens, _ = emit_tokens(biased, drafts, targets[:, :-1], targets, torch.full((N,), K))
    assert chi2(tokens[:, 0], P[0]) > 10 * CHI2_CRIT_DF5


def test_emitted_runs_stop_at_the_first_rejection_and_add_a_bonus_after_full_acceptance():
    targets = torch.tensor([[5, 6, 7], [5, 9, 7], [1, 2, 3], [4, 0, 0]])
    drafts = torch.tensor([[5, 6], [5, 6], [2, 2], [0, 0]])
    lens = torch.tensor([2, 2, 2, 0])
    tokens, emitted = verify_point_drafts(targets, drafts, lens)
    assert emitted.tolist() == [3, 2, 1, 1]
    runs = [row[:n] for row, n in zip(tokens.tolist(), emitted.tolist())]
    assert runs == [[5, 6, 7], [5, 9], [1], [4]]


def test_acceptance_uniforms_are_keyed_by_seed_and_step_not_by_row():
    seeds = torch.tensor([11, 22, 11])
    u = acceptance_uniforms(seeds, torch.tensor([0, 0, 1]), 3)
    assert torch.equal(u[0, 1:], u[2, :2])  # (seed 11, step 1..2) whatever the row
    assert not torch.equal(u[0], u[1])
    assert bool(((u > 0) & (u < 1)).all())
