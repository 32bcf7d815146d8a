"""LoRA layers: per-slot adapter weights beside each linear layer, applied by slot per token.

Every adapted `Linear` gets a `LoRALayer` as its `lora` hook. It keeps one `LoRAStack` for all
its shards (q/k/v of a merged QKV, gate/up of gate-up, or the single o/down projection), padded
to `max_lora_rank`: `A [max_loras, num_shards * max_rank, in]` (shard `i` in rows
`i * max_rank:`), `B^T [max_loras, max_rank, out]` (shard `i` in its output columns), plus each
shard's and slot's used rank and scaling, so a forward costs two kernel launches per layer.
Mixed ranks: a slot holding a rank-8 adapter copies and computes only its first 8 rows (the
kernels stop at `ranks[shard, slot]`); only the memory is reserved at the maximum, so any slot
can take any adapter and loads never fragment.

DoRA: each layer also keeps a per-slot column scale (`dora_scale [max_loras, out]` fp32, 1.0
for plain LoRA), written when a DoRA adapter is loaded into the slot (see `adapters.dora`), so
every slot can hold a DoRA adapter; it costs 4 bytes per output feature per slot.

One `LoRABatchMeta`, shared by all layers, holds the step's per-token slots in persistent
buffers (stable addresses, so CUDA graphs captured over them replay with new contents).

Tensor parallelism (the S-LoRA / Punica split): beside a column-parallel layer each rank keeps
A whole and the rows of B for its output features; beside a row-parallel layer, the columns of
A for its input features and B whole, so its partial delta joins the layer's partial output in
the layer's one all-reduce.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn

from loraplex.adapters.dora import dora_column_scale, row_sq_norms
from loraplex.adapters.peft_format import (
    SUPPORTED_MODULES,
    BaseModelSpec,
    LoRAModuleWeights,
    LoRAWeights,
)
from loraplex.adapters.saved_modules import SavedModules
from loraplex.adapters.vocab_lora import EmbeddingLoRA, LMHeadLoRA
from loraplex.config import LoRAConfig
from loraplex.kernels.lora import LoRAKernelMeta, LoRAStack, add_lora, fill_kernel_meta

_LAYER_PREFIX = re.compile(r"(?:^|\.)layers\.(\d+)\.(?:self_attn|mlp)\.\w+$")
_MIN_WORKSPACE_ROWS = 2048  # room for a decode batch's split shrink (tokens x splits)


class BaseWeightMethod(Protocol):
    """What DoRA reads of a linear layer's weight method (`quant.base.LinearMethod`; adapters
    and quant never import each other)."""

    def apply(self, layer: object, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor: ...

    def dequantized_weight(self, layer: object) -> torch.Tensor: ...


class LoRATarget(Protocol):
    """What a linear layer exposes to be adapted (see `loraplex.platform.models.linear`)."""

    prefix: str
    input_size: int
    output_sizes: list[int]
    shard_names: tuple[str, ...]
    lora: object
    bias: torch.Tensor | None
    method: BaseWeightMethod  # its `apply` and `dequantized_weight` give DoRA's base norms

    def shard_offsets(self) -> list[int]: ...


def _split_of(target: LoRATarget) -> tuple[str | None, list[tuple[int, int]], tuple[int, int]]:
    """How a (tensor-parallel) target is split: (None | "column" | "row", each shard's output
    range, the input range), ranges as (start, size) within the full projection."""
    shard = getattr(target, "tp_shard", None)
    if shard is None:
        return None, [(0, size) for size in target.output_sizes], (0, target.input_size)
    return shard.kind, list(shard.output_ranges), shard.input_range


class LoRABatchMeta:
    """The current step's per-token adapter slots, set once per step before the forward."""

    def __init__(
        self,
        num_slots: int,
        max_rank: int,
        max_num_tokens: int,
        device: torch.device,
        max_slices: int = 3,
    ) -> None:
        self.num_slots = num_slots
        self.max_num_tokens = max_num_tokens
        self.active = False
        self._slots = torch.full((max_num_tokens,), -1, dtype=torch.int32, device=device)
        self._order = torch.zeros(max_num_tokens, dtype=torch.int32, device=device)
        self._start = torch.zeros(num_slots, dtype=torch.int32, device=device)
        self._count = torch.zeros(num_slots, dtype=torch.int32, device=device)
        # NOTE: shrink output, reused by every layer in turn; rows beyond the step's tokens hold
        # the partial sums of a split reduction, so small batches get spare rows to split into.
        self.workspace = torch.zeros(
            max(max_num_tokens, _MIN_WORKSPACE_ROWS),
            max_slices * max_rank,
            dtype=torch.float32,
            device=device,
        )  # [rows, max_slices * max_rank]
        self.kernel_meta = self._view(0)

    def _view(self, n: int) -> LoRAKernelMeta:
        return LoRAKernelMeta(self._slots[:n], self._order[:n], self._start, self._count)

    def set(
        self, lora_slots: torch.Tensor, *, always_apply: bool = False, staged: bool = False
    ) -> None:
        """Install a step's slots (`[num_tokens]` int32, -1 = base) into the shared buffers.

        A CPU tensor with no adapter token switches the LoRA layers off for the step. During
        CUDA-graph capture pass `always_apply=True`, so the kernels are recorded. Never waits
        for the device: a host tensor is copied asynchronously (a pinned one is cloned first,
        so the caller may reuse it at once, unless `staged`: the caller keeps it unchanged
        until the copy is done, as `LoRASlotWriter` does)."""
        n = lora_slots.shape[0]
        if lora_slots.dim() != 1:
            raise ValueError(f"lora_slots must be 1-D, got shape {tuple(lora_slots.shape)}")
        if n > self.max_num_tokens:
            raise ValueError(f"{n} tokens in a step, LoRA buffers hold {self.max_num_tokens}")
        on_host = lora_slots.device.type == "cpu"
        self.active = always_apply or not on_host or bool((lora_slots >= 0).any())
        if on_host and not staged and lora_slots.is_pinned():
            lora_slots = lora_slots.clone()
        self._slots[:n].copy_(lora_slots.to(torch.int32), non_blocking=True)
        self.kernel_meta = self._view(n)
        self.regroup()

    def regroup(self) -> None:
        """Group the installed slots' tokens by slot for the grouped kernels: one kernel launch
        on fixed buffers with no host synchronisation, so a runner may capture it in a CUDA graph
        (after writing new slots into `kernel_meta.lora_slots` in place) instead of calling
        `set` outside the graph."""
        fill_kernel_meta(self.kernel_meta, self.num_slots)


