"""ClientOutputs: the API process's half of output processing, for the EngineCore process.

The core sends each step's new token ids and logprob values per sample, without text (its
Engine runs with `detokenize=False`). Here they become the scheduler's per-sample outputs
again and go through the same OutputProcessor the in-process engine runs: incremental
detokenization, stop strings (with the held-back tail of a partial match), logprob texts and
the caller's output kind. So a request returns the same text whichever engine serves it, and
the detokenizing work spreads over the API processes instead of holding up the core's steps.
"""

from __future__ import annotations

import time

from loraplex.platform.core.outputs import (
    Logprob,
    PromptLogprobs,
    RequestOutput,
    StopHit,
)
from loraplex.platform.engine.output_processor import OutputProcessor


class ClientOutputs(OutputProcessor):
    """An OutputProcessor fed with the core's token-id outputs of this process's requests
    (tracked with `add_request` and the caller's params: its output kind, stop strings)."""

    def forget(self, request_id: str) -> None:
        """Drop a request the core refused or failed."""
        self.abort(request_id)

    def process_core(
        self, outputs: list[RequestOutput]
    ) -> tuple[list[RequestOutput], list[StopHit]]:
        """The core's outputs of one step -> (outputs for the callers, samples that matched a
        stop string, whose core requests must be stopped)."""
        results: list[RequestOutput] = []
        stopped: list[StopHit] = []
        now = time.monotonic()
        parents = self._parents
        for output in outputs:
            parent = parents.get(output.request_id)
            if parent is None:
                continue  # finished here already (a stop string), or unknown
            core_ids = list(parent.samples)
            if output.prompt_logprobs:
                self._add_prompt_logprobs(core_ids[0], output.prompt_logprobs)
            num_cached = output.num_cached_tokens
            took = False
            for sample in output.outputs:
                core_id = core_ids[sample.index]
                logprobs = sample.logprobs
                if not logprobs or len(sample.token_ids) <= 1:
                    took |= self._add_step(
                        parent, core_id, sample.token_ids,
                        _entries(logprobs[0]) if logprobs else None,
                        sample.finish_reason, sample.stop_reason, num_cached, now, stopped,
                    )  # fmt: skip
                    continue
                # NOTE: with logprobs, one token at a time (each carries one token's logprobs)
                last = len(sample.token_ids) - 1
                for i, (token, token_logprobs) in enumerate(zip(sample.token_ids, logprobs)):
                    took |= self._add_step(
                        parent, core_id, [token], _entries(token_logprobs),
                        sample.finish_reason if i == last else None,
                        sample.stop_reason if i == last else None, num_cached, now, stopped,
                    )  # fmt: skip
            result = self._make_output(parent) if took else None
            if result is None:
                continue
            if output.error is not None and result.finished:
                result.error, result.failure = output.error, output.failure
            results.append(result)
        return results, stopped

    def _add_prompt_logprobs(self, core_id: str, logprobs: PromptLogprobs) -> None:
        # NOTE: position by position: a prompt's first token has none (None), and rare
        # enough (prompt_logprobs requests) that a call per token costs nothing that matters.
        for position, entry in enumerate(logprobs):
            if entry is not None:
                self.add_prompt_logprobs({core_id: (position, [_entries(entry)])})


def _entries(logprobs: dict[int, Logprob]) -> list[tuple[int, float, int]]:
    """A token's logprobs as the runner reports them: the sampled token first, then top-k."""
    return [(token_id, lp.logprob, lp.rank) for token_id, lp in logprobs.items()]
