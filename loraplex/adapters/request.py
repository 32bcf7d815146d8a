"""`LoRARequest`: which adapter a request runs with."""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass


def _stable_id(name: str) -> int:
    """A positive id derived from the name alone, the same in every process."""
    digest = hashlib.blake2b(name.encode(), digest_size=8).digest()
    return 1 + int.from_bytes(digest, "little") % (2**31 - 2)


@dataclass(frozen=True, init=False)
class LoRARequest:
    """A LoRA adapter for a request: a name, a PEFT folder, and an integer id.

    Accepted forms: `LoRARequest(name, path)`, vLLM's `LoRARequest(name, int_id, path)`, and
    keywords (`lora_name=`, `lora_path=`, `lora_int_id=`). Without an id, one is derived from
    the name, stable across processes.
    """

    lora_name: str
    lora_path: str
    lora_int_id: int

    def __init__(
        self,
        lora_name: str,
        *args: str | int | os.PathLike[str],
        lora_path: str | os.PathLike[str] | None = None,
        lora_int_id: int | None = None,
    ) -> None:
        if len(args) == 1 and lora_path is None:
            lora_path = args[0]  # type: ignore[assignment]
        elif len(args) == 2 and lora_path is None and lora_int_id is None:
            lora_int_id, lora_path = args  # type: ignore[assignment]
        elif args:
            raise TypeError("LoRARequest takes (name, path), (name, int_id, path) or keywords")
        if not isinstance(lora_name, str) or not lora_name:
            raise ValueError(f"lora_name must be a non-empty string, got {lora_name!r}")
        if not isinstance(lora_path, (str, os.PathLike)) or not os.fspath(lora_path):
            raise ValueError(f"lora_path must be a path, got {lora_path!r}")
        if lora_int_id is None:
            lora_int_id = _stable_id(lora_name)
        if isinstance(lora_int_id, bool) or not isinstance(lora_int_id, int) or lora_int_id < 1:
            raise ValueError(f"lora_int_id must be a positive integer, got {lora_int_id!r}")
        object.__setattr__(self, "lora_name", lora_name)
        object.__setattr__(self, "lora_path", os.fspath(lora_path))
        object.__setattr__(self, "lora_int_id", lora_int_id)
