"""The metrics page: engine stats and server measurements, read back with Prometheus's parser."""

from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from nanoqwen import LLMEngine, SamplingParams
from nanoqwen.metrics import ServerMetrics

ENGINE_STATS: dict[str, Any] = {
    "kv_cache": {"pages_used": 5, "pages_cached": 7, "pages_free": 20, "bytes": 1 << 20},
    "requests": {
        "running": 2, "waiting": 4, "finished": {"stop": 3, "length": 1, "abort": 2},
        "preemptions": 3, "preemptions_by_cause": {"kv_pages": 1, "max_num_seqs": 2},
        "deadlines_met": 6, "deadlines_missed": 1,
    },
    "swap": {
        "swaps_out": 3, "swaps_in": 2, "pages_out": 12, "pages_in": 5, "recomputed": 1,
        "host_pages_total": 64, "host_pages_used": 4, "host_bytes": 1 << 16,
    },
    "tokens": {"prompt": 120, "generated": 64},
    "prefix_cache": {"query_tokens": 100, "hit_tokens": 48},
    "speculative": {
        "proposed_tokens": 40, "accepted_tokens": 30, "verifications": 10,
        "acceptance_rate": 0.75, "mean_accepted_length": 4.0,
    },
    "cpu": {"cores": 2, "threads": 1, "others_cores": 0.9, "reduced_steps": 17},
    "memory": {
        "resident_bytes": 900 << 20, "weight_bytes": 300 << 20, "kv_total_bytes": 32 << 10,
        "kv_used_bytes": 5 << 10, "kv_cached_bytes": 7 << 10, "kv_free_bytes": 20 << 10,
        "cuda_allocated_bytes": 400 << 20, "cuda_reserved_bytes": 512 << 20,
    },
}
# A hybrid model's engine adds its state pool (`memory/state_pool.py`).
HYBRID_STATS: dict[str, Any] = {
    **ENGINE_STATS,
    "state_pool": {"slots_total": 12, "slots_running": 3, "slots_snapshots": 5, "slots_free": 4},
    "memory": {**ENGINE_STATS["memory"], "state_pool_bytes": 6 << 20},
}


def samples(metrics: ServerMetrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """The page as {(sample name, sorted labels): value}, parsed as Prometheus parses it."""
    page = metrics.render().decode()
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(page)
        for sample in family.samples
    }


def test_engine_stats_become_families() -> None:
    page = samples(ServerMetrics(lambda: ENGINE_STATS))
    assert page[("nanoqwen_requests_finished_total", (("reason", "abort"),))] == 2
    assert page[("nanoqwen_requests_finished_total", (("reason", "stop"),))] == 3
    for state in ("used", "cached", "free"):
        expected = ENGINE_STATS["kv_cache"][f"pages_{state}"]
        assert page[("nanoqwen_kv_pages", (("state", state),))] == expected
    assert page[("nanoqwen_requests_running", ())] == 2
    assert page[("nanoqwen_requests_waiting", ())] == 4
    assert page[("nanoqwen_prompt_tokens_total", ())] == 120
    assert page[("nanoqwen_generation_tokens_total", ())] == 64
    assert page[("nanoqwen_prefix_cache_query_tokens_total", ())] == 100
    assert page[("nanoqwen_prefix_cache_hit_tokens_total", ())] == 48
    assert page[("nanoqwen_preemptions_total", ())] == 3
    by_cause = "nanoqwen_preemptions_by_cause_total"
    assert page[(by_cause, (("cause", "kv_pages"),))] == 1
    assert page[(by_cause, (("cause", "max_num_seqs"),))] == 2
    assert page[("nanoqwen_deadlines_missed_total", ())] == 1
    assert page[("nanoqwen_deadlines_met_total", ())] == 6
    assert page[("nanoqwen_swaps_out_total", ())] == 3
    assert page[("nanoqwen_swaps_in_total", ())] == 2
    assert page[("nanoqwen_swapped_out_pages_total", ())] == 12
    assert page[("nanoqwen_swapped_in_pages_total", ())] == 5
    assert page[("nanoqwen_swap_recomputed_total", ())] == 1
    assert page[("nanoqwen_swap_host_pages_used", ())] == 4
    assert page[("nanoqwen_spec_draft_tokens_total", ())] == 40
    assert page[("nanoqwen_spec_accepted_tokens_total", ())] == 30
    assert page[("nanoqwen_spec_verifications_total", ())] == 10
    assert page[("nanoqwen_spec_acceptance_rate", ())] == 0.75
    assert page[("nanoqwen_spec_mean_accepted_length", ())] == 4.0
    assert page[("nanoqwen_cpu_threads", ())] == 1
    assert page[("nanoqwen_cpu_others_cores", ())] == 0.9
    assert page[("nanoqwen_cpu_reduced_steps_total", ())] == 17
    memory = ENGINE_STATS["memory"]
    assert page[("nanoqwen_resident_memory_bytes", ())] == memory["resident_bytes"]
    assert page[("nanoqwen_weight_bytes", ())] == memory["weight_bytes"]
    assert page[("nanoqwen_kv_cache_total_bytes", ())] == memory["kv_total_bytes"]
    for state in ("used", "cached", "free"):
        expected = memory[f"kv_{state}_bytes"]
        assert page[("nanoqwen_kv_cache_bytes", (("state", state),))] == expected
    assert page[("nanoqwen_cuda_memory_allocated_bytes", ())] == memory["cuda_allocated_bytes"]
    assert page[("nanoqwen_cuda_memory_reserved_bytes", ())] == memory["cuda_reserved_bytes"]


