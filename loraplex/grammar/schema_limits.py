"""Size limits on a JSON schema, checked before anything else reads it.

The walk is iterative and stops at the first limit crossed, so it costs at most
`max_schema_nodes` steps whatever the client sent, and no schema is ever deep enough to make a
recursive reader (jsonschema, `json.dumps`, the analysis) raise `RecursionError`.
"""

from __future__ import annotations

import json
from typing import Any

from loraplex.grammar.config import GrammarConfig
from loraplex.grammar.errors import SchemaTooLargeError


def check_schema_limits(schema: Any, config: GrammarConfig) -> None:
    """Raise `SchemaTooLargeError` if `schema` nests deeper than `config.max_schema_depth`,
    holds more than `config.max_schema_nodes` JSON values, or is longer than
    `config.max_schema_bytes` as compact JSON."""
    max_depth, max_nodes = config.max_schema_depth, config.max_schema_nodes
    stack: list[tuple[Any, int]] = [(schema, 1)]
    nodes = 0
    while stack:
        value, depth = stack.pop()
        nodes += 1
        if nodes > max_nodes:
            raise SchemaTooLargeError(
                "max_schema_nodes",
                f"the JSON schema has more than {max_nodes} values; the limit is {max_nodes} "
                "(max_schema_nodes)",
            )
        if isinstance(value, dict):
            children: Any = value.values()
        elif isinstance(value, list):
            children = value
        else:
            continue
        if depth > max_depth:
            raise SchemaTooLargeError(
                "max_schema_depth",
                f"the JSON schema nests deeper than {max_depth} levels of objects and arrays; "
                f"the limit is {max_depth} (max_schema_depth)",
            )
        stack.extend((child, depth + 1) for child in children)
    size = len(json.dumps(schema, separators=(",", ":"), ensure_ascii=False).encode())
    if size > config.max_schema_bytes:
        raise SchemaTooLargeError(
            "max_schema_bytes",
            f"the JSON schema is {size} bytes; the limit is {config.max_schema_bytes} "
            "(max_schema_bytes)",
        )
