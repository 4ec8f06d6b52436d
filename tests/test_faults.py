"""S3 faults under a real mount: transient failures are ridden out, the rest become errno.

The fault matrix of docs/faults.md: a fault proxy (tests/faultproxy.py) sits between a real
cachefs mount and a real S3 server (moto) and takes the endpoint away, throttles, stalls,
resets and truncates answers, or alters bytes in transit, while reader threads read through
the mount and check every byte. Each test reports failed reads, wrong bytes, the longest
read and the recovery time (printed; appended as a JSON line to the file named by
``CACHEFS_FAULT_REPORT`` when set, which is how the table in docs/faults.md was made).
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import random
import signal
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import Mount, is_mounted, run_cachefs
from tests.faultproxy import FaultProxy, ForwardProxy

pytestmark = pytest.mark.fuse


def differing_bytes(a: bytes, b: bytes) -> int:
    return sum(x != y for x, y in zip(a, b, strict=False)) + abs(len(a) - len(b))


def report(fault: str, stats: dict[str, Any]) -> None:
    line = json.dumps({"fault": fault, **stats}, sort_keys=True)
    print(line)
    path = os.environ.get("CACHEFS_FAULT_REPORT")
    if path:
        with open(path, "a") as f:
            f.write(line + "\n")


class Readers:
    """Reader threads that each read their own files whole, once, and check every byte.

    Each reader reads its ``before`` files, then waits for ``go`` (the fault is on by then),
    then reads its ``during`` files."""

    def __init__(self, root: Path, files: dict[str, bytes], *, readers: int = 8,
                 before: list[str] | None = None) -> None:
        self.root = root
        self.files = files
        keys = sorted(k for k in files if k not in (before or []))
        self.during = [keys[i::readers] for i in range(readers)]
        before = before or []
        self.before = [before[i::readers] for i in range(readers)]
        self.go = threading.Event()
        self.reads: list[tuple[str, float, float, int | None, bool]] = []
        self._lock = threading.Lock()
        self.threads = [threading.Thread(target=self._run, args=(i,), daemon=True)
                        for i in range(readers)]
        self.ready = threading.Barrier(readers + 1)

    def _read(self, key: str) -> None:
        t0 = time.monotonic()
        code: int | None = None
        right = False
        try:
            with open(self.root / key, "rb") as f:
                right = f.read() == self.files[key]
        except OSError as exc:
            code = exc.errno
        with self._lock:
            self.reads.append((key, t0, time.monotonic(), code, right))

    def _run(self, i: int) -> None:
        for key in self.before[i]:
            self._read(key)
        self.ready.wait(60)
        self.go.wait(120)
        for key in self.during[i]:
            self._read(key)

    def start(self) -> None:
        for t in self.threads:
            t.start()
        self.ready.wait(60)  # the "before" reads are done

    def join(self, timeout: float) -> None:
        end = time.monotonic() + timeout
        for t in self.threads:
            t.join(max(0.0, end - time.monotonic()))
        assert not any(t.is_alive() for t in self.threads), "readers still blocked"

    def stats(self, fault_end: float | None = None) -> dict[str, Any]:
        failed = [r for r in self.reads if r[3] is not None]
        wrong = [r for r in self.reads if r[3] is None and not r[4]]
        longest = max((r[2] - r[1] for r in self.reads), default=0.0)
        recovery = None
        if fault_end is not None:
            recovery = max((r[2] for r in self.reads), default=fault_end) - fault_end
        return {"reads": len(self.reads), "failed": len(failed), "wrong": len(wrong),
                "errnos": sorted({errno.errorcode.get(r[3], str(r[3])) for r in failed}),
                "longest_read_s": round(longest, 2),
                "recovery_s": None if recovery is None else round(max(recovery, 0.0), 2)}


def dataset(client: Any, name: str, prefix: str, count: int, seed: int = 0) -> dict[str, bytes]:
    """Files of 1 KB to 300 KB under ``prefix``: whole-object reads and, with 64K blocks,
    multi-block ones."""
    rnd = random.Random(seed)
    files = {}
    for i in range(count):
        data = rnd.randbytes(rnd.choice([1000, 20_000, 60_000, 150_000, 300_000]))
        files[f"{prefix}f{i:03d}.bin"] = data
        client.put_object(Bucket=name, Key=f"{prefix}f{i:03d}.bin", Body=data)
    return files


def proxied_mount(mount_factory: Any, proxy: FaultProxy, name: str, *extra: str) -> Mount:
    m: Mount = mount_factory(f"s3://{name}", "--block-size", "64K", *extra, start=False)
    m.endpoint = proxy.url
    m.start()
    return m


def sum_metric(m: Mount, prefix: str) -> float:
    return sum(v for k, v in m.metrics().items() if k.startswith(prefix))


def wait_for(cond: Any, *, what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"no {what} after {timeout:g} s"
        time.sleep(0.1)


def assert_daemon_healthy(m: Mount) -> None:
    assert is_mounted(m.path)
    assert m.metrics()  # still answering
    assert "Traceback" not in m.log()


@pytest.fixture
def proxied(bucket, s3_endpoint, mount_factory, tmp_path):
    client, name = bucket
    data = {f"d/f{i}.bin": random.Random(i).randbytes(50_000 + i * 40_000) for i in range(12)}
    for k, v in data.items():
        client.put_object(Bucket=name, Key=k, Body=v)
    with FaultProxy(s3_endpoint) as proxy:
        # (--list-ahead 0: listings on demand only, none at mount or ahead, so a test here
        # decides which request waits on S3)
        m = proxied_mount(mount_factory, proxy, name, "--retry-deadline", "3s",
                          "--list-ahead", "0")
        yield proxy, m, data


# -- outages ---------------------------------------------------------------------------------
def outage(bucket: Any, s3_endpoint: str, mount_factory: Any, seconds: float,
           *extra: str) -> dict[str, Any]:
    client, name = bucket
    files = dataset(client, name, "warm/", 8, seed=1)
    files.update(dataset(client, name, "cold/", 48, seed=2))
    with FaultProxy(s3_endpoint) as proxy:
        m = proxied_mount(mount_factory, proxy, name, *extra)
        readers = Readers(m.path, files, before=[k for k in files if k.startswith("warm/")])
        readers.start()
        proxy.set_down(True)  # refused connections; open ones reset
        readers.go.set()  # every "cold/" read (and its directory listing) meets the outage
        time.sleep(seconds)
        proxy.set_down(False)
        end = time.monotonic()
        readers.join(seconds + 120)
        stats = readers.stats(fault_end=end)
        stats["retries"] = sum_metric(m, "cachefs_s3_retries_total")
        stats["deadline_exceeded"] = sum_metric(m, "cachefs_s3_deadline_exceeded_total")
        assert_daemon_healthy(m)
    return stats


def test_outage_under_eight_readers_fails_no_read(bucket, s3_endpoint, mount_factory):
    stats = outage(bucket, s3_endpoint, mount_factory, 6, "--retry-deadline", "30s")
    report("outage 6 s, --retry-deadline 30s", stats)
    assert stats["failed"] == 0 and stats["wrong"] == 0, stats
    assert stats["retries"] > 0 and stats["deadline_exceeded"] == 0


@pytest.mark.slow
def test_outage_of_30_s_with_the_default_deadline(bucket, s3_endpoint, mount_factory):
    stats = outage(bucket, s3_endpoint, mount_factory, 30)
    report("outage 30 s (default deadline)", stats)
    assert stats["failed"] == 0 and stats["wrong"] == 0, stats
    assert stats["deadline_exceeded"] == 0


def test_outage_longer_than_the_deadline_becomes_eio_and_the_mount_recovers(proxied):
    proxy, m, data = proxied
    os.listdir(m.path / "d")  # metadata cached; data not yet
    proxy.set_down(True)
    with pytest.raises(OSError) as info:
        (m.path / "d/f3.bin").read_bytes()
    assert info.value.errno == errno.EIO
    assert "retry deadline" in m.log()
    assert sum_metric(m, "cachefs_s3_deadline_exceeded_total") >= 1
    proxy.set_down(False)  # once S3 answers again, the same file reads correctly
    assert (m.path / "d/f3.bin").read_bytes() == data["d/f3.bin"]


def test_a_read_while_s3_is_silent_fails_near_the_deadline_not_twice_past_it(
        bucket, s3_endpoint, mount_factory):
    """S3 accepts the requests and never answers (a hung endpoint). A read failed only
    after twice the deadline and more (22.5 s under --retry-deadline 6s): the kernel asks
    again for a read that failed, which got a deadline of its own, and an attempt (a GET
    and its hedge) ran its own timeouts past the deadline. Now every attempt ends at the
    deadline and the kernel's second request gets a last try of 2 s (LAST_TRY)."""
    client, name = bucket
    data = random.Random(7).randbytes(50_000)
    client.put_object(Bucket=name, Key="s/f.bin", Body=data)
    with FaultProxy(s3_endpoint) as proxy:
        m = proxied_mount(mount_factory, proxy, name, "--retry-deadline", "3s",
                          "--list-ahead", "0")
        os.listdir(m.path / "s")
        proxy.plan = lambda method, path, n: "stall" if method == "GET" else "pass"
        fd = os.open(m.path / "s/f.bin", os.O_RDONLY)
        try:
            with pytest.raises(OSError) as info:
                os.pread(fd, 4096, 0)
        finally:
            os.close(fd)
        assert info.value.errno == errno.EIO
        failed = [line for line in m.log().splitlines() if "read failed" in line]
        # The attempt (and its hedge) cut off at the deadline, not ended by their own
        # silence timeouts; the kernel's second request for the read took a last try.
        assert failed and "no answer by the retry deadline" in failed[0], failed
        assert not any("no byte for" in line for line in failed), failed
        assert any("a last try after giving up moments ago" in line for line in failed), failed
        proxy.plan = lambda method, path, n: "pass"
        assert (m.path / "s/f.bin").read_bytes() == data


