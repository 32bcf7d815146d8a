"""A checkpoint's RoPE settings, read from either config.json layout into one typed value.

transformers 4.x writes a top-level `rope_theta` and an optional `rope_scaling` dict;
transformers 5.x writes one `rope_parameters` dict that holds `rope_theta`, `rope_type` and the
scaling factors. Both become a `RopeConfig`, resolved the way transformers resolves them (which
value wins, which defaults apply), so the rotary embedding we compute is the one transformers
computes. A variant or key we do not implement is refused with a ValueError naming it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

#: transformers' theta when a config names none in either layout (every family we serve).
DEFAULT_ROPE_THETA = 10000.0

# rope_type -> the keys its dict may carry besides `_COMMON_KEYS`.
_TYPE_KEYS: dict[str, frozenset[str]] = {
    "default": frozenset(),
    "linear": frozenset({"factor"}),
    "llama3": frozenset(
        {"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"}
    ),
    "yarn": frozenset(
        {
            "factor",
            "original_max_position_embeddings",
            "attention_factor",
            "beta_fast",
            "beta_slow",
            "mscale",
            "mscale_all_dim",
            "truncate",
        }
    ),
}
_COMMON_KEYS = frozenset({"rope_type", "type", "rope_theta", "partial_rotary_factor"})

# rope_type -> why it is refused.
_REFUSED_TYPES = {
    "dynamic": (
        "dynamic NTK rescales its frequencies by the length of each forward pass, so keys "
        "rotated when they were written to the paged KV cache cannot match transformers' "
        "(which depend on how the sequence was split into calls); serve the model without "
        "rope scaling, or with 'linear' or 'yarn' scaling"
    ),
    "longrope": "LongRoPE (Phi-3) per-dimension factors are not implemented",
    "proportional": "proportional RoPE is not implemented",
}

# Layer-type labels under which transformers 5 may nest one dict per attention kind.
_LAYER_TYPES = frozenset({"full_attention", "sliding_attention"})


@dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding settings, every value resolved (no defaults left to apply).

    `rope_type` is one of default, linear, llama3, yarn. `factor` is 1.0 for default RoPE.
    `attention_factor` multiplies cos and sin (yarn's "mscale"; 1.0 for the others).
    """

    rope_type: str
    theta: float
    factor: float = 1.0
    original_max_position_embeddings: int | None = None
    low_freq_factor: float | None = None  # llama3
    high_freq_factor: float | None = None  # llama3
    beta_fast: float | None = None  # yarn
    beta_slow: float | None = None  # yarn
    truncate: bool = True  # yarn: round the correction range to whole dimensions
    attention_factor: float = 1.0

    def scaling(self) -> dict[str, Any] | None:
        """The `scaling` dict `loraplex.kernels.rotary` takes; None for plain RoPE."""
        if self.rope_type == "default":
            return None
        keys = {
            "linear": ("factor",),
            "llama3": (
                "factor",
                "low_freq_factor",
                "high_freq_factor",
                "original_max_position_embeddings",
            ),
            "yarn": (
                "factor",
                "original_max_position_embeddings",
                "beta_fast",
                "beta_slow",
                "truncate",
                "attention_factor",
            ),
        }[self.rope_type]
        return {"rope_type": self.rope_type, **{key: getattr(self, key) for key in keys}}


def _number(value: Any, field: str, *, positive: bool = True) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"config.json {field}={value!r} is not a number")
    if positive and value <= 0:
        raise ValueError(f"config.json {field}={value!r} must be positive")
    return float(value)


def _flatten_per_layer(rope: dict[str, Any], field: str) -> dict[str, Any]:
    """transformers 5 may nest one dict per layer type; one shared setting is all we run."""
    nested = [key for key in rope if key in _LAYER_TYPES]
    if not nested:
        return rope
    values = [rope[key] for key in nested if rope[key] is not None]
    if any(value != values[0] for value in values[1:]) or set(rope) - _LAYER_TYPES:
        raise ValueError(
            f"config.json {field} sets RoPE per layer type ({sorted(rope)}) with different "
            "values; one rotary embedding for all layers is implemented"
        )
    return dict(values[0]) if values else {}


def _canonical(rope: dict[str, Any], cfg: dict[str, Any]) -> dict[str, Any]:
    """A RoPE dict with its type and theta spelled one way, to compare two layouts."""
    out = {k: v for k, v in rope.items() if k not in ("type", "rope_type", "rope_theta")}
    out["rope_type"] = rope.get("rope_type") or rope.get("type") or "default"
    out["rope_theta"] = float(rope.get("rope_theta") or cfg.get("rope_theta") or 0.0)
    return out


def _rope_dict(cfg: dict[str, Any]) -> tuple[dict[str, Any], str]:
    """The RoPE dict transformers uses and the field it came from.

    transformers 5 takes a 4.x `rope_scaling` when one is set, else `rope_parameters`; a file
    holding both, with different contents, is refused rather than guessed.
    """
    legacy, params = cfg.get("rope_scaling"), cfg.get("rope_parameters")
    for field, value in (("rope_scaling", legacy), ("rope_parameters", params)):
        if value is not None and not isinstance(value, dict):
            raise ValueError(f"config.json {field}={value!r} is not a dict")
    if legacy and params:
        params = _flatten_per_layer(params, "rope_parameters")
        if _canonical(legacy, cfg) != _canonical(params, cfg):
            raise ValueError(
                f"config.json has both rope_scaling={legacy!r} and rope_parameters={params!r}, "
                "which disagree; keep one"
            )
    if legacy:
        return dict(legacy), "rope_scaling"
    return _flatten_per_layer(dict(params or {}), "rope_parameters"), "rope_parameters"


