"""`loraplex serve`: options (named as vLLM names them), an optional YAML file, and uvicorn.

Precedence: a flag given on the command line, then the YAML file's key (the option's name with
underscores), then the default shown in `--help`.
"""

from __future__ import annotations

import argparse
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from loraplex.config import EngineConfig

if TYPE_CHECKING:
    from loraplex.platform.api.settings import ServerSettings

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Option:
    flag: str
    default: Any
    help: str
    type: Any = str
    boolean: bool = False
    json_object: bool = False  # JSON text on the command line; in YAML a mapping or JSON text
    multiple: bool = False  # one or more values on the command line; in YAML a list

    @property
    def key(self) -> str:
        return self.flag.lstrip("-").replace("-", "_")


_OPTIONS = (
    _Option("--model", None, "Hugging Face-layout model folder (default: the embedded "
            "SmolLM2-135M-Instruct, converted on first use)"),
    _Option("--served-model-name", None, "the name clients put in `model` (default: the model "
            "folder's name, e.g. SmolLM2-135M-Instruct)"),
    _Option("--dtype", "auto", "weights and activations: auto, float32, bfloat16 or float16 "
            "(auto: bfloat16 on CUDA, float32 on CPU)"),
    _Option("--max-model-len", None, "context length: prompt plus completion tokens "
            "(default: the model's own)", int),
    _Option("--quantization", None, "quantize at load (fp8); AWQ / GPTQ / FP8 checkpoints are "
            "detected from their config"),
    _Option("--device", "auto", "auto, cpu, cuda or cuda:N"),
    _Option("--tensor-parallel-size", 1, "split the model over this many GPUs of the host "
            "(ranks; CPU processes on CPU); it must divide the attention heads, and the KV heads "
            "or be a multiple of them", int),
    _Option("--seed", 0, "the engine's base random seed", int),
    _Option("--gpu-memory-utilization", 0.9, "on CUDA, the fraction of GPU memory for weights "
            "plus KV cache; the KV cache gets what is left", float),
    _Option("--cpu-kv-cache-gib", 1.0, "on CPU, GiB of KV cache", float),
    _Option("--num-kv-blocks", None, "KV-cache blocks, overriding the memory-based size "
            "(a KV budget of num_kv_blocks * block_size tokens)", int),
    _Option("--block-size", 16, "tokens per KV-cache block (a power of two)", int),
    _Option("--enable-prefix-caching", True, "reuse the KV blocks of shared prompt prefixes",
            boolean=True),
    _Option("--max-num-seqs", 256, "the most sequences in one running batch", int),
    _Option("--max-num-batched-tokens", 2048, "the most tokens one engine step computes "
            "(longer prompts are prefilled in chunks)", int),
    _Option("--long-prefill-token-threshold", None, "the most prompt tokens one request "
            "prefills in a step while others run or wait, so a long prompt shares the step; the "
            "same number is kept for admitting waiting requests (default: a quarter of "
            "--max-num-batched-tokens; 0: no cap)", int),
    _Option("--request-stall-timeout-s", 600.0, "end a request that makes no progress (no "
            "prefill chunk, no token, not admitted) for this many seconds, with a 503 "
            "request_stalled; 0 disables", float),
    _Option("--enforce-eager", False, "never capture CUDA graphs", boolean=True),
    _Option("--async-scheduling", None, "schedule and prepare step N+1 while the GPU runs step "
            "N (default: on for CUDA; requests with penalties or a grammar run steps in lock "
            "step)", boolean=True),
    _Option("--speculative-config", None, "speculative decoding, as a JSON object (vLLM's "
            "shape): '{\"method\": \"ngram\", \"num_speculative_tokens\": 4, "
            "\"prompt_lookup_max\": 4}' or '{\"model\": PATH, \"num_speculative_tokens\": 3}'; "
            "\"disable_by_batch_size\": N turns it off while N or more requests run (default: "
            "off)", json_object=True),
    _Option("--enable-lora", True, "serve LoRA adapters (slots are reserved at start)",
            boolean=True),
    _Option("--max-loras", 8, "adapters resident on the device at once (slots)", int),
    _Option("--max-lora-rank", 64, "the largest adapter rank accepted", int),
    _Option("--max-cpu-loras", 32, "adapters kept in host memory", int),
    _Option("--max-saved-module-loras", 0, "of the --max-loras slots, how many can hold an "
            "adapter with modules_to_save (embed_tokens / lm_head) or trainable_token_indices; "
            "each keeps full copies of both (2 x vocab x hidden); 0 refuses such adapters", int),
    _Option("--grammar-compile-timeout", 30.0, "seconds one JSON schema / regex may take to "
            "compile; slower ones answer 400", float),
    _Option("--grammar-compile-memory-mib", 4096, "memory one grammar compile may use; more "
            "answers 400", int),
    _Option("--grammar-cold-start", True, "a JSON schema's first requests start under "
            "llguidance (milliseconds to compile) while outlines-core compiles, and hand over "
            "to it mid-output", boolean=True),
    _Option("--host", "127.0.0.1", "address to listen on (0.0.0.0: every interface)"),
    _Option("--port", 8000, "TCP port to listen on", int),
    _Option("--api-server-count", None, "API server processes sharing the port (auth, "
            "tokenization, detokenization, SSE), beside the one engine-core process; tenants' "
            "caps hold across them (default: one per 4 usable cores, 1 to 4: min(4, max(1, "
            "cores // 4)))", int),
    _Option("--shutdown-timeout", 30.0, "on SIGTERM / Ctrl-C, seconds in-flight requests may "
            "run on; then they end with a 503 error and the server exits", float),
    _Option("--max-request-body-bytes", 4 * 1024 * 1024, "larger request bodies answer 413",
            int),
    _Option("--uvicorn-log-level", "info", "uvicorn's log level (debug, info, warning, error)"),
    _Option("--data-dir", None, "the adapter registry and tenants (default: LORAPLEX_DATA_DIR, "
            "else ~/.local/share/loraplex)"),
    _Option("--adapter-registry", "local", "where adapters and their catalogue live: local (the "
            "data dir), file:///shared/folder (a folder every replica mounts: adapters, catalogue "
            "and tenants) or s3://bucket/prefix (S3-compatible, through boto3: AWS_ENDPOINT_URL, "
            "credentials); a shared one serves every adapter uploaded through any replica"),
    _Option("--tenants", None, "a YAML file of static tenants, keys as SHA-256 hashes (e.g. "
            "configs/tenants.yaml); with no tenant and no admin key the server is open"),
    _Option("--admin-key", None, "the admin API key, which manages tenants (default: "
            "LORAPLEX_ADMIN_KEY)"),
    _Option("--max-adapter-bytes", 512 * 1024 * 1024, "the largest adapter upload", int),
    _Option("--max-n", 16, "the most samples per prompt (`n`) one request may ask for; more "
            "answers 400", int),
    _Option("--max-prompts-per-request", 64, "the most prompts one /v1/completions request may "
            "hold; more answers 400", int),
    _Option("--lora-modules", None, "adapters every tenant may name from start-up, as vLLM's: "
            "name=path or a JSON object {\"name\", \"path\", \"base_model_name\"}, one or "
            "more (default: none)", multiple=True),
    _Option("--tool-call-parser", None, "how the model writes tool calls: hermes, qwen, "
            "llama3_json or mistral (default: the one its chat template shows, else hermes)"),
)  # fmt: skip
_KEYS = {option.key for option in _OPTIONS}
# Options the HTTP server itself uses; every other option configures the engine.
_SERVER_KEYS = {"host", "port", "max_request_body_bytes", "uvicorn_log_level", "data_dir",
                "adapter_registry",
                "api_server_count", "shutdown_timeout",
                "tenants", "admin_key", "max_adapter_bytes", "max_n",
                "max_prompts_per_request", "tool_call_parser", "lora_modules"}  # fmt: skip
