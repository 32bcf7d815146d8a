"""Server-sent events as OpenAI streams them: one `data: {json}` event per chunk, `data: [DONE]`
at the end, and the error event that ends a stream which failed after its 200.

A streamed response repeats the same head (`id`, `object`, `created`, `model`, ...) in every
chunk, and most chunks carry one choice's new text and nothing else. `ChunkFrames` encodes the
head once per response and frames such a chunk from pre-encoded fragments around the text's
JSON string: the same bytes `sse({**head, "choices": [choice]})` writes, without building and
encoding a dict per token.
"""

from __future__ import annotations

import json
import logging
from json.encoder import encode_basestring  # what json.dumps(..., ensure_ascii=False) runs
from typing import Any

from loraplex.platform.api.errors import APIError, engine_unavailable
from loraplex.platform.core.errors import EngineDeadError

SSE_DONE = "data: [DONE]\n\n"
_CHOICES_NULL = '"choices": null}'
_INDEX = '{"index": '

logger = logging.getLogger(__name__)


def sse(payload: dict[str, Any]) -> str:
    """One server-sent event carrying `payload` as JSON."""
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


class ChunkFrames:
    """The chunk events of one streamed response whose chunks are `{**head, "choices": [...]}`
    (`head` last key before "choices"; the chunk's other keys, e.g. `usage`, in `head`)."""

    def __init__(self, head: dict[str, Any]) -> None:
        encoded = sse({**head, "choices": None})
        assert encoded.endswith(_CHOICES_NULL + "\n\n")
        self._prefix = encoded[: -len("null}\n\n")] + "[" + _INDEX

    def choice(self, choice: dict[str, Any]) -> str:
        """The event of one chunk holding `choice` (whose first key is "index")."""
        body = json.dumps(choice, ensure_ascii=False)
        assert body.startswith(_INDEX)
        return self._prefix + body[len(_INDEX) :] + "]}\n\n"

    def text(self, index: int, text: str) -> str:
        """A completion chunk of choice `index`'s new text, nothing finished, no logprobs."""
        return (
            f'{self._prefix}{index}, "text": {encode_basestring(text)}, '
            '"logprobs": null, "finish_reason": null}]}\n\n'
        )

    def content(self, index: int, text: str) -> str:
        """A chat chunk of choice `index`'s new content, nothing finished, no logprobs."""
        return (
            f'{self._prefix}{index}, "delta": {{"content": {encode_basestring(text)}}}, '
            '"logprobs": null, "finish_reason": null}]}\n\n'
        )


def error_event(error: Exception) -> str:
    """The SSE event that ends a stream which failed after its 200 was sent."""
    if isinstance(error, APIError):
        return sse(error.body())
    if isinstance(error, EngineDeadError):
        return sse(engine_unavailable(error).body())
    logger.error("a stream failed", exc_info=error)
    return sse(APIError(500, "internal server error", type="internal_server_error").body())
