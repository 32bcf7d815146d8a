"""The messages between API processes and the EngineCore process, and their msgpack codec.

Every message is a tagged msgspec Struct (typed, versioned by `PROTOCOL_VERSION`, checked in
the `Hello` / `EngineInfo` handshake); nothing is pickled. API -> core: `Hello`, `AddRequest`,
`Abort`, `Stop`, `CommandRequest`. Core -> API: `EngineInfo` (the handshake's answer), then one
`CoreBatch` per client per engine step, holding every acknowledgement, output, command result,
finished request's timing and (at most every `SNAPSHOT_INTERVAL_S`) the engine snapshot.
The dataclasses inside them (`SamplingParams`, `RequestOutput`, stats) travel as themselves:
msgspec encodes them by field and runs their own checks when it decodes them.

Engine commands (`loraplex.platform.core.commands`) and their results travel generically: the
class name plus the msgpack body of the frozen dataclass, decoded by name against the classes of
that module, so a new command needs no change here. Exceptions travel as `ErrorInfo` (class name,
message, `param`) and are rebuilt as the same class when it is one of `_ERROR_TYPES`.
"""

from __future__ import annotations

import dataclasses
import inspect
import typing
from typing import Any

import msgspec

from loraplex.adapters import errors as adapter_errors
from loraplex.adapters.request import LoRARequest
from loraplex.adapters.validator import AdapterValidator
from loraplex.grammar import errors as grammar_errors
from loraplex.platform.core import commands
from loraplex.platform.core.errors import (
    EngineDeadError,
    PromptTooLongError,
    RequestStalledError,
    TenantLimitExceeded,
)
from loraplex.platform.core.generation_defaults import GenerationDefaults
from loraplex.platform.core.outputs import RequestOutput, StopHit
from loraplex.platform.core.sampling_params import SamplingParams
from loraplex.platform.core.stats import EngineSnapshot
from loraplex.platform.core.tenant_caps import TenantReservation
from loraplex.platform.core.timing import RequestTiming

# 2: outputs carry token ids only; the API processes detokenize. 3: typed SamplingParams in
# AddRequest, typed RequestMetrics in outputs, GetTenantStats, EngineInfo's generation defaults,
# RequestTiming's queue / prefill / decode times. 4: AddRequest carries the tenant's caps and
# what the request reserves of them (the core enforces them); errors carry Retry-After.
PROTOCOL_VERSION = 4
SNAPSHOT_INTERVAL_S = 0.05  # the most often the core publishes its gauges while busy


class ErrorInfo(msgspec.Struct, frozen=True):
    kind: str  # the exception's class name
    message: str
    param: str | None = None  # `ValueError.param` where the error names a request field
    retry_after_s: int | None = None  # `TenantLimitExceeded.retry_after_s`


class Hello(msgspec.Struct, tag=True, frozen=True):
    version: int


class EngineInfo(msgspec.Struct, tag=True, frozen=True):
    """What an API process needs to know about the engine it talks to."""

    version: int
    served_model_name: str
    max_model_len: int
    model_dir: str
    vocab_size: int
    pid: int
    adapter_validator: AdapterValidator | None  # None: LoRA disabled
    generation_defaults: GenerationDefaults  # requests' default sampling parameters


class AddRequest(msgspec.Struct, tag=True, frozen=True):
    request_id: str
    prompt: str | list[int]
    params: SamplingParams  # validated again when decoded (see `refusal`)
    prompt_token_ids: list[int] | None
    tenant: str
    lora: tuple[str, str, int] | None  # LoRARequest (name, path, int id)
    arrival: float  # time.monotonic() in the API process (one clock per host)
    reservation: TenantReservation | None = None  # the tenant's caps and what this one holds


class Abort(msgspec.Struct, tag=True, frozen=True):
    request_ids: list[str]


class Stop(msgspec.Struct, tag=True, frozen=True):
    """Samples whose text matched a stop string in the API process: the core ends them."""

    hits: list[StopHit]


class CommandRequest(msgspec.Struct, tag=True, frozen=True):
    seq: int  # the client's number for this command; its result carries it back
    kind: str  # the command's class name in loraplex.platform.core.commands
    body: msgspec.Raw


class AddResult(msgspec.Struct, frozen=True):
    """The engine's answer to `AddRequest`: accepted (error None) or refused."""

    request_id: str
    error: ErrorInfo | None = None


class RequestFailure(msgspec.Struct, frozen=True):
    """An accepted request that ended in an error (e.g. its step failed, or the engine stops)."""

    request_id: str
    error: ErrorInfo


_NIL = msgspec.Raw(b"\xc0")  # msgpack's nil


class CommandResult(msgspec.Struct, frozen=True):
    seq: int
    kind: str | None = None  # the result's class name; None for a plain value (bool, None)
    body: msgspec.Raw = _NIL  # the msgpack of the result
    error: ErrorInfo | None = None


class CoreBatch(msgspec.Struct, tag=True):
    """Everything one engine step has for one API process."""

    acks: list[AddResult] = []
    outputs: list[RequestOutput] = []
    failures: list[RequestFailure] = []
    results: list[CommandResult] = []
    timings: list[RequestTiming] = []  # every finished request, whichever process sent it
    snapshot: EngineSnapshot | None = None


