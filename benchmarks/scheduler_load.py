"""The scheduler under load, in engine steps and without a model.

A `FakeEngine` drives the real `Scheduler` in lock step with made-up outputs: each request
that reaches the end of its tokens in a step samples one token, a function of its last token
and its length, so a preempted request recomputes to the very same tokens. Time is counted
in steps, so the figures say what the scheduling rule does, not how fast this machine is.

Four scenarios:
- **steady**: 512 requests arriving as a Poisson process at 50 % and 90 % of the workload's
  capacity (`capacity`), three seeds pooled: decode-heavy (256 prompt, 256 output tokens,
  the sequence slots run out), prefill-heavy (prompts of 64-1536 tokens: the step's token
  budget runs out) and mixed (one prompt in ten of 2k-4k tokens); TTFT p50 / p99 in steps,
  the worst gap between a stream's tokens, and the steps that left budget idle;
- **burst**: 512 requests at once;
- **attack**: one tenant's stream alone, then beside another tenant's two batches of
  `n`-sample requests in a KV pool far too small for them, the stream starting first or
  joining while the batches run (its first token and worst gap in steps);
- **schedule_us**: `Scheduler.schedule()` wall time per step with 256 decoding sequences.

    python -m benchmarks.scheduler_load            # prints the figures, then them as JSON
    python -m benchmarks.scheduler_load --record [--baseline old.json --baseline-commit C]
    # writes results/cpu_scheduler_load.json, with the JSON line of a run at commit C
"""

from __future__ import annotations

import argparse
import json
import math
import random
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

from loraplex.config import CacheConfig, SchedulerConfig
from loraplex.platform.core.request import Request
from loraplex.platform.core.sampling_params import SamplingParams
from loraplex.platform.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from loraplex.platform.scheduler.scheduler import Scheduler

EOS = 0
VOCAB = 50_000


def fake_token(request: Request) -> int:
    """The next token of a fake greedy model: a function of the request's tokens only."""
    return (request.all_token_ids[-1] * 7919 + request.num_tokens) % (VOCAB - 1) + 1


def distinct_prompt(key: int, length: int) -> list[int]:
    """A prompt no other key's shares a block with."""
    rng = random.Random(key)
    return [rng.randrange(1, VOCAB) for _ in range(length)]


@dataclass(frozen=True)
class Arrival:
    step: int
    request_id: str
    prompt: list[int]
    max_tokens: int
    tenant: str = "t"


@dataclass
class Trace:
    """What each request saw, in steps: when it arrived, which steps emitted its tokens."""

    arrival: dict[str, int] = field(default_factory=dict)
    token_steps: dict[str, list[int]] = field(default_factory=dict)
    tokens: dict[str, list[int]] = field(default_factory=dict)
    finish_reason: dict[str, str] = field(default_factory=dict)
    schedule_s: list[float] = field(default_factory=list)  # wall seconds of each schedule()
    schedule_cpu_s: list[float] = field(default_factory=list)  # its process-CPU seconds
    num_running: list[int] = field(default_factory=list)
    num_preemptions: int = 0
    num_steps: int = 0
    # Steps that left token budget unused while a prompt waited (with a free slot) or was
    # still being prefilled.
    idle_budget_steps: int = 0

    def ttft(self, request_id: str) -> int:
        """Steps from arrival to the first token: 1 when the arrival step samples it."""
        return self.token_steps[request_id][0] - self.arrival[request_id] + 1

    def worst_gap(self, request_id: str) -> int:
        """The most steps between two of its tokens: 1 when it got a token every step."""
        steps = self.token_steps[request_id]
        return max((b - a for a, b in zip(steps, steps[1:])), default=0)


