"""Reading a model's default sampling parameters, as vLLM's `--generation-config` does.

`source` is `auto` (the model folder's `generation_config.json`, if it has one), `vllm` (none:
vLLM's own defaults) or a folder holding a `generation_config.json`; the operator's overrides
(`--override-generation-config`) then take the place of what it sets.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from loraplex.platform.core.generation_defaults import GenerationDefaults

logger = logging.getLogger(__name__)

GENERATION_CONFIG = "generation_config.json"
SOURCES = ("auto", "vllm")  # or a folder


def read_generation_defaults(
    model_dir: Path, source: str = "auto", overrides: Mapping[str, Any] | None = None
) -> GenerationDefaults:
    """The defaults for requests on the model at `model_dir` (a folder, or the bare config.json
    of a random-weight model, which has none); ValueError for a folder without the file or a
    value of the wrong type or range."""
    defaults = GenerationDefaults()
    path: Path | None = None
    if source == "auto":
        path = model_dir / GENERATION_CONFIG if model_dir.is_dir() else None
        if path is not None and not path.is_file():
            path = None
    elif source != "vllm":
        path = Path(source).expanduser() / GENERATION_CONFIG
        if not path.is_file():
            raise ValueError(f"--generation-config {source}: no {GENERATION_CONFIG} in that folder")
    if path is not None:
        try:
            config = json.loads(path.read_text(encoding="utf-8"))
        except ValueError as error:
            raise ValueError(f"{path}: not valid JSON ({error})") from None
        if not isinstance(config, dict):
            raise ValueError(f"{path}: expected a JSON object")
        defaults = GenerationDefaults.from_hf(config, str(path))
    if overrides:
        defaults = defaults.updated(
            GenerationDefaults.from_hf(overrides, "--override-generation-config", strict=True)
        )
    if defaults.given():
        logger.info(
            "default sampling parameters (a request's own values win): %s; from %s%s",
            defaults.given(),
            "no generation config" if path is None else path,
            " and --override-generation-config" if overrides else "",
        )
    return defaults
