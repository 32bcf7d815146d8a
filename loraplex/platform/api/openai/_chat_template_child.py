"""A chat template render process: `python -I _chat_template_child.py MEMORY_MIB PATHS`.

Run by `ChatTemplateRenderer` as a plain script under an address-space limit of MEMORY_MIB; PATHS
(a JSON list, the parent's sys.path) goes ahead of its own, so it imports loraplex and jinja2
as the parent does (the models' chat template sandbox, never torch). Reads frames on stdin (a
4-byte big-endian length, then JSON): `{"template", "context", "max_chars"}`, and answers each
with `{"text": ...}` or `{"error": kind, "message": ...}` (after a first `{"ready": true}`
once it has imported what it needs), kind being "syntax" (not a Jinja
template), "template" (it failed on, or refused, the conversation), "too_long" (past max_chars)
or "memory". A render that runs too long is ended by the parent killing this process; if the
parent dies, this process exits within a second even in the middle of a render.
"""

import json
import os
import resource
import struct
import sys
import threading

# NOTE: before any other import: the parent's sys.path (which -I did not inherit) ahead of this
# interpreter's own, so loraplex resolves to the parent's copy of it.
sys.path[:0] = [p for p in json.loads(sys.argv[2]) if p not in sys.path]

import jinja2  # noqa: E402

from loraplex.platform.tokenizer.chat_template import (  # noqa: E402
    ChatTemplateError,
    ChatTemplateTooLongError,
    compile_chat_template,
    render_chat_template,
)

_HEADER = struct.Struct(">I")
_PARENT_POLL_S = 0.5


def _read_job(stream) -> dict | None:
    """The next job, or None once the parent has closed the pipe.

    NOTE: a buffered binary stream's read(n) returns n bytes unless the pipe ends first."""
    header = stream.read(_HEADER.size)
    if len(header) < _HEADER.size:
        return None
    (size,) = _HEADER.unpack(header)
    data = stream.read(size)
    return json.loads(data) if len(data) == size else None


def _write_frame(stream, reply: dict) -> None:
    data = json.dumps(reply).encode()
    stream.write(_HEADER.pack(len(data)) + data)
    stream.flush()


def _exit_with_parent() -> None:
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            threading.Event().wait(_PARENT_POLL_S)
        os._exit(0)

    threading.Thread(target=watch, daemon=True).start()


def _render(job: dict) -> dict:
    try:
        template = compile_chat_template(job["template"])
    except jinja2.TemplateSyntaxError as error:
        return {"error": "syntax", "message": f"line {error.lineno}: {error.message}"}
    try:
        return {"text": render_chat_template(template, job["context"], job["max_chars"])}
    except ChatTemplateTooLongError as error:
        return {"error": "too_long", "message": str(error)}
    except MemoryError:
        return {"error": "memory", "message": "the chat template ran out of memory"}
    except RecursionError:
        return {"error": "template", "message": "the chat template recursed too deeply"}
    except ChatTemplateError as error:  # raise_exception, or a bound of the sandbox
        return {"error": "template", "message": str(error)}
    except Exception as error:  # the template's own fault: a type error, a missing key, ...
        return {"error": "template", "message": f"{type(error).__name__}: {error}"}


def main() -> None:
    limit = int(sys.argv[1]) * 1024 * 1024
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    _exit_with_parent()
    requests = sys.stdin.buffer
    # NOTE: the protocol owns the original stdout; stray prints go to stderr instead.
    replies = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    _write_frame(replies, {"ready": True})
    while (job := _read_job(requests)) is not None:
        _write_frame(replies, _render(job))


if __name__ == "__main__":
    main()
