"""Importing one part loads only what it needs (the root package imports lazily)."""

from __future__ import annotations

import subprocess
import sys


def _loaded_after(statement: str) -> set[str]:
    code = f"import sys; {statement}; print(' '.join(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return set(out.stdout.split())


def test_importing_a_kernel_loads_no_engine():
    loaded = _loaded_after("import loraplex.kernels.rotary")
    assert not {m for m in loaded if m.startswith("loraplex.platform.engine")}


def test_scheduler_and_runner_do_not_import_the_engine_package():
    loaded = _loaded_after(
        "import loraplex.platform.scheduler.scheduler, loraplex.platform.runner.model_runner"
    )
    assert not {m for m in loaded if m.startswith("loraplex.platform.engine")}


def test_the_public_names_still_import_from_the_root():
    import loraplex

    assert loraplex.SamplingParams(temperature=0.0).greedy
    assert loraplex.LLM.__name__ == "LLM"
    assert set(loraplex.__all__) <= set(dir(loraplex))


def test_the_api_imports_no_entrypoint():
    # NOTE: entrypoints (the serve CLI, the launcher, Ray Serve) sit on top of the API
    loaded = _loaded_after("import loraplex.platform.api.app")
    assert not {m for m in loaded if m.startswith("loraplex.entrypoints")}


def test_the_api_and_the_engine_client_load_no_engine_internals():
    # NOTE: an API process talks to an engine core elsewhere: it needs the client, the
    # tokenizer and the typed messages, never the model, its kernels or the adapter manager.
    loaded = _loaded_after(
        "import loraplex.platform.api.app, loraplex.platform.engine.core_client, "
        "loraplex.platform.engine.protocol"
    )
    internals = (
        "loraplex.platform.runner",
        "loraplex.platform.models",
        "loraplex.kernels",
        "loraplex.adapters.manager",
    )
    offenders = sorted(m for m in loaded if any(m == p or m.startswith(p + ".") for p in internals))
    assert not offenders, f"the API and the engine client import {offenders}"
