"""Structured output: JSON schemas, regexes and choice lists compiled into token automata
(outlines-core) over the model's vocabulary, a per-request matcher, and packed token bitmasks.

Knows tokenizers and token masks, not engines. `bitmask` needs only torch (applying a mask is
the kernel family `loraplex.kernels.bitmask`); everything else imports outlines-core on first
use.

How an engine uses it:

    vocab = build_vocabulary(tokenizer, stop_token_ids)      # once; EOS first
    compiler = GrammarCompiler(vocab, GrammarConfig())       # once; shutdown() at exit
    future = compiler.submit(params.structured_outputs)      # on add; SchemaTooLargeError -> 400
    if future.done():                                        # each step, until ready
        matcher = GrammarMatcher(future.result())            # GrammarError -> fail request
    bitmask = allocate_token_bitmask(max_rows, vocab_size)   # once; rows = -1 (allow all)
    rows = bitmask.numpy()                                   # once; fast CPU view
    matcher.fill_bitmask(rows, row)                          # each step, constrained rows
    apply_token_bitmask_(logits, bitmask_on_device)          # sampler, any device
    matcher.accept_token(token)                              # after sampling
    matcher.is_terminated()                                  # a stop token ended the grammar
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from loraplex.grammar.errors import (
    GrammarCompileError,
    GrammarError,
    GrammarMemoryError,
    GrammarTimeoutError,
    SchemaTooLargeError,
    UnsupportedSchemaError,
)
from loraplex.platform.core.structured_outputs import StructuredOutputs

if TYPE_CHECKING:
    from loraplex.grammar.bitmask import allocate_token_bitmask, apply_token_bitmask_
    from loraplex.grammar.compiled import CompiledGrammar
    from loraplex.grammar.compiler import GrammarCompiler
    from loraplex.grammar.config import GrammarConfig
    from loraplex.grammar.matcher import GrammarMatcher
    from loraplex.grammar.vocabulary import GrammarVocabulary, build_vocabulary

_LAZY = {
    "CompiledGrammar": "loraplex.grammar.compiled",
    "GrammarCompiler": "loraplex.grammar.compiler",
    "GrammarConfig": "loraplex.grammar.config",
    "GrammarMatcher": "loraplex.grammar.matcher",
    "GrammarVocabulary": "loraplex.grammar.vocabulary",
    "build_vocabulary": "loraplex.grammar.vocabulary",
    "allocate_token_bitmask": "loraplex.grammar.bitmask",
    "apply_token_bitmask_": "loraplex.grammar.bitmask",
}

__all__ = [
    "CompiledGrammar",
    "GrammarCompileError",
    "GrammarCompiler",
    "GrammarConfig",
    "GrammarError",
    "GrammarMatcher",
    "GrammarMemoryError",
    "GrammarTimeoutError",
    "GrammarVocabulary",
    "SchemaTooLargeError",
    "StructuredOutputs",
    "UnsupportedSchemaError",
    "allocate_token_bitmask",
    "apply_token_bitmask_",
    "build_vocabulary",
]


def __getattr__(name: str) -> object:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'loraplex.grammar' has no attribute {name!r}")