ClientMessage = Hello | AddRequest | Abort | Stop | CommandRequest
CoreMessage = EngineInfo | CoreBatch

_ERROR_TYPES: dict[str, type[BaseException]] = {
    cls.__name__: cls
    for module in (grammar_errors, adapter_errors)
    for cls in vars(module).values()
    if inspect.isclass(cls) and issubclass(cls, Exception)
}
_ERROR_TYPES.update(
    {cls.__name__: cls for cls in (ValueError, KeyError, TypeError, RuntimeError,
                                   PromptTooLongError, RequestStalledError, EngineDeadError,
                                   TenantLimitExceeded)}
)  # fmt: skip
# Every frozen dataclass of the commands module: the commands and their results.
_COMMAND_TYPES: dict[str, type] = {
    cls.__name__: cls for cls in vars(commands).values() if dataclasses.is_dataclass(cls)
}


def error_info(error: BaseException) -> ErrorInfo:
    param = getattr(error, "param", None)
    message = str(error.args[0]) if isinstance(error, KeyError) and error.args else str(error)
    retry = getattr(error, "retry_after_s", None)
    return ErrorInfo(
        type(error).__name__,
        message,
        param if isinstance(param, str) else None,
        retry if isinstance(retry, int) else None,
    )


def rebuild_error(info: ErrorInfo) -> BaseException:
    """The exception `info` describes, as its own class when known (else RuntimeError)."""
    cls = _ERROR_TYPES.get(info.kind, RuntimeError)
    # NOTE: built without the class's own __init__ (whose signature varies): the message and
    # `param` are what the API reads.
    error = cls.__new__(cls)
    Exception.__init__(error, info.message)
    if info.param is not None or isinstance(error, TenantLimitExceeded):
        error.param = info.param  # type: ignore[attr-defined]
    if isinstance(error, TenantLimitExceeded):
        error.retry_after_s = info.retry_after_s
    return error


class _AddRequestId(msgspec.Struct, tag="AddRequest"):
    """Only the id of an `AddRequest` (its other fields are ignored)."""

    request_id: str


def refusal(data: bytes, error: msgspec.ValidationError) -> tuple[str, ValueError] | None:
    """An `AddRequest` whose fields fail validation (its SamplingParams' own checks run when it
    is decoded) is refused, not dropped: (its request id, the error to refuse it with); None
    for any other malformed message."""
    try:
        request_id = msgspec.msgpack.decode(data, type=_AddRequestId).request_id
    except msgspec.DecodeError:
        return None
    cause = error.__cause__
    return request_id, cause if isinstance(cause, ValueError) else ValueError(str(error))


def lora_to_wire(lora: LoRARequest | None) -> tuple[str, str, int] | None:
    return None if lora is None else (lora.lora_name, lora.lora_path, lora.lora_int_id)


def lora_from_wire(lora: tuple[str, str, int] | list | None) -> LoRARequest | None:
    return None if lora is None else LoRARequest(lora[0], lora[2], lora[1])


def _enc_hook(obj: object) -> object:
    if isinstance(obj, BaseException):
        return msgspec.structs.asdict(error_info(obj))
    raise NotImplementedError(f"cannot encode {type(obj).__name__}")


def _dec_hook(kind: type, obj: Any) -> object:
    if kind is Exception:
        return rebuild_error(msgspec.convert(obj, ErrorInfo))
    raise NotImplementedError(f"cannot decode {kind!r}")


class Codec:
    """Encoder and decoders of one side (each process makes its own)."""

    def __init__(self) -> None:
        self._encoder = msgspec.msgpack.Encoder(enc_hook=_enc_hook)
        self._client = msgspec.msgpack.Decoder(ClientMessage, dec_hook=_dec_hook)
        self._core = msgspec.msgpack.Decoder(CoreMessage, dec_hook=_dec_hook)

    def encode(self, message: object) -> bytes:
        return self._encoder.encode(message)

    def decode_client(self, data: bytes) -> ClientMessage:
        """A message an API process sent; msgspec.DecodeError if malformed."""
        return self._client.decode(data)

    def decode_core(self, data: bytes) -> CoreMessage:
        return self._core.decode(data)

    def command(self, seq: int, command: object) -> CommandRequest:
        kind = type(command).__name__
        if _COMMAND_TYPES.get(kind) is not type(command):
            raise TypeError(f"{kind} is not an engine command of loraplex.platform.core.commands")
        return CommandRequest(seq, kind, msgspec.Raw(self._encoder.encode(command)))

    @staticmethod
    def command_of(request: CommandRequest) -> object:
        cls = _COMMAND_TYPES.get(request.kind)
        if cls is None or cls not in typing.get_args(commands.EngineCommand):
            raise ValueError(f"unknown engine command {request.kind!r}")
        return msgspec.msgpack.decode(request.body, type=cls)

    def result(self, seq: int, value: object) -> CommandResult:
        kind = type(value).__name__ if dataclasses.is_dataclass(value) else None
        return CommandResult(seq, kind, msgspec.Raw(self._encoder.encode(value)))

    @staticmethod
    def result_of(result: CommandResult) -> object:
        """The command's return value, or raises its error."""
        if result.error is not None:
            raise rebuild_error(result.error)
        if result.kind is None:
            return msgspec.msgpack.decode(result.body)
        return msgspec.msgpack.decode(result.body, type=_COMMAND_TYPES[result.kind])
