"""`GrammarConfig`: limits and caches of grammar compilation."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from loraplex import envs


@dataclass(frozen=True)
class GrammarConfig:
    """How grammars compile and where compiled ones are kept.

    compile_timeout_s / compile_memory_mib: limits on one compile in its child process; a spec
        over either fails with a 400-style error and the server is unaffected.
    num_workers: compiles that run at once, each in its own child process.
    memory_cache_mib: compiled indexes kept in memory (LRU by size).
    disk_cache: keep compiled indexes under `cache_dir` across restarts.
    whitespace_pattern: the regex for whitespace between JSON tokens. A tight one keeps small
        models from looping on whitespace.
    max_recursion_depth: how deep recursive `$ref`s unfold.
    max_schema_depth / max_schema_nodes / max_schema_bytes: the largest JSON schema accepted:
        nesting of its objects and arrays, JSON values in it (objects, arrays, strings, numbers,
        booleans, nulls; keys not counted), and its size as compact JSON text (UTF-8). Checked
        on submission, in time proportional to the limits, before any analysis; a schema over
        one is refused with `SchemaTooLargeError` (a 400) naming it.
    overlap: fill a step's grammar masks on the host while the device runs its forward pass,
        so grammar requests run ahead under async scheduling like any other (`grammar_overlap`
        as an engine option). False puts the engine in lock step while one runs (same tokens,
        slower; for comparison).
    json_backends: the backends a JSON schema may compile with, in the order tried; the first
        that enforces the schema exactly wins. outlines-core (one automaton, masks reused per
        state: the cheapest per step) first; llguidance (a lazy parser: more of JSON Schema,
        instant to compile, a mask computed per step) for what outlines-core cannot enforce.
    cold_start: while a JSON schema's grammar compiles for the first time with outlines-core
        (about half a second, seconds for large schemas), its requests start at once under an
        llguidance grammar of the same schema (milliseconds, in a compile child of its own) and
        hand over to the outlines-core grammar once it is ready, when it accepts the tokens
        generated so far (otherwise they finish under llguidance). Both enforce the schema
        exactly; a seeded request's tokens may then depend on when the hand-over happens.
        Needs llguidance among `json_backends` after outlines (`grammar_cold_start`).
    """

    compile_timeout_s: float = 30.0
    compile_memory_mib: int = 4096
    num_workers: int = 2
    memory_cache_mib: int = 512
    disk_cache: bool = True
    cache_dir: Path | None = None
    whitespace_pattern: str = r"[ ]?"
    max_recursion_depth: int = 3
    max_schema_depth: int = 64
    max_schema_nodes: int = 10_000
    max_schema_bytes: int = 512 * 1024
    overlap: bool = True
    json_backends: tuple[str, ...] = ("outlines", "llguidance")
    cold_start: bool = True

    def __post_init__(self) -> None:
        for name in ("max_schema_depth", "max_schema_nodes", "max_schema_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.compile_timeout_s <= 0:
            raise ValueError(f"compile_timeout_s must be positive, got {self.compile_timeout_s}")
        if self.compile_memory_mib < 256:
            raise ValueError(f"compile_memory_mib must be >= 256, got {self.compile_memory_mib}")
        if self.num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {self.num_workers}")
        if self.memory_cache_mib < 0:
            raise ValueError(f"memory_cache_mib must be >= 0, got {self.memory_cache_mib}")
        unknown = set(self.json_backends) - {"outlines", "llguidance"}
        if not self.json_backends or unknown:
            raise ValueError(
                f"json_backends must name 'outlines' and/or 'llguidance', got {self.json_backends}"
            )
        if self.max_recursion_depth < 0:
            raise ValueError(f"max_recursion_depth must be >= 0, got {self.max_recursion_depth}")

    @property
    def cold_start_enabled(self) -> bool:
        """Whether cold JSON schemas start under llguidance while outlines-core compiles."""
        return self.cold_start and "llguidance" in self.json_backends[1:]

    @property
    def grammar_cache_dir(self) -> Path:
        """Where compiled indexes are stored on disk."""
        return self.cache_dir if self.cache_dir is not None else envs.cache_dir() / "grammars"