class LoRALayer:
    """The `LoRAHook` of one linear layer: adds each token's adapter delta into `out`."""

    def __init__(
        self,
        target: LoRATarget,
        layer_index: int,
        meta: LoRABatchMeta,
        max_rank: int,
        device: torch.device,
        dtype: torch.dtype,
    ) -> None:
        self.prefix = target.prefix
        self.target = target
        self.layer_index = layer_index
        self.shard_names = tuple(target.shard_names)
        self.input_size = target.input_size
        self.output_sizes = list(target.output_sizes)
        self.offsets = target.shard_offsets()
        self.split, self.output_ranges, self.input_range = _split_of(target)
        # The full projections' sizes, which adapters are written for.
        self.full_input_size = getattr(target, "full_input_size", target.input_size)
        self.full_output_sizes = list(getattr(target, "full_output_sizes", target.output_sizes))
        self.meta = meta
        slots, shards = meta.num_slots, len(self.shard_names)
        self.weights = LoRAStack(
            a=torch.zeros(slots, shards * max_rank, self.input_size, dtype=dtype, device=device),
            b_t=torch.zeros(slots, max_rank, self.offsets[-1], dtype=dtype, device=device),
            ranks=torch.zeros(shards, slots, dtype=torch.int32, device=device),
            scaling=torch.zeros(shards, slots, dtype=torch.float32, device=device),
            slice_offsets=tuple(self.offsets),
            dora_scale=torch.ones(slots, self.offsets[-1], dtype=torch.float32, device=device),
            base_bias=target.bias,
        )
        self._w_sq: torch.Tensor | None = None  # [out] fp32, the base rows' squared norms

    def __call__(self, x: torch.Tensor, out: torch.Tensor) -> None:
        # x: [num_tokens, in], out: [num_tokens, sum(output_sizes)]
        if self.meta.active:
            add_lora(x, out, self.weights, self.meta.kernel_meta, self.meta.workspace)

    def load_slot(self, slot: int, weights: LoRAWeights) -> None:
        """Copy this layer's modules of `weights` into `slot` (non-blocking from pinned memory);
        shards the adapter does not touch get rank 0."""
        w, max_rank = self.weights, self.weights.max_rank
        for i, name in enumerate(self.shard_names):
            module = weights.modules.get((self.layer_index, name))
            lo, hi = self.offsets[i], self.offsets[i + 1]
            assert w.dora_scale is not None
            w.dora_scale[slot, lo:hi] = 1.0
            if module is None:
                w.ranks[i, slot] = 0
                continue
            r = module.rank
            a, b = module.a, module.b  # [r, in], [out, r]
            if self.split == "column":
                start, size = self.output_ranges[i]
                b = b[start : start + size]
            elif self.split == "row":
                start, size = self.input_range
                a = a[:, start : start + size]
                if module.magnitude is not None:
                    # NOTE: DoRA's norm runs over the whole input dimension, which a
                    # row-parallel rank holds only a slice of.
                    raise ValueError(
                        "DoRA adapters are not served with tensor parallelism (a row-parallel "
                        f"layer, {self.prefix}, holds only part of each norm)"
                    )
            w.a[slot, i * max_rank : i * max_rank + r].copy_(a, non_blocking=True)
            w.b_t[slot, :r, lo:hi].copy_(b.T, non_blocking=True)
            w.ranks[i, slot] = r
            w.scaling[i, slot] = module.scaling
            if module.magnitude is not None:
                w.dora_scale[slot, lo:hi] = self._dora_scale(slot, i, module)

    @torch.no_grad()
    def _dora_scale(self, slot: int, shard: int, module: LoRAModuleWeights) -> torch.Tensor:
        """DoRA's column scale of one shard, from the slot's device copy of A and B (so the
        norm is that of the weights served) and the base layer. [hi - lo] fp32"""
        w, r, max_rank = self.weights, module.rank, self.weights.max_rank
        lo, hi = self.offsets[shard], self.offsets[shard + 1]
        if self._w_sq is None:  # NOTE: once per layer, at its first DoRA load
            self._w_sq = row_sq_norms(self.target.method.dequantized_weight(self.target))
        a = w.a[slot, shard * max_rank : shard * max_rank + r].contiguous()  # [r, in]
        a_w = self.target.method.apply(self.target, a, None)[:, lo:hi]  # [r, hi - lo]
        b = w.b_t[slot, :r, lo:hi].T  # [hi - lo, r]
        assert module.magnitude is not None
        magnitude = module.magnitude.to(w.a.device, non_blocking=True)
        return dora_column_scale(self._w_sq[lo:hi], a_w, a, b, module.scaling, magnitude)


