"""Logprobs in the two OpenAI shapes: chat (`content: [...]`) and legacy completions."""

from __future__ import annotations

from typing import Any

from loraplex.platform.engine.outputs import Logprob

# One dict per generated token: token id -> Logprob, the sampled token first.
TokenLogprobs = dict[int, Logprob]


def _sampled(entry: TokenLogprobs) -> Logprob:
    return next(iter(entry.values()))


def _top(entry: TokenLogprobs, k: int) -> list[Logprob]:
    return sorted((lp for lp in entry.values() if lp.rank <= k), key=lambda lp: lp.rank)[:k]


def _finite(value: float) -> float:
    # NOTE: JSON has no -inf; OpenAI clients expect a number, so clamp as vLLM does.
    return max(value, -9999.0)


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
    tokens, token_logprobs, top_logprobs, offsets = [], [], [], []
    offset = text_offset
    for entry in entries:
        sampled = _sampled(entry)
        tokens.append(sampled.decoded_token)
        token_logprobs.append(_finite(sampled.logprob))
        top_logprobs.append({lp.decoded_token: _finite(lp.logprob) for lp in _top(entry, top_k)})
        offsets.append(offset)
        offset += len(sampled.decoded_token)
    return {
        "tokens": tokens,
        "token_logprobs": token_logprobs,
        "top_logprobs": top_logprobs,
        "text_offset": offsets,
    }
