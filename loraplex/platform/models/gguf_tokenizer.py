"""Rebuild a Hugging Face `tokenizer.json` from the tokenizer stored inside a GGUF file.

llama.cpp keeps a byte-level BPE tokenizer as three arrays (tokens, token types, merges) plus a
pre-tokenizer name. This module turns them back into a `tokenizers.Tokenizer` that encodes text
exactly as the model's original Hugging Face tokenizer did.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gguf import GGUFReader
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

# NOTE: llama.cpp's token types; control tokens (<|im_start|>, <|endoftext|>, ...) are the ones
# Hugging Face lists as special added tokens.
_TOKEN_TYPE_CONTROL = 3
_TOKEN_TYPE_USER_DEFINED = 4

# GGUF pre-tokenizer names whose original Hugging Face tokenizer splits every digit on its own
# before the GPT-2 byte-level regex (the StarCoder family, which SmolLM2 inherits).
_DIGIT_SPLITTING_PRE = frozenset({"smollm", "starcoder", "refact"})
_GPT2_PRE = frozenset({"default", "gpt-2", "gpt2"})


@dataclass(frozen=True)
class GGUFTokenizerInfo:
    """What `tokenizer_config.json` needs besides the tokenizer itself."""

    bos_token: str
    eos_token: str
    unk_token: str | None
    pad_token: str | None
    add_bos_token: bool
    chat_template: str | None


def gguf_field(reader: GGUFReader, key: str, default: Any = None) -> Any:
    """The decoded value of metadata `key`, or `default` when the file lacks it."""
    field = reader.get_field(key)
    return default if field is None else field.contents()


def _pre_tokenizer(pre: str) -> pre_tokenizers.PreTokenizer:
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in _DIGIT_SPLITTING_PRE:
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    if pre in _GPT2_PRE:
        return byte_level
    raise ValueError(
        f"GGUF pre-tokenizer {pre!r} is not supported; known: "
        f"{sorted(_DIGIT_SPLITTING_PRE | _GPT2_PRE)}"
    )


def build_tokenizer(reader: GGUFReader) -> Tokenizer:
    """A byte-level BPE `Tokenizer` equivalent to the one the GGUF file describes."""
    kind = gguf_field(reader, "tokenizer.ggml.model")
    if kind != "gpt2":
        raise ValueError(
            f"only byte-level BPE ('gpt2') GGUF tokenizers are supported, got {kind!r}"
        )
    tokens: list[str] = gguf_field(reader, "tokenizer.ggml.tokens")
    token_types: list[int] = gguf_field(reader, "tokenizer.ggml.token_type", [1] * len(tokens))
    merges: list[str] = gguf_field(reader, "tokenizer.ggml.merges", [])

    vocab = {token: token_id for token_id, token in enumerate(tokens)}
    merge_pairs = [tuple(merge.split(" ", 1)) for merge in merges]
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merge_pairs, fuse_unk=False))
    tokenizer.pre_tokenizer = _pre_tokenizer(gguf_field(reader, "tokenizer.ggml.pre", "default"))
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)

    special = [
        AddedToken(token, special=True, normalized=False)
        for token, kind in zip(tokens, token_types)
        if kind == _TOKEN_TYPE_CONTROL
    ]
    user = [
        AddedToken(token, special=False, normalized=False)
        for token, kind in zip(tokens, token_types)
        if kind == _TOKEN_TYPE_USER_DEFINED
    ]
    tokenizer.add_special_tokens(special)
    tokenizer.add_tokens(user)
    return tokenizer


def tokenizer_info(reader: GGUFReader) -> GGUFTokenizerInfo:
    """Special tokens, BOS policy and chat template from the GGUF metadata."""
    tokens: list[str] = gguf_field(reader, "tokenizer.ggml.tokens")

    def token(key: str) -> str | None:
        token_id = gguf_field(reader, f"tokenizer.ggml.{key}_token_id")
        return None if token_id is None else tokens[int(token_id)]

    bos, eos = token("bos"), token("eos")
    if bos is None or eos is None:
        raise ValueError("GGUF tokenizer lacks a bos or eos token id")
    return GGUFTokenizerInfo(
        bos_token=bos,
        eos_token=eos,
        unk_token=token("unknown"),
        pad_token=token("padding"),
        add_bos_token=bool(gguf_field(reader, "tokenizer.ggml.add_bos_token", False)),
        chat_template=gguf_field(reader, "tokenizer.chat_template"),
    )