def test_a_remount_while_s3_is_down_serves_the_cache(proxied):
    """A daemon restarted (after a crash, the OOM killer) while S3 does not answer: the
    mount used to fail at its first request (the node was left without its mount). Over
    a cache holding this source's listings it comes up, says so, and serves what is
    cached; once S3 answers, the rest reads too."""
    proxy, m, data = proxied
    cached = sorted(data)[:6]
    for key in cached:
        assert (m.path / key).read_bytes() == data[key]
    m.stop()
    proxy.set_down(True)
    m.start()
    assert "mounting from the cache" in m.log()
    for key in cached:
        assert (m.path / key).read_bytes() == data[key]
    proxy.set_down(False)
    for key, expected in data.items():
        assert (m.path / key).read_bytes() == expected


@pytest.mark.parametrize("code", ["503", "500"], ids=["slowdown", "internal-error"])
def test_a_first_mount_rides_out_a_few_throttled_or_failed_answers(bucket, s3_endpoint,
                                                                   mount_factory, code):
    """S3 answers 503 SlowDown and 500 InternalError now and then, more under load (a
    cluster's nodes all mounting at boot): the first such answer to the start-up check
    failed the mount ('cannot read s3://...: throttled (SlowDown)'), though every read
    rides them out. The check now tries again a few times first."""
    client, name = bucket
    client.put_object(Bucket=name, Key="a.bin", Body=b"a" * 1000)
    with FaultProxy(s3_endpoint) as proxy:
        proxy.plan = lambda method, path, n: code if n <= 3 else "pass"
        m = proxied_mount(mount_factory, proxy, name)
        assert proxy.faults[code] == 3
        assert (m.path / "a.bin").read_bytes() == b"a" * 1000


