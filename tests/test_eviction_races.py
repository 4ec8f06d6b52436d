"""Eviction racing passthrough and reads (issue 16, part 3): each interleaving forced.

A thread is held at a failpoint (:mod:`cachefs.failpoints`) while the racing
operation runs, then released. In-process tests hold BlockCache threads; the
real-mount tests hold the daemon's worker threads through files (the daemon
arms the points named in CACHEFS_FAILPOINTS).

What must hold: a pinned object's bytes are never punched (pins are read inside
the eviction's write transaction, and again under the object's lock when the
bytes are released); a read that loses a race with an eviction is a miss, not
corruption; a file evicted before a passthrough open could open it is a miss for
that open only.
"""

from __future__ import annotations

import hashlib
import os
import random
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import trio

from cachefs import failpoints, metrics
from cachefs.cache.blocks import BlockCache, block_id, object_id
from cachefs.cache.lmdbenv import LmdbEnv
from cachefs.passthrough import Passthrough
from cachefs.passthrough import supported as passthrough_supported
from cachefs.read.fetcher import ObjectVersion
from cachefs.read.prefetcher import PrefetchLedger
from tests.conftest import DaemonHolds, daemon_holds
from tests.conftest import drop_page_cache as _drop_page_cache

BLOCK = 4096


def _sample(name: str) -> float:
    return metrics.REGISTRY.get_sample_value(name) or 0.0


def _bid(key: str, i: int) -> bytes:
    return block_id("bucket", key, "e", BLOCK, i)


def _data(seed: int, n: int = BLOCK) -> bytes:
    return random.Random(seed).randbytes(n)


class Held:
    """A failpoint that holds the first thread reaching it until :meth:`release`."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.reached = threading.Event()
        self._go = threading.Event()
        self._used = False
        failpoints.arm(name, self._action)

    def _action(self) -> None:
        if self._used:
            return
        self._used = True
        self.reached.set()
        self._go.wait(30)

    def wait(self) -> None:
        assert self.reached.wait(30), f"nothing reached {self.name}"

    def release(self) -> None:
        self._go.set()
        failpoints.disarm(self.name)


@pytest.fixture
def cache(tmp_path: Path) -> Iterator[BlockCache]:
    env = LmdbEnv(tmp_path / "meta.lmdb")
    yield BlockCache(env, tmp_path, capacity=2 * BLOCK, policy="lru")
    env.close()


def _in_thread(fn: Callable[[], Any]) -> tuple[threading.Thread, list[Any]]:
    result: list[Any] = []
    t = threading.Thread(target=lambda: result.append(fn()))
    t.start()
    return t, result


def _stored(cache: BlockCache, bid: bytes) -> bytes:
    path, offset = cache.location(bid)
    with open(path, "rb") as f:
        return os.pread(f.fileno(), BLOCK, offset)


# -- in-process: BlockCache ------------------------------------------------------------------
def test_a_pin_taken_while_an_eviction_waits_keeps_the_object(cache: BlockCache) -> None:
    a = [_bid("a", i) for i in range(2)]
    for i, b in enumerate(a):
        assert cache.put_sync(b, _data(i))
    held = Held("put.index")  # inside the write transaction, before choosing victims
    t, admitted = _in_thread(lambda: cache.put_sync(_bid("b", 0), _data(9)))
    held.wait()
    oid = object_id("bucket", "a", "e", BLOCK)
    cache.pin(oid)
    assert cache.verify_object(a) == 2 * BLOCK  # what a passthrough open checks
    held.release()
    t.join()
    assert admitted == [False], "only pinned blocks were left to evict"
    assert all(cache.contains(b) for b in a)
    assert [_stored(cache, b) for b in a] == [_data(0), _data(1)]
    cache.unpin(oid)


def test_a_pin_taken_after_victims_were_chosen_defers_the_punch(cache: BlockCache) -> None:
    a = [_bid("a", i) for i in range(2)]
    for i, b in enumerate(a):
        assert cache.put_sync(b, _data(i))
    held = Held("evict.chosen")  # victims chosen, the transaction not committed yet
    t, admitted = _in_thread(lambda: cache.put_sync(_bid("b", 0), _data(9)))
    held.wait()
    oid = object_id("bucket", "a", "e", BLOCK)
    cache.pin(oid)
    # The verification reads the snapshot before the eviction commits: it passes.
    assert cache.verify_object(a) == 2 * BLOCK
    held.release()
    t.join()
    assert admitted == [True] and not cache.contains(a[0])
    assert _stored(cache, a[0]) == _data(0), "punched under a pinned (verified) object"
    assert cache.deferred_bytes == BLOCK
    cache.flush_touches({})
    assert _stored(cache, a[0]) == _data(0), "released while still pinned"
    cache.unpin(oid)
    cache.flush_touches({})  # maintenance releases what waited for the unpin
    assert cache.deferred_bytes == 0
    assert _stored(cache, a[0]) == bytes(BLOCK), "the evicted block's bytes are freed"
    assert _stored(cache, a[1]) == _data(1)


# -- in-process: a small file registered by the S3 thread that wrote it ---------------------
class _IdFetcher:
    """What Passthrough asks the fetcher (the real ids; every block is being fetched)."""

    def object_id(self, obj: ObjectVersion) -> bytes:
        return object_id("bucket", obj.key, obj.etag, BLOCK)

    def block_ids(self, obj: ObjectVersion) -> list[bytes]:
        return [block_id("bucket", obj.key, obj.etag, BLOCK, 0)]

    def block_count(self, obj: ObjectVersion) -> int:
        return 1

    def is_loading(self, bid: bytes) -> bool:
        return True


class _Kernel:
    """The device's BACKING_OPEN: what file each id was given (its inode and bytes)."""

    def __init__(self) -> None:
        self.open: dict[int, tuple[int, bytes]] = {}
        self.next_id = 0

    def backing_open(self, fd: int) -> int:
        self.next_id += 1
        self.open[self.next_id] = (os.fstat(fd).st_ino, os.pread(fd, 2 * BLOCK, 0))
        return self.next_id

    def backing_close(self, backing_id: int) -> None:
        del self.open[backing_id]


