"""`RandomWalker`: drives a grammar's matcher to completion without a model, by random allowed
tokens; for tests and the coverage benchmark (every walk that ends must give valid output)."""

from __future__ import annotations

from typing import Any

import numpy as np
from tokenizers import Tokenizer

from loraplex.grammar.bitmask import allocate_token_bitmask

# Single characters a finishing walk prefers: they close strings, objects and arrays.
_CLOSERS = ('"', "}", "]")


class RandomWalker:
    """Random walks through grammars over one tokenizer's vocabulary.

    The first `explore_steps` pick any allowed token; later ones favour closing characters and
    single-character tokens, and stop as soon as the grammar is complete, so walks finish.
    """

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.closer_ids = [
            i for i in (tokenizer.token_to_id(ch) for ch in _CLOSERS) if i is not None
        ]
        vocab = tokenizer.get_vocab()
        self.short_ids = np.array(
            sorted(i for t, i in vocab.items() if len(t) == 1), dtype=np.int64
        )

    def walk(
        self, grammar: Any, seed: int, explore_steps: int = 24, max_steps: int = 600
    ) -> list[int] | None:
        """Token ids of one walk through `grammar` (a compiled grammar of either backend), the
        stop token left out; None when it did not finish within `max_steps`."""
        rng = np.random.default_rng(seed)
        matcher = grammar.new_matcher()
        bitmask = allocate_token_bitmask(1, grammar.vocab_size).numpy()  # [1, words]
        is_short = np.zeros(grammar.vocab_size, dtype=bool)
        is_short[self.short_ids[self.short_ids < grammar.vocab_size]] = True
        stop_ids = list(grammar.stop_token_ids)
        tokens: list[int] = []
        for step in range(max_steps):
            matcher.fill_bitmask(bitmask, 0)
            bits = np.unpackbits(bitmask[0].view(np.uint8), bitorder="little")
            allowed = bits[: grammar.vocab_size].astype(bool)  # [vocab]
            exploring = step < explore_steps
            if allowed[stop_ids].any():
                allowed[stop_ids] = False
                if not exploring or rng.random() < 0.2 or not allowed.any():
                    if not matcher.accept_token(stop_ids[0]) or not matcher.is_terminated():
                        raise AssertionError("the grammar allowed a stop token it refuses")
                    return tokens
            candidates = np.flatnonzero(allowed)
            if not exploring:
                closers = [t for t in self.closer_ids if allowed[t]]
                short = np.flatnonzero(allowed & is_short)
                if closers and rng.random() < 0.5:
                    candidates = np.array(closers)
                elif len(short):
                    candidates = short
            if not len(candidates):
                raise AssertionError("a state that is not complete allows no token")
            pick = int(rng.choice(candidates))
            if not matcher.accept_token(pick):
                raise AssertionError(f"the matcher refused token {pick} its mask allowed")
            tokens.append(pick)
        return None
