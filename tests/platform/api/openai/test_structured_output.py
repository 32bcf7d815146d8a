"""Structured output through the HTTP API: response_format, vLLM's extras, refused schemas."""

from __future__ import annotations

import json
import re

import httpx
import openai
import pydantic
import pytest
from jsonschema import Draft202012Validator

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
    },
    "required": ["name", "age"],
}
ASK = [{"role": "user", "content": "Describe a person as JSON with a name and an age."}]


class Person(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=20)
    age: int = pydantic.Field(ge=0, le=120)


def _chat(server, **fields) -> httpx.Response:
    body = {"model": server.model, "messages": ASK, "temperature": 0, **fields}
    return httpx.post(f"{server.v1}/chat/completions", json=body, timeout=120)


def _completion(server, **fields) -> httpx.Response:
    body = {"model": server.model, "temperature": 0, **fields}
    return httpx.post(f"{server.v1}/completions", json=body, timeout=120)


def _validates(schema: dict, text: str) -> None:
    value = json.loads(text)
    errors = [e.message for e in Draft202012Validator(schema).iter_errors(value)]
    assert not errors, f"{text!r}: {errors}"


def test_chat_json_schema_response_format_gives_valid_json(server):
    response_format = {
        "type": "json_schema",
        "json_schema": {"name": "person", "schema": PERSON, "strict": True},
    }
    reply = _chat(server, response_format=response_format, max_completion_tokens=64)
    assert reply.status_code == 200, reply.text
    choice = reply.json()["choices"][0]
    assert choice["finish_reason"] == "stop"
    _validates(PERSON, choice["message"]["content"])


def test_chat_json_object_response_format_gives_an_object(server):
    reply = _chat(server, response_format={"type": "json_object"}, max_completion_tokens=96)
    assert reply.status_code == 200, reply.text
    choice = reply.json()["choices"][0]
    assert choice["finish_reason"] == "stop", choice
    assert isinstance(json.loads(choice["message"]["content"]), dict)


def test_completion_json_schema_response_format_gives_valid_json(server):
    response_format = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    reply = _completion(
        server, prompt="A person as JSON:", max_tokens=64, response_format=response_format
    )
    assert reply.status_code == 200, reply.text
    choice = reply.json()["choices"][0]
    assert choice["finish_reason"] == "stop", choice
    _validates(PERSON, choice["text"])


@pytest.mark.parametrize(
    "fields",
    [
        {"structured_outputs": {"regex": r"[0-9]{3}-[a-z]{2}"}},
        {"guided_regex": r"[0-9]{3}-[a-z]{2}"},
    ],
    ids=["structured_outputs", "guided"],
)
def test_regex_constrains_the_whole_output(server, fields):
    reply = _completion(server, prompt="A code:", max_tokens=16, **fields)
    assert reply.status_code == 200, reply.text
    choice = reply.json()["choices"][0]
    assert re.fullmatch(r"[0-9]{3}-[a-z]{2}", choice["text"]), choice["text"]
    assert choice["finish_reason"] == "stop"


@pytest.mark.parametrize(
    "fields",
    [
        {"structured_outputs": {"choice": ["sunny", "rainy", "foggy"]}},
        {"guided_choice": ["sunny", "rainy", "foggy"]},
    ],
    ids=["structured_outputs", "guided"],
)
def test_choice_outputs_one_of_the_strings(server, fields):
    reply = _chat(server, max_completion_tokens=8, **fields)
    assert reply.status_code == 200, reply.text
    assert reply.json()["choices"][0]["message"]["content"] in ("sunny", "rainy", "foggy")


def test_guided_json_accepts_schema_text(server):
    reply = _chat(server, guided_json=json.dumps(PERSON), max_completion_tokens=64)
    assert reply.status_code == 200, reply.text
    _validates(PERSON, reply.json()["choices"][0]["message"]["content"])


def test_max_tokens_cut_reports_length(server):
    reply = _chat(server, guided_json=PERSON, max_completion_tokens=3)
    assert reply.status_code == 200, reply.text
    choice = reply.json()["choices"][0]
    assert choice["finish_reason"] == "length"
    assert reply.json()["usage"]["completion_tokens"] == 3


@pytest.mark.parametrize(
    ("schema", "feature"),
    [
        ({"type": "integer", "not": {"const": 3}}, "feature: not"),
        ({"type": "array", "items": {"type": "string"}, "uniqueItems": True}, "uniqueItems"),
        ({"$ref": "https://example.com/schema.json"}, "$ref"),
    ],
)
def test_unsupported_schema_feature_is_a_400_naming_it(server, schema, feature):
    response_format = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    reply = _chat(server, response_format=response_format, max_completion_tokens=8)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert feature in error["message"]
    assert error["code"] == "unsupported_schema_feature"


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
         "response_format.json_schema.schema"),
        ({"response_format": {"type": "yaml"}}, "response_format.type"),
        ({"structured_outputs": {"grammar": "root ::= 'a'"}}, "structured_outputs.grammar"),
        ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
        ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
        ({"guided_choice": []}, "guided_choice"),
        ({"guided_json": "{not json"}, "guided_json"),
    ],
)  # fmt: skip
def test_malformed_constraints_are_400s(server, fields, param):
    reply = _chat(server, max_completion_tokens=8, **fields)
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == param


def test_grammar_that_fails_to_compile_is_a_400_and_the_server_carries_on(server):
    broken = {"structured_outputs": {"regex": "(unclosed"}}
    reply = _completion(server, prompt="x", max_tokens=8, **broken)
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["code"] == "invalid_structured_output"
    # Streamed, the compile failure is known before the first token: a 400, not a 200.
    streamed = httpx.post(
        f"{server.v1}/completions",
        json={"model": server.model, "prompt": "x", "max_tokens": 8, "stream": True, **broken},
        timeout=120,
    )
    assert streamed.status_code == 400, streamed.text
    assert streamed.json()["error"]["code"] == "invalid_structured_output"
    after = _chat(server, guided_choice=["yes", "no"], max_completion_tokens=4)
    assert after.status_code == 200
    assert after.json()["choices"][0]["message"]["content"] in ("yes", "no")


def test_openai_sdk_parse_returns_a_pydantic_object(server):
    client = openai.OpenAI(base_url=server.v1, api_key="unused", max_retries=0)
    completions = client.chat.completions
    parse = (
        completions.parse if hasattr(completions, "parse") else client.beta.chat.completions.parse
    )
    reply = parse(
        model=server.model, messages=ASK, response_format=Person, temperature=0, max_tokens=64
    )
    person = reply.choices[0].message.parsed
    assert isinstance(person, Person)
    assert 0 <= person.age <= 120
