"""The ids and creation times of response objects (`cmpl-...`, `chatcmpl-...`, `resp_...`)."""

from __future__ import annotations

import time
import uuid


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now_s() -> int:
    return int(time.time())
