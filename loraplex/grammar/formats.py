"""Regexes for JSON Schema string `format`s, written so every match is a valid value.

outlines-core's own format regexes admit invalid values (a 31st of February, an unquoted `"` in a
URI, a literal backslash in `time`), so each supported format is replaced with one of these.
Each is the body of a JSON string, without the quotes, and needs no JSON escaping.
"""

from __future__ import annotations

_YEAR = r"[0-9]{4}"
# NOTE: February stops at 28 so no leap-year arithmetic is needed for the value to be valid.
_MONTH_DAY = (
    r"((0[13578]|1[02])-(0[1-9]|[12][0-9]|3[01])"
    r"|(0[469]|11)-(0[1-9]|[12][0-9]|30)"
    r"|02-(0[1-9]|1[0-9]|2[0-8]))"
)
_DATE = rf"{_YEAR}-{_MONTH_DAY}"
_TIME = (
    r"([01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9](\.[0-9]{1,6})?(Z|[+-]([01][0-9]|2[0-3]):[0-5][0-9])"
)
_OCTET = r"(25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9]?[0-9])"
_LABEL = r"[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?"
_HOSTNAME = rf"{_LABEL}(\.{_LABEL})*"
_HEX = "[0-9a-f]"

FORMAT_REGEXES: dict[str, str] = {
    "date": _DATE,
    "time": _TIME,
    "date-time": rf"{_DATE}T{_TIME}",
    "uuid": rf"{_HEX}{{8}}-{_HEX}{{4}}-{_HEX}{{4}}-{_HEX}{{4}}-{_HEX}{{12}}",
    "email": rf"[a-zA-Z0-9._%+-]{{1,64}}@{_LABEL}(\.{_LABEL})+",
    "hostname": _HOSTNAME,
    "ipv4": rf"{_OCTET}(\.{_OCTET}){{3}}",
    "uri": rf"https?://{_HOSTNAME}(/[a-zA-Z0-9._~%!$&'()*+,;=:@-]*)*",
}
