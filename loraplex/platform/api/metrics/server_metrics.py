"""Prometheus metrics in the text exposition format, written by hand (no client library).

Names follow vLLM's, under the `loraplex:` prefix. Gauges and token counters come from the
engine's latest snapshot; latency histograms are fed by the engine thread through a timing
observer, so every series describes the engine, whichever client sent the requests.
"""

from __future__ import annotations

import bisect
import threading
from collections import Counter
from collections.abc import Callable, Sequence

from loraplex.platform.core.stats import EngineSnapshot
from loraplex.platform.core.timing import RequestTiming

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
                1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)  # fmt: skip
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
               1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)  # fmt: skip
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
               60.0, 120.0, 240.0, 480.0, 960.0, 1920.0)  # fmt: skip


# The exposition format's escapes in a label value: backslash, double quote, line feed.
_LABEL_ESCAPES = str.maketrans({"\\": "\\\\", '"': '\\"', "\n": "\\n"})


def token_buckets(max_model_len: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, ... up to `max_model_len` (vLLM's buckets of token counts)."""
    buckets, scale = [], 1
    while True:
        for step in (1, 2, 5):
            if step * scale > max_model_len:
                return tuple(buckets)
            buckets.append(step * scale)
        scale *= 10


def _labels(labels: dict[str, str]) -> str:
    """`{k="v",...}`, every value escaped as the exposition format requires, so no name (a
    tenant's, an adapter's, one stored by an older version) can break the page. The one place
    /metrics writes labels."""
    if not labels:
        return ""
    escaped = (f'{k}="{v.translate(_LABEL_ESCAPES)}"' for k, v in labels.items())
    return "{" + ",".join(escaped) + "}"


def _number(value: float) -> str:
    if value == float("inf"):
        return "+Inf"
    return repr(value) if isinstance(value, float) else str(int(value))


class Histogram:
    """A cumulative-bucket histogram, safe to observe and render from different threads."""

    def __init__(self, name: str, help: str, buckets: Sequence[float]) -> None:
        self.name = name
        self.help = help
        self.buckets = tuple(sorted(buckets))
        self._counts = [0] * (len(self.buckets) + 1)  # last one: above every bucket
        self._sum = 0.0
        self._lock = threading.Lock()

    def observe(self, value: float) -> None:
        with self._lock:
            self._counts[bisect.bisect_left(self.buckets, value)] += 1
            self._sum += value

    def observe_all(self, values: Sequence[float]) -> None:
        """`observe` each of `values` (a request's inter-token gaps: hundreds at once)."""
        buckets, find = self.buckets, bisect.bisect_left
        with self._lock:
            counts, total = self._counts, self._sum
            for value in values:
                counts[find(buckets, value)] += 1
                total += value
            self._sum = total

    @property
    def count(self) -> int:
        with self._lock:
            return sum(self._counts)

    def bucket_counts(self) -> tuple[int, ...]:
        """Observations per bucket (not cumulative); the last entry counts those above every
        bound."""
        with self._lock:
            return tuple(self._counts)

    def render(
        self, labels: dict[str, str], name: str | None = None, help: str | None = None
    ) -> list[str]:
        """The histogram's lines, under its own name or `name` (the same observations under
        another series name, e.g. vLLM's)."""
        name, help = name or self.name, help or self.help
        with self._lock:
            counts, total = list(self._counts), self._sum
        lines = [f"# HELP {name} {help}", f"# TYPE {name} histogram"]
        running = 0
        for bound, count in zip((*self.buckets, float("inf")), counts):
            running += count
            bucket_labels = _labels({**labels, "le": _number(float(bound))})
            lines.append(f"{name}_bucket{bucket_labels} {running}")
        lines.append(f"{name}_sum{_labels(labels)} {_number(total)}")
        lines.append(f"{name}_count{_labels(labels)} {running}")
        return lines


# (type, name, help, value) of each series read from the engine's snapshot.
_ENGINE_SERIES: tuple[tuple[str, str, str, Callable[[EngineSnapshot], float]], ...] = (
    ("gauge", "loraplex:num_requests_running", "Requests in the running batch.",
     lambda s: s.stats.num_running),
    ("gauge", "loraplex:num_requests_waiting", "Requests waiting to be scheduled.",
     lambda s: s.stats.num_waiting),
    ("gauge", "loraplex:kv_cache_usage_perc", "Fraction of KV-cache blocks in use (1 = full).",
     lambda s: s.stats.kv_usage),
    ("gauge", "loraplex:num_kv_blocks_free", "KV-cache blocks free.",
     lambda s: s.stats.num_free_blocks),
    ("gauge", "loraplex:num_kv_blocks_total", "KV-cache blocks in all.",
     lambda s: s.stats.num_total_blocks),
    ("counter", "loraplex:prefix_cache_queries_total", "Prompt tokens looked up in the prefix cache.",
     lambda s: s.stats.prefix_cache_queries),
    ("counter", "loraplex:prefix_cache_hits_total", "Prompt tokens found in the prefix cache.",
     lambda s: s.stats.prefix_cache_hits),
    ("gauge", "loraplex:prefix_cache_hit_rate", "Prefix-cache hits over queries since start.",
     lambda s: s.stats.prefix_cache_hit_rate),
    ("counter", "loraplex:num_preemptions_total", "Requests preempted to free KV blocks.",
     lambda s: s.stats.num_preemptions),
    ("counter", "loraplex:prompt_tokens_total", "Prompt tokens admitted.",
     lambda s: s.prompt_tokens_total),
    ("counter", "loraplex:generation_tokens_total", "Tokens generated.",
     lambda s: s.generation_tokens_total),
    ("counter", "loraplex:requests_watchdog_aborted_total", "Requests the watchdog ended for "
     "making no progress for request_stall_timeout_s.", lambda s: s.watchdog_aborted_total),
    ("counter", "loraplex:engine_steps_total", "Engine steps run.", lambda s: s.num_steps),
    ("counter", "loraplex:engine_step_seconds_total", "Wall time spent in engine steps.",
     lambda s: s.step_seconds_total),
)  # fmt: skip


class ServerMetrics:
    """Latency histograms and finished-request counts; `render` adds the engine's gauges."""

    def __init__(self, model_name: str, max_model_len: int = 8192) -> None:
        self.labels = {"model_name": model_name}
        self.ttft = Histogram(
            "loraplex:time_to_first_token_seconds",
            "Time from a request's arrival to its first output token.",
            TTFT_BUCKETS,
        )
        self.itl = Histogram(
            "loraplex:inter_token_latency_seconds",
            "Time between successive output tokens of a request.",
            ITL_BUCKETS,
        )
        self.e2e = Histogram(
            "loraplex:e2e_request_latency_seconds",
            "Time from a request's arrival to its end.",
            E2E_BUCKETS,
        )
        # Where a finished request's time went (vLLM's request phases), and its sizes.
        self.queue = Histogram(
            "loraplex:request_queue_time_seconds",
            "Time a request waited before it was first scheduled.",
            E2E_BUCKETS,
        )
        self.prefill = Histogram(
            "loraplex:request_prefill_time_seconds",
            "Time from a request's first scheduling to its first output token.",
            E2E_BUCKETS,
        )
        self.decode = Histogram(
            "loraplex:request_decode_time_seconds",
            "Time from a request's first output token to its end.",
            E2E_BUCKETS,
        )
        self.inference = Histogram(
            "loraplex:request_inference_time_seconds",
            "Time from a request's first scheduling to its end (prefill plus decode).",
            E2E_BUCKETS,
        )
        buckets = token_buckets(max_model_len)
        self.prompt_tokens = Histogram(
            "loraplex:request_prompt_tokens", "Prompt tokens of a finished request.", buckets
        )
        self.generation_tokens = Histogram(
            "loraplex:request_generation_tokens", "Tokens a finished request generated.", buckets
        )
        self._finished: Counter[str] = Counter()
        self._lock = threading.Lock()

    def observe(self, timing: RequestTiming) -> None:
        """A TimingObserver: called on the engine thread when a request finishes."""
        if timing.ttft_s is not None:
            self.ttft.observe(timing.ttft_s)
        self.itl.observe_all(timing.inter_token_s)
        self.e2e.observe(timing.e2e_s)
        for histogram, value in ((self.queue, timing.queue_s), (self.prefill, timing.prefill_s),
                                 (self.decode, timing.decode_s),
                                 (self.inference, timing.inference_s)):  # fmt: skip
            if value is not None:
                histogram.observe(value)
        self.prompt_tokens.observe(timing.num_prompt_tokens)
        self.generation_tokens.observe(timing.num_generation_tokens)
        with self._lock:
            self._finished[timing.finish_reason or "mixed"] += 1

    def render(self, snapshot: EngineSnapshot) -> str:
        lines: list[str] = []
        for kind, name, help, value in _ENGINE_SERIES:
            lines += [f"# HELP {name} {help}", f"# TYPE {name} {kind}"]
            lines.append(f"{name}{_labels(self.labels)} {_number(value(snapshot))}")
        lines += self._render_spec_decoding(snapshot)
        lines += self.render_finished()
        for histogram in self.histograms:
            lines += histogram.render(self.labels)
        return "\n".join(lines) + "\n"

    @property
    def histograms(self) -> tuple[Histogram, ...]:
        return (self.ttft, self.itl, self.e2e, self.queue, self.prefill, self.decode,
                self.inference, self.prompt_tokens, self.generation_tokens)  # fmt: skip

    def finished(self) -> dict[str, int]:
        """Finished requests by finish reason ("mixed": samples that ended differently)."""
        with self._lock:
            return dict(self._finished)

    def _render_spec_decoding(self, snapshot: EngineSnapshot) -> list[str]:
        """vLLM's `spec_decode_*` counters, when speculative decoding is on."""
        spec = snapshot.stats.spec_decoding
        if spec is None:
            return []
        lines: list[str] = []
        for name, help, value in (
            ("num_drafts", "Verifications of a request's draft tokens.", spec.num_drafts),
            ("num_draft_tokens", "Draft tokens proposed and verified.", spec.num_draft_tokens),
            ("num_accepted_tokens", "Draft tokens accepted.", spec.num_accepted_tokens),
        ):
            full = f"loraplex:spec_decode_{name}_total"
            lines += [f"# HELP {full} {help}", f"# TYPE {full} counter"]
            lines.append(f"{full}{_labels(self.labels)} {value}")
        full = "loraplex:spec_decode_num_accepted_tokens_per_pos_total"
        lines += [
            f"# HELP {full} Draft tokens accepted at each draft position (0: the first).",
            f"# TYPE {full} counter",
        ]
        for pos, count in enumerate(spec.num_accepted_tokens_per_pos):
            lines.append(f"{full}{_labels({**self.labels, 'position': str(pos)})} {count}")
        return lines

    def render_finished(self, name: str = "loraplex:request_success_total") -> list[str]:
        lines = [f"# HELP {name} Finished requests by finish reason.", f"# TYPE {name} counter"]
        for reason, count in sorted(self.finished().items()):
            lines.append(f"{name}{_labels({**self.labels, 'finished_reason': reason})} {count}")
        return lines
