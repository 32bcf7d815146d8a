"""Module-name patterns from a tenant's `adapter_config.json`, matched in linear time.

PEFT matches `rank_pattern` / `alpha_pattern` keys and a string `target_modules` /
`exclude_modules` as Python regexes. A tenant controls those strings, and a backtracking engine
can spend minutes (holding the GIL) on one crafted pattern, so here they compile with RE2, whose
matching time is linear in the input, under a length limit. A pattern RE2 cannot compile
(backreferences, lookaround) or one over the limit is an `AdapterValidationError` naming its
field. The matching rules are PEFT's own (see `match_pattern_key` and `fullmatch_modules`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Generic, TypeVar

import re2

from loraplex.adapters.errors import AdapterValidationError

#: the longest pattern accepted, in characters
MAX_PATTERN_LENGTH = 512
#: the most keys accepted in one `rank_pattern` or `alpha_pattern`
MAX_PATTERNS = 1024
#: RE2's memory budget for one compiled pattern (bytes)
_MAX_PROGRAM_BYTES = 8 << 20

V = TypeVar("V")
Regex = re2._Regexp  # a compiled RE2 pattern


def _options() -> re2.Options:
    options = re2.Options()
    options.log_errors = False  # the error comes back as an exception, not on stderr
    options.max_mem = _MAX_PROGRAM_BYTES
    return options


def compile_pattern(pattern: object, field: str, where: str, template: str = "{}") -> Regex:
    """Compile a tenant's `pattern` (inside `template`) with RE2, or raise naming `field`."""
    if not isinstance(pattern, str):
        raise AdapterValidationError(
            f"{where}: {field} patterns must be strings, got {type(pattern).__name__}"
        )
    if len(pattern) > MAX_PATTERN_LENGTH:
        raise AdapterValidationError(
            f"{where}: {field} pattern is {len(pattern)} characters, over the limit of "
            f"{MAX_PATTERN_LENGTH}"
        )
    try:
        return re2.compile(template.format(pattern), _options())
    except re2.error as error:
        reason = error.args[0] if error.args else error
        if isinstance(reason, bytes):
            reason = reason.decode("utf-8", "replace")
        raise AdapterValidationError(
            f"{where}: {field} pattern {pattern[:80]!r} is not a regular expression that can be "
            f"matched in linear time (RE2: {reason}); backreferences and lookaround are not "
            "supported"
        ) from None


@dataclass(frozen=True)
class PatternTable(Generic[V]):
    """PEFT's `rank_pattern` / `alpha_pattern`: the value of the first key matching a module."""

    field: str
    entries: tuple[tuple[str, Regex, V], ...]  # (key, compiled, value), in file order

    @classmethod
    def compile(cls, field: str, values: dict[str, V], where: str) -> PatternTable[V]:
        if len(values) > MAX_PATTERNS:
            raise AdapterValidationError(
                f"{where}: {field} has {len(values)} keys, over the limit of {MAX_PATTERNS}"
            )
        # NOTE: PEFT's `get_pattern_key`: `re.match(rf"(.*\.)?({key})$", module)`, first key wins.
        entries = tuple(
            (key, compile_pattern(key, field, where, r"(.*\.)?({})$"), value)
            for key, value in values.items()
        )
        return cls(field, entries)

    def match_pattern_key(self, module_path: str) -> tuple[str, V] | None:
        """(key, value) of the first key matching `module_path`, None if none does."""
        for key, regex, value in self.entries:
            if regex.match(module_path) is not None:
                return key, value
        return None


def fullmatch_modules(regex: Regex, module_path: str) -> bool:
    """PEFT's rule for a string `target_modules` / `exclude_modules`: the whole name matches."""
    return regex.fullmatch(module_path) is not None