_ENGINE_KEYS = sorted(_KEYS - _SERVER_KEYS)


def add_serve_parser(
    subparsers: argparse._SubParsersAction, name: str = "serve"
) -> argparse.ArgumentParser:
    """Add `serve` (or another command taking the same options) to the `loraplex` command."""
    parser = subparsers.add_parser(
        name,
        help="serve the OpenAI-compatible API (default: the embedded model on 127.0.0.1:8000)",
        description="Serve a model through an OpenAI-compatible HTTP API: /v1/models, "
        "/v1/completions, /v1/chat/completions, /health and /metrics.",
        epilog="A flag given here overrides the same key in --config, which overrides the "
        "default shown.",
    )
    parser.add_argument(
        "--config",
        default=None,
        help="a YAML file whose keys are these options with underscores (e.g. configs/serve.yaml)",
    )
    for option in _OPTIONS:
        shown = (
            option.help
            if "default:" in option.help
            else f"{option.help} (default: {option.default})"
        )
        if option.boolean:
            parser.add_argument(
                option.flag, action=argparse.BooleanOptionalAction, default=None, help=shown
            )
        elif option.multiple:
            parser.add_argument(option.flag, nargs="+", default=None, help=shown)
        else:
            parser.add_argument(option.flag, type=option.type, default=None, help=shown)
    return parser