def test_a_first_mount_while_s3_is_down_fails_with_one_clear_line(bucket, s3_endpoint,
                                                                  mount_factory):
    """Without a cache of the source there is nothing to serve: the mount fails, saying why."""
    _, name = bucket
    with FaultProxy(s3_endpoint) as proxy:
        proxy.set_down(True)
        with pytest.raises(AssertionError, match="cannot reach"):
            proxied_mount(mount_factory, proxy, name, "--region", "us-east-1")


def test_cached_data_is_served_while_s3_is_down(proxied):
    proxy, m, data = proxied
    for key, expected in data.items():
        assert (m.path / key).read_bytes() == expected
    proxy.set_down(True)
    gets_before = proxy.counts["GET"]
    for key, expected in data.items():
        assert (m.path / key).read_bytes() == expected
    assert proxy.counts["GET"] == gets_before


# -- throttling --------------------------------------------------------------------------------
def test_slowdown_storm_slows_cachefs_down_and_fails_no_read(bucket, s3_endpoint, mount_factory):
    client, name = bucket
    files = dataset(client, name, "warm/", 8, seed=3)
    files.update(dataset(client, name, "storm/", 48, seed=4))
    after = dataset(client, name, "after/", 48, seed=5)
    storm = {"on": False}
    with FaultProxy(s3_endpoint) as proxy:
        proxy.plan = lambda method, path, n: "503" if storm["on"] else "pass"
        m = proxied_mount(mount_factory, proxy, name, "--max-connections", "16",
                          "--retry-deadline", "60s")
        readers = Readers(m.path, files, before=[k for k in files if k.startswith("warm/")])
        readers.start()
        storm["on"] = True  # every request, listings included, is answered 503 SlowDown
        readers.go.set()
        lowest = 16.0
        t_end = time.monotonic() + 20
        while time.monotonic() < t_end:
            lowest = min(lowest, m.metric("cachefs_s3_concurrency_limit"))
            time.sleep(0.5)
        storm["on"] = False
        end = time.monotonic()
        readers.join(120)
        stats = readers.stats(fault_end=end)
        stats["throttles"] = sum_metric(m, "cachefs_s3_throttles_total")
        stats["lowest_concurrency_limit"] = lowest
        # Once S3 is calm, the limit grows back to --max-connections.
        time.sleep(6)
        more = Readers(m.path, after)
        more.start()
        more.go.set()
        more.join(120)
        stats["concurrency_limit_after"] = m.metric("cachefs_s3_concurrency_limit")
        report("503 SlowDown storm 20 s", stats)
        assert stats["failed"] == 0 and stats["wrong"] == 0, stats
        assert more.stats()["failed"] == 0 and more.stats()["wrong"] == 0
        assert stats["throttles"] > 0 and proxy.faults["503"] > 0
        assert lowest < 16  # throttling lowered the concurrency
        assert stats["concurrency_limit_after"] == 16  # and it recovered
        assert_daemon_healthy(m)


def test_slowdown_and_resets_are_retried(proxied):
    proxy, m, data = proxied
    # Every third GET is throttled and every fifth reset: reads must still be exact.
    proxy.plan = lambda method, path, n: ("503" if n % 3 == 0 else "reset" if n % 5 == 0
                                          else "pass")
    for key, expected in data.items():
        assert (m.path / key).read_bytes() == expected
    assert sum_metric(m, "cachefs_s3_retries_total") > 0
    assert sum_metric(m, "cachefs_s3_throttles_total") > 0
    assert proxy.faults["503"] > 0 and proxy.faults["reset"] > 0


@pytest.mark.parametrize("waits_on", ["listing", "data"])
def test_a_signal_to_a_reader_waiting_on_s3_never_fails_its_read(proxied, waits_on: str):
    # A signal with a handler (a DataLoader's SIGCHLD, a timer) reaching a thread blocked in
    # a request that waits on S3 (an open whose directory is being listed, a read) makes
    # the kernel send FUSE_INTERRUPT for it. cachefs does not interrupt requests: the
    # open and the read must go on and return the exact bytes, never an error.
    proxy, m, data = proxied
    key, expected = next(iter(data.items()))
    throttled = threading.Event()
    throttled.set()

    def plan(method: str, path: str, n: int) -> str:
        listing = "list-type" in path or "prefix=" in path
        if throttled.is_set() and method == "GET" and listing == (waits_on == "listing"):
            return "503"
        return "pass"

    proxy.plan = plan
    if waits_on == "data":
        (m.path / key).stat()  # listed: the read below waits only on its GET
    result: dict[str, Any] = {}

    def read() -> None:
        try:
            result["data"] = (m.path / key).read_bytes()
        except OSError as exc:
            result["error"] = exc

    seen: list[int] = []
    old = signal.signal(signal.SIGUSR1, lambda signum, frame: seen.append(signum))
    try:
        reader = threading.Thread(target=read)
        reader.start()
        deadline = time.monotonic() + 10
        while proxy.faults["503"] < 2 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert proxy.faults["503"] >= 2, "the reader never reached S3"
        for _ in range(3):  # the reader is blocked in the kernel, waiting for the daemon
            assert reader.ident is not None
            signal.pthread_kill(reader.ident, signal.SIGUSR1)
            time.sleep(0.1)
        throttled.clear()
        reader.join(30)
    finally:
        signal.signal(signal.SIGUSR1, old)
    assert not reader.is_alive()
    assert "error" not in result, result.get("error")
    assert result["data"] == expected
    assert_daemon_healthy(m)


