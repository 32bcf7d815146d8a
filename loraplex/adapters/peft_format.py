"""PEFT LoRA adapters on disk: load `adapter_config.json` + `adapter_model.safetensors`, refuse
what we cannot serve faithfully, and validate the weights against the base model.

Nothing is ever unpickled: a folder holding only `adapter_model.bin` (or any `.pt`/`.pth`/`.pkl`)
is refused by its file name, before a byte of it is read.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load as load_safetensors

from loraplex.adapters.adapter_tokenizer import check_adapter_tokenizer, tokenizer_files
from loraplex.adapters.errors import AdapterValidationError
from loraplex.adapters.peft_config import PeftLoRAConfig, parse_peft_config
from loraplex.adapters.peft_saved import SAVED_PART, TOKENS_PART, TrainedTokens, vocab_extras

__all__ = [
    "CONFIG_FILE",
    "WEIGHTS_FILE",
    "AdapterValidationError",
    "content_digest",
    "BaseModelSpec",
    "LoRAModuleWeights",
    "LoRAWeights",
    "load_peft_adapter",
]

logger = logging.getLogger(__name__)

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt")

#: PEFT module name -> which part of the decoder layer it lives in.
SUPPORTED_MODULES = {
    "q_proj": "self_attn",
    "k_proj": "self_attn",
    "v_proj": "self_attn",
    "o_proj": "self_attn",
    "gate_proj": "mlp",
    "up_proj": "mlp",
    "down_proj": "mlp",
}

#: Model-level modules PEFT adapts beyond the decoder layers (key layer index: `MODEL_LAYER`).
MODEL_MODULES = ("embed_tokens", "lm_head")
#: the layer index of `embed_tokens` / `lm_head` in `LoRAWeights.modules`
MODEL_LAYER = -1
EMBED_KEY = (MODEL_LAYER, "embed_tokens")
LM_HEAD_KEY = (MODEL_LAYER, "lm_head")

_LAYER_KEY = re.compile(
    r"^base_model\.model\.model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\."
    r"(lora_A\.weight|lora_B\.weight|lora_magnitude_vector(?:\.weight)?)$"
)
_EXTRAS = r"|weight|token_adapter\.trainable_tokens_delta"  # modules_to_save, trained rows
_MODEL_KEY = re.compile(
    r"^base_model\.model\.(?:model\.(embed_tokens)\.(lora_embedding_A|lora_embedding_B"
    r"|base_layer\.weight|lora_magnitude_vector(?:\.weight)?" + _EXTRAS + r")|(lm_head)\."
    r"(lora_A\.weight|lora_B\.weight|base_layer\.weight|lora_magnitude_vector(?:\.weight)?"
    + _EXTRAS
    + r"))$"
)
#: a tensor name's suffix -> its part of a module: A, B, the DoRA magnitude, a saved base copy
_PARTS = {"lora_A.weight": "A", "lora_embedding_A": "A", "lora_B.weight": "B",
          "lora_embedding_B": "B", "lora_magnitude_vector": "M",
          "lora_magnitude_vector.weight": "M", "base_layer.weight": "base",
          "weight": SAVED_PART, "token_adapter.trainable_tokens_delta": TOKENS_PART}  # fmt: skip


@dataclass(frozen=True)
class BaseModelSpec:
    """What an adapter must fit: the base model's architecture and projection sizes."""

    architecture: str  # e.g. "LlamaForCausalLM"
    num_layers: int
    hidden_size: int
    intermediate_size: int
    q_size: int  # num_attention_heads * head_dim
    kv_size: int  # num_key_value_heads * head_dim
    name_or_path: str | None = None
    vocab_size: int = 0  # 0: unknown (embed_tokens / lm_head adapters are then refused)
    tie_word_embeddings: bool = False

    @classmethod
    def from_hf_config(
        cls, config: dict[str, Any], name_or_path: str | None = None
    ) -> BaseModelSpec:
        """Build from a Hugging Face `config.json` dict (Llama family)."""
        heads = config["num_attention_heads"]
        head_dim = config.get("head_dim") or config["hidden_size"] // heads
        archs = config.get("architectures") or ["LlamaForCausalLM"]
        return cls(
            architecture=archs[0],
            num_layers=config["num_hidden_layers"],
            hidden_size=config["hidden_size"],
            intermediate_size=config["intermediate_size"],
            q_size=heads * head_dim,
            kv_size=config.get("num_key_value_heads", heads) * head_dim,
            name_or_path=name_or_path,
            vocab_size=config.get("vocab_size", 0),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        )

    def module_shape(self, module: str) -> tuple[int, int]:
        """(in_features, out_features) of a supported projection, or of `embed_tokens`
        (in = the vocabulary: A is `[rank, vocab]`) and `lm_head`."""
        h, i, q, kv = self.hidden_size, self.intermediate_size, self.q_size, self.kv_size
        shapes = {
            "embed_tokens": (self.vocab_size, h),
            "lm_head": (h, self.vocab_size),
            "q_proj": (h, q),
            "k_proj": (h, kv),
            "v_proj": (h, kv),
            "o_proj": (q, h),
            "gate_proj": (h, i),
            "up_proj": (h, i),
            "down_proj": (i, h),
        }
        return shapes[module]


