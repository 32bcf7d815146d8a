"""Bounded integer and number regexes accept exactly the values inside the bounds."""

from __future__ import annotations

import itertools
import re

import pytest

from loraplex.grammar.numeric_range import integer_regex, natural_range_regex, number_regex

_INT_BOUNDS = [
    (0, 0),
    (0, 9),
    (3, 7),
    (5, 123),
    (1, 1000),
    (17, 17),
    (99, 101),
    (-5, 5),
    (-120, -3),
    (None, 5),
    (-7, None),
    (None, -3),
    (10, None),
    (0, None),
    (1, None),
    (None, None),
    (-1001, 999),
]


@pytest.mark.parametrize(("low", "high"), _INT_BOUNDS)
def test_integer_regex_matches_exactly_the_range(low, high) -> None:
    pattern = re.compile(integer_regex(low, high))
    for value in range(-1300, 1300):
        inside = (low is None or value >= low) and (high is None or value <= high)
        assert bool(pattern.fullmatch(str(value))) == inside, (low, high, value)
    for text in ("01", "007", "+1", "", "1.0", "1e3"):
        assert not pattern.fullmatch(text)


def test_natural_range_spans_digit_counts() -> None:
    pattern = re.compile(natural_range_regex(7, 123456))
    for value in [*range(0, 2000), 99999, 100000, 123456, 123457, 999999]:
        assert bool(pattern.fullmatch(str(value))) == (7 <= value <= 123456)


def test_empty_ranges_raise() -> None:
    with pytest.raises(ValueError):
        integer_regex(5, 4)
    with pytest.raises(ValueError):
        number_regex(3, 3, exclusive_minimum=True)


_NUMBERS = [
    "0",
    "0.0",
    "0.5",
    "-0.5",
    "1",
    "1.0",
    "1.5",
    "2",
    "2.00",
    "2.01",
    "-1",
    "-1.0",
    "-1.5",
    "-2",
    "-2.5",
    "10",
    "10.0",
    "9.99",
    "-10",
    "-10.5",
    "100",
    "3",
    "3.5",
]


@pytest.mark.parametrize(
    ("low", "high", "exclusive_low", "exclusive_high"),
    [
        (lo, hi, el, eh)
        for lo, hi in itertools.product([None, -10, -2, 0, 1], [None, -1, 0, 2, 10])
        for el, eh in itertools.product([False, True], repeat=2)
        if lo is None or hi is None or lo < hi
    ],
)
def test_number_regex_never_admits_a_value_outside(low, high, exclusive_low, exclusive_high):
    pattern = re.compile(number_regex(low, high, exclusive_low, exclusive_high))
    for text in _NUMBERS:
        value = float(text)
        inside = (low is None or (value > low if exclusive_low else value >= low)) and (
            high is None or (value < high if exclusive_high else value <= high)
        )
        matched = bool(pattern.fullmatch(text))
        assert not matched or inside, (text, pattern.pattern)
        if inside and not text.startswith("-0"):
            assert matched, (text, pattern.pattern)
