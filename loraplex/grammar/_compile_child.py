"""The compile child process: `python -I _compile_child.py MEMORY_MIB`.

Runs as a plain script (nothing of loraplex is imported, so no torch), under an address-space
limit. Reads length-prefixed pickled frames on stdin: first the outlines-core `Vocabulary`, then
one job dict per compile. Answers each job with `("ok", Index binary)` or `(kind, message)` where
kind is "error" or "memory". outlines-core aborts the process when an allocation fails; the
parent reads that as running out of memory.
"""

import os
import pickle
import resource
import struct
import sys

from outlines_core import Index
from outlines_core.json_schema import build_regex_from_schema

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


def _regex(job: dict) -> str:
    """The job's regex, followed by the end marker (see `GrammarVocabulary`)."""
    if job["kind"] == "regex":
        regex = job["source"]
    else:
        regex = build_regex_from_schema(
            job["source"], job["whitespace_pattern"], max_recursion_depth=job["max_recursion_depth"]
        )
        for placeholder, replacement in job["substitutions"]:
            regex = regex.replace(placeholder, replacement)
    return f"(?:{regex})\\x{{{ord(job['end_marker']):X}}}"


def main() -> None:
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
            index = Index(_regex(job), vocabulary)
            # NOTE: an Index pickles as `Index.from_binary(data)`; sending `data` alone lets
            # the parent and the disk cache load it without unpickling.
            _write_frame(replies, ("ok", index.__reduce__()[1][0]))
        except MemoryError as error:
            _write_frame(replies, ("memory", str(error)))
        except Exception as error:
            _write_frame(replies, ("error", f"{type(error).__name__}: {error}"))


if __name__ == "__main__":
    main()
