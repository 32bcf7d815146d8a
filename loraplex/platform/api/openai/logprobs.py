"""Logprobs in the OpenAI shapes: chat (`content: [...]`), legacy completions (echo too), and
vLLM's `prompt_logprobs`."""

from __future__ import annotations

from typing import Any

from loraplex.platform.core.outputs import Logprob, PromptLogprobs

# One dict per generated token: token id -> Logprob, the sampled token first.
TokenLogprobs = dict[int, Logprob]
# One item of a legacy `logprobs` object: (token text, the chosen token's Logprob or None,
# top_logprobs or None); None for the first prompt token, which nothing precedes.
_Row = tuple[str, Logprob | None, dict[str, float] | None]


def _sampled(entry: TokenLogprobs) -> Logprob:
    return next(iter(entry.values()))


def _top(entry: TokenLogprobs, k: int) -> list[Logprob]:
    return sorted((lp for lp in entry.values() if lp.rank <= k), key=lambda lp: lp.rank)[:k]


def _finite(value: float) -> float:
    # NOTE: JSON has no -inf or NaN; OpenAI clients expect a number, so clamp as vLLM does
    # (a NaN, from an adapter whose finite weights overflow, fails the comparison too).
    return value if value >= -9999.0 else -9999.0


def chat_logprobs(entries: list[TokenLogprobs], top_k: int) -> dict[str, Any]:
    """`choices[i].logprobs` of a chat completion (or of one streamed chunk)."""
    content = []
    for entry in entries:
        sampled = _sampled(entry)
        content.append(
            {
                "token": sampled.decoded_token,
                "logprob": _finite(sampled.logprob),
                "bytes": list(sampled.decoded_token.encode("utf-8")),
                "top_logprobs": [
                    {
                        "token": lp.decoded_token,
                        "logprob": _finite(lp.logprob),
                        "bytes": list(lp.decoded_token.encode("utf-8")),
                    }
                    for lp in _top(entry, top_k)
                ],
            }
        )
    return {"content": content}


def completion_logprobs(
    entries: list[TokenLogprobs], top_k: int, text_offset: int
) -> dict[str, Any]:
    """`choices[i].logprobs` of a legacy completion; offsets count from `text_offset`."""
    rows: list[_Row] = []
    for entry in entries:
        sampled = _sampled(entry)
        rows.append((sampled.decoded_token, sampled, _legacy_top(entry, sampled, top_k)))
    return _legacy(rows, text_offset)


def echo_logprobs(
    prompt_token_ids: list[int], entries: PromptLogprobs, first_token: str, top_k: int
) -> dict[str, Any]:
    """The echoed prompt's part of a legacy completion's `logprobs`, offsets counted from 0.

    The first token, which nothing precedes, has a null logprob and null top_logprobs, as in
    OpenAI's answers; `first_token` is its text. Every later token has its own logprob.
    """
    rows: list[_Row] = [(first_token, None, None)]
    for token_id, entry in _scored_prompt_tokens(prompt_token_ids, entries):
        chosen = entry[token_id]
        rows.append((chosen.decoded_token, chosen, _legacy_top(entry, chosen, top_k)))
    return _legacy(rows, 0)


def join_completion_logprobs(first: dict[str, Any], second: dict[str, Any]) -> dict[str, Any]:
    """Two legacy `logprobs` objects one after the other (the echoed prompt, then the rest)."""
    return {key: first[key] + second[key] for key in first}


def vllm_prompt_logprobs(
    prompt_token_ids: list[int], entries: PromptLogprobs, top_k: int
) -> list[dict[str, dict[str, Any]] | None]:
    """vLLM's `prompt_logprobs` field: null for the first prompt token, then for each later one
    token id (a string, as JSON keys are) -> {"logprob", "rank", "decoded_token"}, holding the
    prompt token itself and the `top_k` most likely tokens."""
    result: list[dict[str, dict[str, Any]] | None] = [None]
    for token_id, entry in _scored_prompt_tokens(prompt_token_ids, entries):
        result.append(
            {
                str(other): {
                    "logprob": _finite(lp.logprob),
                    "rank": lp.rank,
                    "decoded_token": lp.decoded_token,
                }
                for other, lp in entry.items()
                if other == token_id or lp.rank <= top_k
            }
        )
    return result


def _scored_prompt_tokens(
    prompt_token_ids: list[int], entries: PromptLogprobs
) -> list[tuple[int, TokenLogprobs]]:
    """(token id, its entry) of every prompt token after the first; ValueError if one lacks it."""
    if len(entries) != len(prompt_token_ids):
        raise ValueError(
            f"{len(entries)} prompt logprob entries for {len(prompt_token_ids)} prompt tokens"
        )
    scored = []
    for position in range(1, len(prompt_token_ids)):
        token_id, entry = prompt_token_ids[position], entries[position]
        if entry is None or token_id not in entry:
            raise ValueError(f"no logprob for prompt token {position} (id {token_id})")
        scored.append((token_id, entry))
    return scored


def _legacy_top(entry: TokenLogprobs, chosen: Logprob, top_k: int) -> dict[str, float]:
    # NOTE: OpenAI's legacy shape holds the chosen token besides the top-k (up to k + 1 items).
    top = {lp.decoded_token: _finite(lp.logprob) for lp in _top(entry, top_k)}
    top.setdefault(chosen.decoded_token, _finite(chosen.logprob))
    return top


def _legacy(rows: list[_Row], text_offset: int) -> dict[str, Any]:
    """The four parallel lists of a legacy `logprobs` object, offsets from `text_offset`."""
    tokens, token_logprobs, top_logprobs, offsets = [], [], [], []
    offset = text_offset
    for token, chosen, top in rows:
        tokens.append(token)
        token_logprobs.append(None if chosen is None else _finite(chosen.logprob))
        top_logprobs.append(top)
        offsets.append(offset)
        offset += len(token)
    return {
        "tokens": tokens,
        "token_logprobs": token_logprobs,
        "top_logprobs": top_logprobs,
        "text_offset": offsets,
    }