def load_yaml_options(path: str | Path) -> dict[str, Any]:
    """The option values of a YAML file; ValueError for unknown keys or a non-mapping file."""
    import yaml

    text = Path(path).read_text()
    data = yaml.safe_load(text) or {}
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a mapping of option names to values")
    data = {str(k).replace("-", "_"): v for k, v in data.items()}
    unknown = sorted(set(data) - _KEYS)
    if unknown:
        raise ValueError(f"{path}: unknown option(s) {unknown}; known: {sorted(_KEYS)}")
    for option in _OPTIONS:
        value = data.get(option.key)
        if value is None:
            continue
        if option.json_object and isinstance(value, dict):
            continue
        if option.multiple:
            if not isinstance(value, list):
                raise ValueError(f"{path}: {option.key} must be a list, got {value!r}")
            data[option.key] = value
            continue
        expected = bool if option.boolean else option.type
        if expected is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if not isinstance(value, expected) or (expected is not bool and isinstance(value, bool)):
            raise ValueError(f"{path}: {option.key} must be {expected.__name__}, got {value!r}")
        data[option.key] = value
    return data


def resolve_options(args: argparse.Namespace) -> dict[str, Any]:
    """Every option's value: the command line, else the YAML file, else the default."""
    from_file = load_yaml_options(args.config) if args.config else {}
    values = {}
    for option in _OPTIONS:
        given = getattr(args, option.key)
        values[option.key] = (
            given if given is not None else from_file.get(option.key, option.default)
        )
    return values


def engine_config(values: dict[str, Any]) -> EngineConfig:
    """The engine's options among the resolved serve options (the rest are the server's)."""
    return EngineConfig.from_options(**{k: values[k] for k in _ENGINE_KEYS})


def server_settings(values: dict[str, Any]) -> ServerSettings:
    """The HTTP side's settings among the resolved serve options."""
    from loraplex.entrypoints.lora_modules import parse_lora_modules
    from loraplex.platform.api.settings import ServerSettings

    return ServerSettings(
        host=values["host"],
        port=values["port"],
        max_request_body_bytes=values["max_request_body_bytes"],
        data_dir=values["data_dir"],
        adapter_registry=values["adapter_registry"],
        tenants_file=values["tenants"],
        admin_key=values["admin_key"],
        max_adapter_bytes=values["max_adapter_bytes"],
        max_n=values["max_n"],
        max_prompts_per_request=values["max_prompts_per_request"],
        tool_call_parser=values["tool_call_parser"],
        lora_modules=parse_lora_modules(values["lora_modules"]),
    )


def run_serve(args: argparse.Namespace) -> int:
    """Start the engine-core process and the API processes; serve until SIGTERM / Ctrl-C
    (exit status 0) or a process death (1). See `launcher`."""
    from loraplex.entrypoints.launcher import (
        API_SERVER_COUNT_RULE,
        Launcher,
        default_api_server_count,
        usable_cores,
    )

    values = resolve_options(args)
    count = values["api_server_count"]
    chosen = "given" if count is not None else f"{API_SERVER_COUNT_RULE}, {usable_cores()} cores"
    launcher = Launcher(
        engine_config(values),
        server_settings(values),
        api_server_count=default_api_server_count() if count is None else count,
        shutdown_timeout_s=values["shutdown_timeout"],
        uvicorn_options={"log_level": values["uvicorn_log_level"]},
    )
    logger.info(
        "starting the engine core and %d API process(es) (%s) for http://%s:%d",
        launcher.api_server_count,
        chosen,
        values["host"],
        values["port"],
    )
    return launcher.run()
