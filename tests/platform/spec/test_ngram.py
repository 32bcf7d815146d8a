"""Prompt lookup: the longest recent n-gram match proposes what followed it."""

from __future__ import annotations

import numpy as np
import pytest

from loraplex.platform.core.sampling_params import SamplingParams
from loraplex.platform.spec.ngram import NgramProposer, ngram_lookup
from loraplex.platform.spec.proposer import ProposalRequest


@pytest.mark.parametrize(
    ("tokens", "min_n", "max_n", "k", "expected"),
    [
        ([1, 2, 3, 4, 5, 1, 2, 3], 1, 3, 2, [4, 5]),  # suffix 1 2 3 seen at 0
        ([1, 2, 3, 4, 5, 1, 2, 3], 1, 3, 9, [4, 5, 1, 2, 3]),  # up to what exists
        ([1, 2, 9, 7, 2, 8, 2], 1, 3, 2, [8, 2]),  # latest occurrence of "2" wins
        ([1, 2, 3, 9, 2, 3, 5, 3, 2, 3], 1, 2, 1, [5]),  # "2 3" (longest) before "3"
        ([1, 2, 3, 4], 1, 3, 3, []),  # nothing repeats
        ([4, 5, 6, 4], 2, 3, 3, []),  # a 1-gram would match, min_n is 2
        ([7], 1, 3, 3, []),
    ],
)
def test_lookup(tokens, min_n, max_n, k, expected):
    assert ngram_lookup(np.asarray(tokens), min_n, max_n, k) == expected


def test_proposer_respects_each_requests_limit():
    proposer = NgramProposer(num_speculative_tokens=3, min_n=1, max_n=2)
    params = SamplingParams(max_tokens=8)
    tokens = np.asarray([1, 2, 3, 4, 5, 6, 1, 2])
    out = proposer.propose(
        [
            ProposalRequest("a", tokens, params, max_tokens=3),
            ProposalRequest("b", tokens, params, max_tokens=1),
            ProposalRequest("c", np.asarray([1, 2, 3]), params, max_tokens=3),
        ]
    )
    assert out.token_ids == {"a": [3, 4, 5], "b": [3]}
    assert out.probs is None


def _lookup_by_windows(tokens: np.ndarray, min_n: int, max_n: int, k: int) -> list[int]:
    """The definition, spelled out: every n from the longest down, every earlier window."""
    num = len(tokens)
    for n in range(min(max_n, num - 1), min_n - 1, -1):
        suffix = tokens[num - n :].tolist()
        hits = [s for s in range(num - n) if tokens[s : s + n].tolist() == suffix]
        if hits:
            return tokens[hits[-1] + n : hits[-1] + n + k].tolist()
    return []


@pytest.mark.parametrize("seed", range(6))
def test_lookup_matches_the_definition_on_random_histories(seed):
    rng = np.random.default_rng(seed)
    for _ in range(200):
        vocab = int(rng.integers(2, 8))  # small vocabularies: many partial matches
        tokens = rng.integers(0, vocab, int(rng.integers(1, 40)))
        min_n = int(rng.integers(1, 4))
        max_n = int(rng.integers(min_n, 6))
        k = int(rng.integers(1, 6))
        assert ngram_lookup(tokens, min_n, max_n, k) == _lookup_by_windows(tokens, min_n, max_n, k)
