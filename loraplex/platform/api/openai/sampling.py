"""From an OpenAI request body to the engine's SamplingParams, refusing what we do not serve."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from loraplex.platform.api.errors import bad_request, from_engine_error
from loraplex.platform.api.openai.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    SamplingFields,
)
from loraplex.platform.core.generation_defaults import GenerationDefaults
from loraplex.platform.core.sampling_params import RequestOutputKind, SamplingParams
from loraplex.platform.core.structured_outputs import StructuredOutputs

_NO_DEFAULTS = GenerationDefaults()
DEFAULT_MAX_N = 16
DEFAULT_MAX_PROMPTS_PER_REQUEST = 64
# NOTE: real text averages 3-5 characters a token, and even long runs of spaces or symbols stay
# far below this; a text over max_model_len times this many characters cannot fit the context,
# so it is refused before it is tokenized (7 s of one core for 4 MiB) or templated.
MAX_CHARS_PER_TOKEN = 32


@dataclass(frozen=True)
class RequestLimits:
    """What one request may ask of this server: samples per prompt, prompts, token ids, and
    (given `max_model_len`) a prompt's length in tokens and in characters."""

    vocab_size: int
    max_n: int = DEFAULT_MAX_N
    max_prompts_per_request: int = DEFAULT_MAX_PROMPTS_PER_REQUEST
    max_model_len: int | None = None  # None: prompts are bounded by the body size alone

    def __post_init__(self) -> None:
        for name in ("vocab_size", "max_n", "max_prompts_per_request"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")

    @property
    def max_prompt_chars(self) -> int | None:
        """The longest text (a prompt, or a rendered chat) that may still fit the context."""
        return None if self.max_model_len is None else self.max_model_len * MAX_CHARS_PER_TOKEN


def check_prompt_size(prompt: str | list[int], limits: RequestLimits, param: str) -> None:
    """400 `context_length_exceeded` for a prompt that cannot fit the context: more token ids
    than `max_model_len`, or more characters than `max_prompt_chars` (checked before the
    prompt is tokenized or its ids are looked at)."""
    if limits.max_model_len is None:
        return
    if isinstance(prompt, str):
        if len(prompt) > (limit := limits.max_prompt_chars or 0):
            raise bad_request(
                f"{param} holds {len(prompt)} characters; a prompt this server can serve holds "
                f"at most {limit} ({MAX_CHARS_PER_TOKEN} per token of the {limits.max_model_len}"
                "-token context)",
                param=param,
                code="context_length_exceeded",
            )
    elif len(prompt) > limits.max_model_len:
        raise bad_request(
            f"{param} holds {len(prompt)} token ids; this model's context is "
            f"{limits.max_model_len} tokens",
            param=param,
            code="context_length_exceeded",
        )


# vLLM's extras, each a shorthand for one kind of `structured_outputs`.
_GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice"}
_STRUCTURED_KINDS = ("json", "regex", "choice", "json_object")


def structured_outputs_for(body: SamplingFields) -> StructuredOutputs | None:
    """The request's output constraint, or None when it asks for free text.

    Reads OpenAI's `response_format` (`json_schema`, `json_object`, `text`), vLLM's
    `structured_outputs` ({"json" | "regex" | "choice" | "json_object": ...}) and its older
    `guided_json` / `guided_regex` / `guided_choice`. At most one constraint may be given.
    Whether a schema can be honoured is decided when the engine admits the request.
    """
    given: list[tuple[str, str, Any]] = []  # (param, kind, spec)
    if body.response_format is not None:
        kind_spec = _response_format(body.response_format)
        if kind_spec is not None:
            given.append(("response_format", *kind_spec))
    if body.structured_outputs is not None:
        given.append(("structured_outputs", *_structured_field(body.structured_outputs)))
    for name, kind in _GUIDED_FIELDS.items():
        value = getattr(body, name)
        if value is not None:
            given.append((name, kind, value))
    if not given:
        return None
    if len(given) > 1:
        names = ", ".join(param for param, _, _ in given)
        raise bad_request(f"give at most one output constraint, got {names}", param=given[1][0])
    param, kind, spec = given[0]
    try:
        return StructuredOutputs(**{kind: spec})
    except ValueError as error:  # GrammarError included
        raise bad_request(str(error), param=param) from None
    except RecursionError:
        raise bad_request(f"{param} is nested too deeply", param=param) from None


def _response_format(value: dict[str, Any]) -> tuple[str, Any] | None:
    """(kind, spec) of OpenAI's `response_format`, or None for plain text."""
    kind = value.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return "json_object", True
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
            raise bad_request(
                "response_format of type 'json_schema' needs json_schema.schema, a JSON object",
                param="response_format.json_schema.schema",
            )
        return "json", spec["schema"]
    raise bad_request(
        f"response_format type must be 'text', 'json_object' or 'json_schema', got {kind!r}",
        param="response_format.type",
    )


def _structured_field(value: dict[str, Any]) -> tuple[str, Any]:
    """(kind, spec) of vLLM's `structured_outputs` object, which sets exactly one kind."""
    unknown = sorted(set(value) - set(_STRUCTURED_KINDS))
    if unknown:
        raise bad_request(
            f"structured_outputs field {unknown[0]!r} is not supported; "
            f"use one of {list(_STRUCTURED_KINDS)}",
            param=f"structured_outputs.{unknown[0]}",
        )
    set_kinds = [kind for kind in _STRUCTURED_KINDS if value.get(kind) not in (None, False)]
    if len(set_kinds) != 1:
        raise bad_request(
            f"structured_outputs needs exactly one of {list(_STRUCTURED_KINDS)}, "
            f"got {set_kinds or 'none'}",
            param="structured_outputs",
        )
    kind = set_kinds[0]
    if kind == "json_object" and value[kind] is not True:
        raise bad_request(
            "structured_outputs.json_object must be true", param="structured_outputs.json_object"
        )
    return kind, value[kind]


def check_token_ids(ids: list[int], limits: RequestLimits, param: str) -> None:
    bad = next((t for t in ids if not 0 <= t < limits.vocab_size), None)
    if bad is not None:
        raise bad_request(
            f"{param} holds token id {bad}, outside the vocabulary [0, {limits.vocab_size})",
            param=param,
        )


def _check_common(body: SamplingFields, limits: RequestLimits) -> None:
    if body.n > limits.max_n:
        raise bad_request(
            f"n must be at most {limits.max_n} on this server (--max-n), got {body.n}", param="n"
        )
    check_token_ids(body.stop_token_ids or [], limits, "stop_token_ids")
    if body.logit_bias:
        keys = [key for key in body.logit_bias if not (key.isascii() and key.isdigit())]
        if keys:
            raise bad_request(
                f"logit_bias keys must be token ids, got {keys[0]!r}", param="logit_bias"
            )
        check_token_ids([int(key) for key in body.logit_bias], limits, "logit_bias")


def _check_completion(body: CompletionRequest, limits: RequestLimits) -> None:
    if isinstance(body.prompt, list) and (
        not body.prompt or any(isinstance(p, list) and not p for p in body.prompt)
    ):
        raise bad_request("prompt must not be empty", param="prompt")
    prompts = body.prompts
    if len(prompts) > limits.max_prompts_per_request:
        raise bad_request(
            f"prompt holds {len(prompts)} prompts; this server takes at most "
            f"{limits.max_prompts_per_request} per request (--max-prompts-per-request)",
            param="prompt",
        )
    for prompt in prompts:
        check_prompt_size(prompt, limits, "prompt")
    for prompt in prompts:
        if isinstance(prompt, list):
            check_token_ids(prompt, limits, "prompt")
    if body.best_of is not None and body.best_of != body.n:
        raise bad_request("best_of is not supported (only best_of == n)", param="best_of")
    if body.suffix:
        raise bad_request("suffix is not supported", param="suffix")
    if body.echo_only and body.min_tokens > 0:
        raise bad_request(
            f"min_tokens must be 0 when max_tokens is 0, got {body.min_tokens}", param="min_tokens"
        )


# Chat fields we do not serve, and what to use instead (None: nothing).
_UNSERVED_CHAT = {
    "functions": "use tools", "function_call": "use tool_choice", "audio": None,
    "prediction": None, "web_search_options": None, "reasoning_effort": None,
}  # fmt: skip


def check_text_content(messages: list[ChatMessage]) -> None:
    """400 naming the first content part that is not text: this server's models read text."""
    for i, message in enumerate(messages):
        for j, part in enumerate(message.content if isinstance(message.content, list) else ()):
            where = f"messages[{i}].content[{j}]"
            if part.type != "text":
                raise bad_request(
                    f"{where}: {part.type} content parts are not supported by this server "
                    "(text-only model)",
                    param=f"messages.{i}.content.{j}.type",
                )
            if part.text is None:
                raise bad_request(
                    f"{where}: a text part needs `text`", param=f"messages.{i}.content.{j}.text"
                )


def _check_chat(body: ChatCompletionRequest) -> None:
    check_text_content(body.messages)
    for name, instead in _UNSERVED_CHAT.items():
        if getattr(body, name) is not None:
            hint = f"; {instead}" if instead else ""
            raise bad_request(f"{name} is not supported{hint}", param=name)
    if body.modalities is not None and set(body.modalities) - {"text"}:
        raise bad_request("only the text modality is supported", param="modalities")
    if body.top_logprobs is not None and not body.logprobs:
        raise bad_request("top_logprobs needs logprobs set to true", param="top_logprobs")
    if body.prompt_logprobs is not None and body.stream:
        raise bad_request(
            "prompt_logprobs is not supported with stream on chat completions",
            param="prompt_logprobs",
        )


def _given(value: Any, default: Any, fallback: Any) -> Any:
    """The request's value, else the server's default (generation config), else vLLM's."""
    if value is not None:
        return value
    return fallback if default is None else default


def _params(
    body: SamplingFields,
    max_tokens: int | None,
    logprobs: int | None,
    prompt_logprobs: int | None,
    defaults: GenerationDefaults,
) -> SamplingParams:
    # NOTE: max_tokens left None takes the default max_tokens (generation config), capped at
    # the rest of the context, once the engine knows the prompt's length.
    try:
        return SamplingParams(
            n=body.n,
            temperature=_given(body.temperature, defaults.temperature, 1.0),
            top_p=_given(body.top_p, defaults.top_p, 1.0),
            top_k=_given(body.top_k, defaults.top_k, 0),
            min_p=_given(body.min_p, defaults.min_p, 0.0),
            repetition_penalty=_given(body.repetition_penalty, defaults.repetition_penalty, 1.0),
            presence_penalty=body.presence_penalty,
            frequency_penalty=body.frequency_penalty,
            seed=body.seed,
            max_tokens=max_tokens,
            min_tokens=body.min_tokens,
            stop=tuple(body.stop_list),
            stop_token_ids=tuple(body.stop_token_ids or ()),
            ignore_eos=body.ignore_eos,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            skip_special_tokens=body.skip_special_tokens,
            include_stop_str_in_output=body.include_stop_str_in_output,
            structured_outputs=structured_outputs_for(body),
            logit_bias=tuple((int(k), v) for k, v in (body.logit_bias or {}).items()),
            output_kind=RequestOutputKind.DELTA,
        )
    except ValueError as error:
        raise from_engine_error(error) from None


def completion_sampling_params(
    body: CompletionRequest, limits: RequestLimits, defaults: GenerationDefaults | None = None
) -> SamplingParams:
    """Streaming-shaped (DELTA) params of a /v1/completions body, the server's `defaults` for
    the sampling fields it leaves out; APIError (400) if bad."""
    _check_common(body, limits)
    _check_completion(body, limits)
    # NOTE: `echo` with `max_tokens: 0` scores a text (lm-evaluation-harness does so), which
    # OpenAI and vLLM accept. The engine samples at least one token, so it runs one, and the
    # completion drops it from text, logprobs and usage (serving_completion). Without echo,
    # max_tokens 0 goes on to SamplingParams, which refuses it (400, param max_tokens).
    max_tokens = 1 if body.echo_only else body.max_tokens
    # The echoed prompt's logprobs come from the engine's prompt logprobs.
    prompt_logprobs = body.prompt_logprobs
    if body.echo and body.logprobs is not None:
        prompt_logprobs = max(prompt_logprobs or 0, body.logprobs)
    return _params(body, max_tokens, body.logprobs, prompt_logprobs, defaults or _NO_DEFAULTS)


def chat_sampling_params(
    body: ChatCompletionRequest, limits: RequestLimits, defaults: GenerationDefaults | None = None
) -> SamplingParams:
    """Streaming-shaped (DELTA) params of a /v1/chat/completions body, the server's `defaults`
    for the sampling fields it leaves out; APIError (400) if bad."""
    _check_common(body, limits)
    _check_chat(body)
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    return _params(
        body, body.max_new_tokens, logprobs, body.prompt_logprobs, defaults or _NO_DEFAULTS
    )
