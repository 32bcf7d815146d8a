"""`Replica`: one simulated engine — continuous batching over GPU adapter slots (see
`benchmarks.cluster_sim`)."""

from __future__ import annotations

import heapq
from collections import Counter, OrderedDict, deque

from benchmarks.cluster.costs import CostModel
from benchmarks.cluster.workload import Request, SimConfig


class Replica:
    """One engine: continuous batching over GPU adapter slots, stepped by the event loop."""

    def __init__(self, index: int, cfg: SimConfig, costs: CostModel) -> None:
        self.index, self.cfg, self.costs = index, cfg, costs
        self.waiting: deque[Request] = deque()
        self.finishing: list[tuple[int, int, Request]] = []  # (finish step, tie, request)
        self.num_running = 0
        self.adapters = Counter()  # running requests per adapter
        self.queued = Counter()  # waiting requests per adapter
        self.slots: OrderedDict[int, None] = OrderedDict()  # resident adapters, LRU first
        self.loading: int | None = None
        self.load_queue: deque[int] = deque()
        self.steps = 0
        self.busy = False
        self.loads = 0
        self.kv_prompt = 0
        self.kv_admit_steps = 0
        self.window_tokens = 0  # tokens generated in steps ending in [warmup_s, duration_s)

    def kv_usage(self) -> float:
        generated = self.num_running * self.steps - self.kv_admit_steps
        return min(1.0, (self.kv_prompt + generated) / self.cfg.kv_tokens)

    def waiting_adapters(self) -> set[int]:
        return {a for a, n in self.queued.items() if n and a >= 0} - set(self.adapters)

    def enqueue(self, request: Request) -> None:
        self.waiting.append(request)
        self.queued[request.adapter] += 1

    def start_step(self, now: float) -> float | None:
        """Admit what can run, start loads; the step's end time, or None if idle."""
        admitted, prefill, kept = [], 0, []
        while self.waiting and self.num_running + len(admitted) < self.cfg.max_num_seqs:
            request = self.waiting.popleft()
            if request.adapter < 0 or request.adapter in self.slots:
                admitted.append(request)
                self.queued[request.adapter] -= 1
                prefill += request.prompt
                if request.adapter >= 0:
                    self.slots.move_to_end(request.adapter)
                    self.adapters[request.adapter] += 1
            else:
                if request.adapter != self.loading and request.adapter not in self.load_queue:
                    self.load_queue.append(request.adapter)
                kept.append(request)
                if len(kept) >= 256:  # look no further this step
                    break
        self.waiting.extendleft(reversed(kept))  # back in arrival order, O(len(kept))
        for request in admitted:
            request.admit_step = self.steps
            self.num_running += 1
            self.kv_prompt += request.prompt
            self.kv_admit_steps += self.steps
            heapq.heappush(self.finishing, (self.steps + request.output, id(request), request))
        if not self.num_running:
            self.busy = False
            return None
        self.busy = True
        self._new = admitted
        distinct = sum(1 for c in self.adapters.values() if c)
        return now + self.costs.step(self.num_running, distinct, prefill)

    def end_step(self, now: float, done: list[Request]) -> None:
        self.steps += 1
        if self.cfg.warmup_s <= now < self.cfg.duration_s:
            self.window_tokens += self.num_running
        for request in self._new:
            request.first_token = now
        while self.finishing and self.finishing[0][0] <= self.steps:
            _, _, request = heapq.heappop(self.finishing)
            self.num_running -= 1
            self.kv_prompt -= request.prompt
            self.kv_admit_steps -= request.admit_step
            if request.adapter >= 0:
                self.adapters[request.adapter] -= 1
                if not self.adapters[request.adapter]:
                    del self.adapters[request.adapter]
            done.append(request)

    def next_load(self) -> int | None:
        """The adapter to load next, its slot made free (an LRU slot nothing runs on)."""
        if self.loading is not None or not self.load_queue:
            return None
        if len(self.slots) >= self.cfg.max_loras:
            victim = next((a for a in self.slots if a not in self.adapters), None)
            if victim is None:
                return None
            del self.slots[victim]
        self.loading = self.load_queue.popleft()
        self.loads += 1
        return self.loading