class FakeEngine:
    """Drives a `Scheduler` in lock step, the model replaced by `fake_token`."""

    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler
        self.trace = Trace()
        self.step_index = 0

    def add(self, arrival: Arrival) -> None:
        params = SamplingParams(temperature=0.0, max_tokens=arrival.max_tokens, ignore_eos=True)
        request = Request(
            arrival.request_id,
            list(arrival.prompt),
            params,
            (EOS,),
            max_tokens=arrival.max_tokens,
            tenant=arrival.tenant,
        )
        self.scheduler.add_request(request)
        self.trace.arrival[arrival.request_id] = self.step_index
        self.trace.token_steps[arrival.request_id] = []
        self.trace.tokens[arrival.request_id] = []

    def step(self) -> SchedulerOutput:
        sched = self.scheduler
        start, start_cpu = time.perf_counter(), time.process_time()
        so = sched.schedule()
        self.trace.schedule_cpu_s.append(time.process_time() - start_cpu)
        self.trace.schedule_s.append(time.perf_counter() - start)
        self.trace.num_running.append(sched.num_running)
        if so.total_num_scheduled_tokens < sched.config.max_num_batched_tokens and (
            (sched.num_waiting and sched.num_running < sched.config.max_num_seqs)
            or any(r.num_computed_tokens < r.num_tokens for r in sched.running)
        ):
            self.trace.idle_budget_steps += 1
        sampled = {}
        for req_id in so.num_scheduled_tokens:
            request = sched.requests[req_id]
            if request.num_pending:
                sampled[req_id] = fake_token(request)
        for out in sched.update_from_output(so, ModelRunnerOutput(sampled=sampled)):
            self.trace.token_steps[out.req_id].extend([self.step_index] * len(out.new_token_ids))
            self.trace.tokens[out.req_id].extend(out.new_token_ids)
            if out.finish_reason is not None:
                self.trace.finish_reason[out.req_id] = out.finish_reason
        self.trace.num_preemptions = sched.num_preemptions
        self.step_index += 1
        self.trace.num_steps = self.step_index
        return so

    def run(self, arrivals: list[Arrival], max_steps: int = 100_000) -> Trace:
        """Add each arrival before its step and step until every request finished."""
        pending = sorted(arrivals, key=lambda a: a.step)
        i = 0
        while i < len(pending) or self.scheduler.has_unfinished_requests():
            while i < len(pending) and pending[i].step <= self.step_index:
                self.add(pending[i])
                i += 1
            self.step()
            if self.step_index >= max_steps:
                raise RuntimeError(f"not finished after {max_steps} steps")
        return self.trace


def make_scheduler(
    *,
    max_num_seqs: int = 256,
    max_num_batched_tokens: int = 2048,
    num_blocks: int = 65_536,
    block_size: int = 16,
    max_model_len: int = 8192,
    **config: object,
) -> Scheduler:
    return Scheduler(
        SchedulerConfig(
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            **config,  # type: ignore[arg-type]
        ),
        CacheConfig(block_size=block_size),
        num_blocks,
        max_model_len,
    )


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (nearest rank), q in [0, 100]."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


# -- steady arrivals and bursts ------------------------------------------------------------


@dataclass(frozen=True)
class Workload:
    """Requests of `max_tokens` output tokens, their prompt lengths drawn uniformly from
    `prompt_lens` (low, high), or from `long_prompt_lens` with probability `long_fraction`."""

    prompt_lens: tuple[int, int]
    max_tokens: int
    long_fraction: float = 0.0
    long_prompt_lens: tuple[int, int] = (0, 0)
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048

    def scheduler(self) -> Scheduler:
        return make_scheduler(
            max_num_seqs=self.max_num_seqs, max_num_batched_tokens=self.max_num_batched_tokens
        )

    def prompt_len(self, index: int) -> int:
        rng = random.Random(index)
        low, high = self.prompt_lens
        if rng.random() < self.long_fraction:
            low, high = self.long_prompt_lens
        return rng.randint(low, high)

    def arrival(self, step: int, index: int) -> Arrival:
        prompt = distinct_prompt(index, self.prompt_len(index))
        return Arrival(step, f"r{index}", prompt, self.max_tokens)


# Every sequence slot busy near capacity: the slots are what runs out (256 streams decode).
DECODE_HEAVY = Workload(prompt_lens=(256, 256), max_tokens=256)
# The step's token budget is what runs out, with ~300 streams decoding beside the prefills.
PREFILL_HEAVY = Workload(prompt_lens=(64, 1536), max_tokens=128, max_num_seqs=512)
# Mostly short prompts, one in ten of 2k-4k tokens.
MIXED = Workload(
    prompt_lens=(64, 256),
    max_tokens=128,
    long_fraction=0.1,
    long_prompt_lens=(2048, 4096),
    max_num_seqs=512,
)


