"""An adapter's own tokenizer: `tokenizer.json` saved beside the PEFT files (as
`tokenizer.save_pretrained(adapter_dir)` writes it after `tokenizer.add_tokens(...)`), with its
`tokenizer_config.json` and `chat_template.jinja` when present.

It is served only if it keeps the base model's meaning of every id: each token the base
tokenizer knows has the same id, no base id is given to another token, the end- and
beginning-of-sequence tokens the engine relies on are the base's, and every id it can produce
has a row in the base embedding (`vocab_size` of the model's config; the base tokenizer may hold
fewer, e.g. a vocabulary padded to a multiple of 64, leaving rows free for new tokens). New
tokens therefore live in rows the base tokenizer never produces, trained with
`trainable_token_indices`. An adapter that needs more rows than the base has is refused
(`peft_saved`): the base embedding, lm_head and slot copies have no room for them.

The files are part of the adapter's content digest (`content_digest`), stored with it, and
loaded by the platform (`AdapterTokenizers`) for the requests that name the adapter.
"""

from __future__ import annotations

import functools
import json
import threading
from collections import OrderedDict
from pathlib import Path

from tokenizers import Tokenizer

from loraplex.adapters.errors import AdapterValidationError

TOKENIZER_FILE = "tokenizer.json"
#: the tokenizer files stored with an adapter, in the order its digest reads them
TOKENIZER_FILES = (TOKENIZER_FILE, "tokenizer_config.json", "chat_template.jinja")
#: how large an adapter's tokenizer_config.json / chat_template.jinja may be
MAX_TOKENIZER_CONFIG_BYTES = 1024 * 1024
#: tokenizers that passed (the adapter's digest, rows, base folder), so that reloading an
#: adapter (after its host copy was evicted) does not compare whole vocabularies again
_PASSED: OrderedDict[tuple[str, int, str], None] = OrderedDict()
_PASSED_LOCK = threading.Lock()
_MAX_PASSED = 256


def tokenizer_files(folder: Path) -> list[tuple[str, bytes]]:
    """The adapter folder's tokenizer files (name, bytes); none without a tokenizer.json (a
    tokenizer_config.json alone is not a tokenizer: the base model's serves the adapter)."""
    if not (folder / TOKENIZER_FILE).is_file():
        return []
    return [(name, (folder / name).read_bytes()) for name in TOKENIZER_FILES
            if (folder / name).is_file()]  # fmt: skip


def check_adapter_tokenizer(
    folder: Path,
    files: list[tuple[str, bytes]],
    vocab_rows: int,
    base_tokenizer: str,
    digest: str,
) -> None:
    """Refuse a tokenizer (`files`, from `tokenizer_files`) that could not serve the adapter on
    the base model: unreadable, an id past the `vocab_rows` embedding rows, or an id whose
    meaning differs from the base tokenizer's in `base_tokenizer` (a folder; "" for a model
    served without a tokenizer: then only the rows are checked). `digest`: the adapter's
    content digest (it covers `files`): an adapter that passed is not checked again."""
    if not files:
        return
    key = (digest, vocab_rows, base_tokenizer)
    with _PASSED_LOCK:
        if key in _PASSED:
            return
    _check(folder, dict(files), vocab_rows, base_tokenizer)
    with _PASSED_LOCK:
        _PASSED[key] = None
        while len(_PASSED) > _MAX_PASSED:
            _PASSED.popitem(last=False)


def _check(folder: Path, contents: dict[str, bytes], vocab_rows: int, base_tokenizer: str) -> None:
    where = folder / TOKENIZER_FILE
    for name in TOKENIZER_FILES[1:]:
        if len(contents.get(name, b"")) > MAX_TOKENIZER_CONFIG_BYTES:
            raise AdapterValidationError(
                f"{folder / name}: over {MAX_TOKENIZER_CONFIG_BYTES} bytes"
            )
    try:
        vocab = Tokenizer.from_str(contents[TOKENIZER_FILE].decode()).get_vocab(True)
    except Exception as error:  # the tokenizers library raises its own Exception kinds
        raise AdapterValidationError(f"{where}: unreadable tokenizer ({error})") from None
    config = _read_config(folder, contents.get("tokenizer_config.json"))
    token, top = max(vocab.items(), key=lambda item: item[1], default=("", -1))
    if top >= vocab_rows:
        raise AdapterValidationError(
            f"{where}: token {token!r} has id {top}, the base model has {vocab_rows} embedding "
            "rows: an adapter's tokens must fit the base vocabulary (add them in unused rows, "
            "trained with trainable_token_indices)"
        )
    if not base_tokenizer:
        return
    base_vocab, base_specials = _base_tokenizer(base_tokenizer)
    by_id = {i: t for t, i in base_vocab.items()}
    for token, i in vocab.items():
        if base_vocab.get(token, i) != i or by_id.get(i, token) != token:
            raise AdapterValidationError(
                f"{where}: token {token!r} has id {i}, the base tokenizer gives "
                + (f"it id {base_vocab[token]}" if token in base_vocab
                   else f"id {i} to {by_id[i]!r}")
                + ": an adapter's tokenizer must keep every base id (add tokens only)"
            )  # fmt: skip
    missing = base_vocab.keys() - vocab.keys()
    if missing:
        raise AdapterValidationError(
            f"{where}: lacks {len(missing)} base tokens (e.g. {min(missing)!r}): an adapter's "
            "tokenizer must keep every base id (add tokens only)"
        )
    for field, base_token in base_specials.items():
        token = _token_text(config.get(field))
        if token is not None and base_token is not None and token != base_token:
            raise AdapterValidationError(
                f"{folder / 'tokenizer_config.json'}: {field} is {token!r}, the base model's is "
                f"{base_token!r}: the engine stops and starts sequences on the base's"
            )


def _read_config(folder: Path, raw: bytes | None) -> dict:
    if raw is None:
        return {}
    try:
        config = json.loads(raw)
    except (ValueError, UnicodeDecodeError, RecursionError) as error:
        raise AdapterValidationError(
            f"{folder / 'tokenizer_config.json'}: not valid JSON ({error})"
        ) from None
    if not isinstance(config, dict):
        raise AdapterValidationError(f"{folder / 'tokenizer_config.json'}: not a JSON object")
    return config


def _token_text(value: object) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


@functools.lru_cache(maxsize=4)
def _base_tokenizer(folder: str) -> tuple[dict[str, int], dict[str, str | None]]:
    """The base tokenizer's vocabulary (with added tokens) and its EOS / BOS tokens."""
    vocab = Tokenizer.from_file(str(Path(folder) / TOKENIZER_FILE)).get_vocab(True)
    path = Path(folder) / "tokenizer_config.json"
    config = json.loads(path.read_text()) if path.is_file() else {}
    return vocab, {f: _token_text(config.get(f)) for f in ("eos_token", "bos_token")}
