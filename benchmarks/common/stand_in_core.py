"""A stand-in EngineCore process for measuring API processes without a model: the real
`EngineLoop` over the real `ZmqTransport` (the same messages, batches and handshake as
`loraplex serve`), stepping a `StandInEngine` that gives every running sample one token per
step at a fixed step period.

The engine's outputs come from the real `OutputProcessor` without text (as the engine core's
do), so an API process receives exactly what a real core of that speed would send it.
"""

from __future__ import annotations

import logging
import os
import random
import signal
import time
from multiprocessing.connection import Connection
from pathlib import Path

from loraplex.config import EngineConfig, SchedulerConfig
from loraplex.platform.core.commands import (
    EngineCommand,
    GetTenantStats,
    SetTenantWeight,
    TenantStatsReport,
)
from loraplex.platform.core.outputs import RequestOutput, StopHit
from loraplex.platform.core.sampling_params import SamplingParams
from loraplex.platform.core.scheduler_output import EngineCoreOutput
from loraplex.platform.core.stats import EngineStats
from loraplex.platform.engine.engine_loop import EngineLoop
from loraplex.platform.engine.ipc import PROTOCOL_VERSION, EngineInfo
from loraplex.platform.engine.output_processor import OutputProcessor, core_request_ids
from loraplex.platform.engine.zmq_transport import ZmqTransport
from loraplex.platform.tokenizer.tokenizer import load_tokenizer

# Token ids the stand-in samples from: ordinary words of the served vocabularies (as the
# serving benchmarks' prompts), in a fixed pseudo-random order.
_TOKENS = random.Random(0).choices(range(1000, 40000), k=8192)


class _Sample:
    __slots__ = ("left", "made", "offset")

    def __init__(self, max_tokens: int, offset: int) -> None:
        self.left = max_tokens
        self.made = 0
        self.offset = offset


class StandInEngine:
    """What `EngineLoop` calls of an `Engine`, with no model: requests are admitted at once,
    and each step (`step_s` apart) every running sample gets one token until its max_tokens
    (default 256). Engine commands other than tenant weights and tenant stats are refused."""

    def __init__(self, model_dir: Path, step_s: float) -> None:
        self.config = EngineConfig(scheduler=SchedulerConfig(request_stall_timeout_s=0))
        self.model_dir = model_dir
        self.tokenizer = load_tokenizer(model_dir, 0)
        self.served_model_name = model_dir.name
        self.max_model_len = 4096
        self.step_s = step_s
        self.output_processor = OutputProcessor(self.tokenizer, detokenize=False)
        self._samples: dict[str, _Sample] = {}
        self._next_step = 0.0
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        *,
        prompt_token_ids: list[int] | None = None,
        tenant: str = "default",
        lora_request: object = None,
    ) -> str:
        if lora_request is not None:
            raise ValueError("the stand-in engine serves no adapters")
        ids = prompt_token_ids if prompt_token_ids is not None else prompt
        if not isinstance(ids, list):
            raise ValueError("the stand-in engine takes token ids")
        core_ids = core_request_ids(request_id, params.n)
        self.output_processor.add_request(request_id, None, ids, params, core_ids)
        for core_id in core_ids:
            offset = hash(core_id) % len(_TOKENS)
            self._samples[core_id] = _Sample(params.max_tokens or 256, offset)
        self.prompt_tokens_total += len(ids)
        return request_id

    def step(self) -> list[RequestOutput]:
        now = time.perf_counter()
        if self._next_step > now:
            time.sleep(self._next_step - now)
        self._next_step = max(now, self._next_step) + self.step_s
        outputs: list[EngineCoreOutput] = []
        finished = []
        for core_id, sample in self._samples.items():
            token = _TOKENS[(sample.offset + sample.made) % len(_TOKENS)]
            sample.made += 1
            sample.left -= 1
            reason = "length" if sample.left <= 0 else None
            if reason is not None:
                finished.append(core_id)
            outputs.append(EngineCoreOutput(core_id, [token], None, reason, None, 0))
        for core_id in finished:
            del self._samples[core_id]
        self.generation_tokens_total += len(outputs)
        return self.output_processor.process(outputs)[0]

    def abort_request(
        self, request_id: str, error: Exception | None = None
    ) -> RequestOutput | None:
        for core_id in self.output_processor.core_ids(request_id):
            self._samples.pop(core_id, None)
        return self.output_processor.abort(request_id, "abort" if error is None else "error")

    def stop_samples(self, hits: list[StopHit]) -> list[RequestOutput]:
        outputs = []
        for hit in hits:
            self._samples.pop(hit.core_id, None)
            out = self.output_processor.stop(hit)
            if out is not None:
                outputs.append(out)
        return outputs

    def end_all_requests(self, request_ids: object) -> None:
        for core_id in list(self._samples):
            parent = self.output_processor.parent_of(core_id)
            if parent is not None:
                self.abort_request(parent)

    def handle_command(self, command: EngineCommand) -> object:
        if isinstance(command, SetTenantWeight):
            return None
        if isinstance(command, GetTenantStats):
            return TenantStatsReport(())
        raise ValueError(f"the stand-in engine does not serve {type(command).__name__}")

    def progress(self, request_id: str) -> tuple[tuple[int, int], ...]:
        samples = (self._samples.get(c) for c in self.output_processor.core_ids(request_id))
        return tuple((s.made, s.made) for s in samples if s is not None)

    def has_unfinished_requests(self) -> bool:
        return bool(self._samples)

    def stats(self) -> EngineStats:
        return EngineStats(len(self._samples), 0, 0, 0, 0.0, 0, 0, 0)

    def shutdown(self) -> None:
        return None


def run_stand_in_core(address: str, model_dir: str, step_s: float, ready: Connection) -> None:
    """The stand-in EngineCore process's entry (a multiprocessing target): serve on `address`
    until SIGTERM; sends True on `ready` once bound."""
    logging.basicConfig(level=logging.WARNING)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    engine = StandInEngine(Path(model_dir), step_s)
    info = EngineInfo(
        version=PROTOCOL_VERSION,
        served_model_name=engine.served_model_name,
        max_model_len=engine.max_model_len,
        model_dir=str(engine.model_dir),
        vocab_size=0,
        pid=os.getpid(),
        adapter_validator=None,
    )
    transport = ZmqTransport(address, info)
    loop = EngineLoop(engine, transport)  # type: ignore[arg-type]
    loop.add_timing_observer(transport.add_timing)
    signal.signal(signal.SIGTERM, lambda *_: transport.request_stop())
    ready.send(True)
    loop.run()
