"""`hold_outlines`: hold a compiler's outlines-core compiles until the test lets them go."""

from __future__ import annotations

import threading

from loraplex.grammar.compiler import GrammarCompiler


def hold_outlines(compiler: GrammarCompiler, monkeypatch) -> threading.Event:
    """Hold every compile that tries outlines-core first until the returned event is set (as
    if its automaton took long to build), so tests do not race the real compile time."""
    gate = threading.Event()
    compile_ = compiler._compile

    def held(request, key, workers):
        if request.backends[0] == "outlines":
            assert gate.wait(120)
        return compile_(request, key, workers)

    monkeypatch.setattr(compiler, "_compile", held)
    return gate
