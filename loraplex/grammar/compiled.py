"""`CompiledGrammar`: an outlines-core index plus the packed token mask of each state."""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

import numpy as np
from outlines_core import Index

from loraplex.grammar.bitmask import bitmask_words
from loraplex.grammar.vocabulary import GrammarVocabulary

if TYPE_CHECKING:
    from loraplex.grammar.matcher import GrammarMatcher


class CompiledGrammar:
    """A compiled grammar shared by every request with the same spec; immutable to callers.

    Masks are packed little-endian: bit `t % 32` of word `t // 32` is set when token `t` is
    allowed. Stop tokens are allowed exactly in final states. Masks are built once per state on
    first use and kept (up to `max_cached_states`), so a step costs one row copy.
    """

    backend = "outlines"

    def __init__(
        self,
        index: Index,
        vocabulary: GrammarVocabulary,
        key: str,
        max_cached_states: int = 1024,
    ) -> None:
        self.index = index
        self.key = key
        self.vocab_size = vocabulary.vocab_size
        self.stop_token_ids = vocabulary.stop_token_ids
        self.end_marker_id = vocabulary.end_marker_id
        self._marker_length = len(vocabulary.end_marker.encode())
        self._marker_token_ids = vocabulary.marker_token_ids
        self._end_states = frozenset(index.get_final_states())
        self.initial_state: int = index.get_initial_state()
        self.max_cached_states = max_cached_states
        self._masks: dict[int, np.ndarray] = {}
        self._only_stop: dict[int, bool] = {}
        self._lock = threading.Lock()

    @property
    def num_words(self) -> int:
        return bitmask_words(self.vocab_size)

    def new_matcher(self) -> GrammarMatcher:
        """A matcher at the start of this grammar."""
        from loraplex.grammar.matcher import GrammarMatcher

        return GrammarMatcher(self)

    def is_final(self, state: int) -> bool:
        """True when the output so far is a complete match (a stop token may end it)."""
        # NOTE: membership, not mere existence: the marker may also be ordinary content
        # (a JSON string admits U+FFFF), which does not complete the grammar.
        return self.index.get_next_state(state, self.end_marker_id) in self._end_states

    def next_state(self, state: int, token_id: int) -> int | None:
        """The state after `token_id`, or None when `mask(state)` forbids it. Not for stop
        tokens.

        NOTE: the index has a transition for exactly the tokens a state's mask allows, but for
        the few that spell the end marker (cut from the mask): only those read the mask, so
        this costs one index lookup, and no mask is built for states only passed through."""
        if not 0 <= token_id < self.vocab_size:
            return None
        if token_id in self._marker_token_ids and not self.allows(state, token_id):
            return None
        return self.index.get_next_state(state, token_id)

    def mask(self, state: int) -> np.ndarray:
        """The packed allowed-token mask of `state`. # [num_words] int32, read-only"""
        mask = self._masks.get(state)
        if mask is None:
            mask = self._build_mask(state)
            with self._lock:
                if len(self._masks) < self.max_cached_states:
                    self._masks[state] = mask
        return mask

    def allows(self, state: int, token_id: int) -> bool:
        """True when `mask(state)` allows `token_id`."""
        if not 0 <= token_id < self.vocab_size:
            return False
        return bool(self.mask(state)[token_id >> 5] >> (token_id & 31) & 1)

    def allows_only_stop(self, state: int) -> bool:
        """True when `state` is complete and nothing but a stop token may follow."""
        only = self._only_stop.get(state)
        if only is None:
            only = set(self.allowed_token_ids(state)) <= set(self.stop_token_ids)
            self._only_stop[state] = only
        return only

    def allowed_token_ids(self, state: int) -> list[int]:
        """Token ids `mask(state)` allows, for tests and debugging."""
        bits = np.unpackbits(self.mask(state).view(np.uint8), bitorder="little")
        return np.flatnonzero(bits).tolist()

    def _build_mask(self, state: int) -> np.ndarray:
        allowed = np.zeros(self.num_words * 32, dtype=bool)  # [num_words * 32]
        tokens = np.asarray(self.index.get_allowed_tokens(state) or [], dtype=np.int64)
        allowed[tokens[tokens < self.vocab_size]] = True
        for token in self._marker_token_ids.intersection(tokens.tolist()):
            if self._spells_end(state, token, self._marker_length):
                allowed[token] = False
        # NOTE: the end marker (id vocab_size, filtered out above) stands for "complete";
        # every stop id is allowed exactly there. A state with no way forward may only stop.
        allowed[list(self.stop_token_ids)] = self.is_final(state)
        if not allowed.any():
            allowed[list(self.stop_token_ids)] = True
        packed = np.packbits(allowed, bitorder="little").view("<i4").astype(np.int32)
        packed.flags.writeable = False
        return packed  # [num_words]

    def _spells_end(self, state: int, token: int, depth: int) -> bool:
        """True when real `token` spells (part of) the end marker and leads nowhere else.

        NOTE: tokens are bytes, so real tokens can spell the marker's bytes; such a path would
        put the marker character in the output. It is cut where it starts.
        """
        after = self.index.get_next_state(state, token)
        if after is None:
            return False
        if after in self._end_states:
            return True
        allowed = self.index.get_allowed_tokens(after) or []
        if depth <= 1 or self.is_final(after):
            return False
        return all(
            t in self._marker_token_ids and self._spells_end(after, t, depth - 1) for t in allowed
        )
