"""LoRARequest accepts the issue's (name, path), vLLM's (name, id, path), and keywords."""

from __future__ import annotations

from pathlib import Path

import pytest

from loraplex.adapters.request import LoRARequest


def test_positional_name_and_path():
    request = LoRARequest("sql", "/adapters/sql")
    assert (request.lora_name, request.lora_path) == ("sql", "/adapters/sql")
    assert request.lora_int_id == LoRARequest("sql", "/elsewhere").lora_int_id > 0


def test_vllm_order_and_keywords_agree():
    assert LoRARequest("sql", 7, "/a") == LoRARequest(
        lora_name="sql", lora_int_id=7, lora_path=Path("/a")
    )
    assert LoRARequest("sql", lora_path="/a").lora_int_id != LoRARequest("chat", "/a").lora_int_id


def test_frozen_and_hashable():
    request = LoRARequest("sql", "/a")
    with pytest.raises(AttributeError):
        request.lora_name = "other"  # type: ignore[misc]
    assert len({request, LoRARequest("sql", "/a")}) == 1


@pytest.mark.parametrize(
    ("args", "kwargs", "error"),
    [
        (("", "/a"), {}, ValueError),
        (("sql",), {}, ValueError),
        (("sql", 0, "/a"), {}, ValueError),
        (("sql", "/a", "/b", "/c"), {}, TypeError),
    ],
)
def test_bad_requests_are_refused(args, kwargs, error):
    with pytest.raises(error):
        LoRARequest(*args, **kwargs)
