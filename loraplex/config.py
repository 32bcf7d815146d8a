"""Root configuration: frozen dataclasses, one per part, composed into `EngineConfig`.

Derived values are properties; bad values raise `ValueError`. Runtime facts (how many KV blocks
fit, which device was found) live in state objects, never in a mutated config.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from typing import Any

from loraplex.grammar.config import GrammarConfig
from loraplex.platform.core.generation_defaults import GenerationDefaults
from loraplex.platform.spec.config import SpeculativeConfig

DTYPES = ("auto", "float32", "bfloat16", "float16")
MAX_SERVED_NAME_CHARS = 256
_DTYPE_ALIASES = {
    "fp32": "float32",
    "float": "float32",
    "bf16": "bfloat16",
    "fp16": "float16",
    "half": "float16",
}


def normalize_dtype(dtype: str) -> str:
    name = _DTYPE_ALIASES.get(dtype, dtype)
    if name not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
    return name


@dataclass(frozen=True)
class ModelConfig:
    """Which model to load and how. `model=None` means the embedded SmolLM2-135M-Instruct."""

    model: str | None = None
    dtype: str = "auto"
    max_model_len: int | None = None
    quantization: str | None = None
    seed: int = 0
    served_model_name: str | None = None
    device: str = "auto"
    # vLLM's: where requests' default sampling parameters come from ("auto": the model folder's
    # generation_config.json; "vllm": none; else a folder holding one), and values that take
    # their place (Hugging Face's names, e.g. {"max_new_tokens": 256, "temperature": 0.7}: a
    # mapping or its JSON text, kept as sorted pairs). A request's own values win over both.
    generation_config: str = "auto"
    override_generation_config: tuple[tuple[str, Any], ...] | dict[str, Any] | str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "dtype", normalize_dtype(self.dtype))
        overrides = _json_object(self.override_generation_config, "override_generation_config")
        GenerationDefaults.from_hf(overrides, "--override-generation-config", strict=True)
        object.__setattr__(self, "override_generation_config", tuple(sorted(overrides.items())))
        if not isinstance(self.generation_config, str) or not self.generation_config:
            raise ValueError(
                "generation_config must be 'auto', 'vllm' or a folder holding a "
                f"generation_config.json, got {self.generation_config!r}"
            )
        if self.max_model_len is not None and self.max_model_len <= 0:
            raise ValueError(f"max_model_len must be positive, got {self.max_model_len}")
        if self.device not in ("auto", "cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ValueError(f"device must be 'auto', 'cpu' or 'cuda[:N]', got {self.device!r}")
        name = self.served_model_name
        # NOTE: the name is a label on every /metrics series and in every response: no control
        # characters (a newline would break the exposition format), no surrounding spaces.
        if name is not None and (
            not 1 <= len(name) <= MAX_SERVED_NAME_CHARS
            or not name.isprintable()
            or name != name.strip()
        ):
            raise ValueError(
                f"served_model_name must be 1-{MAX_SERVED_NAME_CHARS} printable characters "
                f"without surrounding spaces, got {name!r}"
            )

    @property
    def generation_overrides(self) -> dict[str, Any]:
        """`override_generation_config` as a mapping (Hugging Face's names)."""
        return dict(self.override_generation_config or ())


def _json_object(value: object, name: str) -> dict[str, Any]:
    """A mapping given as itself, as (key, value) pairs, or as JSON text; {} for None."""
    if value is None:
        return {}
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as error:
            raise ValueError(f"{name} is not valid JSON ({error})") from None
    if isinstance(value, tuple):
        value = dict(value)
    if not isinstance(value, dict):
        raise ValueError(f"{name} must be a JSON object, got {value!r}")
    return value


@dataclass(frozen=True)
class CacheConfig:
    """Paged KV cache. `num_kv_blocks=None` sizes the cache from `gpu_memory_utilization`
    (on CUDA) or from `cpu_kv_cache_gib` (on CPU)."""

    block_size: int = 16
    num_kv_blocks: int | None = None
    gpu_memory_utilization: float = 0.9
    cpu_kv_cache_gib: float = 1.0
    enable_prefix_caching: bool = True

    def __post_init__(self) -> None:
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a positive power of two, got {self.block_size}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {self.num_kv_blocks}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}"
            )
        if self.cpu_kv_cache_gib <= 0:
            raise ValueError(f"cpu_kv_cache_gib must be positive, got {self.cpu_kv_cache_gib}")