@pytest.mark.parametrize("outcome", ["answered", "changed"])
def test_reads_of_a_file_being_fetched_join_its_one_get(bucket, s3_endpoint, mount_factory,
                                                        outcome: str):
    # READs of a one-block file whose GET is under way (here: retried while S3 throttles)
    # join that GET on the request workers, without a hand-over to the trio thread: each
    # is answered once the GET ends -- with its exact bytes, S3 having passed one GET, or,
    # when the object was replaced meanwhile, with ESTALE (never bytes of the new
    # version) -- and the mount goes on.
    client, name = bucket
    data = random.Random(7).randbytes(512 * 1024)
    client.put_object(Bucket=name, Key="one.bin", Body=data)
    held = threading.Event()
    held.set()
    passed = {"n": 0}

    def plan(method: str, path: str, n: int) -> str:
        if method == "GET" and path.split("?")[0].endswith("/one.bin"):
            if held.is_set():
                return "503"
            passed["n"] += 1
        return "pass"

    with FaultProxy(s3_endpoint) as proxy:
        m: Mount = mount_factory(f"s3://{name}", "--block-size", "1M", start=False)
        m.endpoint = proxy.url
        m.start()
        os.listdir(m.path)  # listed: the reads below wait only on the GET
        proxy.plan = plan
        joins = m.metric('cachefs_fuse_handed_over_total{how="joined"}')
        results: dict[int, bytes | int] = {}

        def read(offset: int) -> None:
            try:
                fd = os.open(m.path / "one.bin", os.O_RDONLY)
                try:
                    # No readahead: each reader's READ covers its own pages only (else the
                    # first READ's readahead locks them all and the others wait for it).
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
                    results[offset] = os.pread(fd, 64 * 1024, offset)
                finally:
                    os.close(fd)
            except OSError as exc:
                results[offset] = exc.errno or 0

        offsets = [i * 128 * 1024 for i in range(4)]
        threads = [threading.Thread(target=read, args=(off,)) for off in offsets]
        threads[0].start()  # its READ starts the GET
        deadline = time.monotonic() + 10
        while proxy.faults["503"] < 2 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert proxy.faults["503"] >= 2, "the GET never reached S3"
        for t in threads[1:]:
            t.start()
        time.sleep(0.5)  # the other readers' READs arrive and join the GET
        if outcome == "changed":
            client.put_object(Bucket=name, Key="one.bin", Body=b"new" * 1000)
        held.clear()
        for t in threads:
            t.join(60)
        assert not any(t.is_alive() for t in threads)
        if outcome == "answered":
            assert results == {off: data[off:off + 64 * 1024] for off in offsets}
            assert passed["n"] == 1, "one GET"
        else:
            # (a READ the kernel sends after the failed GET asks again, and fails alike)
            assert results == dict.fromkeys(offsets, errno.ESTALE)
        assert m.metric('cachefs_fuse_handed_over_total{how="joined"}') > joins, \
            "no READ joined the GET on its worker"
        assert_daemon_healthy(m)


# -- stalls, resets, truncation ---------------------------------------------------------------
def test_small_read_behind_a_stalled_answer_completes_through_a_hedge(bucket, s3_endpoint,
                                                                       mount_factory):
    client, name = bucket
    client.put_object(Bucket=name, Key="small.bin", Body=b"s" * 1024)
    stalled = {"n": 0}

    def plan(method: str, path: str, n: int) -> str:
        if method == "GET" and path.endswith("/small.bin") and not stalled["n"]:
            stalled["n"] += 1
            return "stall_body"  # headers, then nothing
        return "pass"

    with FaultProxy(s3_endpoint) as proxy:
        m = proxied_mount(mount_factory, proxy, name)
        os.listdir(m.path)
        proxy.plan = plan
        t0 = time.monotonic()
        assert (m.path / "small.bin").read_bytes() == b"s" * 1024
        took = time.monotonic() - t0
        report("answer stalls after its headers (1 KB read)",
               {"reads": 1, "failed": 0, "wrong": 0, "longest_read_s": round(took, 2),
                "recovery_s": None, "hedges_won": m.metric("cachefs_s3_hedges_won_total")})
        assert stalled["n"] == 1
        assert m.metric("cachefs_s3_hedges_won_total") == 1
        assert took < 15  # a hedge after ~1 s; the idle timeout alone would take 5-30 s
        assert_daemon_healthy(m)


@pytest.mark.parametrize("fault", ["reset", "truncate", "short", "500"])
def test_a_third_of_answers_broken_fails_no_read(bucket, s3_endpoint, mount_factory, fault):
    client, name = bucket
    files = dataset(client, name, "data/", 40, seed=6)
    rnd = random.Random(9)
    with FaultProxy(s3_endpoint) as proxy:
        proxy.plan = lambda method, path, n: fault if rnd.random() < 0.33 else "pass"
        m = proxied_mount(mount_factory, proxy, name, "--retry-deadline", "60s")
        readers = Readers(m.path, files)
        readers.start()
        readers.go.set()
        readers.join(120)
        stats = readers.stats()
        stats["retries"] = sum_metric(m, "cachefs_s3_retries_total")
        report({"reset": "connection resets (1 in 3 requests)",
                "truncate": "bodies cut short, connection closed (1 in 3)",
                "short": "bodies cut short, consistent length (1 in 3)",
                "500": "500 InternalError (1 in 3)"}[fault], stats)
        assert stats["failed"] == 0 and stats["wrong"] == 0, stats
        assert proxy.faults[fault] > 0 and stats["retries"] > 0
        assert_daemon_healthy(m)


# -- unmount during an outage ------------------------------------------------------------------
def _pid(m: Mount) -> int:
    from cachefs.control import registry

    info = registry.lookup(m.path)
    assert info is not None
    return int(info["pid"])


def _wait_gone(pid: int, timeout: float) -> float:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return time.monotonic() - t0
        time.sleep(0.05)
    raise AssertionError(f"daemon {pid} still running after {timeout} s")


def test_sigterm_during_an_outage_ends_blocked_reads_at_once(bucket, s3_endpoint, mount_factory):
    client, name = bucket
    files = dataset(client, name, "cold/", 8, seed=7)
    with FaultProxy(s3_endpoint) as proxy:
        m = proxied_mount(mount_factory, proxy, name)  # the default deadline: minutes
        os.listdir(m.path / "cold")
        pid = _pid(m)
        proxy.set_down(True)
        readers = Readers(m.path, files)
        readers.start()
        readers.go.set()
        time.sleep(2)  # every reader is blocked in a read, retrying
        t0 = time.monotonic()
        os.kill(pid, signal.SIGTERM)  # what systemctl stop does
        took = _wait_gone(pid, 60)
        readers.join(30)
        stats = readers.stats()
        report("SIGTERM during an outage (8 blocked readers)",
               {**stats, "longest_read_s": None, "recovery_s": None,
                "daemon_exit_s": round(took, 2), "reads_ended_s": round(
                    max(r[2] for r in readers.reads) - t0, 2)})
        # Seconds, not the retry deadline (minutes); before the origin stopped requests at
        # SIGTERM this took 19 s here, and minutes at worst.
        assert took < 10, took
        assert stats["wrong"] == 0  # blocked reads fail (the mount is going), never wrong
        assert not is_mounted(m.path)


