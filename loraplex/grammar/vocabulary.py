"""The tokenizer's vocabulary as outlines-core sees it: token ids by the bytes they decode to."""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from functools import cache
from importlib.metadata import version
from typing import Any

from outlines_core import Vocabulary
from tokenizers import Tokenizer

from loraplex.grammar.llguidance_compile import llguidance_version

_SENTENCEPIECE_SPACE = "\u2581"
# Unicode noncharacters: candidates for the end marker, which no real token may contain.
_END_MARKERS = ("\uffff", "\ufffe", "\U0010ffff", "\U0010fffe")
_BYTE_FALLBACK = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


@dataclass(frozen=True)
class GrammarVocabulary:
    r"""A tokenizer's vocabulary prepared for grammar compilation.

    vocabulary: outlines-core's `Vocabulary` (normal tokens only; special tokens never match).
    eos_token_id: the id outlines-core allows in final states.
    stop_token_ids: every id that ends a request (EOS first); all are allowed in final states.
    vocab_size: the tokenizer's vocabulary size; masks cover at least this many ids.
    fingerprint: sha256 of the tokenizer and stop ids, part of every grammar cache key.
    end_marker / end_marker_id: a character no token contains, as a virtual token (id
        `vocab_size`) of `vocabulary`. Every grammar is compiled as `(?:regex)<end_marker>`:
        a state is complete exactly when the marker may follow.
    marker_token_ids: real tokens sharing a byte with the marker; only they could spell it
        out, so only they are checked when masks are built (see `CompiledGrammar`).
    tokenizer_json: the tokenizer's JSON, from which the llguidance backend builds its own.

    NOTE: outlines-core 0.2.14 drops every transition from a complete state into an incomplete
    one (regex `[0-9]+(\.[0-9]+)?` cannot continue "12" with "."; choice ["a", "abc"] cannot
    continue "a"). With the marker, no state before it is complete, so nothing is dropped.
    """

    vocabulary: Vocabulary
    eos_token_id: int
    stop_token_ids: tuple[int, ...]
    vocab_size: int
    fingerprint: str
    end_marker: str
    end_marker_id: int
    marker_token_ids: frozenset[int]
    tokenizer_json: str = ""


@cache
def _byte_level_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet: printable stand-in character -> the byte it encodes."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    chars = list(printable)
    shift = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            chars.append(256 + shift)
            shift += 1
    return {chr(char): byte for byte, char in zip(printable, chars)}


def _decoder_types(decoder: dict[str, Any] | None) -> set[str]:
    if decoder is None:
        return set()
    if decoder.get("type") == "Sequence":
        return {d.get("type") for d in decoder.get("decoders", [])}
    return {decoder.get("type")}


def _token_bytes_fn(tokenizer_json: dict[str, Any]):
    """How one token string turns into the bytes it decodes to, for this tokenizer family."""
    decoders = _decoder_types(tokenizer_json.get("decoder"))
    if "ByteLevel" in decoders:
        alphabet = _byte_level_decoder()

        def byte_level(token: str) -> bytes | None:
            if any(ch not in alphabet for ch in token):
                return None
            return bytes(alphabet[ch] for ch in token)

        return byte_level

    def sentencepiece(token: str) -> bytes | None:
        match = _BYTE_FALLBACK.match(token)
        if match:
            return bytes([int(match.group(1), 16)])
        return token.replace(_SENTENCEPIECE_SPACE, " ").encode()

    return sentencepiece


def build_vocabulary(
    tokenizer: Tokenizer, stop_token_ids: list[int] | tuple[int, ...]
) -> GrammarVocabulary:
    """Map every normal token of `tokenizer` to its bytes for outlines-core.

    Special (added) tokens are left out, so no grammar can emit them; `stop_token_ids[0]` is the
    EOS outlines-core allows in final states.
    """
    if not stop_token_ids:
        raise ValueError("build_vocabulary needs at least one stop token id (the EOS)")
    vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
    if any(not 0 <= token_id < vocab_size for token_id in stop_token_ids):
        raise ValueError(f"stop token ids {stop_token_ids} are outside the vocabulary")
    text = tokenizer.to_str()
    to_bytes = _token_bytes_fn(json.loads(text))
    special = set(tokenizer.get_added_tokens_decoder())
    by_bytes: dict[bytes, list[int]] = {}
    for token_id in range(vocab_size):
        if token_id in special or token_id in stop_token_ids:
            continue
        token = tokenizer.id_to_token(token_id)
        data = to_bytes(token) if token is not None else None
        if data:
            by_bytes.setdefault(data, []).append(token_id)
    end_marker = _end_marker(by_bytes)
    marker_bytes = set(end_marker.encode())
    marker_token_ids = frozenset(
        token_id for data, ids in by_bytes.items() if marker_bytes & set(data) for token_id in ids
    )
    by_bytes[end_marker.encode()] = [vocab_size]
    stops = tuple(dict.fromkeys(stop_token_ids))
    digest = hashlib.sha256(text.encode())
    # NOTE: the compilers' versions are part of the key: each stores its own format.
    backends = [version("outlines_core"), llguidance_version()]
    digest.update(json.dumps([stops, end_marker, *backends]).encode())
    return GrammarVocabulary(
        vocabulary=Vocabulary(stops[0], by_bytes),
        eos_token_id=stops[0],
        stop_token_ids=stops,
        vocab_size=vocab_size,
        fingerprint=digest.hexdigest(),
        end_marker=end_marker,
        end_marker_id=vocab_size,
        marker_token_ids=marker_token_ids,
        tokenizer_json=text,
    )


def _end_marker(by_bytes: dict[bytes, list[int]]) -> str:
    for marker in _END_MARKERS:
        encoded = marker.encode()
        if not any(encoded in token for token in by_bytes):
            return marker
    raise ValueError("every end-marker candidate occurs inside some token of this vocabulary")
