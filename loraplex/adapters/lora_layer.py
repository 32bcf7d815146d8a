"""LoRA layers: per-slot adapter weights beside each linear layer, applied by slot per token.

Every adapted `Linear` gets a `LoRALayer` as its `lora` hook. It keeps one `LoRAStack` for all
its shards (q/k/v of a merged QKV, gate/up of gate-up, or the single o/down projection), padded
to `max_lora_rank`: `A [max_loras, num_shards * max_rank, in]` (shard `i` in rows
`i * max_rank:`), `B^T [max_loras, max_rank, out]` (shard `i` in its output columns), plus each
shard's and slot's used rank and scaling, so a forward costs one kernel launch per layer for
a decode batch and two (shrink, expand) for larger ones. Mixed ranks: a slot holding a rank-8 adapter computes
only its first 8 rows (the kernels stop at `ranks[shard, slot]`); only the memory is reserved
at the maximum, so any slot can take any adapter and loads never fragment.

These tensors are views into the model's one `SlotMemory` (`adapters.slot_memory`), slot-major:
an adapter is staged once into a host image laid out as a slot (`LoRAModelState.stage`, the
loader thread's work) and written into a slot with three device operations
(`LoRAModelState.write_slot`), whatever the number of layers.

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
from dataclasses import dataclass, replace
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
from loraplex.adapters.slot_memory import SlotImage, SlotMemory, SlotShapes
from loraplex.adapters.vocab_lora import EmbeddingLoRA, LMHeadLoRA
from loraplex.config import LoRAConfig
from loraplex.kernels.lora import (
    DEFAULT_KERNEL_CONFIG,
    LoRAKernelConfig,
    LoRAKernelMeta,
    LoRAStack,
    add_lora,
    expand_lora,
    fill_kernel_meta,
    fused_gemv_lora,
    new_counters,
    shrink_lora,
)

_LAYER_PREFIX = re.compile(r"(?:^|\.)layers\.(\d+)\.(?:self_attn|mlp)\.\w+$")
_MIN_WORKSPACE_ROWS = 4096  # room for a small batch's split shrink (tokens x splits)


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
        # NOTE: the one-launch decode kernel's arrival counters, zero between launches; the
        # LoRA layers of a forward run one after another on one stream, so they share them.
        self.counters = new_counters(device)  # [SYNC_COUNTERS] int32
        # NOTE: the fused GEMVs' counters, one per layer (`fused_counters`), zeroed every step
        self._fused_counts = torch.zeros(0, dtype=torch.int32, device=device)
        # NOTE: where the layers' shrinks run beside the base products (`LoRALayer.begin`); one
        # for all, as the layers run one after another, so they share the workspace too
        self.side_stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.kernel_meta = self._view(0)

    def fused_counters(self, n: int) -> list[torch.Tensor]:
        """`n` counters (`[1]` int32 each), one per layer's fused GEMV, replacing any handed out
        before: each `set` zeroes them all in one fill, so a forward may use each once a step."""
        self._fused_counts = torch.zeros(n, dtype=torch.int32, device=self._fused_counts.device)
        return [self._fused_counts[i : i + 1] for i in range(n)]

    def _view(self, n: int, num_adapters: int | None = None) -> LoRAKernelMeta:
        return LoRAKernelMeta(
            self._slots[:n], self._order[:n], self._start, self._count, num_adapters
        )

    def set(
        self,
        lora_slots: torch.Tensor,
        *,
        always_apply: bool = False,
        staged: bool = False,
        num_adapters: int | None = None,
    ) -> None:
        """Install a step's slots (`[num_tokens]` int32, -1 = base) into the shared buffers.

        A CPU tensor with no adapter token switches the LoRA layers off for the step. During
        CUDA-graph capture pass `always_apply=True`, so the kernels are recorded. Never waits
        for the device: a host tensor is copied asynchronously (a pinned one is cloned first,
        so the caller may reuse it at once, unless `staged`: the caller keeps it unchanged
        until the copy is done, as `LoRASlotWriter` does). `num_adapters`: the most distinct
        adapters the step holds, where the caller knows it (it picks the kernels' regime)."""
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
        self.kernel_meta = self._view(n, num_adapters)
        if self.active:
            self._fused_counts.zero_()
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
        memory: SlotMemory | None = None,
    ) -> None:
        """`memory`: the model's shared slot memory, sized with `slot_shapes` of every hook in
        construction order; None gives the layer slot memory of its own."""
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
        shapes = self.slot_shapes(target, max_rank)
        if memory is None:
            memory = SlotMemory(meta.num_slots, [shapes], dtype, device)
        self.region = memory.take(shapes)
        a, b_t = self.region.weights
        assert self.region.dora is not None
        self.weights = LoRAStack(
            a=a,  # [slots, shards * max_rank, in]
            b_t=b_t,  # [slots, max_rank, out]
            ranks=self.region.ranks,
            scaling=self.region.scaling,
            slice_offsets=tuple(self.offsets),
            dora_scale=self.region.dora,
            base_bias=target.bias,
        )
        self._w_sq: torch.Tensor | None = None  # [out] fp32, the base rows' squared norms
        # NOTE: this layer's counter for the fused GEMV (`LoRABatchMeta.fused_counters`); None
        # keeps the layer on the separate kernels
        self.fused_counter: torch.Tensor | None = None
        self._splits: int | None = None  # a shrink `begin` started, until the call joins it

    @staticmethod
    def slot_shapes(target: LoRATarget, max_rank: int) -> SlotShapes:
        """What a layer over `target` keeps per slot."""
        shards, out = len(target.shard_names), target.shard_offsets()[-1]
        return SlotShapes(((shards * max_rank, target.input_size), (max_rank, out)), shards, out)

    def begin(self, x: torch.Tensor) -> None:
        """Before the base product of `x` (`[num_tokens, in]`): where the step's LoRA is two
        launches on CUDA, start the shrink on the batch's side stream, so it runs beside the base
        GEMM (it reads only `x`); the call that follows the product joins it and expands."""
        meta = self.meta
        side = meta.side_stream
        self._splits = None
        if side is None or not meta.active or not x.is_cuda:
            return
        if not DEFAULT_KERNEL_CONFIG.overlaps(x.shape[0], has_counters=True):
            return
        # NOTE: the side stream waits for `x` and for the last layer's expand, which read the
        # workspace this shrink overwrites
        side.wait_stream(torch.cuda.current_stream(x.device))
        with torch.cuda.stream(side):
            self._splits = shrink_lora(x, self.weights, meta.kernel_meta, meta.workspace)

    def __call__(self, x: torch.Tensor, out: torch.Tensor) -> None:
        # x: [num_tokens, in], out: [num_tokens, sum(output_sizes)]
        meta = self.meta
        if self._splits is not None:
            splits, self._splits = self._splits, None
            assert meta.side_stream is not None
            torch.cuda.current_stream(out.device).wait_stream(meta.side_stream)
            expand_lora(meta.workspace, splits, out, self.weights, meta.kernel_meta)
        elif meta.active:
            add_lora(x, out, self.weights, meta.kernel_meta, meta.workspace, counters=meta.counters)

    def fused(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor | None:
        """One token through a plain weight on CUDA: the base GEMV with the delta in one launch
        (`fused_gemv_lora`); None otherwise, or when no adapter is in the batch."""
        if (
            x.shape[0] != 1
            or not self.meta.active
            or self.fused_counter is None
            or getattr(layer.method, "name", None) != "unquantized"
        ):
            return None
        weight = getattr(layer, "weight", None)  # NOTE: none where a CPU fp32 one is held packed
        if weight is None:
            return None
        meta = self.meta
        return fused_gemv_lora(x, weight, layer.bias, self.weights, meta.kernel_meta,
                               meta.workspace, self.fused_counter)  # fmt: skip

    def stage(self, image: SlotImage, weights: LoRAWeights) -> None:
        """Write this layer's modules of `weights` into its part of a host slot image (any
        thread); shards the adapter does not touch keep rank 0."""
        a_img, b_img = self.region.host_weights(image)  # [shards * R, in], [R, out]
        ranks, scaling = self.region.host_params(image)  # [shards] int32, [shards] fp32
        max_rank = self.weights.max_rank
        for i, name in enumerate(self.shard_names):
            module = weights.modules.get((self.layer_index, name))
            if module is None:
                continue
            r, (lo, hi) = module.rank, (self.offsets[i], self.offsets[i + 1])
            a, b = self._shard_weights(i, module)  # [r, in], [out, r]
            a_img[i * max_rank : i * max_rank + r].copy_(a)
            b_img[:r, lo:hi].copy_(b.T)
            ranks[i] = r
            scaling[i] = module.scaling

    def _shard_weights(
        self, shard: int, module: LoRAModuleWeights
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's part of a module's A [r, in] and B [out, r] (tensor parallelism)."""
        a, b = module.a, module.b
        if self.split == "column":
            start, size = self.output_ranges[shard]
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
        return a, b

    def write_dora(self, slot: int, weights: LoRAWeights) -> None:
        """After the slot's copy (same stream): the column scales of the adapter's DoRA modules."""
        assert self.weights.dora_scale is not None
        for i, name in enumerate(self.shard_names):
            module = weights.modules.get((self.layer_index, name))
            if module is not None and module.magnitude is not None:
                lo, hi = self.offsets[i], self.offsets[i + 1]
                self.weights.dora_scale[slot, lo:hi] = self._dora_scale(slot, i, module)

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
    memory: SlotMemory
    layers: tuple[LoRALayer, ...]
    vocab: tuple[EmbeddingLoRA | LMHeadLoRA | SavedModules, ...] = ()

    @property
    def saved_module_slots(self) -> int:
        """How many slots (the first ones) can hold full embed_tokens / lm_head copies."""
        return sum(h.num_slots for h in self.vocab if isinstance(h, SavedModules))

    def stage(self, weights: LoRAWeights, *, pin_memory: bool = False) -> SlotImage:
        """The adapter as a host image of one slot (the loader thread's work: reads and writes
        host memory only). Raises `ValueError` for an adapter these layers cannot serve."""
        image = self.memory.new_image(weights.path, weights.digest, pin_memory=pin_memory)
        for layer in self.layers:
            layer.stage(image, weights)
        for hook in self.vocab:
            if not isinstance(hook, SavedModules):  # its copies are extras, not in the image
                hook.stage(image, weights)
        # NOTE: DoRA's column scales are computed from the slot's device copy, so the image
        # keeps only each DoRA module's rank, scaling and magnitude (no second copy of A, B).
        # Module copies and trained rows go along in the model dtype (pinned: one buffer).
        copies = LoRAWeights(weights.path, weights.digest, {}, weights.saved, weights.tokens)
        if copies.needs_saved_module_slot:
            copies = copies.to(self.memory.dtype, pin_memory=pin_memory)
        dora = {
            key: LoRAModuleWeights(
                torch.empty(m.rank, 0), torch.empty(0, m.rank), m.scaling, m.magnitude.clone()
            )
            for key, m in weights.modules.items()
            if m.magnitude is not None
        }
        if dora or copies.needs_saved_module_slot:
            extras = LoRAWeights(weights.path, weights.digest, dora, copies.saved, copies.tokens)
            image = replace(image, extras=extras)
        return image

    def write_slot(self, slot: int, image: SlotImage) -> None:
        """Copy a staged adapter into `slot` of every layer, on the caller's current stream:
        three device operations (plus the column scales of DoRA modules, computed on the
        device, and the slot's embed_tokens / lm_head copies where the model has them)."""
        self.memory.write(slot, image)
        if image.extras is not None:
            for layer in self.layers:
                layer.write_dora(slot, image.extras)
        extras = image.extras or LoRAWeights(image.path, image.digest, {})
        for hook in self.vocab:
            if isinstance(hook, SavedModules):  # on every write: it also marks copy-less slots
                hook.load_slot(slot, extras)

    def load_slot(self, slot: int, weights: LoRAWeights) -> None:
        """`stage`, then `write_slot`, on the calling thread."""
        self.write_slot(slot, self.stage(weights))

    @torch.no_grad()
    def warm_up(self, config: LoRAKernelConfig = DEFAULT_KERNEL_CONFIG) -> int:
        """Run every decoder LoRA layer and the embedding hook once at a token count of each
        kernel regime (within the buffers, on scratch inputs and outputs), so that no step
        compiles a LoRA kernel mid-run: CUDA-graph capture meets the decode sizes, this the
        eager prefill sizes. Leaves the layers off until the next step's slots; returns the
        number of hook calls."""
        meta = self.meta
        device = meta.workspace.device
        counts = {1, config.decode_max_tokens + 1, config.token_kernels_max_tokens + 1}
        embeds = [h for h in self.vocab if isinstance(h, EmbeddingLoRA)]
        calls = 0
        for n in sorted(c for c in counts if 0 < c <= meta.max_num_tokens):
            meta.set(torch.zeros(n, dtype=torch.int32, device=device))
            scratch: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
            for layer in self.layers:
                shape = (layer.input_size, layer.offsets[-1])
                if shape not in scratch:
                    dtype = layer.weights.a.dtype
                    scratch[shape] = (
                        torch.zeros(n, shape[0], dtype=dtype, device=device),
                        torch.zeros(n, shape[1], dtype=dtype, device=device),
                    )
                layer(*scratch[shape])
                calls += 1
            for hook in embeds:
                hidden = torch.zeros(n, hook.weights.b_t.shape[2], dtype=hook.weights.a.dtype,
                                     device=device)  # fmt: skip
                hook(torch.zeros(n, dtype=torch.long, device=device), hidden)
                calls += 1
        meta.active = False
        return calls

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
    rank = lora_config.max_lora_rank
    meta = LoRABatchMeta(lora_config.max_loras, rank, max_num_tokens, device, max_slices)
    vocab = _vocab_hooks(model)
    shapes = [LoRALayer.slot_shapes(module, rank) for module, _ in targets]
    shapes += [kind.slot_shapes(size, hidden, rank) for _, kind, size, hidden in vocab]
    memory = SlotMemory(meta.num_slots, shapes, dtype, device)
    layers = []
    for (module, index), counter in zip(targets, meta.fused_counters(len(targets))):
        layer = LoRALayer(module, index, meta, rank, device, dtype, memory)
        layer.fused_counter = counter
        module.lora = layer
        layers.append(layer)
    hooks: list[EmbeddingLoRA | LMHeadLoRA | SavedModules] = []
    for attr, kind, size, hidden in vocab:
        hook = kind(meta, size, hidden, rank, dtype, device, memory)
        setattr(model, attr, hook)
        hooks.append(hook)
    if lora_config.max_saved_module_loras and len(hooks) == 2:
        hooks.insert(0, _attach_saved_modules(model, meta, lora_config.max_saved_module_loras))
    return LoRAModelState(meta, memory, tuple(layers), tuple(hooks))


def _chain(*stages: Callable[..., None]) -> Callable[..., None]:
    """One hook running `stages` in order (each updates the same output in place)."""

    def run(*args: object) -> None:
        for stage in stages:
            stage(*args)

    return run


def _attach_saved_modules(model: nn.Module, meta: LoRABatchMeta, num_slots: int) -> SavedModules:
    """The full embed_tokens / lm_head copies' stage, run first in each vocabulary hook (it
    replaces what the LoRA stage adds to; one adapter never has both on one module). It keeps
    its own buffers, outside the slot memory: `LoRAModelState.write_slot` writes them."""
    vocab = getattr(getattr(model, "config", None), "vocab_size", model.embed_tokens.shape[0])
    saved = SavedModules(meta, num_slots, model.embed_tokens, model.lm_head, vocab)
    model.embed_lora = _chain(saved.embed, model.embed_lora)
    model.logits_lora = _chain(saved.logits, model.logits_lora)
    return saved


def _vocab_hooks(model: nn.Module) -> list[tuple[str, type[EmbeddingLoRA | LMHeadLoRA], int, int]]:
    """(attribute, hook class, vocabulary size, hidden size) of the embedding and lm_head LoRA
    hooks, for a model with `embed_lora` / `logits_lora` slots."""
    hooks: list[tuple[str, type[EmbeddingLoRA | LMHeadLoRA], int, int]] = []
    for attr, weight_name, kind in (
        ("embed_lora", "embed_tokens", EmbeddingLoRA),
        ("logits_lora", "lm_head", LMHeadLoRA),
    ):
        weight = getattr(model, weight_name, None)
        if not hasattr(model, attr) or not isinstance(weight, torch.Tensor):
            continue
        # NOTE: the whole vocabulary, not the weight's rows: a tensor-parallel rank holds a
        # slice of them, while these hooks see global token ids and the gathered logits.
        vocab = getattr(getattr(model, "config", None), "vocab_size", weight.shape[0])
        hooks.append((attr, kind, vocab, weight.shape[1]))
    return hooks
