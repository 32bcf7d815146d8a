"""vLLM's /tokenize and /detokenize on the live server."""

from __future__ import annotations

import httpx


def test_tokenize_then_detokenize_round_trips_text(server):
    text = "Tool calling, in 2026: ünïcode & spaces  kept."
    with httpx.Client(base_url=server.base_url, timeout=60) as http:
        tokens = http.post("/tokenize", json={"model": server.model, "prompt": text,
                                              "return_token_strs": True}).json()  # fmt: skip
        assert tokens["count"] == len(tokens["tokens"]) > 5
        assert tokens["max_model_len"] == 512 and len(tokens["token_strs"]) == tokens["count"]
        back = http.post("/detokenize", json={"model": server.model, "tokens": tokens["tokens"]})
        assert back.json() == {"prompt": text}


def test_tokenize_messages_renders_tools_and_tool_results(server):
    messages = [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "tool_calls": [{"id": "c1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "rainy"},
    ]  # fmt: skip
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {}}}
    with httpx.Client(base_url=server.base_url, timeout=60) as http:
        reply = http.post("/tokenize", json={"messages": messages, "tools": [tool]}).json()
        text = http.post("/detokenize", json={"tokens": reply["tokens"]}).json()["prompt"]
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}' in text
    assert "<tool_response>\nrainy\n</tool_response>" in text and "<tools>" in text
    assert text.endswith("<|im_start|>assistant\n")


def test_tokenize_refuses_bad_bodies_with_400(server):
    with httpx.Client(base_url=server.base_url, timeout=60) as http:
        both = http.post("/tokenize", json={"prompt": "a", "messages": [{"role": "user"}]})
        far = http.post("/detokenize", json={"tokens": [10**9]})
        unknown = http.post("/tokenize", json={"model": "nope", "prompt": "a"})
    assert both.status_code == 400 and far.status_code == 400
    assert far.json()["error"]["param"] == "tokens"
    assert unknown.status_code == 404