@dataclass(frozen=True)
class SchedulerConfig:
    """Continuous batching limits: running sequences and tokens per step."""

    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    enable_chunked_prefill: bool = True
    # Schedule step N+1 while the device still runs step N (its sampled tokens stay on the
    # device and feed step N+1), so the CPU's step work overlaps the GPU's. None: on for CUDA.
    async_scheduling: bool | None = None
    # vLLM's name: the most prompt tokens one request may prefill in a step while other requests
    # run or wait (its chunked prefill then shares the step, and the same number of tokens is
    # kept for admitting waiting requests). None: a quarter of max_num_batched_tokens; 0: no cap.
    long_prefill_token_threshold: int | None = None
    # vLLM's name: how many prompts longer than that threshold are prefilled at once ahead of
    # shorter waiting prompts (which otherwise queue behind them); the budget such shorter
    # prompts leave still goes to the next long ones.
    max_long_partial_prefills: int = 1
    # Abort a request that made no progress (no prefill chunk, no token, not admitted) for this
    # many seconds, freeing its blocks; 0 disables the watchdog.
    request_stall_timeout_s: float = 600.0

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(
                f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}"
            )
        if self.max_long_partial_prefills < 1:
            raise ValueError(
                f"max_long_partial_prefills must be >= 1, got {self.max_long_partial_prefills}"
            )
        threshold = self.long_prefill_token_threshold
        if threshold is not None and threshold < 0:
            raise ValueError(f"long_prefill_token_threshold must be >= 0, got {threshold}")
        if not self.request_stall_timeout_s >= 0:
            raise ValueError(
                f"request_stall_timeout_s must be >= 0, got {self.request_stall_timeout_s}"
            )

    @property
    def prefill_chunk_cap(self) -> int:
        """Prompt tokens one request may take per step under contention (0: no cap)."""
        if not self.enable_chunked_prefill:
            return 0
        threshold = self.long_prefill_token_threshold
        if threshold is None:
            return max(1, self.max_num_batched_tokens // 4)
        return min(threshold, self.max_num_batched_tokens)


@dataclass(frozen=True)
class LoRAConfig:
    """Multi-LoRA serving: GPU slots, the largest rank, and the CPU cache of adapters."""

    enable_lora: bool = True
    max_loras: int = 8
    max_lora_rank: int = 64
    max_cpu_loras: int = 32
    # Of the `max_loras` slots, how many can hold an adapter with `modules_to_save` or
    # `trainable_token_indices`: each such slot keeps a full copy of embed_tokens and lm_head
    # (2 * vocab * hidden elements); 0 refuses those adapters at registration.
    max_saved_module_loras: int = 0

    def __post_init__(self) -> None:
        if not 0 <= self.max_saved_module_loras <= self.max_loras:
            raise ValueError(
                f"max_saved_module_loras must be in [0, max_loras={self.max_loras}], got "
                f"{self.max_saved_module_loras}"
            )
        if self.max_loras < 1:
            raise ValueError(f"max_loras must be >= 1, got {self.max_loras}")
        if self.max_lora_rank < 1:
            raise ValueError(f"max_lora_rank must be >= 1, got {self.max_lora_rank}")
        if self.max_cpu_loras < self.max_loras:
            raise ValueError(
                f"max_cpu_loras must be >= max_loras ({self.max_cpu_loras} < {self.max_loras})"
            )


@dataclass(frozen=True)
class RunnerConfig:
    """How the model runs: eager, or decode replayed from CUDA graphs of these batch sizes."""

    enforce_eager: bool = False
    cuda_graph_max_bs: int = 256

    def __post_init__(self) -> None:
        if self.cuda_graph_max_bs < 1:
            raise ValueError(f"cuda_graph_max_bs must be >= 1, got {self.cuda_graph_max_bs}")


@dataclass(frozen=True)
class ParallelConfig:
    """How many ranks (GPUs of one host, or CPU processes) one model is split over (vLLM's
    `tensor_parallel_size`); rank 0 schedules and samples, every rank runs each step."""

    tensor_parallel_size: int = 1

    def __post_init__(self) -> None:
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    runner: RunnerConfig = field(default_factory=RunnerConfig)
    grammar: GrammarConfig = field(default_factory=GrammarConfig)
    # None: no speculative decoding (`speculative_config`, vLLM's option name).
    speculative: SpeculativeConfig | None = None
    parallel: ParallelConfig = field(default_factory=ParallelConfig)

    def __post_init__(self) -> None:
        if self.speculative is not None and self.parallel.tensor_parallel_size > 1:
            # NOTE: the other ranks run each step from the batch rank 0 broadcasts, which does
            # not carry draft tokens yet.
            raise ValueError(
                "speculative_config cannot be combined with tensor_parallel_size > 1 yet"
            )
        if self.lora.max_saved_module_loras and self.parallel.tensor_parallel_size > 1:
            # NOTE: a rank holds a slice of the base embedding, which trained token rows are
            # written into.
            raise ValueError(
                "max_saved_module_loras cannot be combined with tensor_parallel_size > 1 yet"
            )

    # Flat option names (vLLM's, as `LLM(...)` and `loraplex serve` take them) that differ from
    # the field they set.
    _ALIASES = {
        "grammar_compile_timeout": "compile_timeout_s",
        "grammar_compile_memory_mib": "compile_memory_mib",
        "grammar_overlap": "overlap",
        "grammar_cold_start": "cold_start",
    }

    @classmethod
    def from_options(cls, **options: Any) -> EngineConfig:
        """Build the config from flat options (`max_num_seqs=...`, `max_loras=...`); each goes
        to the part that owns a field of that name. Unknown names raise ValueError."""
        parts = {
            "model": ModelConfig,
            "cache": CacheConfig,
            "scheduler": SchedulerConfig,
            "lora": LoRAConfig,
            "runner": RunnerConfig,
            "grammar": GrammarConfig,
            "parallel": ParallelConfig,
        }
        owner = {f.name: part for part, c in parts.items() for f in fields(c)}
        kwargs: dict[str, dict[str, Any]] = {part: {} for part in parts}
        spec = options.pop("speculative_config", None)
        for name, value in options.items():
            key = cls._ALIASES.get(name, name)
            if key not in owner:
                raise ValueError(f"unknown engine option {name!r}")
            kwargs[owner[key]][key] = value
        built = {part: parts[part](**kw) for part, kw in kwargs.items()}
        speculative = SpeculativeConfig.parse(spec) if spec is not None else None
        return cls(**built, speculative=speculative)
