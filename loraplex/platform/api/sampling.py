"""From an OpenAI request body to the engine's SamplingParams, refusing what we do not serve."""

from __future__ import annotations

from typing import TYPE_CHECKING

from loraplex.platform.api.errors import bad_request, from_engine_error
from loraplex.platform.api.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    SamplingFields,
)
from loraplex.platform.engine.sampling_params import RequestOutputKind, SamplingParams

if TYPE_CHECKING:
    from loraplex.grammar.params import StructuredOutputs

MAX_N = 128
_MAX_INT32 = 2**31 - 1
_STRUCTURED_FIELDS = ("structured_outputs", "guided_json", "guided_regex", "guided_choice")


def structured_outputs_for(body: SamplingFields) -> StructuredOutputs | None:
    """The request's output constraint, or None when it asks for free text.

    NOTE: the grammar engine is not wired into the sampler yet, so every structured-output
    request answers 400 "not supported yet" here. This is the one function to replace when it is.
    """
    if body.response_format is not None and body.response_format.get("type", "text") != "text":
        raise bad_request(
            "response_format of type "
            f"{body.response_format.get('type')!r} is not supported yet; only 'text' is",
            param="response_format",
        )
    for name in _STRUCTURED_FIELDS:
        if getattr(body, name) is not None:
            raise bad_request(f"{name} is not supported yet", param=name)
    return None


def _check_common(body: SamplingFields) -> None:
    if body.n > MAX_N:
        raise bad_request(f"n must be at most {MAX_N}, got {body.n}", param="n")
    if body.top_k is not None and body.top_k > _MAX_INT32:
        raise bad_request(f"top_k must be at most {_MAX_INT32}, got {body.top_k}", param="top_k")
    if body.logit_bias:
        raise bad_request("logit_bias is not supported", param="logit_bias")


def _check_completion(body: CompletionRequest) -> None:
    if isinstance(body.prompt, list) and (
        not body.prompt or any(isinstance(p, list) and not p for p in body.prompt)
    ):
        raise bad_request("prompt must not be empty", param="prompt")
    if body.best_of is not None and body.best_of != body.n:
        raise bad_request("best_of is not supported (only best_of == n)", param="best_of")
    if body.suffix:
        raise bad_request("suffix is not supported", param="suffix")
    if body.echo and body.logprobs is not None:
        raise bad_request("echo with logprobs is not supported", param="echo")


def _check_chat(body: ChatCompletionRequest) -> None:
    if body.top_logprobs is not None and not body.logprobs:
        raise bad_request("top_logprobs needs logprobs set to true", param="top_logprobs")
    if body.tools and body.tool_choice != "none":
        raise bad_request("tools are not supported yet", param="tools")


def _params(body: SamplingFields, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
    try:
        return SamplingParams(
            n=body.n,
            temperature=1.0 if body.temperature is None else body.temperature,
            top_p=1.0 if body.top_p is None else body.top_p,
            top_k=body.top_k or 0,
            min_p=body.min_p or 0.0,
            repetition_penalty=(
                1.0 if body.repetition_penalty is None else body.repetition_penalty
            ),
            presence_penalty=body.presence_penalty,
            frequency_penalty=body.frequency_penalty,
            seed=body.seed,
            max_tokens=max_tokens,
            min_tokens=body.min_tokens,
            stop=tuple(body.stop_list),
            stop_token_ids=tuple(body.stop_token_ids or ()),
            ignore_eos=body.ignore_eos,
            logprobs=logprobs,
            skip_special_tokens=body.skip_special_tokens,
            include_stop_str_in_output=body.include_stop_str_in_output,
            structured_outputs=structured_outputs_for(body),
            output_kind=RequestOutputKind.DELTA,
        )
    except ValueError as error:
        raise from_engine_error(error) from None


def completion_sampling_params(body: CompletionRequest) -> SamplingParams:
    """Streaming-shaped (DELTA) params of a /v1/completions body; APIError (400) if bad."""
    _check_common(body)
    _check_completion(body)
    return _params(body, body.max_tokens, body.logprobs)


def chat_sampling_params(body: ChatCompletionRequest) -> SamplingParams:
    """Streaming-shaped (DELTA) params of a /v1/chat/completions body; APIError (400) if bad."""
    _check_common(body)
    _check_chat(body)
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    return _params(body, body.max_new_tokens, logprobs)
