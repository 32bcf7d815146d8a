"""Every environment variable loraplex reads, in one typed place.

Read lazily through functions, never at import time, so tests can set them per process.
"""

from __future__ import annotations

import os
from pathlib import Path


def _path(name: str, default: Path) -> Path:
    value = os.environ.get(name)
    return Path(value).expanduser() if value else default


def _xdg_cache() -> Path:
    return _path("XDG_CACHE_HOME", Path.home() / ".cache")


def cache_dir() -> Path:
    """Converted models, compiled grammars and CPU kernels (LORAPLEX_CACHE_DIR, default
    ~/.cache/loraplex)."""
    return _path("LORAPLEX_CACHE_DIR", _xdg_cache() / "loraplex")


def data_dir() -> Path:
    """The persistent adapter registry and tenants (LORAPLEX_DATA_DIR,
    default ~/.local/share/loraplex)."""
    xdg = _path("XDG_DATA_HOME", Path.home() / ".local" / "share")
    return _path("LORAPLEX_DATA_DIR", xdg / "loraplex")


def c_compiler() -> str:
    """The C compiler that builds the CPU kernels (CC, default `cc`)."""
    return os.environ.get("CC") or "cc"


def admin_key() -> str | None:
    """The admin API key (LORAPLEX_ADMIN_KEY), if set."""
    return os.environ.get("LORAPLEX_ADMIN_KEY") or None


def allow_runtime_lora_updating() -> bool:
    """Whether vLLM's runtime adapter routes load and unload server-wide adapters
    (VLLM_ALLOW_RUNTIME_LORA_UPDATING, vLLM's switch, or LORAPLEX_ALLOW_RUNTIME_LORA_UPDATING:
    `1` or `true`, any case; `--allow-runtime-lora-updating` wins over both)."""
    return any(
        os.environ.get(name, "").strip().lower() in ("1", "true")
        for name in ("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "LORAPLEX_ALLOW_RUNTIME_LORA_UPDATING")
    )


def metrics_key() -> str | None:
    """The key that opens every series of /metrics (LORAPLEX_METRICS_KEY), if set."""
    return os.environ.get("LORAPLEX_METRICS_KEY") or None


def log_level() -> str:
    return os.environ.get("LORAPLEX_LOG_LEVEL", "INFO").upper()


def triton_interpret() -> bool:
    """True when Triton kernels run in the CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def gc_tuning() -> bool:
    """Whether the engine tunes the garbage collector for serving (LORAPLEX_GC_TUNING, default
    1; 0 leaves the process's settings alone)."""
    return os.environ.get("LORAPLEX_GC_TUNING", "1") != "0"


def cpu_threads() -> int | None:
    """Intra-op threads of a CPU engine (LORAPLEX_CPU_THREADS); None: unset (see
    `loraplex.platform.runner.cpu_threads`). A value that is not a positive integer is a
    ValueError."""
    value = os.environ.get("LORAPLEX_CPU_THREADS")
    if not value:
        return None
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"LORAPLEX_CPU_THREADS must be a positive integer, got {value!r}")
    return int(value)


def cpu_omp_threads_bind() -> str:
    """Where a CPU engine's compute threads run (LORAPLEX_CPU_OMP_THREADS_BIND, vLLM's
    VLLM_CPU_OMP_THREADS_BIND): `auto` (default), `nobind`, or a CPU list such as `1` or
    `0-3,6`; parsed and checked by `loraplex.platform.runner.cpu_threads`."""
    return os.environ.get("LORAPLEX_CPU_OMP_THREADS_BIND", "").strip() or "auto"


def cpu_lend_idle_cores() -> bool:
    """Whether a CPU engine's steps borrow the cores it leaves to the API process while those
    are idle (LORAPLEX_CPU_LEND_IDLE_CORES, default 1; 0: never; see
    `loraplex.platform.runner.cpu_threads.SpareCores`)."""
    return os.environ.get("LORAPLEX_CPU_LEND_IDLE_CORES", "1").strip() != "0"


def omp_num_threads_set() -> bool:
    """Whether OMP_NUM_THREADS is set (torch then already took its thread count from it)."""
    return bool(os.environ.get("OMP_NUM_THREADS"))


def quant_gemm_table() -> Path | None:
    """A W4A16 kernel selection table file written by `benchmarks.quant_gemm --table`
    (LORAPLEX_QUANT_GEMM_TABLE); None: the built-in table."""
    value = os.environ.get("LORAPLEX_QUANT_GEMM_TABLE")
    return Path(value).expanduser() if value else None


def warm_up() -> bool | None:
    """Whether a server's engine runs a warm-up burst before it reports ready (LORAPLEX_WARM_UP:
    1 always, 0 never; unset or `auto`: on CUDA, where kernels compile at first use)."""
    value = os.environ.get("LORAPLEX_WARM_UP", "auto").strip().lower()
    if value in ("", "auto"):
        return None
    if value not in ("0", "1"):
        raise ValueError(f"LORAPLEX_WARM_UP must be 0, 1 or auto, got {value!r}")
    return value == "1"
