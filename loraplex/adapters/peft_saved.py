"""What PEFT saves of an adapter beyond LoRA on the vocabulary ends: full copies of
`embed_tokens` / `lm_head` (`modules_to_save`) and trained rows of them
(`trainable_token_indices`), checked against the config and the base model's vocabulary.

PEFT's trainable tokens replace rows (its `trainable_tokens_delta` holds the rows' new values,
not differences). On a base with tied embeddings, rows trained on embed_tokens are the rows of
lm_head too, unless the adapter saved lm_head rows of its own (PEFT ties them the same way).

An adapter whose vocabulary is larger than the base model's (a resized embedding, or token ids
past its end) is refused: every row it adds would need a row the base model's embedding, its
lm_head and the tokenizer the requests are encoded with do not have.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from loraplex.adapters.errors import AdapterValidationError
from loraplex.adapters.peft_config import VOCAB_MODULES, PeftLoRAConfig

#: the parts of a vocabulary module's tensors this file reads (see `peft_format._PARTS`)
SAVED_PART = "saved"  # `...embed_tokens.weight` / `...lm_head.weight`: a modules_to_save copy
TOKENS_PART = "tokens"  # `....token_adapter.trainable_tokens_delta`: trained rows


@dataclass(frozen=True)
class TrainedTokens:
    """Rows of embed_tokens or lm_head an adapter trained (`trainable_token_indices`)."""

    indices: torch.Tensor  # [n] int64, token ids
    values: torch.Tensor  # [n, hidden], each row's new value


def _added_tokens(where: Path, what: str, vocab_size: int) -> AdapterValidationError:
    return AdapterValidationError(
        f"{where}: {what}, the base model's vocabulary has {vocab_size} tokens: adapters that add "
        "tokens beyond the base vocabulary are not supported (the base embedding, lm_head and "
        "tokenizer have no rows for them); train new tokens into existing (e.g. reserved) ids "
        "with trainable_token_indices instead"
    )


def vocab_extras(
    where: Path,
    config: PeftLoRAConfig,
    found: dict[tuple[str, str], torch.Tensor],  # (module, SAVED_PART | TOKENS_PART) -> tensor
    vocab_size: int,
    hidden_size: int,
    tied: bool,
    check_values: Callable[[str, str, torch.Tensor], None],
) -> tuple[dict[str, torch.Tensor], dict[str, TrainedTokens]]:
    """The adapter's full module copies ([vocab, hidden] fp32) and trained rows, by module.

    Raises `AdapterValidationError` for a copy or rows the config does not declare (or the
    reverse), a wrong shape, non-finite values, or a vocabulary larger than the base's."""
    saved: dict[str, torch.Tensor] = {}
    tokens: dict[str, TrainedTokens] = {}
    wanted_tokens = config.trainable_tokens
    if (config.modules_to_save or wanted_tokens or found) and not vocab_size:
        raise AdapterValidationError(
            f"{where}: modules_to_save / trainable_token_indices need the base model's "
            "vocabulary size"
        )
    for module in VOCAB_MODULES:
        name = "lm_head" if module == "lm_head" else f"model.{module}"
        copy = found.get((module, SAVED_PART))
        rows = found.get((module, TOKENS_PART))
        if (copy is not None) != (module in config.modules_to_save):
            raise AdapterValidationError(
                f"{where}: {name}.weight "
                + ("is saved, but modules_to_save does not list it" if copy is not None
                   else "is missing, but modules_to_save lists it")
            )  # fmt: skip
        if copy is not None:
            if copy.dim() == 2 and copy.shape[0] > vocab_size:
                raise _added_tokens(
                    where, f"{name}.weight has {copy.shape[0]} rows (a resized vocabulary)",
                    vocab_size,
                )  # fmt: skip
            if tuple(copy.shape) != (vocab_size, hidden_size):
                raise AdapterValidationError(
                    f"{where}: {name}.weight has shape {tuple(copy.shape)}, expected "
                    f"{(vocab_size, hidden_size)} for the base model"
                )
            check_values(name, "weight", copy)
            saved[module] = copy.float().contiguous()
        ids = wanted_tokens.get(module)
        if rows is None and ids is not None and not _tied_to_embedding(module, tied, config):
            raise AdapterValidationError(
                f"{where}: trainable_token_indices lists {module}, but the file has no "
                f"{name}.token_adapter.trainable_tokens_delta"
            )
        if rows is None:
            continue
        if ids is None:
            raise AdapterValidationError(
                f"{where}: {name} has trained token rows, but trainable_token_indices does not "
                "list it"
            )
        if copy is not None:
            raise AdapterValidationError(
                f"{where}: {name} is both in modules_to_save and trainable_token_indices"
            )
        if max(ids) >= vocab_size:
            raise _added_tokens(where, f"trainable_token_indices holds id {max(ids)}", vocab_size)
        if tuple(rows.shape) != (len(ids), hidden_size):
            raise AdapterValidationError(
                f"{where}: {name}.token_adapter.trainable_tokens_delta has shape "
                f"{tuple(rows.shape)}, expected {(len(ids), hidden_size)} (one row per "
                "trainable token)"
            )
        check_values(name, "token_adapter.trainable_tokens_delta", rows)
        tokens[module] = TrainedTokens(torch.tensor(ids), rows.float().contiguous())
    if tied and "embed_tokens" in tokens and "lm_head" not in tokens and "lm_head" not in saved:
        tokens["lm_head"] = tokens["embed_tokens"]  # PEFT ties lm_head to the embedding's rows
    return saved, tokens


def _tied_to_embedding(module: str, tied: bool, config: PeftLoRAConfig) -> bool:
    """lm_head rows PEFT did not save because they are the embedding's (same ids, tied base)."""
    wanted = config.trainable_tokens
    return module == "lm_head" and tied and wanted.get("embed_tokens") == wanted.get("lm_head")
