"""Default sampling parameters as vLLM reads them: the model folder's generation_config.json
(`--generation-config auto`), none (`vllm`), another folder's, and the operator's overrides
(`--override-generation-config`, Hugging Face's names) over them."""

from __future__ import annotations

import json

import pytest

from loraplex.config import ModelConfig
from loraplex.platform.core.generation_defaults import GenerationDefaults
from loraplex.platform.models.generation_config import read_generation_defaults


def _folder(path, **config):
    path.mkdir()
    (path / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, **config}))
    return path


def test_the_models_folder_sets_the_defaults_by_vllms_names(tmp_path):
    model = _folder(tmp_path / "m", temperature=0.6, top_p=0.9, max_new_tokens=256, do_sample=True)
    defaults = read_generation_defaults(model)
    assert defaults.given() == {"temperature": 0.6, "top_p": 0.9, "max_tokens": 256}
    assert read_generation_defaults(model, "vllm") == GenerationDefaults()
    other = _folder(tmp_path / "other", top_k=20)
    assert read_generation_defaults(model, str(other)).given() == {"top_k": 20}


def test_overrides_take_the_place_of_what_the_file_sets(tmp_path):
    model = _folder(tmp_path / "m", temperature=0.6, max_new_tokens=256)
    defaults = read_generation_defaults(model, "auto", {"max_new_tokens": 32, "min_p": 0.1})
    assert defaults.given() == {"temperature": 0.6, "max_tokens": 32, "min_p": 0.1}
    assert read_generation_defaults(model, "vllm", {"temperature": 0.0}).given() == {
        "temperature": 0.0
    }


def test_a_model_without_a_generation_config_has_no_defaults(tmp_path):
    (tmp_path / "bare").mkdir()
    assert read_generation_defaults(tmp_path / "bare") == GenerationDefaults()
    config_file = tmp_path / "config.json"  # a random-weight model's bare config.json
    config_file.write_text("{}")
    assert read_generation_defaults(config_file) == GenerationDefaults()


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"max_tokens": 5}, "unknown key"),  # vLLM's name: refused, not silently ignored
        ({"temperature": "hot"}, "temperature must be a number"),
        ({"max_new_tokens": 2.5}, "max_new_tokens must be an integer"),
        ({"top_p": 1.5}, "top_p"),
        ({"max_new_tokens": 0}, "max_tokens"),
    ],
)
def test_bad_overrides_are_refused_naming_the_key(overrides, message):
    with pytest.raises(ValueError, match=message):
        ModelConfig(override_generation_config=overrides)


def test_overrides_as_json_text_and_a_folder_without_the_file(tmp_path):
    config = ModelConfig(override_generation_config='{"max_new_tokens": 64}')
    assert config.generation_overrides == {"max_new_tokens": 64}
    with pytest.raises(ValueError, match="not valid JSON"):
        ModelConfig(override_generation_config="{nope")
    with pytest.raises(ValueError, match="no generation_config.json"):
        read_generation_defaults(tmp_path, str(tmp_path))


def test_max_tokens_defaults_are_capped_at_the_rest_of_the_context():
    defaults = GenerationDefaults(max_tokens=100)
    assert defaults.max_tokens_for(None, 10, 512) == 100
    assert defaults.max_tokens_for(None, 450, 512) == 62
    assert defaults.max_tokens_for(7, 450, 512) == 7  # a request's own value wins
    assert GenerationDefaults().max_tokens_for(None, 12, 512) == 500
