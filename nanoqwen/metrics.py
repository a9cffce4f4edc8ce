"""Server metrics for Prometheus: what the server measures, and what the engine counts.

A server under load is a black box unless it says what it is doing. Prometheus-style
monitoring asks every server for one plain-text page (`GET /metrics`) every few seconds
and stores the numbers; rates and percentiles are computed from the differences between
scrapes. `prometheus_client` writes the page; three kinds of metric are enough here:

* a **counter** only goes up (requests answered, tokens generated);
* a **gauge** is a value right now (requests running, KV pages in use, state slots free);
* a **histogram** is a distribution kept as counts in fixed buckets (`le="x"` counts every
  observation `<= x`), so quantiles are estimated by whoever reads the page, and the server
  keeps O(buckets) memory however many requests it serves.

Latencies are measured where the client sees them, in the server's handler threads, into
`prometheus_client`'s thread-safe counters and histograms. Everything the engine already
counts (pages, state slots, queue lengths, token totals, prefix-cache hits, the bytes of the
process, the weights, the KV cache and the state pool) is *not* copied here:
`EngineStatsCollector` reads a fresh `engine.stats()` at scrape time, so the page can never
drift from the engine's own accounting.

Each `ServerMetrics` has its own registry (not the process-wide default), so several
servers in one process keep separate counts.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Histogram,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

CONTENT_TYPE = CONTENT_TYPE_LATEST
# Seconds. TTFT spans a fast prefill to a long wait in the queue; inter-token latency is a
# single decode step, milliseconds on a GPU and tens of milliseconds on a CPU.
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
INTER_TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
REQUEST_DURATION_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)

EngineStats = Mapping[str, Any]


class ServerMetrics:
    """What the HTTP server measures itself, and the page that joins it with engine stats."""

    def __init__(self, read_engine_stats: Callable[[], EngineStats | None]) -> None:
        """`read_engine_stats` returns `LLMEngine.stats()`, or None when the engine can't
        answer (the page then holds the server's own metrics only)."""
        self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter(
            "nanoqwen_http_requests", "HTTP requests answered, by final status code.",
            ["status"], registry=self.registry,
        )
        self.time_to_first_token = Histogram(
            "nanoqwen_time_to_first_token_seconds",
            "Time from request arrival to its first generated token.",
            buckets=TTFT_BUCKETS, registry=self.registry,
        )
        self.inter_token_latency = Histogram(
            "nanoqwen_inter_token_latency_seconds",
            "Time between consecutive generated tokens of one sequence.",
            buckets=INTER_TOKEN_BUCKETS, registry=self.registry,
        )
        self.request_duration = Histogram(
            "nanoqwen_request_duration_seconds",
            "Time from request arrival to its last generated token.",
            buckets=REQUEST_DURATION_BUCKETS, registry=self.registry,
        )
        self.registry.register(EngineStatsCollector(read_engine_stats))

    def count_request(self, status: int) -> None:
        self.requests.labels(status=str(status)).inc()

    def render(self) -> bytes:
        """The page, in the Prometheus text format (`CONTENT_TYPE`)."""
        return generate_latest(self.registry)


class EngineStatsCollector(Collector):
    """`LLMEngine.stats()` as metric families, read afresh at every scrape."""

    def __init__(self, read_engine_stats: Callable[[], EngineStats | None]) -> None:
        self._read_engine_stats = read_engine_stats

    def collect(self) -> Iterator[Metric]:
        stats = self._read_engine_stats()
        if stats is not None:
            yield from engine_families(stats)

    def describe(self) -> list[Metric]:
        return []  # the families exist only while the engine answers


def engine_families(stats: EngineStats) -> list[Metric]:
    """The groups of `LLMEngine.stats()` (described in `nanoqwen/stats.py`) as families; a
    feature that is off has no group, and no families."""
    kv, requests, tokens = stats["kv_cache"], stats["requests"], stats["tokens"]
    finished = CounterMetricFamily(
        "nanoqwen_requests_finished",
        "Engine requests finished, by reason (stop, length, abort, error).", labels=["reason"],
    )
    for reason, count in sorted(requests["finished"].items()):
        finished.add_metric([reason], count)
    pages = by_state(
        "nanoqwen_kv_pages",
        "KV-cache pages by state: used (held by requests), cached (only the prefix cache "
        "holds them; evictable), free.", kv, "pages_{}",
    )
    preemptions = CounterMetricFamily(
        "nanoqwen_preemptions_by_cause",
        "Running requests preempted, by cause: kv_pages (the KV pool ran out), max_num_seqs "
        "(a more urgent request took the seat).", labels=["cause"],
    )
    for cause, count in sorted(requests["preemptions_by_cause"].items()):
        preemptions.add_metric([cause], count)
    return [
        finished,
        GaugeMetricFamily("nanoqwen_requests_running", "Requests in the running batch.",
                          value=requests["running"]),
        GaugeMetricFamily("nanoqwen_requests_waiting", "Requests queued for admission.",
                          value=requests["waiting"]),
        CounterMetricFamily("nanoqwen_prompt_tokens", "Prompt tokens received.",
                            value=tokens["prompt"]),
        CounterMetricFamily("nanoqwen_generation_tokens", "Tokens generated.",
                            value=tokens["generated"]),
        pages,
        CounterMetricFamily("nanoqwen_preemptions",
                            "Running requests preempted (pages released, recomputed later).",
                            value=requests["preemptions"]),
        preemptions,
        CounterMetricFamily("nanoqwen_deadlines_missed",
                            "Requests with a deadline that ended after it.",
                            value=requests["deadlines_missed"]),
        CounterMetricFamily("nanoqwen_deadlines_met",
                            "Requests with a deadline that finished by it.",
                            value=requests["deadlines_met"]),
        *group_families(stats, "swap", SWAP_FAMILIES, "Swap preemption: "),
        *group_families(stats, "prefix_cache", PREFIX_CACHE_FAMILIES, "Prefix cache: "),
        *state_pool_families(stats),
        *group_families(stats, "speculative", SPECULATION_FAMILIES, "Speculative decoding: "),
        *group_families(stats, "cpu", CPU_FAMILIES, "CPU: "),
        *memory_families(stats),
    ]


def by_state(
    name: str, help: str, group: Mapping[str, Any], key: str,
    states: tuple[str, ...] = ("used", "cached", "free"),
) -> GaugeMetricFamily:
    """A gauge labelled by state, KV page states unless told (`key` names a state's figure)."""
    family = GaugeMetricFamily(name, help, labels=["state"])
    for state in states:
        family.add_metric([state], group[key.format(state)])
    return family


def state_pool_families(stats: EngineStats) -> list[Metric]:
    """The `state_pool` group (a model with recurrent layers): its slots by state, and all."""
    if "state_pool" not in stats:
        return []
    slots = by_state(
        "nanoqwen_state_slots",
        "State pool: slots by state: running (held by running requests), snapshots (the "
        "prefix cache's saved states; evictable), free.", stats["state_pool"], "slots_{}",
        states=("running", "snapshots", "free"),
    )
    return [slots, *group_families(stats, "state_pool", STATE_POOL_FAMILIES, "State pool: ")]


def memory_families(stats: EngineStats) -> list[Metric]:
    """The `memory` group: one gauge a figure, the KV cache's bytes by page state."""
    if "memory" not in stats:
        return []
    kv_bytes = by_state(
        "nanoqwen_kv_cache_bytes",
        "Memory: bytes of the KV-cache pages by state (as nanoqwen_kv_pages), every rank's.",
        stats["memory"], "kv_{}_bytes",
    )
    return [kv_bytes, *group_families(stats, "memory", MEMORY_FAMILIES, "Memory: ")]


def group_families(
    stats: EngineStats, group: str, families: tuple[FamilySpec, ...], help_prefix: str
) -> list[Metric]:
    """One family per figure of an optional `stats()` group; none when the group is absent,
    nor for a figure it lacks (CUDA's, off a GPU)."""
    if group not in stats:
        return []
    return [
        kind(name, help_prefix + help, value=stats[group][key])
        for kind, name, help, key in families
        if key in stats[group]
    ]


# (kind, metric name, help, key in its `stats()` group)
FamilySpec = tuple[type[Metric], str, str, str]
PREFIX_CACHE_FAMILIES: tuple[FamilySpec, ...] = (
    (CounterMetricFamily, "nanoqwen_prefix_cache_query_tokens",
     "prompt tokens looked up.", "query_tokens"),
    (CounterMetricFamily, "nanoqwen_prefix_cache_hit_tokens",
     "prompt tokens whose KV was reused.", "hit_tokens"),
)
STATE_POOL_FAMILIES: tuple[FamilySpec, ...] = (
    (GaugeMetricFamily, "nanoqwen_state_slots_total",
     "slots requests and snapshots can hold (running + snapshots + free).", "slots_total"),
)
SWAP_FAMILIES: tuple[FamilySpec, ...] = (
    (CounterMetricFamily, "nanoqwen_swaps_out", "preempted requests whose pages were copied "
     "to host memory.", "swaps_out"),
    (CounterMetricFamily, "nanoqwen_swaps_in", "admissions that copied pages back.", "swaps_in"),
    (CounterMetricFamily, "nanoqwen_swapped_out_pages", "pages copied to host memory.",
     "pages_out"),
    (CounterMetricFamily, "nanoqwen_swapped_in_pages", "pages copied back.", "pages_in"),
    (CounterMetricFamily, "nanoqwen_swap_recomputed", "preemptions that found the host pool "
     "full and recompute instead.", "recomputed"),
    (GaugeMetricFamily, "nanoqwen_swap_host_pages_used", "host pages held by swapped-out "
     "requests.", "host_pages_used"),
)
SPECULATION_FAMILIES: tuple[FamilySpec, ...] = (
    (CounterMetricFamily, "nanoqwen_spec_draft_tokens", "draft tokens proposed and verified.",
     "proposed_tokens"),
    (CounterMetricFamily, "nanoqwen_spec_accepted_tokens",
     "draft tokens the target model accepted.", "accepted_tokens"),
    (CounterMetricFamily, "nanoqwen_spec_verifications",
     "request-steps that verified draft tokens.", "verifications"),
    (GaugeMetricFamily, "nanoqwen_spec_acceptance_rate",
     "accepted / proposed draft tokens, so far.", "acceptance_rate"),
    (GaugeMetricFamily, "nanoqwen_spec_mean_accepted_length",
     "tokens per verification (accepted drafts plus the target's own), so far.",
     "mean_accepted_length"),
)
CPU_FAMILIES: tuple[FamilySpec, ...] = (
    (GaugeMetricFamily, "nanoqwen_cpu_threads", "threads the last step ran on.", "threads"),
    (GaugeMetricFamily, "nanoqwen_cpu_others_cores",
     "cores' worth of time others (other processes, this one's handler threads) took.",
     "others_cores"),
    (CounterMetricFamily, "nanoqwen_cpu_reduced_steps",
     "steps run on fewer threads than torch's count, to leave others a core.",
     "reduced_steps"),
)
MEMORY_FAMILIES: tuple[FamilySpec, ...] = (
    (GaugeMetricFamily, "nanoqwen_resident_memory_bytes",
     "resident set size (RSS) of the server's process (rank 0's, with split ranks).",
     "resident_bytes"),
    (GaugeMetricFamily, "nanoqwen_weight_bytes", "bytes of the model's weights, every rank's.",
     "weight_bytes"),
    (GaugeMetricFamily, "nanoqwen_kv_cache_total_bytes",
     "bytes of the KV-cache pages requests can hold, every rank's.", "kv_total_bytes"),
    (GaugeMetricFamily, "nanoqwen_state_pool_bytes",
     "bytes of the state pool (recurrent layers' slots), every rank's.", "state_pool_bytes"),
    (GaugeMetricFamily, "nanoqwen_cuda_memory_allocated_bytes",
     "GPU memory in tensors, as torch counts it (rank 0's GPU).", "cuda_allocated_bytes"),
    (GaugeMetricFamily, "nanoqwen_cuda_memory_reserved_bytes",
     "GPU memory torch's caching allocator holds: allocated, and kept for reuse.",
     "cuda_reserved_bytes"),
)
