"""The architecture facts a model needs, read once from a Hugging Face config.json.

Both layouts are read: transformers 4.x (`rope_theta`, `rope_scaling`, `torch_dtype`) and 5.x
(`rope_parameters`, `dtype`). Each value is resolved the way transformers' implementation of
that architecture resolves it (its defaults, which fields it reads), so the model we build
computes the numbers transformers computes. This module is the one place that decides what a
config may ask for: a field or value that changes the numbers and that loraplex does not
implement is refused here with a ValueError naming it, never defaulted; fields that do not
change outputs (dropout, initializer_range, use_cache, ...) are ignored.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loraplex.platform.models.rope_config import RopeConfig, parse_rope_config

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Family:
    """What transformers' implementation of one architecture reads from its config."""

    qkv_bias: bool | None  # None: the config's attention_bias
    o_bias: bool | None  # None: the config's attention_bias
    qk_norm: bool  # RMSNorm on each head of q and k before rotary
    # How sliding-window attention is switched on: "never" (transformers ignores the field),
    # "every_layer" (Mistral: whenever sliding_window is set) or "layer_types" (Qwen2/3: with
    # use_sliding_window, on the layers `layer_types` / `max_window_layers` mark).
    sliding: str
    default_sliding_window: int | None = None  # transformers' value when the field is absent


_FAMILIES: dict[str, _Family] = {
    "LlamaForCausalLM": _Family(qkv_bias=None, o_bias=None, qk_norm=False, sliding="never"),
    "MistralForCausalLM": _Family(False, False, False, "every_layer", default_sliding_window=4096),
    "Qwen2ForCausalLM": _Family(True, False, False, "layer_types", default_sliding_window=4096),
    "Qwen3ForCausalLM": _Family(None, None, True, "layer_types", default_sliding_window=4096),
}

#: Activations `silu_and_mul` computes (transformers' ACT2FN maps "swish" to SiLU too).
SUPPORTED_ACTIVATIONS = ("silu", "swish")
_LAYER_TYPES = ("full_attention", "sliding_attention")

#: Fields that change the numbers of some architecture and that loraplex does not implement,
#: with the values under which they change nothing (absent counts as None).
UNSUPPORTED_FIELDS: dict[str, tuple[Any, ...]] = {
    "mlp_bias": (None, False),
    "attn_logit_softcapping": (None, 0),
    "final_logit_softcapping": (None, 0),
    "query_pre_attn_scalar": (None,),
    "embedding_multiplier": (None, 1),
    "residual_multiplier": (None, 1),
    "logits_scaling": (None, 1),
    "attention_multiplier": (None,),
    "clip_qkv": (None,),
    "use_qk_norm": (None, False),
    "attention_chunk_size": (None,),
    "no_rope_layers": (None,),
    "use_bidirectional_attention": (None, False),
    "num_local_experts": (None, 0),
    "num_experts": (None, 0),
    "n_routed_experts": (None, 0),
}