@dataclass(frozen=True)
class LoRAModuleWeights:
    """One adapted module: delta = scaling * x @ a^T @ b^T (for `embed_tokens`, x is the
    token's one-hot row, so the delta is `scaling * a[:, token] @ b^T`).

    With DoRA, `magnitude` is PEFT's `lora_magnitude_vector`: the projection's output becomes
    `magnitude / ||W + scaling * b @ a||_row * (x @ W^T + delta)` (plus the base bias), the
    norm of each output feature's row of the adapted weight."""

    a: torch.Tensor  # [rank, in_features]
    b: torch.Tensor  # [out_features, rank]
    scaling: float
    magnitude: torch.Tensor | None = None  # [out_features], DoRA only

    @property
    def rank(self) -> int:
        return self.a.shape[0]


@dataclass(frozen=True)
class LoRAWeights:
    """A validated adapter: its projections keyed by (layer index, PEFT module name), and its
    full copies (`modules_to_save`) and trained rows (`trainable_token_indices`) of
    embed_tokens / lm_head, by module name."""

    path: str
    digest: str  # sha256 of adapter_config.json, adapter_model.safetensors and its tokenizer
    modules: dict[tuple[int, str], LoRAModuleWeights]
    saved: dict[str, torch.Tensor] = field(default_factory=dict)  # module -> [vocab, hidden]
    tokens: dict[str, TrainedTokens] = field(default_factory=dict)

    @property
    def needs_saved_module_slot(self) -> bool:
        """Whether serving it needs a slot with full embed_tokens / lm_head copies."""
        return bool(self.saved or self.tokens)

    @property
    def rank(self) -> int:
        """The largest rank of any module."""
        return max(m.rank for m in self.modules.values())

    @property
    def nbytes(self) -> int:
        lora = sum(m.a.nbytes + m.b.nbytes + _nbytes(m.magnitude) for m in self.modules.values())
        extras = sum(t.values.nbytes + t.indices.nbytes for t in self._distinct_tokens())
        return lora + extras + sum(w.nbytes for w in self.saved.values())

    def to(self, dtype: torch.dtype, *, pin_memory: bool = False) -> LoRAWeights:
        """A copy in `dtype`, optionally in page-locked host memory, staged for slot copies.

        Every tensor is a view into one buffer: pinning an 8B-shape adapter is then one
        page-locked allocation, not one per tensor (hundreds, each slow to pin while the device
        is busy). NOTE: each `b` comes back as the transpose of a contiguous [rank, out] tensor,
        so the slot pool copies B^T to the device in one contiguous transfer."""
        total = sum(m.a.numel() + m.b.numel() + _numel(m.magnitude) for m in self.modules.values())
        total += sum(w.numel() for w in self.saved.values())
        total += sum(t.values.numel() for t in self._distinct_tokens())
        flat = torch.empty(total, dtype=dtype, pin_memory=pin_memory)  # [total]
        offset = 0

        def place(x: torch.Tensor) -> torch.Tensor:
            nonlocal offset
            view = flat[offset : offset + x.numel()].view(x.shape)
            view.copy_(x)
            offset += x.numel()
            return view

        modules = {
            k: LoRAModuleWeights(
                place(m.a),
                place(m.b.T).T,
                m.scaling,
                None if m.magnitude is None else place(m.magnitude),
            )
            for k, m in self.modules.items()
        }
        saved = {k: place(w) for k, w in self.saved.items()}
        placed = {id(t): TrainedTokens(t.indices, place(t.values)) for t in self._distinct_tokens()}
        tokens = {k: placed[id(t)] for k, t in self.tokens.items()}
        return LoRAWeights(self.path, self.digest, modules, saved, tokens)

    def _distinct_tokens(self) -> list[TrainedTokens]:
        """The trained rows, each once (tied lm_head rows are the embedding's)."""
        return list({id(t): t for t in self.tokens.values()}.values())