def _writer(cache: BlockCache) -> tuple[Passthrough, _Kernel, ObjectVersion, bytes]:
    """A Passthrough over ``cache`` waiting for object "a" (predicted while fetched)."""
    p = Passthrough(_IdFetcher(), cache, PrefetchLedger(), enabled=True)  # type: ignore[arg-type]
    kernel = _Kernel()
    p.wanted = True
    p.attach_device(kernel)  # type: ignore[arg-type]
    cache.on_evicted_while_pinned = p.evicted
    obj = ObjectVersion("a", "e", BLOCK - 100)
    p.predicted(obj, 42)
    return p, kernel, obj, block_id("bucket", "a", "e", BLOCK, 0)


def test_a_file_registered_by_its_writer_is_pinned_from_before_its_write(cache: BlockCache) -> None:
    """The S3 thread that checked a predicted small file writes it and registers the file
    from the descriptor it wrote through, reading no index and no file back: safe only
    because the pin is taken before the write. Two other blocks put between the write and
    the registration (the cache holds two) must evict around it, not it -- else the kernel
    would be handed a file whose block the index no longer names (its bytes beyond the
    cache's size, never told to the registration, or punched). Once registered and idle,
    its pin yields: an eviction then takes it, and the registration goes."""
    p, kernel, obj, a = _writer(cache)
    body = _data(1, obj.size)
    between: list[bool] = []

    def evict_meanwhile() -> None:  # (the S3 thread, after the put, before BACKING_OPEN)
        assert cache.put_sync(_bid("b", 0), _data(2))
        assert cache.put_sync(_bid("c", 0), _data(3))  # evicts b: a is pinned
        between.append(cache.contains(a))

    failpoints.arm("written.kept", evict_meanwhile)
    try:
        assert p.write_checked(obj, a, body)
    finally:
        failpoints.disarm("written.kept")
    assert between == [True], "the block was evicted between its write and its registration"
    oid = object_id("bucket", "a", "e", BLOCK)
    path = cache.object_path(oid)
    assert kernel.open == {1: (os.stat(path).st_ino, body)}, "not the file written"
    assert cache.contains(a) and not cache.contains(_bid("b", 0))
    assert p._backings[oid].backing_id == 1 and oid in p._idle
    assert (cache._pinned, cache._yielding) == ({}, {oid: 1}), "idle: its pin yields"
    assert not p._awaiting
    assert metrics.REGISTRY.get_sample_value(
        "cachefs_passthrough_prepared_total", {"outcome": "written"}) >= 1
    # Idle, it yields: the next put evicts it (the least recently used), and the
    # registration is closed, which lets its bytes go.
    assert cache.put_sync(_bid("d", 0), _data(4))
    assert not cache.contains(a)
    assert kernel.open == {} and oid not in p._backings
    assert (cache._pinned, cache._yielding) == ({}, {})
    cache.release_deferred()
    assert not os.path.exists(path)