def test_gpu_memory_is_reported_only_on_a_gpu() -> None:
    """Off CUDA the memory group has no GPU figures: the page has no GPU families, and
    keeps the rest of the group."""
    off_gpu = {key: value for key, value in ENGINE_STATS["memory"].items()
               if not key.startswith("cuda")}
    stats = {**ENGINE_STATS, "memory": off_gpu}
    names = {name for name, _ in samples(ServerMetrics(lambda: stats))}
    assert {"nanoqwen_resident_memory_bytes", "nanoqwen_kv_cache_bytes"} <= names
    assert not any(name.startswith("nanoqwen_cuda") for name in names)


def test_features_that_are_off_have_no_families() -> None:
    """An engine without prefix cache or speculation (or off a CPU) reports no such group:
    no zeros."""
    stats = {group: ENGINE_STATS[group] for group in ("kv_cache", "requests", "tokens")}
    names = {name for name, _ in samples(ServerMetrics(lambda: stats))}
    assert "nanoqwen_requests_running" in names
    assert not any(name.startswith(("nanoqwen_prefix_cache", "nanoqwen_spec", "nanoqwen_cpu",
                                    "nanoqwen_swap"))
                   for name in names)


def test_a_hybrid_models_state_slots_are_gauges() -> None:
    page = samples(ServerMetrics(lambda: HYBRID_STATS))
    pool = HYBRID_STATS["state_pool"]
    for state in ("running", "snapshots", "free"):
        assert page[("nanoqwen_state_slots", (("state", state),))] == pool[f"slots_{state}"]
    assert page[("nanoqwen_state_slots_total", ())] == 12
    assert page[("nanoqwen_state_pool_bytes", ())] == 6 << 20
    dense = {name for name, _ in samples(ServerMetrics(lambda: ENGINE_STATS))}
    assert not any(name.startswith("nanoqwen_state_") for name in dense)


def test_a_hybrid_engines_page_counts_its_slots(newer_kind_dirs: dict[str, str]) -> None:
    """The page of a running hybrid engine: every slot is running, a snapshot or free."""
    engine = LLMEngine(newer_kind_dirs["qwen3_5"], device="cpu", dtype="float32", page_size=4,
                       num_pages=64)
    engine.add_request(list(range(10, 40)), SamplingParams(max_tokens=4, ignore_eos=True))
    engine.step()
    page = samples(ServerMetrics(engine.stats))
    slots = {state: page[("nanoqwen_state_slots", (("state", state),))]
             for state in ("running", "snapshots", "free")}
    assert slots["running"] == 1 and slots["snapshots"] >= 1
    assert sum(slots.values()) == page[("nanoqwen_state_slots_total", ())]
    assert page[("nanoqwen_state_pool_bytes", ())] == engine.runner.states.nbytes


def test_engine_stats_are_read_at_every_scrape() -> None:
    stats = {**ENGINE_STATS, "requests": dict(ENGINE_STATS["requests"])}
    metrics = ServerMetrics(lambda: stats)
    assert samples(metrics)[("nanoqwen_requests_running", ())] == 2
    stats["requests"]["running"] = 7
    assert samples(metrics)[("nanoqwen_requests_running", ())] == 7


def test_server_measurements_are_counted() -> None:
    metrics = ServerMetrics(lambda: ENGINE_STATS)
    for status in (200, 200, 504):
        metrics.count_request(status)
    for seconds in (0.02, 0.2, 7.0):
        metrics.time_to_first_token.observe(seconds)
    page = samples(metrics)
    assert page[("nanoqwen_http_requests_total", (("status", "200"),))] == 2
    assert page[("nanoqwen_http_requests_total", (("status", "504"),))] == 1
    ttft = "nanoqwen_time_to_first_token_seconds"
    assert page[(f"{ttft}_count", ())] == 3
    assert page[(f"{ttft}_bucket", (("le", "0.025"),))] == 1
    assert page[(f"{ttft}_bucket", (("le", "5.0"),))] == 2
    assert page[(f"{ttft}_bucket", (("le", "+Inf"),))] == 3


def test_each_server_counts_for_itself() -> None:
    first, second = ServerMetrics(lambda: ENGINE_STATS), ServerMetrics(lambda: ENGINE_STATS)
    first.count_request(200)
    assert samples(first)[("nanoqwen_http_requests_total", (("status", "200"),))] == 1
    assert ("nanoqwen_http_requests_total", (("status", "200"),)) not in samples(second)


def test_page_without_engine_stats_keeps_the_server_metrics() -> None:
    metrics = ServerMetrics(lambda: None)  # the engine can't answer
    metrics.count_request(503)
    page = samples(metrics)
    assert page[("nanoqwen_http_requests_total", (("status", "503"),))] == 1
    assert not any(name.startswith("nanoqwen_kv_pages") for name, _ in page)


def test_every_family_is_announced_once() -> None:
    page = ServerMetrics(lambda: ENGINE_STATS).render().decode()
    names = [line.split()[2] for line in page.splitlines() if line.startswith("# TYPE")]
    assert len(names) == len(set(names))
    assert {"nanoqwen_time_to_first_token_seconds", "nanoqwen_inter_token_latency_seconds",
            "nanoqwen_request_duration_seconds", "nanoqwen_kv_pages"} <= set(names)
