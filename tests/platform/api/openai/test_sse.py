"""Chunk events framed from pre-encoded fragments are the bytes `sse` writes for the same
chunk: the streams' bytes do not depend on which path framed them."""

from __future__ import annotations

import pytest

from loraplex.platform.api.openai.sse import ChunkFrames, sse

TEXTS = ["", "plain", ' quote " and \\ backslash', "line\nbreak\ttab\x00nul\x1f", "café 日本 🦊",
         "\ud800 lone surrogate", "</script>"]  # fmt: skip


@pytest.mark.parametrize("usage", [False, True])
def test_chunk_frames_write_the_bytes_sse_writes(usage):
    head = {"id": "cmpl-abc", "object": "text_completion", "created": 1700000000,
            "model": 'a "model" é', "system_fingerprint": None}  # fmt: skip
    if usage:
        head["usage"] = None
    frames = ChunkFrames(head)
    for text in TEXTS:
        for index in (0, 7, 123):
            completion = {"index": index, "text": text, "logprobs": None, "finish_reason": None}
            assert frames.text(index, text) == sse({**head, "choices": [completion]})
            chat = {"index": index, "delta": {"content": text}, "logprobs": None,
                    "finish_reason": None}  # fmt: skip
            assert frames.content(index, text) == sse({**head, "choices": [chat]})
            final = {**completion, "finish_reason": "stop", "stop_reason": text or None}
            assert frames.choice(final) == sse({**head, "choices": [final]})
