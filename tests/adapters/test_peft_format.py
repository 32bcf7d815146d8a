"""PEFT adapter loading: good adapters load with PEFT's scaling; bad ones are refused clearly."""

from __future__ import annotations

import json
import logging
import math
import pickle
import re
from pathlib import Path

import pytest
import torch
from lora_fixtures import HF_CONFIG, make_peft_adapter, tiny_llama
from safetensors.torch import load_file, save_file

from loraplex.adapters.peft_format import (
    CONFIG_FILE,
    WEIGHTS_FILE,
    AdapterValidationError,
    BaseModelSpec,
    load_peft_adapter,
)


def _edit_config(folder: Path, **changes) -> None:
    config = json.loads((folder / CONFIG_FILE).read_text())
    config.update(changes)
    (folder / CONFIG_FILE).write_text(json.dumps(config))


def _edit_tensors(folder: Path, edit) -> None:
    tensors = load_file(str(folder / WEIGHTS_FILE))
    edit(tensors)
    save_file(tensors, str(folder / WEIGHTS_FILE))


def test_loads_every_module_with_peft_scaling(make_adapter, spec):
    folder = make_adapter(r=4, lora_alpha=8)
    weights = load_peft_adapter(folder, spec, max_rank=16)
    assert len(weights.modules) == 2 * 7
    q = weights.modules[(1, "q_proj")]
    assert q.a.shape == (4, 64) and q.b.shape == (64, 4) and q.a.dtype == torch.float32
    assert q.scaling == pytest.approx(2.0)
    assert weights.modules[(0, "down_proj")].a.shape == (4, 96)
    assert weights.rank == 4 and len(weights.digest) == 64
    assert q.b.abs().sum() > 0


def test_rslora_scales_by_square_root_of_rank(make_adapter, spec):
    weights = load_peft_adapter(make_adapter(r=16, lora_alpha=8, use_rslora=True), spec, 16)
    assert weights.modules[(0, "v_proj")].scaling == pytest.approx(8 / math.sqrt(16))


def test_rank_and_alpha_patterns_match_peft(tmp_path, spec):
    from peft import PeftModel

    folder = make_peft_adapter(
        tmp_path / "a",
        r=4,
        lora_alpha=8,
        rank_pattern={"down_proj": 2},
        alpha_pattern={"q_proj": 3},
    )
    weights = load_peft_adapter(folder, spec, max_rank=8)
    peft_model = PeftModel.from_pretrained(tiny_llama(), str(folder))
    for (layer, module), ours in weights.modules.items():
        block = "self_attn" if module in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
        theirs = getattr(getattr(peft_model.base_model.model.model.layers[layer], block), module)
        assert ours.rank == theirs.r["default"]
        assert ours.scaling == pytest.approx(theirs.scaling["default"])
    assert weights.modules[(0, "down_proj")].rank == 2
    assert weights.modules[(0, "q_proj")].scaling == pytest.approx(0.75)


def test_layers_to_transform_subset_is_accepted(make_adapter, spec):
    weights = load_peft_adapter(make_adapter(layers_to_transform=[1]), spec, 16)
    assert {layer for layer, _ in weights.modules} == {1}


def test_base_model_name_mismatch_only_warns(make_adapter, spec, caplog):
    folder = make_adapter()
    _edit_config(folder, base_model_name_or_path="someone/other-model")
    with caplog.at_level(logging.WARNING):
        load_peft_adapter(folder, spec, 16)
    assert "someone/other-model" in caplog.text


