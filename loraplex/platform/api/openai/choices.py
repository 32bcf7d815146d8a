"""A whole (not streamed) response gathered from the engine's DELTA outputs: each choice's text,
logprobs and finish reason, and the request's token usage."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from loraplex.platform.api.openai.logprobs import TokenLogprobs
from loraplex.platform.api.openai.request_streams import merge_streams
from loraplex.platform.core.outputs import CompletionOutput, PromptLogprobs, RequestOutput
from loraplex.platform.engine.request_stream import RequestStream


@dataclass
class Choice:
    """One choice's output so far, gathered from DELTA outputs."""

    index: int
    text: list[str] = field(default_factory=list)
    num_tokens: int = 0
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_logprobs: PromptLogprobs | None = None  # its prompt's, with `prompt_logprobs` set

    def add(self, delta: CompletionOutput) -> None:
        self.text.append(delta.text)
        self.num_tokens += len(delta.token_ids)
        if delta.logprobs:
            self.logprobs.extend(delta.logprobs)
        if delta.finish_reason is not None:
            self.finish_reason, self.stop_reason = delta.finish_reason, delta.stop_reason

    @property
    def full_text(self) -> str:
        return "".join(self.text)


@dataclass
class UsageCounter:
    """Prompt, completion and cached prompt tokens over every prompt of one API request."""

    prompt_tokens: dict[int, int] = field(default_factory=dict)
    cached_tokens: dict[int, int] = field(default_factory=dict)
    completion_tokens: int = 0

    def add(self, prompt_index: int, output: RequestOutput) -> None:
        self.prompt_tokens[prompt_index] = len(output.prompt_token_ids)
        self.cached_tokens[prompt_index] = output.num_cached_tokens
        self.completion_tokens += sum(len(c.token_ids) for c in output.outputs)

    def as_dict(self) -> dict[str, Any]:
        prompt = sum(self.prompt_tokens.values())
        return {
            "prompt_tokens": prompt,
            "completion_tokens": self.completion_tokens,
            "total_tokens": prompt + self.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": sum(self.cached_tokens.values())},
        }


async def collect(
    streams: list[RequestStream],
    n: int,
    view: Callable[[RequestOutput], RequestOutput] | None = None,
) -> tuple[list[Choice], UsageCounter]:
    """Run every stream to its end; choices are numbered prompt_index * n + sample index.

    `view`, if given, rewrites each output before it counts (e.g. to drop generated tokens)."""
    choices = [Choice(i) for i in range(len(streams) * n)]
    usage = UsageCounter()
    async for prompt_index, output in merge_streams(streams):
        if view is not None:
            output = view(output)
        usage.add(prompt_index, output)
        if output.prompt_logprobs is not None:
            for choice in choices[prompt_index * n : (prompt_index + 1) * n]:
                choice.prompt_logprobs = output.prompt_logprobs
        for delta in output.outputs:
            choices[prompt_index * n + delta.index].add(delta)
    return choices, usage
