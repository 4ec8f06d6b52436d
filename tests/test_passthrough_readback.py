"""Read-back in the background, on real mounts: a large file cached by an earlier daemon.

A file too large to be read back at its open (over ``MAX_OBJECT_BYTES``, lowered here
for the daemon through ``CACHEFS_TEST_MAX_OBJECT_BYTES`` so that a few blocks are
"large") is registered for reads without the daemon only when this daemon wrote every
block of it (written marks). After a restart those marks are gone: the open that finds
it so is served by the daemon and queues the file for one read-back in the background
(:meth:`cachefs.passthrough.Passthrough.read_back`). What is checked: once it passed, the
next open is passed through to the kernel (or bound to the native loop without
passthrough), reading nothing from S3; a corrupt block the read-back finds is dropped,
counted and fetched again when read, never served, and the file is passed through once
it is whole again and read back again. Like ``tests/test_passthrough.py``, these need
Linux >= 6.9 and root, and the native loop's variant a build with it.
"""

from __future__ import annotations

import random
import time
from pathlib import Path
from typing import Any

import pytest

from cachefs import metrics, passthrough
from cachefs.cache.blocks import block_id, split_block_id
from cachefs.fuse import native
from cachefs.passthrough import Passthrough
from cachefs.read.fetcher import ObjectVersion
from cachefs.read.prefetcher import PrefetchLedger
from tests.conftest import drop_page_cache as _drop_page_cache
from tests.conftest import read_unbuffered as _read
from tests.test_blockcache import Cache, corrupt_count, data

mounted = [pytest.mark.fuse,
           pytest.mark.skipif(not passthrough.supported(),
                              reason="FUSE passthrough needs Linux >= 6.9")]

BLOCK = 64 * 1024
KEY = "shards/big.tar"
OPENS = "cachefs_passthrough_opens_total"
VERIFIED = 'cachefs_passthrough_read_backs_total{outcome="verified"}'
FAILED = 'cachefs_passthrough_read_backs_total{outcome="failed"}'


@pytest.fixture
def large(bucket: Any, monkeypatch: pytest.MonkeyPatch) -> tuple[str, bytes]:
    """A file of 6 blocks and a bit, over the daemon's bound of 4 blocks: (bucket, bytes)."""
    client, name = bucket
    data = random.Random(24).randbytes(6 * BLOCK + 777)
    client.put_object(Bucket=name, Key=KEY, Body=data)
    monkeypatch.setenv("CACHEFS_TEST_MAX_OBJECT_BYTES", str(4 * BLOCK))
    return name, data


def _mount(mount_factory: Any, name: str, reader: str) -> Any:
    if reader == "native" and not native.AVAILABLE:
        pytest.skip("cachefs was built without the native request loop")
    mode = ["--passthrough", "off"] if reader == "native" else []
    return mount_factory(f"s3://{name}", "--block-size", "64K", *mode)


def _wait_metric(m: Any, metric: str, value: float) -> None:
    deadline = time.monotonic() + 60
    while m.metric(metric) != value:
        assert time.monotonic() < deadline, f"{metric} stayed {m.metric(metric)}, not {value}"
        time.sleep(0.05)


