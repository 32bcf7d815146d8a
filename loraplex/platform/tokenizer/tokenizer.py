"""Tokenizer: tokenizer.json through `tokenizers`, the chat template through jinja2."""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer


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
        cfg_path = model_dir / "tokenizer_config.json"
        cfg = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
        self.chat_template: str | None = cfg.get("chat_template")
        template_file = model_dir / "chat_template.jinja"
        if self.chat_template is None and template_file.is_file():
            self.chat_template = template_file.read_text()
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
        self._template: jinja2.Template | None = None

    @property
    def backend(self) -> HFTokenizer:
        return self._tok

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = self._tok.encode(text, add_special_tokens=add_special_tokens).ids
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

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        **kwargs: Any,
    ) -> str:
        if self.chat_template is None:
            raise ValueError("this model has no chat template; use completions instead")
        if self._template is None:
            env = ImmutableSandboxedEnvironment(
                trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
            )
            env.globals["raise_exception"] = _raise_template_error
            env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
            env.filters["tojson"] = lambda x, indent=None, ensure_ascii=False: json.dumps(
                x, indent=indent, ensure_ascii=ensure_ascii
            )
            self._template = env.from_string(self.chat_template)
        return self._template.render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            tools=tools,
            bos_token=self.bos_token or "",
            eos_token=self.eos_token or "",
            **kwargs,
        )

    def encode_chat(self, messages: list[dict[str, Any]], **kwargs: Any) -> list[int]:
        # NOTE: the template writes any BOS itself, so special tokens are not added again.
        return self.encode(self.apply_chat_template(messages, **kwargs), add_special_tokens=False)


def _raise_template_error(message: str) -> None:
    raise ValueError(f"chat template error: {message}")


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
