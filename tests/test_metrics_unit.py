"""The lock-free counters of the request path count every increment from any thread."""

from __future__ import annotations

import threading

from prometheus_client import CollectorRegistry, generate_latest

from cachefs import metrics


def test_a_fast_counter_counts_every_increment_from_racing_threads() -> None:
    counter = metrics.FastCounter()
    assert counter.value == 0

    def bump() -> None:
        for _ in range(20_000):
            counter.inc()

    threads = [threading.Thread(target=bump) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert counter.value == 80_000


def test_fast_counters_export_one_labelled_family() -> None:
    family = metrics._FastCounters("cachefs_test_things", "Things.", "kind", ("a", "b"))
    registry = CollectorRegistry()
    registry.register(family)
    for _ in range(3):
        family.counters["a"].inc()
    text = generate_latest(registry).decode()
    assert 'cachefs_test_things_total{kind="a"} 3.0' in text
    assert 'cachefs_test_things_total{kind="b"} 0.0' in text


def test_totals_sum_every_cachefs_counter_and_gauge_but_no_histogram() -> None:
    """totals() (the status reports) collects only what it sums; it must still cover every
    cachefs family that is not a histogram, custom collectors included."""
    metrics.S3_LATENCY.labels("get").observe(0.01)
    full: dict[str, float] = {}
    for family in metrics.REGISTRY.collect():
        if family.type == "histogram":
            continue
        for sample in family.samples:
            if not sample.name.endswith("_created"):
                full[sample.name] = full.get(sample.name, 0.0) + sample.value
    got = metrics.totals()
    assert set(got) == set(full)
    assert "cachefs_fuse_requests_total" in got and "cachefs_cache_used_bytes" in got
    assert not any(k.startswith("cachefs_s3_request_duration") for k in got), sorted(got)