@dataclass(frozen=True)
class LoRAModelState:
    """All LoRA layers of one model and the batch metadata they share; `vocab` holds the
    embedding and lm_head hooks (`adapters.vocab_lora`, `adapters.saved_modules`) where the
    model has them."""

    meta: LoRABatchMeta
    layers: tuple[LoRALayer, ...]
    vocab: tuple[EmbeddingLoRA | LMHeadLoRA | SavedModules, ...] = ()

    @property
    def saved_module_slots(self) -> int:
        """How many slots (the first ones) can hold full embed_tokens / lm_head copies."""
        return sum(h.num_slots for h in self.vocab if isinstance(h, SavedModules))

    def load_slot(self, slot: int, weights: LoRAWeights) -> None:
        """Write an adapter into `slot` of every layer (on the caller's current stream)."""
        for layer in self.layers:
            layer.load_slot(slot, weights)
        for hook in self.vocab:
            hook.load_slot(slot, weights)

    def check_spec(self, spec: BaseModelSpec) -> None:
        """Raise `ValueError` if the attached layers disagree with the adapters' base spec."""
        for layer in self.layers:
            if layer.layer_index >= spec.num_layers:
                raise ValueError(
                    f"{layer.prefix}: layer {layer.layer_index} is beyond the "
                    f"spec's {spec.num_layers} layers"
                )
            for name, out in zip(layer.shard_names, layer.full_output_sizes):
                if spec.module_shape(name) != (layer.full_input_size, out):
                    raise ValueError(
                        f"{layer.prefix}.{name}: shape {(layer.full_input_size, out)} "
                        f"differs from the spec's {spec.module_shape(name)}"
                    )


