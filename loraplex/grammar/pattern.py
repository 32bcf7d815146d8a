"""Turn a JSON Schema `pattern` into the body of a JSON string regex for outlines-core.

JSON Schema patterns search: `[a-z]+` accepts any string containing a letter, and `^`/`$` anchor
the search. outlines-core matches whole strings, and a `^` left inside `"..."` matches nothing.
The pattern is also matched against JSON text, not the decoded string, so every character it can
produce must be legal unescaped inside a JSON string (no quote, backslash or control character).
"""

from __future__ import annotations

from loraplex.grammar.errors import UnsupportedSchemaError

# One character of a JSON string that needs no escaping.
SAFE_CHAR = r'[^"\\\x00-\x1F\x7F]'
_SAFE_EXCLUDED = r'"\\\x00-\x1F\x7F'
# Class escapes whose complement would reach unsafe characters, rewritten as safe classes.
_NEGATED_CLASS_ESCAPES = {"D": r"\d", "W": r"\w", "S": r"\s"}


def _unsupported(detail: str) -> UnsupportedSchemaError:
    return UnsupportedSchemaError("pattern", detail)


def _read_class(pattern: str, start: int) -> tuple[str, int]:
    """The character class starting at `pattern[start] == "["`, made safe; returns its end."""
    i = start + 1
    negated = pattern.startswith("^", i)
    if negated:
        i += 1
    body = []
    if pattern.startswith("]", i):
        body.append(r"\]")
        i += 1
    while i < len(pattern) and pattern[i] != "]":
        char = pattern[i]
        if char == "[":
            raise _unsupported("nested character classes")
        if char == "\\":
            escape = pattern[i + 1 : i + 2]
            if escape in ("s", "S", "D", "W") or escape == "\\":
                raise _unsupported(f"\\{escape} inside a character class")
            body.append(pattern[i : i + 2])
            i += 2
            continue
        if char == '"':
            raise _unsupported("a quote inside a character class")
        body.append(char)
        i += 1
    if i >= len(pattern):
        raise _unsupported("unterminated character class")
    if negated:
        return "[^" + "".join(body) + _SAFE_EXCLUDED + "]", i + 1
    # NOTE: a range such as ` -~` spans the quote and backslash; intersect with safe characters.
    return "[" + "".join(body) + "&&" + SAFE_CHAR + "]", i + 1


def _read_escape(pattern: str, i: int) -> str:
    escape = pattern[i + 1 : i + 2]
    if not escape:
        raise _unsupported("trailing backslash")
    if escape.isdigit() and escape != "0" or escape == "k":
        raise _unsupported("backreferences")
    if escape in ("b", "B"):
        raise _unsupported("word boundaries")
    if escape == "s":
        return "[ ]"
    if escape in _NEGATED_CLASS_ESCAPES:
        return f"[^{_NEGATED_CLASS_ESCAPES[escape]}{_SAFE_EXCLUDED}]"
    if escape in ("n", "t", "r", "f", "v", "\\", '"'):
        raise _unsupported(f"matching the character \\{escape} (needs JSON escaping)")
    return pattern[i : i + 2]


def _top_level_alternation(pattern: str) -> bool:
    depth = 0
    i = 0
    while i < len(pattern):
        char = pattern[i]
        if char == "\\":
            i += 2
            continue
        if char == "[":
            _, i = _read_class(pattern, i)
            continue
        depth += char == "("
        depth -= char == ")"
        if char == "|" and depth == 0:
            return True
        i += 1
    return False


def normalize_pattern(pattern: str) -> str:
    """A full-match regex, safe inside a JSON string, accepting what `re.search(pattern)` does.

    Raises `UnsupportedSchemaError("pattern")` for lookarounds, backreferences, anchors inside
    the expression, and characters that would need JSON escaping.
    """
    for construct in ("(?=", "(?!", "(?<=", "(?<!"):
        if construct in pattern:
            raise _unsupported("lookaround assertions")
    anchored_start = pattern.startswith("^")
    anchored_end = pattern.endswith("$") and not pattern.endswith("\\$")
    body = pattern[1 if anchored_start else 0 : len(pattern) - 1 if anchored_end else None]
    if (anchored_start or anchored_end) and _top_level_alternation(body):
        raise _unsupported("anchors around a top-level alternation")
    out = []
    i = 0
    while i < len(body):
        char = body[i]
        if char == "\\":
            out.append(_read_escape(body, i))
            i += 2
        elif char == "[":
            safe_class, i = _read_class(body, i)
            out.append(safe_class)
        elif char in "^$":
            raise _unsupported("anchors inside the expression")
        elif char == ".":
            out.append(SAFE_CHAR)
            i += 1
        elif char == '"':
            raise _unsupported("matching a quote (needs JSON escaping)")
        else:
            out.append(char)
            i += 1
    prefix = "" if anchored_start else SAFE_CHAR + "*"
    suffix = "" if anchored_end else SAFE_CHAR + "*"
    return f"{prefix}(?:{''.join(out)}){suffix}"
