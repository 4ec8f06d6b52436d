"""The read-back in the background under stress, on real mounts: large files cached by an
earlier daemon read back while their blocks are evicted, while they are replaced in S3,
and while the daemon stops.

A file over ``MAX_OBJECT_BYTES`` (lowered for the daemon through
``CACHEFS_TEST_MAX_OBJECT_BYTES``, so that a few 64 KiB blocks are "large") cached by an
earlier daemon is read back by one thread in the background after an open finds it so
(:meth:`cachefs.passthrough.Passthrough.read_back`). The thread is held at a block of
its read-back (failpoint ``readback.block``) while the racing event happens -- a small
cache filled with other files (the read-back's pin yields: its blocks are evicted under
it), a new version of the object put in S3 (listings renewed every second), the daemon
stopped -- then let go, while reader threads open and read the large files and the
filler files the whole time. What must hold: every byte read is the bytes of the one
version its open pinned (or the read fails with ESTALE, the version replaced), no block
is found corrupt, nothing fails its check, the daemon logs no traceback, and it unmounts
and exits cleanly -- also when stopped with the read-back held mid-file.
"""

from __future__ import annotations

import errno
import json
import os
import random
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from cachefs import passthrough
from cachefs.control import registry
from cachefs.fuse import native
from tests.conftest import daemon_holds, is_mounted, run_cachefs
from tests.versiontags import UNIT, VersionTags

pytestmark = [pytest.mark.fuse, pytest.mark.slow]

BLOCK = 64 * 1024
LARGE = 3  # large files, big/f{i}.bin
FILLERS = 6  # filler files, fill/g{j}.bin, 5 blocks each: more than the cache holds
CACHE = 2 << 20
VERIFIED = 'cachefs_passthrough_read_backs_total{outcome="verified"}'
GONE = 'cachefs_passthrough_read_backs_total{outcome="gone"}'
POINT = "readback.block"  # (the read-back held at a block)
FAILED = 'cachefs_passthrough_read_backs_total{outcome="failed"}'


def units_of(version: int) -> int:
    """6 blocks and a part (over the lowered bound of 4 blocks); the length differs
    between versions, so a length from another version cannot pass as this one's."""
    return 6 * BLOCK // UNIT + 1 + (version * 389) % 512


_TAGS = VersionTags(units_of)
tagged = _TAGS.tagged
classify = _TAGS.classify


def _filler(j: int) -> bytes:
    return random.Random(1000 + j).randbytes(5 * BLOCK + 11)


def _read_whole(path: Path, drop: bool) -> bytes:
    """One open, 64 KiB reads to the end (the page cache dropped first, so that the reads
    reach the daemon, the native loop or the cache file)."""
    parts = []
    fd = os.open(path, os.O_RDONLY)
    try:
        if drop:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        while chunk := os.read(fd, BLOCK):
            parts.append(chunk)
    finally:
        os.close(fd)
    return b"".join(parts)


class Readers:
    """Threads opening and reading the large and the filler files until stopped, checking
    every byte: outcomes counted ("ok", "estale"; anything else is a failure)."""

    def __init__(self, root: Path, threads: int = 2) -> None:
        self.root = root
        self.outcomes: Counter[str] = Counter()
        self.failures: list[str] = []
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._run, args=(t,)) for t in range(threads)]
        for t in self._threads:
            t.start()

    def _run(self, seed: int) -> None:
        rng = random.Random(seed)
        while not self._stop.is_set():
            try:
                if rng.random() < 0.6:
                    f = rng.randrange(LARGE)
                    try:
                        got = classify(_read_whole(self.root / "big" / f"f{f}.bin",
                                                   rng.random() < 0.7), f)
                    except OSError as exc:
                        if exc.errno != errno.ESTALE:
                            raise
                        got = "estale"
                else:
                    j = rng.randrange(FILLERS)
                    same = _read_whole(self.root / "fill" / f"g{j}.bin", True) == _filler(j)
                    got = "ok" if same else f"filler g{j} wrong"
            except Exception as exc:  # reported by the test
                got = f"{type(exc).__name__}: {exc}"
            with self._lock:
                self.outcomes[got] += 1
                if got not in ("ok", "estale"):
                    self.failures.append(got)

    def stop(self) -> Counter[str]:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=120)
        assert not any(t.is_alive() for t in self._threads), "a reader is stuck"
        assert not self.failures, (self.failures[:10], self.outcomes)
        assert self.outcomes["ok"] > 0
        return self.outcomes


def _wait(what: Any, timeout: float = 60.0, message: str = "") -> None:
    deadline = time.monotonic() + timeout
    while not what():
        assert time.monotonic() < deadline, message or f"waited {timeout} s"
        time.sleep(0.02)


def _daemon_pid(mp: Path) -> int:
    proc = run_cachefs("status", "--json", str(mp))
    assert proc.returncode == 0, proc.stderr
    return int(json.loads(proc.stdout)["pid"])


