"""The Prometheus text format, checked line by line on small hand-made metrics."""

import threading

import pytest

from nanoqwen.metrics import Counter, Histogram, ServerMetrics, engine_families, render

ENGINE_STATS = {
    "finished": {"stop": 3, "length": 1, "abort": 2},
    "pages_used": 5, "pages_cached": 7, "pages_free": 20,
    "running": 2, "waiting": 4,
    "prompt_tokens": 120, "generated_tokens": 64,
    "prefix_query_tokens": 100, "prefix_hit_tokens": 48,
    "preemptions": 1,
}


def sample_lines(text: str) -> dict[str, str]:
    return dict(line.rsplit(" ", 1) for line in text.splitlines() if not line.startswith("#"))


def test_histogram_buckets_are_cumulative_and_inclusive() -> None:
    histogram = Histogram("latency_seconds", "A latency.", [0.1, 1.0])
    for value in (0.05, 0.1, 0.5, 1.0, 7.0):  # 0.1 and 1.0 sit exactly on a bound
        histogram.observe(value)
    samples = sample_lines(render([histogram.collect()]))
    assert samples == {
        'latency_seconds_bucket{le="0.1"}': "2",
        'latency_seconds_bucket{le="1"}': "4",
        'latency_seconds_bucket{le="+Inf"}': "5",
        "latency_seconds_sum": repr(0.05 + 0.1 + 0.5 + 1.0 + 7.0),
        "latency_seconds_count": "5",
    }


def test_histogram_rejects_unsorted_buckets() -> None:
    with pytest.raises(ValueError, match="increasing"):
        Histogram("h", "h", [1.0, 0.5])


def test_counter_keeps_one_value_per_label_set_across_threads() -> None:
    counter = Counter("requests_total", "Requests.")

    def count_many() -> None:
        for _ in range(1000):
            counter.inc(status="200")
        counter.inc(status="404")

    threads = [threading.Thread(target=count_many) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    text = render([counter.collect()])
    assert text.splitlines()[:2] == [
        "# HELP requests_total Requests.", "# TYPE requests_total counter"
    ]
    assert sample_lines(text) == {
        'requests_total{status="200"}': "4000", 'requests_total{status="404"}': "4"
    }


def test_label_values_are_escaped() -> None:
    counter = Counter("c_total", "c")
    counter.inc(path='a"b\\c\nd')
    assert 'c_total{path="a\\"b\\\\c\\nd"} 1' in render([counter.collect()])


def test_engine_stats_become_families() -> None:
    samples = sample_lines(render(engine_families(ENGINE_STATS)))
    assert samples['nanoqwen_requests_finished_total{reason="abort"}'] == "2"
    assert samples['nanoqwen_kv_pages{state="used"}'] == "5"
    assert samples['nanoqwen_kv_pages{state="cached"}'] == "7"
    assert samples['nanoqwen_kv_pages{state="free"}'] == "20"
    assert samples["nanoqwen_requests_waiting"] == "4"
    assert samples["nanoqwen_prefix_cache_hit_tokens_total"] == "48"
    assert samples["nanoqwen_generation_tokens_total"] == "64"


def test_server_page_announces_every_family_once() -> None:
    metrics = ServerMetrics()
    metrics.time_to_first_token.observe(0.02)
    text = metrics.render(ENGINE_STATS)
    names = [line.split()[2] for line in text.splitlines() if line.startswith("# TYPE")]
    assert len(names) == len(set(names))
    assert {"nanoqwen_time_to_first_token_seconds", "nanoqwen_inter_token_latency_seconds",
            "nanoqwen_http_requests_total", "nanoqwen_kv_pages"} <= set(names)
    assert sample_lines(text)["nanoqwen_time_to_first_token_seconds_count"] == "1"
