"""JSON Schema `pattern`s become full-match regexes that keep search semantics and JSON safety."""

from __future__ import annotations

import re
from functools import cache

import pytest
from outlines_core import Index, Vocabulary

from loraplex.grammar.errors import UnsupportedSchemaError
from loraplex.grammar.pattern import normalize_pattern

# One token per byte, plus an end marker: the compiler's own view of which strings a regex
# accepts (compiled the way `GrammarCompiler` compiles, see `GrammarVocabulary`).
_MARKER_ID = 256


@cache
def _index(regex: str) -> Index:
    tokens = {bytes([b]): [b] for b in range(1, 256)}
    tokens["\uffff".encode()] = [_MARKER_ID]
    return Index(f"(?:{regex})\\x{{FFFF}}", Vocabulary(0, tokens))


def _accepts(regex: str, text: str) -> bool:
    index = _index(regex)
    state = index.get_initial_state()
    for byte in text.encode():
        state = index.get_next_state(state, byte)
        if state is None:
            return False
    return index.get_next_state(state, _MARKER_ID) in index.get_final_states()


_CANDIDATES = [
    "",
    "a",
    "ab",
    "abc",
    "xab",
    "abx",
    "123",
    "a1b2",
    "AB-123",
    "cats",
    "dog",
    "a b",
    "é",
    "Z9",
    "hello world",
    "ab ab",
    "x.y",
]


@pytest.mark.parametrize(
    "pattern",
    [
        "^ab",
        "ab$",
        "^ab$",
        "ab",
        "[0-9]",
        "^[A-Z]{2}-[0-9]{3}$",
        "^(cat|dog)s?$",
        "^.{2,3}$",
        "^[^a]+$",
        r"^\w+$",
        r"\d",
        r"^\S+$",
        "cat|dog",
        "^[ -~]+$",
        r"^\s*$",
    ],
)
def test_normalised_pattern_keeps_search_semantics(pattern) -> None:
    regex = normalize_pattern(pattern)
    for text in _CANDIDATES:
        assert _accepts(regex, text) == bool(re.search(pattern, text)), (pattern, text)


def test_start_anchor_alone_still_matches() -> None:
    regex = normalize_pattern("^ab")
    assert _accepts(regex, "abzzz")
    assert not _accepts(regex, "zab")


def test_unanchored_pattern_may_be_surrounded() -> None:
    regex = normalize_pattern("[0-9]")
    assert _accepts(regex, "ab7cd")
    assert not _accepts(regex, "abcd")


def test_outputs_never_need_json_escaping() -> None:
    for pattern in ("^.+$", "^[^x]+$", r"^\S+$", "^[ -~]+$"):
        regex = normalize_pattern(pattern)
        assert _accepts(regex, "ab")
        for text in ['a"b', "a\\b", "a\nb", "a\tb"]:
            assert not _accepts(regex, text), (pattern, text)


@pytest.mark.parametrize(
    ("pattern", "reason"),
    [
        ("(?=a)b", "lookaround"),
        (r"(a)\1", "backreferences"),
        ("a^b", "anchors inside"),
        ('^"a"$', "quote"),
        ("^a|b$", "top-level alternation"),
        (r"\bword\b", "word boundaries"),
        (r"^a\nb$", "JSON escaping"),
    ],
)
def test_unsupported_patterns_are_refused_by_name(pattern, reason) -> None:
    with pytest.raises(UnsupportedSchemaError, match=reason) as caught:
        normalize_pattern(pattern)
    assert caught.value.feature == "pattern"
