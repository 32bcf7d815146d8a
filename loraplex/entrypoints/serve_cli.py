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

from loraplex.config import DTYPES, EngineConfig
from loraplex.platform.api.openai.tools.tool_parsers import TOOL_PARSERS

if TYPE_CHECKING:
    from loraplex.platform.api.settings import ServerSettings

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Option:
    flag: str
    default: Any
    meaning: str  # what the option does (`--help` adds the default)
    type: Any = str
    boolean: bool = False
    json_object: bool = False  # JSON text on the command line; in YAML a mapping or JSON text
    multiple: bool = False  # one or more values on the command line; in YAML a list
    shown_default: str | None = None  # the default in words, where the value says too little

    @property
    def key(self) -> str:
        return self.flag.lstrip("-").replace("-", "_")

    @property
    def help(self) -> str:
        """The `--help` text: the meaning, then `(default: ...)`, which the README's options
        table reads back (`serve_options_table`)."""
        shown = self.shown_default
        if shown is None:
            shown = "on" if self.default is True else "off" if self.default is False else None
        if shown is None:
            shown = "none" if self.default is None else str(self.default)
        return f"{self.meaning} (default: {shown})"


_TOOL_PARSERS = ", ".join(TOOL_PARSERS)
_OPTIONS = (
    _Option("--model", None, "Hugging Face-layout model folder; also the positional MODEL, "
            "as `vllm serve MODEL`", shown_default="the embedded SmolLM2-135M-Instruct, "
            "converted on first use"),
    _Option("--served-model-name", None, "the name clients put in `model`",
            shown_default="the model folder's name, e.g. SmolLM2-135M-Instruct"),
    _Option("--dtype", "auto", f"weights and activations: {', '.join(DTYPES)} (auto: bfloat16 "
            "on CUDA, float32 on CPU)"),
    _Option("--max-model-len", None, "context length: prompt plus completion tokens; more than "
            "the model's own is refused", int, shown_default="the model's own"),
    _Option("--generation-config", "auto", "where requests' default sampling parameters come "
            "from: auto (the model folder's generation_config.json), vllm (none) or a folder "
            "holding a generation_config.json; a request's own values win"),
    _Option("--override-generation-config", None, "default sampling parameters over the "
            "generation config's, as a JSON object of Hugging Face's names: max_new_tokens, "
            "temperature, top_p, top_k, min_p, repetition_penalty (e.g. '{\"max_new_tokens\": "
            "256}': a request without max_tokens then stops after 256 tokens)",
            json_object=True),
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
            "(a KV budget of num_kv_blocks * block_size tokens)", int,
            shown_default="from memory"),
    _Option("--block-size", 16, "tokens per KV-cache block (a power of two)", int),
    _Option("--enable-prefix-caching", True, "reuse the KV blocks of shared prompt prefixes",
            boolean=True),
    _Option("--max-num-seqs", 256, "the most sequences in one running batch", int),
    _Option("--max-num-batched-tokens", 2048, "the most tokens one engine step computes "
            "(longer prompts are prefilled in chunks)", int),
    _Option("--long-prefill-token-threshold", None, "the most prompt tokens one request "
            "prefills in a step while others run or wait, so a long prompt shares the step; the "
            "same number is kept for admitting waiting requests, and budget the others leave "
            "goes back to it (0: no cap)", int,
            shown_default="a quarter of --max-num-batched-tokens"),
    _Option("--max-long-partial-prefills", 1, "as vLLM's: how many prompts longer than "
            "--long-prefill-token-threshold are prefilled ahead of shorter waiting ones at once "
            "(the others take what the short ones leave)", int),
    _Option("--request-stall-timeout-s", 600.0, "end a request that makes no progress (no "
            "prefill chunk, no token, not admitted) for this many seconds, with a 503 "
            "request_stalled; 0 disables", float),
    _Option("--enforce-eager", False, "never capture CUDA graphs", boolean=True),
    _Option("--async-scheduling", None, "schedule and launch step N+1 while the device runs "
            "step N (grammar requests too: their masks are filled while the forward pass runs; "
            "speculative steps run in lock step)", boolean=True, shown_default="on for CUDA"),
    _Option("--speculative-config", None, "speculative decoding, as a JSON object (vLLM's "
            "shape): '{\"method\": \"ngram\", \"num_speculative_tokens\": 4, "
            "\"prompt_lookup_max\": 4}' or '{\"model\": PATH, \"num_speculative_tokens\": 3}'; "
            "\"disable_by_batch_size\": N turns it off while N or more requests run",
            json_object=True, shown_default="off"),
    _Option("--enable-lora", True, "serve LoRA adapters (slots are reserved at start)",
            boolean=True),
    _Option("--max-loras", 8, "adapters resident on the device at once (slots)", int),
    _Option("--max-lora-rank", 64, "the largest adapter rank accepted", int),
    _Option("--max-cpu-loras", 32, "adapters kept in host memory", int),
    _Option("--max-saved-module-loras", 0, "of the --max-loras slots, how many can hold an "
            "adapter with modules_to_save (embed_tokens / lm_head) or trainable_token_indices; "
            "each keeps full copies of both (2 x vocab x hidden); 0 refuses such adapters", int),
    _Option("--lora-modules", None, "adapters every tenant may name from start-up, as vLLM's: "
            "name=path or a JSON object {\"name\", \"path\", \"base_model_name\"}, one or "
            "more", multiple=True),
    _Option("--allow-runtime-lora-updating", None, "vLLM's POST /v1/load_lora_adapter and "
            "/v1/unload_lora_adapter load and unload server-wide adapters (as --lora-modules "
            "makes them) at run time", boolean=True, shown_default="VLLM_ALLOW_RUNTIME_LORA_"
            "UPDATING or LORAPLEX_ALLOW_RUNTIME_LORA_UPDATING set to 1 or true, else off"),
    _Option("--grammar-compile-timeout", 30.0, "seconds one JSON schema / regex may take to "
            "compile; slower ones answer 400", float),
    _Option("--grammar-compile-memory-mib", 4096, "memory one grammar compile may use; more "
            "answers 400", int),
    _Option("--grammar-cold-start", True, "a JSON schema's first requests start under "
            "llguidance (milliseconds to compile) while outlines-core compiles, and hand over "
            "to it mid-output", boolean=True),
    _Option("--tool-call-parser", None, f"how the model writes tool calls: {_TOOL_PARSERS}",
            shown_default="the one its chat template shows, else hermes"),
    _Option("--host", "127.0.0.1", "address to listen on (0.0.0.0: every interface)"),
    _Option("--port", 8000, "TCP port to listen on", int),
    _Option("--api-server-count", None, "API server processes sharing the port (auth, "
            "tokenization, detokenization, SSE), beside the one engine-core process; tenants' "
            "caps hold across them; the launcher logs the count and why", int,
            shown_default="min(4, max(1, usable cores // 4)): 1 on 2-7 cores, 2 on 8-15, 4 on "
            "16 or more"),
    _Option("--shutdown-timeout", 30.0, "on SIGTERM / Ctrl-C, seconds in-flight requests may "
            "run on; then they end with a 503 error and the server exits", float),
    _Option("--max-request-body-bytes", 4 * 1024 * 1024, "larger request bodies answer 413",
            int),
    _Option("--max-n", 16, "the most samples per prompt (`n`) one request may ask for; more "
            "answers 400", int),
    _Option("--max-prompts-per-request", 64, "the most prompts one /v1/completions request may "
            "hold; more answers 400", int),
    _Option("--uvicorn-log-level", "info", "uvicorn's log level (debug, info, warning, error)"),
    _Option("--admin-key", None, "the admin API key, which manages tenants; on the command "
            "line it shows in `ps`: prefer LORAPLEX_ADMIN_KEY or --admin-key-file",
            shown_default="LORAPLEX_ADMIN_KEY; without one the admin API answers 403"),
    _Option("--admin-key-file", None, "a file holding the admin API key (its first line)"),
    _Option("--tenants", None, "a YAML file of static tenants, keys as SHA-256 hashes (e.g. "
            "configs/tenants.yaml); with no tenant and no admin key the server is open"),
    _Option("--data-dir", None, "the adapter registry and tenants",
            shown_default="LORAPLEX_DATA_DIR, else ~/.local/share/loraplex"),
    _Option("--adapter-registry", "local", "where adapters and their catalogue live: local (the "
            "data dir), file:///shared/folder (a folder every replica mounts: adapters, catalogue "
            "and tenants) or s3://bucket/prefix (S3-compatible, through boto3: AWS_ENDPOINT_URL, "
            "credentials); a shared one serves every adapter uploaded through any replica"),
    _Option("--max-adapter-bytes", 512 * 1024 * 1024, "the largest adapter upload", int),
)  # fmt: skip
# What one tenant may cost the others, and what the public routes show (README, "Security").
_ISOLATION_OPTIONS = (
    _Option("--metrics-key", None, "a key (Authorization: Bearer) that opens every /metrics "
            "series and /adapters/resident on a server with tenants; without it, or the admin "
            "key, they name no tenant and no tenant's adapter (default: LORAPLEX_METRICS_KEY)"),
    _Option("--metrics-public-adapter-names", False, "list every adapter requests run on or "
            "wait for in /metrics' loraplex:lora_requests_info without a key (by the name "
            "clients send in `model`; tenant names stay hidden), for the Gateway API Inference "
            "Extension's endpoint picker, which sends no key", boolean=True),
    _Option("--chat-template-timeout", 5.0, "seconds one chat template render may take, in a "
            "render process that is killed past it; slower renders answer 400, and an "
            "adapter's template that takes longer on a small conversation is refused at upload",
            float),
    _Option("--chat-template-workers", 2, "chat template render processes per API process; "
            "one tenant's renders use at most all but one of them", int),
    _Option("--max-concurrent-uploads", 2, "adapter uploads one API process reads at once "
            "(each streamed to disk and counted as it arrives); more answer 503, and one tenant "
            "holds at most all but one (429)", int),
    _Option("--request-read-timeout", 30.0, "seconds a connection may take to send a request's "
            "headers, and the longest pause while it sends a body; past it: 408 and the "
            "connection closes", float),
    _Option("--timeout-keep-alive", 5, "seconds an idle keep-alive connection stays open "
            "(uvicorn's option)", int),
)  # fmt: skip
_OPTIONS = _OPTIONS + _ISOLATION_OPTIONS
_KEYS = {option.key for option in _OPTIONS}
# Options the HTTP server itself uses; every other option configures the engine.
_SERVER_KEYS = {"host", "port", "max_request_body_bytes", "uvicorn_log_level", "data_dir",
                "adapter_registry", "api_server_count", "shutdown_timeout",
                "tenants", "admin_key", "admin_key_file", "max_adapter_bytes", "max_n",
                "max_prompts_per_request", "tool_call_parser", "lora_modules",
                "allow_runtime_lora_updating",
                *(option.key for option in _ISOLATION_OPTIONS)}  # fmt: skip
