"""Scheduler: iteration-level continuous batching under a token budget.

One rule drives everything: each step, every scheduled request catches its
`num_computed_tokens` up towards its token count, within `max_num_batched_tokens`. That gives
chunked prefill (a long prompt takes several steps), prefix-cache skipping (cached tokens count
as computed), and prefill mixed with decode in one step. Running requests go first, then
waiting ones are admitted in weighted-fair order.

Memory pressure is shared by the tenants' fair shares (`TenantShares`: a busy tenant's weight
over the busy tenants' weights, of the KV blocks and of the sequence slots). When the KV pool
runs dry, the newest request of the tenant furthest over its share is preempted (its blocks
freed, to be recomputed; it goes back to the head of its tenant's queue, so it resumes before
that tenant's newer requests). Admission leaves the blocks the running set needs to take one
more token each next step; a tenant over its share is admitted only into idle capacity, and a
tenant within its share takes capacity back from those over theirs. A request preempted in a
step is not admitted again in that step. So one tenant's batches can fill an idle server, but
never push another tenant's stream out of it.

The step's budget is split so decodes keep their pace and prompts their order: every prompt
chunk leaves one token for each running request after it, so a decoding request gets its
token every step. Prompts are prefilled oldest first (running ones, then waiting ones in
fair-queue order). While other requests run or wait, a long prompt (more than `cap`,
`SchedulerConfig.long_prefill_token_threshold`) takes at most `cap` tokens a step, and a
running one leaves `min(cap, budget // 2)` tokens for admitting waiting requests; at most
`max_long_partial_prefills` long prompts are prefilled ahead of shorter waiting ones, the
others let those in first. Whatever budget is left then goes back to the prompts the cap held
back, oldest first: the cap shares a contended step and never leaves budget idle.

A step's tokens count as computed when it is scheduled, and a step that reaches a request's
end leaves one token pending until its output comes back. So with async scheduling the next
step can be scheduled while the device still runs this one: the pending token is its input
(the runner takes it from the device), and a request that turns out to have stopped simply
has one extra token computed and thrown away.
"""

from __future__ import annotations

