"""`GrammarMatcher`: one request's position in its grammar."""

from __future__ import annotations

import numpy as np
import torch

from loraplex.grammar.bitmask import bitmask_array
from loraplex.grammar.compiled import CompiledGrammar


class GrammarMatcher:
    """Tracks a request's grammar state, token by token.

    Per step the engine calls `fill_bitmask` for the request's row (CPU), the sampler applies
    the bitmask, then `accept_token` with the sampled token. A stop token is accepted only in a
    final state and terminates the matcher: the request must end there.
    """

    def __init__(self, grammar: CompiledGrammar) -> None:
        self.grammar = grammar
        self.state = grammar.initial_state
        self._terminated = False

    def accept_token(self, token_id: int) -> bool:
        """Advance by `token_id`; False (state unchanged) when the grammar forbids it."""
        if self._terminated:
            return False
        if token_id in self.grammar.stop_token_ids:
            if not self.grammar.is_final(self.state):
                return False
            self._terminated = True
            return True
        next_state = self.grammar.next_state(self.state, token_id)
        if next_state is None:
            return False
        self.state = next_state
        return True

    def accept_tokens(self, token_ids: list[int]) -> bool:
        """Advance by each token in turn (e.g. a prompt continuation); stops at the first
        forbidden one and returns False."""
        return all(self.accept_token(token_id) for token_id in token_ids)

    def fill_bitmask(self, bitmask: np.ndarray | torch.Tensor, row: int) -> None:
        """Write the allowed-token mask into `bitmask[row]` (CPU).

        bitmask: [num_rows, num_words] int32, num_words >= ceil(vocab_size / 32); words past
        the tokenizer's vocabulary are zeroed. Pass the numpy view of the batch bitmask
        (`tensor.numpy()`, taken once): a torch tensor works too but costs ~10 us more per row.
        """
        if isinstance(bitmask, torch.Tensor):
            bitmask = bitmask_array(bitmask)
        mask = self.grammar.mask(self.state)  # [grammar words]
        words = mask.shape[0]
        if bitmask.dtype != np.int32 or bitmask.ndim != 2 or bitmask.shape[1] < words:
            raise ValueError(
                f"bitmask must be [rows, >= {words}] int32, got {bitmask.dtype} {bitmask.shape}"
            )
        bitmask[row, :words] = mask
        if bitmask.shape[1] > words:
            bitmask[row, words:] = 0

    def mask_row(self) -> np.ndarray:
        """The packed mask `fill_bitmask` writes, kept by the grammar per state: read-only, and
        the same array whenever a state recurs (while it stays cached), so a batch bitmask
        slot that was copied from this very array need not be written again.
        # [grammar words] int32"""
        return self.grammar.mask(self.state)

    def is_final(self) -> bool:
        """True when the output so far is complete: a stop token is allowed now."""
        return not self._terminated and self.grammar.is_final(self.state)

    def must_stop(self) -> bool:
        """True when only a stop token may come next (or one already came): the engine may end
        the request without sampling."""
        return self._terminated or self.grammar.allows_only_stop(self.state)

    def is_terminated(self) -> bool:
        """True once a stop token was accepted: the request is finished."""
        return self._terminated
