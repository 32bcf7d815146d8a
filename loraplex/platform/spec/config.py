"""`SpeculativeConfig`: vLLM's `--speculative-config` shape, validated."""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any

METHODS = ("ngram", "draft_model")


@dataclass(frozen=True)
class SpeculativeConfig:
    """Which proposer bets tokens for the target model, and how many per step.

    method: "ngram" (prompt lookup: no model) or "draft_model" (a smaller model of the same
        tokenizer; `model` given without a method means this one).
    model: the draft model's folder (draft_model only).
    num_speculative_tokens: tokens proposed per request per step (k); the target verifies
        them in one forward pass and emits 1 to k + 1 tokens.
    prompt_lookup_max / prompt_lookup_min: the longest and shortest suffix n-gram the n-gram
        proposer looks up in the request's tokens (longest first).
    disable_by_batch_size: speculation switches itself off while this many requests or more
        run (the step is then compute-bound and verifying drafts costs throughput); None:
        never.
    draft_num_kv_blocks: blocks of the draft model's own paged KV cache (draft_model only).
    """

    method: str = "ngram"
    num_speculative_tokens: int = 4
    model: str | None = None
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 1
    disable_by_batch_size: int | None = None
    draft_num_kv_blocks: int = 1024

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"speculative method must be one of {METHODS}, got {self.method!r}")
        k = self.num_speculative_tokens
        if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= 16:
            raise ValueError(f"num_speculative_tokens must be an integer in [1, 16], got {k!r}")
        if self.method == "draft_model" and not self.model:
            raise ValueError("the draft_model method needs a 'model' (the draft's folder)")
        if self.method == "ngram" and self.model is not None:
            raise ValueError("the ngram method takes no 'model'")
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        if not (isinstance(lo, int) and isinstance(hi, int) and 1 <= lo <= hi):
            raise ValueError(
                f"prompt_lookup_min and prompt_lookup_max must be integers with "
                f"1 <= min <= max, got {lo!r}, {hi!r}"
            )
        limit = self.disable_by_batch_size
        if limit is not None and (not isinstance(limit, int) or limit < 1):
            raise ValueError(f"disable_by_batch_size must be a positive integer, got {limit!r}")
        if self.draft_num_kv_blocks < 1:
            raise ValueError(f"draft_num_kv_blocks must be >= 1, got {self.draft_num_kv_blocks}")

    @classmethod
    def parse(cls, value: str | dict[str, Any] | SpeculativeConfig) -> SpeculativeConfig:
        """From a JSON object (text or dict) in vLLM's shape:
        `{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}` or
        `{"model": PATH, "num_speculative_tokens": k}`. Unknown keys raise ValueError."""
        if isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"speculative config is not valid JSON: {e}") from None
        if not isinstance(value, dict):
            raise ValueError("speculative config must be a JSON object")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"unknown speculative config keys: {unknown}")
        options = dict(value)
        if "method" not in options and options.get("model"):
            options["method"] = "draft_model"
        if "num_speculative_tokens" not in options:
            raise ValueError("speculative config needs 'num_speculative_tokens'")
        return cls(**options)
