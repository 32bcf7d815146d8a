"""`StructuredOutputs`: what shape a request's output must take."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

_KINDS = ("json", "regex", "choice", "json_object")


@dataclass(frozen=True)
class StructuredOutputs:
    """Constrain a request's output to a JSON schema, a regular expression, one of a list of
    strings, or any JSON object. Exactly one of the four must be set.

    `json` may be a schema dict or its JSON text. `regex` must match the whole output.
    `choice` outputs one of the strings verbatim (a list is taken too, kept as a tuple).
    """

    json: dict[str, Any] | str | None = None
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    json_object: bool = False

    def __post_init__(self) -> None:
        given = [kind for kind in _KINDS if self._value(kind) not in (None, False)]
        if len(given) != 1:
            raise ValueError(
                f"StructuredOutputs needs exactly one of {list(_KINDS)}, got {given or 'none'}"
            )
        if isinstance(self.json, str):
            try:
                parsed = json.loads(self.json)
            except json.JSONDecodeError as error:
                raise ValueError(f"StructuredOutputs.json is not valid JSON: {error}") from None
            object.__setattr__(self, "json", parsed)
        if self.json is not None and not isinstance(self.json, dict):
            raise ValueError(f"StructuredOutputs.json must be an object, got {type(self.json)}")
        if self.regex is not None and not isinstance(self.regex, str):
            raise ValueError("StructuredOutputs.regex must be a string")
        if self.choice is not None:
            if not self.choice or not all(isinstance(c, str) and c for c in self.choice):
                raise ValueError("StructuredOutputs.choice must be a non-empty list of strings")
            object.__setattr__(self, "choice", tuple(self.choice))

    @property
    def kind(self) -> str:
        """Which of "json", "regex", "choice", "json_object" is set."""
        return next(kind for kind in _KINDS if self._value(kind) not in (None, False))

    @property
    def spec(self) -> Any:
        """The value of the field that is set (True for `json_object`)."""
        return self._value(self.kind)

    def key(self) -> str:
        """A stable sha256 of (kind, spec): equal specs give equal keys across processes.

        Key order does not count, except the order of a schema's `properties`, which is the
        order the output's keys are generated in."""
        spec = canonical_schema(self.spec) if self.kind == "json" else self.spec
        text = json.dumps([self.kind, spec], separators=(",", ":"))
        return hashlib.sha256(text.encode()).hexdigest()

    def __hash__(self) -> int:
        # NOTE: the schema is a dict; hash the canonical key so SamplingParams stays hashable.
        return hash(self.key())

    def _value(self, kind: str) -> Any:
        return getattr(self, kind)


def canonical_schema(node: Any, properties: bool = False) -> Any:
    """`node` with every object's keys sorted, except the members of `properties` maps, which
    keep the schema's order (objects are generated with their keys in that order, as OpenAI's
    structured outputs do). Schemas that differ only in the order of other keys map to the
    same value. `properties`: `node` is a `properties` map."""
    if isinstance(node, list):
        return [canonical_schema(item) for item in node]
    if not isinstance(node, dict):
        return node
    if properties:
        return {name: canonical_schema(schema) for name, schema in node.items()}
    return {key: canonical_schema(node[key], key == "properties") for key in sorted(node)}