_ENGINE_KEYS = sorted(_KEYS - _SERVER_KEYS)
DESCRIPTION = (
    "Serve a model through an OpenAI-compatible HTTP API: /v1/chat/completions, "
    "/v1/completions, /v1/responses, /v1/models and more (every route: GET /openapi.json on "
    "the running server, or the README's 'The HTTP API'), with tenants, LoRA adapters, "
    "/metrics and /health."
)


def add_serve_parser(
    subparsers: argparse._SubParsersAction, name: str = "serve"
) -> argparse.ArgumentParser:
    """Add `serve` (or another command taking the same options) to the `loraplex` command."""
    parser = subparsers.add_parser(
        name,
        help="serve the OpenAI-compatible API (default: the embedded model on 127.0.0.1:8000)",
        description=DESCRIPTION,
        epilog="A flag given here overrides the same key in --config, which overrides the "
        "default shown.",
    )
    parser.add_argument(
        "model_tag",
        nargs="?",
        default=None,
        metavar="MODEL",
        help="a model folder, as `vllm serve MODEL` takes it: the same as --model (default: "
        "--model's)",
    )
    parser.add_argument(
        "--config",
        default=None,
        help="a YAML file whose keys are these options with underscores (e.g. "
        "configs/serve.yaml) (default: none)",
    )
    for option in _OPTIONS:
        if option.boolean:
            parser.add_argument(
                option.flag, action=argparse.BooleanOptionalAction, default=None, help=option.help
            )
        elif option.multiple:
            parser.add_argument(option.flag, nargs="+", default=None, help=option.help)
        else:
            parser.add_argument(option.flag, type=option.type, default=None, help=option.help)
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
    """Every option's value: the command line, else the YAML file, else the default.
    ValueError for a positional MODEL that contradicts --model."""
    from_file = load_yaml_options(args.config) if args.config else {}
    values = {}
    for option in _OPTIONS:
        given = getattr(args, option.key)
        values[option.key] = (
            given if given is not None else from_file.get(option.key, option.default)
        )
    positional = getattr(args, "model_tag", None)
    if positional is not None:
        if args.model is not None and args.model != positional:
            raise ValueError(
                f"the model is given twice, as MODEL ({positional}) and --model ({args.model}); "
                "give one"
            )
        values["model"] = positional
    return values