def _numel(x: torch.Tensor | None) -> int:
    return 0 if x is None else x.numel()


def _nbytes(x: torch.Tensor | None) -> int:
    return 0 if x is None else x.nbytes


def load_peft_adapter(
    path: str | Path,
    spec: BaseModelSpec,
    max_rank: int,
    dtype: torch.dtype = torch.float32,
    saved_module_slots: int = 0,
    base_tokenizer: str = "",
) -> LoRAWeights:
    """Load and validate a PEFT LoRA folder; tensors come back fp32 on CPU.

    `dtype` is the dtype the adapter will be served in: its weights and every module's scaling
    must be finite there. `saved_module_slots`: how many slots can hold full embed_tokens /
    lm_head copies (`LoRAConfig.max_saved_module_loras`); with none, adapters that need one
    (`modules_to_save`, `trainable_token_indices`) are refused. A tokenizer saved in the folder
    is checked against the base model's rows and its tokenizer in `base_tokenizer` (a folder,
    "" if it has none; see `adapter_tokenizer`). Raises `AdapterValidationError` for anything
    that cannot be served exactly, naming the field, tensor or module.
    """
    folder = Path(path)
    if not folder.is_dir():
        if folder.suffix in PICKLE_SUFFIXES:
            raise AdapterValidationError(
                f"{folder}: pickle checkpoints are refused; save the adapter as {WEIGHTS_FILE}"
            )
        raise AdapterValidationError(f"{folder}: adapter path is not a folder")
    config, config_bytes = _read_config(folder)
    _check_options(folder, config, spec)
    weights_bytes = _read_weights_file(folder)
    tensors = _parse_tensors(folder, weights_bytes)
    groups = _group_tensors(folder / WEIGHTS_FILE, tensors, spec)
    saved, tokens = _take_vocab_extras(folder, config, groups, spec, dtype, saved_module_slots)
    modules = _build_modules(folder, config, groups, spec, max_rank, dtype)
    tokenizer = tokenizer_files(folder)
    if tokenizer and not spec.vocab_size:
        raise AdapterValidationError(
            f"{folder}: an adapter's tokenizer needs the base model's vocabulary size"
        )
    digest = content_digest(config_bytes, weights_bytes, tokenizer)
    check_adapter_tokenizer(folder, tokenizer, spec.vocab_size, base_tokenizer, digest)
    return LoRAWeights(str(folder), digest, modules, saved, tokens)