import enum
from collections import Counter
from collections.abc import Iterable
from dataclasses import replace
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
from loraplex.platform.scheduler.tenant_shares import TenantShares


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
        self.shares = TenantShares(
            self.waiting.weights, self.kv.tenant_blocks, num_blocks, scheduler_config.max_num_seqs
        )
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
        self.shares.add_request(request.tenant)
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
                self.shares.stopped(request.tenant)
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
        self.shares.clear_running()
        while len(self.waiting):
            self.waiting.pop(charge=False)
        return ids

    def _free(self, request: Request, status: RequestStatus) -> None:
        request.status = status
        self.kv.free(request)
        self._release_adapter(request)
        self._finished_ids.add(request.request_id)
        del self.requests[request.request_id]
        self.shares.remove_request(request.tenant)
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
        """The tenant's weight: its share of admissions (fair queuing) and of the KV blocks and
        sequence slots under pressure, against the other busy tenants' weights."""
        if not weight > 0:
            raise ValueError(f"a tenant's weight must be > 0, got {weight}")
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
        for request in self.running:
            counts.setdefault(request.tenant, [0, 0])[0] += 1
        for request in self.waiting:
            counts.setdefault(request.tenant, [0, 0])[1] += 1
        blocks = self.kv.tenant_blocks  # each block once, however many requests share it
        return TenantStatsReport(
            tuple(
                TenantStat(tenant, running, waiting, blocks.get(tenant, 0))
                for tenant, (running, waiting) in sorted(counts.items())
            )
        )

    # -- one step ------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        step = _Step(self.config.max_num_batched_tokens)
        can_admit = len(self.waiting) > 0 and len(self.running) < self.config.max_num_seqs
        cap = self.config.prefill_chunk_cap
        if len(self.running) + (len(self.waiting) if can_admit else 0) <= 1:
            cap = 0  # nothing to share the step with: a prompt may take the whole budget
        reserve = min(cap, step.budget // 2) if can_admit else 0
        self._schedule_running(step, cap, reserve)
        self._schedule_waiting(step, cap)
        if step.capped and step.budget > 0:
            self._top_up(step)

        finished, self._finished_ids = frozenset(self._finished_ids), set()
        cached_reqs = step.cached_reqs
        new_reqs = step.new_reqs
        if step.unscheduled:  # NOTE: requests preempted after they were scheduled this step
            cached_reqs = [c for c in cached_reqs if c.req_id not in step.unscheduled]
            new_reqs = [r for r in new_reqs if r.req_id not in step.unscheduled]
        return SchedulerOutput(
            new_reqs=new_reqs,
            cached_reqs=cached_reqs,
            num_scheduled_tokens=step.num_scheduled,
            total_num_scheduled_tokens=step.total,
            finished_req_ids=finished,
            scheduled_spec_decode_tokens=step.spec_tokens,
        )

    def _schedule_running(self, step: _Step, cap: int, reserve: int) -> None:
        """Give each running request its tokens for the step, in the order they run; when the
        KV pool runs dry, preempt the newest request of the tenant furthest over its share."""
        # NOTE: the hot path (one pass over every running request each step): locals below
        # and no allocation for a plain decode beyond its CachedRequestData.
        bs = self.kv.block_size
        allocate = self.kv.allocate_slots
        num_scheduled = step.num_scheduled
        add_cached = step.cached_reqs.append
        running_status = RequestStatus.RUNNING
        running = list(self.running)  # NOTE: a copy: preemption removes from self.running
        num_later = len(running)
        budget = step.budget
        for request in running:
            num_later -= 1
            if budget <= 0:
                break
            if request.status != running_status:
                continue  # preempted earlier in this step
            n = self._num_new_tokens(request, budget)
            capped = False
            if n > 1 and cap:
                # A prompt chunk leaves a token for each later running request; a long one
                # (more than the cap) takes at most the cap and leaves the reserve too.
                wanted = n
                n = min(n, budget - num_later)
                if wanted > cap:
                    n = min(n, cap, budget - num_later - reserve)
                capped = n < wanted
                if n <= 0:
                    step.capped.append((request, step.cached_reqs, -1))
                    continue
            if n <= 0:
                continue
            num_drafts = 0
            new_block_ids = None
            drafts = request.spec_token_ids
            if drafts:
                request.spec_token_ids = []
                if n == 1:
                    drafts = self._fit_drafts(request, drafts, budget)
                    if drafts:  # NOTE: drafts never preempt anyone
                        new_block_ids = allocate(request, 1 + len(drafts))
                    if new_block_ids is not None:
                        num_drafts = len(drafts)
                        n = 1 + num_drafts
                        step.spec_tokens[request.request_id] = drafts
            if new_block_ids is None:
                new_block_ids = allocate(request, n)
                if new_block_ids is None:
                    step.budget = budget
                    new_block_ids = self._allocate_preempting(request, n, step)
                    budget = step.budget
                    if new_block_ids is None:
                        continue
            num_scheduled[request.request_id] = n
            if capped:
                step.capped.append((request, step.cached_reqs, len(step.cached_reqs)))
            add_cached(
                CachedRequestData(request.request_id, new_block_ids, request.num_computed_tokens)
            )
            _advance(request, n, num_drafts)
            budget -= n
            if request.num_computed_tokens % bs == 0:
                step.headroom += 1  # its next token starts a block
        step.budget = budget

    def _allocate_preempting(self, request: Request, n: int, step: _Step) -> list[int] | None:
        """Blocks for a running request's `n` tokens, preempting the newest requests of the
        tenants furthest over their KV shares until they fit; None if it was preempted."""
        while True:
            need = self.kv.num_new_blocks(request, n)
            victim = self._newest_running(self.shares.kv_victim(request.tenant, need))
            self._preempt(victim, step)
            if victim is request:
                return None
            new_block_ids = self.kv.allocate_slots(request, n)
            if new_block_ids is not None:
                return new_block_ids

    def _schedule_waiting(self, step: _Step, cap: int) -> None:
        """Admit waiting requests in fair-queue order while the step's budget, a sequence slot
        and KV blocks (past the running set's next step) allow.

        A tenant over its fair share only borrows idle capacity: when there is none, its
        requests wait and the others' may still come in. A tenant within its share may take
        capacity back from the tenants over theirs (their newest requests are preempted); a
        request it cannot fit that way waits at the head of the queue, holding the others back,
        so a large request is never starved by smaller ones. A tenant with a request preempted
        in this step has none admitted in it.

        Prompts longer than the chunk cap are prefilled `max_long_partial_prefills` at a time
        (those already running count) ahead of shorter ones: past that, a long prompt lets
        the shorter ones behind it in first and takes what budget they leave, in a second
        pass. So short prompts are not queued behind long ones, and no budget idles."""
        passed_over: set[str] = set()  # tenants over their share with no room left for them
        long_slots = None
        if cap:
            long_slots = max(self.config.max_long_partial_prefills - len(step.capped), 0)
        if self._admit(step, cap, passed_over, long_slots) and step.budget > 0:
            self._admit(step, cap, passed_over, None)

    def _admit(self, step: _Step, cap: int, passed_over: set[str], long_slots: int | None) -> bool:
        """One pass of admissions (see `_schedule_waiting`); with `long_slots`, prompts longer
        than the cap past that many are set aside. Returns whether any was."""
        skipped: list[Request] = []
        deferred = False
        bs = self.kv.block_size
        while step.budget > 0:
            try:
                request = self.waiting.peek(passed_over)
            except IndexError:
                break
            if request.request_id in step.preempted:
                # NOTE: its tenant's newer requests wait behind it: a preempted request resumes
                # before them, and not in the step that preempted it (a token of it may still
                # be in flight).
                passed_over.add(request.tenant)
                continue
            if request.status == RequestStatus.WAITING_FOR_GRAMMAR:
                skipped.append(self.waiting.pop(charge=False, exclude=passed_over))
                continue
            if not self._adapter_ready(request):
                # No free slot for its adapter now: let later requests in, and warm its weights.
                assert self.adapters is not None
                self.adapters.prefetch(request.adapter_key)
                skipped.append(self.waiting.pop(charge=False, exclude=passed_over))
                continue
            room = self._slot_room(request.tenant)
            if room is _Room.OVER_SHARE:
                passed_over.add(request.tenant)
                continue
            if room is _Room.NONE:
                break
            if long_slots is not None and request.num_tokens - request.num_computed_tokens > cap:
                # NOTE: long before its prefix-cache hits (looked up once it is admitted, so a
                # set-aside request is not counted twice in the hit rate).
                if not long_slots:
                    skipped.append(self.waiting.pop(charge=False, exclude=passed_over))
                    deferred = True
                    continue
                long_slots -= 1
            computed_blocks: list = []
            if request.num_computed_tokens == 0:
                computed_blocks, num_hit = self.kv.get_computed_blocks(request)
                if request.num_cached_tokens < 0:
                    request.num_cached_tokens = num_hit
            else:
                num_hit = 0
            n = self._num_new_tokens(request, step.budget, extra_computed=num_hit)
            capped = cap and n > cap
            if capped:
                n = cap
            if n == 0:
                break
            room = self._make_room(request, n, computed_blocks, step)
            if room is _Room.OVER_SHARE:
                passed_over.add(request.tenant)
                continue
            if room is _Room.NONE:
                break
            new_block_ids = self.kv.allocate_slots(request, n, computed_blocks)
            assert new_block_ids is not None  # NOTE: _make_room counted these blocks free
            self.waiting.pop(exclude=passed_over)
            request.num_computed_tokens += num_hit
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            self.shares.started(request.tenant)
            slot = -1
            if request.adapter_key is not None and self.adapters is not None:
                # NOTE: acquiring may start the adapter's host-to-device copy (on a side
                # stream); the scheduler itself never touches device memory.
                slot = self.adapters.acquire_for_request(request.request_id, request.adapter_key)
            step.num_scheduled[request.request_id] = n
            if capped:
                step.capped.append((request, step.new_reqs, len(step.new_reqs)))
            step.new_reqs.append(
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
            step.budget -= n
            if request.num_computed_tokens % bs == 0:
                step.headroom += 1
        for request in reversed(skipped):
            self.waiting.push_front(request)
        return deferred

    def _top_up(self, step: _Step) -> None:
        """Give what the step's budget has left to the prompt chunks the cap held back, oldest
        first: the cap shares a contended step, it never leaves one idle. A top-up never
        preempts."""
        for request, records, index in step.capped:
            if step.budget <= 0:
                break
            if request.status != RequestStatus.RUNNING or request.request_id in step.unscheduled:
                continue  # preempted after its chunk was scheduled
            n = self._num_new_tokens(request, step.budget)
            new_block_ids = self.kv.allocate_slots(request, n) if n > 0 else None
            if new_block_ids is None:
                continue
            if index < 0:  # it had no chunk in this step yet
                step.num_scheduled[request.request_id] = n
                records.append(
                    CachedRequestData(
                        request.request_id, new_block_ids, request.num_computed_tokens
                    )
                )
                _advance(request, n)
                step.budget -= n
                continue
            record = records[index]
            if isinstance(record, CachedRequestData):
                new_block_ids = record.new_block_ids + new_block_ids
                records[index] = replace(record, new_block_ids=new_block_ids)
            else:
                records[index] = replace(record, block_ids=record.block_ids + new_block_ids)
            step.num_scheduled[request.request_id] += n
            _advance(request, n)
            step.budget -= n

    def _slot_room(self, tenant: str) -> _Room:
        """Whether a request of `tenant` can have a sequence slot: a free one, or one taken
        back from a tenant over its share of the slots (the tenant staying within its own)."""
        if len(self.running) < self.config.max_num_seqs:
            return _Room.FITS
        if self.shares.seq_excess(tenant) + 1 > 0:
            return _Room.OVER_SHARE if self.shares.seq_excess(tenant) >= 0 else _Room.NONE
        return _Room.NONE if self.shares.seq_lender(tenant) is None else _Room.FITS

    def _make_room(self, request: Request, n: int, computed_blocks: list, step: _Step) -> _Room:
        """Whether a waiting request's first `n` tokens fit now, with a sequence slot and the
        blocks the running set needs for its next step left over; a tenant within its share
        takes them back from tenants over theirs (preempting their newest requests)."""
        need = self.kv.num_new_blocks(request, n, computed_blocks)
        max_seqs = self.config.max_num_seqs
        if len(self.running) < max_seqs and self.kv.num_free_blocks >= need + step.headroom:
            return _Room.FITS
        tenant = request.tenant
        shares = self.shares
        if not shares.within_share(tenant, need, 1):
            # Only idle capacity is lent past a share; a tenant already over its share waits,
            # one within it holds the queue's head until the room is there.
            over = shares.kv_excess(tenant) >= 0 or shares.seq_excess(tenant) >= 0
            return _Room.OVER_SHARE if over else _Room.NONE
        short = need + step.headroom - self.kv.num_free_blocks
        if short > shares.reclaimable_blocks(tenant):
            return _Room.NONE
        # NOTE: `_slot_room` found a slot free or one to take back.
        while len(self.running) >= max_seqs:
            victim_tenant = shares.seq_lender(tenant)
            assert victim_tenant is not None
            self._preempt(self._newest_running(victim_tenant), step)
        while self.kv.num_free_blocks < need + step.headroom:
            victim_tenant = shares.kv_lender(tenant)
            if victim_tenant is None:
                return _Room.NONE
            self._preempt(self._newest_running(victim_tenant), step)
        return _Room.FITS

    def _newest_running(self, tenant: str) -> Request:
        return max((r for r in self.running if r.tenant == tenant), key=_arrival_order)

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
        num_tokens = len(request.all_token_ids)
        if pending and (
            not request.async_ok
            or num_tokens - request.num_prompt_tokens + pending >= request.max_tokens
            or num_tokens + pending >= self.max_model_len
        ):
            # Its pending token must be known first, or will end it (length) anyway.
            return 0
        computed = request.num_computed_tokens + extra_computed
        n = min(num_tokens + pending, self.max_model_len) - computed
        if n > budget:
            return budget if self.config.enable_chunked_prefill else 0
        return n if n > 0 else 0

    def _adapter_ready(self, request: Request) -> bool:
        if request.adapter_key is None or self.adapters is None:
            return True
        return self.adapters.can_schedule(request.adapter_key)

    def _preempt(self, request: Request, step: _Step | None = None) -> None:
        """Send a running request back to the head of its tenant's queue, to be recomputed;
        undo what `step` had scheduled for it."""
        self.running.remove(request)
        self.shares.stopped(request.tenant)
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
        if step is not None:
            step.preempted.add(request.request_id)
            n = step.num_scheduled.pop(request.request_id, None)
            if n is not None:
                step.budget += n
                step.spec_tokens.pop(request.request_id, None)
                step.unscheduled.add(request.request_id)

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
                self.shares.stopped(request.tenant)
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


class _Room(enum.Enum):
    FITS = 0
    NONE = 1  # no room now: the request waits, at the head of the queue
    OVER_SHARE = 2  # no idle room, and its tenant is over its share: it waits, others may not


class _Step:
    """What one `schedule()` call has handed out so far."""

    def __init__(self, budget: int) -> None:
        self.budget = budget  # tokens left in the step
        self.num_scheduled: dict[str, int] = {}
        self.new_reqs: list[NewRequestData] = []
        self.cached_reqs: list[CachedRequestData] = []
        self.spec_tokens: dict[str, list[int]] = {}
        # Blocks the scheduled requests need to take one more token each in the next step.
        self.headroom = 0
        # Prompt chunks the cap cut short: (request, the list holding its record, its index;
        # -1 for a running request the cap left without a chunk).
        self.capped: list[tuple[Request, list, int]] = []
        self.preempted: set[str] = set()  # NOTE: not admitted again in this step
        self.unscheduled: set[str] = set()  # scheduled, then preempted in this step

    @property
    def total(self) -> int:
        return sum(self.num_scheduled.values())


def _arrival_order(request: Request) -> tuple[float, str]:
    return (request.arrival_time, request.request_id)


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