@pytest.mark.drops_caches
@pytest.mark.parametrize("reader", ["kernel", "native"])
@mounted[0]
@mounted[1]
def test_a_large_file_cached_by_an_earlier_daemon_is_read_back_and_passed_through(large, mount_factory, reader) -> None:  # type: ignore[no-untyped-def]
    name, data = large
    m = _mount(mount_factory, name, reader)
    path = m.path / KEY
    assert _read(path) == data  # cold: this daemon writes every block (written marks)
    _drop_page_cache()
    assert _read(path) == data
    assert m.metric(OPENS) == 1, "a large file this daemon wrote is registered"
    m.stop()
    m.start()  # a new daemon: the marks are gone, and the file is too large to read back
    _drop_page_cache()
    assert _read(path) == data
    assert m.metric('cachefs_passthrough_declined_total{reason="size"}') >= 1
    _wait_metric(m, VERIFIED, 1)  # ... so that open queued it for the read-back
    opens = m.metric(OPENS)
    read = m.metric("cachefs_read_bytes_total")
    _drop_page_cache()
    assert _read(path) == data
    metrics = m.metrics()
    assert metrics[OPENS] == opens + 1, "the open after the read-back is not registered"
    if reader == "kernel":
        assert metrics["cachefs_read_bytes_total"] == read, "reads reached the daemon"
    assert metrics['cachefs_s3_requests_total{op="get"}'] == 0
    assert metrics["cachefs_cache_corrupt_blocks_total"] == 0
    assert metrics.get(FAILED) == 0


@pytest.mark.drops_caches
@pytest.mark.parametrize("reader", ["kernel", "native"])
@mounted[0]
@mounted[1]
def test_a_corrupt_block_found_by_the_read_back_is_never_served(large, mount_factory, reader) -> None:  # type: ignore[no-untyped-def]
    name, data = large
    m = _mount(mount_factory, name, reader)
    path = m.path / KEY
    assert _read(path) == data
    m.corrupt_cache_file(3 * BLOCK + 9)  # a new daemon; one flipped bit in the 4th block
    _drop_page_cache()
    with open(path, "rb"):
        pass  # nothing read: the open only queues the read-back
    _wait_metric(m, FAILED, 1)
    metrics = m.metrics()
    assert metrics["cachefs_cache_corrupt_blocks_total"] == 1, "the read-back found it"
    assert metrics['cachefs_s3_requests_total{op="get"}'] == 0
    assert metrics.get(VERIFIED) == 0 and metrics.get(OPENS) == 0
    assert _read(path) == data  # the dropped block is fetched again, never served
    assert m.gets() == 1, "only the bad block is fetched"
    # Whole again (one block written by this daemon): an open queues another read-back
    # (with the native loop, the bind tried at a READ above may have queued it already).
    with open(path, "rb"):
        pass
    _wait_metric(m, VERIFIED, 1)
    opens = m.metric(OPENS)
    _drop_page_cache()
    assert _read(path) == data
    assert m.metric(OPENS) == opens + 1
    assert m.gets() == 1 and m.metric("cachefs_cache_corrupt_blocks_total") == 1


# -- unit tests: Passthrough.read_back on a real block cache -----------------------------
UBLOCK = 4096
INO = 42


class _Fetcher:
    def __init__(self, bids: list[bytes]) -> None:
        self.bids = bids

    def object_id(self, obj: ObjectVersion) -> bytes:
        return split_block_id(self.bids[0])[0]

    def block_ids(self, obj: ObjectVersion) -> list[bytes]:
        return list(self.bids)

    def is_loading(self, bid: bytes) -> bool:
        return False


class _Device:
    def backing_open(self, fd: int) -> int:
        return 7

    def backing_close(self, backing_id: int) -> None:
        pass


def _outcome(outcome: str) -> float:
    return metrics.REGISTRY.get_sample_value("cachefs_passthrough_read_backs_total",
                                             {"outcome": outcome}) or 0.0


