"""A request's matcher: masks allow exactly the grammar's next tokens, stop only when complete."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from loraplex.grammar.bitmask import allocate_token_bitmask, apply_token_bitmask_
from loraplex.grammar.matcher import GrammarMatcher
from loraplex.platform.core.structured_outputs import StructuredOutputs


@pytest.fixture(scope="module")
def yes_no(compiler):
    return compiler.compile(StructuredOutputs(choice=["yes", "no"]))


def _allowed(matcher: GrammarMatcher, width: int | None = None) -> np.ndarray:
    vocab = matcher.grammar.vocab_size
    bitmask = np.full((1, width or (vocab + 31) // 32), -1, dtype=np.int32)
    matcher.fill_bitmask(bitmask, 0)
    return np.flatnonzero(np.unpackbits(bitmask[0].view(np.uint8), bitorder="little"))


def test_first_mask_allows_only_prefixes_of_the_choices(yes_no, tokenizer) -> None:
    matcher = GrammarMatcher(yes_no)
    texts = {tokenizer.decode([int(t)]) for t in _allowed(matcher)}
    assert texts and all("yes".startswith(t) or "no".startswith(t) for t in texts)
    assert not set(yes_no.stop_token_ids) & set(_allowed(matcher).tolist())


def test_stop_is_allowed_only_when_complete(yes_no, tokenizer) -> None:
    matcher = GrammarMatcher(yes_no)
    assert not matcher.accept_token(yes_no.stop_token_ids[0])
    assert matcher.accept_tokens(tokenizer.encode("yes").ids)
    assert matcher.is_final() and matcher.must_stop()
    assert set(_allowed(matcher).tolist()) == set(yes_no.stop_token_ids)
    assert matcher.accept_token(yes_no.stop_token_ids[1])
    assert matcher.is_terminated()
    assert not matcher.accept_token(tokenizer.encode("no").ids[0])


def test_forbidden_token_is_rejected_and_state_kept(yes_no, tokenizer) -> None:
    matcher = GrammarMatcher(yes_no)
    state = matcher.state
    assert not matcher.accept_token(tokenizer.encode("maybe").ids[0])
    assert matcher.state == state
    assert not matcher.is_final()


def test_padding_words_beyond_the_vocabulary_are_zero(yes_no) -> None:
    matcher = GrammarMatcher(yes_no)
    allowed = _allowed(matcher, width=(yes_no.vocab_size + 31) // 32 + 3)
    assert (allowed < yes_no.vocab_size).all()


def test_batch_of_constrained_rows_samples_only_allowed_tokens(compiler, tokenizer) -> None:
    grammars = [
        compiler.compile(StructuredOutputs(choice=["yes", "no"])),
        compiler.compile(StructuredOutputs(regex="[0-9]{2}")),
    ]
    matchers = [GrammarMatcher(g) for g in grammars]
    vocab = grammars[0].vocab_size
    bitmask = allocate_token_bitmask(2, vocab)  # [2, words]
    for row, matcher in enumerate(matchers):
        matcher.fill_bitmask(bitmask, row)
    logits = torch.randn(3, vocab)  # row 1 is unconstrained
    apply_token_bitmask_(logits, bitmask, torch.tensor([0, 2]))
    picks = logits.argmax(dim=-1).tolist()
    assert matchers[0].accept_token(picks[0])
    assert matchers[1].accept_token(picks[2])
    assert tokenizer.decode([picks[2]]).isdigit()


@pytest.mark.parametrize(
    ("outputs", "text"),
    [
        (StructuredOutputs(regex=r"[0-9]+(\.[0-9]+)?"), "12.5"),
        (StructuredOutputs(choice=["a", "abc"]), "abc"),
        (StructuredOutputs(choice=["Yes", "Yes, definitely"]), "Yes, definitely"),
        (StructuredOutputs(json={"type": "number"}), "-3.25"),
    ],
)
def test_output_may_continue_past_an_earlier_complete_point(compiler, tokenizer, outputs, text):
    grammar = compiler.compile(outputs)
    matcher = GrammarMatcher(grammar)
    for char in text:  # one character per token, through every intermediate complete state
        assert matcher.accept_token(tokenizer.token_to_id(tokenizer.encode(char).tokens[0]))
    assert matcher.is_final()
    assert matcher.accept_token(grammar.stop_token_ids[0])


def test_the_end_marker_cannot_be_spelled_out_by_real_tokens(compiler, vocabulary, tokenizer):
    grammar = compiler.compile(StructuredOutputs(choice=["done"]))
    matcher = GrammarMatcher(grammar)
    assert matcher.accept_tokens(tokenizer.encode("done").ids)
    # outlines-core itself would let the marker's bytes follow; the mask must not.
    assert set(grammar.index.get_allowed_tokens(matcher.state)) & vocabulary.marker_token_ids
    assert matcher.must_stop()
    assert not any(matcher.accept_token(t) for t in vocabulary.marker_token_ids)


def test_json_object_outputs_parse_as_objects(compiler, tokenizer, random_walk) -> None:
    grammar = compiler.compile(StructuredOutputs(json_object=True))
    for seed in range(3):
        value = json.loads(tokenizer.decode(random_walk(grammar, seed), skip_special_tokens=False))
        assert isinstance(value, dict)


def test_choices_with_regex_metacharacters_match_literally(compiler, tokenizer) -> None:
    choices = ["a.b (c)", "x|y", "1+1=2?", 'say "hi"', "[br]{ac}^$#&-~\\", "tab\there"]
    grammar = compiler.compile(StructuredOutputs(choice=choices))
    for choice in choices:
        matcher = GrammarMatcher(grammar)
        assert matcher.accept_tokens(tokenizer.encode(choice).ids), choice
        assert matcher.must_stop(), choice
    assert not GrammarMatcher(grammar).accept_tokens(tokenizer.encode("aXb (c)").ids)


def test_fill_bitmask_accepts_a_torch_row(yes_no) -> None:
    row = torch.zeros(1, (yes_no.vocab_size + 31) // 32, dtype=torch.int32)
    GrammarMatcher(yes_no).fill_bitmask(row, 0)
    assert np.array_equal(row[0].numpy(), yes_no.mask(yes_no.initial_state))
    with pytest.raises(ValueError):
        GrammarMatcher(yes_no).fill_bitmask(torch.zeros(1, 10, dtype=torch.int32), 0)
