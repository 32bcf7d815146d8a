"""The llguidance backend's runtime side: a compiled grammar and the per-request matcher.

llguidance computes each mask from the parser's state at every step (tens of microseconds, the
GIL released) instead of reusing one mask per automaton state as outlines-core's grammars do.
See `llguidance_compile` for what it enforces and how it is compiled.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

import numpy as np
import torch

from loraplex.grammar.bitmask import bitmask_array, bitmask_words
from loraplex.grammar.llguidance_compile import _MAGIC

if TYPE_CHECKING:
    from llguidance import LLMatcher, LLTokenizer

    from loraplex.grammar.vocabulary import GrammarVocabulary

_tokenizers: dict[str, LLTokenizer] = {}
_tokenizers_lock = threading.Lock()


def llguidance_tokenizer(vocabulary: GrammarVocabulary) -> LLTokenizer:
    """llguidance's view of the tokenizer, built once per vocabulary (about a second)."""
    from llguidance import LLTokenizer

    with _tokenizers_lock:
        tokenizer = _tokenizers.get(vocabulary.fingerprint)
        if tokenizer is None:
            if not vocabulary.tokenizer_json:
                raise ValueError("this GrammarVocabulary carries no tokenizer JSON for llguidance")
            tokenizer = LLTokenizer(
                vocabulary.tokenizer_json,
                n_vocab=vocabulary.vocab_size,
                eos_token=list(vocabulary.stop_token_ids),
            )
            _tokenizers[vocabulary.fingerprint] = tokenizer
        return tokenizer


class LLGuidanceGrammar:
    """A compiled llguidance grammar shared by every request with the same spec.

    Built off the engine thread (the compiler's pool): the tokenizer and a first matcher are
    made here, and each request's matcher is a copy of that one.
    """

    backend = "llguidance"

    def __init__(self, data: bytes, vocabulary: GrammarVocabulary, key: str) -> None:
        from llguidance import LLMatcher

        from loraplex.grammar.errors import GrammarCompileError

        self.key = key
        self.vocab_size = vocabulary.vocab_size
        self.stop_token_ids = vocabulary.stop_token_ids
        self.grammar = data[len(_MAGIC) :].decode()
        self._template = LLMatcher(llguidance_tokenizer(vocabulary), self.grammar, log_level=0)
        if self._template.is_error():
            raise GrammarCompileError(f"llguidance: {self._template.get_error()}")

    @property
    def num_words(self) -> int:
        return bitmask_words(self.vocab_size)

    def new_matcher(self) -> LLGuidanceMatcher:
        """A matcher at the start of this grammar."""
        return LLGuidanceMatcher(self, self._template.deep_copy())


class LLGuidanceMatcher:
    """One request's position in an llguidance grammar; `GrammarMatcher`'s interface.

    A stop token is accepted only where the grammar is complete and terminates the matcher."""

    def __init__(self, grammar: LLGuidanceGrammar, matcher: LLMatcher) -> None:
        self.grammar = grammar
        self._matcher = matcher
        self._only_stop: bool | None = None
        # NOTE: llguidance stops by itself where nothing may follow; the request still ends
        # with a stop token, accepted here.
        self._terminated = False

    def accept_token(self, token_id: int) -> bool:
        """Advance by `token_id`; False (state unchanged) when the grammar forbids it."""
        m = self._matcher
        if self._terminated or not 0 <= token_id < self.grammar.vocab_size:
            return False
        self._only_stop = None
        if token_id in self.grammar.stop_token_ids:
            if m.is_stopped() or (m.is_accepting() and m.consume_token(token_id)):
                self._terminated = True
            return self._terminated
        # NOTE: try_consume leaves the matcher as it was for a forbidden token.
        return not m.is_stopped() and m.try_consume_tokens([token_id]) == 1

    def accept_tokens(self, token_ids: list[int]) -> bool:
        """Advance by each token in turn; stops at the first forbidden one."""
        return all(self.accept_token(token_id) for token_id in token_ids)

    def fill_bitmask(self, bitmask: np.ndarray | torch.Tensor, row: int) -> None:
        """Write the allowed-token mask into `bitmask[row]` (CPU), as `GrammarMatcher` does."""
        if isinstance(bitmask, torch.Tensor):
            bitmask = bitmask_array(bitmask)
        words = self.grammar.num_words
        if bitmask.dtype != np.int32 or bitmask.ndim != 2 or bitmask.shape[1] < words:
            raise ValueError(
                f"bitmask must be [rows, >= {words}] int32, got {bitmask.dtype} {bitmask.shape}"
            )
        target = bitmask[row, :words]
        if not target.flags.c_contiguous:
            raise ValueError("bitmask rows must be contiguous")
        if self._matcher.is_stopped():
            target[:] = 0
            words_u32 = target.view(np.uint32)
            for stop in self.grammar.stop_token_ids:
                words_u32[stop >> 5] |= np.uint32(1 << (stop & 31))
        else:
            # NOTE: releases the GIL while llguidance computes the mask.
            self._matcher.unsafe_compute_mask_ptr(target.ctypes.data, target.nbytes)
        if bitmask.shape[1] > words:
            bitmask[row, words:] = 0

    def mask_row(self) -> None:
        """None: llguidance computes each mask from the whole parse (`fill_bitmask`)."""
        return None

    def is_final(self) -> bool:
        """True when the output so far is complete: a stop token is allowed now."""
        m = self._matcher
        return not self._terminated and (m.is_stopped() or m.is_accepting())

    def must_stop(self) -> bool:
        """True when only a stop token may come next (or one already came)."""
        if self._terminated or self._matcher.is_stopped():
            return True
        if not self._matcher.is_accepting():
            return False
        if self._only_stop is None:
            row = np.zeros((1, self.grammar.num_words), dtype=np.int32)
            self.fill_bitmask(row, 0)
            allowed = np.flatnonzero(np.unpackbits(row.view(np.uint8), bitorder="little"))
            self._only_stop = set(allowed.tolist()) <= set(self.grammar.stop_token_ids)
        return self._only_stop

    def is_terminated(self) -> bool:
        """True once a stop token was accepted: the request is finished."""
        return self._terminated
