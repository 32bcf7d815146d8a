"""What a user reads in answers: errors name the field the request used (`prompt` on
completions, `messages` on chat, `input` / `max_output_tokens` on responses), `/v1/models`
shows real creation times, and stored responses can be deleted as OpenAI deletes them."""

from __future__ import annotations

import time

import httpx
import openai
import pytest

LONG = "word " * 600  # over the test server's 512-token context


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.v1, api_key="unused", max_retries=0)


def _refused(call) -> dict:
    with pytest.raises(openai.BadRequestError) as refused:
        call()
    return refused.value.body


def test_a_context_overflow_names_the_field_the_request_used(client, server):
    model = server.model
    error = _refused(lambda: client.completions.create(model=model, prompt=LONG, max_tokens=4))
    assert (error["param"], error["code"]) == ("prompt", "context_length_exceeded")
    error = _refused(lambda: client.completions.create(model=model, prompt="Hi", max_tokens=600))
    assert error["param"] == "max_tokens"
    error = _refused(
        lambda: client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": LONG}], max_tokens=4
        )
    )
    assert error["param"] == "messages"
    error = _refused(lambda: client.responses.create(model=model, input=LONG))
    assert error["param"] == "input"
    error = _refused(
        lambda: client.responses.create(model=model, input="Hi", max_output_tokens=600)
    )
    assert error["param"] == "max_output_tokens"


def test_models_carry_a_real_creation_time(client):
    (card,) = client.models.list().data
    assert 1_600_000_000 < card.created <= time.time()


def test_a_stored_response_is_deleted_as_openai_deletes_it(client, server):
    response = client.responses.create(model=server.model, input="Hi", max_output_tokens=2)
    assert client.responses.retrieve(response.id).id == response.id
    deleted = httpx.delete(f"{server.v1}/responses/{response.id}", timeout=30)
    assert deleted.status_code == 200
    assert deleted.json() == {"id": response.id, "object": "response", "deleted": True}
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(response.id)
    again = httpx.delete(f"{server.v1}/responses/{response.id}", timeout=30)
    assert again.status_code == 404 and again.json()["error"]["param"] == "response_id"
    other = client.responses.create(model=server.model, input="Hi", max_output_tokens=2)
    client.responses.delete(other.id)  # the SDK's own call
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(other.id)