def _take_vocab_extras(
    folder: Path,
    config: PeftLoRAConfig,
    groups: dict[tuple[int, str], dict[str, torch.Tensor]],
    spec: BaseModelSpec,
    dtype: torch.dtype,
    saved_module_slots: int,
) -> tuple[dict[str, torch.Tensor], dict[str, TrainedTokens]]:
    """Take the full module copies and trained rows out of `groups`, checked (`peft_saved`)."""
    found = {
        (module, part): groups[(layer, module)].pop(part)
        for (layer, module), parts in list(groups.items())
        for part in (SAVED_PART, TOKENS_PART)
        if part in parts
    }
    saved, tokens = vocab_extras(
        folder / WEIGHTS_FILE, config, found, spec.vocab_size, spec.hidden_size,
        spec.tie_word_embeddings,
        lambda name, label, t: _check_values(folder / WEIGHTS_FILE, name, label, t, dtype),
    )  # fmt: skip
    for module in list(saved) + list(tokens):
        lora = groups.get((MODEL_LAYER, module), {}).keys() - {"base"}
        if lora:
            raise AdapterValidationError(
                f"{folder / WEIGHTS_FILE}: {module} has both LoRA weights and a full copy or "
                "trained rows; PEFT saves one or the other"
            )
    if (saved or tokens) and saved_module_slots < 1:
        what = "modules_to_save" if saved else "trainable_token_indices"
        raise AdapterValidationError(
            f"{folder / CONFIG_FILE}: {what} ({sorted(set(saved) | set(tokens))}) needs a slot "
            "holding full embed_tokens / lm_head copies; this server reserves none (start it "
            "with --max-saved-module-loras N)"
        )
    return saved, tokens


def _check_values(
    weights_path: Path, name: str, label: str, tensor: torch.Tensor, dtype: torch.dtype
) -> None:
    """Refuse NaN, infinities and values over what the serving dtype holds."""
    limit = torch.finfo(dtype).max
    if not bool(torch.isfinite(tensor).all()):
        raise AdapterValidationError(f"{weights_path}: {name}.{label} holds NaN or infinite values")
    if tensor.numel() and float(tensor.abs().max()) > limit:
        raise AdapterValidationError(
            f"{weights_path}: {name}.{label} holds values over {limit:.4g}, the largest "
            f"{str(dtype).removeprefix('torch.')} can hold"
        )


def content_digest(
    config_bytes: bytes, weights_bytes: bytes, extra: list[tuple[str, bytes]] | None = None
) -> str:
    """An adapter's identity: sha256 of its config file's bytes, then its weights file's, then
    each `extra` file's name, length and bytes (its tokenizer files; none: the digest of the
    two files alone, as it always was)."""
    digest = hashlib.sha256(config_bytes)
    digest.update(weights_bytes)
    for name, data in extra or ():
        digest.update(b"\0%s\0%d\0" % (name.encode(), len(data)))
        digest.update(data)
    return digest.hexdigest()


def _read_config(folder: Path) -> tuple[PeftLoRAConfig, bytes]:
    config_path = folder / CONFIG_FILE
    if not config_path.is_file():
        raise AdapterValidationError(f"{folder}: missing {CONFIG_FILE}")
    raw = config_path.read_bytes()
    try:
        config = json.loads(raw)
    except (ValueError, UnicodeDecodeError, RecursionError) as e:
        raise AdapterValidationError(f"{config_path}: not valid JSON ({e})") from None
    return parse_peft_config(config, str(config_path)), raw


def _check_options(folder: Path, config: PeftLoRAConfig, spec: BaseModelSpec) -> None:
    where = folder / CONFIG_FILE
    targets = config.target_modules
    if isinstance(targets, tuple):
        unsupported = sorted(set(targets) - set(SUPPORTED_MODULES) - set(MODEL_MODULES))
        if unsupported:
            raise AdapterValidationError(
                f"{where}: target modules {unsupported} are not supported; LoRA applies only "
                f"to {sorted(SUPPORTED_MODULES) + list(MODEL_MODULES)}"
            )
    base_class = config.base_model_class
    if base_class and base_class != spec.architecture:
        raise AdapterValidationError(
            f"{where}: adapter was trained on {base_class}, the base model is {spec.architecture}"
        )
    trained_on = config.base_model_name_or_path
    if trained_on and spec.name_or_path and trained_on != spec.name_or_path:
        logger.warning(
            "%s: trained on %s, serving on %s (shapes match)", folder, trained_on, spec.name_or_path
        )


def _read_weights_file(folder: Path) -> bytes:
    weights_path = folder / WEIGHTS_FILE
    if not weights_path.is_file():
        pickles = sorted(p.name for p in folder.iterdir() if p.suffix in PICKLE_SUFFIXES)
        if pickles:
            raise AdapterValidationError(
                f"{folder}: {pickles} are pickle checkpoints and are "
                f"refused; save the adapter as {WEIGHTS_FILE}"
            )
        raise AdapterValidationError(f"{folder}: missing {WEIGHTS_FILE}")
    return weights_path.read_bytes()


