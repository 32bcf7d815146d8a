"""`AdapterNames`: the names one engine serves, each bound to an adapter version (its key).

A name comes in one of two ways, both through `AdapterNames.add` (the manager's one
registration path): an `AddAdapter` command (the API's adapters, and `--lora-modules`), or on
sight of a `LoRARequest` naming a folder (the offline `LLM`). The key of a version is
`key_from_digest` of its content digest, so the same files under two names, or given by path
and by command, are one key: one host-cache entry, one GPU slot, one set of prefix blocks.

Replacing a name binds it to the new key at once; requests already running keep the old key
until they finish. This is not the API's persistent catalog (`adapters.catalog`, `registry`):
it lives and dies with the engine.
"""

from __future__ import annotations

import os
from collections import Counter
from dataclasses import dataclass

from loraplex.adapters.adapter_tokenizer import TOKENIZER_FILES
from loraplex.adapters.errors import AdapterNotFoundError
from loraplex.adapters.peft_format import CONFIG_FILE, WEIGHTS_FILE
from loraplex.adapters.request import LoRARequest
from loraplex.platform.core.commands import AddAdapter

KEY_PREFIX = "lora-"


def key_from_digest(digest: str) -> str:
    """The key of an adapter version: "lora-" and the first 32 hex digits of its sha256
    content digest. Prefix caching hashes KV blocks with it; statistics report it."""
    return KEY_PREFIX + digest[:32]


def folder_fingerprint(path: str) -> tuple[int, ...]:
    """The adapter files' times and sizes (its tokenizer's too; () when the PEFT files are
    missing): a change re-registers an adapter that was registered on sight."""
    try:
        stats = [os.stat(os.path.join(path, f)) for f in (CONFIG_FILE, WEIGHTS_FILE)]
    except OSError:
        return ()
    for name in TOKENIZER_FILES:
        try:
            stats.append(os.stat(os.path.join(path, name)))
        except OSError:
            pass
    return tuple(v for st in stats for v in (st.st_mtime_ns, st.st_size))


@dataclass(frozen=True)
class AdapterEntry:
    """One registered name: its folder, its version's key, and what statistics show."""

    path: str
    key: str
    fingerprint: tuple[int, ...]  # `folder_fingerprint(path)` when it was registered
    on_sight: bool  # registered on sight of a LoRARequest, not by an AddAdapter command
    tenant: str = ""
    label: str = ""


class AdapterNames:
    """Name -> `AdapterEntry`, and key -> folder for the loader."""

    def __init__(self) -> None:
        self._entries: dict[str, AdapterEntry] = {}
        self._names_per_key: Counter[str] = Counter()
        # NOTE: kept after a name moves on: a request queued on the old version may still need
        # it read (it is never dropped; a key is a few dozen bytes).
        self._paths: dict[str, str] = {}
        self._removed: set[str] = set()  # names a RemoveAdapter command took away

    def __len__(self) -> int:
        return len(self._entries)

    def items(self) -> list[tuple[str, AdapterEntry]]:
        return list(self._entries.items())

    def get(self, name: str) -> AdapterEntry | None:
        return self._entries.get(name)

    def resolve(self, request: LoRARequest) -> AdapterEntry | None:
        """The entry that serves the request, or None when its adapter must be registered:
        on first sight, or when an adapter registered on sight was given another folder or its
        files changed. Raises `AdapterNotFoundError` for a name a command removed."""
        entry = self._entries.get(request.lora_name)
        if entry is None:
            if request.lora_name in self._removed:
                raise AdapterNotFoundError(f"The adapter `{request.lora_name}` was removed.")
            return None
        if entry.on_sight and (
            entry.path != request.lora_path
            or entry.fingerprint != folder_fingerprint(request.lora_path)
        ):
            return None
        return entry

    def add(self, command: AddAdapter, key: str, *, on_sight: bool) -> AdapterEntry | None:
        """Bind `command.name` to the version `key` (at `command.path`); returns the entry it
        replaced, if any."""
        old = self._entries.get(command.name)
        if old is not None:
            self._unbind(old.key)
        entry = AdapterEntry(
            command.path, key, folder_fingerprint(command.path), on_sight,
            command.tenant, command.label,
        )  # fmt: skip
        self._entries[command.name] = entry
        self._names_per_key[key] += 1
        self._paths[key] = command.path
        self._removed.discard(command.name)
        return old

    def remove(self, name: str) -> AdapterEntry | None:
        """Unbind `name`; requests naming it later are refused when a command had registered
        it (registered on sight, it is registered again)."""
        entry = self._entries.pop(name, None)
        if entry is None:
            return None
        self._unbind(entry.key)
        if not entry.on_sight:
            self._removed.add(name)
        return entry

    def uses(self, key: str) -> bool:
        """Whether some registered name is bound to the version `key`."""
        return self._names_per_key[key] > 0

    def path_of(self, key: str) -> str | None:
        """The folder the version `key` was registered from (None: never registered)."""
        return self._paths.get(key)

    def _unbind(self, key: str) -> None:
        self._names_per_key[key] -= 1
        if not self._names_per_key[key]:
            del self._names_per_key[key]
