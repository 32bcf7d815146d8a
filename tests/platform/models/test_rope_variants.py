"""RoPE variants against transformers' own rotary embedding, at positions past the original
context; the variants and keys we do not implement are refused, naming the field."""

from __future__ import annotations

import pytest
import torch

from loraplex.kernels.rotary import cos_sin_cache
from loraplex.platform.models.arch_config import ArchConfig
from loraplex.platform.models.rope_config import DEFAULT_ROPE_THETA, parse_rope_config

transformers = pytest.importorskip("transformers")
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding  # noqa: E402

HEAD_DIM, MAX_POSITIONS = 64, 512
BASE = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 1,
    "num_attention_heads": 4,
    "vocab_size": 300,
    "max_position_embeddings": MAX_POSITIONS,
}
# name -> rope_parameters (transformers 5 layout); every scaled one has a 64-position original
VARIANTS = {
    "default": {"rope_type": "default", "rope_theta": 10000.0},
    "linear": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
    "llama3": {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    },
    "yarn": {
        "rope_type": "yarn",
        "rope_theta": 1e6,
        "factor": 4.0,
        "original_max_position_embeddings": 64,
    },
    "yarn-mscale": {  # DeepSeek style: attention factor from mscale / mscale_all_dim
        "rope_type": "yarn",
        "rope_theta": 10000.0,
        "factor": 8.0,
        "original_max_position_embeddings": 64,
        "mscale": 1.0,
        "mscale_all_dim": 0.5,
        "beta_fast": 4,
        "beta_slow": 2,
    },
    "yarn-untruncated-implicit-factor": {  # factor from max_position_embeddings / original
        "rope_type": "yarn",
        "rope_theta": 10000.0,
        "factor": None,
        "original_max_position_embeddings": 64,
        "truncate": False,
    },
    "yarn-attention-factor": {
        "rope_type": "yarn",
        "rope_theta": 10000.0,
        "factor": 2.0,
        "original_max_position_embeddings": 64,
        "attention_factor": 0.8,
    },
}


def _transformers_cos_sin(rope: dict) -> tuple[torch.Tensor, torch.Tensor]:
    config = transformers.LlamaConfig(
        **{k: v for k, v in BASE.items() if k not in ("architectures", "model_type")},
        rope_parameters=dict(rope),
    )
    emb = LlamaRotaryEmbedding(config)
    positions = torch.arange(MAX_POSITIONS)[None]
    cos, sin = emb(torch.zeros(1, dtype=torch.float32), positions)  # [1, positions, head_dim]
    return cos[0, :, : HEAD_DIM // 2], sin[0, :, : HEAD_DIM // 2]


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_cos_sin_equal_transformers_past_the_original_context(name: str) -> None:
    cfg = {**BASE, "rope_parameters": VARIANTS[name]}
    arch = ArchConfig.from_dict(cfg)
    cache = cos_sin_cache(arch.head_dim, MAX_POSITIONS, arch.rope.theta, arch.rope.scaling())
    cos, sin = cache.chunk(2, dim=-1)  # [positions, head_dim // 2] each
    ref_cos, ref_sin = _transformers_cos_sin(VARIANTS[name])
    # positions up to 8x the 64-position original context; fp32 angles up to ~500 rad
    torch.testing.assert_close(cos, ref_cos, atol=2e-4, rtol=0)
    torch.testing.assert_close(sin, ref_sin, atol=2e-4, rtol=0)
    if name != "default":  # the scaling really changes the numbers
        plain = cos_sin_cache(arch.head_dim, MAX_POSITIONS, arch.rope.theta, None)
        assert (plain - cache).abs().max() > 0.1


def test_4x_and_5x_layouts_give_the_same_rope() -> None:
    for rope in VARIANTS.values():
        new = parse_rope_config({**BASE, "rope_parameters": rope})
        legacy = {k: v for k, v in rope.items() if k != "rope_theta"}
        legacy_type = legacy.pop("rope_type")
        legacy["type"] = legacy_type  # the oldest spelling
        old = parse_rope_config(
            {
                **BASE,
                "rope_theta": rope["rope_theta"],
                "rope_scaling": None if legacy_type == "default" else legacy,
            }
        )
        assert old == new


def test_theta_comes_from_either_layout_and_defaults_like_transformers() -> None:
    assert parse_rope_config({**BASE, "rope_parameters": {"rope_theta": 5e5}}).theta == 5e5
    assert parse_rope_config({**BASE, "rope_theta": 5e5}).theta == 5e5
    # a 4.x rope_scaling with the theta beside it at the top level
    scaled = {**BASE, "rope_theta": 5e5, "rope_scaling": {"type": "linear", "factor": 2.0}}
    assert parse_rope_config(scaled).theta == 5e5
    assert parse_rope_config(BASE).theta == DEFAULT_ROPE_THETA  # neither: transformers' 10000


def test_top_level_original_context_wins_as_in_transformers() -> None:
    rope = {**VARIANTS["yarn"], "original_max_position_embeddings": 128}
    parsed = parse_rope_config(
        {**BASE, "original_max_position_embeddings": 64, "rope_parameters": rope}
    )
    assert parsed.original_max_position_embeddings == 64


@pytest.mark.parametrize(
    "cfg,message",
    [
        (
            {"rope_parameters": {"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}},
            "rope_parameters.rope_type='dynamic' is not supported",
        ),
        (
            {"rope_scaling": {"type": "dynamic", "factor": 2.0}},
            "rope_scaling.rope_type='dynamic' is not supported",
        ),
        (
            {
                "rope_scaling": {
                    "rope_type": "longrope",
                    "long_factor": [1.0],
                    "short_factor": [1.0],
                }
            },
            "rope_type='longrope' is not supported",
        ),
        ({"rope_parameters": {"rope_type": "su"}}, "rope_type='su' is not supported"),
        (
            {"rope_parameters": {"rope_type": "default", "mrope_section": [8, 8]}},
            r"rope_parameters.mrope_section=\[8, 8\]",
        ),
        ({"partial_rotary_factor": 0.5}, "partial_rotary_factor=0.5 is not supported"),
        (
            {"rope_parameters": {"rope_type": "default", "partial_rotary_factor": 0.25}},
            "rope_parameters.partial_rotary_factor=0.25",
        ),
        ({"rope_scaling": {"rope_type": "linear"}}, "lacks 'factor'"),
        (
            {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0}},
            "lacks 'high_freq_factor'",
        ),
        (
            {"rope_theta": 1e4, "rope_parameters": {"rope_type": "default", "rope_theta": 5e5}},
            "rope_theta=10000.0 and rope_parameters.rope_theta=500000.0",
        ),
        (
            {
                "rope_scaling": {"rope_type": "linear", "factor": 2.0},
                "rope_parameters": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e4},
            },
            "both rope_scaling",
        ),
        (
            {
                "layer_types": ["full_attention", "sliding_attention"],
                "rope_parameters": {
                    "full_attention": {"rope_type": "default", "rope_theta": 1e6},
                    "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
                },
            },
            "per layer type",
        ),
        ({"rope_parameters": {"rope_type": "linear", "factor": -2.0}}, "factor=-2.0 must be"),
    ],
)
def test_unimplemented_rope_is_refused_naming_the_field(cfg: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ArchConfig.from_dict({**BASE, **cfg})


def test_one_rope_shared_by_every_layer_type_is_accepted() -> None:
    rope = {"rope_type": "default", "rope_theta": 1e6}
    cfg = {
        **BASE,
        "layer_types": ["full_attention"],
        "rope_parameters": {"full_attention": rope},
    }
    assert ArchConfig.from_dict(cfg).rope.theta == 1e6
