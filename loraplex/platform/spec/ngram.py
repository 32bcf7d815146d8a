"""N-gram / prompt-lookup proposer: copy what followed the last occurrence of the request's
latest tokens (no model; pays off when the output repeats its prompt: edits, summaries,
code refactoring)."""

from __future__ import annotations

import numpy as np

from loraplex.platform.spec.proposer import ProposalRequest, Proposals, Proposer


def ngram_lookup(tokens: np.ndarray, min_n: int, max_n: int, k: int) -> list[int]:
    """Up to `k` tokens that followed the latest earlier occurrence of the longest suffix of
    `tokens` of length in [min_n, max_n] that occurs earlier; [] when none does.
    [num_tokens] int -> list of up to k ints"""
    num = len(tokens)
    if num < 2:
        return []
    # NOTE: one pass over the history finds where the last token occurred before (each such
    # place ends a candidate occurrence, followed by >= 1 token); only those few candidates are
    # then extended backwards, up to max_n tokens. It runs in the lock step between a step's
    # read-back and the next launch, so it must stay cheap on long contexts.
    ends = np.flatnonzero(tokens[: num - 1] == tokens[num - 1])  # [c]
    if not len(ends):
        return []
    matched = np.ones(len(ends), dtype=np.int64)  # [c] suffix tokens each candidate matches
    alive = np.ones(len(ends), dtype=bool)
    for j in range(1, max_n):
        at = ends - j
        alive &= at >= 0
        alive[alive] = tokens[at[alive]] == tokens[num - 1 - j]
        if not alive.any():
            break
        matched += alive
    n = int(matched.max())
    if n < min_n:
        return []
    start = int(ends[np.flatnonzero(matched >= n)[-1]]) + 1
    return tokens[start : start + k].tolist()


class NgramProposer(Proposer):
    """Proposes by prompt lookup (`ngram_lookup`) over each request's prompt and output."""

    def __init__(self, num_speculative_tokens: int, min_n: int, max_n: int) -> None:
        if not 1 <= min_n <= max_n or num_speculative_tokens < 1:
            raise ValueError("need 1 <= min_n <= max_n and num_speculative_tokens >= 1")
        self.k, self.min_n, self.max_n = num_speculative_tokens, min_n, max_n

    def propose(self, requests: list[ProposalRequest]) -> Proposals:
        out: dict[str, list[int]] = {}
        for req in requests:
            k = min(self.k, req.max_tokens)
            if k > 0:
                drafts = ngram_lookup(req.token_ids, self.min_n, self.max_n, k)
                if drafts:
                    out[req.req_id] = drafts
        return Proposals(out)
