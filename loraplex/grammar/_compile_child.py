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


def _regex(job: dict, schema_regex) -> str:
    """The job's regex, followed by the end marker (see `GrammarVocabulary`)."""
    if job["kind"] == "regex":
        regex = job["source"]
    else:
        schema = json.loads(job["source"])
        regex = schema_regex(schema, job["whitespace_pattern"], job["max_recursion_depth"])
    return f"(?:{regex})\\x{{{ord(job['end_marker']):X}}}"


def main() -> None:
    schema_regex, errors, llguidance = _import_analysis(sys.argv[2])
    has_llguidance = llguidance.llguidance_available()
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
            index = Index(_regex(job, schema_regex), vocabulary)
            # NOTE: an Index pickles as `Index.from_binary(data)`; sending `data` alone lets
            # the parent and the disk cache load it without unpickling.
            _write_frame(replies, ("ok", index.__reduce__()[1][0]))
        except errors.UnsupportedSchemaError as error:
            # NOTE: outlines-core cannot enforce it exactly; llguidance may (the second backend).
            grammar, why = None, "llguidance is not installed"
            if has_llguidance and job["kind"] == "json":
                schema = json.loads(job["source"])
                grammar, why = llguidance.json_schema_grammar(schema, job["whitespace_pattern"])
            if grammar is not None:
                _write_frame(replies, ("ok", llguidance.pack(grammar)))
            else:
                detail = f"{error.detail}; llguidance: {why}" if error.detail else why
                _write_frame(replies, ("unsupported", (error.feature, detail)))
        except errors.GrammarError as error:
            _write_frame(replies, ("invalid", str(error)))
        except MemoryError as error:
            _write_frame(replies, ("memory", str(error)))
        except Exception as error:
            _write_frame(replies, ("error", f"{type(error).__name__}: {error}"))


if __name__ == "__main__":
    main()
