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
    assert "min(4, max(1, usable cores // 4))" in " ".join(text.split())  # the default's rule


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


def test_the_model_as_a_positional_argument_as_vllm_serve_takes_it(tmp_path):

    assert resolve_options(_parse("/models/x"))["model"] == "/models/x"
    assert resolve_options(_parse("/models/x", "--model", "/models/x"))["model"] == "/models/x"
    assert engine_config(resolve_options(_parse("/models/x"))).model.model == "/models/x"
    with pytest.raises(ValueError, match="given twice"):
        resolve_options(_parse("/models/x", "--model", "/models/y"))


def test_both_models_given_exit_2_with_the_reason(capsys):
    from loraplex.cli import main

    assert main(["serve", "/models/x", "--model", "/models/y"]) == 2
    err = capsys.readouterr().err
    assert "loraplex serve: error:" in err and "/models/x" in err and "/models/y" in err


def test_help_shows_one_default_per_option_and_no_stale_claims(capsys):
    with pytest.raises(SystemExit):
        _parse("--help")
    text = " ".join(capsys.readouterr().out.split())
    assert "(default: None)" not in text and "default 1;" not in text
    assert "penalties" not in text  # penalties no longer force lock step
    for flag in ("--enable-lora", "--max-loras", "--max-lora-rank", "--tool-call-parser",
                 "--generation-config", "--override-generation-config", "--admin-key-file",
                 "--allow-runtime-lora-updating", "MODEL"):  # fmt: skip
        assert flag in text
    for parser in ("hermes", "qwen", "llama3_json", "mistral"):  # the registry's names
        assert parser in text
    assert "/v1/responses" in text and "/openapi.json" in text


def test_the_readme_options_table_is_the_parsers():
    """The README's table is rendered from the parser: this fails when one changes without
    the other (`python -m loraplex.entrypoints.serve_options_table` rewrites it)."""
    from loraplex.entrypoints.serve_options_table import README, options_table, readme_with_table

    text = README.read_text()
    assert readme_with_table(text, options_table()) == text
    for row in ("| `--enable-lora` / `--no-enable-lora` | on |", "| `--max-loras` | 8 |",
                "| `--max-lora-rank` | 64 |", "| `--api-server-count` | min(4, max(1, usable cores"):  # fmt: skip
        assert row in text


def test_the_table_picks_up_a_flag_added_to_the_parser():
    from loraplex.entrypoints.serve_options_table import options_table, serve_parser

    parser = serve_parser()
    parser.add_argument("--new-flag", type=int, help="does something new (default: 3)")
    assert "| `--new-flag` | 3 | does something new |" in options_table(parser)


def test_the_admin_key_from_a_file_not_the_command_line(tmp_path, capsys):
    from loraplex.cli import main
    from loraplex.entrypoints.serve_cli import server_settings

    key_file = tmp_path / "admin.key"
    key_file.write_text("sk-from-file\n")
    settings = server_settings(resolve_options(_parse("--admin-key-file", str(key_file))))
    assert settings.admin_key == "sk-from-file"
    with pytest.raises(ValueError, match="once"):
        server_settings(resolve_options(_parse("--admin-key-file", str(key_file),
                                               "--admin-key", "x")))  # fmt: skip
    empty = tmp_path / "empty.key"
    empty.write_text("\n")
    assert main(["serve", "--admin-key-file", str(empty)]) == 2
    assert "holds no key" in capsys.readouterr().err
    assert main(["serve", "--admin-key-file", str(tmp_path / "missing")]) == 2
    assert "--admin-key-file" in capsys.readouterr().err


def test_the_isolation_options_reach_the_server_settings():
    from loraplex.entrypoints.serve_cli import server_settings

    defaults = server_settings(resolve_options(_parse()))
    assert (defaults.metrics_key, defaults.metrics_public_adapter_names) == (None, False)
    assert (defaults.chat_template_timeout_s, defaults.request_read_timeout_s) == (5.0, 30.0)
    assert (defaults.max_concurrent_uploads, defaults.timeout_keep_alive_s) == (2, 5)
    values = resolve_options(_parse(
        "--metrics-key", "sk-m", "--metrics-public-adapter-names", "--chat-template-timeout",
        "0.5", "--chat-template-workers", "3", "--max-concurrent-uploads", "1",
        "--request-read-timeout", "7", "--timeout-keep-alive", "2",
    ))  # fmt: skip
    settings = server_settings(values)
    assert settings.metrics_key == "sk-m" and settings.metrics_public_adapter_names
    assert (settings.chat_template_timeout_s, settings.chat_template_workers) == (0.5, 3)
    assert (settings.max_concurrent_uploads, settings.request_read_timeout_s) == (1, 7.0)
    assert settings.timeout_keep_alive_s == 2
    with pytest.raises(ValueError, match="chat_template_workers"):
        server_settings({**values, "chat_template_workers": 0})
    with pytest.raises(ValueError, match="served_model_name"):
        engine_config({**values, "served_model_name": "evil\nname"})
