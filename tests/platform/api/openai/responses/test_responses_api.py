"""OpenAI's Responses API through the `openai` SDK against the live server: create and stream
(text, json_schema, function calls), `previous_response_id`, retrieval, `store: false`, and
per-tenant isolation of stored responses."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
from tenant_helpers import ADMIN_KEY, start_server

SCHEMA = {
    "type": "object",
    "properties": {"color": {"enum": ["red", "green", "blue"]}, "count": {"type": "integer"}},
    "required": ["color", "count"],
}
WEATHER = {"type": "function", "name": "get_weather",
           "parameters": {"type": "object", "properties": {"city": {"type": "string",
                                                                    "maxLength": 10}},
                          "required": ["city"]}}  # fmt: skip


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.v1, api_key="unused", max_retries=0, timeout=300)


def test_create_returns_text_usage_and_can_be_retrieved(client, server):
    response = client.responses.create(
        model=server.model, input="Name a color.", instructions="Answer briefly.",
        max_output_tokens=6, temperature=0,
    )  # fmt: skip
    assert response.object == "response" and response.id.startswith("resp_")
    assert response.output[0].type == "message" and response.output_text
    assert response.status in ("completed", "incomplete")
    if response.status == "incomplete":
        assert response.incomplete_details.reason == "max_output_tokens"
    assert 0 < response.usage.output_tokens <= 6 and response.usage.input_tokens > 0
    assert response.instructions == "Answer briefly."
    again = client.responses.retrieve(response.id)
    assert again.id == response.id and again.output_text == response.output_text


def test_json_schema_output_validates(client, server):
    response = client.responses.create(
        model=server.model, input="Pick a color and a count.", max_output_tokens=40,
        text={"format": {"type": "json_schema", "name": "pick", "schema": SCHEMA}},
    )  # fmt: skip
    assert response.status == "completed"
    jsonschema.validate(json.loads(response.output_text), SCHEMA)


def test_stream_events_build_the_same_response_as_create(client, server):
    kwargs = dict(model=server.model, input="Say hi.", max_output_tokens=8, temperature=0)
    whole = client.responses.create(**kwargs)
    with client.responses.stream(**kwargs) as stream:
        events = list(stream)
    kinds = [event.type for event in events]
    # NOTE: a response cut by max_output_tokens ends in response.incomplete, as OpenAI's do
    # (the SDK's get_final_response() wants response.completed); both carry the response.
    final = events[-1].response
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    assert "response.output_text.delta" in kinds and "response.output_item.done" in kinds
    assert final.output_text == whole.output_text and final.status == whole.status
    assert client.responses.retrieve(final.id).output_text == final.output_text


def test_required_function_call_streams_and_continues_with_its_output(client, server):
    kwargs = dict(model=server.model, input="Weather in Oslo?", tools=[WEATHER],
                  tool_choice="required", parallel_tool_calls=False, max_output_tokens=30)  # fmt: skip
    with client.responses.stream(**kwargs) as stream:
        final = stream.get_final_response()
    (call,) = [item for item in final.output if item.type == "function_call"]
    assert call.name == "get_weather" and call.call_id.startswith("call_")
    jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])
    follow = client.responses.create(
        model=server.model, previous_response_id=final.id, max_output_tokens=6,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}],
    )  # fmt: skip
    assert follow.previous_response_id == final.id and follow.output_text


def test_previous_response_id_carries_the_conversation(client, server):
    first = client.responses.create(model=server.model, input="My name is Ada.",
                                    max_output_tokens=4, temperature=0)  # fmt: skip
    second = client.responses.create(model=server.model, input="What is my name?",
                                     previous_response_id=first.id, max_output_tokens=4,
                                     temperature=0)  # fmt: skip
    alone = client.responses.create(model=server.model, input="What is my name?",
                                    max_output_tokens=4, temperature=0)  # fmt: skip
    # The first turn (its input and output) is in the second's prompt.
    assert second.usage.input_tokens > alone.usage.input_tokens + first.usage.output_tokens
    unstored = client.responses.create(model=server.model, input="hi", max_output_tokens=2,
                                       store=False)  # fmt: skip
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model=server.model, input="x", previous_response_id=unstored.id)


def test_unsupported_fields_answer_400(client, server):
    for extra in ({"tools": [{"type": "web_search"}]}, {"background": True},
                  {"include": ["reasoning.encrypted_content"]}):  # fmt: skip
        with pytest.raises(openai.BadRequestError):
            client.responses.create(model=server.model, input="x", **extra)


def test_another_tenants_response_id_is_a_404(model_dir, tmp_path):
    server = start_server(model_dir, tmp_path / "data", max_num_seqs=2)
    try:
        admin = server.client(ADMIN_KEY)
        keys = {n: admin.post("/admin/tenants", json={"name": n}).json()["api_key"]
                for n in ("alpha", "beta")}  # fmt: skip
        alpha, beta = (openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=keys[n],
                                     max_retries=0) for n in ("alpha", "beta"))  # fmt: skip
        mine = alpha.responses.create(model=server.model, input="hi", max_output_tokens=2)
        assert alpha.responses.retrieve(mine.id).id == mine.id
        with pytest.raises(openai.NotFoundError):
            beta.responses.retrieve(mine.id)
        with pytest.raises(openai.NotFoundError):
            beta.responses.create(model=server.model, input="x", previous_response_id=mine.id)
    finally:
        server.stop()
