"""The compile child process: `python -I _compile_child.py MEMORY_MIB PACKAGE_PARENT PATHS`.

Runs as a plain script under an address-space limit. Of loraplex it imports only the schema
analysis (`loraplex.grammar`, never the engine or torch), found under PACKAGE_PARENT; PATHS (a
JSON list, the parent's sys.path) is added behind its own sys.path first, so it finds the
packages the parent finds. Reads
length-prefixed pickled frames on stdin: first the outlines-core `Vocabulary`, then one job dict
per compile. A "json" job's schema is analysed here (`analyse_schema`: validation, refusals,
rewriting), so a costly schema spends this process's time and memory, not the engine's. Answers
each job with `("ok", Index binary)`, `("unsupported", (feature, detail))`, `("invalid",
message)`, or `(kind, message)` where kind is "error" or "memory". A schema the analysis refuses
for outlines-core goes to llguidance (when installed), whose grammar text comes back as
`("ok", packed text)`; refused by both, the answer names outlines-core's feature and adds
llguidance's reason. outlines-core aborts the
process when an allocation fails; the parent reads that as running out of memory.
"""

import json
import os
import pickle
import resource
import struct
import sys
import types

# NOTE: before any third-party import: the parent's sys.path, which -I did not inherit.
sys.path += [p for p in json.loads(sys.argv[3]) if p not in sys.path]

from outlines_core import Index  # noqa: E402

_HEADER = struct.Struct("<Q")


def _read_exact(stream, size: int) -> bytes | None:
    data = bytearray()
    while len(data) < size:
        chunk = stream.read(size - len(data))
        if not chunk:
            return None
        data += chunk
    return bytes(data)


def _read_frame(stream) -> bytes | None:
    header = _read_exact(stream, _HEADER.size)
    return None if header is None else _read_exact(stream, _HEADER.unpack(header)[0])


def _write_frame(stream, payload: object) -> None:
    data = pickle.dumps(payload, protocol=pickle.HIGHEST_PROTOCOL)
    stream.write(_HEADER.pack(len(data)) + data)
    stream.flush()


def _import_analysis(package_parent: str):
    """`schema_regex` and the grammar errors, without running `loraplex/__init__`.

    NOTE: the root package imports the engine (and with it torch); a bare module standing in for
    it, whose path is the package folder, lets `loraplex.grammar` load alone."""
    package = types.ModuleType("loraplex")
    package.__path__ = [os.path.join(package_parent, "loraplex")]
    sys.modules["loraplex"] = package
    from loraplex.grammar import errors, llguidance_compile
    from loraplex.grammar.schema_analysis import schema_regex

    return schema_regex, errors, llguidance_compile


def _as_outlines(schema: dict, llguidance) -> dict:
    """`schema` as outlines-core would enforce it (listed properties only), when our analysis
    lets outlines-core enforce it; otherwise unchanged (llguidance will be its backend)."""
    from loraplex.grammar.errors import GrammarError
    from loraplex.grammar.schema_analysis import analyse_schema

    try:
        analyse_schema(schema)
    except GrammarError:
        return schema
    return llguidance.listed_properties_only(schema)


def _compile_json(job: dict, vocabulary, schema_regex, errors, llguidance) -> tuple:
    """The reply to a "json" job: the first backend in `job["backends"]` that enforces the
    schema exactly compiles it; refused by all, the first refusal's feature is named and every
    backend's reason is given."""
    schema = json.loads(job["source"])
    refusals = []
    for backend in job["backends"]:
        if backend == "outlines":
            try:
                regex = schema_regex(schema, job["whitespace_pattern"], job["max_recursion_depth"])
            except errors.UnsupportedSchemaError as error:
                why = f"{error.feature} {error.detail}".strip()
                refusals.append((error.feature, f"outlines-core refuses {why}"))
                continue
            return ("ok", _index_bytes(Index(_with_end_marker(regex, job), vocabulary)))
        if not llguidance.llguidance_available():
            refusals.append(("llguidance", "llguidance: not installed"))
            continue
        source = _as_outlines(schema, llguidance) if job.get("as_outlines") else schema
        grammar, why = llguidance.json_schema_grammar(source, job["whitespace_pattern"])
        if grammar is not None:
            return ("ok", llguidance.pack(grammar))
        refusals.append((llguidance.refused_feature(why), f"llguidance: {why}"))
    feature = refusals[0][0] if refusals else "backends"
    return ("unsupported", (feature, "; ".join(why for _, why in refusals) or "no backend"))


def _with_end_marker(regex: str, job: dict) -> str:
    """`regex` followed by the end marker (see `GrammarVocabulary`)."""
    return f"(?:{regex})\\x{{{ord(job['end_marker']):X}}}"


def _index_bytes(index) -> bytes:
    # NOTE: an Index pickles as `Index.from_binary(data)`; sending `data` alone lets the parent
    # and the disk cache load it without unpickling.
    return index.__reduce__()[1][0]


def main() -> None:
    schema_regex, errors, llguidance = _import_analysis(sys.argv[2])
    limit = int(sys.argv[1]) * 1024 * 1024
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    requests = sys.stdin.buffer
    # NOTE: the protocol owns the original stdout; stray prints go to stderr instead.
    replies = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    vocabulary = pickle.loads(_read_frame(requests))
    while (frame := _read_frame(requests)) is not None:
        job = pickle.loads(frame)
        try:
            if job["kind"] == "json":
                reply = _compile_json(job, vocabulary, schema_regex, errors, llguidance)
            else:
                reply = (
                    "ok",
                    _index_bytes(Index(_with_end_marker(job["source"], job), vocabulary)),
                )
            _write_frame(replies, reply)
        except errors.UnsupportedSchemaError as error:
            _write_frame(replies, ("unsupported", (error.feature, error.detail)))
        except errors.GrammarError as error:
            _write_frame(replies, ("invalid", str(error)))
        except MemoryError as error:
            _write_frame(replies, ("memory", str(error)))
        except Exception as error:
            _write_frame(replies, ("error", f"{type(error).__name__}: {error}"))


if __name__ == "__main__":
    main()