@pytest.mark.parametrize("fault", ["outage", "throttling"])
def test_unmount_during_an_outage_returns_promptly(bucket, s3_endpoint, mount_factory, fault):
    client, name = bucket
    big = random.Random(8).randbytes(3 << 20)
    client.put_object(Bucket=name, Key="big.bin", Body=big)
    with FaultProxy(s3_endpoint) as proxy:
        m = proxied_mount(mount_factory, proxy, name, "--memory-budget", "64M")
        pid = _pid(m)
        with open(m.path / "big.bin", "rb") as f:  # sequential: readahead runs ahead
            assert f.read(256 << 10) == big[:256 << 10]
            if fault == "outage":  # the prefetches in flight now retry...
                proxy.set_down(True)
            else:
                proxy.plan = lambda method, path, n: "503"
            assert f.read(64 << 10) == big[256 << 10:320 << 10]
        time.sleep(1)
        t0 = time.monotonic()
        proc = run_cachefs("unmount", str(m.path), timeout=120)
        took = time.monotonic() - t0
        assert proc.returncode == 0, proc.stderr
        _wait_gone(pid, 30)
        report(f"unmount during {'an outage' if fault == 'outage' else 'a 503 storm'} "
               "(prefetches retrying)",
               {"reads": 2, "failed": 0, "wrong": 0, "longest_read_s": None,
                "recovery_s": None, "unmount_s": round(took, 2)})
        # Seconds, not the retry deadline (minutes): before, retries slept in worker threads
        # that unmount had to wait for (19 s here during a 503 storm, minutes at worst).
        assert took < 15, took


# -- bytes altered in transit (issue 16) -------------------------------------------------------
def test_altered_bytes_never_reach_whole_object_reads_nor_stay_cached(
        bucket, s3_endpoint, mount_factory, tmp_path):
    import boto3
    import botocore.config

    from tests.conftest import ACCESS_KEY, SECRET_KEY

    client, name = bucket
    # Objects as S3 holds them: single-part uploads (ETag = MD5), some with a full-object
    # checksum (CRC64NVME, S3's default for new objects; CRC32, CRC32C), and multi-block
    # objects with a full-object CRC (checked once all their blocks are cached).
    crc_client = boto3.client(
        "s3", endpoint_url=s3_endpoint, region_name="us-east-1", aws_access_key_id=ACCESS_KEY,
        aws_secret_access_key=SECRET_KEY,
        config=botocore.config.Config(request_checksum_calculation="when_supported"))
    rnd = random.Random(11)
    files: dict[str, bytes] = {}
    for i in range(60):
        key = f"small/{i:03d}.bin"
        files[key] = rnd.randbytes(rnd.choice([3000, 30_000, 60_000]))  # one 64K block
        algorithm = [None, "CRC64NVME", "CRC32", "CRC32C"][i % 4]
        if algorithm:
            crc_client.put_object(Bucket=name, Key=key, Body=files[key],
                                  ChecksumAlgorithm=algorithm)
        else:
            client.put_object(Bucket=name, Key=key, Body=files[key])
    for i in range(12):
        key = f"large/{i:03d}.bin"
        files[key] = rnd.randbytes(rnd.choice([200_000, 500_000]))  # 4-8 blocks
        crc_client.put_object(Bucket=name, Key=key, Body=files[key],
                              ChecksumAlgorithm=["CRC64NVME", "CRC32C", "CRC32"][i % 3])
    cache = tmp_path / "flipcache"
    flip_rnd = random.Random(12)
    with FaultProxy(s3_endpoint) as proxy:
        proxy.plan = lambda method, path, n: "flip" if flip_rnd.random() < 0.10 else "pass"
        m = mount_factory(f"s3://{name}", "--block-size", "64K", "--retry-deadline", "60s",
                          "--passthrough", "off", cache_dir=cache, start=False)
        m.endpoint = proxy.url
        m.start()
        wrong_small = wrong_large = wrong_bytes = 0
        for key, data in files.items():
            got = (m.path / key).read_bytes()
            if got != data:
                wrong_bytes += differing_bytes(got, data)
                if key.startswith("small/"):
                    wrong_small += 1
                else:
                    wrong_large += 1
        flipped = proxy.faults["flip"]
        integrity = sum_metric(m, "cachefs_s3_integrity_errors_total")
        time.sleep(1)  # the last multi-block checks run in the background
        m.stop()
        proxy.plan = lambda method, path, n: "pass"  # the proxy stops altering bytes
        again = mount_factory(f"s3://{name}", "--block-size", "64K", "--passthrough", "off",
                              cache_dir=cache, start=False)
        again.endpoint = proxy.url
        again.start()
        stale = [k for k, data in files.items() if (again.path / k).read_bytes() != data]
        report("8 bytes flipped in 10% of GET bodies (plain HTTP)",
               {"reads": len(files), "failed": 0, "wrong": wrong_small + wrong_large,
                "wrong_whole_object_reads": wrong_small, "wrong_ranged_reads": wrong_large,
                "wrong_bytes": wrong_bytes,
                "bodies_altered": flipped, "integrity_errors": integrity,
                "wrong_after_remount": len(stale), "longest_read_s": None, "recovery_s": None})
        assert flipped > 0 and integrity > 0
        assert wrong_small == 0  # whole-object reads are checked before use
        assert stale == []  # nothing altered stayed cached