@pytest.fixture
def cached(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    """An object of 4 blocks cached by an earlier daemon (no written marks), larger than
    an open reads back: (passthrough, cache, block ids, object)."""
    monkeypatch.setattr(passthrough, "MAX_OBJECT_BYTES", 2 * UBLOCK)
    c = Cache(tmp_path / "cache", 10 * UBLOCK)
    bids = [block_id("bucket", "big", "e", UBLOCK, i) for i in range(4)]
    for i, b in enumerate(bids):
        assert c.put(b, data(i))
    c.reopen()  # a new daemon
    p = Passthrough(_Fetcher(bids), c.cache, PrefetchLedger(),  # type: ignore[arg-type]
                    enabled=True)
    p.wanted = True
    p.attach_device(_Device())
    yield p, c, bids, ObjectVersion("big", "e", 4 * UBLOCK)
    c.env.close()


def test_an_open_declined_for_its_size_queues_one_read_back_then_opens_register(cached) -> None:  # type: ignore[no-untyped-def]
    p, _, _, obj = cached
    assert p.open(INO, obj) == 0  # served by the daemon: too large to read back now
    assert p.open(INO, obj) == 0  # (the inode has a handle served by the daemon)
    assert list(p._read_backs.values()) == [obj], "queued once"
    p.release(INO, 0)
    p.release(INO, 0)
    assert p.open(INO, obj) == 0, "still untrusted: declined again"
    p.release(INO, 0)
    assert len(p._read_backs) == 1
    assert p.read_back(p._read_backs.popitem()[1]) == "verified"
    assert p.open(INO, obj) == 7, "read back: registered without reading it again"
    p.release(INO, 7)


def test_the_read_back_queue_is_bounded(cached, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    p, _, _, obj = cached
    monkeypatch.setattr(passthrough, "READ_BACK_QUEUE", 2)
    dropped = _outcome("dropped")
    fetcher = p.fetcher
    for i in range(3):
        monkeypatch.setattr(fetcher, "object_id", lambda o, i=i: b"oid-%d" % i)
        p.read_back_later(obj)
        if i < 2:
            p.read_back_later(obj)  # (an object queued already: nothing changes)
    assert list(p._read_backs) == [b"oid-0", b"oid-1"]
    assert _outcome("dropped") == dropped + 1


def test_a_corrupt_block_found_by_the_read_back_is_dropped(cached) -> None:  # type: ignore[no-untyped-def]
    p, c, bids, obj = cached
    c.damage(bids[2], 5)
    corrupt = corrupt_count()
    assert p.read_back(obj) == "failed"
    assert corrupt_count() == corrupt + 1 and not c.cache.contains(bids[2])
    assert p.open(INO, obj) == 0  # not cached whole: served (and fetched again) by the daemon
    p.release(INO, 0)


@pytest.mark.parametrize("what", ["evicted", "stopped"])
def test_the_read_back_gives_up_leaving_nothing_trusted_and_dropping_nothing(cached, monkeypatch, what) -> None:  # type: ignore[no-untyped-def]
    """A block evicted under the read-back (its pin yields), or the daemon stopping, ends
    it at the next block."""
    p, c, bids, obj = cached
    c.damage(bids[3], 1)  # (never reached: not found, not dropped)
    indexed_as = c.cache.indexed_as
    asked: list[bytes] = []

    def racing(bid: bytes, entry: tuple[int, int]) -> bool:
        asked.append(bid)
        if len(asked) == 2:
            if what == "evicted":
                c.cache.drop([bids[2]])  # (what an eviction does, while the pin keeps it)
            else:
                p._stop_reading_back()
        return indexed_as(bid, entry)

    monkeypatch.setattr(c.cache, "indexed_as", racing)
    corrupt = corrupt_count()
    assert p.read_back(obj) == ("gone" if what == "evicted" else "stopped")
    assert asked == bids[:2] if what == "stopped" else asked == bids[:3]
    assert corrupt_count() == corrupt and c.cache.contains(bids[3])
    if what == "evicted":
        assert c.stored(bids[2]).count(0) == UBLOCK, "released once the read-back let go"
    monkeypatch.undo()
    assert p.open(INO, obj) == 0, "nothing trusted"
    p.release(INO, 0)


def test_a_paced_read_back_finds_the_same(cached, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    p, _, _, obj = cached
    monkeypatch.setattr(passthrough, "READ_BACK_CHUNK", UBLOCK)  # a rest after every block
    monkeypatch.setattr(passthrough, "READ_BACK_REST", 0.5)
    assert p.read_back(obj) == "verified"
    assert p.open(INO, obj) == 7
    p.release(INO, 7)