def test_an_open_registering_the_file_first_keeps_its_registration(cache: BlockCache) -> None:
    """An open of the file between its write and its registration by the S3 thread (the
    index names it now) registers it itself, through the written marks; the S3 thread's
    registration is then closed and its pin let go: one registration per object."""
    p, kernel, obj, a = _writer(cache)
    body = _data(5, obj.size)
    answers: list[int] = []
    failpoints.arm("written.kept", lambda: answers.append(p.open(7, obj)))
    try:
        assert p.write_checked(obj, a, body)
    finally:
        failpoints.disarm("written.kept")
    oid = object_id("bucket", "a", "e", BLOCK)
    assert answers == [1] and p._backings[oid].backing_id == 1
    assert kernel.open == {1: (os.stat(cache.object_path(oid)).st_ino, body)}
    assert (cache._pinned, cache._yielding) == ({oid: 1}, {}), "the open's pin only"
    p.release(7, 1)
    assert (cache._pinned, cache._yielding) == ({}, {oid: 1})


def test_a_deferred_release_keeps_a_block_stored_again(cache: BlockCache) -> None:
    a = [_bid("a", i) for i in range(2)]
    for i, b in enumerate(a):
        assert cache.put_sync(b, _data(i))
    held = Held("evict.chosen")
    t, _ = _in_thread(lambda: cache.put_sync(_bid("b", 0), _data(9)))
    held.wait()
    oid = object_id("bucket", "a", "e", BLOCK)
    cache.pin(oid)
    held.release()
    t.join()
    assert not cache.contains(a[0]) and cache.deferred_bytes == BLOCK
    cache.unpin(oid)
    # a[0] is read again (a miss) and stored again before the deferred release runs
    cache._remove([a[1]])
    assert cache.put_sync(a[0], _data(0))  # also runs the deferred release
    assert cache.deferred_bytes == 0
    assert trio.run(cache.get, a[0]) == _data(0), "a block indexed again was punched"


def test_a_read_racing_an_eviction_is_a_miss_not_corruption(cache: BlockCache) -> None:
    a0 = _bid("a", 0)
    assert cache.put_sync(a0, _data(0))
    assert cache.put_sync(_bid("a", 1), _data(1))
    corrupt = _sample("cachefs_cache_corrupt_blocks_total")
    held = Held("read.indexed")  # looked up in the index, not read yet

    async def read() -> bytes | None:
        return await cache.get(a0)

    t, got = _in_thread(lambda: trio.run(read))
    held.wait()
    assert cache.put_sync(_bid("b", 0), _data(9))  # evicts a0: its hole is punched
    assert not cache.contains(a0)
    held.release()
    t.join()
    assert got == [None], "zeros served, or a miss not reported"
    assert _sample("cachefs_cache_corrupt_blocks_total") == corrupt


def test_a_read_racing_a_file_removal_is_a_miss_not_corruption(tmp_path: Path) -> None:
    env = LmdbEnv(tmp_path / "meta.lmdb")
    try:
        cache = BlockCache(env, tmp_path, capacity=BLOCK, policy="lru")
        a0 = _bid("a", 0)
        assert cache.put_sync(a0, _data(0))
        corrupt = _sample("cachefs_cache_corrupt_blocks_total")
        held = Held("read.indexed")
        t, got = _in_thread(lambda: trio.run(cache.get, a0))
        held.wait()
        assert cache.put_sync(_bid("b", 0), _data(9))  # evicts a: its file is removed
        assert not os.path.exists(cache.location(a0)[0])
        held.release()
        t.join()
        assert got == [None]
        assert _sample("cachefs_cache_corrupt_blocks_total") == corrupt
    finally:
        env.close()


def test_real_damage_is_still_corruption(cache: BlockCache) -> None:
    a0 = _bid("a", 0)
    assert cache.put_sync(a0, _data(0))
    path, offset = cache.location(a0)
    with open(path, "r+b") as f:
        os.pwrite(f.fileno(), b"\x00", offset + 17)
    corrupt = _sample("cachefs_cache_corrupt_blocks_total")
    assert trio.run(cache.get, a0) is None
    assert _sample("cachefs_cache_corrupt_blocks_total") == corrupt + 1
    assert not cache.contains(a0)


