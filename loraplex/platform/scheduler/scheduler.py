"""Scheduler: iteration-level continuous batching under a token budget.

One rule drives everything: each step, every scheduled request catches its
`num_computed_tokens` up towards its token count, within `max_num_batched_tokens`. That gives
chunked prefill (a long prompt takes several steps), prefix-cache skipping (cached tokens count
as computed), and prefill mixed with decode in one step. Running requests go first; when the
KV pool runs dry the most recently admitted running request is preempted and recomputed later.

Chunked prefill shares the step (`SchedulerConfig.long_prefill_token_threshold`): while other
requests run or wait, one request's prompt chunk takes at most `cap` tokens, leaves one token
for each running request after it, and leaves `min(cap, budget // 2)` tokens for admitting
waiting requests. So a long prompt never holds the whole budget while others wait: the head of
the waiting queue gets its first chunk in the next step that has a free sequence slot and KV
blocks for it, and decoding requests keep getting a token each step.

A step's tokens count as computed when it is scheduled, and a step that reaches a request's
end leaves one token pending until its output comes back. So with async scheduling the next
step can be scheduled while the device still runs this one: the pending token is its input
(the runner takes it from the device), and a request that turns out to have stopped simply
has one extra token computed and thrown away.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from typing import Protocol

from loraplex.config import CacheConfig, SchedulerConfig
from loraplex.platform.core.commands import TenantStat, TenantStatsReport
from loraplex.platform.core.request import Request, RequestStatus
from loraplex.platform.core.scheduler_output import (
    CachedRequestData,
    EngineCoreOutput,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
)
from loraplex.platform.core.spec_stats import SpecDecodingStats
from loraplex.platform.scheduler.kv_cache_manager import KVCacheManager
from loraplex.platform.scheduler.request_queue import FairRequestQueue


class AdapterAdmission(Protocol):
    """What the scheduler asks of the adapter side (never its slot tables)."""

    def can_schedule(self, key: str | None) -> bool:
        """Whether a request on this adapter can run now (its slot is written); never blocks.
        False starts the adapter's load; the request waits in the queue meanwhile."""
        ...

    def acquire_for_request(self, request_id: str, key: str | None) -> int:
        """Pin the adapter's slot for the request (after `can_schedule`); returns the slot."""
        ...

    def release_for_request(self, request_id: str) -> None:
        """Unpin the request's slot (finished, aborted, preempted); no-op if it holds none."""
        ...

    def prefetch(self, key: str | None) -> None:
        """Start reading a queued request's adapter ahead of need, evicting nothing."""
        ...


