"""Server metrics in the Prometheus text format.

A server under load is a black box unless it says what it is doing. Prometheus-style
monitoring asks every server for one plain-text page (`GET /metrics`) every few seconds
and stores the numbers; rates and percentiles are computed from the differences between
scrapes. The page is a list of *families*, each announced by `# HELP` and `# TYPE` lines:

    # HELP nanoqwen_time_to_first_token_seconds Time from request arrival to its first token.
    # TYPE nanoqwen_time_to_first_token_seconds histogram
    nanoqwen_time_to_first_token_seconds_bucket{le="0.05"} 12
    ...
    nanoqwen_time_to_first_token_seconds_sum 0.61
    nanoqwen_time_to_first_token_seconds_count 14

Three kinds are enough here:

* a **counter** only goes up (requests answered, tokens generated);
* a **gauge** is a value right now (requests running, KV pages in use);
* a **histogram** is a distribution kept as counts in fixed buckets. Bucket `le="x"` counts
  every observation `<= x`, so the buckets are cumulative and the last one, `+Inf`, equals
  the count. Quantiles are then estimated by whoever reads the page, and the server keeps
  O(buckets) memory however many requests it serves.

Latencies are measured where the client sees them, in the server's handler threads, so
`Counter` and `Histogram` are thread-safe. Everything the engine already counts (pages,
queue lengths, token totals, prefix-cache hits) is *not* copied here: `ServerMetrics.render`
reads a fresh `engine.stats()` at scrape time, so the page can never drift from the
engine's own accounting.
"""

from __future__ import annotations

import math
import threading
from bisect import bisect_left
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

Labels = tuple[tuple[str, str], ...]

# Seconds. TTFT spans a fast prefill to a long wait in the queue; inter-token latency is a
# single decode step, milliseconds on a GPU and tens of milliseconds on a CPU.
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
INTER_TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
REQUEST_DURATION_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


@dataclass
class Family:
    """One metric as it appears on the page: its announcement and its samples."""

    name: str
    kind: str  # "counter" | "gauge" | "histogram"
    help: str
    samples: list[tuple[str, Labels, float]] = field(default_factory=list)  # (name, labels, value)

    def add(self, value: float, suffix: str = "", **labels: str) -> Family:
        self.samples.append((self.name + suffix, tuple(labels.items()), value))
        return self


class Counter:
    """A monotonically increasing count, one value per combination of label values."""

    def __init__(self, name: str, help: str) -> None:
        self.name, self.help = name, help
        self._values: dict[Labels, float] = {}
        self._lock = threading.Lock()

    def inc(self, amount: float = 1.0, **labels: str) -> None:
        key = tuple(sorted(labels.items()))
        with self._lock:
            self._values[key] = self._values.get(key, 0.0) + amount

    def collect(self) -> Family:
        with self._lock:
            samples = [(self.name, labels, value) for labels, value in sorted(self._values.items())]
        return Family(self.name, "counter", self.help, samples)


class Histogram:
    """Counts of observations per bucket, plus their sum and number."""

    def __init__(self, name: str, help: str, buckets: Sequence[float]) -> None:
        if list(buckets) != sorted(buckets):
            raise ValueError(f"histogram buckets must be increasing, got {buckets}")
        self.name, self.help = name, help
        self.buckets = tuple(buckets)
        # One slot per finite bucket plus one for values above them all (the +Inf bucket).
        self._counts = [0] * (len(self.buckets) + 1)
        self._sum = 0.0
        self._lock = threading.Lock()

    def observe(self, value: float) -> None:
        slot = bisect_left(self.buckets, value)  # the first bucket with value <= upper bound
        with self._lock:
            self._counts[slot] += 1
            self._sum += value

    def collect(self) -> Family:
        with self._lock:
            counts, total = list(self._counts), self._sum
        family = Family(self.name, "histogram", self.help)
        cumulative = 0
        for upper_bound, count in zip((*self.buckets, math.inf), counts):
            cumulative += count
            family.add(cumulative, "_bucket", le=_format_value(upper_bound))
        return family.add(total, "_sum").add(cumulative, "_count")


def render(families: Iterable[Family]) -> str:
    """The Prometheus text exposition format (version 0.0.4)."""
    lines = []
    for family in families:
        lines.append(f"# HELP {family.name} {family.help}")
        lines.append(f"# TYPE {family.name} {family.kind}")
        for name, labels, value in family.samples:
            lines.append(f"{name}{_format_labels(labels)} {_format_value(value)}")
    return "\n".join(lines) + "\n"


def _format_labels(labels: Labels) -> str:
    if not labels:
        return ""
    pairs = ",".join(f'{key}="{_escape(value)}"' for key, value in labels)
    return "{" + pairs + "}"


def _escape(label_value: str) -> str:
    return label_value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _format_value(value: float) -> str:
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return str(int(value)) if float(value).is_integer() else repr(float(value))


class ServerMetrics:
    """What the HTTP server measures itself, and the page that joins it with engine stats."""

    def __init__(self) -> None:
        self.requests = Counter(
            "nanoqwen_http_requests_total", "HTTP requests answered, by status code."
        )
        self.time_to_first_token = Histogram(
            "nanoqwen_time_to_first_token_seconds",
            "Time from request arrival to its first generated token.",
            TTFT_BUCKETS,
        )
        self.inter_token_latency = Histogram(
            "nanoqwen_inter_token_latency_seconds",
            "Time between consecutive generated tokens of one sequence.",
            INTER_TOKEN_BUCKETS,
        )
        self.request_duration = Histogram(
            "nanoqwen_request_duration_seconds",
            "Time from request arrival to its last generated token.",
            REQUEST_DURATION_BUCKETS,
        )

    def render(self, engine_stats: Mapping[str, Any]) -> str:
        server_families = [
            self.requests.collect(),
            self.time_to_first_token.collect(),
            self.inter_token_latency.collect(),
            self.request_duration.collect(),
        ]
        return render(server_families + engine_families(engine_stats))


def engine_families(stats: Mapping[str, Any]) -> list[Family]:
    """`LLMEngine.stats()` as metric families."""
    finished = Family(
        "nanoqwen_requests_finished_total", "counter",
        "Engine requests finished, by reason (stop, length, abort).",
    )
    for reason, count in sorted(stats["finished"].items()):
        finished.add(count, reason=reason)
    pages = Family(
        "nanoqwen_kv_pages", "gauge",
        "KV-cache pages by state: used (held by requests), cached (only the prefix cache "
        "holds them; evictable), free.",
    )
    for state in ("used", "cached", "free"):
        pages.add(stats[f"pages_{state}"], state=state)

    def single(name: str, kind: str, help: str, key: str) -> Family:
        return Family(name, kind, help).add(stats[key])

    return [
        finished,
        single("nanoqwen_requests_running", "gauge", "Requests in the running batch.", "running"),
        single("nanoqwen_requests_waiting", "gauge", "Requests queued for admission.", "waiting"),
        single("nanoqwen_prompt_tokens_total", "counter", "Prompt tokens received.",
               "prompt_tokens"),
        single("nanoqwen_generation_tokens_total", "counter", "Tokens generated.",
               "generated_tokens"),
        pages,
        single("nanoqwen_prefix_cache_query_tokens_total", "counter",
               "Prompt tokens looked up in the prefix cache.", "prefix_query_tokens"),
        single("nanoqwen_prefix_cache_hit_tokens_total", "counter",
               "Prompt tokens whose KV was reused from the prefix cache.", "prefix_hit_tokens"),
        single("nanoqwen_preemptions_total", "counter",
               "Running requests preempted (pages released, recomputed later).", "preemptions"),
    ]
