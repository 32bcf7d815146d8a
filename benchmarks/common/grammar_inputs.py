"""What the grammar benchmarks compile: one realistic JSON schema, the test suite's schemas, a
corpus of public real-world schemas, and the grammar vocabulary of a tokenizer."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
_METASCHEMAS = ("draft4/metaschema.json", "draft6/metaschema.json", "draft7/metaschema.json")

# A catalog item: strings with length limits, an enum, bounded integers, a boolean and an array.
CATEGORIES = ["book", "film", "music", "game", "podcast"]
SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "maxLength": 32},
        "category": {"enum": CATEGORIES},
        "rating": {"type": "integer", "minimum": 1, "maximum": 10},
        "year": {"type": "integer", "minimum": 1900, "maximum": 2030},
        "available": {"type": "boolean"},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 4},
    },
    "required": ["title", "category", "rating", "year", "available", "tags"],
    "additionalProperties": False,
}


def _package_dir(name: str) -> Path:
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit(f"the corpus needs the {name} package: pip install --no-deps {name}")
    return Path(spec.submodule_search_locations[0])


def coverage_corpus(components: int) -> list[tuple[str, str, dict[str, Any]]]:
    """(name, where it came from, schema) of every coverage-corpus entry: the JSON Schema Store
    files `check-jsonschema` vendors, up to `components` object-typed definitions of each (with
    the definitions they reference), and the draft 4, 6 and 7 meta-schemas that
    `jsonschema-specifications` ships."""
    entries = []
    vendor = _package_dir("check_jsonschema") / "builtin_schemas" / "vendor"
    for path in sorted(vendor.glob("*.json")):
        schema = json.loads(path.read_text())
        source = f"check-jsonschema {path.name}" + (
            f" ({schema.get('$id') or schema.get('id')})" if schema.get("$id") else ""
        )
        entries.append((path.stem, source, schema))
        for key in ("definitions", "$defs"):
            defs = schema.get(key)
            if not isinstance(defs, dict):
                continue
            objects = [
                n
                for n, d in sorted(defs.items())
                if isinstance(d, dict) and d.get("type") == "object"
            ]
            step = max(1, len(objects) // max(components, 1))
            for name in objects[::step][:components]:
                needed = _referenced(defs, key, defs[name])
                component = {**defs[name], key: needed} if needed else dict(defs[name])
                entries.append((f"{path.stem}#{name}", f"{source} {key}/{name}", component))
    specs = _package_dir("jsonschema_specifications") / "schemas"
    for rel in _METASCHEMAS:
        path = specs / rel
        if path.exists():
            entries.append(
                (
                    f"metaschema-{rel.split('/')[0]}",
                    f"jsonschema-specifications {rel}",
                    json.loads(path.read_text()),
                )
            )
    return entries


def _referenced(defs: dict[str, Any], key: str, node: Any) -> dict[str, Any]:
    """The entries of `defs` that `node` reaches through `#/<key>/...` references."""
    prefix, seen, todo = f"#/{key}/", {}, [node]
    while todo:
        item = todo.pop()
        if isinstance(item, list):
            todo.extend(item)
        elif isinstance(item, dict):
            ref = item.get("$ref")
            if isinstance(ref, str) and ref.startswith(prefix):
                name = ref[len(prefix) :].split("/")[0]
                if name in defs and name not in seen:
                    seen[name] = defs[name]
                    todo.append(defs[name])
            todo.extend(v for k, v in item.items() if k != "$ref")
    return seen


def test_suite_schemas() -> dict[str, dict[str, Any]]:
    """The test suite's JSON schemas by name (tests/grammar/grammar_schemas.py)."""
    spec = importlib.util.spec_from_file_location(
        "grammar_schemas", ROOT / "tests/grammar/grammar_schemas.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.SCHEMAS


def grammar_vocabulary(tokenizer_file: Path):
    """(tokenizer, stop token ids, grammar vocabulary) of a SmolLM2-style tokenizer.json."""
    from tokenizers import Tokenizer

    from loraplex.grammar.vocabulary import build_vocabulary

    tokenizer = Tokenizer.from_file(str(tokenizer_file))
    stops = [tokenizer.token_to_id("<|im_end|>"), tokenizer.token_to_id("<|endoftext|>")]
    return tokenizer, stops, build_vocabulary(tokenizer, stops)
