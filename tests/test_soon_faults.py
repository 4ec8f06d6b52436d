"""Cold directory walks of many small files under S3 faults (the GETs driven by callbacks).

A cold one-block file that a directory walk's lookahead loads ahead is fetched with
:meth:`cachefs.s3.origin.Origin.get_soon` (no task per GET). These tests walk hundreds of
such files in several folders with several reader threads through a real mount, while the
fault proxy (tests/faultproxy.py) throttles, fails, resets or stalls S3's answers, and
check that every byte read is right or the read fails with a clear errno, that the
daemon's log has no traceback, and that the mount's gauges come back to 0 when idle.
"""

from __future__ import annotations

import errno
import os
import random
import signal
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import is_mounted
from tests.faultproxy import FaultProxy
from tests.test_faults import _pid, _wait_gone, proxied_mount, sum_metric, wait_for

pytestmark = pytest.mark.fuse


def small_files(client: Any, name: str, folders: int, per_folder: int,
                seed: int = 0) -> dict[str, bytes]:
    """``folders`` x ``per_folder`` objects of 1-40 KB (one 64K block each)."""
    rnd = random.Random(seed)
    files = {}
    for d in range(folders):
        for i in range(per_folder):
            key = f"w/d{d}/f{i:03d}.bin"
            files[key] = rnd.randbytes(rnd.randint(1000, 40_000))
            client.put_object(Bucket=name, Key=key, Body=files[key])
    return files


class Walk:
    """Reader threads that each walk folders in directory order, reading every file whole."""

    def __init__(self, root: Path, files: dict[str, bytes], readers: int = 4) -> None:
        self.root = root
        self.files = files
        folders = sorted({k.rsplit("/", 1)[0] for k in files})
        self.parts = [folders[i::readers] for i in range(readers)]
        self.new: dict[str, bytes] = {}  # (an object's bytes once overwritten)
        self.reads: list[tuple[str, int | None, bool]] = []
        self._lock = threading.Lock()
        self.threads = [threading.Thread(target=self._run, args=(p,), daemon=True)
                        for p in self.parts]

    def _run(self, folders: list[str]) -> None:
        for folder in folders:
            try:
                entries = sorted(os.listdir(self.root / folder))
            except OSError:
                return  # (the mount is gone)
            for entry in entries:
                key = f"{folder}/{entry}"
                code, right = None, False
                try:
                    with open(self.root / key, "rb") as f:
                        got = f.read()
                        right = got in (self.files[key], self.new.get(key))
                except OSError as exc:
                    code = exc.errno
                with self._lock:
                    self.reads.append((key, code, right))

    def start(self) -> Walk:
        for t in self.threads:
            t.start()
        return self

    def join(self, timeout: float) -> None:
        end = time.monotonic() + timeout
        for t in self.threads:
            t.join(max(0.0, end - time.monotonic()))
        assert not any(t.is_alive() for t in self.threads), "readers still blocked"

    @property
    def wrong(self) -> list[str]:
        return [k for k, code, right in self.reads if code is None and not right]

    @property
    def errnos(self) -> set[int]:
        return {code for _, code, _ in self.reads if code is not None}


def assert_idle(m: Any) -> None:
    """The daemon's gauges of work in flight come back to 0, its log has no traceback."""
    def idle() -> bool:
        got = m.metrics()
        return (got.get("cachefs_inflight_fetches", 0) == 0
                and got.get("cachefs_inflight_bytes", 0) == 0)
    wait_for(idle, what="idle gauges", timeout=30)
    assert "Traceback" not in m.log()


def index(path: str) -> int:
    """The number of a file of :func:`small_files` from its request path."""
    return int(path[-7:-4])


def walk_mount(mount_factory: Any, proxy: FaultProxy, name: str, *extra: str) -> Any:
    """A mount through ``proxy`` whose folders are listed (the walk's GETs are all data)."""
    m = proxied_mount(mount_factory, proxy, name, *extra)
    for folder in sorted({f"w/d{d}" for d in range(4)}):
        os.listdir(m.path / folder)
    return m


