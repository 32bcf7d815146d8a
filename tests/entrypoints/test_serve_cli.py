"""`loraplex serve` options: YAML keys, command-line precedence, help text."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from loraplex.cli import build_parser
from loraplex.entrypoints.serve_cli import engine_config, resolve_options

REPO = Path(__file__).resolve().parents[2]


def _parse(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["serve", *argv])


def test_defaults_serve_the_embedded_model_on_loopback():
    values = resolve_options(_parse())
    assert (values["host"], values["port"], values["model"]) == ("127.0.0.1", 8000, None)
    config = engine_config(values)
    assert config.cache.enable_prefix_caching and config.model.model is None


def test_the_shipped_yaml_matches_the_defaults():
    assert resolve_options(_parse("--config", str(REPO / "configs/serve.yaml"))) == (
        resolve_options(_parse())
    )


def test_flags_override_yaml(tmp_path):
    path = tmp_path / "serve.yaml"
    path.write_text("port: 9001\nmax_num_seqs: 8\nenable_prefix_caching: false\ndtype: bf16\n")
    values = resolve_options(_parse("--config", str(path), "--port", "9002"))
    assert values["port"] == 9002 and values["max_num_seqs"] == 8
    config = engine_config(values)
    assert config.scheduler.max_num_seqs == 8
    assert not config.cache.enable_prefix_caching
    assert config.model.dtype == "bfloat16"
    assert resolve_options(_parse("--config", str(path), "--enable-prefix-caching"))[
        "enable_prefix_caching"
    ]


@pytest.mark.parametrize(
    ("text", "message"),
    [("prot: 1\n", "unknown option"), ("port: eighty\n", "port must be int"), ("- 1\n", "mapping")],
)
def test_bad_yaml_is_a_clear_error(tmp_path, text, message):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(ValueError, match=message):
        resolve_options(_parse("--config", str(path)))


def test_help_explains_every_option(capsys):
    with pytest.raises(SystemExit):
        _parse("--help")
    text = capsys.readouterr().out
    for flag in ("--model", "--served-model-name", "--dtype", "--max-model-len",
                 "--gpu-memory-utilization", "--num-kv-blocks", "--block-size", "--max-num-seqs",
                 "--max-num-batched-tokens", "--enable-prefix-caching", "--quantization",
                 "--enforce-eager", "--seed", "--host", "--port", "--config",
                 "--max-request-body-bytes", "--api-server-count"):  # fmt: skip
        assert flag in text
    assert "min(4, max(1, cores // 4))" in " ".join(text.split())  # the default's rule


def test_speculative_config_from_the_command_line_and_yaml(tmp_path):
    flag = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}'
    config = engine_config(resolve_options(_parse("--speculative-config", flag)))
    assert config.speculative is not None
    assert (config.speculative.num_speculative_tokens, config.speculative.prompt_lookup_max) == (
        4, 3,
    )  # fmt: skip
    path = tmp_path / "serve.yaml"
    path.write_text("speculative_config:\n  method: ngram\n  num_speculative_tokens: 2\n")
    config = engine_config(resolve_options(_parse("--config", str(path))))
    assert config.speculative is not None and config.speculative.num_speculative_tokens == 2


def test_a_bad_speculative_config_exits_2_with_the_reason(capsys):
    from loraplex.cli import main

    assert main(["serve", "--speculative-config", '{"method": "eagle"}']) == 2
    err = capsys.readouterr().err
    assert "loraplex serve: error:" in err and "num_speculative_tokens" in err
    assert main(["serve", "--speculative-config", "{nope"]) == 2
    assert "not valid JSON" in capsys.readouterr().err


def test_lora_modules_from_the_command_line_and_yaml(tmp_path):
    from loraplex.entrypoints.serve_cli import server_settings

    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "adapter_config.json").write_text("{}")
    values = resolve_options(
        _parse("--lora-modules", f"a={tmp_path / 'a'}",
               json.dumps({"name": "b", "path": str(tmp_path / "b")}))
    )  # fmt: skip
    assert [m.name for m in server_settings(values).lora_modules] == ["a", "b"]
    path = tmp_path / "serve.yaml"
    path.write_text(
        f"lora_modules:\n  - a={tmp_path / 'a'}\n  - name: b\n    path: {tmp_path / 'b'}\n"
    )
    values = resolve_options(_parse("--config", str(path)))
    assert [m.path for m in server_settings(values).lora_modules] == [
        str((tmp_path / "a").resolve()), str((tmp_path / "b").resolve())
    ]  # fmt: skip
    path.write_text("lora_modules: a=/x\n")
    with pytest.raises(ValueError, match="lora_modules must be a list"):
        resolve_options(_parse("--config", str(path)))
