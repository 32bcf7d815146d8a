"""Fixtures shared by the whole test suite."""

from __future__ import annotations

import gc
import json
import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from loraplex.platform.runner.cpu_malloc import release_free_memory

# NOTE: under pytest-xdist (`make test` runs two workers), each worker is one process of several
# sharing the machine's cores: one intra-op thread each (and for the servers they start, which
# inherit OMP_NUM_THREADS) keeps two workers from oversubscribing two cores. An explicit
# OMP_NUM_THREADS is left alone.
_XDIST_WORKER = os.environ.get("PYTEST_XDIST_WORKER")
if _XDIST_WORKER and "OMP_NUM_THREADS" not in os.environ:
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch

    torch.set_num_threads(1)

# NOTE: Triton reads TRITON_INTERPRET when a kernel is decorated, i.e. when its module is first
# imported, and collection imports every test module (tests/benchmarks' too, whose benchmarks
# import kernel modules) before any test runs: set here, in the root conftest, where no CUDA
# device is present, the kernels run in the CPU interpreter whichever module imports them first.
# On a CUDA machine they compile for the GPU.
if "TRITON_INTERPRET" not in os.environ:
    import torch

    if not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"

# NOTE: set before any test reads `loraplex.envs.cache_dir()`, so every run shares one converted
# default model in the git-ignored `.cache/` at the repository root instead of the user's cache.
_REPO = Path(__file__).resolve().parents[1]
_TEST_CACHE = _REPO / ".cache"
os.environ.setdefault("LORAPLEX_CACHE_DIR", str(_TEST_CACHE))
# Servers started by tests keep their registries under the same ignored folder, not in $HOME;
# one folder per xdist worker, so two workers' servers never share a tenant or adapter database.
os.environ.setdefault(
    "LORAPLEX_DATA_DIR", str(_TEST_CACHE / (f"data-{_XDIST_WORKER}" if _XDIST_WORKER else "data"))
)
# NOTE: the engine cores of servers that tests start would all bind to the host's last core
# (`auto`), however many xdist workers start them; tests that check binding set it themselves.
os.environ.setdefault("LORAPLEX_CPU_OMP_THREADS_BIND", "nobind")

# The CI bound on the suite's wall time (`.ci/run` sets it): over it, the run fails.
WALL_BUDGET_ENV = "LORAPLEX_TEST_WALL_BUDGET_S"
_session: dict[str, object] = {}  # the running session and its start (controller side)


def pytest_sessionstart(session: pytest.Session) -> None:
    _session.update(session=session, start=time.monotonic())


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    """With LORAPLEX_TEST_WALL_BUDGET_S set (CI), print the run's wall time against that bound
    and fail the run when it is over; pytest's own summary line still comes last."""
    budget = os.environ.get(WALL_BUDGET_ENV)
    if not budget or _XDIST_WORKER or not _session:
        return
    elapsed = time.monotonic() - _session["start"]
    workers = getattr(config.option, "numprocesses", None) or 0
    over = elapsed > float(budget)
    terminalreporter.write_line(
        f"test wall time: {elapsed:.0f} s (bound {float(budget):.0f} s, xdist workers: {workers})"
        + (" -- OVER THE BOUND" if over else ""),
        red=over,
        green=not over,
    )
    session = _session["session"]
    if over and session.exitstatus == pytest.ExitCode.OK:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


# NOTE: `make test` hands whole modules to its xdist workers in collection order, a new one to
# each worker as it finishes one (`--dist loadfile`). The modules the latest record of the suite's
# time names (`python -m benchmarks.suite_durations`, its slowest 25 or so) go first, longest
# first, so that no worker is left running a long one alone at the end while the other has
# nothing to do; the others keep their order. Without the record, collection order stands.
SUITE_DURATIONS = _REPO / "benchmarks/results/cpu_suite_durations.json"


def _recorded_module_seconds() -> dict[str, float]:
    """Test module path (`tests/...py`) -> its seconds in the suite-durations record."""
    prefix = "module_s_"
    try:
        metrics = json.loads(SUITE_DURATIONS.read_text())["metrics"]
    except (OSError, ValueError, KeyError):
        return {}
    return {f"tests/{name[len(prefix) :]}": float(seconds)
            for name, seconds in metrics.items() if name.startswith(prefix)}  # fmt: skip


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    seconds = _recorded_module_seconds()
    items.sort(key=lambda item: -seconds.get(item.nodeid.split("::")[0], 0.0))  # stable


@pytest.fixture(scope="module", autouse=True)
def _collect_garbage_after_each_module() -> Iterator[None]:
    """A full collection once a module's fixtures are torn down, then the freed heap handed back
    to the OS.

    NOTE: the engine raises the collector's thresholds for serving (gc_tuning.py), so in a test
    process the old generation is almost never collected: the engines a module built and dropped
    (they hold reference cycles) would stay in memory for the rest of the run, gigabytes per
    xdist worker by the end of the suite. Collected, their weights (and oneDNN-packed copies)
    are free but still resident in glibc's heap (`cpu_malloc.release_free_memory`): a worker
    would keep the largest module's footprint for the rest of the run.
    """
    yield
    gc.collect()
    release_free_memory()


@pytest.fixture(scope="session")
def model_dir() -> Path:
    """The default model (SmolLM2-135M-Instruct) as a Hugging Face folder, converted once."""
    from loraplex.platform.models.model_store import ensure_default_model

    return ensure_default_model(progress=False)


@pytest.fixture(scope="session")
def tiny_llama_dir(model_dir, tmp_path_factory) -> Path:
    """The suite's tiny random Llama with the default model's tokenizer
    (`tests.tiny_models.write_tiny_llama`), written once; tests only read it."""
    from tests.tiny_models import write_tiny_llama

    return write_tiny_llama(tmp_path_factory.mktemp("tiny-llama"), Path(model_dir))


@pytest.fixture(scope="session")
def hf_prompt_logprobs(model_dir):
    """HF transformers' fp32 logprob of each prompt token after the first, under the default
    model: `run(prompt_ids) -> [len - 1]` tensor, the reference for prompt logprobs."""
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    model.eval()

    def run(prompt_ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            logits = model(torch.tensor([prompt_ids])).logits[0, :-1].float()
        logprobs = torch.log_softmax(logits, dim=-1)
        return logprobs.gather(1, torch.tensor(prompt_ids[1:])[:, None]).squeeze(1)

    return run
