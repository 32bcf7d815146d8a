"""Regular expressions for JSON numbers within bounds, so `minimum`/`maximum` are enforced.

outlines-core ignores numeric bounds; these regexes replace the plain integer or number regex of a
bounded schema. Numbers are written without exponents, which every bound check accepts.
"""

from __future__ import annotations

_FRACTION = r"(\.[0-9]+)?"
_POSITIVE_FRACTION = r"\.[0-9]*[1-9][0-9]*"


def _nines(value: int, count: int) -> int:
    digits = str(value)
    return int(digits[:-count] + "9" * count) if count < len(digits) else int("9" * count)


def _range_chunks(low: int, high: int) -> list[tuple[int, int]]:
    """Split [low, high] into ranges whose bounds share a prefix then differ digit by digit."""
    stops = {high}
    count = 1
    stop = _nines(low, count)
    while low <= stop < high:
        stops.add(stop)
        count += 1
        stop = _nines(low, count)
    count = 1
    stop = high + 1 - (high + 1) % 10**count - 1
    while low < stop <= high:
        stops.add(stop)
        count += 1
        stop = high + 1 - (high + 1) % 10**count - 1
    chunks = []
    start = low
    for stop in sorted(stops):
        chunks.append((start, stop))
        start = stop + 1
    return chunks


def _chunk_regex(low: int, high: int) -> str:
    parts = []
    for a, b in zip(str(low), str(high)):
        parts.append(a if a == b else f"[{a}-{b}]")
    return "".join(parts)


def _bounded_digits(low: int, high: int) -> list[str]:
    """Alternatives matching exactly the decimal integers in [low, high], low >= 0."""
    alternatives = []
    while low <= high:
        # NOTE: chunk bounds must have equal digit counts; split at each power of ten.
        top = min(high, 10 ** len(str(low)) - 1)
        alternatives += [_chunk_regex(a, b) for a, b in _range_chunks(low, top)]
        low = top + 1
    return alternatives


def natural_range_regex(low: int, high: int | None) -> str:
    """Decimal integers (no sign, no leading zeros) in [low, high]; `high=None` is unbounded."""
    if low < 0 or (high is not None and high < low):
        raise ValueError(f"empty or negative natural range [{low}, {high}]")
    if high is not None:
        return "(" + "|".join(_bounded_digits(low, high)) + ")"
    width = len(str(low))
    alternatives = _bounded_digits(low, 10**width - 1) + [f"[1-9][0-9]{{{width},}}"]
    return "(" + "|".join(alternatives) + ")"


def integer_regex(minimum: int | None, maximum: int | None) -> str:
    """JSON integers in [minimum, maximum]; None leaves that side unbounded."""
    if minimum is not None and maximum is not None and minimum > maximum:
        raise ValueError(f"empty integer range [{minimum}, {maximum}]")
    alternatives = []
    if minimum is None or minimum < 0:
        low = 1 if maximum is None or maximum >= 0 else -maximum
        alternatives.append("-" + natural_range_regex(low, None if minimum is None else -minimum))
    if maximum is None or maximum >= 0:
        alternatives.append(natural_range_regex(max(minimum or 0, 0), maximum))
    return "(" + "|".join(alternatives) + ")"


def _magnitude_regex(low: int, high: int | None, exclusive_low: bool, exclusive_high: bool) -> str:
    """Non-negative decimals m with low <(=) m <(=) high, for integral low >= 0 and high."""
    alternatives = []
    first_whole = low
    if exclusive_low:
        alternatives.append(f"{low}{_POSITIVE_FRACTION}")
        first_whole = low + 1
    last_whole = None if high is None else high - 1
    if last_whole is None or first_whole <= last_whole:
        alternatives.append(natural_range_regex(first_whole, last_whole) + _FRACTION)
    if high is not None and not exclusive_high and high >= first_whole:
        alternatives.append(rf"{high}(\.0+)?")
    if not alternatives:
        raise ValueError(f"empty number range ({low}, {high})")
    return "(" + "|".join(alternatives) + ")"


def number_regex(
    minimum: int | None,
    maximum: int | None,
    exclusive_minimum: bool = False,
    exclusive_maximum: bool = False,
) -> str:
    """JSON numbers between integral bounds; exclusive flags make a bound strict."""
    if minimum is not None and maximum is not None:
        if minimum > maximum or (minimum == maximum and (exclusive_minimum or exclusive_maximum)):
            raise ValueError(f"empty number range [{minimum}, {maximum}]")
    alternatives = []
    if minimum is None or minimum < 0:
        if maximum is not None and maximum < 0:
            negative = _magnitude_regex(
                -maximum,
                None if minimum is None else -minimum,
                exclusive_maximum,
                exclusive_minimum,
            )
        else:
            negative = _magnitude_regex(
                0, None if minimum is None else -minimum, True, exclusive_minimum
            )
        alternatives.append("-" + negative)
    if maximum is None or maximum > 0 or (maximum == 0 and not exclusive_maximum):
        low = 0 if minimum is None or minimum < 0 else minimum
        exclusive_low = exclusive_minimum and minimum is not None and minimum >= 0
        alternatives.append(_magnitude_regex(low, maximum, exclusive_low, exclusive_maximum))
    return "(" + "|".join(alternatives) + ")"
