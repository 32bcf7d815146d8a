"""The loop of a tensor-parallel rank beyond rank 0 (a spawned process).

It joins the group, builds its runner over its shard of the model (with the factory rank 0
gave, `RankRunnerFactory`), reports `WorkerReady`, then runs what rank 0 sends, in order: each
step's forward pass (`RankRunner.follow`) and LoRA slot writes. It ends on `Shutdown`, when
rank 0's end of the pipe closes, or with rank 0's process (PDEATHSIG).
"""

from __future__ import annotations

import ctypes
import logging
import os
import pickle
import signal
import sys
from collections import OrderedDict
from collections.abc import Callable
from multiprocessing.connection import Connection
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from loraplex.config import EngineConfig

if TYPE_CHECKING:
    import torch

    from loraplex.adapters.lora_layer import LoRAModelState
    from loraplex.platform.models.arch_config import ArchConfig
    from loraplex.platform.parallel.parallel_state import TensorParallel
    from loraplex.platform.runner.tp.messages import ExecuteStep

logger = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1


class RankRunner(Protocol):
    """What a rank beyond rank 0 drives: a model runner over the rank's shard (`ModelRunner`)."""

    arch: ArchConfig
    dtype: torch.dtype
    lora_state: LoRAModelState | None

    def follow(self, step: ExecuteStep) -> None:
        """Run the step rank 0 launched (the same forward pass; rank 0's sampled tokens)."""


#: Builds a rank's runner from (config, model folder, the rank's group, `on_loaded`), calling
#: `on_loaded` once its model is loaded. NOTE: sent to the rank's process, so a module-level
#: function (pickled by name).
RankRunnerFactory = Callable[[EngineConfig, Path, "TensorParallel", Callable[[], None]], RankRunner]


def _die_with_parent(parent_pid: int) -> None:
    """Have the kernel kill this process when rank 0's process ends (Linux)."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except OSError:
        pass
    if os.getppid() != parent_pid:  # rank 0 ended before the call above
        os._exit(1)


class _AdapterReader:
    """Reads adapters for LoRA slot writes, keeping the last few in host memory."""

    def __init__(self, runner: RankRunner, config: EngineConfig, model_dir: str) -> None:
        from loraplex.adapters.peft_format import BaseModelSpec
        from loraplex.adapters.validator import AdapterValidator
        from loraplex.platform.tokenizer.tokenizer import tokenizer_folder

        spec = BaseModelSpec.from_hf_config(runner.arch.raw, name_or_path=model_dir)
        dtype = runner.dtype
        self._validator = AdapterValidator(
            spec,
            config.lora.max_lora_rank,
            str(dtype).removeprefix("torch."),
            config.lora.max_saved_module_loras,
            str(tokenizer_folder(Path(model_dir)) or ""),
        )
        self._dtype = dtype
        self._cache: OrderedDict[str, object] = OrderedDict()
        self._capacity = config.lora.max_cpu_loras

    def read(self, path: str, digest: str):  # -> LoRAWeights
        weights = self._cache.get(digest)
        if weights is None:
            weights = self._validator.validate(path).to(self._dtype)
            if weights.digest != digest:
                raise ValueError(f"adapter {path} changed on disk since rank 0 read it")
            self._cache[digest] = weights
            while len(self._cache) > self._capacity:
                self._cache.popitem(last=False)
        self._cache.move_to_end(digest)
        return weights


def run_worker(
    rank: int,
    size: int,
    config: EngineConfig,
    model_dir: str,
    init_file: str,
    pipe: Connection,
    parent_pid: int,
    make_runner: RankRunnerFactory,
    forked: bool = False,
) -> None:
    """The entry point of rank `rank` (a multiprocessing target)."""
    _die_with_parent(parent_pid)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    import torch

    if forked:
        # NOTE: a forked child must not enter the parent's OpenMP thread pool (GNU OpenMP
        # hangs there); one intra-op thread per rank keeps every op out of it.
        torch.set_num_threads(1)
    logging.basicConfig(
        level=logging.WARNING,
        format=f"%(asctime)s tp-rank{rank} %(name)s %(levelname)s %(message)s",
    )
    from loraplex.platform.parallel.parallel_state import (
        destroy_tensor_parallel,
        init_tensor_parallel,
    )
    from loraplex.platform.runner.tp.messages import (
        ExecuteStep,
        LoadLoRASlot,
        Shutdown,
        WorkerReady,
    )

    try:
        # NOTE: rank 0 resolved the rank's device (`rank_device`: "cpu" or "cuda:<rank>").
        tp = init_tensor_parallel(rank, size, init_file, torch.device(config.model.device))
        runner = make_runner(config, Path(model_dir), tp, lambda: pipe.send(WorkerReady(rank)))
    except (ValueError, FileNotFoundError) as exc:
        pipe.send(WorkerReady(rank, error=str(exc)))
        # NOTE: stay until rank 0 has read the refusal and closes the pipe, so the exit is
        # not taken for a crash.
        try:
            pipe.recv_bytes()
        except (EOFError, OSError):
            pass
        sys.exit(2)
    adapters = _AdapterReader(runner, config, model_dir) if runner.lora_state else None
    while True:
        try:
            message = pickle.loads(pipe.recv_bytes())
        except (EOFError, OSError):
            break  # rank 0 is gone
        if isinstance(message, ExecuteStep):
            runner.follow(message)
        elif isinstance(message, LoadLoRASlot):
            assert adapters is not None and runner.lora_state is not None
            weights = adapters.read(message.path, message.digest)
            runner.lora_state.load_slot(message.slot, weights)
        elif isinstance(message, Shutdown):
            break
    destroy_tensor_parallel(tp)