class _Boom:
    """Unpickling this object creates a file: proof that something was unpickled."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def test_pickle_checkpoint_is_refused_without_unpickling(make_adapter, spec, tmp_path):
    folder = make_adapter()
    (folder / WEIGHTS_FILE).unlink()
    marker = tmp_path / "unpickled"
    (folder / "adapter_model.bin").write_bytes(pickle.dumps(_Boom(marker)))
    with pytest.raises(AdapterValidationError, match="pickle"):
        load_peft_adapter(folder, spec, 16)
    with pytest.raises(AdapterValidationError, match="pickle"):
        load_peft_adapter(folder / "adapter_model.bin", spec, 16)
    assert not marker.exists()


def _truncate(folder: Path) -> None:
    data = (folder / WEIGHTS_FILE).read_bytes()
    (folder / WEIGHTS_FILE).write_bytes(data[: len(data) - 100])


def _nan(folder: Path) -> None:
    def edit(t):
        t["base_model.model.model.layers.1.mlp.up_proj.lora_B.weight"][3, 1] = float("nan")

    _edit_tensors(folder, edit)


def _embed_tokens(folder: Path) -> None:
    def edit(t):
        t["base_model.model.model.embed_tokens.lora_embedding_A"] = torch.ones(4, 128)

    _edit_tensors(folder, edit)


def _short_lm_head(folder: Path) -> None:
    def edit(t):
        key = "base_model.model.lm_head.lora_B.weight"
        t[key] = t[key][:-1].contiguous()  # one vocabulary row short

    _edit_tensors(folder, edit)


def _no_magnitude(folder: Path) -> None:
    _edit_tensors(
        folder,
        lambda t: t.pop("base_model.model.model.layers.1.mlp.up_proj.lora_magnitude_vector"),
    )


def _resized_vocabulary(folder: Path) -> None:
    def edit(t):
        t["base_model.model.model.embed_tokens.base_layer.weight"] = torch.zeros(130, 64)

    _edit_tensors(folder, edit)


def _missing_b(folder: Path) -> None:
    _edit_tensors(
        folder, lambda t: t.pop("base_model.model.model.layers.0.self_attn.k_proj.lora_B.weight")
    )


def _extra_layer(folder: Path) -> None:
    def edit(t):
        t["base_model.model.model.layers.5.self_attn.q_proj.lora_A.weight"] = torch.ones(4, 64)

    _edit_tensors(folder, edit)


BAD_ADAPTERS = [
    # (name, adapter options, edit of the saved folder, expected message)
    ("truncated", {}, _truncate, "truncated or corrupt"),
    ("wrong shapes", {"model_overrides": {"hidden_size": 32}}, None, "expected"),
    (
        "lm_head short",
        {"target_modules": ["q_proj", "lm_head"]},
        _short_lm_head,
        "lm_head has lora_A",
    ),
    ("embed_tokens", {}, _embed_tokens, "embed_tokens"),
    ("rank over max", {"r": 32}, None, "max_lora_rank=16"),
    ("nan weights", {}, _nan, "layers.1.mlp.up_proj.lora_B holds NaN"),
    ("missing config", {}, lambda f: (f / CONFIG_FILE).unlink(), "missing adapter_config.json"),
    ("missing weights", {}, lambda f: (f / WEIGHTS_FILE).unlink(), "missing adapter_model"),
    ("missing lora_B", {}, _missing_b, "k_proj has no lora_B"),
    ("layer beyond model", {}, _extra_layer, "layer 5"),
    (
        "added tokens",
        {"target_modules": ["q_proj", "embed_tokens"]},
        _resized_vocabulary,
        "adapters that resize the vocabulary",
    ),
    ("dora without magnitude", {"use_dora": True}, _no_magnitude, "up_proj has no lora_magn"),
    (
        "dora on lm_head",
        {"use_dora": True, "target_modules": ["q_proj", "lm_head"]},
        None,
        "on lm_head is not supported",
    ),
    (
        "modules_to_save without copy slots",
        {"modules_to_save": ["lm_head"]},
        None,
        "needs a slot holding full embed_tokens / lm_head copies",
    ),
    (
        "trainable tokens without copy slots",
        {"trainable_token_indices": [3, 5]},
        None,
        "start it with --max-saved-module-loras",
    ),
    ("bias", {"bias": "all"}, None, "bias='all'"),
    ("rank disagrees with config", {}, lambda f: _edit_config(f, r=8), "config.json says 8"),
    (
        "other architecture",
        {},
        lambda f: _edit_config(f, auto_mapping={"base_model_class": "GPT2LMHeadModel"}),
        "GPT2LMHeadModel",
    ),
    ("not lora", {}, lambda f: _edit_config(f, peft_type="IA3"), "not LORA"),
]


def test_spec_from_hf_config_sizes():
    spec = BaseModelSpec.from_hf_config(
        {
            "hidden_size": 4096,
            "intermediate_size": 14336,
            "num_hidden_layers": 32,
            "num_attention_heads": 32,
            "num_key_value_heads": 8,
        }
    )
    assert spec.module_shape("k_proj") == (4096, 1024)
    assert spec.module_shape("down_proj") == (14336, 4096)


def test_staged_weights_share_one_buffer_and_keep_their_values(make_adapter, spec):
    weights = load_peft_adapter(make_adapter("a", r=4), spec, 8, torch.float32)
    staged = weights.to(torch.bfloat16)
    storages = {t.untyped_storage().data_ptr() for m in staged.modules.values() for t in (m.a, m.b)}
    assert len(storages) == 1  # one (page-locked, on CUDA) allocation per adapter
    for key, module in weights.modules.items():
        copy = staged.modules[key]
        assert copy.a.dtype == torch.bfloat16 and copy.b.T.is_contiguous()
        assert torch.equal(copy.a, module.a.to(torch.bfloat16))
        assert torch.equal(copy.b, module.b.to(torch.bfloat16))
        assert copy.scaling == module.scaling


def _nan_copy(folder: Path) -> None:
    def edit(t):
        t["base_model.model.lm_head.weight"][3, 4] = float("nan")

    _edit_tensors(folder, edit)


def _short_rows(folder: Path) -> None:
    key = "base_model.model.model.embed_tokens.token_adapter.trainable_tokens_delta"
    _edit_tensors(folder, lambda t: t.update({key: t[key][:1]}))


BAD_EXTRAS = [
    # (name, adapter options, edit of the saved folder, expected message)
    ("norm", {"modules_to_save": ["norm"]}, None, "'norm' is not supported: only full copies"),
    ("classifier", {"modules_to_save": ["score"]}, None, "'score' is not supported"),
    (
        "resized lm_head copy",
        {"modules_to_save": ["lm_head"], "model_overrides": {"vocab_size": 136}},
        None,
        "lm_head.weight has 136 rows (a resized vocabulary), the base model's vocabulary has 128",
    ),
    (
        "token id past the vocabulary",
        {"trainable_token_indices": [3, 130], "model_overrides": {"vocab_size": 160}},
        None,
        "holds id 130, the base model's vocabulary has 128 tokens: adapters that add tokens",
    ),
    ("rows of a wrong shape", {"trainable_token_indices": [3, 5]}, _short_rows, "expected (2, 64)"),
    ("non-finite copy", {"modules_to_save": ["lm_head"]}, _nan_copy, "lm_head.weight holds NaN"),
    (
        "copy the config does not list",
        {"modules_to_save": ["lm_head"]},
        lambda f: _edit_config(f, modules_to_save=None),
        "modules_to_save does not list it",
    ),
    (
        "listed copy missing",
        {},
        lambda f: _edit_config(f, modules_to_save=["embed_tokens"]),
        "embed_tokens.weight is missing",
    ),
    (
        "duplicate token ids",
        {},
        lambda f: _edit_config(f, trainable_token_indices=[3, 3]),
        "distinct token ids",
    ),
]


#: every case, with the slots for module copies it is loaded with
REFUSED = [(*case, 0) for case in BAD_ADAPTERS] + [(*case, 1) for case in BAD_EXTRAS]


@pytest.mark.parametrize(
    ("name", "options", "edit", "message", "copy_slots"), REFUSED, ids=[c[0] for c in REFUSED]
)
def test_bad_adapter_is_refused(tmp_path, spec, name, options, edit, message, copy_slots):
    """Refused naming the folder and the fault (with copy slots for module copies, malformed
    copies / rows and added tokens)."""
    folder = make_peft_adapter(tmp_path / "bad", **options)
    if edit is not None:
        edit(folder)
    with pytest.raises(AdapterValidationError, match=re.escape(message)) as error:
        load_peft_adapter(folder, spec, max_rank=16, saved_module_slots=copy_slots)
    assert str(folder) in str(error.value)


def test_saved_copies_and_token_rows_load_as_peft_saved_them(tmp_path, spec):
    from peft import PeftModel

    folder = make_peft_adapter(tmp_path / "a", modules_to_save=["lm_head", "embed_tokens"])
    weights = load_peft_adapter(folder, spec, max_rank=16, saved_module_slots=1)
    peft = PeftModel.from_pretrained(tiny_llama(), str(folder))
    assert weights.needs_saved_module_slot
    assert torch.equal(weights.saved["lm_head"], peft.base_model.model.lm_head.weight)
    embed = peft.base_model.model.model.embed_tokens.weight
    assert torch.equal(weights.saved["embed_tokens"], embed)
    staged = weights.to(torch.bfloat16)
    assert torch.equal(staged.saved["lm_head"], weights.saved["lm_head"].to(torch.bfloat16))

    tied_spec = BaseModelSpec.from_hf_config({**HF_CONFIG, "tie_word_embeddings": True})
    folder = make_peft_adapter(tmp_path / "t", trainable_token_indices=[7, 3, 90])
    weights = load_peft_adapter(folder, tied_spec, max_rank=16, saved_module_slots=1)
    assert weights.tokens["embed_tokens"].indices.tolist() == [7, 3, 90]
    assert weights.tokens["lm_head"] is weights.tokens["embed_tokens"]  # PEFT ties them
    staged = weights.to(torch.bfloat16)
    assert staged.tokens["lm_head"] is staged.tokens["embed_tokens"]
    assert staged.nbytes == weights.nbytes // 2 + 3 * 8 // 2  # bf16 rows; int64 ids kept
    assert "lm_head" not in load_peft_adapter(folder, spec, 16, saved_module_slots=1).tokens
    assert not load_peft_adapter(
        make_peft_adapter(tmp_path / "p"), spec, 16
    ).needs_saved_module_slot