# -- any region, any network ---------------------------------------------------------------------
def test_bucket_in_another_region_is_read_without_region(bucket, s3_endpoint, mount_factory):
    client, name = bucket
    files = dataset(client, name, "eu/", 6, seed=13)
    with FaultProxy(s3_endpoint) as proxy:
        proxy.bucket_region = "eu-west-1"  # S3 refuses requests signed for us-east-1
        m = proxied_mount(mount_factory, proxy, name)  # node default: us-east-1, no --region
        for key, data in files.items():
            assert (m.path / key).read_bytes() == data
        assert f"bucket {name} is in eu-west-1" in m.log()
        assert proxy.faults["wrong_region"] >= 1  # the lookup's first request was refused


@pytest.mark.parametrize("redirect", [False, True], ids=["400-malformed", "301-redirect"])
def test_a_shared_tier_in_another_region_than_the_source_is_used(bucket, s3_endpoint,
                                                                  mount_factory, redirect):
    """The tier is in the compute region, the source typically in another; the tier's
    requests were signed for --region (the source's) or the AWS config's: S3 refused
    every one (400 AuthorizationHeaderMalformed, or 301 PermanentRedirect), and the tier
    never served or stored a block, with a log line naming only the error. Without
    --shared-cache-region the tier's client now takes the region S3 names, as the
    source's does."""
    client, name = bucket
    tier = f"tier-{uuid.uuid4().hex[:10]}"
    client.create_bucket(Bucket=tier)
    data = bytes(range(256)) * 500
    client.put_object(Bucket=name, Key="a.bin", Body=data)

    def published() -> int:
        listed = client.list_objects_v2(Bucket=tier, Prefix="cache/").get("Contents", [])
        return sum(1 for o in listed if not o["Key"].startswith("cache/leases/"))

    with FaultProxy(s3_endpoint) as proxy:
        proxy.bucket_region = "eu-west-1"
        proxy.redirect = redirect
        m = mount_factory(f"s3://{name}", "--region", "us-east-1", "--block-size", "64K",
                          "--shared-cache", f"s3://{tier}/cache",
                          "--shared-cache-endpoint-url", proxy.url,
                          "--shared-cache-timeout", "10s")
        assert (m.path / "a.bin").read_bytes() == data
        wait_for(lambda: published() == 2, what="a.bin's blocks in the tier", timeout=30)
        assert "eu-west-1" in m.log()
        assert "refuses writes" not in m.log()


def test_an_endpoint_under_a_path_is_used_whole(bucket, s3_endpoint, mount_factory):
    """An S3-compatible gateway served under a path (--endpoint-url http://gw:9000/s3):
    boto3 (the start-up checks, HEAD) sent to /s3/BUCKET, the lean clients (listings,
    GETs, the shared tier's requests) to /BUCKET, outside the gateway: the mount failed,
    or listed nothing. Every client now keeps the endpoint's path."""
    client, name = bucket
    tier = f"tier-{uuid.uuid4().hex[:10]}"
    client.create_bucket(Bucket=tier)
    data = {f"d/f{i}.bin": bytes([i]) * 100_000 for i in range(3)}
    for key, body in data.items():
        client.put_object(Bucket=name, Key=key, Body=body)

    def published() -> int:
        listed = client.list_objects_v2(Bucket=tier, Prefix="cache/").get("Contents", [])
        return sum(1 for o in listed if not o["Key"].startswith("cache/leases/"))

    with FaultProxy(s3_endpoint) as proxy:
        proxy.path_prefix = "/s3"
        m = mount_factory(f"s3://{name}", "--block-size", "64K", "--shared-cache",
                          f"s3://{tier}/cache", "--shared-cache-endpoint-url",
                          proxy.url + "/s3/", "--shared-cache-timeout", "10s", start=False)
        m.endpoint = proxy.url + "/s3"
        m.start()
        assert sorted(os.listdir(m.path / "d")) == sorted(k[2:] for k in data)
        for key, body in data.items():
            assert (m.path / key).read_bytes() == body
        wait_for(lambda: published() == 6, what="the blocks in the tier", timeout=30)


def test_a_mount_opens_at_most_64_connections_ahead_of_its_reads(bucket, s3_endpoint,
                                                                  mount_factory):
    """At mount, half of --max-connections (256 by default) are opened ahead of the first
    reads, but never more than 64: a fleet of mounts coming up does not make a handshake
    storm across regions."""
    client, name = bucket
    files = dataset(client, name, "pre/", 2, seed=17)
    with FaultProxy(s3_endpoint) as proxy:
        m = proxied_mount(mount_factory, proxy, name)
        deadline = time.monotonic() + 30
        while "ahead of the first reads" not in m.log() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert "opened 64 connection(s) to S3 ahead of the first reads" in m.log()
        # The connections the server sees: the 64 opened ahead (the proxy counts each once
        # its accept loop has taken it), plus at most the few the mount's own requests
        # (bucket region, listing) opened; not the 128 of half the limit.
        while len(proxy._conns) < 64 and time.monotonic() < deadline:
            time.sleep(0.1)
        time.sleep(0.5)  # any connection beyond them would be counted by now
        assert 64 <= len(proxy._conns) <= 70
        for key, data in files.items():
            assert (m.path / key).read_bytes() == data


def test_mount_through_an_http_proxy(bucket, s3_endpoint, mount_factory,
                                     monkeypatch: pytest.MonkeyPatch):
    client, name = bucket
    files = dataset(client, name, "p/", 4, seed=14)
    with ForwardProxy() as fwd:
        monkeypatch.setenv("HTTP_PROXY", fwd.url)
        m = mount_factory(f"s3://{name}", "--block-size", "64K")
        for key, data in files.items():
            assert (m.path / key).read_bytes() == data
        targets = [t for method, t in fwd.seen if method == "GET"]
        assert any(t.endswith("/p/f000.bin") for t in targets)  # the lean GETs
        assert any("list-type=2" in t for t in targets)  # and boto3's listings
        assert "via proxy" in m.log()


