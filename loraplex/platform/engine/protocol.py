"""EngineClient: what the API (and anything else that serves requests) holds of the engine.

Two implementations: `InprocClient` (the engine in this process, stepped by an `EngineLoop` on
a thread of its own) and `EngineCoreClient` (the engine in the EngineCore process, over ZeroMQ).
The API depends on this contract only. Importing this module loads no engine, runner or model
code: an API process talks to an engine elsewhere.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Protocol, TypeVar

from loraplex.adapters.request import LoRARequest
from loraplex.platform.core.commands import (
    AdapterAdded,
    AdapterStatsReport,
    AddAdapter,
    EngineCommand,
    GetAdapterStats,
    GetTenantStats,
    PinAdapter,
    RemoveAdapter,
    SetTenantWeight,
    TenantStatsReport,
)
from loraplex.platform.core.generation_defaults import GenerationDefaults
from loraplex.platform.core.outputs import RequestOutput
from loraplex.platform.core.sampling_params import SamplingParams
from loraplex.platform.core.stats import EngineSnapshot
from loraplex.platform.core.tenant_caps import TenantReservation
from loraplex.platform.core.timing import TimingObserver
from loraplex.platform.engine.request_stream import RequestStream
from loraplex.platform.tokenizer.tokenizer import TokenIdsOnlyTokenizer, Tokenizer

if TYPE_CHECKING:
    from loraplex.adapters.validator import AdapterValidator

_T = TypeVar("_T")


class EngineClient(Protocol):
    """A handle on one engine: requests in, their outputs back, engine commands, gauges.

    Contract of the primitives (each implementation states only how it meets it):

    - `add_request` returns once the engine has accepted the request, with its stream; it
      raises what the engine refused it with — `ValueError` and its kinds: `PromptTooLongError`
      (prompt plus max_tokens past the context), `AdapterValidationError` (an adapter that
      cannot be served), `GrammarError` (a structured-output spec that cannot be compiled, or
      one on an adapter with its own tokenizer), a request id already in flight — or
      `TenantLimitExceeded` when `reservation` does not fit its tenant's caps (counted by the
      engine for every caller: see `core/tenant_caps.py`), or `EngineDeadError` when the
      engine does not run. A caller cancelled while it waits
      aborts the request. A request on an adapter that stores its own tokenizer is tokenized
      and detokenized with it (`tokenizer_for`).
    - The stream yields outputs of the params' `output_kind` and ends after the finished one;
      a request that fails after it was accepted ends its stream with the error
      (`EngineDeadError` when the engine stops). A request the engine ends itself (the
      watchdog, a failed grammar or adapter load) finishes with reason "error" and the
      exception in its final output's `failure`.
    - `abort` may be called from any thread, at any time; an unknown or finished id is ignored.
    - `command` runs an engine command between steps and returns its result (the commands
      module lists them) or raises its error.
    - A request's `reservation` is held until it finishes, when its tenant is charged what it
      used, before its caller sees the final output: a tenant's next request is admitted
      against the charged budget. Timing observers see the request before its caller too.
    - `snapshot` is the engine's gauges as of a recent step; reading it never waits.
    - `served_model_name`, `max_model_len`, `generation_defaults` (a request's default sampling
      parameters, from the model's generation config), `tokenizer` and `adapter_validator`
      (None: LoRA is disabled) are set when the client is built and never change; any thread
      may read them.
      `tokenizer_for` may read an adapter's tokenizer from disk: call it off the event loop.

    The conveniences below (`generate`, the adapter and tenant commands) are written once over
    the primitives; an implementation subclasses this class to get them.
    """

    served_model_name: str
    max_model_len: int
    generation_defaults: GenerationDefaults
    tokenizer: Tokenizer | TokenIdsOnlyTokenizer
    adapter_validator: AdapterValidator | None

    # -- primitives ------------------------------------------------------------------------

    @abstractmethod
    def start(self) -> None:
        """Start serving (idempotent), on the event loop the requests will come from."""

    @abstractmethod
    def shutdown(self, timeout_s: float = 10.0) -> None:
        """Stop; requests still in flight fail with EngineDeadError."""

    @property
    @abstractmethod
    def is_running(self) -> bool:
        """Whether the engine serves requests now."""

    @abstractmethod
    def new_request_id(self, prefix: str = "req") -> str:
        """A request id unique on this engine (across API processes too)."""

    @abstractmethod
    async def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        *,
        prompt_token_ids: list[int] | None = None,
        tenant: str = "default",
        lora_request: LoRARequest | None = None,
        reservation: TenantReservation | None = None,
    ) -> RequestStream:
        """Send a request and wait until the engine accepts it (see the class docstring)."""

    @abstractmethod
    def abort(self, request_id: str) -> None:
        """Abort a request; unknown or finished ids are ignored."""

    @abstractmethod
    async def command(self, command: EngineCommand) -> object:
        """Run an engine command between steps; its result, or raises its error."""

    @abstractmethod
    def snapshot(self) -> EngineSnapshot:
        """The engine's gauges and counters as of a recent step."""

    @abstractmethod
    def add_timing_observer(self, observer: TimingObserver) -> None:
        """Call `observer` with each finished request's latencies."""

    @abstractmethod
    def tokenizer_for(self, lora_request: LoRARequest | None) -> Tokenizer | TokenIdsOnlyTokenizer:
        """The tokenizer of requests on `lora_request`: its adapter's own, else the base's."""

    # -- conveniences over the primitives --------------------------------------------------

    async def generate(
        self,
        prompt: str | list[int],
        params: SamplingParams,
        request_id: str | None = None,
        *,
        prompt_token_ids: list[int] | None = None,
        tenant: str = "default",
        lora_request: LoRARequest | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Yield the request's outputs; aborts the request if the consumer stops early.

        >>> async for out in client.generate("Hello", SamplingParams(max_tokens=8)):
        ...     print(out.outputs[0].text)
        """
        request_id = request_id or self.new_request_id()
        stream = await self.add_request(
            request_id,
            prompt,
            params,
            prompt_token_ids=prompt_token_ids,
            tenant=tenant,
            lora_request=lora_request,
        )
        try:
            async for output in stream:
                yield output
        finally:
            stream.abort()

    async def add_adapter(self, command: AddAdapter) -> AdapterAdded:
        """Register (or replace) an adapter; its weights load ahead of its first request."""
        return _expect(await self.command(command), AdapterAdded)

    async def remove_adapter(self, name: str) -> bool:
        """Unregister an adapter; requests already running on it finish on it."""
        return _expect(await self.command(RemoveAdapter(name)), bool)

    async def pin_adapter(self, name: str, pinned: bool = True) -> bool:
        """Keep an adapter in a GPU slot (or let it go); False if there is none of that name."""
        return _expect(await self.command(PinAdapter(name, pinned)), bool)

    async def adapter_stats(self) -> AdapterStatsReport:
        """Every adapter's residency, loads and requests, and the slot and cache pools."""
        return _expect(await self.command(GetAdapterStats()), AdapterStatsReport)

    async def tenant_stats(self) -> TenantStatsReport:
        """Each tenant's running and waiting sequences and the KV blocks they hold."""
        return _expect(await self.command(GetTenantStats()), TenantStatsReport)

    async def add_lora(self, lora_request: LoRARequest) -> str:
        """vLLM's `add_lora`: register a PEFT folder by path (hashed by the engine); returns
        its key. Raises AdapterValidationError, or ValueError when LoRA is disabled."""
        added = await self.add_adapter(AddAdapter(lora_request.lora_name, lora_request.lora_path))
        return added.key

    async def remove_lora(self, lora_name: str) -> bool:
        """vLLM's `remove_lora`: `remove_adapter`."""
        return await self.remove_adapter(lora_name)

    async def set_tenant_weight(self, tenant: str, weight: float) -> None:
        """The tenant's share in the scheduler's weighted fair queuing."""
        await self.command(SetTenantWeight(tenant, weight))


def _expect(value: object, kind: type[_T]) -> _T:
    """A command's result, checked to be of the kind the command returns."""
    if not isinstance(value, kind):
        raise TypeError(f"the engine answered {type(value).__name__}, not {kind.__name__}")
    return value