@pytest.mark.slow
def test_a_cold_walk_throttled_with_few_connections_reads_every_byte(bucket, s3_endpoint,
                                                                      mount_factory):
    """503 SlowDown to every GET past each folder's first files for 4 s, with 4
    connections and a 1 MiB memory budget: the lookahead's loads wait for a connection
    (as tasks in the limiter, get_soon refusing while none is free), are throttled,
    retried, and every file reads whole; the gauges of work in flight come back to 0."""
    client, name = bucket
    files = small_files(client, name, 4, 40)
    storm = {"on": True}
    with FaultProxy(s3_endpoint) as proxy:
        m = walk_mount(mount_factory, proxy, name, "--max-connections", "4",
                       "--memory-budget", "1M", "--retry-deadline", "60s")
        proxy.plan = lambda method, path, n: (
            "503" if storm["on"] and method == "GET" and "?" not in path and index(path) >= 4
            else "pass")
        walk = Walk(m.path, files).start()
        time.sleep(4)
        storm["on"] = False
        walk.join(120)
        assert len(walk.reads) == len(files) and not walk.errnos and not walk.wrong
        assert proxy.faults["503"] > 0 and sum_metric(m, "cachefs_s3_throttles_total") > 0
        assert_idle(m)


@pytest.mark.slow
def test_a_cold_walk_whose_answers_start_late_is_answered_by_hedges(bucket, s3_endpoint,
                                                                    mount_factory):
    """One GET in twelve answers its first byte 3 s late: the watcher of the GETs driven by
    callbacks sends their hedges after the hedge delay (1 s), the hedges win, no GET
    times out, and every file reads whole."""
    client, name = bucket
    files = small_files(client, name, 4, 40)
    rnd = random.Random(5)
    with FaultProxy(s3_endpoint) as proxy:
        m = walk_mount(mount_factory, proxy, name)

        def plan(method: str, path: str, n: int) -> str:
            if method == "GET" and "?" not in path and rnd.random() < 1 / 12:
                time.sleep(3)  # (in the proxy's thread for this request: a late first byte)
            return "pass"
        proxy.plan = plan
        walk = Walk(m.path, files).start()
        walk.join(120)
        assert len(walk.reads) == len(files) and not walk.errnos and not walk.wrong
        assert m.metric("cachefs_s3_hedges_won_total") > 0
        assert m.metric('cachefs_s3_retries_total{op="get",reason="timeout"}') == 0
        assert_idle(m)


def test_objects_overwritten_mid_walk_read_whole_or_fail_estale(bucket, s3_endpoint,
                                                                mount_factory):
    """Every third object is overwritten while a cold walk's lookahead loads them: each
    read is one whole version, old or new, or fails ESTALE; never bytes of both."""
    client, name = bucket
    files = small_files(client, name, 4, 40)
    with FaultProxy(s3_endpoint) as proxy:
        m = walk_mount(mount_factory, proxy, name)
        walk = Walk(m.path, files)
        rnd = random.Random(11)
        walk.start()
        for key in sorted(files)[::3]:
            walk.new[key] = new = rnd.randbytes(len(files[key]))
            client.put_object(Bucket=name, Key=key, Body=new)
        walk.join(120)
        assert len(walk.reads) == len(files) and not walk.wrong
        assert walk.errnos <= {errno.ESTALE}, walk.errnos
        assert_idle(m)


def test_sigterm_with_a_walks_gets_in_flight_exits_at_once(bucket, s3_endpoint,
                                                           mount_factory):
    """SIGTERM while a cold walk's lookahead has ~100 GETs driven by callbacks in flight
    (S3 silent to them) and readers wait on them: the daemon is gone in seconds, its log
    has no traceback, and no read returns wrong bytes (the waiting ones fail)."""
    client, name = bucket
    files = small_files(client, name, 4, 40)
    with FaultProxy(s3_endpoint) as proxy:
        m = walk_mount(mount_factory, proxy, name)
        proxy.plan = lambda method, path, n: (
            "stall" if method == "GET" and "?" not in path and index(path) >= 6 else "pass")
        pid = _pid(m)
        walk = Walk(m.path, files).start()
        wait_for(lambda: m.metric("cachefs_inflight_fetches") >= 80, what="GETs in flight",
                 timeout=30)
        os.kill(pid, signal.SIGTERM)
        assert _wait_gone(pid, 30) < 10
        walk.join(30)
        assert not walk.wrong and not is_mounted(m.path)
        assert walk.errnos <= {errno.EIO, errno.ENOENT, errno.ENOTCONN}, walk.errnos
        assert "Traceback" not in m.log()
