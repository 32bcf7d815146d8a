"""Twenty function tools with varied parameter schemas, for the tool-calling tests."""

from __future__ import annotations

from typing import Any


def _tool(name: str, description: str, parameters: dict[str, Any] | None) -> dict[str, Any]:
    function: dict[str, Any] = {"name": name, "description": description}
    if parameters is not None:
        function["parameters"] = parameters
    return {"type": "function", "function": function}


def _obj(properties: dict[str, Any], required: list[str] | None = None) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "object", "properties": properties}
    if required is not None:
        schema["required"] = required
    return schema


_STR = {"type": "string", "maxLength": 12}
TOOLS: list[dict[str, Any]] = [
    _tool("get_weather", "Current weather in a city.",
          _obj({"city": _STR, "unit": {"enum": ["celsius", "fahrenheit"]}}, ["city", "unit"])),
    _tool("get_time", "The current time.", None),
    _tool("add_numbers", "Add two integers.",
          _obj({"a": {"type": "integer"}, "b": {"type": "integer"}}, ["a", "b"])),
    _tool("set_volume", "Set the volume.",
          _obj({"level": {"type": "integer", "minimum": 0, "maximum": 10}}, ["level"])),
    _tool("toggle_light", "Switch a light.",
          _obj({"on": {"type": "boolean"}, "room": _STR}, ["on", "room"])),
    _tool("convert_currency", "Convert money.",
          _obj({"amount": {"type": "number"}, "from": {"enum": ["USD", "EUR"]},
                "to": {"enum": ["USD", "EUR", "JPY"]}}, ["amount", "from", "to"])),
    _tool("send_email", "Send an email.",
          _obj({"to": _STR, "subject": _STR, "urgent": {"type": "boolean"}}, ["to", "subject"])),
    _tool("search_web", "Search the web.",
          _obj({"query": _STR, "limit": {"type": "integer", "minimum": 1, "maximum": 5}},
               ["query"])),
    _tool("create_event", "Add a calendar event.",
          _obj({"title": _STR, "day": {"type": "integer", "minimum": 1, "maximum": 31},
                "attendees": {"type": "array", "items": _STR, "maxItems": 2}},
               ["title", "day", "attendees"])),
    _tool("rate_movie", "Rate a movie.",
          _obj({"movie": _STR, "stars": {"enum": [1, 2, 3, 4, 5]}}, ["movie", "stars"])),
    _tool("book_table", "Book a restaurant table.",
          _obj({"guests": {"type": "integer", "minimum": 1, "maximum": 8},
                "time": {"type": "string", "pattern": "^[0-2][0-9]:[0-5][0-9]$"}},
               ["guests", "time"])),
    _tool("move_robot", "Move a robot on a grid.",
          _obj({"position": _obj({"x": {"type": "integer"}, "y": {"type": "integer"}},
                                 ["x", "y"])}, ["position"])),
    _tool("tag_photo", "Tag a photo.",
          _obj({"photo_id": {"type": "integer", "minimum": 0},
                "tags": {"type": "array", "items": {"enum": ["cat", "dog", "sky"]},
                         "minItems": 1, "maxItems": 3}}, ["photo_id", "tags"])),
    _tool("translate", "Translate text.",
          _obj({"text": _STR, "target": {"enum": ["fr", "de", "es"]}}, ["text", "target"])),
    _tool("set_alarm", "Set an alarm.",
          _obj({"hour": {"type": "integer", "minimum": 0, "maximum": 23},
                "label": {"anyOf": [_STR, {"type": "null"}]}}, ["hour", "label"])),
    _tool("order_pizza", "Order a pizza.",
          _obj({"size": {"$ref": "#/$defs/size"}, "extra_cheese": {"type": "boolean"}},
               ["size", "extra_cheese"]) | {"$defs": {"size": {"enum": ["S", "M", "L"]}}}),
    _tool("find_route", "Directions between places.",
          _obj({"start": _STR, "end": _STR, "mode": {"const": "walk"}}, ["start", "end", "mode"])),
    _tool("log_workout", "Log a workout.",
          _obj({"minutes": {"type": "number", "minimum": 0, "maximum": 300},
                "kind": {"enum": ["run", "swim", "bike"]}}, ["minutes", "kind"])),
    _tool("lookup_word", "Look up a word.", _obj({"word": _STR})),
    _tool("transfer_funds", "Move money between accounts.",
          _obj({"account": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{4}$"},
                "cents": {"type": "integer", "minimum": 1, "maximum": 100000}},
               ["account", "cents"])),
]  # fmt: skip
