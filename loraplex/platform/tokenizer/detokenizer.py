"""Incremental detokenization that never splits a multi-byte character, plus stop strings."""

from __future__ import annotations

from loraplex.platform.tokenizer.tokenizer import Tokenizer

# Prompt tokens kept as left context so the first generated token decodes with the right
# leading space or byte merge.
_CONTEXT_TOKENS = 6


class IncrementalDetokenizer:
    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: list[int],
        skip_special_tokens: bool = True,
        stop: tuple[str, ...] = (),
        include_stop_str_in_output: bool = False,
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.stop = stop
        self.include_stop = include_stop_str_in_output
        self._ids = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self.text = ""
        self._emitted = 0  # characters of `text` already handed out
        self._max_stop = max((len(s) for s in stop), default=0)

    def add_tokens(self, token_ids: list[int]) -> str | None:
        """Append tokens; returns the stop string if one now appears (text is cut there)."""
        self._ids.extend(token_ids)
        decode = self.tokenizer.decode
        prefix = decode(
            self._ids[self._prefix_offset : self._read_offset], self.skip_special_tokens
        )
        full = decode(self._ids[self._prefix_offset :], self.skip_special_tokens)
        # NOTE: an incomplete UTF-8 sequence decodes to U+FFFD; hold it back until complete.
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            new_text = full[len(prefix) :]
            self._prefix_offset = self._read_offset
            self._read_offset = len(self._ids)
        else:
            return None
        start = max(len(self.text) - self._max_stop + 1, 0)
        self.text += new_text
        if not self.stop:
            return None
        for stop in self.stop:
            idx = self.text.find(stop, start)
            if idx >= 0:
                self.text = self.text[: idx + len(stop)] if self.include_stop else self.text[:idx]
                return stop
        return None

    def take_delta(self, final: bool) -> str:
        """New text since the last call. While running, hold back a tail that could still
        become a stop string, so a streamed stop string is never shown."""
        end = len(self.text)
        if not final and self.stop and not self.include_stop:
            end = max(self._emitted, end - self._max_stop + 1)
        delta = self.text[self._emitted : end]
        self._emitted = end
        return delta
