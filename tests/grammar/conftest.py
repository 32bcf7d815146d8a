"""Grammar fixtures: the default model's tokenizer, its grammar vocabulary, one compiler, and a
random walk that drives a matcher to completion without a model."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from tokenizers import Tokenizer

from loraplex.grammar.compiler import GrammarCompiler
from loraplex.grammar.config import GrammarConfig
from loraplex.grammar.vocabulary import GrammarVocabulary, build_vocabulary
from loraplex.grammar.walk import RandomWalker


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
def random_walk(tokenizer: Tokenizer) -> Callable:
    """`walk(grammar, seed)` samples allowed tokens until the grammar ends; returns token ids
    (`RandomWalker.walk`), and fails the test when a walk does not finish."""
    walker = RandomWalker(tokenizer)

    def walk(grammar, seed: int, explore_steps: int = 24, max_steps: int = 600) -> list[int]:
        tokens = walker.walk(grammar, seed, explore_steps, max_steps)
        assert tokens is not None, f"walk did not finish in {max_steps} steps"
        return tokens

    return walk
