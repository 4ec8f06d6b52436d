"""The lock-free counters of the request path count every increment from any thread."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

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


def test_owned_counters_export_as_a_counter_does_and_add_amounts() -> None:
    """A family counted by one thread without a lock (the trio thread's issued bytes)
    exports what prometheus-client's Counter exported: ``<name>_total`` by label, of the
    counter type, each ``labels()`` the same series."""
    family = metrics.OwnedCounters("cachefs_test_bytes", "Bytes.", "policy")
    registry = CollectorRegistry()
    registry.register(family)
    family.labels("a").inc(110_000)
    family.labels("a").inc(5)
    family.labels("b")
    assert family.labels("a") is family.labels("a")
    text = generate_latest(registry).decode()
    assert "# TYPE cachefs_test_bytes_total counter" in text
    assert 'cachefs_test_bytes_total{policy="a"} 110005.0' in text
    assert 'cachefs_test_bytes_total{policy="b"} 0.0' in text
    assert registry.get_sample_value("cachefs_test_bytes_total", {"policy": "a"}) == 110005
    # The prefetcher's issued bytes are such a family, on the daemon's page and in totals().
    metrics.PREFETCH_ISSUED_BYTES.labels("directory").inc(7)
    assert isinstance(metrics.PREFETCH_ISSUED_BYTES, metrics.OwnedCounters)
    assert metrics.REGISTRY.get_sample_value("cachefs_prefetch_issued_bytes_total",
                                             {"policy": "directory"}) >= 7
    assert metrics.totals()["cachefs_prefetch_issued_bytes_total"] >= 7


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


def _burn(seconds: float) -> None:
    """Run on the CPU for ``seconds`` of this thread's own CPU time."""
    start = time.thread_time()
    while time.thread_time() - start < seconds:
        pass


def test_thread_cpu_counts_what_each_group_of_threads_ran_by_the_scheduler() -> None:
    cpu = metrics.ThreadCpu()
    before = cpu.sample()
    running = threading.Event()
    stop = threading.Event()

    def s3() -> None:
        _burn(0.2)
        running.set()
        stop.wait(10)

    t = threading.Thread(target=s3, name="cachefs-s3")
    t.start()
    running.wait(10)
    during = cpu.sample()
    stop.set()
    t.join()
    assert during["s3"] - before["s3"] >= 0.18
    assert during["fuse"] == before["fuse"]
    _burn(0.1)  # this test's own thread: the main thread, the daemon's trio thread
    after = cpu.sample()
    assert after["event_loop"] - during["event_loop"] >= 0.09
    assert after["s3"] >= during["s3"]  # a thread that ended takes nothing back


#: Run in an interpreter of its own: the time of threads that ended between two looks goes
#: to their group only when they were all in one, and the test process's other threads
#: (trio's idle workers end 10 s after their last job, a pytest-xdist worker's) may end in
#: the same window. The look after waits until the thread's task is gone from /proc.
_ENDED_THREAD = """
import json, os, threading, time
from cachefs import metrics

def burn(seconds):
    start = time.thread_time()
    while time.thread_time() - start < seconds:
        pass

cpu = metrics.ThreadCpu()
go = threading.Event()

def verify():
    go.wait(10)
    burn(0.3)

t = threading.Thread(target=verify, name="cachefs-verify-0")
t.start()
before = cpu.sample()  # sees the thread, idle
go.set()
t.join()
# join() returns once the thread's Python code is done; the kernel's task can stay in
# /proc a moment longer, still counted as a live thread (whose name is gone): wait it out.
while os.path.exists(f"/proc/self/task/{t.native_id}"):
    time.sleep(0.001)
after = cpu.sample()
print(json.dumps([before, after]))
"""


def test_thread_cpu_counts_threads_that_ended_between_two_looks() -> None:
    """What a thread ran after the last look and before it ended is only in the process's
    total: it still counts, under the group the thread was in when last seen."""
    out = subprocess.run([sys.executable, "-c", _ENDED_THREAD], capture_output=True, text=True,
                         timeout=60, check=True).stdout
    before, after = json.loads(out)
    # (the process's total moves in ticks of 10 ms, hence the margin)
    assert after["verify"] - before["verify"] >= 0.25
    assert sum(after.values()) >= sum(before.values())


def test_thread_cpu_is_on_the_scraped_page_and_not_in_the_status_snapshot() -> None:
    text = generate_latest(metrics.EXPOSED).decode()
    for group in ("event_loop", "fuse", "s3", "verify", "readahead", "other"):
        assert f'cachefs_thread_cpu_seconds_total{{threads="{group}"}}' in text
    assert not any(k.startswith("cachefs_thread_cpu") for k in metrics.totals())


def test_threads_are_grouped_by_their_names() -> None:
    assert metrics.thread_group("MainThread") == "event_loop"
    assert metrics.thread_group("cachefs-fuse-3") == "fuse"
    assert metrics.thread_group("cachefs-s3") == "s3"
    assert metrics.thread_group("cachefs-verify-1") == "verify"
    assert metrics.thread_group("Trio thread 12") == "other"


def test_metadata_without_a_version_still_imports(tmp_path: Path) -> None:
    """``make dist`` writes ``cachefs.egg-info`` in the checkout, which is on a daemon's
    path when it runs from the source tree; caught half-written, its metadata names no
    version, and ``importlib.metadata.version`` gives None: the metrics module's build
    info then raised at import, and a mount started at that moment failed with a
    traceback (seen with tests running two at a time)."""
    egg = tmp_path / "cachefs.egg-info"
    egg.mkdir()
    (egg / "PKG-INFO").write_text("Metadata-Version: 2.1\nName: cachefs\n")
    repo = Path(__file__).resolve().parent.parent
    code = "import cachefs, cachefs.metrics; print(cachefs.__version__)"
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{repo}"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=env, cwd=tmp_path, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "0.0.0+unknown"
