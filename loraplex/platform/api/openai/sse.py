"""Server-sent events as OpenAI streams them: one `data: {json}` event per chunk, `data: [DONE]`
at the end, and the error event that ends a stream which failed after its 200."""

from __future__ import annotations

import json
import logging
from typing import Any

from loraplex.platform.api.errors import APIError, engine_unavailable
from loraplex.platform.core.errors import EngineDeadError

SSE_DONE = "data: [DONE]\n\n"

logger = logging.getLogger(__name__)


def sse(payload: dict[str, Any]) -> str:
    """One server-sent event carrying `payload` as JSON."""
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


def error_event(error: Exception) -> str:
    """The SSE event that ends a stream which failed after its 200 was sent."""
    if isinstance(error, APIError):
        return sse(error.body())
    if isinstance(error, EngineDeadError):
        return sse(engine_unavailable(error).body())
    logger.error("a stream failed", exc_info=error)
    return sse(APIError(500, "internal server error", type="internal_server_error").body())
