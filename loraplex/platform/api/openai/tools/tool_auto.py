"""`tool_choice: "auto"` with enforced calls: free text until the model writes its template's
call marker, then the call under a grammar built from the tools' schemas.

`AutoToolStream` runs one choice as a chain of engine requests and reads like one request's
stream (`RequestStream`): a free phase stops at the parser's `marker`; the stream writes the
marker and `call_prefix`, then a constrained phase generates `call_schema` and the stream adds
`call_suffix`; with parallel calls a free phase follows again (another call, or the end). Each
phase's prompt is the prompt plus everything written so far, so prefix caching reuses its KV.
The text it yields is what the model wrote in the template's format: the parser reads it back.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from dataclasses import replace

from loraplex.adapters.request import LoRARequest
from loraplex.platform.api.errors import from_engine_error
from loraplex.platform.api.openai.request_streams import Prompt, merge_streams
from loraplex.platform.api.openai.tools.tool_calls import ToolRequest
from loraplex.platform.api.openai.tools.tool_parsers import ToolParser
from loraplex.platform.api.tenancy.limits import limit_error, reserve
from loraplex.platform.core.errors import TenantLimitExceeded
from loraplex.platform.core.outputs import CompletionOutput, RequestOutput
from loraplex.platform.core.sampling_params import SamplingParams
from loraplex.platform.core.structured_outputs import StructuredOutputs
from loraplex.platform.core.tenant_caps import TenantCaps
from loraplex.platform.engine.protocol import EngineClient
from loraplex.platform.engine.request_stream import RequestStream

MAX_CALLS = 16  # calls one choice may open (parallel calls); then it ends


class AutoToolStream:
    """One choice of an `auto` tool request (see module doc). Iterate it like a RequestStream;
    `abort()` ends the phase running now and any to come. Outputs carry the original prompt's
    token ids, so usage counts the prompt once and every generated token once."""

    def __init__(
        self,
        engine: EngineClient,
        prompt: Prompt,
        params: SamplingParams,
        request_id: str,
        tools: ToolRequest,
        parser: ToolParser,
        tenant: str,
        lora_request: LoRARequest | None,
        index: int = 0,
        caps: TenantCaps | None = None,
    ) -> None:
        self.engine, self.prompt, self.params = engine, prompt, params
        self.request_id, self.tools, self.parser = request_id, tools, parser
        self.tenant, self.lora_request, self.index = tenant, lora_request, index
        self.caps = caps  # each phase holds its part; after the first, never refused
        self.grammar = StructuredOutputs(
            json=parser.call_schema(list(tools.functions), tools.parallel)
        )
        self.finished = False
        self._text = ""  # everything written so far (model and stream)
        self._generated = 0  # tokens the model generated so far
        self._calls = 0
        self._phase: RequestStream | None = None
        self._constrained = False
        self._cached = 0
        self._ids = itertools.count()

    @classmethod
    async def start(cls, *args, **kwargs) -> AutoToolStream:
        """The stream with its first (free) phase added; ValueError as `add_request` raises."""
        stream = cls(*args, **kwargs)
        await stream._next_phase(constrained=False)
        return stream

    def __aiter__(self) -> AutoToolStream:
        return self

    def _remaining(self) -> int | None:
        if self.params.max_tokens is None:
            return None
        return self.params.max_tokens - self._generated

    async def _next_phase(self, constrained: bool) -> None:
        first = self._phase is None
        if constrained:
            params = replace(
                self.params, stop=(), stop_token_ids=(), min_tokens=0,
                include_stop_str_in_output=False, structured_outputs=self.grammar,
                max_tokens=self._remaining(),
            )  # fmt: skip
        else:
            params = replace(
                self.params, stop=(*self.params.stop, self.parser.marker),
                include_stop_str_in_output=False, max_tokens=self._remaining(),
                min_tokens=max(0, self.params.min_tokens - self._generated),
            )  # fmt: skip
        tokenizer = self.engine.tokenizer_for(self.lora_request)  # loaded by the route already
        text = self.prompt.text + self._text
        ids = self.prompt.token_ids + tokenizer.encode(self._text, add_special_tokens=False)
        if not first:  # the prompt's logprobs come with the first phase only
            params = replace(params, prompt_logprobs=None)
        self._constrained = constrained
        held = reserve(self.caps, self.engine, params, len(ids), not first)
        self._phase = await self.engine.add_request(
            f"{self.request_id}-{self.index}.{next(self._ids)}", text, params,
            prompt_token_ids=ids, tenant=self.tenant, lora_request=self.lora_request,
            reservation=held,
        )  # fmt: skip

    async def __anext__(self) -> RequestOutput:
        if self.finished or self._phase is None:
            raise StopAsyncIteration
        try:
            output = await anext(self._phase)
        except StopAsyncIteration:
            self.finished = True
            raise
        if output.error is not None:
            self.finished = True
            return output
        if not self._generated and not self._text:
            self._cached = output.num_cached_tokens
        delta = output.outputs[0]
        self._text += delta.text
        self._generated += len(delta.token_ids)
        finish, stop, extra = delta.finish_reason, delta.stop_reason, ""
        if finish == "stop" and self._remaining() != 0:
            if not self._constrained and stop == self.parser.marker and self._calls < MAX_CALLS:
                extra, finish = self.parser.marker + self.parser.call_prefix, None
                self._calls += 1
                self._text += extra
                await self._next_phase(constrained=True)
            elif self._constrained:
                extra = self.parser.call_suffix
                self._text += extra
                if self.tools.parallel:
                    finish = None
                    await self._next_phase(constrained=False)
        if finish is not None:
            self.finished = True
        return self._output(output, delta, extra, finish, stop if finish else None)

    def _output(
        self,
        output: RequestOutput,
        delta: CompletionOutput,
        extra: str,
        finish: str | None,
        stop: int | str | None,
    ) -> RequestOutput:
        text = delta.text + extra
        completion = replace(delta, index=self.index, text=text, finish_reason=finish,
                             stop_reason=stop)  # fmt: skip
        return replace(
            output, prompt_token_ids=self.prompt.token_ids, outputs=[completion],
            finished=finish is not None, num_cached_tokens=self._cached,
        )  # fmt: skip

    def abort(self) -> None:
        """Stop generating (idempotent)."""
        self.finished = True
        if self._phase is not None:
            self._phase.abort()


class AutoToolChoices:
    """The n choices of an `auto` tool request as one stream (outputs numbered by choice, as
    one engine request with n samples gives them)."""

    def __init__(self, children: list[AutoToolStream]) -> None:
        self.children = children
        self._merged = merge_streams(list(children))  # type: ignore[arg-type]
        self.finished = False

    def __aiter__(self) -> AutoToolChoices:
        return self

    async def __anext__(self) -> RequestOutput:
        try:
            _, output = await anext(self._merged)
        except StopAsyncIteration:
            self.finished = True
            raise
        return output

    def abort(self) -> None:
        self.finished = True
        for child in self.children:
            child.abort()


async def submit_auto(
    engine: EngineClient,
    prompt: Prompt,
    params: SamplingParams,
    request_id: str,
    tools: ToolRequest,
    parser: ToolParser,
    tenant: str,
    lora_request: LoRARequest | None,
    fields: Mapping[str, str] | None = None,
    caps: TenantCaps | None = None,
) -> list[AutoToolChoices]:
    """Start every choice of an `auto` tool request; if any is refused, abort the others and
    raise 4xx (as `request_streams.submit`)."""
    children: list[AutoToolStream] = []
    try:
        for i in range(params.n):
            child = params.for_child(i) if params.n > 1 else params
            children.append(
                await AutoToolStream.start(
                    engine,
                    prompt,
                    child,
                    request_id,
                    tools,
                    parser,
                    tenant,
                    lora_request,
                    i,
                    caps,
                )  # fmt: skip
            )
    except ValueError as error:
        for stream in children:
            stream.abort()
        raise from_engine_error(error, fields) from None
    except TenantLimitExceeded as error:
        for stream in children:
            stream.abort()
        raise limit_error(error) from None
    except BaseException:
        for stream in children:
            stream.abort()
        raise
    return [AutoToolChoices(children)]