class Scheduler:
    def __init__(
        self,
        scheduler_config: SchedulerConfig,
        cache_config: CacheConfig,
        num_blocks: int,
        max_model_len: int,
        adapters: AdapterAdmission | None = None,
    ) -> None:
        self.config = scheduler_config
        self.max_model_len = max_model_len
        self.kv = KVCacheManager(
            num_blocks, cache_config.block_size, cache_config.enable_prefix_caching
        )
        self.adapters = adapters
        self.waiting = FairRequestQueue()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self._finished_ids: set[str] = set()
        self.num_preemptions = 0
        self.spec_stats = SpecDecodingStats()
        # Unfinished requests that cannot be scheduled ahead of their last token (async_ok
        # False); while there are any, the engine steps in lock step.
        self.num_lock_step = 0

    # -- requests in and out -------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        self.requests[request.request_id] = request
        self.waiting.push(request)
        if not request.async_ok:
            self.num_lock_step += 1
        if self.adapters is not None and request.adapter_key is not None:
            self.adapters.prefetch(request.adapter_key)

    def finish_requests(self, request_ids: Iterable[str], status: RequestStatus) -> None:
        """End requests from outside the step (abort, stop string found by the detokenizer)."""
        for req_id in request_ids:
            request = self.requests.get(req_id)
            if request is None or request.status.finished:
                continue
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            else:
                self.waiting.remove(request)
            self._free(request, status)

    def finish_all_requests(self, status: RequestStatus) -> list[str]:
        """End every request, wherever a step that raised midway left it; returns their ids.

        Their blocks and adapter slots are freed and the runner is told to forget them (in the
        next `SchedulerOutput.finished_req_ids`), so nothing stays running or allocated."""
        ids = list(self.requests)
        for request in list(self.requests.values()):
            self._free(request, status)
        self.running.clear()  # NOTE: may hold requests a failed update had already freed
        while len(self.waiting):
            self.waiting.pop(charge=False)
        return ids

    def _free(self, request: Request, status: RequestStatus) -> None:
        request.status = status
        self.kv.free(request)
        self._release_adapter(request)
        self._finished_ids.add(request.request_id)
        del self.requests[request.request_id]
        if not request.async_ok:
            self.num_lock_step -= 1

    def _release_adapter(self, request: Request) -> None:
        # NOTE: the adapter side keeps the one request -> adapter table; releasing a request
        # that holds no slot is a no-op there.
        if self.adapters is not None and request.adapter_key is not None:
            self.adapters.release_for_request(request.request_id)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def has_unfinished_requests(self) -> bool:
        return bool(self.running) or len(self.waiting) > 0

    def set_tenant_weight(self, tenant: str, weight: float) -> None:
        """The tenant's share in weighted fair queuing (1.0 unless set)."""
        self.waiting.weights[tenant] = float(weight)

    def update_draft_token_ids(self, draft_token_ids: dict[str, list[int]]) -> None:
        """Take a proposer's drafts: each running request verifies its own in its next step
        (`scheduled_spec_decode_tokens`), a request without an entry none."""
        for request in self.running:
            request.spec_token_ids = draft_token_ids.get(request.request_id, [])

    def num_waiting_by_adapter(self) -> Counter[str]:
        """Adapter key -> sequences on it that are not running (queued, preempted)."""
        return Counter(
            r.adapter_key
            for r in self.requests.values()
            if r.adapter_key is not None and r.status != RequestStatus.RUNNING
        )

    def tenant_stats(self) -> TenantStatsReport:
        """Each tenant's running and waiting sequences and the KV blocks they hold."""
        counts: dict[str, list[int]] = {}
        blocks: dict[str, set[int]] = {}
        for request in self.running:
            counts.setdefault(request.tenant, [0, 0])[0] += 1
            blocks.setdefault(request.tenant, set()).update(self.kv.block_ids(request.request_id))
        for request in self.waiting:
            counts.setdefault(request.tenant, [0, 0])[1] += 1
        return TenantStatsReport(
            tuple(
                TenantStat(tenant, running, waiting, len(blocks.get(tenant, ())))
                for tenant, (running, waiting) in sorted(counts.items())
            )
        )

    # -- one step ------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        num_scheduled: dict[str, int] = {}
        new_reqs: list[NewRequestData] = []
        cached_reqs: list[CachedRequestData] = []
        spec_tokens: dict[str, list[int]] = {}
        preempted = False
        can_admit = len(self.waiting) > 0 and len(self.running) < self.config.max_num_seqs
        cap = self.config.prefill_chunk_cap
        if len(self.running) + (len(self.waiting) if can_admit else 0) <= 1:
            cap = 0  # nothing to share the step with: a prompt may take the whole budget
        reserve = min(cap, budget // 2) if can_admit else 0

        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            n = self._num_new_tokens(request, budget)
            if n > 1 and cap:
                # A prompt chunk: leave a token for each later running request and the reserve.
                n = min(n, cap, budget - (len(self.running) - i - 1) - reserve)
            if n <= 0:
                i += 1
                continue
            drafts, request.spec_token_ids = request.spec_token_ids, []
            if n == 1 and drafts:
                drafts = self._fit_drafts(request, drafts, budget)
                new_block_ids = self.kv.allocate_slots(request, 1 + len(drafts)) if drafts else None
                if new_block_ids is not None:  # NOTE: drafts never preempt anyone
                    n = 1 + len(drafts)
                    spec_tokens[request.request_id] = drafts
                    num_scheduled[request.request_id] = n
                    cached_reqs.append(
                        CachedRequestData(
                            request.request_id, new_block_ids, request.num_computed_tokens
                        )
                    )
                    _advance(request, n, len(drafts))
                    budget -= n
                    i += 1
                    continue
            while True:
                new_block_ids = self.kv.allocate_slots(request, n)
                if new_block_ids is not None:
                    break
                victim = self.running.pop()
                self._preempt(victim)
                preempted = True
                if victim is request:
                    break
            if new_block_ids is None:
                break
            num_scheduled[request.request_id] = n
            cached_reqs.append(
                CachedRequestData(request.request_id, new_block_ids, request.num_computed_tokens)
            )
            _advance(request, n)
            budget -= n
            i += 1

        # NOTE: no admissions in a step that preempted: the pool is known to be short.
        skipped: list[Request] = []
        while (
            not preempted
            and budget > 0
            and len(self.waiting) > 0
            and len(self.running) < self.config.max_num_seqs
        ):
            request = self.waiting.peek()
            if request.status == RequestStatus.WAITING_FOR_GRAMMAR:
                skipped.append(self.waiting.pop(charge=False))
                continue
            if not self._adapter_ready(request):
                # No free slot for its adapter now: let later requests in, and warm its weights.
                assert self.adapters is not None
                self.adapters.prefetch(request.adapter_key)
                skipped.append(self.waiting.pop(charge=False))
                continue
            computed_blocks: list = []
            if request.num_computed_tokens == 0:
                computed_blocks, num_hit = self.kv.get_computed_blocks(request)
                if request.num_cached_tokens < 0:
                    request.num_cached_tokens = num_hit
            else:
                num_hit = 0
            n = self._num_new_tokens(request, budget, extra_computed=num_hit)
            if cap:
                n = min(n, cap)
            if n == 0:
                break
            new_block_ids = self.kv.allocate_slots(request, n, computed_blocks)
            if new_block_ids is None:
                break
            self.waiting.pop()
            request.num_computed_tokens += num_hit
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            slot = -1
            if request.adapter_key is not None and self.adapters is not None:
                # NOTE: acquiring may start the adapter's host-to-device copy (on a side
                # stream); the scheduler itself never touches device memory.
                slot = self.adapters.acquire_for_request(request.request_id, request.adapter_key)
            num_scheduled[request.request_id] = n
            new_reqs.append(
                NewRequestData(
                    req_id=request.request_id,
                    prompt_token_ids=request.prompt_token_ids,
                    output_token_ids=list(request.output_token_ids),
                    sampling_params=request.sampling_params,
                    block_ids=self.kv.block_ids(request.request_id),
                    num_computed_tokens=request.num_computed_tokens,
                    lora_slot=slot,
                )
            )
            _advance(request, n)
            budget -= n
        for request in reversed(skipped):
            self.waiting.push_front(request)

        finished, self._finished_ids = frozenset(self._finished_ids), set()
        return SchedulerOutput(
            new_reqs=new_reqs,
            cached_reqs=cached_reqs,
            num_scheduled_tokens=num_scheduled,
            total_num_scheduled_tokens=sum(num_scheduled.values()),
            finished_req_ids=finished,
            scheduled_spec_decode_tokens=spec_tokens,
        )

    def _fit_drafts(self, request: Request, drafts: list[int], budget: int) -> list[int]:
        """The drafts a decoding request may verify now: within the step's token budget, its
        max_tokens (the step emits up to len + 1 tokens) and the model's length."""
        if request.num_pending:
            return []
        k = min(
            len(drafts),
            budget - 1,
            request.max_tokens - request.num_output_tokens - 1,
            self.max_model_len - request.num_tokens,
        )
        return drafts[: max(k, 0)]

    def _num_new_tokens(self, request: Request, budget: int, extra_computed: int = 0) -> int:
        pending = request.num_pending
        if pending and (
            not request.async_ok
            or request.num_output_tokens + pending >= request.max_tokens
            or request.num_tokens + pending >= self.max_model_len
        ):
            # Its pending token must be known first, or will end it (length) anyway.
            return 0
        computed = request.num_computed_tokens + extra_computed
        n = min(request.num_tokens + pending - computed, self.max_model_len - computed)
        if not self.config.enable_chunked_prefill and n > budget:
            return 0
        return max(0, min(n, budget))

    def _adapter_ready(self, request: Request) -> bool:
        if request.adapter_key is None or self.adapters is None:
            return True
        return self.adapters.can_schedule(request.adapter_key)

    def _preempt(self, request: Request) -> None:
        self.kv.free(request)
        self._release_adapter(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_pending = 0  # a token still in flight is dropped and sampled again
        request.spec_token_ids = []
        request.num_preemptions += 1
        self.num_preemptions += 1
        self._finished_ids.add(request.request_id)
        self.waiting.push_front(request)

    def update_from_output(
        self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> list[EngineCoreOutput]:
        outputs: list[EngineCoreOutput] = []
        still_running: list[Request] = []
        for request in self.running:
            token = runner_output.sampled.get(request.request_id)
            if token is None or request.request_id not in scheduler_output.num_scheduled_tokens:
                still_running.append(request)
                continue
            request.num_pending -= 1
            tokens = [token, *runner_output.extra_token_ids.get(request.request_id, ())]
            drafts = scheduler_output.scheduled_spec_decode_tokens.get(request.request_id)
            if drafts:
                # NOTE: the K/V of rejected drafts is rolled back by counting it uncomputed:
                # their slots are rewritten by the next tokens, and no block holding them was
                # published to the prefix cache (hashes cover known tokens only).
                request.num_computed_tokens -= len(drafts) - (len(tokens) - 1)
                self.spec_stats.observe(len(drafts), len(tokens) - 1)
            status = None
            for n, token in enumerate(tokens, 1):
                request.append_output_token(token)
                if request.grammar is not None:
                    request.grammar.accept_token(token)
                status = self._check_stop(request, token)
                if status is not None:
                    del tokens[n:]  # NOTE: an EOS or a length limit inside an accepted run
                    break
            outputs.append(
                EngineCoreOutput(
                    req_id=request.request_id,
                    new_token_ids=tokens,
                    new_logprobs=runner_output.logprobs.get(request.request_id),
                    finish_reason=None,
                    stop_reason=request.stop_reason,
                    num_cached_tokens=max(request.num_cached_tokens, 0),
                )
            )
            if status is None:
                still_running.append(request)
            else:
                self._free(request, status)
                outputs[-1] = _with_finish(outputs[-1], request)
        self.running = still_running
        return outputs

    def _check_stop(self, request: Request, token: int) -> RequestStatus | None:
        params = request.sampling_params
        if request.num_output_tokens >= params.min_tokens:
            if token in request.eos_token_ids and not params.ignore_eos:
                return RequestStatus.FINISHED_STOPPED
            if token in params.stop_token_ids:
                request.stop_reason = token
                return RequestStatus.FINISHED_STOPPED
        if request.grammar is not None and (
            request.grammar.is_terminated() or request.grammar.must_stop()
        ):
            return RequestStatus.FINISHED_STOPPED
        if request.num_output_tokens >= request.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        if request.num_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None


def _advance(request: Request, n: int, num_drafts: int = 0) -> None:
    """Count a scheduled step's tokens as computed; one that reaches the end samples a token
    (a speculative step's `num_drafts` draft tokens count, and are rolled back if rejected)."""
    request.num_computed_tokens += n
    if request.num_computed_tokens == request.num_tokens + request.num_pending + num_drafts:
        request.num_pending += 1


def _with_finish(output: EngineCoreOutput, request: Request) -> EngineCoreOutput:
    return EngineCoreOutput(
        req_id=output.req_id,
        new_token_ids=output.new_token_ids,
        new_logprobs=output.new_logprobs,
        finish_reason=request.finish_reason,
        stop_reason=request.stop_reason,
        num_cached_tokens=output.num_cached_tokens,
    )
