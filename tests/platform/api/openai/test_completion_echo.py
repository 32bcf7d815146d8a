"""Scoring text over HTTP: `echo` with `logprobs` (max_tokens 0 too, as lm-evaluation-harness
asks), and vLLM's `prompt_logprobs`, equal HF transformers' scores of the same model."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
import torch

TEXT = "The old lighthouse keeper climbed the stairs at dusk and lit the lamp for the ships."
C, CHAT = "/v1/completions", "/v1/chat/completions"
USER = [{"role": "user", "content": "Say hi."}]


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.base_url, timeout=60) as client:
        yield client


def _ids(server, text: str) -> list[int]:
    return server.engine.tokenizer.encode(text)


def _complete(http, **body) -> dict:
    response = http.post(C, json={"temperature": 0.0, **body})
    assert response.status_code == 200, response.text
    return response.json()


def _close(got: list[float], expected: torch.Tensor) -> None:
    torch.testing.assert_close(torch.tensor(got), expected, atol=2e-4, rtol=0)


def _check_offsets(text: str, logprobs: dict) -> None:
    for token, offset in zip(logprobs["tokens"], logprobs["text_offset"], strict=True):
        assert text[offset : offset + len(token)] == token


def test_echo_with_max_tokens_0_scores_the_prompt_like_hf(http, server, hf_prompt_logprobs):
    out = _complete(http, prompt=TEXT, echo=True, logprobs=2, max_tokens=0)
    choice, ids = out["choices"][0], _ids(server, TEXT)
    assert choice["text"] == TEXT
    assert choice["finish_reason"] == "length"
    assert out["usage"]["prompt_tokens"] == len(ids)
    assert out["usage"]["completion_tokens"] == 0
    logprobs = choice["logprobs"]
    assert len(logprobs["tokens"]) == len(ids)
    assert "".join(logprobs["tokens"]) == TEXT
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    _close(logprobs["token_logprobs"][1:], hf_prompt_logprobs(ids))
    _check_offsets(choice["text"], logprobs)
    for token, score, top in zip(
        logprobs["tokens"][1:], logprobs["token_logprobs"][1:], logprobs["top_logprobs"][1:]
    ):
        assert top[token] == score and 2 <= len(top) <= 3  # the top 2, and the prompt token
        assert max(top.values()) >= score


def test_echo_then_generated_tokens_follow_the_prompt(http, server):
    prompt = "Once upon a time"
    plain = _complete(http, prompt=prompt, logprobs=1, max_tokens=4)["choices"][0]
    out = _complete(http, prompt=prompt, echo=True, logprobs=1, max_tokens=4)
    choice, n_prompt = out["choices"][0], len(_ids(server, prompt))
    assert choice["text"] == prompt + plain["text"]
    assert out["usage"]["completion_tokens"] == 4
    logprobs = choice["logprobs"]
    assert logprobs["tokens"][n_prompt:] == plain["logprobs"]["tokens"]
    assert logprobs["token_logprobs"][n_prompt:] == plain["logprobs"]["token_logprobs"]
    assert logprobs["text_offset"][n_prompt] == len(prompt)
    _check_offsets(choice["text"], logprobs)


def test_token_id_prompts_echo_their_decoded_text(http, server, hf_prompt_logprobs):
    ids = _ids(server, TEXT)[:12]
    out = _complete(http, prompt=[ids, ids[:5]], echo=True, logprobs=0, max_tokens=0)
    first, second = out["choices"]
    assert first["text"] == server.engine.tokenizer.decode(ids)
    assert second["text"] == server.engine.tokenizer.decode(ids[:5])
    assert len(second["logprobs"]["tokens"]) == 5
    _close(first["logprobs"]["token_logprobs"][1:], hf_prompt_logprobs(ids))


def test_vllm_prompt_logprobs_on_completions_and_chat(http, server, hf_prompt_logprobs):
    out = _complete(http, prompt=TEXT, prompt_logprobs=1, max_tokens=2)
    choice, ids = out["choices"][0], _ids(server, TEXT)
    assert not choice["text"].startswith(TEXT) and choice["logprobs"] is None
    scores = choice["prompt_logprobs"]
    assert scores[0] is None and len(scores) == len(ids)
    for token_id, entry in zip(ids[1:], scores[1:]):
        assert str(token_id) in entry and 1 <= len(entry) <= 2
        assert min(item["rank"] for item in entry.values()) == 1
    _close(
        [entry[str(t)]["logprob"] for t, entry in zip(ids[1:], scores[1:])], hf_prompt_logprobs(ids)
    )
    tokenizer = server.engine.tokenizer
    assert scores[1][str(ids[1])]["decoded_token"] == tokenizer.decode([ids[1]])

    chat = http.post(CHAT, json={"messages": USER, "max_tokens": 1, "prompt_logprobs": 0})
    body = chat.json()
    assert chat.status_code == 200 and "prompt_logprobs" not in body["choices"][0]
    assert len(body["prompt_logprobs"]) == body["usage"]["prompt_tokens"]
    assert body["prompt_logprobs"][0] is None
    assert all(len(entry) == 1 for entry in body["prompt_logprobs"][1:])


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        (C, {"prompt": "a", "max_tokens": 0}, "max_tokens"),
        (C, {"prompt": "a", "prompt_logprobs": 21}, "prompt_logprobs"),
        (C, {"prompt": "a", "echo": True, "logprobs": 1, "prompt_logprobs": -1}, "prompt_logprobs"),
        (C, {"prompt": "a", "echo": True, "logprobs": 21, "max_tokens": 0}, "logprobs"),
        (C, {"prompt": "a", "echo": True, "max_tokens": 0, "min_tokens": 1}, "min_tokens"),
        (CHAT, {"messages": USER, "prompt_logprobs": 2, "stream": True}, "prompt_logprobs"),
    ],
)
def test_bad_combinations_are_refused_with_their_param(http, path, body, param):
    response = http.post(path, json=body)
    assert response.status_code == 400
    assert response.json()["error"]["param"] == param


def _events(http, body: dict) -> list[dict]:
    with http.stream("POST", C, json={"temperature": 0.0, "stream": True, **body}) as response:
        assert response.status_code == 200
        lines = [line for line in response.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    return [json.loads(line[len("data: ") :]) for line in lines[:-1]]


def test_streaming_echo_sends_the_prompt_and_its_logprobs_first(http, server):
    body = {"prompt": TEXT, "echo": True, "logprobs": 1, "max_tokens": 3}
    whole = _complete(http, **body)["choices"][0]
    events = _events(http, body)
    first = events[0]["choices"][0]
    assert first["text"] == TEXT
    assert first["logprobs"]["tokens"] == whole["logprobs"]["tokens"][: len(_ids(server, TEXT))]
    assert first["logprobs"]["token_logprobs"][0] is None
    assert "".join(e["choices"][0]["text"] for e in events) == whole["text"]
    streamed_tokens = [t for e in events for t in e["choices"][0]["logprobs"]["tokens"]]
    assert streamed_tokens == whole["logprobs"]["tokens"]

    scoring = _events(http, {**body, "max_tokens": 0, "stream_options": {"include_usage": True}})
    choices = [e["choices"][0] for e in scoring if e["choices"]]
    assert "".join(c["text"] for c in choices) == TEXT
    assert choices[-1]["finish_reason"] == "length"
    assert scoring[-1]["usage"]["completion_tokens"] == 0


def test_the_openai_sdk_reads_echoed_scores(server):
    client = openai.OpenAI(base_url=server.v1, api_key="unused", max_retries=0)
    out = client.completions.create(
        model=server.model, prompt=TEXT, echo=True, logprobs=0, max_tokens=0, temperature=0.0
    )
    logprobs = out.choices[0].logprobs
    assert out.choices[0].text == TEXT and logprobs.token_logprobs[0] is None
    assert all(score < 0 for score in logprobs.token_logprobs[1:])
