"""Component tests of cachefs.read.fetcher over MemoryStore + BlockCache + MemoryBudget (no FUSE)."""

from __future__ import annotations

import contextlib
import random
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
import trio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cachefs import metrics
from cachefs.cache.blocks import BlockCache
from cachefs.cache.lmdbenv import LmdbEnv
from cachefs.errors import AccessDenied, NoSuchKey, ObjectChanged, TransientStoreError
from cachefs.read.budget import MemoryBudget
from cachefs.read.fetcher import Fetcher, ObjectVersion
from cachefs.read.prefetcher import DIRECTORY, HINT, SEQUENTIAL, SWEEP, Prefetcher, PrefetchLedger
from cachefs.s3.memory import MemoryStore
from cachefs.s3.origin import Backoff, Origin
from cachefs.s3.store import Exchange, ObjectStore
from tests.conftest import running

BS = 64  # tiny blocks: many block boundaries with little data


def payload(n: int, seed: int = 1) -> bytes:
    return random.Random(seed).randbytes(n)


class Rig:
    """Everything a Fetcher needs, built inside one trio run."""

    def __init__(self, root: Path, store: ObjectStore, *, budget: int = 1 << 20, hot: int = 0,
                 capacity: int = 1 << 20, connections: int = 8, deadline: float = 0,
                 backoff: Backoff | None = None) -> None:
        self.root = root
        self.store = store
        self.deadline = deadline  # 0: no retries
        self.backoff = backoff
        root.mkdir(parents=True, exist_ok=True)
        self.env = LmdbEnv(root / "meta.lmdb")
        self.budget_limit = budget
        self.hot = hot
        self.capacity = capacity
        self.connections = connections

    @contextlib.asynccontextmanager
    async def fetcher(self) -> AsyncIterator[Fetcher]:
        cache = BlockCache(self.env, self.root, capacity=self.capacity)
        origin = Origin(self.store, max_connections=self.connections, deadline=self.deadline,
                        backoff=self.backoff)
        fetcher = Fetcher(origin, cache, block_size=BS, budget=MemoryBudget(self.budget_limit),
                          hot_capacity=self.hot)
        async with running(fetcher):
            yield fetcher

    def run(self, fn: Callable[[Fetcher], Awaitable[Any]]) -> Any:
        async def main() -> Any:
            async with self.fetcher() as f:
                return await fn(f)
        return trio.run(main)

    def close(self) -> None:
        self.env.close()


@pytest.fixture
def mem() -> MemoryStore:
    return MemoryStore()


@pytest.fixture
def rig(tmp_path: Path, mem: MemoryStore) -> Any:
    r = Rig(tmp_path, mem)
    yield r
    r.close()


def version(store: MemoryStore, key: str) -> ObjectVersion:
    info = store.head(key)
    store.calls["head"] -= 1
    return ObjectVersion(key, info.etag, info.size)


def slow_gets(store: MemoryStore, seconds: float = 0.02) -> None:
    def fault(op: str, key: str) -> None:
        if op == "get":
            time.sleep(seconds)
    store.fault = fault