@dataclass(frozen=True)
class ArchConfig:
    """A checkpoint's architecture, normalised: the rest of loraplex reads this, not raw JSON.

    `max_position_embeddings` is the longest sequence served exactly: the config's value,
    capped at the sliding window when one applies (within the window, sliding-window attention
    is full attention). `raw` keeps the parsed config.json for tools that need other fields.
    """

    architecture: str
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float
    rope: RopeConfig
    max_position_embeddings: int
    sliding_window: int | None  # the window of the layers that slide; None: full attention
    tie_word_embeddings: bool
    attention_bias: bool  # bias on q/k/v (Qwen2; Llama and Qwen3 with attention_bias)
    o_proj_bias: bool  # bias on o_proj (Llama and Qwen3 with attention_bias)
    qk_norm: bool  # RMSNorm on each head of q and k before rotary (Qwen3)
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    torch_dtype: str
    raw: dict[str, Any]

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def rope_theta(self) -> float:
        return self.rope.theta

    @property
    def rope_scaling(self) -> dict[str, Any] | None:
        """The resolved scaling dict `loraplex.kernels.rotary` takes (None: plain RoPE)."""
        return self.rope.scaling()

    def context_length(self, max_model_len: int | None) -> int:
        """The context a server runs with: `max_model_len` (prompt plus completion tokens, vLLM's
        option), or the model's own when None. ValueError, naming the limit, when it asks for
        more than the model serves (as vLLM refuses it; it is never silently lowered)."""
        limit = self.max_position_embeddings
        if max_model_len is None:
            return limit
        if max_model_len > limit:
            source = (
                f"its sliding window ({self.sliding_window} tokens)"
                if self.sliding_window == limit < _int(self.raw, "max_position_embeddings", 4096)
                else "max_position_embeddings in its config.json"
            )
            raise ValueError(
                f"max_model_len {max_model_len} is more than this model's context length of "
                f"{limit} tokens ({source}); give --max-model-len {limit} or less, or leave it "
                "out to use the model's own"
            )
        return max_model_len

    @classmethod
    def from_dict(cls, cfg: dict[str, Any]) -> ArchConfig:
        """Parse and check a config.json dict; ValueError names what is missing or refused."""
        family = _family(cfg)
        arch = cfg["architectures"][0]
        check_supported_fields(cfg)
        num_heads = _int(cfg, "num_attention_heads")
        hidden = _int(cfg, "hidden_size")
        num_kv_heads = _int(cfg, "num_key_value_heads", num_heads)
        if num_heads % num_kv_heads:
            raise ValueError(
                f"config.json num_attention_heads={num_heads} is not a multiple of "
                f"num_key_value_heads={num_kv_heads}"
            )
        if cfg.get("head_dim") is None and hidden % num_heads:
            raise ValueError(
                f"config.json has no head_dim and hidden_size={hidden} is not a multiple of "
                f"num_attention_heads={num_heads}"
            )
        head_dim = _int(cfg, "head_dim", hidden // num_heads)
        if head_dim % 2:
            raise ValueError(f"config.json head_dim={head_dim} must be even for rotary embedding")
        num_layers = _int(cfg, "num_hidden_layers")
        max_positions = _int(cfg, "max_position_embeddings", 4096)
        window = _sliding_window(cfg, family, num_layers)
        if window is not None and window < max_positions:
            logger.warning(
                "sliding_window=%d is shorter than max_position_embeddings=%d: sequences are "
                "limited to %d tokens, within which sliding-window attention is full attention "
                "(longer ones would need sliding-window attention, which is not implemented)",
                window,
                max_positions,
                window,
            )
            max_positions = window
        attention_bias = bool(cfg.get("attention_bias", False))
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        return cls(
            architecture=arch,
            hidden_size=hidden,
            intermediate_size=_int(cfg, "intermediate_size"),
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            vocab_size=_int(cfg, "vocab_size"),
            rms_norm_eps=float(cfg.get("rms_norm_eps") or 1e-6),
            rope=parse_rope_config(cfg),
            max_position_embeddings=max_positions,
            sliding_window=window,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=attention_bias if family.qkv_bias is None else family.qkv_bias,
            o_proj_bias=attention_bias if family.o_bias is None else family.o_bias,
            qk_norm=family.qk_norm,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            torch_dtype=str(cfg.get("dtype") or cfg.get("torch_dtype") or "float32"),
            raw=cfg,
        )

    @classmethod
    def from_path(cls, model_dir: Path) -> ArchConfig:
        """The architecture of a Hugging Face folder, or of a bare config.json file (a model
        of random weights)."""
        path = Path(model_dir)
        path = path if path.is_file() else path / "config.json"
        if not path.is_file():
            raise ValueError(f"{model_dir} has no config.json")
        return cls.from_dict(json.loads(path.read_text()))


def _int(cfg: dict[str, Any], key: str, default: int | None = None) -> int:
    value = cfg.get(key)
    if value is None:
        if default is None:
            raise ValueError(f"config.json lacks {key!r}")
        return default
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"config.json {key}={value!r} must be a positive integer")
    return value


def _family(cfg: dict[str, Any]) -> _Family:
    archs = cfg.get("architectures") or []
    if not archs:
        raise ValueError("config.json has no 'architectures' entry")
    family = _FAMILIES.get(archs[0])
    if family is None:
        raise ValueError(
            f"config.json architectures={archs!r}: unsupported architecture {archs[0]!r}; "
            f"supported: {sorted(_FAMILIES)}"
        )
    return family


def check_supported_config(cfg: dict[str, Any]) -> None:
    """The refusals that need no sizes (architecture, numerics fields, RoPE), for tools that
    handle a checkpoint without building it (`loraplex quantize`); `from_dict` applies them too."""
    _family(cfg)
    check_supported_fields(cfg)
    parse_rope_config(cfg)


def check_supported_fields(cfg: dict[str, Any]) -> None:
    """Refuse a config field whose value changes the numbers in a way we do not implement.

    RoPE fields are checked by `parse_rope_config`, quantization methods by
    `loraplex.quant.registry` (both at load, from `ArchConfig.from_dict` and the loader).
    """
    for field, neutral in UNSUPPORTED_FIELDS.items():
        value = cfg.get(field)
        if value in neutral:
            continue
        if field == "no_rope_layers" and isinstance(value, list) and all(v == 1 for v in value):
            continue  # every layer uses RoPE
        raise ValueError(f"config.json {field}={value!r} is not supported (not implemented)")
    act = cfg.get("hidden_act", "silu")
    if act not in SUPPORTED_ACTIVATIONS:
        raise ValueError(
            f"config.json hidden_act={act!r} is not supported; supported: "
            f"{list(SUPPORTED_ACTIVATIONS)}"
        )
    unknown = sorted(set(cfg.get("layer_types") or ()) - set(_LAYER_TYPES))
    if unknown:
        raise ValueError(
            f"config.json layer_types has {unknown}: only {list(_LAYER_TYPES)} are implemented"
        )


def _sliding_window(cfg: dict[str, Any], family: _Family, num_layers: int) -> int | None:
    """The window transformers applies on some layer of this model, or None."""
    if family.sliding == "never":
        return None
    window = cfg.get("sliding_window", family.default_sliding_window)
    if family.sliding == "layer_types":
        if not cfg.get("use_sliding_window", False) or window is None:
            return None
        first_sliding = cfg.get("max_window_layers", 28)
        layer_types = cfg.get("layer_types") or [
            "sliding_attention" if i >= first_sliding else "full_attention"
            for i in range(num_layers)
        ]
        if "sliding_attention" not in layer_types:
            return None
    if window is None:
        return None
    if isinstance(window, bool) or not isinstance(window, int) or window <= 0:
        raise ValueError(f"config.json sliding_window={window!r} must be a positive integer")
    return window
