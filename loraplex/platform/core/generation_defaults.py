"""`GenerationDefaults`: the sampling parameters a request gets for the fields it leaves out.

vLLM's rule: the model's `generation_config.json` (Hugging Face's names: `max_new_tokens`,
`temperature`, `top_p`, `top_k`, `min_p`, `repetition_penalty`), updated by the operator's
`--override-generation-config`, gives the defaults; a request's own values win over both. A
request without `max_tokens` generates up to the default `max_tokens` (`max_new_tokens`),
capped at what is left of the context, or without a default to the end of the context.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

from loraplex.platform.core.sampling_params import SamplingParams

# Hugging Face's generation-config name -> vLLM's (SamplingParams') name; other keys of a
# generation_config.json (bos_token_id, do_sample, ...) are not sampling defaults.
HF_SAMPLING_KEYS = {
    "max_new_tokens": "max_tokens",
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
}
_INTEGERS = frozenset({"max_tokens", "top_k"})


@dataclass(frozen=True)
class GenerationDefaults:
    """Default sampling parameters (None: SamplingParams' own default, vLLM's)."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    max_tokens: int | None = None

    def __post_init__(self) -> None:
        SamplingParams(**self.given())  # NOTE: the same ranges as a request's (ValueError)

    @classmethod
    def from_hf(
        cls, config: Mapping[str, Any], source: str, strict: bool = False
    ) -> GenerationDefaults:
        """The defaults a generation config (Hugging Face's names) sets; ValueError naming
        `source` and the key for a value of the wrong type or range. `strict`: a key that is
        not a sampling default is refused too (an operator's override, where a misspelt key
        would otherwise change nothing)."""
        if strict:
            unknown = sorted(set(config) - set(HF_SAMPLING_KEYS))
            if unknown:
                raise ValueError(
                    f"{source}: unknown key(s) {unknown}; the sampling defaults are "
                    f"{sorted(HF_SAMPLING_KEYS)} (Hugging Face's names: max_new_tokens is "
                    "max_tokens)"
                )
        values: dict[str, Any] = {}
        for hf_name, name in HF_SAMPLING_KEYS.items():
            value = config.get(hf_name)
            if value is None:
                continue
            integer = isinstance(value, int) and not isinstance(value, bool)
            if not integer and (name in _INTEGERS or not isinstance(value, float)):
                kind = "an integer" if name in _INTEGERS else "a number"
                raise ValueError(f"{source}: {hf_name} must be {kind}, got {value!r}")
            values[name] = value if name in _INTEGERS else float(value)
        try:
            return cls(**values)
        except ValueError as error:
            raise ValueError(f"{source}: {error}") from None

    def given(self) -> dict[str, Any]:
        """The defaults that are set, by SamplingParams' names."""
        return {name: value for name, value in asdict(self).items() if value is not None}

    def updated(self, other: GenerationDefaults) -> GenerationDefaults:
        """These defaults with `other`'s set values taking their place."""
        return GenerationDefaults(**{**self.given(), **other.given()})

    def sampling_params(self) -> SamplingParams:
        """The SamplingParams of a request that gives none (the offline `LLM`, as vLLM's)."""
        return SamplingParams(**self.given())

    def max_tokens_for(
        self, requested: int | None, num_prompt_tokens: int, max_model_len: int
    ) -> int:
        """The tokens a request may generate: `requested`, else the default capped at the
        rest of the context, else the rest of the context."""
        if requested is not None:
            return requested
        rest = max_model_len - num_prompt_tokens
        return rest if self.max_tokens is None else min(self.max_tokens, rest)
