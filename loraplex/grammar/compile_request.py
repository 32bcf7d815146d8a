"""`CompileRequest`: the exact, self-contained job a compile child process runs."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

from loraplex.grammar.config import GrammarConfig
from loraplex.platform.core.structured_outputs import StructuredOutputs, canonical_schema

# Escaped in choices: every character the Rust regex syntax treats as special.
_REGEX_META = set("\\.+*?()|[]{}^$#&-~")
_JSON_STRING = r'"([^"\\\x00-\x1F\x7F]|\\["\\/bfnrt])*"'
_JSON_NUMBER = r"-?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)?"
# NOTE: outlines-core's regex for `{"type": "object"}` nests three levels and takes over 20 s
# to compile for a 49k vocabulary; two levels (values may be objects or arrays of scalars)
# compile in about 2 s.
_JSON_OBJECT_DEPTH = 2


@dataclass(frozen=True)
class CompileRequest:
    """What to compile: a regex, or a JSON schema to turn into one.

    kind: "regex" or "json". source: the regex, or the schema's JSON text (`canonical_schema`:
    keys sorted, properties in the schema's order).
    A "json" job is analysed (`analyse_schema`) in the compile child, under its time and memory
    limits, not by whoever builds the job.
    whitespace_pattern / max_recursion_depth: passed to outlines-core for "json".
    backends: for "json", the backends to try in order ("outlines", "llguidance"); the first
        that enforces the schema exactly compiles it.
    as_outlines: for "json" under llguidance, a cold-start grammar: where outlines-core would
        enforce the schema, objects get only their listed properties as it emits them
        (`listed_properties_only`), so the two grammars' outputs agree and a request can hand
        over from one to the other mid-output.
    """

    kind: str
    source: str
    whitespace_pattern: str = r"[ ]?"
    max_recursion_depth: int = 3
    backends: tuple[str, ...] = ("outlines", "llguidance")
    as_outlines: bool = False

    def key(self, fingerprint: str) -> str:
        """sha256 of the job and the tokenizer fingerprint: the grammar cache key."""
        fields = [
            self.kind,
            self.source,
            self.whitespace_pattern,
            self.max_recursion_depth,
            list(self.backends),
            fingerprint,
        ]
        if self.as_outlines:  # NOTE: only then, so the keys of every other job stay as they were
            fields.append("as_outlines")
        return hashlib.sha256(json.dumps(fields).encode()).hexdigest()


def escape_regex(text: str) -> str:
    """`text` as a regex that matches it literally."""
    return "".join("\\" + ch if ch in _REGEX_META else ch for ch in text)


def json_object_regex(whitespace: str, depth: int = _JSON_OBJECT_DEPTH) -> str:
    """Any JSON object whose values nest at most `depth` levels of objects and arrays."""
    value = f"({_JSON_STRING}|{_JSON_NUMBER}|true|false|null)"
    member = ""
    for _ in range(depth):
        member = f"{_JSON_STRING}{whitespace}:{whitespace}{value}"
        obj = rf"\{{{whitespace}({member}({whitespace},{whitespace}{member})*)?{whitespace}\}}"
        arr = rf"\[{whitespace}({value}({whitespace},{whitespace}{value})*)?{whitespace}\]"
        value = f"({value}|{obj}|{arr})"
    return obj


def build_compile_request(outputs: StructuredOutputs, config: GrammarConfig) -> CompileRequest:
    """The compile job of `outputs`: cheap, with no schema analysis (the compile child runs it).

    A JSON schema must have passed `check_schema_limits` first."""
    if outputs.kind == "regex":
        return CompileRequest(kind="regex", source=outputs.regex)
    if outputs.kind == "choice":
        return CompileRequest(kind="regex", source="|".join(map(escape_regex, outputs.choice)))
    if outputs.kind == "json_object":
        return CompileRequest(kind="regex", source=json_object_regex(config.whitespace_pattern))
    return CompileRequest(
        kind="json",
        source=json.dumps(canonical_schema(outputs.json)),
        whitespace_pattern=config.whitespace_pattern,
        max_recursion_depth=config.max_recursion_depth,
        backends=config.json_backends,
    )