def capacity(workload: Workload, sample: int = 4096) -> float:
    """Requests per step the workload's mix can get through: the step's token budget over the
    tokens a request needs (its prompt, and its output tokens but the one its prompt's step
    samples), or the sequence slots over the steps a request holds one (its prompt in chunks
    of a quarter of the budget, then one step per further output token), whichever is less.

    NOTE: computed from the mix, not measured on a saturated queue: a full queue favours
    short prompts (see `max_long_partial_prefills`), so its completion rate overstates what
    the mix itself can sustain."""
    lengths = [workload.prompt_len(i) for i in range(sample)]
    budget, cap = workload.max_num_batched_tokens, max(1, workload.max_num_batched_tokens // 4)
    tokens = sum(lengths) / sample + workload.max_tokens - 1
    steps = sum(-(-length // cap) for length in lengths) / sample + workload.max_tokens - 1
    return min(budget / tokens, workload.max_num_seqs / steps)


def poisson_arrivals(workload: Workload, rate: float, num: int, seed: int = 0) -> list[Arrival]:
    """`num` requests arriving as a Poisson process of `rate` requests per step."""
    rng = random.Random(seed)
    t, out = 0.0, []
    for index in range(num):
        t += rng.expovariate(rate)
        out.append(workload.arrival(int(t), index))
    return out


@dataclass(frozen=True)
class TTFTFigures:
    """Time to first token in steps (1: the step after arrival samples it), over every request
    and over those with short prompts (no longer than the chunk cap, a quarter of the budget)."""

    ttft_p50: float
    ttft_p90: float
    ttft_p99: float
    ttft_mean: float
    short_ttft_p50: float
    short_ttft_p99: float
    worst_gap: int  # the most steps between two tokens of any stream
    idle_budget_steps: int
    steps: int

    @property
    def p99_over_p50(self) -> float:
        return self.ttft_p99 / self.ttft_p50


def ttft_figures(workload: Workload, traces: list[Trace]) -> TTFTFigures:
    cap = workload.max_num_batched_tokens // 4
    ttfts: list[float] = []
    short: list[float] = []
    for trace in traces:
        for req_id in trace.arrival:
            ttfts.append(trace.ttft(req_id))
            if workload.prompt_len(int(req_id[1:])) <= cap:
                short.append(ttfts[-1])
    return TTFTFigures(
        ttft_p50=percentile(ttfts, 50),
        ttft_p90=percentile(ttfts, 90),
        ttft_p99=percentile(ttfts, 99),
        ttft_mean=round(sum(ttfts) / len(ttfts), 2),
        short_ttft_p50=percentile(short, 50) if short else 0,
        short_ttft_p99=percentile(short, 99) if short else 0,
        worst_gap=max(t.worst_gap(r) for t in traces for r in t.arrival),
        idle_budget_steps=sum(t.idle_budget_steps for t in traces),
        steps=sum(t.num_steps for t in traces),
    )


def steady(
    workload: Workload, load: float, num: int = 512, seeds: tuple[int, ...] = (0, 1, 2)
) -> TTFTFigures:
    """`num` requests arriving as a Poisson process at `load` x `capacity` from an idle
    scheduler (as `benchmarks.serving` measures), the TTFTs of one run per seed pooled."""
    rate = load * capacity(workload)
    traces = [
        FakeEngine(workload.scheduler()).run(poisson_arrivals(workload, rate, num, seed))
        for seed in seeds
    ]
    return ttft_figures(workload, traces)


def burst(workload: Workload, num: int = 512) -> TTFTFigures:
    trace = FakeEngine(workload.scheduler()).run([workload.arrival(0, i) for i in range(num)])
    return ttft_figures(workload, [trace])


# -- one tenant's batches beside another's stream -------------------------------------------


@dataclass(frozen=True)
class Attack:
    """Bob streams; alice sends `num_batches` requests of `prompts` prompts x `n` samples."""

    stream_prompt_len: int = 24
    stream_tokens: int = 200
    prompts: int = 64
    n: int = 16
    prompt_len: int = 24
    max_tokens: int = 100
    num_batches: int = 2
    stream_step: int = 0
    batch_step: int = 5  # alice arrives while bob streams
    num_blocks: int = 512
    max_num_seqs: int = 256

    def stream(self) -> Arrival:
        return Arrival(self.stream_step, "bob", distinct_prompt(-1, self.stream_prompt_len), self.stream_tokens,
                       tenant="bob")  # fmt: skip

    def batches(self) -> list[Arrival]:
        out = []
        for b in range(self.num_batches):
            for p in range(self.prompts):
                prompt = distinct_prompt(1000 * b + p, self.prompt_len)
                out += [
                    Arrival(
                        self.batch_step,
                        f"alice-{b}-{p}-{i}",
                        prompt,
                        self.max_tokens,
                        tenant="alice",
                    )  # fmt: skip
                    for i in range(self.n)
                ]
        return out

    def scheduler(self) -> Scheduler:
        return make_scheduler(num_blocks=self.num_blocks, max_num_seqs=self.max_num_seqs)


@dataclass(frozen=True)
class AttackFigures:
    unloaded_worst_gap: int  # bob's worst gap between tokens, alone
    attacked_worst_gap: int  # and beside alice's batches
    attacked_ttft: int
    num_preemptions: int
    stream_tokens_equal: bool  # bob's tokens under attack equal his tokens alone
    batch_tokens_equal: bool  # alice's tokens beside bob equal hers alone
    batch_all_finished: bool
    steps: int


def attack(setup: Attack = Attack()) -> AttackFigures:
    alone = FakeEngine(setup.scheduler()).run([replace(setup.stream(), step=0)])
    batches = setup.batches()
    batches_alone = FakeEngine(setup.scheduler()).run(batches)
    attacked = FakeEngine(setup.scheduler()).run([setup.stream(), *batches])
    batch_ids = [a.request_id for a in batches]
    return AttackFigures(
        unloaded_worst_gap=alone.worst_gap("bob"),
        attacked_worst_gap=attacked.worst_gap("bob"),
        attacked_ttft=attacked.ttft("bob"),
        num_preemptions=attacked.num_preemptions,
        stream_tokens_equal=attacked.tokens["bob"] == alone.tokens["bob"],
        batch_tokens_equal=all(attacked.tokens[r] == batches_alone.tokens[r] for r in batch_ids),
        batch_all_finished=all(attacked.finish_reason.get(r) == "length" for r in batch_ids),
        steps=attacked.num_steps,
    )


# -- the cost of one schedule() -------------------------------------------------------------


def schedule_us(num_running: int = 256, steps: int = 400) -> tuple[float, float]:
    """`Scheduler.schedule()` per step with `num_running` decoding sequences, in microseconds:
    (median wall time, median process-CPU time: the CPU clock moves less with other load)."""
    engine = FakeEngine(make_scheduler(max_num_seqs=num_running))
    for i in range(num_running):
        engine.add(Arrival(0, f"r{i}", distinct_prompt(i, 100), 100_000))
    while engine.scheduler.num_waiting or any(
        not steps for steps in engine.trace.token_steps.values()
    ):
        engine.step()
    engine.trace.schedule_s.clear()
    engine.trace.schedule_cpu_s.clear()
    for _ in range(steps):
        engine.step()
    return (
        1e6 * percentile(engine.trace.schedule_s, 50),
        1e6 * percentile(engine.trace.schedule_cpu_s, 50),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--record", action="store_true", help="write the JSON record")
    parser.add_argument(
        "--baseline",
        type=Path,
        help="the metrics this script printed (without --record) at another commit: the "
        "record's baseline",
    )
    parser.add_argument("--baseline-commit", default="", help="the commit of --baseline")
    args = parser.parse_args()
    metrics: dict[str, object] = {}
    workloads = (("decode_heavy", DECODE_HEAVY), ("prefill_heavy", PREFILL_HEAVY),
                 ("mixed", MIXED))  # fmt: skip
    for name, workload in workloads:
        metrics[f"{name}_capacity_per_step"] = round(capacity(workload), 4)
        for load in (0.5, 0.9):
            figures = steady(workload, load)
            metrics[f"{name}_poisson{int(load * 100)}"] = figures.__dict__
            print(name, load, figures, f"p99/p50 {figures.p99_over_p50:.2f}")
        figures = burst(workload)
        metrics[f"{name}_burst512"] = figures.__dict__
        print(name, "burst", figures)
    for name, setup in (
        ("attack_stream_first", Attack()),
        ("attack_stream_joins", Attack(stream_step=20, batch_step=0)),
    ):
        figures = attack(setup)
        metrics[name] = figures.__dict__
        print(name, figures)
    wall, cpu = schedule_us()
    metrics["schedule_us_256"] = {"wall": round(wall, 1), "cpu": round(cpu, 1)}
    print("schedule() us per step at 256 running:", metrics["schedule_us_256"])
    if args.record:
        from benchmarks.record import write_result

        baseline: dict[str, object] = {}
        if args.baseline is not None:
            baseline = {"commit": args.baseline_commit, **json.loads(args.baseline.read_text())}
        write_result("cpu_scheduler_load.json", "scheduler_load", metrics, baseline=baseline)
    else:
        print(json.dumps(metrics, default=str))


if __name__ == "__main__":
    main()
