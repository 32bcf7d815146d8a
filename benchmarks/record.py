"""Benchmark records: one JSON object per run, saying how it was made."""

from __future__ import annotations

import datetime
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).parent / "results"


def git_commit() -> str:
    """HEAD of this checkout; a copy without .git (the GPU machine's) reads
    LORAPLEX_BENCH_COMMIT, set to the commit the copy was made from."""
    if os.environ.get("LORAPLEX_BENCH_COMMIT"):
        return os.environ["LORAPLEX_BENCH_COMMIT"]
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"],
            capture_output=True,
            text=True,
            cwd=Path(__file__).parent,
            check=True,
        )
        return out.stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def device_name() -> str:
    import torch

    if torch.cuda.is_available():
        return torch.cuda.get_device_name()
    return f"cpu ({torch.get_num_threads()} threads)"


def flatten_metrics(metrics: dict[str, Any]) -> tuple[dict[str, float], dict[str, Any]]:
    """A record's metrics as flat name -> number (nested names joined by "_"), and what is not a
    number (lists of rounds, flags, labels) by its flat name, kept beside them."""
    flat: dict[str, float] = {}
    details: dict[str, Any] = {}

    def walk(name: str, value: Any) -> None:
        if isinstance(value, dict):
            for key, inner in value.items():
                walk(f"{name}_{key}" if name else str(key), inner)
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            flat[name] = value
        else:
            details[name] = value

    walk("", metrics)
    return flat, details


def record_header(benchmark: str) -> dict[str, str]:
    """The fields naming a run: benchmark, device, command (re-runnable), commit, date."""
    return {
        "benchmark": benchmark,
        "device": device_name(),
        "command": " ".join(shlex.quote(a) for a in ["python", "-m", *_module_argv()]),
        "commit": git_commit(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


def write_result(
    name: str, benchmark: str, metrics: dict[str, Any], baseline: dict[str, Any], **extra: Any
) -> Path:
    """Write `results/<name>`: metrics flattened to name -> number (`flatten_metrics`), what is
    not a number under "metric_details"."""
    metrics, details = flatten_metrics(metrics)
    if details:
        extra = {**extra, "metric_details": {**details, **extra.get("metric_details", {})}}
    record = {
        **record_header(benchmark),
        "metrics": metrics,
        "baseline": baseline,
        **extra,
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / name
    path.write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {path}")
    return path


def _module_argv() -> list[str]:
    main = sys.modules["__main__"]
    spec = getattr(main, "__spec__", None)
    script = Path(sys.argv[0]).resolve()
    if spec is not None:
        module = spec.name
    elif script.parent == Path(__file__).resolve().parent:  # `python benchmarks/x.py`
        module = f"benchmarks.{script.stem}"
    else:
        module = script.stem
    return [module, *sys.argv[1:]]
