"""How load arrives and how its latencies are summed up: what `bench.py` shares between
driving the engine in-process and driving a server over HTTP.

**Arrivals.** `--request-rate inf` submits every request at once (an offline batch job, or
a closed loop that `--max-concurrency` keeps at a fixed number in flight: each finished
request lets the next one in). A finite rate is an open loop: requests arrive as a
Poisson process of that many per second, whatever the engine is doing, so the gaps
between them are independent exponential draws of mean `1 / rate`. That is how requests
from many independent users arrive, and what shows an engine's TTFT growing as the rate
nears what it can serve. The draws are seeded: the same seed gives the same arrival times.

**Percentiles and goodput.** Latencies are reported as p50 and p95 (interpolating between
ranks). Goodput is the rate of requests that met every latency objective given
(`--goodput ttft:MS`, `tpot:MS`; all finished requests count when none is given): the
throughput a service level can count on, which raw tokens per second overstates once
queues grow.
"""

from __future__ import annotations

import math
import random
import statistics
from collections.abc import Iterable, Sequence

GOODPUT_KEYS = ("ttft", "tpot", "e2e")


def arrival_times(count: int, rate: float, seed: int) -> list[float]:
    """Seconds from the start at which each of `count` requests arrives: all at 0 for an
    infinite rate, else a Poisson process of `rate` requests a second (the first after one
    gap, as every other)."""
    if rate <= 0:
        raise ValueError(f"the request rate must be positive, got {rate}")
    if math.isinf(rate):
        return [0.0] * count
    rng, now, times = random.Random(seed), 0.0, []
    for _ in range(count):
        now += rng.expovariate(rate)
        times.append(now)
    return times


def percentile(values: Sequence[float], q: int) -> float:
    """The `q`-th percentile (1-99), interpolating between ranks; 0 for no values."""
    if len(values) < 2:
        return float(values[0]) if values else 0.0
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1]


def percentiles(values: Sequence[float]) -> dict[str, float]:
    return {"p50": percentile(values, 50), "p95": percentile(values, 95)}


def latency_ms(seconds: Sequence[float]) -> dict[str, float]:
    return {name: value * 1000 for name, value in percentiles(seconds).items()}


def request_latencies(
    submitted: float, first_token: float, last_token: float, output_tokens: int
) -> dict[str, float]:
    """A finished request's ttft, tpot (when it made more than one token) and e2e."""
    latencies = {"ttft": first_token - submitted, "e2e": last_token - submitted}
    if output_tokens > 1:
        latencies["tpot"] = (last_token - first_token) / (output_tokens - 1)
    return latencies


def parse_goodput(objectives: Iterable[str]) -> dict[str, float]:
    """`["ttft:2000", "tpot:250"]` → `{"ttft": 2.0, "tpot": 0.25}` (seconds); a ValueError
    naming what is wrong."""
    parsed = {}
    for objective in objectives:
        key, _, value = objective.partition(":")
        if key not in GOODPUT_KEYS:
            raise ValueError(f"--goodput {objective!r}: the key must be one of "
                             f"{', '.join(GOODPUT_KEYS)}, as in ttft:2000")
        try:
            milliseconds = float(value)
        except ValueError:
            raise ValueError(f"--goodput {objective!r}: expected milliseconds after the "
                             "colon, as in ttft:2000") from None
        if milliseconds <= 0:
            raise ValueError(f"--goodput {objective!r}: the objective must be positive")
        parsed[key] = milliseconds / 1000
    return parsed


def goodput(
    latencies: Sequence[dict[str, float]], objectives: dict[str, float], wall_s: float,
    total: int,
) -> dict[str, float]:
    """Requests per second that met every objective, and their share of all `total`
    requests, beside the rate of all finished ones (the throughput goodput falls short of).
    `latencies` holds each finished request's ttft, tpot and e2e in seconds (a request that
    made one token has no tpot, which then counts as met)."""
    met = sum(
        all(request.get(key, 0.0) <= limit for key, limit in objectives.items())
        for request in latencies
    )
    per_second = 1 / wall_s if wall_s > 0 else 0.0
    return {"finished_req_s": len(latencies) * per_second, "goodput_req_s": met * per_second,
            "goodput_share": met / max(total, 1)}