def _theta(cfg: dict[str, Any], rope: dict[str, Any], field: str) -> float:
    inner, top = rope.get("rope_theta"), cfg.get("rope_theta")
    if inner is not None and top is not None and float(inner) != float(top):
        raise ValueError(
            f"config.json has rope_theta={top!r} and {field}.rope_theta={inner!r}, "
            "which disagree; keep one"
        )
    value = inner if inner is not None else top
    if value is None:
        return DEFAULT_ROPE_THETA
    return _number(value, f"{field}.rope_theta" if inner is not None else "rope_theta")


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def parse_rope_config(cfg: dict[str, Any]) -> RopeConfig:
    """Read the RoPE settings of a config.json dict (4.x or 5.x layout).

    Raises ValueError naming the field for a RoPE variant or key we do not implement
    (dynamic NTK, LongRoPE, partial rotary, per-layer-type RoPE, unknown keys) and for
    missing or malformed values.
    """
    rope, field = _rope_dict(cfg)
    theta = _theta(cfg, rope, field)
    rope_type = str(rope.get("rope_type") or rope.get("type") or "default")
    if rope_type in _REFUSED_TYPES:
        raise ValueError(
            f"config.json {field}.rope_type={rope_type!r} is not supported: "
            f"{_REFUSED_TYPES[rope_type]}"
        )
    if rope_type not in _TYPE_KEYS:
        raise ValueError(
            f"config.json {field}.rope_type={rope_type!r} is not supported; "
            f"supported: {sorted(_TYPE_KEYS)}"
        )
    unknown = sorted(set(rope) - _COMMON_KEYS - _TYPE_KEYS[rope_type])
    if unknown:
        shown = ", ".join(f"{field}.{key}={rope[key]!r}" for key in unknown)
        raise ValueError(f"config.json {shown}: not implemented for rope_type {rope_type!r}")
    for where, value in (
        ("partial_rotary_factor", cfg.get("partial_rotary_factor")),
        (f"{field}.partial_rotary_factor", rope.get("partial_rotary_factor")),
    ):
        if value is not None and float(value) != 1.0:
            raise ValueError(
                f"config.json {where}={value!r} is not supported: only full-width rotary "
                "embeddings (partial_rotary_factor 1.0) are implemented"
            )
    if rope_type == "default":
        return RopeConfig("default", theta)

    def required(key: str) -> float:
        if rope.get(key) is None:
            raise ValueError(f"config.json {field} of rope_type {rope_type!r} lacks {key!r}")
        return _number(rope[key], f"{field}.{key}")

    if rope_type == "linear":
        return RopeConfig("linear", theta, factor=required("factor"))
    # NOTE: as in transformers, a top-level original_max_position_embeddings (Phi-3 style)
    # wins over the dict's, and the model's max_position_embeddings is the last resort.
    original = cfg.get("original_max_position_embeddings") or rope.get(
        "original_max_position_embeddings"
    )
    if original is None:
        original = cfg.get("max_position_embeddings")
    if original is None:
        raise ValueError(f"config.json {field} lacks 'original_max_position_embeddings'")
    original = int(_number(original, f"{field}.original_max_position_embeddings"))
    if rope_type == "llama3":
        low, high = required("low_freq_factor"), required("high_freq_factor")
        if high <= low:
            raise ValueError(
                f"config.json {field}.high_freq_factor={high} must exceed low_freq_factor={low}"
            )
        return RopeConfig(
            "llama3",
            theta,
            factor=required("factor"),
            original_max_position_embeddings=original,
            low_freq_factor=low,
            high_freq_factor=high,
        )
    # yarn
    if rope.get("factor") is not None:
        factor = _number(rope["factor"], f"{field}.factor")
    else:  # transformers: the ratio of the extended context to the original one
        factor = _number(cfg.get("max_position_embeddings"), "max_position_embeddings") / original
    if rope.get("attention_factor") is not None:
        attention_factor = _number(rope["attention_factor"], f"{field}.attention_factor")
    elif rope.get("mscale") and rope.get("mscale_all_dim"):
        attention_factor = _yarn_mscale(
            factor, _number(rope["mscale"], f"{field}.mscale")
        ) / _yarn_mscale(factor, _number(rope["mscale_all_dim"], f"{field}.mscale_all_dim"))
    else:
        attention_factor = _yarn_mscale(factor)
    truncate = rope.get("truncate", True)
    if not isinstance(truncate, bool):
        raise ValueError(f"config.json {field}.truncate={truncate!r} is not a boolean")
    return RopeConfig(
        "yarn",
        theta,
        factor=factor,
        original_max_position_embeddings=original,
        # NOTE: transformers treats 0 / null as unset here (`or`), so do we.
        beta_fast=_number(rope.get("beta_fast") or 32, f"{field}.beta_fast"),
        beta_slow=_number(rope.get("beta_slow") or 1, f"{field}.beta_slow"),
        truncate=truncate,
        attention_factor=attention_factor,
    )
