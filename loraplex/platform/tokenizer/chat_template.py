"""Chat templates (Jinja, as Hugging Face writes them) in a sandbox, with bounded output.

`compile_chat_template` builds a template in jinja2's `ImmutableSandboxedEnvironment` (no
attribute access to internals, no mutation of the values passed in, `range` capped by jinja2)
with the globals and filters Hugging Face templates use; string and list repetition (`*`) and
powers (`**`) are bounded too. `render_chat_template` renders it piece by piece and stops once
the text passes `max_chars`, so a template cannot build a huge prompt before the limit is seen.

Time is not bounded here: a Python thread cannot be stopped, so a render that must not run long
runs in a process that can be killed (the API's `ChatTemplateRenderer`).
"""

from __future__ import annotations

import functools
import json
import operator
from collections.abc import Callable
from datetime import datetime
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

#: the longest string or list one `*` may build, and the largest exponent of `**`
MAX_REPEAT_ITEMS = 1 << 20
MAX_EXPONENT = 1 << 10
_COMPILED_CACHE = 64  # templates kept compiled (the base model's and the adapters' own)


class ChatTemplateError(ValueError):
    """The template refused the conversation (`raise_exception`) or could not render it."""


class ChatTemplateTooLongError(ChatTemplateError):
    """The rendered text passed the character limit."""

    def __init__(self, max_chars: int) -> None:
        super().__init__(f"the chat template rendered more than {max_chars} characters")
        self.max_chars = max_chars


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(f"chat template error: {message}")


def _tojson(value: Any, indent: int | None = None, ensure_ascii: bool = False) -> str:
    return json.dumps(value, indent=indent, ensure_ascii=ensure_ascii)


def _repeat(left: Any, right: Any) -> Any:
    for items, times in ((left, right), (right, left)):
        if isinstance(items, (str, list, tuple)) and isinstance(times, int):
            if len(items) * max(times, 0) > MAX_REPEAT_ITEMS:
                raise ChatTemplateError(
                    f"chat template error: `*` would build over {MAX_REPEAT_ITEMS} items"
                )
    return left * right


def _power(left: Any, right: Any) -> Any:
    if isinstance(right, int) and abs(right) > MAX_EXPONENT:
        raise ChatTemplateError(f"chat template error: `**` exponent over {MAX_EXPONENT}")
    return operator.pow(left, right)


class _BoundedSandbox(ImmutableSandboxedEnvironment):
    """The immutable sandbox, with `*` and `**` bounded (jinja2's operator interception)."""

    intercepted_binops = frozenset({"*", "**"})
    _BINOPS: dict[str, Callable[[Any, Any], Any]] = {"*": _repeat, "**": _power}

    def call_binop(self, context: jinja2.runtime.Context, operator: str, left: Any, right: Any):
        return self._BINOPS[operator](left, right)


def chat_template_environment() -> ImmutableSandboxedEnvironment:
    """The sandbox every chat template renders in: Hugging Face's options (`trim_blocks`,
    `lstrip_blocks`, loop controls) and globals (`raise_exception`, `strftime_now`, `tojson`)."""
    env = _BoundedSandbox(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    env.filters["tojson"] = _tojson
    return env


@functools.lru_cache(maxsize=_COMPILED_CACHE)
def compile_chat_template(source: str) -> jinja2.Template:
    """The compiled template (cached by its text); jinja2.TemplateSyntaxError if it is not one."""
    return chat_template_environment().from_string(source)


def render_chat_template(
    template: jinja2.Template, context: dict[str, Any], max_chars: int | None = None
) -> str:
    """The template rendered with `context`; ChatTemplateTooLongError as soon as the text passes
    `max_chars` (None: no limit)."""
    if max_chars is None:
        return template.render(**context)
    pieces: list[str] = []
    size = 0
    for piece in template.generate(**context):
        size += len(piece)
        if size > max_chars:
            raise ChatTemplateTooLongError(max_chars)
        pieces.append(piece)
    return "".join(pieces)
