"""Errors a structured-output request can fail with. Every one is a `ValueError` subclass the API
turns into a 400: the request asked for something the grammar compiler cannot honour."""

from __future__ import annotations


class GrammarError(ValueError):
    """Base class: the structured-output spec cannot be compiled into a token automaton."""


class UnsupportedSchemaError(GrammarError):
    """The JSON schema uses a keyword or value the compiler cannot enforce.

    `feature` names it (e.g. "multipleOf", "format: hostname"), so the client learns what to drop.
    """

    def __init__(self, feature: str, detail: str = "") -> None:
        self.feature = feature
        self.detail = detail
        message = f"unsupported JSON schema feature: {feature}"
        super().__init__(f"{message} ({detail})" if detail else message)


class GrammarCompileError(GrammarError):
    """The compiler rejected the spec (an invalid regex, a schema outlines-core refuses)."""


class GrammarTimeoutError(GrammarError):
    """Compiling took longer than `GrammarConfig.compile_timeout_s`."""


class GrammarMemoryError(GrammarError):
    """Compiling needed more memory than `GrammarConfig.compile_memory_mib`."""


class SchemaTooLargeError(GrammarError):
    """The JSON schema is over one of `GrammarConfig`'s size limits; `limit` names it
    (e.g. "max_schema_depth"). Checked before anything else looks at the schema."""

    def __init__(self, limit: str, message: str) -> None:
        self.limit = limit
        super().__init__(message)
