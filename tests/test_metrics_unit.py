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