def test_credentials_never_reach_the_log(bucket, mount_factory):
    from tests.conftest import ACCESS_KEY, SECRET_KEY

    client, name = bucket
    client.put_object(Bucket=name, Key="k.bin", Body=b"k" * 1000)
    m = mount_factory(f"s3://{name}", "--log-level", "debug")
    assert (m.path / "k.bin").read_bytes() == b"k" * 1000
    log = m.log()
    assert "mounted" in log
    assert SECRET_KEY not in log and ACCESS_KEY not in log


def test_a_password_in_the_endpoint_url_never_reaches_the_log(bucket, s3_endpoint,
                                                              mount_factory):
    """An endpoint URL with a user and password (a gateway behind basic auth) was logged
    whole at every mount ('S3 endpoint http://user:password@host')."""
    client, name = bucket
    client.put_object(Bucket=name, Key="k.bin", Body=b"k" * 1000)
    m = mount_factory(f"s3://{name}", start=False)
    m.endpoint = s3_endpoint.replace("http://", "http://gateway-user:hunter2-pw@")
    m.start()
    assert (m.path / "k.bin").read_bytes() == b"k" * 1000
    log = m.log()
    assert "mounted" in log and "gateway-user" in log
    assert "hunter2-pw" not in log


@contextlib.contextmanager
def small_tmpfs(path: Path, size: str) -> Iterator[Path]:
    """A tmpfs of ``size`` mounted at ``path`` (made here) for the block: a small disk to
    fill. Needs root (the suite's tests that use it skip without)."""
    import subprocess

    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root")
    path.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], check=True)
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def test_full_cache_disk_still_serves_correct_bytes(bucket, mount_factory, tmp_path):
    client, name = bucket
    data = random.Random(5).randbytes(3 << 20)
    client.put_object(Bucket=name, Key="big.bin", Body=data)
    small_at = tmp_path / "smallfs"
    with small_tmpfs(small_at, "4m") as small:
        m = mount_factory(f"s3://{name}", "--block-size", "64K", "--cache-size", "3M",
                          cache_dir=small / "cache")
        (small / "filler").write_bytes(b"\0" * (3 << 20))  # leave well under one MiB free
        assert (m.path / "big.bin").read_bytes() == data
        assert (m.path / "big.bin").read_bytes() == data
        assert m.metric("cachefs_cache_write_errors_total") > 0
        assert "No space left on device" in m.log()
        m.stop()


def test_a_full_cache_disk_is_logged_once_a_minute_not_once_a_block(bucket, mount_factory,
                                                                      tmp_path):
    """A cache disk that stays full fails the write of every block fetched: one log line
    for each (250,000 an epoch of a 1 TB dataset in 4 MiB blocks) buried the log, and by
    default the log is on that same full disk. The first failure is logged, later ones
    are counted and summed up at most once a minute."""
    client, name = bucket
    files = {f"f{i}.bin": random.Random(40 + i).randbytes(1 << 20) for i in range(4)}
    for key, body in files.items():
        client.put_object(Bucket=name, Key=key, Body=body)
    small_at = tmp_path / "smallfs"
    with small_tmpfs(small_at, "4m") as small:
        log_file = tmp_path / "cachefs.log"  # (on a disk with room: every line can land)
        m = mount_factory(f"s3://{name}", "--block-size", "64K", "--cache-size", "3M",
                          "--log-file", str(log_file), cache_dir=small / "cache")
        (small / "filler").write_bytes(b"\0" * (3 << 20))  # leave well under one MiB free
        for key, body in files.items():
            assert (m.path / key).read_bytes() == body
        failed = m.metric("cachefs_cache_write_errors_total")
        assert failed >= 40  # most of the 64 blocks found no room
        lines = [line for line in log_file.read_text().splitlines()
                 if "cannot write block to the cache" in line]
        assert len(lines) == 1, lines[:5]
        assert "No space left on device" in lines[0]
        m.stop()


def test_a_cache_disk_filled_by_something_else_still_lists_and_reads(bucket, mount_factory,
                                                                       tmp_path):
    """Another program fills the cache's file system: directories not listed yet must
    still list, and their files read from S3. Every new listing's commit failed with
    ENOSPC, and every lookup in an unlisted directory with it (EIO): the index now keeps
    disk allocated ahead to grow into (LmdbEnv.keep_reserve)."""
    client, name = bucket
    data = {f"{d}/f{i}.bin": random.Random(i).randbytes(20_000) for d in "abc" for i in range(3)}
    for key, body in data.items():
        client.put_object(Bucket=name, Key=key, Body=body)
    small_at = tmp_path / "smallfs"
    with small_tmpfs(small_at, "48m") as small:
        m = mount_factory(f"s3://{name}", "--block-size", "64K", "--cache-size", "16M",
                          "--list-ahead", "0", cache_dir=small / "cache")
        assert sorted(os.listdir(m.path / "a")) == ["f0.bin", "f1.bin", "f2.bin"]
        with open(small / "filler", "wb") as filler:  # until the file system is full
            try:
                while True:
                    filler.write(b"\0" * (1 << 20))
                    filler.flush()
            except OSError as exc:
                assert exc.errno == errno.ENOSPC
        for d in "bc":  # listed only now, with no space left but the index's own
            assert sorted(os.listdir(m.path / d)) == ["f0.bin", "f1.bin", "f2.bin"]
        for key, body in data.items():
            assert (m.path / key).read_bytes() == body
        m.stop()


def test_mount_refuses_a_cache_dir_on_a_full_disk(bucket, tmp_path, s3_endpoint):
    _, name = bucket
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    with small_tmpfs(tmp_path / "fullfs", "1m") as small:
        (small / "cache").mkdir()
        try:
            (small / "filler").write_bytes(b"\0" * (2 << 20))
        except OSError:
            pass  # the disk is now full
        proc = run_cachefs("mount", f"s3://{name}", str(mnt), "--cache-dir", str(small / "cache"),
                           "--cache-size", "512K", "--block-size", "64K", "--endpoint-url", s3_endpoint)
        assert proc.returncode != 0
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and "No space left on device" in lines[0], proc.stderr
        assert not is_mounted(mnt)