def test_touches_from_any_thread_never_race_their_flush(tmp_path: Path) -> None:
    """verify_object (a worker thread) records uses while flush_touches writes the last
    batch out in another: the batch handed over is never written to again."""
    import sys

    env = LmdbEnv(tmp_path / "meta.lmdb")
    try:
        cache = BlockCache(env, tmp_path, capacity=1 << 30, policy="lru")
        blocks = [_bid("t", i) for i in range(512)]
        for b in blocks:
            assert cache.put_sync(b, b"x")
        errors: list[BaseException] = []
        stop = threading.Event()

        def verifier() -> None:
            try:
                while not stop.is_set():
                    assert cache.verify_object(blocks) == len(blocks)
            except BaseException as exc:  # reported below
                errors.append(exc)

        old = sys.getswitchinterval()
        sys.setswitchinterval(1e-6)
        try:
            t = threading.Thread(target=verifier)
            t.start()
            deadline = time.monotonic() + 3
            while time.monotonic() < deadline and not errors:
                touched = cache.take_touches()
                time.sleep(0.0005)  # the verifier may still hold the dict just taken
                cache.flush_touches(touched)
            stop.set()
            t.join()
        finally:
            sys.setswitchinterval(old)
        assert not errors, errors
    finally:
        env.close()


# -- real mounts: the daemon held at failpoints ----------------------------------------------
MNT_BLOCK = 64 * 1024


