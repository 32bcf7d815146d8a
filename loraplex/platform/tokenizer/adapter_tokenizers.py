"""AdapterTokenizers: the tokenizer each request is encoded and decoded with.

A request on an adapter that stores its own tokenizer (`adapters.adapter_tokenizer`, validated
when the adapter was registered) is tokenized, rendered through a chat template (its own, else
the base model's) and detokenized with that tokenizer; every other request with the base
model's. Each process that tokenizes or detokenizes holds one: the Engine (offline `LLM`, the
in-process server, whose API routes share it) and each API process of the EngineCore mode.
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from pathlib import Path

from loraplex.adapters.adapter_tokenizer import TOKENIZER_FILE
from loraplex.adapters.request import LoRARequest
from loraplex.platform.tokenizer.tokenizer import TokenIdsOnlyTokenizer, Tokenizer

#: adapter tokenizers kept loaded (least recently used first out)
MAX_ADAPTER_TOKENIZERS = 64


class AdapterTokenizers:
    """The base tokenizer and the adapters' own, loaded once per adapter version; any thread
    may call `get` (the first call for an adapter reads its tokenizer: call it off the event
    loop and off the step thread where it may be the first)."""

    def __init__(self, base: Tokenizer | TokenIdsOnlyTokenizer) -> None:
        self.base = base
        self._lock = threading.Lock()
        # folder -> (tokenizer.json's mtime and size, its tokenizer)
        self._loaded: OrderedDict[str, tuple[tuple[int, int], Tokenizer]] = OrderedDict()

    @staticmethod
    def has_own(lora_request: LoRARequest | None) -> bool:
        """Whether the request's adapter stores its own tokenizer."""
        if lora_request is None:
            return False
        return os.path.isfile(os.path.join(lora_request.lora_path, TOKENIZER_FILE))

    def get(self, lora_request: LoRARequest | None) -> Tokenizer | TokenIdsOnlyTokenizer:
        """The tokenizer of the request's adapter: its own, else the base model's."""
        if lora_request is None:
            return self.base
        folder = lora_request.lora_path
        try:
            st = os.stat(os.path.join(folder, TOKENIZER_FILE))
        except OSError:
            return self.base
        version = (st.st_mtime_ns, st.st_size)
        with self._lock:
            cached = self._loaded.get(folder)
            if cached is not None and cached[0] == version:
                self._loaded.move_to_end(folder)
                return cached[1]
        base = self.base if isinstance(self.base, Tokenizer) else None
        tokenizer = Tokenizer(Path(folder), base)
        with self._lock:
            self._loaded[folder] = (version, tokenizer)
            self._loaded.move_to_end(folder)
            while len(self._loaded) > MAX_ADAPTER_TOKENIZERS:
                self._loaded.popitem(last=False)
        return tokenizer