def attach_lora_layers(
    model: nn.Module,
    lora_config: LoRAConfig,
    device: torch.device | str,
    dtype: torch.dtype,
    max_num_tokens: int = 8192,
) -> LoRAModelState:
    """Give every decoder-layer projection of `model` a `LoRALayer` hook.

    Adapted layers are modules with a `prefix` like `model.layers.3.self_attn.qkv_proj` whose
    `shard_names` are all LoRA-capable projections (q/k/v/o/gate/up/down)."""
    device = torch.device(device)
    targets = []
    for module in model.modules():
        prefix = getattr(module, "prefix", None)
        shards = getattr(module, "shard_names", None)
        if not isinstance(prefix, str) or shards is None or not hasattr(module, "lora"):
            continue
        match = _LAYER_PREFIX.search(prefix)
        if match is not None and set(shards) <= set(SUPPORTED_MODULES):
            targets.append((module, int(match[1])))
    if not targets:
        raise ValueError("attach_lora_layers: the model has no q/k/v/o/gate/up/down projections")
    max_slices = max(len(module.shard_names) for module, _ in targets)
    meta = LoRABatchMeta(
        lora_config.max_loras, lora_config.max_lora_rank, max_num_tokens, device, max_slices
    )
    layers = []
    for module, index in targets:
        layer = LoRALayer(module, index, meta, lora_config.max_lora_rank, device, dtype)
        module.lora = layer
        layers.append(layer)
    return LoRAModelState(meta, tuple(layers), _attach_vocab(model, meta, lora_config, dtype))


def _chain(*stages: Callable[..., None]) -> Callable[..., None]:
    """One hook running `stages` in order (each updates the same output in place)."""

    def run(*args: object) -> None:
        for stage in stages:
            stage(*args)

    return run


def _attach_vocab(
    model: nn.Module, meta: LoRABatchMeta, lora_config: LoRAConfig, dtype: torch.dtype
) -> tuple[EmbeddingLoRA | LMHeadLoRA | SavedModules, ...]:
    """Embedding and lm_head LoRA hooks, for a model with `embed_lora` / `logits_lora` slots;
    with `max_saved_module_loras`, the full copies' stage runs first in each (it replaces what
    the LoRA stage adds to; one adapter never has both on one module)."""
    hooks: list[EmbeddingLoRA | LMHeadLoRA | SavedModules] = []
    rank = lora_config.max_lora_rank
    for attr, weight_name, kind in (
        ("embed_lora", "embed_tokens", EmbeddingLoRA),
        ("logits_lora", "lm_head", LMHeadLoRA),
    ):
        weight = getattr(model, weight_name, None)
        if not hasattr(model, attr) or not isinstance(weight, torch.Tensor):
            continue
        # NOTE: the whole vocabulary, not the weight's rows: a tensor-parallel rank holds a
        # slice of them, while these hooks see global token ids and the gathered logits.
        hidden = weight.shape[1]
        vocab = getattr(getattr(model, "config", None), "vocab_size", weight.shape[0])
        hook = kind(meta, vocab, hidden, rank, dtype, weight.device)
        setattr(model, attr, hook)
        hooks.append(hook)
    if lora_config.max_saved_module_loras and len(hooks) == 2:
        vocab = getattr(getattr(model, "config", None), "vocab_size", model.embed_tokens.shape[0])
        saved = SavedModules(
            meta, lora_config.max_saved_module_loras, model.embed_tokens, model.lm_head, vocab
        )
        model.embed_lora = _chain(saved.embed, hooks[0])
        model.logits_lora = _chain(saved.logits, hooks[1])
        hooks.insert(0, saved)
    return tuple(hooks)
