"""Grammar fixtures: the default model's tokenizer, its grammar vocabulary, one compiler, and a
random walk that drives a matcher to completion without a model."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer

# NOTE: before any Triton kernel module is imported, as in tests/kernels/conftest.py.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from loraplex.grammar.bitmask import allocate_token_bitmask  # noqa: E402
from loraplex.grammar.compiler import GrammarCompiler  # noqa: E402
from loraplex.grammar.config import GrammarConfig  # noqa: E402
from loraplex.grammar.vocabulary import GrammarVocabulary, build_vocabulary  # noqa: E402

# Single characters a finishing walk prefers: they close strings, objects and arrays.
_CLOSERS = ('"', "}", "]")


@pytest.fixture(scope="session")
def tokenizer(model_dir: Path) -> Tokenizer:
    return Tokenizer.from_file(str(model_dir / "tokenizer.json"))


@pytest.fixture(scope="session")
def vocabulary(tokenizer: Tokenizer) -> GrammarVocabulary:
    stops = [tokenizer.token_to_id("<|im_end|>"), tokenizer.token_to_id("<|endoftext|>")]
    return build_vocabulary(tokenizer, stops)


@pytest.fixture(scope="session")
def compiler(vocabulary: GrammarVocabulary, tmp_path_factory: pytest.TempPathFactory):
    """One compiler for the session; its disk cache lives in the repository's test cache, so a
    second test run compiles nothing."""
    from loraplex import envs

    config = GrammarConfig(compile_timeout_s=120, cache_dir=envs.cache_dir() / "grammars-tests")
    compiler = GrammarCompiler(vocabulary, config)
    yield compiler
    compiler.shutdown()


@pytest.fixture(scope="session")
def closer_ids(tokenizer: Tokenizer) -> dict[int, str]:
    """Ids of the one-character tokens a finishing walk prefers."""
    return {tokenizer.token_to_id(ch): ch for ch in _CLOSERS}


@pytest.fixture(scope="session")
def short_ids(tokenizer: Tokenizer) -> np.ndarray:
    """Ids of every single-byte token (a finishing walk takes small steps)."""
    vocab = tokenizer.get_vocab()
    return np.array(sorted(i for t, i in vocab.items() if len(t) == 1), dtype=np.int64)


@pytest.fixture(scope="session")
def random_walk(closer_ids: dict[int, str], short_ids: np.ndarray) -> Callable:
    """`walk(grammar, seed)` samples allowed tokens until the grammar ends; returns token ids.

    The first steps pick any allowed token; later ones favour closing characters and short
    tokens, and stop as soon as the grammar is complete, so every walk finishes.
    """

    def walk(grammar, seed: int, explore_steps: int = 24, max_steps: int = 600) -> list[int]:
        rng = np.random.default_rng(seed)
        matcher = grammar.new_matcher()
        bitmask = allocate_token_bitmask(1, grammar.vocab_size).numpy()
        is_short = np.zeros(grammar.vocab_size, dtype=bool)
        is_short[short_ids[short_ids < grammar.vocab_size]] = True
        stop_ids = list(grammar.stop_token_ids)
        tokens: list[int] = []
        for step in range(max_steps):
            matcher.fill_bitmask(bitmask, 0)
            bits = np.unpackbits(bitmask[0].view(np.uint8), bitorder="little")
            allowed = bits[: grammar.vocab_size].astype(bool)
            exploring = step < explore_steps
            if allowed[stop_ids].any():
                allowed[stop_ids] = False
                if not exploring or rng.random() < 0.2 or not allowed.any():
                    assert matcher.accept_token(stop_ids[0])
                    assert matcher.is_terminated()
                    return tokens
            candidates = np.flatnonzero(allowed)
            if not exploring:
                closers = [t for t in closer_ids if allowed[t]]
                short = np.flatnonzero(allowed & is_short)
                if closers and rng.random() < 0.5:
                    candidates = np.array(closers)
                elif len(short):
                    candidates = short
            assert len(candidates), "a non-final state allows no token"
            pick = int(rng.choice(candidates))
            assert matcher.accept_token(pick)
            tokens.append(pick)
        raise AssertionError(f"walk did not finish in {max_steps} steps")

    return walk