# -- correctness of arbitrary ranges ------------------------------------------------------------
def test_read_arbitrary_ranges_matches_reference(tmp_path: Path) -> None:
    store = MemoryStore()
    sizes = {"empty": 0, "one": 1, "small": BS - 1, "exact": 4 * BS, "odd": 10 * BS + 17}
    ref = {k: payload(n, seed=n) for k, n in sizes.items()}
    for k, d in ref.items():
        store.put(k, d)
    rig = Rig(tmp_path, store, hot=3 * BS)

    @settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(key=st.sampled_from(sorted(sizes)), offset=st.integers(0, 12 * BS),
           size=st.integers(0, 12 * BS))
    def check(key: str, offset: int, size: int) -> None:
        obj = version(store, key)

        async def body(f: Fetcher) -> bytes:
            return await f.read(obj, offset, size)

        assert rig.run(body) == ref[key][offset:offset + size]

    try:
        check()
        # Every block ever fetched was fetched once (later examples hit the disk cache).
        fetched = store.calls["get"]
        assert fetched <= sum((n + BS - 1) // BS for n in sizes.values())

        async def again(f: Fetcher) -> None:
            for k in sizes:
                assert await f.read(version(store, k), 0, 1 << 20) == ref[k]
        rig.run(again)
        assert store.calls["get"] == sum((n + BS - 1) // BS for n in sizes.values())
    finally:
        rig.close()


def test_read_clamps_to_object_size(rig: Rig, mem: MemoryStore) -> None:
    mem.put("k", payload(100))
    obj = version(mem, "k")

    async def body(f: Fetcher) -> None:
        assert await f.read(obj, 90, 1000) == payload(100)[90:]
        assert await f.read(obj, 100, 10) == b""
        assert await f.read(obj, 5000, 10) == b""
        assert await f.read(obj, 0, 0) == b""

    rig.run(body)


# -- single flight and caching ------------------------------------------------------------------------
def test_concurrent_readers_of_a_missing_block_share_one_get(rig: Rig, mem: MemoryStore) -> None:
    mem.put("k", payload(3 * BS))
    obj = version(mem, "k")
    slow_gets(mem)

    async def body(f: Fetcher) -> None:
        results: list[bytes] = []

        async def reader(offset: int, size: int) -> None:
            results.append(await f.read(obj, offset, size))

        async with trio.open_nursery() as nursery:
            for i in range(10):
                nursery.start_soon(reader, i, BS - i)  # all inside block 0
        assert sorted(results) == sorted(payload(3 * BS)[i:BS] for i in range(10))
        assert mem.calls["get"] == 1

    rig.run(body)


def test_request_workers_reading_during_a_load_never_start_a_second_get(
        rig: Rig, mem: MemoryStore) -> None:
    # FUSE request workers answer reads of cached blocks themselves (read_now, any thread):
    # while the block is being loaded they must hand the read to the trio side (None),
    # never fetch it themselves nor return part of it; once it is there they serve it.
    data = payload(3 * BS)
    mem.put("k", data)
    obj = version(mem, "k")
    slow_gets(mem, 0.05)

    async def body(f: Fetcher) -> None:
        stop = threading.Event()
        seen: list[bytes | None] = []
        errors: list[BaseException] = []

        def worker(offset: int) -> None:
            try:
                while not stop.is_set():
                    got = f.read_now(obj, offset, 2 * BS - offset)
                    seen.append(got)
                    if got is not None:
                        assert got == data[offset:2 * BS]
            except BaseException as exc:  # reported below
                errors.append(exc)

        threads = [threading.Thread(target=worker, args=(i * 7,)) for i in range(6)]
        for t in threads:
            t.start()
        try:
            async with trio.open_nursery() as nursery:
                for i in range(4):
                    nursery.start_soon(f.read, obj, i, 2 * BS - i)
            await f.drain()
            await trio.sleep(0.05)
        finally:
            stop.set()
            for t in threads:
                t.join()
        assert not errors, errors
        assert mem.calls["get"] == 2  # blocks 0 and 1, once each
        assert None in seen and any(s is not None for s in seen)

    rig.run(body)


@pytest.mark.parametrize("hot", [0, 1 << 20], ids=["from-disk", "from-memory"])
def test_second_read_is_served_without_a_get(tmp_path: Path, mem: MemoryStore, hot: int) -> None:
    data = payload(5 * BS + 3)
    mem.put("k", data)
    obj = version(mem, "k")
    rig = Rig(tmp_path, mem, hot=hot)
    try:
        async def body(f: Fetcher) -> None:
            assert await f.read(obj, 0, len(data)) == data
            assert mem.calls["get"] == 6
            await f.drain()
            sources = [(await f.get_block(obj, i))[1] for i in range(6)]
            assert sources == ["memory" if hot else "disk"] * 6
            assert await f.read(obj, 0, len(data)) == data
            assert await f.read(obj, BS - 1, 2) == data[BS - 1:BS + 1]
            assert mem.calls["get"] == 6

        rig.run(body)

        # A new fetcher over the same cache directory (a remount) reads from disk too.
        async def after_restart(f: Fetcher) -> None:
            assert (await f.get_block(obj, 2))[1] == "disk"
            assert await f.read(obj, 0, len(data)) == data

        rig.run(after_restart)
        assert mem.calls["get"] == 6
    finally:
        rig.close()


def test_corrupt_cached_block_is_fetched_again(rig: Rig, mem: MemoryStore) -> None:
    data = payload(2 * BS)
    mem.put("k", data)
    obj = version(mem, "k")

    async def fill(f: Fetcher) -> tuple[Path, int]:
        assert await f.read(obj, 0, 2 * BS) == data
        path, offset = f.cache.location(f.block_id(obj, 1))
        return Path(path), offset

    path, offset = rig.run(fill)
    raw = bytearray(path.read_bytes())
    raw[offset] ^= 0xFF
    path.write_bytes(bytes(raw))

    async def reread(f: Fetcher) -> None:
        assert await f.read(obj, 0, 2 * BS) == data

    rig.run(reread)
    assert mem.calls["get"] == 3


# -- changed objects ---------------------------------------------------------------------------------
def test_object_changed_raises_and_never_mixes_versions(rig: Rig, mem: MemoryStore) -> None:
    v1 = payload(3 * BS, seed=1)
    v2 = payload(3 * BS, seed=2)
    mem.put("k", v1)
    old = version(mem, "k")

    async def body(f: Fetcher) -> None:
        assert await f.read(old, 0, BS) == v1[:BS]
        await f.drain()  # block 0 of v1 is now on disk
        mem.put("k", v2)
        new = version(mem, "k")
        assert new.etag != old.etag
        with pytest.raises(ObjectChanged):
            await f.read(old, 0, 3 * BS)  # block 1 and 2 are not cached: If-Match fails
        with pytest.raises(ObjectChanged):
            await f.read(old, 2 * BS, 5)
        assert await f.read(old, 0, BS) == v1[:BS]  # still the pinned version's bytes
        assert await f.read(new, 0, 3 * BS) == v2  # the new version: none of v1's bytes
        with pytest.raises(ObjectChanged):
            await f.read(old, BS, BS)

    rig.run(body)


def test_vanished_object_raises_no_such_key(rig: Rig, mem: MemoryStore) -> None:
    mem.put("k", payload(BS))
    obj = version(mem, "k")
    mem.delete("k")

    async def body(f: Fetcher) -> None:
        with pytest.raises(NoSuchKey):
            await f.read(obj, 0, 10)

    rig.run(body)


# -- prefetch and budget (through the one prefetcher) ----------------------------------------------------
def ahead(f: Fetcher) -> Prefetcher:
    return Prefetcher(f, f.budget, PrefetchLedger())


def test_prefetch_starts_at_most_one_load_per_block(tmp_path: Path, mem: MemoryStore) -> None:
    data = payload(4 * BS)
    mem.put("k", data)
    obj = version(mem, "k")
    slow_gets(mem)
    rig = Rig(tmp_path, mem, hot=1 << 20)

    async def body(f: Fetcher) -> None:
        p = ahead(f)
        assert p.want(obj, 1, SEQUENTIAL) == BS
        assert f.is_loading(f.block_id(obj, 1))
        assert p.want(obj, 1, SEQUENTIAL) == BS  # in flight: no second load
        assert f.is_resident(obj, 1)
        assert await f.read(obj, BS, BS) == data[BS:2 * BS]  # joins the prefetch flight
        assert mem.calls["get"] == 1
        await f.drain()
        assert p.want(obj, 1, SEQUENTIAL) == BS  # in memory: nothing to do
        assert p.want(obj, 4, SEQUENTIAL) == 0  # past the end
        assert p.want(obj, 100, SEQUENTIAL) == 0
        assert [p.want(obj, i, SEQUENTIAL) for i in (0, 0, 2, 3, 3)] == [BS] * 5
        await f.drain()
        assert mem.calls["get"] == 4
        assert await f.read(obj, 0, 4 * BS) == data
        assert mem.calls["get"] == 4

    try:
        rig.run(body)
    finally:
        rig.close()


def test_prefetch_of_a_cached_block_loads_it_from_disk_for_near_policies_only(
        tmp_path: Path, mem: MemoryStore) -> None:
    data = payload(2 * BS)
    mem.put("k", data)
    obj = version(mem, "k")
    rig = Rig(tmp_path, mem, hot=1 << 20)
    try:
        async def fill(f: Fetcher) -> None:
            await f.read(obj, 0, 2 * BS)
        rig.run(fill)

        async def body(f: Fetcher) -> None:  # a fresh fetcher: empty memory, blocks on disk
            p = ahead(f)
            b0, b1 = f.block_id(obj, 0), f.block_id(obj, 1)
            assert b0 not in f.memory
            # A far-ahead policy leaves cached blocks on disk.
            assert p.want(obj, 1, HINT) == 0
            assert not f.is_loading(b1)
            # The sequential policy predicts a daemon read now: disk -> memory.
            assert p.want(obj, 0, SEQUENTIAL) == 0
            assert f.is_loading(b0)
            await f.drain()
            assert b0 in f.memory and b1 not in f.memory
            assert f.budget.used == 0
        rig.run(body)
        assert mem.calls["get"] == 2
    finally:
        rig.close()


def test_directory_lookahead_reads_cached_blocks_into_the_page_cache_without_passthrough(
        tmp_path: Path, mem: MemoryStore) -> None:
    data = payload(BS)
    mem.put("k", data)
    obj = version(mem, "k")
    rig = Rig(tmp_path, mem, hot=1 << 20)
    try:
        rig.run(lambda f: f.read(obj, 0, BS))

        async def body(f: Fetcher) -> None:
            bid = f.block_id(obj, 0)
            f.memory.discard(bid)
            advised: list[tuple[bytes, int]] = []
            p = Prefetcher(f, f.budget, PrefetchLedger(),
                           readahead=lambda b, n: advised.append((b, n)))
            assert p.want(obj, 0, DIRECTORY) == 0  # on local disk: nothing fetched ahead
            assert advised == [(bid, BS)]
            assert not f.is_loading(bid)  # its next reader reads it from the page cache
            assert p.want(obj, 0, HINT) == 0 and p.want(obj, 0, SWEEP) == 0
            assert advised == [(bid, BS)]  # far-ahead policies leave it alone
            assert p.want(obj, 0, DIRECTORY, load_cached=False) == 0
            assert advised == [(bid, BS)]
            passed_through = Prefetcher(f, f.budget, PrefetchLedger(),
                                        readahead=lambda b, n: advised.append((b, n)),
                                        kernel_reads_cached=lambda: True)
            assert passed_through.want(obj, 0, DIRECTORY) == 0
            assert advised == [(bid, BS)]  # the kernel reads it itself, as from a local disk
            assert not f.is_loading(bid)
            assert p.want(obj, 0, SEQUENTIAL) == 0
            assert f.is_loading(bid)  # the handle's next read comes through the daemon
            await f.drain()
            assert bid in f.memory
            assert p.want(obj, 0, DIRECTORY) == BS  # in memory: nothing more to do
            assert advised == [(bid, BS)]
        rig.run(body)
    finally:
        rig.close()


def test_prefetch_respects_the_memory_budget(tmp_path: Path, mem: MemoryStore) -> None:
    data = payload(8 * BS)
    mem.put("k", data)
    obj = version(mem, "k")
    gate = threading.Event()

    def blocked(op: str, key: str) -> None:
        if op == "get":
            gate.wait(5)

    mem.fault = blocked
    rig = Rig(tmp_path, mem, budget=3 * BS)
    try:
        async def body(f: Fetcher) -> None:
            p = ahead(f)
            assert [p.want(obj, i, SEQUENTIAL) for i in range(5)] == [BS, BS, BS, None, None]
            assert p.want_object(obj, HINT) is None  # the whole object does not fit either
            assert f.budget.used == 3 * BS
            assert not f.is_resident(obj, 3)
            gate.set()
            await f.drain()
            assert f.budget.used == 0
            assert p.want(obj, 3, SEQUENTIAL) == BS  # room again
            await f.drain()
            assert mem.calls["get"] == 4
            assert await f.read(obj, 0, 8 * BS) == data
            await f.drain()
            assert f.budget.used == 0
            assert mem.calls["get"] == 8

        rig.run(body)
    finally:
        gate.set()
        rig.close()


def test_demand_reads_never_wait_for_the_budget(tmp_path: Path, mem: MemoryStore) -> None:
    data = payload(6 * BS)
    mem.put("k", data)
    obj = version(mem, "k")
    rig = Rig(tmp_path, mem, budget=BS)
    try:
        async def body(f: Fetcher) -> None:
            assert f.budget.try_reserve(BS)  # the budget is exhausted
            with trio.fail_after(5):
                assert await f.read(obj, 0, 6 * BS) == data
            await f.drain()
            assert f.budget.used == BS  # demand reservations were released again
            assert f.budget.try_reserve(1) is False
        rig.run(body)
    finally:
        rig.close()


def test_drain_waits_for_cache_writes(rig: Rig, mem: MemoryStore, monkeypatch: pytest.MonkeyPatch) -> None:
    data = payload(3 * BS)
    mem.put("k", data)
    obj = version(mem, "k")
    real_put_sync = BlockCache.put_sync
    written: list[bytes] = []

    def slow_put_sync(self: BlockCache, bid: bytes, block: bytes) -> bool:
        time.sleep(0.05)
        ok = real_put_sync(self, bid, block)
        written.append(bid)
        return ok

    monkeypatch.setattr(BlockCache, "put_sync", slow_put_sync)

    async def body(f: Fetcher) -> None:
        assert await f.read(obj, 0, 3 * BS) == data
        ids = [f.block_id(obj, i) for i in range(3)]
        assert not any(f.cache.contains(b) for b in ids), "writes should still be running"
        assert f.budget.used == 3 * BS  # reservations held until the block is on disk
        await f.drain()
        assert sorted(written) == sorted(ids)
        assert all(f.cache.contains(b) for b in ids)
        assert f.budget.used == 0
        await f.drain()  # idle: returns at once

    rig.run(body)


def test_block_evicted_from_memory_while_written_is_not_fetched_again(
        rig: Rig, mem: MemoryStore, monkeypatch: pytest.MonkeyPatch) -> None:
    data = payload(3 * BS)
    mem.put("k", data)
    obj = version(mem, "k")
    real_put_sync = BlockCache.put_sync

    def slow_put_sync(self: BlockCache, bid: bytes, block: bytes) -> bool:
        time.sleep(0.1)
        return real_put_sync(self, bid, block)

    monkeypatch.setattr(BlockCache, "put_sync", slow_put_sync)

    async def body(f: Fetcher) -> None:
        assert f.memory.capacity == 0  # nothing stays in the hot set
        assert await f.read(obj, 0, 3 * BS) == data
        assert not f.cache.contains(f.block_id(obj, 0))  # still being written
        assert await f.read(obj, 0, 3 * BS) == data  # served from the pending flight
        assert mem.calls["get"] == 3
        await f.drain()
        assert await f.read(obj, 0, 3 * BS) == data  # now from disk
        assert mem.calls["get"] == 3

    rig.run(body)


# -- failures ------------------------------------------------------------------------------------------
def test_transient_failures_are_retried(tmp_path: Path, mem: MemoryStore) -> None:
    data = payload(2 * BS)
    mem.put("k", data)
    obj = version(mem, "k")
    failures = {"left": 2}
    lock = threading.Lock()

    def flaky(op: str, key: str) -> None:
        with lock:
            if op == "get" and failures["left"]:
                failures["left"] -= 1
                raise TransientStoreError("500 InternalError")

    mem.fault = flaky
    rig = Rig(tmp_path, mem, deadline=30, backoff=Backoff(base=0.001, cap=0.001))
    try:
        async def body(f: Fetcher) -> None:
            assert await f.read(obj, 0, BS) == data[:BS]
        rig.run(body)
        assert mem.calls["get"] == 3
    finally:
        rig.close()


def test_retries_give_up_at_the_deadline_not_after_a_count(tmp_path: Path, mem: MemoryStore) -> None:
    mem.put("k", payload(BS))
    obj = version(mem, "k")

    def always(op: str, key: str) -> None:
        raise TransientStoreError("503 SlowDown", throttled=True)

    mem.fault = always
    rig = Rig(tmp_path, mem, deadline=0.3, backoff=Backoff(base=0.01, cap=0.02))
    try:
        async def body(f: Fetcher) -> float:
            t0 = trio.current_time()
            with pytest.raises(TransientStoreError, match="retry deadline"):
                await f.read(obj, 0, BS)
            return trio.current_time() - t0
        elapsed = rig.run(body)
        assert elapsed >= 0.3  # kept trying until the deadline...
        assert mem.calls["get"] > 8  # ...many more times than the old fixed count
    finally:
        rig.close()


def test_permanent_failure_reaches_every_waiter_and_is_not_cached(rig: Rig, mem: MemoryStore) -> None:
    data = payload(2 * BS)
    mem.put("k", data)
    obj = version(mem, "k")

    def denied(op: str, key: str) -> None:
        if op == "get":
            time.sleep(0.02)
            raise AccessDenied("access denied to s3://bucket/k")

    mem.fault = denied

    async def body(f: Fetcher) -> None:
        errors: list[BaseException] = []

        async def reader(offset: int) -> None:
            try:
                await f.read(obj, offset, 10)
            except AccessDenied as exc:
                errors.append(exc)

        async with trio.open_nursery() as nursery:
            for i in range(5):
                nursery.start_soon(reader, i)
        assert len(errors) == 5
        assert mem.calls["get"] == 1  # one shared failing GET
        # A read spanning two blocks fails with the one error, not an exception group.
        with pytest.raises(AccessDenied):
            await f.read(obj, 0, 2 * BS)
        await f.drain()
        assert f.budget.used == 0
        # The failure is not remembered: once access works again the read succeeds.
        mem.fault = None
        assert await f.read(obj, 0, 2 * BS) == data

    rig.run(body)


# -- bytes altered in transit ----------------------------------------------------------------
def metric(name: str, labels: dict[str, str] | None = None) -> float:
    from cachefs import metrics
    return metrics.REGISTRY.get_sample_value(name, labels or {}) or 0.0


async def until(predicate: Callable[[], bool], timeout: float = 10.0) -> None:
    with trio.fail_after(timeout):
        while not predicate():
            await trio.sleep(0.01)


def alter_gets(store: MemoryStore, which: set[int]) -> list[int]:
    """Alter the bytes of the GETs numbered in ``which`` (1-based), as in transit."""
    seen: list[int] = []
    lock = threading.Lock()

    def mangle(key: str, data: bytes) -> bytes:
        with lock:
            seen.append(len(seen) + 1)
            n = len(seen)
        if n not in which:
            return data
        at = n % len(data)  # another place each time
        return data[:at] + bytes([data[at] ^ 0x55]) + data[at + 1:]
    store.mangle = mangle
    return seen


def test_whole_object_reads_never_return_altered_bytes(rig: Rig, mem: MemoryStore) -> None:
    rig.deadline = 30
    rig.backoff = Backoff(base=0.001, cap=0.001)
    data = payload(BS - 5)
    mem.put("small", data)
    obj = version(mem, "small")
    alter_gets(mem, {1, 2})

    async def body(f: Fetcher) -> None:
        assert await f.read(obj, 0, BS) == data
        await f.drain()
        assert mem.calls["get"] == 3
        assert await f.read(obj, 0, BS) == data  # what was cached is right too

    rig.run(body)


@pytest.mark.parametrize("start", ["read", "ahead"])
def test_whole_object_reads_of_an_etag_that_is_no_md5_are_served_and_cached(
        rig: Rig, mem: MemoryStore, start: str) -> None:
    """Two identical answers that both disagree with the ETag (not an MD5 of the
    content): the bytes are served, and cached by the write-back (their GET's thread
    wrote nothing: they failed its check), whether the load was started by the reader or
    ahead of it (a GET driven by callbacks, Origin.get_soon)."""
    rig.deadline = 30
    rig.backoff = Backoff(base=0.001, cap=0.001)
    data = payload(BS - 5)
    info = mem.put("small", data)
    odd = "0123456789abcdef0123456789abcdef"  # an ETag of another kind
    with mem._lock:
        mem._objects["small"] = (data, info._replace(etag=odd), None)
    obj = ObjectVersion("small", odd, len(data))

    async def body(f: Fetcher) -> None:
        bid = f.block_id(obj, 0)
        if start == "ahead":
            f.budget.force_reserve(obj.size)
            f.load_ahead(obj, 0, bid, reserved=obj.size)
        assert await f.read(obj, 0, BS) == data
        await f.drain()
        assert mem.calls["get"] == 2
        assert f.cache.get_now(bid) == data
        assert f.budget.used == 0

    rig.run(body)


def test_multi_block_object_with_an_altered_block_is_dropped_from_the_cache(
        rig: Rig, mem: MemoryStore) -> None:
    data = payload(5 * BS + 7)
    mem.put("big", data, checksum="crc64nvme")
    obj = version(mem, "big")
    alter_gets(mem, {3})
    mismatches = metric("cachefs_s3_assembled_checks_total", {"result": "mismatch"})

    async def body(f: Fetcher) -> None:
        first = await f.read(obj, 0, len(data))
        assert first != data  # ranged blocks are served as they come (TLS covers them)
        await f.drain()
        await until(lambda: metric("cachefs_s3_assembled_checks_total",
                                   {"result": "mismatch"}) > mismatches)
        assert not any(f.cache.contains(b) for b in f.block_ids(obj))
        gets = mem.calls["get"]
        assert await f.read(obj, 0, len(data)) == data  # fetched again, right this time
        assert mem.calls["get"] == gets + 6
        await f.drain()

    rig.run(body)
    assert metric("cachefs_s3_integrity_errors_total", {"check": "combined_crc64nvme"}) >= 1


def test_multi_block_object_that_checks_out_stays_cached(rig: Rig, mem: MemoryStore) -> None:
    data = payload(4 * BS)
    mem.put("big", data, checksum="crc32c")
    obj = version(mem, "big")
    ok = metric("cachefs_s3_assembled_checks_total", {"result": "ok"})

    async def body(f: Fetcher) -> None:
        assert await f.read(obj, 0, len(data)) == data
        await f.drain()
        await until(lambda: metric("cachefs_s3_assembled_checks_total", {"result": "ok"}) > ok)
        assert all(f.cache.contains(b) for b in f.block_ids(obj))

    rig.run(body)
    assert mem.calls["head"] == 1  # one checksum HEAD for the version


def test_object_filled_across_sessions_is_checked_with_its_cached_blocks(
        rig: Rig, mem: MemoryStore) -> None:
    data = payload(4 * BS)
    mem.put("big", data, checksum="crc64nvme")
    obj = version(mem, "big")
    alter_gets(mem, {1})  # the first block is altered, in the first session
    mismatches = metric("cachefs_s3_assembled_checks_total", {"result": "mismatch"})

    async def first_session(f: Fetcher) -> None:
        await f.read(obj, 0, 2 * BS)
        await f.drain()

    async def second_session(f: Fetcher) -> None:
        await f.read(obj, 0, len(data))
        await f.drain()
        await until(lambda: metric("cachefs_s3_assembled_checks_total",
                                   {"result": "mismatch"}) > mismatches)
        assert await f.read(obj, 0, len(data)) == data

    rig.run(first_session)
    rig.run(second_session)


def test_objects_without_a_full_checksum_are_not_dropped(rig: Rig, mem: MemoryStore) -> None:
    data = payload(3 * BS)
    mem.put("big", data)  # no checksum S3 keeps (an old upload)

    async def body(f: Fetcher) -> None:
        obj = version(mem, "big")
        assert await f.read(obj, 0, len(data)) == data
        await f.drain()
        await trio.sleep(0.1)
        assert all(f.cache.contains(b) for b in f.block_ids(obj))

    rig.run(body)


# -- whole objects written to disk in the GET's thread -------------------------------------------
def _hops(op: str) -> float:
    from cachefs import metrics
    return metrics.REGISTRY.get_sample_value("cachefs_thread_hops_total", {"op": op}) or 0.0


def test_a_whole_object_is_on_disk_when_its_read_returns_with_one_thread_hop(
        rig: Rig, mem: MemoryStore) -> None:
    """A small file's GET writes it to the disk cache in its own worker thread: when the
    read returns the block is indexed and its flight gone, and no second hop was made."""
    data = payload(BS - 3)
    mem.put("small", data)
    obj = version(mem, "small")
    gets, writes = _hops("s3_get"), _hops("cache_write")

    async def body(f: Fetcher) -> None:
        assert await f.read(obj, 0, BS) == data
        bid = f.block_id(obj, 0)
        assert f.cache.contains(bid)
        assert not f.is_loading(bid)
        assert f.budget.used == 0
        assert f.cache.get_now(bid) == data

    rig.run(body)
    assert (_hops("s3_get") - gets, _hops("cache_write") - writes) == (1, 0)


@pytest.mark.parametrize("start", ["read", "ahead"])
def test_a_failing_write_in_the_get_thread_falls_back_to_the_write_back(
        rig: Rig, mem: MemoryStore, monkeypatch: pytest.MonkeyPatch, start: str) -> None:
    """The write in the GET's thread must never fail the read: if it raises (a bug), the
    reader gets its bytes and the block is written back the usual way (a load started
    by the reader, or ahead of it: a GET driven by callbacks, Origin.get_soon)."""
    data = payload(BS - 3)
    mem.put("small", data)
    obj = version(mem, "small")

    def broken(self: BlockCache, bid: bytes, block: bytes) -> bool:
        raise RuntimeError("a bug in the cache write")

    monkeypatch.setattr(BlockCache, "put_now", broken)

    async def body(f: Fetcher) -> None:
        if start == "ahead":
            f.budget.force_reserve(obj.size)
            f.load_ahead(obj, 0, f.block_id(obj, 0), reserved=obj.size)
        assert await f.read(obj, 0, BS) == data
        if start == "ahead":
            await f.wait_loaded(f.block_id(obj, 0))  # (until written back)
            assert f.budget.used == 0
        await f.drain()
        assert f.cache.get_now(f.block_id(obj, 0)) == data  # by the write-back

    rig.run(body)


def test_no_write_from_a_get_thread_once_the_fetcher_has_stopped(
        rig: Rig, mem: MemoryStore, monkeypatch: pytest.MonkeyPatch) -> None:
    """A GET thread abandoned at unmount never writes to the cache once the fetcher has
    stopped (the index is about to be closed); the fetcher's end waits for a write that
    is running."""
    data = payload(BS - 3)
    mem.put("small", data)
    obj = version(mem, "small")
    in_write = threading.Event()
    release = threading.Event()
    real_put_now = BlockCache.put_now
    writes: list[str] = []

    def slow_put_now(self: BlockCache, bid: bytes, block: bytes) -> bool:
        in_write.set()
        release.wait(5)
        writes.append("done")
        return real_put_now(self, bid, block)

    monkeypatch.setattr(BlockCache, "put_now", slow_put_now)
    sinks: list[Any] = []
    late: list[bool] = []

    async def main() -> None:
        async with rig.fetcher() as f:
            sink = f._disk_sink(f.ref(obj, 0), late)
            assert sink is not None
            sinks.append(sink)
            async with trio.open_nursery() as nursery:
                nursery.start_soon(f.read, obj, 0, BS)
                await trio.to_thread.run_sync(in_write.wait, 5)
                # Stop the fetcher while the write runs: its end waits for the write.
                trio.lowlevel.current_trio_token().run_sync_soon(release.set)
                nursery.cancel_scope.cancel()

    trio.run(main)
    assert writes == ["done"]  # the running write finished before the fetcher ended
    sinks[0](data)  # a GET thread finishing after the stop: refused
    assert writes == ["done"] and not late


# -- reads joined from request workers to a load under way ------------------------------------------
@pytest.mark.parametrize("start", ["read", "ahead"])
@pytest.mark.parametrize("fault", [None, "denied", "changed"])
def test_workers_joining_a_load_under_way_share_its_one_get_and_are_answered_once(
        rig: Rig, mem: MemoryStore, fault: str | None, start: str) -> None:
    # A FUSE request worker answers a READ of a one-block file whose GET is running by
    # joining that GET (Fetcher.join_now): many workers and a trio-side reader at once
    # make one GET; each joined reader is answered exactly once, on the trio thread, with
    # its slice of the bytes or with the load's error; none starts a load of its own.
    # The load is started by the trio-side reader (a task), or ahead of the readers for
    # a file found not on disk (a GET driven by callbacks, Origin.get_soon).
    data = payload(BS)
    mem.put("k", data)
    obj = version(mem, "k")

    def gate(op: str, key: str) -> None:
        if op == "get":
            time.sleep(0.1)
            if fault == "denied":
                raise AccessDenied("access denied to s3://bucket/k")
            if fault == "changed":
                raise ObjectChanged("s3://bucket/k changed")

    mem.fault = gate

    async def body(f: Fetcher) -> None:
        trio_thread = threading.get_ident()
        answers: dict[int, list[tuple[bytes | None, BaseException | None, int]]] = {}
        joined: list[bool] = []

        def worker(i: int) -> None:
            def done(got: bytes | None, error: BaseException | None) -> None:
                answers.setdefault(i, []).append((got, error, threading.get_ident()))
            joined.append(f.join_now(obj, i, BS - 2 * i, done))

        async def trio_reader() -> None:
            with contextlib.suppress(AccessDenied, ObjectChanged):
                await f.read(obj, 0, BS)

        changed: list[ObjectVersion] = []
        f.on_changed = changed.append
        if start == "ahead":
            f.budget.force_reserve(BS)
            f.load_ahead(obj, 0, f.block_id(obj, 0), reserved=BS)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(trio_reader)
            await trio.sleep(0.02)  # the load is under way
            threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
            for t in threads:
                t.start()
            for t in threads:
                await trio.to_thread.run_sync(t.join)
        await f.drain()
        assert joined == [True] * 8
        assert sorted(answers) == list(range(8))
        for i, got in answers.items():
            assert len(got) == 1, "answered exactly once"
            data_i, error, thread = got[0]
            assert thread == trio_thread
            if fault is None:
                assert data_i == data[i:BS - i] and error is None
            else:
                assert data_i is None and isinstance(
                    error, AccessDenied if fault == "denied" else ObjectChanged)
        assert mem.calls["get"] == 1
        assert changed == ([obj] if fault == "changed" else [])
        assert f.budget.used == 0
        assert f.cache.contains(f.block_id(obj, 0)) == (fault is None)
        # Once the load has ended nothing is joined: the worker reads memory or disk.
        assert not f.join_now(obj, 0, BS, lambda *_: None)

    rig.run(body)


def test_a_join_never_starts_a_load_nor_joins_a_multi_block_object(
        rig: Rig, mem: MemoryStore) -> None:
    mem.put("small", payload(BS))
    mem.put("big", payload(3 * BS, seed=2))
    small, big = version(mem, "small"), version(mem, "big")
    slow_gets(mem, 0.05)

    async def body(f: Fetcher) -> None:
        assert not f.join_now(small, 0, BS, lambda *_: None), "nothing under way: no join"
        async with trio.open_nursery() as nursery:
            nursery.start_soon(f.read, big, 0, 10)
            await trio.sleep(0.01)
            # (reads of a larger object go through the trio path: its sequential
            # prefetcher must see them)
            assert not f.join_now(big, 0, 10, lambda *_: None)
        assert mem.calls["get"] == 1

    rig.run(body)


# -- pieces: random reads of large objects ----------------------------------------------------
@pytest.fixture
def pieces(monkeypatch: pytest.MonkeyPatch) -> None:
    """Pieces with this module's tiny blocks (a block of 64 bytes: share 8 bytes)."""
    import cachefs.read.fetcher as fetcher_module

    monkeypatch.setattr(fetcher_module, "PIECE_MIN_BLOCK_SIZE", BS)


def test_a_random_read_of_a_large_object_gets_exactly_its_bytes(
        rig: Rig, mem: MemoryStore, pieces: None) -> None:
    data = payload(16 * BS)
    mem.put("k", data)
    obj = version(mem, "k")

    async def body(f: Fetcher) -> None:
        assert await f.read(obj, 5 * BS + 10, 3, random=True) == data[5 * BS + 10:5 * BS + 13]
        assert await f.read(obj, 9 * BS + 60, 7, random=True) == data[9 * BS + 60:9 * BS + 67]
        assert mem.calls["get"] == 2  # one GET each, of the read's bytes only
        await f.drain()
        assert not f.is_cached(obj, 5) and not f.is_cached(obj, 9)  # pieces are not kept
        # a read that is not random, or a small object, reads by blocks as before
        assert await f.read(obj, 2 * BS + 1, 3) == data[2 * BS + 1:2 * BS + 4]
        await f.drain()
        assert f.is_cached(obj, 2) and mem.calls["get"] == 3
        mem.put("small", payload(7 * BS, seed=3))
        small = version(mem, "small")
        await f.read(small, 3 * BS, 2, random=True)
        await f.drain()
        assert f.is_cached(small, 3)

    rig.run(body)


def test_pieces_of_a_block_that_add_up_to_its_share_load_it_whole(
        rig: Rig, mem: MemoryStore, pieces: None) -> None:
    """A block is loaded (and cached) at the first read after the pieces read of it reached
    1/PIECE_SHARE of it (8 of 64 bytes): a reader that reads a file densely ends up caching
    it whole. The first read of a block is a piece whatever its size (a memory map's page
    fault reads the kernel's whole read-around)."""
    data = payload(16 * BS)
    mem.put("k", data)
    obj = version(mem, "k")

    async def body(f: Fetcher) -> None:
        for offset in (4 * BS + 50, 4 * BS + 3, 4 * BS + 30, 4 * BS + 20):  # 4 x 2 bytes
            assert await f.read(obj, offset, 2, random=True) == data[offset:offset + 2]
        await f.drain()
        assert mem.calls["get"] == 4 and not f.is_cached(obj, 4)
        assert await f.read(obj, 4 * BS + 40, 2, random=True) == data[4 * BS + 40:4 * BS + 42]
        await f.drain()  # 8 bytes read as pieces before: the block's load
        assert mem.calls["get"] == 5 and f.is_cached(obj, 4)
        assert await f.read(obj, 4 * BS + 10, 2, random=True) == data[4 * BS + 10:4 * BS + 12]
        assert mem.calls["get"] == 5  # from the cache now
        # half a block at once: a piece; the next read of that block loads it
        assert await f.read(obj, 7 * BS, 32, random=True) == data[7 * BS:7 * BS + 32]
        assert await f.read(obj, 7 * BS + 40, 2, random=True) == data[7 * BS + 40:7 * BS + 42]
        await f.drain()
        assert mem.calls["get"] == 7 and f.is_cached(obj, 7)

    rig.run(body)


def test_readers_of_a_range_a_piece_in_flight_covers_share_its_get(
        rig: Rig, mem: MemoryStore, pieces: None) -> None:
    data = payload(16 * BS)
    mem.put("k", data)
    obj = version(mem, "k")
    slow_gets(mem)

    async def body(f: Fetcher) -> None:
        got: dict[int, bytes] = {}

        async def reader(i: int, offset: int, size: int) -> None:
            got[i] = await f.read(obj, offset, size, random=True)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(reader, 0, 6 * BS + 10, 4)
            await trio.sleep(0.005)  # the first piece is in flight
            nursery.start_soon(reader, 1, 6 * BS + 11, 2)  # inside it: joins
            nursery.start_soon(reader, 2, 6 * BS + 40, 2)  # another range: loads the block
        assert got == {0: data[6 * BS + 10:6 * BS + 14], 1: data[6 * BS + 11:6 * BS + 13],
                       2: data[6 * BS + 40:6 * BS + 42]}
        assert mem.calls["get"] == 2
        await f.drain()
        assert f.is_cached(obj, 6)

    rig.run(body)


def test_a_piece_of_a_changed_object_raises_and_tells_the_change(
        rig: Rig, mem: MemoryStore, pieces: None) -> None:
    v1, v2 = payload(16 * BS, seed=1), payload(16 * BS, seed=2)
    mem.put("k", v1)
    old = version(mem, "k")
    told: list[ObjectVersion] = []

    async def body(f: Fetcher) -> None:
        f.on_changed = told.append
        assert await f.read(old, 3 * BS + 1, 2, random=True) == v1[3 * BS + 1:3 * BS + 3]
        mem.put("k", v2)
        with pytest.raises(ObjectChanged):
            await f.read(old, 11 * BS + 5, 2, random=True)  # If-Match fails: no v2 byte
        assert told == [old]

    rig.run(body)


# -- cold small files loaded ahead: GETs driven by callbacks ---------------------------------
class _Spawned:
    """A trio instrument counting the tasks spawned while it is on."""

    def __init__(self) -> None:
        self.n = 0

    def task_spawned(self, task: trio.lowlevel.Task) -> None:
        self.n += 1


def test_cold_small_files_loaded_ahead_take_no_task_and_one_get_each(
        tmp_path: Path, mem: MemoryStore) -> None:
    """The load of a one-block object found not on local disk (a directory walk's
    lookahead) spawns no task on the trio thread: its whole-object GET is driven by
    callbacks (Origin.get_soon) and written to disk in its worker thread. Each load makes
    one GET; readers that come while it runs join it; when it ends its bytes are on
    disk and in memory, its flight and its memory reservation gone."""
    objs = []
    for i in range(40):
        mem.put(f"f{i}", payload(BS - i % 7, seed=i))
        objs.append(version(mem, f"f{i}"))
    # (0.5 s each: the readers below come while every load is still in flight, however
    # late a busy machine runs them -- at 50 ms, two of ten came after theirs had landed;
    # below the hedge delay's floor, 1 s, so no GET is hedged)
    slow_gets(mem, 0.5)
    gets, joins = _hops("s3_get"), metrics.SINGLE_FLIGHT_JOINS._value.get()
    rig = Rig(tmp_path, mem, connections=64)  # (48 background connections: 40 at once)

    async def body(f: Fetcher) -> None:
        spawned = _Spawned()
        fetched: list[bytes] = []
        trio.lowlevel.add_instrument(spawned)
        try:
            for obj in objs:
                f.budget.force_reserve(obj.size)
                f.load_ahead(obj, 0, f.block_id(obj, 0), reserved=obj.size,
                             fetched=fetched.append)
            assert all(f.is_fetching(f.block_id(obj, 0)) for obj in objs)
            # (the gauge reads the fetcher's count when collected)
            assert metrics.REGISTRY.get_sample_value("cachefs_inflight_fetches") == 40
        finally:
            trio.lowlevel.remove_instrument(spawned)
        # readers of the first ten join their loads (no GET of their own)
        got: dict[int, bytes] = {}

        async def reader(i: int) -> None:
            got[i] = await f.read(objs[i], 0, BS)

        async with trio.open_nursery() as nursery:
            for i in range(10):
                nursery.start_soon(reader, i)
        await f.drain()
        assert spawned.n == 0
        assert sorted(fetched) == sorted(f.block_id(obj, 0) for obj in objs)
        for i, obj in enumerate(objs):
            bid = f.block_id(obj, 0)
            assert f.cache.get_now(bid) == payload(BS - i % 7, seed=i)
            assert not f.is_loading(bid)
        assert got == {i: payload(BS - i % 7, seed=i) for i in range(10)}
        assert f.budget.used == 0
        assert metrics.REGISTRY.get_sample_value("cachefs_inflight_fetches") == 0

    try:
        rig.run(body)
    finally:
        rig.close()
    assert mem.calls["get"] == 40
    assert _hops("s3_get") - gets == 40
    assert metrics.SINGLE_FLIGHT_JOINS._value.get() - joins == 10


def test_a_cold_small_file_loaded_ahead_is_retried_and_fails_at_the_deadline(
        tmp_path: Path, mem: MemoryStore) -> None:
    """A load driven by callbacks whose first GET fails is retried until the retry
    deadline like any load: a transient failure then an answer gives the bytes; S3
    failing throughout fails the load's readers with the deadline's error."""
    mem.put("ok", payload(BS - 1, seed=1))
    mem.put("bad", payload(BS - 1, seed=2))
    failures = {"ok": 1}

    def fault(op: str, key: str) -> None:
        if op != "get":
            return
        if key == "bad" or failures.get(key):
            failures[key] = failures.get(key, 1) - 1
            raise TransientStoreError("503 Service Unavailable", reason="server_error")

    mem.fault = fault
    rig = Rig(tmp_path, mem, deadline=1.0, backoff=Backoff(base=0.05, cap=0.1))
    ok, bad = version(mem, "ok"), version(mem, "bad")

    async def body(f: Fetcher) -> None:
        for obj in (ok, bad):
            f.budget.force_reserve(obj.size)
            f.load_ahead(obj, 0, f.block_id(obj, 0), reserved=obj.size)
        assert await f.read(ok, 0, BS) == payload(BS - 1, seed=1)
        t0 = time.monotonic()
        with pytest.raises(TransientStoreError, match="retry deadline"):
            await f.read(bad, 0, BS)
        assert time.monotonic() - t0 < 3.0
        await f.drain()
        assert f.cache.contains(f.block_id(ok, 0))
        assert not f.cache.contains(f.block_id(bad, 0))
        assert f.budget.used == 0

    try:
        rig.run(body)
    finally:
        rig.close()
    assert mem.calls["get"] >= 2 + 3  # (ok: 2; bad: tried again until the deadline)


def test_a_cold_small_file_loaded_ahead_ends_when_the_fetcher_stops(
        rig: Rig, mem: MemoryStore) -> None:
    """A load driven by callbacks still waiting for S3 when the fetcher ends (unmount)
    is failed at once with "cachefs is stopping": its readers are answered, its GET
    aborted, its memory reservation given back."""
    mem.put("k", payload(BS - 1))
    obj = version(mem, "k")
    aborted = threading.Event()

    def stall(key: str, exchange: Exchange) -> None:
        while not exchange.aborted:
            time.sleep(0.01)
        aborted.set()
        raise TransientStoreError("aborted", reason="stopping")

    mem.on_get = stall
    seen: list[BaseException] = []
    budgets: list[MemoryBudget] = []

    class Stop(Exception):
        pass

    async def main() -> None:
        async with trio.open_nursery() as outer:
            with contextlib.suppress(Stop, BaseExceptionGroup):
                async with rig.fetcher() as f:  # (left by an exception: no drain)
                    budgets.append(f.budget)
                    f.budget.force_reserve(obj.size)
                    f.load_ahead(obj, 0, f.block_id(obj, 0), reserved=obj.size)

                    async def reader() -> None:
                        with pytest.raises(TransientStoreError) as info:
                            await f.read(obj, 0, BS)
                        seen.append(info.value)

                    outer.start_soon(reader)
                    await trio.sleep(0.2)
                    raise Stop()

    t0 = time.monotonic()
    trio.run(main)
    assert time.monotonic() - t0 < 5.0  # (not at the retry deadline)
    assert aborted.wait(5)
    assert len(seen) == 1 and "stopping" in str(seen[0])
    assert budgets[0].used == 0