def _parse_tensors(folder: Path, data: bytes) -> dict[str, torch.Tensor]:
    weights_path = folder / WEIGHTS_FILE
    try:
        return load_safetensors(data)
    except (SafetensorError, ValueError, RuntimeError) as e:
        raise AdapterValidationError(
            f"{weights_path}: unreadable safetensors file (truncated or corrupt): {e}"
        ) from None


def _module_path(layer: int, module: str) -> str:
    """PEFT's name of an adapted module (what target_modules / rank_pattern match)."""
    if layer == MODEL_LAYER:
        return "lm_head" if module == "lm_head" else f"model.{module}"
    return f"model.layers.{layer}.{SUPPORTED_MODULES[module]}.{module}"


def _group_tensors(
    weights_path: Path, tensors: dict[str, torch.Tensor], spec: BaseModelSpec
) -> dict[tuple[int, str], dict[str, torch.Tensor]]:
    """The file's tensors by module and part (A, B, M = DoRA magnitude, base = saved copy)."""
    parts: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        layer_match, model_match = _LAYER_KEY.match(key), _MODEL_KEY.match(key)
        if layer_match is not None:
            layer, block, module = int(layer_match[1]), layer_match[2], layer_match[3]
            suffix = layer_match[4]
            if SUPPORTED_MODULES.get(module) != block:
                raise AdapterValidationError(
                    f"{weights_path}: tensor {key!r} targets module {module!r}, which is not "
                    "supported"
                )
            if layer >= spec.num_layers:
                raise AdapterValidationError(
                    f"{weights_path}: tensor {key!r} is for layer {layer}, "
                    f"the base model has {spec.num_layers} layers"
                )
        elif model_match is not None:
            layer = MODEL_LAYER
            module = model_match[1] or model_match[3]
            suffix = model_match[2] or model_match[4]
        else:
            raise AdapterValidationError(
                f"{weights_path}: tensor {key!r} is not a LoRA A/B weight or DoRA magnitude of "
                f"{sorted(SUPPORTED_MODULES)} in a decoder layer, nor of "
                f"{list(MODEL_MODULES)}; unsupported module"
            )
        if not tensor.is_floating_point():
            raise AdapterValidationError(
                f"{weights_path}: tensor {key!r} has dtype {tensor.dtype}, expected floating point"
            )
        parts.setdefault((layer, module), {})[_PARTS[suffix]] = tensor
    return parts


