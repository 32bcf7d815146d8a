"""Counters of speculative decoding (vLLM's `spec_decode_*` metrics)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecDecodingStats:
    """Since start: verifications with drafts, drafts verified, drafts accepted, and how
    many were accepted at each draft position (position 0 is the first draft)."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)

    def observe(self, num_draft_tokens: int, num_accepted: int) -> None:
        """One request's verification: `num_accepted` of its `num_draft_tokens` passed."""
        if not 0 <= num_accepted <= num_draft_tokens:
            raise ValueError(f"accepted {num_accepted} of {num_draft_tokens} drafts")
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        per_pos = self.num_accepted_tokens_per_pos
        if len(per_pos) < num_draft_tokens:
            per_pos.extend([0] * (num_draft_tokens - len(per_pos)))
        for j in range(num_accepted):
            per_pos[j] += 1

    @property
    def acceptance_rate(self) -> float:
        """Accepted over proposed drafts (0 before any)."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens emitted per verification: 1 + accepted drafts, averaged (0 before any)."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0

    def snapshot(self) -> SpecDecodingStats:
        return SpecDecodingStats(
            self.num_drafts, self.num_draft_tokens, self.num_accepted_tokens,
            list(self.num_accepted_tokens_per_pos),
        )  # fmt: skip