def test_credentials_rotated_in_the_credentials_file_are_used_without_a_restart(
        bucket, s3_endpoint, mount_factory, tmp_path, monkeypatch):
    """Temporary credentials written into the shared credentials file by a refresher (a
    cron job with aws sts, saml2aws, a cluster's own tool) replace the expiring ones in
    place. The daemon kept signing with the ones it read at mount: once S3 stopped taking
    them, every read of what was not cached failed with EACCES until a restart. Now a
    changed file is read again before the next request."""
    client, name = bucket
    for i in range(2):
        client.put_object(Bucket=name, Key=f"d/f{i}.bin", Body=bytes([i]) * 70_000)
    creds = tmp_path / "credentials"
    creds.write_text("[default]\naws_access_key_id = OLDKEY\naws_secret_access_key = s1\n")
    for var in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.delenv(var)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(creds))
    with FaultProxy(s3_endpoint) as proxy:
        proxy.accepted_keys = {"OLDKEY"}
        # (--list-ahead 0: nothing is listed or fetched but what the reads below ask for,
        # so no request is in flight while the credentials change)
        m = proxied_mount(mount_factory, proxy, name, "--list-ahead", "0")
        assert proxy.counts["GET"] + proxy.counts["HEAD"] > 0  # the mount's, with OLDKEY
        creds.write_text("[default]\naws_access_key_id = NEWKEY\naws_secret_access_key = s2\n")
        proxy.accepted_keys = {"NEWKEY"}
        for i in range(2):
            assert (m.path / "d" / f"f{i}.bin").read_bytes() == bytes([i]) * 70_000
        assert proxy.faults["unknown_key"] == 0
        assert "the AWS credentials file changed" in m.log()



def test_credentials_rotated_in_the_credentials_file_reach_the_shared_tier(
        bucket, s3_endpoint, mount_factory, tmp_path, monkeypatch):
    """The same renewal as above, seen by the shared tier's client: it kept the credentials
    it read at mount, so once the tier stopped taking them every tier request failed, the
    breaker sent every read to the origin and no block was published again until a
    restart. Its client now reads a changed file again as the origin's does."""
    client, name = bucket
    tier = f"tier-{uuid.uuid4().hex[:10]}"
    client.create_bucket(Bucket=tier)
    data = {f"d/f{i}.bin": bytes([i]) * 70_000 for i in range(2)}
    for key, body in data.items():
        client.put_object(Bucket=name, Key=key, Body=body)
    creds = tmp_path / "credentials"
    creds.write_text("[default]\naws_access_key_id = OLDKEY\naws_secret_access_key = s1\n")
    for var in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.delenv(var)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(creds))

    def published() -> int:  # blocks in the tier (their names are hashes)
        listed = client.list_objects_v2(Bucket=tier, Prefix="cache/").get("Contents", [])
        return sum(1 for o in listed if not o["Key"].startswith("cache/leases/"))

    with FaultProxy(s3_endpoint) as proxy:
        proxy.accepted_keys = {"OLDKEY"}
        m = mount_factory(f"s3://{name}", "--block-size", "64K", "--list-ahead", "0",
                          "--shared-cache", f"s3://{tier}/cache",
                          "--shared-cache-endpoint-url", proxy.url,
                          "--shared-cache-timeout", "10s")
        assert (m.path / "d/f0.bin").read_bytes() == data["d/f0.bin"]
        wait_for(lambda: published() == 2, what="f0.bin's blocks in the tier")
        creds.write_text("[default]\naws_access_key_id = NEWKEY\naws_secret_access_key = s2\n")
        proxy.accepted_keys = {"NEWKEY"}
        assert (m.path / "d/f1.bin").read_bytes() == data["d/f1.bin"]
        # (a request of f0's signed before the change may still meet the new key: what
        # counts is that f1's blocks, fetched after it, reach the tier)
        wait_for(lambda: published() == 4, what="f1.bin's blocks in the tier", timeout=30)
        assert "the AWS credentials file changed" in m.log()


def test_a_listing_whose_continuation_token_repeats_ends_with_an_error(bucket, s3_endpoint,
                                                                      mount_factory):
    """An S3-compatible server that answers a folder's listing with the same continuation
    token again (a server bug; botocore's paginators refuse it) had cachefs list that
    folder for ever: the same page again and again, written into the index, and the
    lookups in it waiting on a listing that never ended. It now fails that listing (EIO,
    logged) after the token repeats; the other folders are served."""
    client, name = bucket
    for i in range(3):
        client.put_object(Bucket=name, Key=f"loop/f{i}", Body=b"%d" % i)
    client.put_object(Bucket=name, Key="ok/g", Body=b"fine")
    lists = 0

    def plan(method: str, path: str, n: int) -> str:
        nonlocal lists
        if "list-type=2" in path and "prefix=loop%2F" in path:
            lists += 1
            return "relist"
        return "pass"

    with FaultProxy(s3_endpoint) as proxy:
        proxy.plan = plan
        m = proxied_mount(mount_factory, proxy, name, "--list-ahead", "0",
                          "--retry-deadline", "5s")
        assert (m.path / "ok/g").read_bytes() == b"fine"
        result: dict[str, Any] = {}

        def walk() -> None:
            try:
                result["names"] = sorted(os.listdir(m.path / "loop"))
            except OSError as exc:
                result["errno"] = exc.errno

        t = threading.Thread(target=walk, daemon=True)
        t.start()
        t.join(30)
        assert not t.is_alive(), f"the listing never ended ({lists} pages asked)"
        assert result.get("errno") == errno.EIO, result
        assert lists < 10, f"{lists} pages asked"
        assert (m.path / "ok/g").read_bytes() == b"fine"
        assert "continuation token" in m.log() and "Traceback" not in m.log()