@pytest.fixture
def holds(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[DaemonHolds]:
    h = daemon_holds(tmp_path, monkeypatch, "put.index", "evict.chosen", "read.indexed",
                     "attach.start", "attach.verified")
    yield h
    for f in h.dir.glob("*.hold"):
        f.unlink()


def _wait(m: Any, what: Callable[[dict[str, float]], bool], timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while True:
        if what(m.metrics()):
            return
        assert time.monotonic() < deadline, "timed out waiting for the daemon"
        time.sleep(0.05)


def _evictions_or_rejects(s: dict[str, float]) -> float:
    return s.get("cachefs_cache_evictions_total", 0) + s.get(
        "cachefs_cache_admission_rejected_total", 0)


def _read_file(path: Path) -> bytes:
    with open(path, "rb", buffering=0) as f:
        return f.read()


def _read_fd(fd: int) -> bytes:
    out, off = [], 0
    while chunk := os.pread(fd, MNT_BLOCK, off):
        out.append(chunk)
        off += len(chunk)
    return b"".join(out)


def _objects(bucket: Any, sizes: dict[str, int]) -> dict[str, bytes]:
    client, name = bucket
    files = {key: _data(i + 100, n) for i, (key, n) in enumerate(sizes.items())}
    for key, body in files.items():
        client.put_object(Bucket=name, Key=key, Body=body)
    return files


def _mount(mount_factory: Any, bucket: Any, cache_blocks: int, *extra: str) -> Any:
    _, name = bucket
    return mount_factory(f"s3://{name}", "--block-size", "64K", "--cache-size",
                         f"{cache_blocks * 64}K", "--cache-policy", "lru", "--memory-budget",
                         "256K", "--metadata-ttl", "inf", "--read-ahead", "64K", *extra)


def _cached(m: Any, path: Path, body: bytes, blocks: int) -> None:
    assert _read_file(path) == body
    _wait(m, lambda s: s["cachefs_cache_blocks"] == blocks
          and s["cachefs_open_file_handles"] == 0)


needs_passthrough = pytest.mark.skipif(not passthrough_supported(),
                                       reason="FUSE passthrough needs Linux >= 6.9")


@pytest.mark.drops_caches
@pytest.mark.fuse
@needs_passthrough
@pytest.mark.parametrize("point", ["put.index", "evict.chosen"])
def test_an_eviction_never_punches_a_file_the_kernel_reads(bucket, mount_factory, holds, point) -> None:  # type: ignore[no-untyped-def]
    """An object verified and handed to the kernel while an eviction of its blocks was
    being decided (before it chose them, or after) keeps its bytes."""
    files = _objects(bucket, {"a.bin": 2 * MNT_BLOCK, "b.bin": MNT_BLOCK})
    m = _mount(mount_factory, bucket, 2)
    _cached(m, m.path / "a.bin", files["a.bin"], 2)
    holds.hold(point)
    t, got = _in_thread(lambda: _read_file(m.path / "b.bin"))  # its put must evict a
    holds.wait(point)
    fd = os.open(m.path / "a.bin", os.O_RDONLY)
    try:
        assert m.metric("cachefs_passthrough_opens_total") == 1
        holds.release(point)
        t.join()
        assert got == [files["b.bin"]]
        _wait(m, lambda s: _evictions_or_rejects(s) >= 1)
        _drop_page_cache()
        assert _read_fd(fd) == files["a.bin"], "the kernel read punched (zeroed) bytes"
    finally:
        os.close(fd)
    assert m.metric("cachefs_cache_corrupt_blocks_total") == 0
    if point == "evict.chosen" and m.metric("cachefs_cache_evictions_total") >= 1:
        # a was registered after its blocks were chosen: the cache tells its registration,
        # which goes once idle, so a's bytes do not stay beyond the cache's size.
        _wait(m, lambda s: s["cachefs_passthrough_yielded_total"] == 1, timeout=10)
        assert _read_file(m.path / "a.bin") == files["a.bin"]


@pytest.mark.drops_caches
@pytest.mark.fuse
def test_a_daemon_read_racing_an_eviction_is_a_miss_not_corruption(bucket, mount_factory, holds) -> None:  # type: ignore[no-untyped-def]
    files = _objects(bucket, {"a.bin": 2 * MNT_BLOCK, "b.bin": MNT_BLOCK})
    m = _mount(mount_factory, bucket, 2, "--passthrough", "off", "--native-reads", "off")
    _cached(m, m.path / "a.bin", files["a.bin"], 2)  # memory holds block 1 only
    _drop_page_cache()
    holds.hold("read.indexed")

    def read_head() -> bytes:
        with open(m.path / "a.bin", "rb", buffering=0) as f:
            return os.pread(f.fileno(), 100, 0)

    t, got = _in_thread(read_head)
    holds.wait("read.indexed")  # block 0 found in the index, not read yet
    assert _read_file(m.path / "b.bin") == files["b.bin"]
    _wait(m, lambda s: s.get("cachefs_cache_evictions_total", 0) >= 1)  # block 0 punched
    holds.release("read.indexed")
    t.join()
    assert got == [files["a.bin"][:100]]
    assert m.metric("cachefs_cache_corrupt_blocks_total") == 0, "a lost race counted as damage"


@pytest.mark.fuse
@needs_passthrough
def test_a_file_evicted_under_a_passthrough_open_is_a_miss_for_that_open(bucket, mount_factory, holds) -> None:  # type: ignore[no-untyped-def]
    """An eviction decided before the open pinned the object, committed after the
    open verified it: the open must neither hand punched bytes to the kernel nor
    switch passthrough off for the mount."""
    files = _objects(bucket, {"a.bin": MNT_BLOCK, "b.bin": MNT_BLOCK})
    # (no idle registration: a's next open registers its file again)
    m = _mount(mount_factory, bucket, 1, "--registered-files", "0")
    _cached(m, m.path / "a.bin", files["a.bin"], 1)
    holds.hold("put.index")
    holds.hold("attach.verified")
    t_b, got_b = _in_thread(lambda: _read_file(m.path / "b.bin"))
    holds.wait("put.index")  # the eviction of a is being decided
    t_a, got_a = _in_thread(lambda: _read_file(m.path / "a.bin"))
    holds.wait("attach.verified")  # a's open verified its file
    holds.release("put.index")
    _wait(m, lambda s: _evictions_or_rejects(s) >= 1)
    holds.release("attach.verified")
    t_a.join()
    t_b.join()
    assert got_a == [files["a.bin"]] and got_b == [files["b.bin"]]
    assert m.metric("cachefs_passthrough_enabled") == 1, "one evicted file switched passthrough off"
    assert m.metric("cachefs_cache_corrupt_blocks_total") == 0


@pytest.mark.drops_caches
@pytest.mark.fuse
@needs_passthrough
def test_a_file_gone_before_a_passthrough_open_is_a_miss_for_that_open(bucket, mount_factory, holds) -> None:  # type: ignore[no-untyped-def]
    files = _objects(bucket, {"a.bin": MNT_BLOCK, "b.bin": MNT_BLOCK})
    # (no idle registration: a's next open registers its file again)
    m = _mount(mount_factory, bucket, 1, "--registered-files", "0")
    _cached(m, m.path / "a.bin", files["a.bin"], 1)
    declined = 'cachefs_passthrough_declined_total{reason="not_cached"}'
    assert _read_file(m.path / "b.bin") == files["b.bin"]  # b cached now, a evicted
    _drop_page_cache()
    assert _read_file(m.path / "a.bin") == files["a.bin"]  # a cached again, b evicted
    _wait(m, lambda s: s["cachefs_open_file_handles"] == 0
          and s.get("cachefs_cache_evictions_total", 0) >= 2)
    before = m.metric(declined)
    holds.hold("attach.start")
    t_a, got_a = _in_thread(lambda: _read_file(m.path / "a.bin"))
    holds.wait("attach.start")  # a is cached: its open goes to verify it
    assert _read_file(m.path / "b.bin") == files["b.bin"]
    _wait(m, lambda s: s.get("cachefs_cache_evictions_total", 0) >= 3)  # a's file removed
    holds.release("attach.start")
    t_a.join()
    assert got_a == [files["a.bin"]]
    s = m.metrics()
    assert s["cachefs_passthrough_enabled"] == 1
    assert s[declined] == before + 2  # b (not cached), and a (gone when opened)
    assert s["cachefs_cache_corrupt_blocks_total"] == 0


# -- files verified ahead of their open (a preparing thread) ----------------------------------
REGISTERED = 'cachefs_passthrough_prepared_total{outcome="registered"}'


def _read_cold_then_hold(m: Any, path: Path, body: bytes, holds: DaemonHolds, point: str) -> None:
    """Read ``path`` cold (served by the daemon); its close queues it for registration,
    which is held at ``point``."""
    holds.hold(point)
    assert _read_file(path) == body
    holds.wait(point)


@pytest.mark.drops_caches
@pytest.mark.fuse
@needs_passthrough
def test_opens_during_a_registration_ahead_share_its_backing(bucket, mount_factory, holds) -> None:  # type: ignore[no-untyped-def]
    """Opens of an object whose file a preparing thread is verifying wait for it and
    share its one backing (one registration per object at a time)."""
    files = _objects(bucket, {"a.bin": MNT_BLOCK + 5})  # (idle, it stays registered)
    m = _mount(mount_factory, bucket, 8)
    _read_cold_then_hold(m, m.path / "a.bin", files["a.bin"], holds, "attach.verified")
    _drop_page_cache()
    threads = [_in_thread(lambda: _read_file(m.path / "a.bin")) for _ in range(3)]
    time.sleep(0.3)  # (the opens are waiting for the registration)
    assert all(t.is_alive() for t, _ in threads)
    holds.release("attach.verified")
    for t, got in threads:
        t.join()
        assert got == [files["a.bin"]]
    s = m.metrics()
    assert s["cachefs_passthrough_opens_total"] == 3
    assert s["cachefs_passthrough_backing_files"] == 1
    assert s[REGISTERED] == 1
    assert s["cachefs_passthrough_verified_bytes_total"] == len(files["a.bin"]), \
        "verified more than once"
    assert s["cachefs_cache_hit_bytes_total"] == 3 * len(files["a.bin"])  # (three opens)


@pytest.mark.drops_caches
@pytest.mark.fuse
@needs_passthrough
@pytest.mark.parametrize("point", ["attach.start", "attach.verified"])
def test_an_eviction_during_a_registration_ahead_never_serves_a_wrong_byte(bucket, mount_factory, holds, point) -> None:  # type: ignore[no-untyped-def]
    """An eviction of the object a preparing thread is about to verify (not pinned yet:
    the registration fails, the next open is served) or has verified (pinned: its bytes
    stay, the kernel reads them)."""
    others = [f"b{i}.bin" for i in range(4)]
    files = _objects(bucket, {"a.bin": MNT_BLOCK, **{k: MNT_BLOCK for k in others}})
    m = _mount(mount_factory, bucket, 4)  # (idle registrations may pin one block)
    _read_cold_then_hold(m, m.path / "a.bin", files["a.bin"], holds, point)
    for key in others:  # their puts evict the least recently used block: a's
        # (O_DIRECT: served by the daemon, so that no open of theirs meets the failpoint)
        fd = os.open(m.path / key, os.O_RDONLY | os.O_DIRECT)
        try:
            assert _read_fd(fd) == files[key]
        finally:
            os.close(fd)
    _wait(m, lambda s: _evictions_or_rejects(s) >= 1)
    holds.release(point)
    _wait(m, lambda s: sum(v for k, v in s.items()
                           if k.startswith("cachefs_passthrough_prepared_total")) >= 1)
    _wait(m, lambda s: s["cachefs_open_file_handles"] == 0)
    s = m.metrics()
    if point == "attach.start":
        assert s['cachefs_passthrough_prepared_total{outcome="not_cached"}'] >= 1
    else:
        assert s[REGISTERED] >= 1  # a, pinned before the eviction chose: its bytes stay
    _drop_page_cache()
    for key, body in files.items():
        assert _read_file(m.path / key) == body
    s = m.metrics()
    assert s["cachefs_passthrough_enabled"] == 1
    assert s["cachefs_cache_corrupt_blocks_total"] == 0
    if point == "attach.verified":
        assert s["cachefs_passthrough_opens_total"] >= 1


@pytest.mark.fuse
@needs_passthrough
def test_an_opener_killed_while_a_registration_ahead_is_held(bucket, mount_factory, holds) -> None:  # type: ignore[no-untyped-def]
    """A reader killed while its open waits for a preparing thread leaves no handle and
    no pin behind that would keep the backing busy."""
    import subprocess
    import sys
    files = _objects(bucket, {"a.bin": MNT_BLOCK})
    m = _mount(mount_factory, bucket, 8)
    _read_cold_then_hold(m, m.path / "a.bin", files["a.bin"], holds, "attach.verified")
    proc = subprocess.Popen([sys.executable, "-c",
                             f"open({str(m.path / 'a.bin')!r}, 'rb').read()"])
    time.sleep(0.5)  # its open is waiting for the registration
    assert proc.poll() is None
    proc.kill()  # (it ends once its open is answered: the kernel waits for an answer
    # to a request the daemon has read)
    holds.release("attach.verified")
    proc.wait(30)
    _wait(m, lambda s: s.get(REGISTERED, 0) == 1)
    _wait(m, lambda s: s["cachefs_open_file_handles"] == 0)
    assert _read_file(m.path / "a.bin") == files["a.bin"]
    _wait(m, lambda s: s["cachefs_open_file_handles"] == 0)
    assert m.metric("cachefs_passthrough_backing_files") == 1


# -- the load, bounded ----------------------------------------------------------------
@pytest.mark.drops_caches
@pytest.mark.fuse
@pytest.mark.slow
def test_eviction_under_passthrough_load_never_serves_a_wrong_byte(bucket, mount_factory) -> None:  # type: ignore[no-untyped-def]
    """60 objects of 1-3 MiB through an 8 MiB LRU cache with passthrough on, 8 readers
    (half of their picks from 6 hot objects) checking sha256, the page cache dropped
    every second."""
    client, name = bucket
    rnd = random.Random(16)
    sums: dict[str, str] = {}
    for i in range(60):
        body = rnd.randbytes(rnd.randrange(1 << 20, 3 << 20))
        client.put_object(Bucket=name, Key=f"o/{i:02d}.bin", Body=body)
        sums[f"{i:02d}.bin"] = hashlib.sha256(body).hexdigest()
    m = mount_factory(f"s3://{name}/o", "--cache-size", "8M", "--block-size", "1M",
                      "--cache-policy", "lru", "--memory-budget", "4M", "--metadata-ttl", "inf")
    names = sorted(sums)
    stop = threading.Event()
    wrong: list[str] = []
    reads = [0]
    errors: list[BaseException] = []

    def reader(seed: int) -> None:
        r = random.Random(seed)
        try:
            while not stop.is_set():
                n = names[r.randrange(6)] if r.random() < 0.5 else r.choice(names)
                if hashlib.sha256(_read_file(m.path / n)).hexdigest() != sums[n]:
                    wrong.append(n)
                reads[0] += 1
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=reader, args=(s,)) for s in range(8)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        time.sleep(1)
        _drop_page_cache()
    stop.set()
    for t in threads:
        t.join(timeout=120)
    s = m.metrics()
    print(f"{reads[0]} reads, {len(wrong)} wrong; passthrough opens "
          f"{s.get('cachefs_passthrough_opens_total', 0)}, evictions "
          f"{s.get('cachefs_cache_evictions_total', 0)}")
    assert not errors, errors
    assert reads[0] > 100
    assert s.get("cachefs_passthrough_opens_total", 0) > 0 or not passthrough_supported()
    assert not wrong, f"{len(wrong)} wrong reads of {reads[0]}"
    assert s.get("cachefs_cache_corrupt_blocks_total", 0) == 0


@pytest.mark.fuse
@needs_passthrough
def test_a_file_closed_before_its_blocks_landed_is_registered_once_they_have(bucket, mount_factory, holds) -> None:  # type: ignore[no-untyped-def]
    """Reads of a multi-block file are answered before its blocks are written to the
    cache, so its handle may close (and ask for its registration ahead of the next open)
    while they are still being written: the preparing thread looks again once they have
    landed instead of giving the file up -- however long the disk takes to write them
    (here 3 s: longer than the fixed count of looks it once made, 2 s, which a busy
    machine's disk outlasted)."""
    files = _objects(bucket, {"a.bin": 3 * MNT_BLOCK})
    m = _mount(mount_factory, bucket, 16)
    holds.hold("put.index")  # every write-back waits before it is indexed
    assert _read_file(m.path / "a.bin") == files["a.bin"]
    holds.wait("put.index")
    _wait(m, lambda s: s["cachefs_open_file_handles"] == 0)
    time.sleep(3)  # the preparing thread has looked at it, found blocks missing, again and again
    assert m.metric('cachefs_passthrough_prepared_total{outcome="registered"}') == 0
    holds.release("put.index")
    _wait(m, lambda s: s['cachefs_passthrough_prepared_total{outcome="registered"}'] == 1)
    assert m.metric('cachefs_passthrough_prepared_total{outcome="declined"}') == 0
    assert m.metric("cachefs_passthrough_backing_files") == 1
    assert _read_file(m.path / "a.bin") == files["a.bin"]
    assert m.metric("cachefs_passthrough_opens_total") == 1


@pytest.mark.fuse
@needs_passthrough
@pytest.mark.parametrize("reader", ["kernel", "native"])
def test_readers_racing_the_eviction_of_idle_registrations_read_right_bytes(bucket, mount_factory, reader) -> None:  # type: ignore[no-untyped-def]
    """Idle registrations yield to eviction (their pin does not keep it away): with four
    readers opening, reading and closing files of a dataset three times the cache in
    random orders, registrations are closed by evictions (on the threads that put) while
    other readers reuse, open and release them. Every byte read is right, passthrough
    stays on, and once the readers stop the cache's files take no more than its size."""
    files = _objects(bucket, {f"d/f{i:02d}.bin": MNT_BLOCK - 3 * i for i in range(24)})
    extra = ("--passthrough", "off") if reader == "native" else ()
    m = _mount(mount_factory, bucket, 8, *extra)
    wrong: list[str] = []

    def read(seed: int) -> None:
        order = sorted(files)
        for epoch in range(3):
            random.Random(seed * 10 + epoch).shuffle(order)
            for key in order:
                if _read_file(m.path / key) != files[key]:
                    wrong.append(key)

    threads = [threading.Thread(target=read, args=(seed,)) for seed in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not wrong, f"wrong bytes for {sorted(set(wrong))}"
    _wait(m, lambda s: s["cachefs_open_file_handles"] == 0)
    s = m.metrics()
    assert s["cachefs_passthrough_yielded_total"] > 0, "no idle registration was evicted"
    assert s["cachefs_passthrough_enabled" if reader == "kernel"
             else "cachefs_native_reads_enabled"] == 1
    assert s["cachefs_cache_corrupt_blocks_total"] == 0
    # (one the native loop had a handle of when evicted goes within a second of its close)
    _wait(m, lambda s: s["cachefs_passthrough_backing_files"] <= 8, timeout=5)

    # Deferred releases run at the next put or the next maintenance pass (every 5 s).
    _wait(m, lambda s: m.cache_bytes_on_disk() <= 8 * MNT_BLOCK, timeout=15)
    for key in sorted(files):
        assert _read_file(m.path / key) == files[key]


def test_the_cache_s_own_write_into_a_registered_file_is_no_change(cache: BlockCache) -> None:
    """A registered file's stamp follows the cache's own writes into it (a block the index
    dropped while a pin kept its bytes, fetched and written again: the same checked
    bytes), even with no written marks left to vouch for the file (their table is
    bounded): its next open is answered as before, not refused as changed. A write by
    anyone else still is a change."""
    p, _kernel, obj, a = _writer(cache)
    cache.on_written = p.written
    body = _data(1, obj.size)
    assert p.write_checked(obj, a, body)
    oid = object_id("bucket", "a", "e", BLOCK)
    changed = metrics.REGISTRY.get_sample_value("cachefs_passthrough_changed_total") or 0
    cache.max_written_marks = 0  # (marks pushed out of their table: none vouch any more)
    with cache._file_lock(oid):
        cache._unmark_written(oid)
    assert cache.put_sync(a, body)  # the cache's own write of the same bytes
    assert p.open(7, obj) == 1, "refused as changed"
    assert (metrics.REGISTRY.get_sample_value("cachefs_passthrough_changed_total") or 0) \
        == changed
    p.release(7, 1)
    fd = os.open(cache.object_path(oid), os.O_WRONLY)  # someone else's write
    try:
        os.pwrite(fd, b"\xff", 10)
    finally:
        os.close(fd)
    assert p.open(8, obj) == 0, "a changed file registered again unread"
    assert metrics.REGISTRY.get_sample_value("cachefs_passthrough_changed_total") == changed + 1
