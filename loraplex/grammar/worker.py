"""`CompileWorker`: one compile child process, restarted after a timeout or a crash."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import pickle
import select
import signal
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import IO

from outlines_core import Index

from loraplex.grammar.compile_request import CompileRequest
from loraplex.grammar.errors import (
    GrammarCompileError,
    GrammarMemoryError,
    GrammarTimeoutError,
    UnsupportedSchemaError,
)
from loraplex.grammar.vocabulary import GrammarVocabulary

logger = logging.getLogger(__name__)

_CHILD = Path(__file__).with_name("_compile_child.py")
# Lines of the child's stderr quoted in the error when it dies.
_STDERR_LINES = 8
# The folder holding the `loraplex` package, where the child finds the schema analysis.
_PACKAGE_PARENT = Path(__file__).resolve().parents[2]
_HEADER = struct.Struct("<Q")
# Deaths that mean the child ran out of memory: Rust aborts on a failed allocation, the kernel's
# OOM killer sends SIGKILL.
_OOM_SIGNALS = (-signal.SIGABRT, -signal.SIGKILL, -signal.SIGSEGV)


class CompileWorker:
    """Compiles `CompileRequest`s in a child process under time and memory limits.

    Not thread-safe: one caller at a time. The child starts on first use and again after any
    compile that killed it, so one bad schema never affects the next.
    """

    def __init__(self, vocabulary: GrammarVocabulary, timeout_s: float, memory_mib: int) -> None:
        self._vocabulary_frame = pickle.dumps(
            vocabulary.vocabulary, protocol=pickle.HIGHEST_PROTOCOL
        )
        self._end_marker = vocabulary.end_marker
        self.timeout_s = timeout_s
        self.memory_mib = memory_mib
        self._process: subprocess.Popen[bytes] | None = None
        self._stderr: IO[bytes] | None = None

    def compile(self, request: CompileRequest) -> bytes:
        """The binary form of the outlines-core `Index` for `request` (see `load_index`).

        Raises `GrammarTimeoutError`, `GrammarMemoryError`, `GrammarCompileError`, or
        `UnsupportedSchemaError` when the schema's analysis refuses it.
        """
        process = self._ensure_started()
        deadline = time.monotonic() + self.timeout_s
        try:
            job = {**dataclasses.asdict(request), "end_marker": self._end_marker}
            self._send(process, job)
            status, payload = pickle.loads(self._receive(process, deadline))
        except TimeoutError:
            self.close()
            raise GrammarTimeoutError(
                f"grammar compilation exceeded the {self.timeout_s:g} s limit"
            ) from None
        except (EOFError, BrokenPipeError):
            returncode = self.close()
            if returncode in _OOM_SIGNALS:
                raise GrammarMemoryError(
                    f"grammar compilation exceeded the {self.memory_mib} MiB memory limit"
                ) from None
            message = f"grammar compiler exited ({returncode})"
            tail = self._stderr_tail()
            if tail:
                message += f": {tail}"
            logger.warning("%s", message)
            raise GrammarCompileError(message) from None
        if status == "ok":
            return payload
        if status == "memory":
            raise GrammarMemoryError(
                f"grammar compilation exceeded the {self.memory_mib} MiB memory limit"
            )
        if status == "unsupported":
            raise UnsupportedSchemaError(*payload)
        if status == "invalid":
            raise GrammarCompileError(payload)
        raise GrammarCompileError(f"grammar compilation failed: {payload}")

    def start(self) -> None:
        """Start the child now (a warm-up), rather than on the first compile."""
        self._ensure_started()

    def close(self) -> int | None:
        """Stop the child (if any); returns its exit code. Its stderr is kept until the next
        start, for `_stderr_tail`."""
        process, self._process = self._process, None
        if process is None:
            return None
        if process.poll() is None:
            process.kill()
        returncode = process.wait()
        for stream in (process.stdin, process.stdout):
            if stream is not None:
                stream.close()
        return returncode

    def _stderr_tail(self) -> str:
        """The last lines the child wrote to stderr, joined with " | " (empty if none)."""
        if self._stderr is None:
            return ""
        self._stderr.seek(0, os.SEEK_END)
        size = self._stderr.tell()
        self._stderr.seek(max(0, size - 8192))
        lines = self._stderr.read().decode(errors="replace").strip().splitlines()
        return " | ".join(line.strip() for line in lines[-_STDERR_LINES:] if line.strip())

    def _ensure_started(self) -> subprocess.Popen[bytes]:
        if self._process is not None and self._process.poll() is None:
            return self._process
        self.close()
        if self._stderr is not None:
            self._stderr.close()
        # NOTE: a file, not a pipe: nobody reads it while the child runs, so it never blocks.
        self._stderr = tempfile.TemporaryFile(prefix="loraplex-grammar-child-")
        self._process = subprocess.Popen(
            child_command(self.memory_mib),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._stderr,
            bufsize=0,
        )
        self._send(self._process, self._vocabulary_frame, pickled=True)
        return self._process

    @staticmethod
    def _send(process: subprocess.Popen[bytes], payload: object, pickled: bool = False) -> None:
        data = payload if pickled else pickle.dumps(payload, protocol=pickle.HIGHEST_PROTOCOL)
        process.stdin.write(_HEADER.pack(len(data)) + data)
        process.stdin.flush()

    @staticmethod
    def _receive(process: subprocess.Popen[bytes], deadline: float) -> bytes:
        fd = process.stdout.fileno()
        data = bytearray()
        size = None
        while size is None or len(data) < size:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not select.select([fd], [], [], remaining)[0]:
                raise TimeoutError
            chunk = os.read(fd, 1 << 20)
            if not chunk:
                raise EOFError
            data += chunk
            if size is None and len(data) >= _HEADER.size:
                size = _HEADER.size + _HEADER.unpack_from(data)[0]
        return bytes(data[_HEADER.size :])


def child_command(memory_mib: int) -> list[str]:
    """The compile child's command line.

    NOTE: -I keeps the script's folder off sys.path and ignores PYTHON* variables; the parent's
    own sys.path is passed explicitly instead, so the child finds every package the parent
    does (outlines-core and llguidance included, wherever they were installed or put on
    PYTHONPATH). The child imports those and loraplex.grammar's analysis, never torch."""
    paths = [os.path.abspath(p) for p in sys.path if p]
    return [
        sys.executable,
        "-I",
        str(_CHILD),
        str(memory_mib),
        str(_PACKAGE_PARENT),
        json.dumps(paths),
    ]


def load_index(data: bytes) -> Index:
    """An `Index` from the bytes `CompileWorker.compile` returns (no unpickling involved)."""
    return Index.from_binary(data)