def _build_modules(
    folder: Path,
    config: PeftLoRAConfig,
    groups: dict[tuple[int, str], dict[str, torch.Tensor]],
    spec: BaseModelSpec,
    max_rank: int,
    dtype: torch.dtype,
) -> dict[tuple[int, str], LoRAModuleWeights]:
    weights_path = folder / WEIGHTS_FILE
    if not groups:
        raise AdapterValidationError(f"{weights_path}: no LoRA weights found")
    limit = torch.finfo(dtype).max  # the largest magnitude the serving dtype holds
    dtype_name = str(dtype).removeprefix("torch.")

    def check_values(name: str, label: str, tensor: torch.Tensor) -> None:
        _check_values(weights_path, name, label, tensor, dtype)

    modules = {}
    for (layer, module), part in sorted(groups.items()):
        name = _module_path(layer, module)
        if layer == MODEL_LAYER:
            _check_saved_base(weights_path, name, part.pop("base", None), spec)
            if not part:
                continue  # a saved copy of an untouched base layer only
        elif "base" in part:
            raise AdapterValidationError(
                f"{weights_path}: {name} holds a copy of its base weight (modules_to_save?), "
                "which is not supported"
            )
        if "A" not in part or "B" not in part:
            missing = "lora_B" if "A" in part else "lora_A"
            raise AdapterValidationError(f"{weights_path}: {name} has no {missing} weight")
        if not config.targets(name):
            raise AdapterValidationError(
                f"{weights_path}: {name} has LoRA weights, but {CONFIG_FILE}'s target_modules / "
                "exclude_modules do not select it"
            )
        if module in MODEL_MODULES and not spec.vocab_size:
            raise AdapterValidationError(
                f"{weights_path}: {name} LoRA needs the base model's vocabulary size"
            )
        a, b = part["A"].float(), part["B"].float()  # [rank, in], [out, rank]
        in_features, out_features = spec.module_shape(module)
        rank = a.shape[0] if a.dim() == 2 else -1
        if (
            a.dim() != 2
            or b.dim() != 2
            or a.shape[1] != in_features
            or b.shape != (out_features, rank)
        ):
            labels = ("lora_embedding_A", "lora_embedding_B")
            label_a, label_b = labels if module == "embed_tokens" else ("lora_A", "lora_B")
            raise AdapterValidationError(
                f"{weights_path}: {name} has {label_a} {tuple(a.shape)} and {label_b} "
                f"{tuple(b.shape)}, expected ({rank}, {in_features}) and "
                f"({out_features}, {rank}) for the base model"
            )
        expected_rank, rank_field = config.rank_of(name)
        if rank != expected_rank:
            raise AdapterValidationError(
                f"{weights_path}: {name} has rank {rank}, {CONFIG_FILE} says {expected_rank} "
                f"({rank_field})"
            )
        if rank > max_rank:
            raise AdapterValidationError(
                f"{weights_path}: {name} has rank {rank}, over max_lora_rank={max_rank}"
            )
        check_values(name, "lora_A", a)
        check_values(name, "lora_B", b)
        magnitude = _magnitude(weights_path, config, name, module, part.get("M"), out_features)
        if magnitude is not None:
            check_values(name, "lora_magnitude_vector", magnitude)
        scaling, alpha_field = config.scaling_of(name, rank)
        if not scaling <= limit:
            raise AdapterValidationError(
                f"{config.where}: {alpha_field} gives {name} a scaling of {scaling:.4g}, over "
                f"{limit:.4g}, the largest {dtype_name} (the serving dtype) can hold"
            )
        modules[(layer, module)] = LoRAModuleWeights(
            a.contiguous(), b.contiguous(), scaling, magnitude
        )
    if not modules:
        raise AdapterValidationError(f"{weights_path}: no LoRA weights found")
    return modules


def _magnitude(
    weights_path: Path,
    config: PeftLoRAConfig,
    name: str,
    module: str,
    magnitude: torch.Tensor | None,
    out_features: int,
) -> torch.Tensor | None:
    """A DoRA module's magnitude vector (fp32), checked against `use_dora`; None without DoRA."""
    if not config.use_dora:
        if magnitude is not None:
            raise AdapterValidationError(
                f"{weights_path}: {name} has a lora_magnitude_vector, but {CONFIG_FILE} does "
                "not set use_dora"
            )
        return None
    if module in MODEL_MODULES:
        raise AdapterValidationError(
            f"{config.where}: DoRA (use_dora) on {module} is not supported; DoRA applies to "
            f"{sorted(SUPPORTED_MODULES)}"
        )
    if magnitude is None:
        raise AdapterValidationError(
            f"{weights_path}: {name} has no lora_magnitude_vector, which use_dora needs"
        )
    if magnitude.shape != (out_features,):
        raise AdapterValidationError(
            f"{weights_path}: {name}.lora_magnitude_vector has shape {tuple(magnitude.shape)}, "
            f"expected ({out_features},) for the base model"
        )
    return magnitude.float().contiguous()


def _check_saved_base(
    weights_path: Path, name: str, base: torch.Tensor | None, spec: BaseModelSpec
) -> None:
    """PEFT saves the base embedding / lm_head beside their LoRA weights (`base_layer.weight`).
    A copy of the base's shape is the frozen base weight and is not read; another shape means
    a resized vocabulary (added tokens), which is refused."""
    if base is None:
        return
    expected = (spec.vocab_size, spec.hidden_size)
    if base.shape != expected:
        raise AdapterValidationError(
            f"{weights_path}: {name}.base_layer.weight has shape {tuple(base.shape)}, the base "
            f"model's is {expected}: adapters that resize the vocabulary (added tokens) are not "
            "supported; train the new tokens into existing rows instead"
        )
