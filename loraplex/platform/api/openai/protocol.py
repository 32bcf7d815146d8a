"""Request and response bodies of the OpenAI-compatible API (pydantic).

Requests accept OpenAI's fields plus vLLM's sampling extras and ignore unknown fields, as vLLM
does. Types are strict (a string is not a number), so wrong types answer 400 rather than being
coerced; every number is range-checked here (floats finite, integers within what the engine and
a 64-bit integer can hold), so the ranges also show in `/openapi.json`. Limits that depend on the
server (`n`, prompts per request, the vocabulary) are checked in `sampling`. Responses are plain
dicts built in the serving modules; only requests are modelled here.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag

MAX_INT32 = 2**31 - 1
MAX_INT64 = 2**63 - 1
MIN_INT64 = -(2**63)
MAX_LOGPROBS = 20

TokenId = Annotated[int, Field(ge=0, le=MAX_INT32)]
Count = Annotated[int, Field(ge=0, le=MAX_INT32)]
Logprobs = Annotated[int, Field(ge=0, le=MAX_LOGPROBS)]
Penalty = Annotated[float, Field(ge=-2.0, le=2.0)]


class _Body(BaseModel):
    # NOTE: allow_inf_nan=False: NaN and +-Infinity never reach the engine (400 instead).
    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)


class StreamOptions(_Body):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class SamplingFields(_Body):
    """Sampling fields shared by completions and chat completions."""

    model: str | None = None
    n: int = Field(1, ge=1, le=MAX_INT32)  # at most the server's --max-n (sampling)
    max_tokens: Count | None = None
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=MIN_INT64, le=MAX_INT64)  # OpenAI: a 64-bit integer
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: Penalty = 0.0
    frequency_penalty: Penalty = 0.0
    user: str | None = None
    logit_bias: dict[str, Annotated[float, Field(ge=-100.0, le=100.0)]] | None = None
    # vLLM's extras
    top_k: int | None = Field(None, ge=-1, le=MAX_INT32)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(None, gt=0.0, le=2.0)
    min_tokens: Count = 0
    ignore_eos: bool = False
    stop_token_ids: list[TokenId] | None = None  # within the vocabulary (sampling)
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    prompt_logprobs: Logprobs | None = None  # each prompt token's logprob and the top-k
    # Structured output: accepted here, answered by `sampling.structured_outputs_for`.
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None

    @property
    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


def _prompt_form(value: Any) -> str:
    """Which form of `prompt` a value is, from its first item.

    NOTE: a plain union would try every form in turn, and collect an error per item for each
    form that fails: a quarter of a second for 600,000 token ids. Picking the form first keeps
    validation one pass. (The tags are capitalized, so error paths skip them.)"""
    if isinstance(value, str):
        return "Text"
    if isinstance(value, list) and value and isinstance(value[0], str):
        return "Texts"
    if isinstance(value, list) and value and isinstance(value[0], list):
        return "TokenIdLists"
    return "TokenIds"


Prompts = Annotated[
    Annotated[str, Tag("Text")]
    | Annotated[list[str], Tag("Texts")]
    | Annotated[list[TokenId], Tag("TokenIds")]
    | Annotated[list[list[TokenId]], Tag("TokenIdLists")],
    Discriminator(_prompt_form),
]


class CompletionRequest(SamplingFields):
    """POST /v1/completions."""

    prompt: Prompts
    max_tokens: Count | None = 16
    logprobs: Logprobs | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = Field(None, ge=1, le=MAX_INT32)

    @property
    def echo_only(self) -> bool:
        """`echo` with `max_tokens: 0`: return the prompt (and its logprobs), generate nothing."""
        return self.echo and self.max_tokens == 0

    @property
    def prompts(self) -> list[str | list[int]]:
        """The prompts as a list: strings, or lists of token ids."""
        prompt = self.prompt
        if isinstance(prompt, str):
            return [prompt]
        if not prompt or isinstance(prompt[0], int):  # one prompt of token ids (see _prompt_form)
            return [list(prompt)]  # type: ignore[arg-type]
        return list(prompt)  # type: ignore[arg-type]


class ContentPart(_Body):
    """One part of a message's `content`. Text parts are served; any other kind (`image_url`,
    `input_audio`, `file`, ...) is refused with a 400 naming it (`sampling.check_text_content`),
    so its fields are not modelled here."""

    type: str
    text: str | None = None


class FunctionCall(_Body):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(_Body):
    """An earlier assistant turn's call (`messages[i].tool_calls[j]`)."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # on assistant turns
    tool_call_id: str | None = None  # on tool turns: the call it answers

    def as_template_dict(self) -> dict[str, Any]:
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text or "" for part in content)
        role = "system" if self.role == "developer" else self.role
        message: dict[str, Any] = {"role": role, "content": content or ""}
        if self.name is not None:
            message["name"] = self.name
        return message


class ChatCompletionRequest(SamplingFields):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Count | None = None
    logprobs: bool = False
    top_logprobs: Logprobs | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    # OpenAI fields we do not serve: refused with a 400 naming them (`sampling`), never
    # ignored. (`store`, `metadata`, `service_tier`, `prompt_cache_key`, `safety_identifier`
    # and `user` are accepted and ignored, as they change no output.)
    functions: list[Any] | None = None
    function_call: Any = None
    audio: Any = None
    prediction: Any = None
    web_search_options: Any = None
    reasoning_effort: Any = None
    modalities: list[str] | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None

    @property
    def max_new_tokens(self) -> int | None:
        """`max_completion_tokens` (OpenAI's current name) wins over `max_tokens`."""
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        return self.max_tokens


class TokenizeRequest(_Body):
    """POST /tokenize (vLLM's): `prompt` text, or chat `messages` through the template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None  # default: True for a prompt, False for messages
    add_generation_prompt: bool = True
    return_token_strs: bool = False
    tools: list[dict[str, Any]] | None = None
    chat_template_kwargs: dict[str, Any] | None = None


class DetokenizeRequest(_Body):
    """POST /detokenize (vLLM's): token ids back to text."""

    model: str | None = None
    tokens: list[TokenId]


class ResponsesRequest(_Body):
    """POST /v1/responses (OpenAI's Responses API), the fields we serve.

    `input` is text or a list of items: messages (`{"role", "content"}`, with or without
    `"type": "message"`), `function_call` and `function_call_output`. Fields we do not serve
    are refused by name in `serving_responses` rather than ignored."""

    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: Count | None = None
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    text: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    stream: bool = False
    previous_response_id: str | None = None
    store: bool = True
    metadata: dict[str, str] | None = None
    user: str | None = None
    truncation: Literal["disabled"] | None = None
    background: bool | None = None
    include: list[str] | None = None
    reasoning: dict[str, Any] | None = None
    top_logprobs: Logprobs | None = None
    conversation: Any = None
    prompt: Any = None
    max_tool_calls: Any = None
