"""A tenant's adapter_config.json cannot stall the server or poison a slot: patterns match in
linear time (RE2) under PEFT's rules, and every numeric field is type-, range- and
finiteness-checked against the serving dtype, with a message naming the field."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch
from lora_fixtures import make_peft_adapter, tiny_llama
from safetensors.torch import load_file, save_file

from loraplex.adapters.patterns import MAX_PATTERN_LENGTH
from loraplex.adapters.peft_format import (
    CONFIG_FILE,
    WEIGHTS_FILE,
    AdapterValidationError,
    load_peft_adapter,
)

#: a pattern a backtracking engine needs minutes for on every module name
CATASTROPHIC = "(.*)*(.*)*(.*)*(.*)*(.*)*Z"


@pytest.fixture(scope="module")
def adapter(tmp_path_factory) -> Path:
    """One PEFT adapter (r=4, alpha=8, every projection); tests edit copies of its config."""
    return make_peft_adapter(tmp_path_factory.mktemp("good") / "a", r=4, lora_alpha=8)


def _with_config(adapter: Path, tmp_path: Path, raw: str | None = None, **changes) -> Path:
    """A copy of `adapter` whose config has `changes` (or is the raw text `raw`)."""
    folder = tmp_path / "edited"
    folder.mkdir(parents=True)
    (folder / WEIGHTS_FILE).write_bytes((adapter / WEIGHTS_FILE).read_bytes())
    if raw is None:
        config = json.loads((adapter / CONFIG_FILE).read_text())
        config.update(changes)
        raw = json.dumps(config)  # NOTE: Python writes float("nan") as NaN, as a tenant could
    (folder / CONFIG_FILE).write_text(raw)
    return folder


def test_catastrophic_rank_pattern_is_matched_in_linear_time(adapter, spec, tmp_path):
    folder = _with_config(adapter, tmp_path, rank_pattern={CATASTROPHIC: 8})
    start = time.monotonic()
    weights = load_peft_adapter(folder, spec, max_rank=16)
    assert time.monotonic() - start < 2.0
    # PEFT's rule: the key matches no module name (none ends in Z), so every module has rank r
    assert {m.rank for m in weights.modules.values()} == {4}


@pytest.mark.parametrize(
    ("field", "pattern"),
    [
        ("rank_pattern", r"(q)_\1"),  # a backreference
        ("alpha_pattern", r"(?=q)q_proj"),  # lookahead
        ("rank_pattern", "q" * (MAX_PATTERN_LENGTH + 1)),
    ],
    ids=["backreference", "lookahead", "too long"],
)
def test_patterns_re2_cannot_run_are_refused_naming_the_field(
    adapter, spec, tmp_path, field, pattern
):
    value = 4 if field == "rank_pattern" else 8
    folder = _with_config(adapter, tmp_path, **{field: {pattern: value}})
    with pytest.raises(AdapterValidationError, match=field):
        load_peft_adapter(folder, spec, max_rank=16)


def test_regex_keys_and_regex_target_modules_follow_peft(tmp_path, spec):
    from peft import PeftModel

    folder = make_peft_adapter(
        tmp_path / "a",
        r=4,
        lora_alpha=8,
        target_modules=r".*\.(q_proj|down_proj)",
        rank_pattern={r"layers\.1\..*down_proj": 2},
        alpha_pattern={r"0\.self_attn\.q_proj": 3},
    )
    weights = load_peft_adapter(folder, spec, max_rank=8)
    peft_model = PeftModel.from_pretrained(tiny_llama(), str(folder))
    layers = peft_model.base_model.model.model.layers
    assert {module for _, module in weights.modules} == {"q_proj", "down_proj"}
    for (layer, module), ours in weights.modules.items():
        block = layers[layer].self_attn if module == "q_proj" else layers[layer].mlp
        theirs = getattr(block, module)
        assert ours.rank == theirs.r["default"]
        assert ours.scaling == pytest.approx(theirs.scaling["default"])
    assert weights.modules[(1, "down_proj")].rank == 2
    assert weights.modules[(0, "q_proj")].scaling == pytest.approx(0.75)


def test_weights_target_modules_does_not_select_are_refused(adapter, spec, tmp_path):
    folder = _with_config(adapter, tmp_path, target_modules=r".*\.q_proj")
    with pytest.raises(AdapterValidationError, match="target_modules"):
        load_peft_adapter(folder, spec, max_rank=16)
    lookaround = _with_config(adapter, tmp_path / "x", target_modules=r"(?!lm_head).*")
    with pytest.raises(AdapterValidationError, match="target_modules pattern"):
        load_peft_adapter(lookaround, spec, max_rank=16)


NAN, INF = float("nan"), float("inf")
BAD_FIELDS = [
    # (case, config changes, the field the message must name)
    ("alpha 1e308", {"lora_alpha": 1e308}, "lora_alpha"),
    ("alpha NaN", {"lora_alpha": NAN}, "lora_alpha"),
    ("alpha Infinity", {"lora_alpha": INF}, "lora_alpha"),
    ("alpha negative", {"lora_alpha": -8}, "lora_alpha"),
    ("alpha string", {"lora_alpha": "8"}, "lora_alpha"),
    ("alpha bool", {"lora_alpha": True}, "lora_alpha"),
    ("r float", {"r": 4.0}, "r must be an integer"),
    ("r bool", {"r": True}, "r must be an integer"),
    ("r huge", {"r": 10**30}, "r must be an integer"),
    ("rank_pattern list", {"rank_pattern": [1, 2]}, "rank_pattern"),
    ("rank_pattern float", {"rank_pattern": {"q_proj": 2.5}}, "rank_pattern"),
    ("rank_pattern key", {"rank_pattern": {"(": 4}}, "rank_pattern"),
    ("alpha_pattern string", {"alpha_pattern": {"q_proj": "x"}}, "alpha_pattern"),
    ("alpha_pattern NaN", {"alpha_pattern": {"q_proj": NAN}}, "alpha_pattern"),
    ("alpha_pattern 1e308", {"alpha_pattern": {"q_proj": 1e308}}, "alpha_pattern"),
    ("auto_mapping string", {"auto_mapping": "x"}, "auto_mapping"),
    ("use_rslora string", {"use_rslora": "yes"}, "use_rslora"),
    ("use_dora string", {"use_dora": "false"}, "use_dora"),
    ("fan_in_fan_out number", {"fan_in_fan_out": 0}, "fan_in_fan_out"),
    ("target_modules number", {"target_modules": 5}, "target_modules"),
    ("lora_dropout 2", {"lora_dropout": 2}, "lora_dropout"),
    ("layers_to_transform string", {"layers_to_transform": "x"}, "layers_to_transform"),
    ("peft_type number", {"peft_type": 5}, "peft_type"),
    ("config a list", None, "expected a JSON object"),
]


@pytest.mark.parametrize(
    ("case", "changes", "field"), BAD_FIELDS, ids=[case for case, _, _ in BAD_FIELDS]
)
def test_bad_config_fields_are_refused_naming_the_field(
    adapter, spec, tmp_path, case, changes, field
):
    raw = "[1, 2]" if changes is None else None
    folder = _with_config(adapter, tmp_path, raw=raw, **(changes or {}))
    with pytest.raises(AdapterValidationError, match=field) as error:
        load_peft_adapter(folder, spec, max_rank=16)
    assert str(folder) in str(error.value)


def test_deeply_nested_or_huge_number_json_is_refused(adapter, spec, tmp_path):
    nested = _with_config(adapter, tmp_path, raw="[" * 100_000 + "]" * 100_000)
    with pytest.raises(AdapterValidationError, match="JSON"):
        load_peft_adapter(nested, spec, max_rank=16)
    digits = _with_config(adapter, tmp_path / "d", raw='{"r": ' + "9" * 5000 + "}")
    with pytest.raises(AdapterValidationError, match="JSON"):
        load_peft_adapter(digits, spec, max_rank=16)


def test_scaling_and_weights_must_fit_the_serving_dtype(adapter, spec, tmp_path):
    big_alpha = _with_config(adapter, tmp_path, lora_alpha=1e6)  # scaling 2.5e5 > fp16 max
    assert load_peft_adapter(big_alpha, spec, 16, torch.float32).modules
    with pytest.raises(AdapterValidationError, match=r"lora_alpha gives .* float16"):
        load_peft_adapter(big_alpha, spec, 16, torch.float16)

    huge = tmp_path / "huge"
    huge.mkdir()
    (huge / CONFIG_FILE).write_bytes((adapter / CONFIG_FILE).read_bytes())
    tensors = load_file(str(adapter / WEIGHTS_FILE))
    tensors["base_model.model.model.layers.0.mlp.up_proj.lora_A.weight"][0, 0] = 1e5
    save_file(tensors, str(huge / WEIGHTS_FILE))
    assert load_peft_adapter(huge, spec, 16, torch.bfloat16).modules
    with pytest.raises(AdapterValidationError, match=r"up_proj\.lora_A holds values over"):
        load_peft_adapter(huge, spec, 16, torch.float16)


def test_all_linear_and_nulls_are_accepted(adapter, spec, tmp_path):
    folder = _with_config(
        adapter,
        tmp_path,
        target_modules="all-linear",
        rank_pattern=None,
        alpha_pattern=None,
        auto_mapping=None,
        use_rslora=None,
    )
    assert len(load_peft_adapter(folder, spec, max_rank=16).modules) == 2 * 7
