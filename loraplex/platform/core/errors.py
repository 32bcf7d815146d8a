"""The errors that travel: raised in the engine, rebuilt by class name in API processes."""

from __future__ import annotations


class EngineDeadError(RuntimeError):
    """The engine thread has stopped; no request can be served."""


class RequestStalledError(RuntimeError):
    """The watchdog ended a request that made no progress for `request_stall_timeout_s`; it is
    the `failure` of the request's final output (finish reason "error")."""


class PromptTooLongError(ValueError):
    """The prompt plus the requested tokens do not fit the model's context; `param` names the
    engine's field at fault (`prompt` or `max_tokens`: the API renames them to its own)."""

    def __init__(self, message: str, param: str = "prompt") -> None:
        super().__init__(message)
        self.param = param
