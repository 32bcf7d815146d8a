"""Tokenizer: tokenizer.json through `tokenizers`, the chat template through jinja2."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as HFTokenizer

from loraplex.platform.tokenizer.chat_template import compile_chat_template, render_chat_template

CHAT_TEMPLATE_FILE = "chat_template.jinja"


def _token_text(value: Any) -> str | None:
    if isinstance(value, dict):
        return value.get("content")
    return value


class Tokenizer:
    """`base`: the tokenizer this one extends (an adapter's own, see
    `adapters.adapter_tokenizer`): its chat template, BOS / EOS tokens and `add_bos_token`
    serve where this folder's tokenizer_config.json does not set them."""

    def __init__(self, model_dir: Path, base: Tokenizer | None = None) -> None:
        model_dir = Path(model_dir)
        path = model_dir / "tokenizer.json"
        if not path.is_file():
            raise ValueError(f"{model_dir} has no tokenizer.json")
        self._tok = HFTokenizer.from_file(str(path))
        cfg = _tokenizer_config(model_dir)
        self.chat_template: str | None = read_chat_template(model_dir)
        self.bos_token = _token_text(cfg.get("bos_token"))
        self.eos_token = _token_text(cfg.get("eos_token"))
        self.add_bos_token = bool(cfg.get("add_bos_token", False))
        if base is not None:
            self.chat_template = self.chat_template or base.chat_template
            self.bos_token = self.bos_token or base.bos_token
            self.eos_token = self.eos_token or base.eos_token
            self.add_bos_token = bool(cfg.get("add_bos_token", base.add_bos_token))
        self.bos_token_id = self._tok.token_to_id(self.bos_token) if self.bos_token else None
        self.eos_token_id = self._tok.token_to_id(self.eos_token) if self.eos_token else None
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)

    @property
    def backend(self) -> HFTokenizer:
        return self._tok

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        # NOTE: encode_batch, not encode: it releases the GIL while it works, so a long text
        # tokenized in a worker thread does not stop the event loop (and every stream) with it.
        ids = self._tok.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
        if (
            add_special_tokens
            and self.add_bos_token
            and self.bos_token_id is not None
            and (not ids or ids[0] != self.bos_token_id)
        ):
            ids = [self.bos_token_id, *ids]
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(token_id)

    def chat_template_context(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        **kwargs: Any,
    ) -> dict[str, Any]:
        """The variables a chat template renders with: the conversation, its tools, the
        special tokens, and the caller's extra `kwargs` (TypeError if one of them would replace
        any of the others)."""
        context = {
            "messages": messages,
            "add_generation_prompt": add_generation_prompt,
            "tools": tools,
            "bos_token": self.bos_token or "",
            "eos_token": self.eos_token or "",
        }
        clash = sorted(set(kwargs) & set(context))
        if clash:
            raise TypeError(f"chat template kwargs may not set {clash}")
        return {**context, **kwargs}

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        **kwargs: Any,
    ) -> str:
        """The conversation through the chat template, in this process (no time limit: the API
        renders tenants' templates in killable processes instead, `ChatTemplateRenderer`)."""
        if self.chat_template is None:
            raise ValueError("this model has no chat template; use completions instead")
        context = self.chat_template_context(messages, add_generation_prompt, tools, **kwargs)
        return render_chat_template(compile_chat_template(self.chat_template), context)

    def encode_chat(self, messages: list[dict[str, Any]], **kwargs: Any) -> list[int]:
        # NOTE: the template writes any BOS itself, so special tokens are not added again.
        return self.encode(self.apply_chat_template(messages, **kwargs), add_special_tokens=False)


def _tokenizer_config(folder: Path) -> dict[str, Any]:
    path = folder / "tokenizer_config.json"
    return json.loads(path.read_text()) if path.is_file() else {}


def read_chat_template(folder: Path) -> str | None:
    """The folder's chat template: tokenizer_config.json's `chat_template` (of a list of named
    templates, the one named "default"), else chat_template.jinja; None if it has neither (or
    the config's is not text)."""
    template = _tokenizer_config(Path(folder)).get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    if not isinstance(template, str) and (Path(folder) / CHAT_TEMPLATE_FILE).is_file():
        template = (Path(folder) / CHAT_TEMPLATE_FILE).read_text()
    return template if isinstance(template, str) else None


class TokenIdsOnlyTokenizer:
    """Stands in for a model without a tokenizer (random-weight benchmarks): prompts must be
    token ids, and outputs carry token ids with empty text."""

    chat_template = None
    bos_token_id = None
    eos_token_id = None
    backend = None

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        raise ValueError("this model has no tokenizer: pass prompts as token ids")

    def encode_chat(self, messages: list[dict[str, Any]], **kwargs: Any) -> list[int]:
        raise ValueError("this model has no tokenizer or chat template")

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return ""


def tokenizer_folder(model_path: Path) -> Path | None:
    """The folder of the model's tokenizer.json, None if it has none."""
    # NOTE: a random-weight model is a bare config file; its tokenizer may sit beside it.
    folder = Path(model_path) if Path(model_path).is_dir() else Path(model_path).parent
    return folder if (folder / "tokenizer.json").is_file() else None


def load_tokenizer(model_path: Path, vocab_size: int) -> Tokenizer | TokenIdsOnlyTokenizer:
    folder = tokenizer_folder(model_path)
    return TokenIdsOnlyTokenizer(vocab_size) if folder is None else Tokenizer(folder)
