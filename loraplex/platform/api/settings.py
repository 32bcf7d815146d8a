"""`ServerSettings`: the HTTP side's settings, as the operator gave them (the engine has its own
`EngineConfig`), and `LoRAModule`, one `--lora-modules` entry among them."""

from __future__ import annotations

from dataclasses import dataclass

from loraplex import envs
from loraplex.adapters.registry import check_registry_url
from loraplex.platform.api.openai.sampling import DEFAULT_MAX_N, DEFAULT_MAX_PROMPTS_PER_REQUEST
from loraplex.platform.api.openai.tools.tool_parsers import TOOL_PARSERS

DEFAULT_MAX_REQUEST_BODY_BYTES = 4 * 1024 * 1024
DEFAULT_MAX_ADAPTER_BYTES = 512 * 1024 * 1024
DEFAULT_MAX_CONCURRENT_UPLOADS = 2
DEFAULT_REQUEST_READ_TIMEOUT_S = 30.0
DEFAULT_TIMEOUT_KEEP_ALIVE_S = 5
DEFAULT_CHAT_TEMPLATE_TIMEOUT_S = 5.0
DEFAULT_CHAT_TEMPLATE_WORKERS = 2


@dataclass(frozen=True)
class LoRAModule:
    """One `--lora-modules` entry: serve the PEFT folder `path` as the model `name`."""

    name: str
    path: str
    base_model_name: str | None = None  # if given, must be the served base model's name


@dataclass(frozen=True)
class ServerSettings:
    """HTTP-side settings (the engine has its own EngineConfig)."""

    host: str = "127.0.0.1"
    port: int = 8000
    max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES
    disconnect_poll_s: float = 0.25
    data_dir: str | None = None  # the adapter registry and tenants (None: envs.data_dir())
    tenants_file: str | None = None  # a YAML file of static tenants
    admin_key: str | None = None  # None: LORAPLEX_ADMIN_KEY, if set
    max_adapter_bytes: int = DEFAULT_MAX_ADAPTER_BYTES  # per adapter upload
    max_n: int = DEFAULT_MAX_N  # samples per prompt (`n`) of one request
    max_prompts_per_request: int = DEFAULT_MAX_PROMPTS_PER_REQUEST  # prompts of one completion
    tool_call_parser: str | None = None  # vLLM's name; None: the one the chat template implies
    # where adapters and their catalogue live: "local" (data_dir), file:///shared/folder or
    # s3://bucket/prefix (one registry for every replica); see `open_registry`
    adapter_registry: str = "local"
    registry_sync_s: float = 2.0  # how often a shared registry's changes reach this engine
    # adapters served to every tenant from start-up (`--lora-modules`, as vLLM's)
    lora_modules: tuple[LoRAModule, ...] = ()
    # vLLM's runtime adapter routes may load / unload server-wide adapters; None: the
    # environment decides (`envs.allow_runtime_lora_updating`)
    allow_runtime_lora_updating: bool | None = None

    @property
    def runtime_lora_updating(self) -> bool:
        """Whether POST /v1/load_lora_adapter and /v1/unload_lora_adapter change server-wide
        adapters (the flag, else VLLM_ALLOW_RUNTIME_LORA_UPDATING /
        LORAPLEX_ALLOW_RUNTIME_LORA_UPDATING)."""
        if self.allow_runtime_lora_updating is not None:
            return self.allow_runtime_lora_updating
        return envs.allow_runtime_lora_updating()

    # -- what one tenant's requests may cost the others (see README, "Security") --
    metrics_key: str | None = None  # opens every /metrics series; None: LORAPLEX_METRICS_KEY
    # list tenants' adapter names in /metrics' lora_requests_info without a key (GIE's picker)
    metrics_public_adapter_names: bool = False
    chat_template_timeout_s: float = DEFAULT_CHAT_TEMPLATE_TIMEOUT_S  # one render's time
    chat_template_workers: int = DEFAULT_CHAT_TEMPLATE_WORKERS  # render processes per API process
    max_concurrent_uploads: int = DEFAULT_MAX_CONCURRENT_UPLOADS  # per API process; more: 503
    # headers must arrive within it, and a body may pause no longer (408)
    request_read_timeout_s: float = DEFAULT_REQUEST_READ_TIMEOUT_S
    timeout_keep_alive_s: int = DEFAULT_TIMEOUT_KEEP_ALIVE_S  # idle keep-alive connections close

    def __post_init__(self) -> None:
        if not 0 < self.port < 65536:
            raise ValueError(f"port must be in [1, 65535], got {self.port}")
        if self.max_request_body_bytes < 1024:
            raise ValueError(
                f"max_request_body_bytes must be >= 1024, got {self.max_request_body_bytes}"
            )
        if self.disconnect_poll_s <= 0:
            raise ValueError(f"disconnect_poll_s must be positive, got {self.disconnect_poll_s}")
        if self.max_adapter_bytes < 1024:
            raise ValueError(f"max_adapter_bytes must be >= 1024, got {self.max_adapter_bytes}")
        for name in ("max_n", "max_prompts_per_request"):
            if not 1 <= getattr(self, name) <= 2**31 - 1:
                raise ValueError(f"{name} must be in [1, 2**31 - 1], got {getattr(self, name)}")
        check_registry_url(self.adapter_registry)
        if self.registry_sync_s <= 0:
            raise ValueError(f"registry_sync_s must be positive, got {self.registry_sync_s}")
        for name in ("chat_template_timeout_s", "request_read_timeout_s"):
            if not 0 < getattr(self, name) <= 3600:
                raise ValueError(f"{name} must be in (0, 3600], got {getattr(self, name)}")
        for name in ("chat_template_workers", "max_concurrent_uploads", "timeout_keep_alive_s"):
            if not 1 <= getattr(self, name) <= 1024:
                raise ValueError(f"{name} must be in [1, 1024], got {getattr(self, name)}")
        if self.tool_call_parser is not None and self.tool_call_parser not in TOOL_PARSERS:
            raise ValueError(
                f"tool_call_parser must be one of {sorted(TOOL_PARSERS)}, "
                f"got {self.tool_call_parser!r}"
            )