def _admin_key(values: dict[str, Any]) -> str | None:
    """`--admin-key`, or the first line of `--admin-key-file` (ValueError for both, or for a
    file that cannot be read or holds no key); None: LORAPLEX_ADMIN_KEY, read by the server."""
    path = values["admin_key_file"]
    if path is None:
        return values["admin_key"]
    if values["admin_key"] is not None:
        raise ValueError("give the admin key once: --admin-key or --admin-key-file")
    try:
        lines = Path(path).expanduser().read_text(encoding="utf-8").splitlines()
    except OSError as error:
        raise ValueError(f"--admin-key-file {path}: {error.strerror or error}") from None
    key = lines[0].strip() if lines else ""
    if not key:
        raise ValueError(f"--admin-key-file {path}: the file holds no key")
    return key


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
        admin_key=_admin_key(values),
        max_adapter_bytes=values["max_adapter_bytes"],
        max_n=values["max_n"],
        max_prompts_per_request=values["max_prompts_per_request"],
        tool_call_parser=values["tool_call_parser"],
        lora_modules=parse_lora_modules(values["lora_modules"]),
        allow_runtime_lora_updating=values["allow_runtime_lora_updating"],
        metrics_key=values["metrics_key"],
        metrics_public_adapter_names=values["metrics_public_adapter_names"],
        chat_template_timeout_s=values["chat_template_timeout"],
        chat_template_workers=values["chat_template_workers"],
        max_concurrent_uploads=values["max_concurrent_uploads"],
        request_read_timeout_s=values["request_read_timeout"],
        timeout_keep_alive_s=values["timeout_keep_alive"],
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
    if args.admin_key is not None:
        logger.warning(
            "--admin-key on the command line is visible to every user of this machine (ps, "
            "/proc): set LORAPLEX_ADMIN_KEY or give --admin-key-file instead"
        )
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
