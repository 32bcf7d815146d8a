"""Checkpoint loading: safetensors files (sharded with an index) → model parameters.

Generic over architectures: a model class declares `checkpoint_renames` (whole-name renames),
`stacked_shards` (checkpoint projection → merged layer) and `ignored_suffixes`; each `Linear`
loads its own shards. Every parameter must be filled exactly once per shard, and every tensor
in the checkpoint must land somewhere, so a malformed checkpoint fails with a clear message.
Under tensor parallelism the checkpoint is iterated lazily (`CheckpointTensor`), so each rank
reads only its slices.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from loraplex.platform.models.checkpoint_tensor import CheckpointTensor, narrow
from loraplex.platform.models.linear import Linear


def checkpoint_files(model_dir: Path) -> list[Path]:
    """The safetensors files of a checkpoint; never a pickle (.bin / .pt)."""
    model_dir = Path(model_dir)
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        files = sorted({model_dir / f for f in weight_map.values()})
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise ValueError(f"{index.name} names missing files: {missing}")
        return files
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        pickles = [p.name for p in model_dir.glob("*.bin")] + [
            p.name for p in model_dir.glob("*.pt")
        ]
        hint = f" (found {pickles}: pickle checkpoints are not loaded)" if pickles else ""
        raise ValueError(f"no .safetensors files in {model_dir}{hint}")
    return files


def iterate_checkpoint(
    model_dir: Path, lazy: bool = False
) -> Iterator[tuple[str, torch.Tensor | CheckpointTensor]]:
    """Every tensor of the checkpoint, read at once, or (`lazy`) as a `CheckpointTensor` the
    consumer reads in part or whole while the iteration stands on it."""
    for path in checkpoint_files(model_dir):
        try:
            with safe_open(str(path), framework="pt", device="cpu") as f:
                for name in f.keys():  # noqa: SIM118  (safe_open has no __iter__)
                    yield name, CheckpointTensor(f, name) if lazy else f.get_tensor(name)
        except (OSError, RuntimeError) as exc:
            if "safetensors" in type(exc).__module__ or "header" in str(exc).lower():
                raise ValueError(f"{path.name} is not a valid safetensors file: {exc}") from exc
            raise


def _split(name: str) -> tuple[str, str]:
    module, _, param = name.rpartition(".")
    return module, param


def load_named_weights(
    model: nn.Module, weights: Iterable[tuple[str, torch.Tensor | CheckpointTensor]]
) -> None:
    renames: dict[str, str] = getattr(model, "checkpoint_renames", {})
    stacked: dict[str, str] = getattr(model, "stacked_shards", {})
    ignored: tuple[str, ...] = getattr(model, "ignored_suffixes", ())
    tied = getattr(getattr(model, "config", None), "tie_word_embeddings", False)
    loaded: set[tuple[int, int]] = set()

    for ckpt_name, tensor in weights:
        if ckpt_name.endswith(ignored) or (tied and ckpt_name == "lm_head.weight"):
            continue
        if ckpt_name in renames:
            target = renames[ckpt_name]
        else:
            target = ckpt_name.removeprefix("model.")
        module_path, param_name = _split(target)
        parent_path, _, module_name = module_path.rpartition(".")
        shard_name = module_name
        if module_name in stacked:
            module_path = f"{parent_path}.{stacked[module_name]}"
        try:
            module = model.get_submodule(module_path) if module_path else model
            param = getattr(module, param_name)
        except AttributeError:
            raise ValueError(f"unexpected tensor {ckpt_name!r} in the checkpoint") from None
        if not isinstance(param, torch.Tensor):
            raise ValueError(f"unexpected tensor {ckpt_name!r} in the checkpoint")
        if isinstance(module, Linear):
            try:
                shard = module.shard_index(shard_name)
            except KeyError:
                raise ValueError(f"unexpected tensor {ckpt_name!r} in the checkpoint") from None
            try:
                module.weight_loader(param, tensor, shard)
            except ValueError as exc:
                raise ValueError(f"{exc} (checkpoint tensor {ckpt_name})") from None
            loaded.add((id(param), shard))
        else:
            vocab_rows = getattr(param, "vocab_range", None)
            if vocab_rows is not None:
                _load_vocab_rows(ckpt_name, param, tensor, vocab_rows)
                loaded.add((id(param), 0))
                continue
            tensor = narrow(tensor, None, 0, 0)
            if tuple(param.shape) != tuple(tensor.shape):
                raise ValueError(
                    f"tensor {ckpt_name} has shape {tuple(tensor.shape)}, "
                    f"expected {tuple(param.shape)}"
                )
            param.data.copy_(tensor)
            loaded.add((id(param), 0))
    _check_complete(model, loaded, renames)


def _load_vocab_rows(
    name: str,
    param: torch.Tensor,
    tensor: torch.Tensor | CheckpointTensor,
    rows: tuple[int, int],
) -> None:
    """A vocabulary-parallel embedding or LM head: rows [start, start + size) of the full
    [vocab, hidden] tensor; rows past the vocabulary (padding of the last rank) are zero."""
    start, size = rows
    vocab, hidden = tensor.shape
    if (size, hidden) != tuple(param.shape) or start >= vocab:
        raise ValueError(
            f"tensor {name} has shape {tuple(tensor.shape)}, which does not hold rows "
            f"[{start}, {start + size}) of width {param.shape[1]}"
        )
    take = min(size, vocab - start)
    param.data[take:].zero_()
    param.data[:take].copy_(narrow(tensor, 0, start, take))


def _check_complete(model: nn.Module, loaded: set[tuple[int, int]], renames: dict) -> None:
    inverse = {v: k for k, v in renames.items()}
    missing: list[str] = []
    seen: set[int] = set()
    for module_path, module in model.named_modules():
        for param_name, param in module.named_parameters(recurse=False):
            if id(param) in seen or getattr(param, "optional", False):
                continue
            seen.add(id(param))
            if isinstance(module, Linear):
                base = module_path.rpartition(".")[0]
                for shard, shard_name in enumerate(module.shard_names):
                    if (id(param), shard) not in loaded:
                        missing.append(f"model.{base}.{shard_name}.{param_name}")
            elif (id(param), 0) not in loaded:
                full = f"{module_path}.{param_name}" if module_path else param_name
                missing.append(inverse.get(full, f"model.{full}"))
    if missing:
        shown = ", ".join(missing[:5]) + (
            f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        )
        raise ValueError(f"checkpoint is missing tensors: {shown}")
