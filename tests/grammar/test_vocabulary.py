"""The grammar vocabulary: byte-level tokens as bytes, special tokens left out."""

from __future__ import annotations

import pytest

from loraplex.grammar.vocabulary import build_vocabulary


def test_byte_level_tokens_map_to_their_bytes(tokenizer, vocabulary) -> None:
    space_the = tokenizer.token_to_id("Ġthe")
    assert space_the in vocabulary.vocabulary.get(b" the")
    newline = tokenizer.token_to_id("Ċ")
    assert newline in vocabulary.vocabulary.get(b"\n")
    e_acute = tokenizer.encode("é").ids
    assert len(e_acute) == 1 and e_acute[0] in vocabulary.vocabulary.get("é".encode())


def test_special_tokens_are_left_out(tokenizer, vocabulary) -> None:
    assert vocabulary.vocabulary.get(b"<|im_start|>") is None
    assert vocabulary.eos_token_id == tokenizer.token_to_id("<|im_end|>")
    assert vocabulary.vocab_size == tokenizer.get_vocab_size() == 49152


def test_fingerprint_depends_on_tokenizer_and_stops(tokenizer, vocabulary) -> None:
    again = build_vocabulary(tokenizer, list(vocabulary.stop_token_ids))
    other = build_vocabulary(tokenizer, [vocabulary.stop_token_ids[0]])
    assert again.fingerprint == vocabulary.fingerprint
    assert other.fingerprint != vocabulary.fingerprint


def test_bad_stop_ids_are_rejected(tokenizer) -> None:
    with pytest.raises(ValueError):
        build_vocabulary(tokenizer, [])
    with pytest.raises(ValueError):
        build_vocabulary(tokenizer, [10**9])