def _checked(m: Any) -> dict[str, float]:
    """The daemon's counters say nothing was found corrupt and no read-back failed."""
    metrics = m.metrics()
    assert metrics["cachefs_cache_corrupt_blocks_total"] == 0
    assert metrics.get(FAILED, 0) == 0
    return metrics


def _restart_with_large_files_cached(m: Any) -> None:
    """Every large file cached whole (by this daemon: read), then a new daemon (which finds
    them cached without the marks of their writing: its opens queue their read-back)."""
    for f in range(LARGE):
        assert classify(_read_whole(m.path / "big" / f"f{f}.bin", True), f) == "ok"
    _checked(m)
    m.stop()
    assert not is_mounted(m.path)
    m.start()


@pytest.mark.parametrize("reader", ["kernel", "native"])
def test_a_read_back_under_eviction_a_new_version_and_a_stop(
        bucket: Any, mount_factory: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        reader: str) -> None:
    if reader == "kernel" and not passthrough.supported():
        pytest.skip("FUSE passthrough needs Linux >= 6.9")
    if reader == "native" and not native.AVAILABLE:
        pytest.skip("cachefs was built without the native request loop")
    client, name = bucket
    for f in range(LARGE):
        client.put_object(Bucket=name, Key=f"big/f{f}.bin", Body=tagged(1, f))
    for j in range(FILLERS):
        client.put_object(Bucket=name, Key=f"fill/g{j}.bin", Body=_filler(j))
    monkeypatch.setenv("CACHEFS_TEST_MAX_OBJECT_BYTES", str(4 * BLOCK))
    holds = daemon_holds(tmp_path, monkeypatch, POINT)
    m = mount_factory(f"s3://{name}", "--block-size", "64K", "--cache-size", str(CACHE),
                      "--cache-policy", "lru", "--metadata-ttl", "1s",
                      *(["--passthrough", "off"] if reader == "native" else []))
    outcomes: Counter[str] = Counter()

    # 1. Blocks evicted under the read-back: the cache filled with the filler files.
    _restart_with_large_files_cached(m)
    holds.hold(POINT, forget=True)
    readers = Readers(m.path)
    holds.wait(POINT, timeout=60)  # (a reader's open queued a large file; its read-back is held)
    for j in list(range(FILLERS)) * 2:
        assert _read_whole(m.path / "fill" / f"g{j}.bin", True) == _filler(j)
    holds.release(POINT)
    _wait(lambda: m.metric(GONE) + m.metric(VERIFIED) >= 1)
    time.sleep(1)  # (the readers go on: read-backs queued again, given up or passed)
    outcomes += readers.stop()
    metrics = _checked(m)
    print(f"\nevicted: read-backs gone {metrics.get(GONE, 0)}, "
          f"verified {metrics.get(VERIFIED, 0)}")

    # 2. A new version of a large file put in S3 under the read-back of the old one.
    _restart_with_large_files_cached(m)
    holds.hold(POINT, forget=True)
    readers = Readers(m.path)
    holds.wait(POINT, timeout=60)
    for f in range(LARGE):
        client.put_object(Bucket=name, Key=f"big/f{f}.bin", Body=tagged(2, f))
    for f in range(LARGE):
        _wait(lambda f=f: os.stat(m.path / "big" / f"f{f}.bin").st_size  # type: ignore[misc]
              == units_of(2) * UNIT, message="the new version is not listed")
    time.sleep(1)  # (the readers read the new versions while the old one is read back)
    holds.release(POINT)
    _wait(lambda: m.metric(GONE) + m.metric(VERIFIED) >= 1)
    time.sleep(1)
    outcomes += readers.stop()
    for f in range(LARGE):
        assert _read_whole(m.path / "big" / f"f{f}.bin", True) == tagged(2, f)
    metrics = _checked(m)
    print(f"replaced: read-backs gone {metrics.get(GONE, 0)}, "
          f"verified {metrics.get(VERIFIED, 0)}")

    # 3. The daemon stopped while the read-back is held mid-file: it ends cleanly once the
    # thread is let go (the stop makes the read-back give up at its next block).
    _restart_with_large_files_cached(m)
    holds.hold(POINT, forget=True)
    readers = Readers(m.path)
    holds.wait(POINT, timeout=60)
    time.sleep(0.5)
    outcomes += readers.stop()
    _checked(m)
    pid = _daemon_pid(m.path)
    stopping = threading.Thread(target=m.stop)
    stopping.start()
    time.sleep(1)  # (the unmount is under way; the daemon joins its threads)
    holds.release(POINT)
    stopping.join(timeout=120)
    assert not stopping.is_alive()
    assert not is_mounted(m.path), "the mount was left behind"
    _wait(lambda: not registry.pid_alive(pid), message="the daemon did not end")
    log = m.log()
    assert "Traceback" not in log, log[-6000:]
    print(f"readers: {dict(outcomes)}")
