"""StepOutput: a launched step's sampled tokens and logprobs, read back when the engine asks."""

from __future__ import annotations

import numpy as np
import torch

from loraplex.platform.core.scheduler_output import ModelRunnerOutput, PromptLogprobScores
from loraplex.platform.runner.input_batch import InputBatch
from loraplex.platform.runner.sampling_metadata import LogprobsTensors

# req_id -> [(token_id, logprob, rank)], the sampled token first, then the top-k.
Logprobs = dict[str, list[tuple[int, float, int]]]


class StepOutput:
    """A launched step's output. The device copies its tokens (and its logprobs, packed in one
    tensor) into pinned host memory behind the step; `get()` waits on one event — the step's
    one synchronisation — and hands the tokens to the input batch."""

    def __init__(
        self,
        batch: InputBatch | None,
        req_ids: list[str],
        generations: np.ndarray,  # [k] int64, which add of each request sampled
        tokens: torch.Tensor | None,  # [k] int64 on the device
        logprobs: LogprobsTensors | None,
        num_logprobs: list[int | None],  # per sampled row, its top-k count (None: no logprobs)
        prompt_logprobs: PromptLogprobScores,
        # A speculative step: tokens is [k, K + 1] and each row emitted its first num_emitted
        num_emitted: torch.Tensor | None = None,  # [k] int64 on the device
    ) -> None:
        self._batch, self._req_ids, self._generations = batch, req_ids, generations
        self._num_logprobs, self._prompt_logprobs = num_logprobs, prompt_logprobs
        self._event: torch.cuda.Event | None = None
        packed = _pack(logprobs) if logprobs is not None else None
        self._speculative = num_emitted is not None
        if num_emitted is not None and tokens is not None:
            tokens = torch.cat([tokens, num_emitted[:, None]], dim=1)  # one copy back
        if tokens is not None and tokens.is_cuda:
            tokens = _to_pinned(tokens)
            packed = _to_pinned(packed) if packed is not None else None
            self._event = torch.cuda.Event()
            self._event.record()
        self._tokens, self._packed = tokens, packed
        self._output: ModelRunnerOutput | None = None

    @classmethod
    def ready(cls, output: ModelRunnerOutput) -> StepOutput:
        step = cls(None, [], np.zeros(0, dtype=np.int64), None, None, [], {})
        step._output = output
        return step

    def get(self) -> ModelRunnerOutput:
        if self._output is None:
            if self._event is not None:
                self._event.synchronize()
            assert self._batch is not None and self._tokens is not None
            extra: dict[str, list[int]] = {}
            if self._speculative:
                rows = self._tokens.tolist()
                token_ids = [row[0] for row in rows]
                for req_id, row in zip(self._req_ids, rows):
                    if row[-1] > 1:
                        extra[req_id] = row[1 : row[-1]]
            else:
                token_ids = self._tokens.tolist()
            logprobs = _unpack(self._packed, self._req_ids, self._num_logprobs, token_ids)
            self._output = ModelRunnerOutput(
                sampled=self._batch.receive(self._req_ids, self._generations, token_ids, extra),
                logprobs=logprobs,
                prompt_logprobs=self._prompt_logprobs,
                extra_token_ids=extra,
            )
        return self._output


def _to_pinned(tensor: torch.Tensor) -> torch.Tensor:
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    return host.copy_(tensor, non_blocking=True)


def _pack(lp: LogprobsTensors) -> torch.Tensor:
    """[k, 2 + 2 * top] float64: logprob, rank, top ids, top logprobs (ids and ranks are exact
    in float64), so one copy brings them all back."""
    return torch.cat(
        [
            lp.token_logprobs[:, None].double(),
            lp.token_ranks[:, None].double(),
            lp.top_ids.double(),
            lp.top_logprobs.double(),
        ],
        dim=1,
    )


def _unpack(
    packed: torch.Tensor | None,
    req_ids: list[str],
    num_logprobs: list[int | None],
    token_ids: list[int],
) -> Logprobs:
    if packed is None:
        return {}
    rows = packed.tolist()
    top = (packed.shape[1] - 2) // 2
    out: Logprobs = {}
    for req_id, k, token, row in zip(req_ids, num_logprobs, token_ids, rows):
        if k is None:
            continue
        ids, values = row[2 : 2 + top], row[2 + top :]
        entry = [(token, row[0], int(row[1]))]
        entry += [(int(ids[j]), values[j], j + 1) for j in range(k)]
        out[req_id] = entry
    return out
