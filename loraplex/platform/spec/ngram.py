"""N-gram / prompt-lookup proposer: copy what followed the last occurrence of the request's
latest tokens (no model; pays off when the output repeats its prompt: edits, summaries,
code refactoring)."""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from loraplex.platform.spec.proposer import ProposalRequest, Proposals, Proposer


def ngram_lookup(tokens: np.ndarray, min_n: int, max_n: int, k: int) -> list[int]:
    """Up to `k` tokens that followed the latest earlier occurrence of the longest suffix of
    `tokens` of length in [min_n, max_n] that occurs earlier; [] when none does.
    [num_tokens] int -> list of up to k ints"""
    num = len(tokens)
    for n in range(min(max_n, num - 1), min_n - 1, -1):
        suffix = tokens[num - n :]
        # Windows starting at 0..num-n-1: every earlier occurrence, followed by >= 1 token.
        windows = sliding_window_view(tokens[: num - 1], n)  # [num - n, n]
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        if len(hits):
            start = int(hits[-1]) + n
            return tokens[start : start + k].tolist()
    return []


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
