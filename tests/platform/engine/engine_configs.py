"""One EngineConfig for the engine tests' own small CPU engines (fp32, embedded model)."""

from __future__ import annotations

from pathlib import Path

from loraplex.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig


def cpu_engine_config(
    model_dir: Path,
    *,
    num_kv_blocks: int,
    max_model_len: int = 256,
    enable_prefix_caching: bool = True,
    **scheduler: object,
) -> EngineConfig:
    return EngineConfig(
        model=ModelConfig(
            model=str(model_dir), dtype="float32", max_model_len=max_model_len, device="cpu"
        ),
        cache=CacheConfig(num_kv_blocks=num_kv_blocks, enable_prefix_caching=enable_prefix_caching),
        scheduler=SchedulerConfig(**scheduler),  # type: ignore[arg-type]
    )
