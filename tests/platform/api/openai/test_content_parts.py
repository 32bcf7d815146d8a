"""Content parts the text-only model cannot read (images, audio, files) are refused with a 400
naming the part and its kind, in chat (streamed or not), /tokenize and the Responses API; text
parts are served."""

from __future__ import annotations

import httpx
import openai
import pytest

IMAGE = {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}
AUDIO = {"type": "input_audio", "input_audio": {"data": "UklGRg==", "format": "wav"}}
FILE = {"type": "file", "file": {"file_id": "file-abc"}}


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.v1, api_key="unused", max_retries=0)


def _messages(part: dict) -> list[dict]:
    return [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "What is this?"}, part]},
    ]


@pytest.mark.parametrize(("part", "kind"), [(IMAGE, "image_url"), (AUDIO, "input_audio"),
                                            (FILE, "file")])  # fmt: skip
@pytest.mark.parametrize("stream", [False, True])
def test_chat_refuses_the_part_by_name(client, server, part, kind, stream):
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(
            model=server.model, messages=_messages(part), max_tokens=4, stream=stream
        )
    error = refused.value.body
    assert error["message"] == (
        f"messages[1].content[1]: {kind} content parts are not supported by this server "
        "(text-only model)"
    )
    assert error["param"] == "messages.1.content.1.type"


def test_text_parts_are_served(client, server):
    parts = [{"type": "text", "text": "Name a color."}, {"type": "text", "text": " One word."}]
    reply = client.chat.completions.create(
        model=server.model, messages=[{"role": "user", "content": parts}], max_tokens=3
    )
    assert reply.choices[0].finish_reason in ("length", "stop")


def test_tokenize_refuses_the_part_too(server):
    response = httpx.post(
        f"{server.base_url}/tokenize", json={"messages": _messages(IMAGE)}, timeout=30
    )
    assert response.status_code == 400
    assert response.json()["error"]["message"].startswith("messages[1].content[1]: image_url")


def test_responses_refuse_an_image_input_by_name(client, server):
    item = {"role": "user", "content": [{"type": "input_text", "text": "What is this?"},
                                        {"type": "input_image", "image_url": IMAGE["image_url"]["url"]}]}  # fmt: skip
    with pytest.raises(openai.BadRequestError) as refused:
        client.responses.create(model=server.model, input=[item], max_output_tokens=4)
    error = refused.value.body
    assert error["message"] == (
        "input[0].content[1]: input_image content parts are not supported by this server "
        "(text-only model)"
    )
    assert error["param"] == "input.0.content.1.type"
