"""The LMDB index under load and after damage (issue 16, part 4).

* Reader slots: no read transaction lives across an await, so many concurrent
  reads of cached blocks use a handful of slots (py-lmdb frees a slot only when
  the Transaction object is freed); the slots in use are exported.
* Any error from the index is a cache miss served from S3, counted, never EIO.
* A damaged index (bytes overwritten, a plain file where its directory should
  be) is wiped at mount with one log line, and the cache starts empty.
"""

from __future__ import annotations

import random
import threading
import time
from pathlib import Path
from typing import Any

import lmdb
import pytest
import trio

from cachefs import metrics
from cachefs.cache.blocks import BlockCache
from cachefs.cache.lmdbenv import LmdbEnv
from cachefs.read.budget import MemoryBudget
from cachefs.read.fetcher import Fetcher, ObjectVersion
from cachefs.s3.memory import MemoryStore
from cachefs.s3.origin import Origin
from tests.conftest import drop_page_cache

BS = 4096


def _sample(name: str) -> float:
    return metrics.REGISTRY.get_sample_value(name) or 0.0


def _payload(n: int, seed: int) -> bytes:
    return random.Random(seed).randbytes(n)


# -- components: Fetcher over BlockCache over a real LMDB environment ------------------------
def _fetcher(env: LmdbEnv, root: Path, store: MemoryStore, *, disk_threads: int = 2) -> Fetcher:
    cache = BlockCache(env, root, capacity=1 << 30,
                       limiter=trio.CapacityLimiter(disk_threads))
    return Fetcher(Origin(store, max_connections=4, deadline=0), cache, block_size=BS,
                   budget=MemoryBudget(1 << 24), hot_capacity=0)


def test_many_concurrent_reads_of_cached_blocks_use_few_reader_slots(tmp_path: Path) -> None:
    store = MemoryStore()
    objects = [ObjectVersion(f"k{i}", "", 64 * BS) for i in range(8)]
    bodies = {}
    for i, obj in enumerate(objects):
        bodies[obj.key] = _payload(obj.size, i)
        store.put(obj.key, bodies[obj.key])
    objects = [ObjectVersion(o.key, store.head(o.key).etag, o.size) for o in objects]
    env = LmdbEnv(tmp_path / "meta.lmdb", max_readers=24)
    try:
        async def main() -> None:
            fetcher = _fetcher(env, tmp_path, store)
            async with trio.open_nursery() as nursery:
                await nursery.start(fetcher.run)
                for obj in objects:  # cache every block
                    assert await fetcher.read(obj, 0, obj.size) == bodies[obj.key]
                await fetcher.drain()
                gets = store.calls["get"]
                peak = [0]

                async def sample() -> None:
                    while True:
                        peak[0] = max(peak[0], env.readers_in_use())
                        await trio.sleep(0)

                nursery.start_soon(sample)
                results: dict[tuple[str, int], bytes] = {}

                async def read_block(obj: ObjectVersion, i: int) -> None:
                    results[obj.key, i] = await fetcher.read(obj, i * BS, BS)

                # 512 reads wait at once for 2 disk threads, with 24 reader slots.
                async with trio.open_nursery() as readers:
                    for obj in objects:
                        for i in range(64):
                            readers.start_soon(read_block, obj, i)
                nursery.cancel_scope.cancel()
            assert store.calls["get"] == gets, "cached blocks were fetched again"
            for (key, i), data in results.items():
                assert data == bodies[key][i * BS:(i + 1) * BS]
            assert peak[0] <= 8, f"{peak[0]} reader slots in use"

        errors = _sample("cachefs_cache_index_errors_total")
        trio.run(main)
        assert _sample("cachefs_cache_index_errors_total") == errors
    finally:
        env.close()


def test_speculative_loads_of_cached_blocks_are_bounded(tmp_path: Path) -> None:
    store = MemoryStore()
    body = _payload(32 * BS, 5)
    store.put("k", body)
    obj = ObjectVersion("k", store.head("k").etag, len(body))
    env = LmdbEnv(tmp_path / "meta.lmdb")
    try:
        async def main() -> None:
            fetcher = _fetcher(env, tmp_path, store)
            fetcher.max_disk_ahead = 4
            async with trio.open_nursery() as nursery:
                await nursery.start(fetcher.run)
                assert await fetcher.read(obj, 0, obj.size) == body
                await fetcher.drain()
                for i in range(32):
                    fetcher.load_ahead(obj, i, fetcher.block_id(obj, i), reserved=0)
                assert sum(fetcher.is_loading(fetcher.block_id(obj, i)) for i in range(32)) == 4
                await fetcher.drain()
                for i in range(32):  # room again once those finished
                    fetcher.load_ahead(obj, i, fetcher.block_id(obj, i), reserved=0)
                assert sum(fetcher.is_loading(fetcher.block_id(obj, i)) for i in range(32)) == 4
                assert await fetcher.read(obj, 0, obj.size) == body
                nursery.cancel_scope.cancel()

        trio.run(main)
    finally:
        env.close()


class _FailingEnv:
    """Wraps an lmdb Environment: read transactions fail (any LMDB error) while armed."""

    def __init__(self, env: Any, error: Exception) -> None:
        self._env = env
        self.error = error
        self.armed = False

    def begin(self, write: bool = False, **kwargs: Any) -> Any:
        if self.armed and not write:
            raise self.error
        return self._env.begin(write=write, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._env, name)


@pytest.mark.parametrize("error", [lmdb.ReadersFullError("full"), lmdb.CorruptedError("bad"),
                                   lmdb.BadTxnError("bad txn"), lmdb.PanicError("panic")],
                         ids=lambda e: type(e).__name__)
def test_an_index_error_is_a_miss_served_from_s3(tmp_path: Path, error: Exception) -> None:
    store = MemoryStore()
    body = _payload(5 * BS + 7, 3)
    store.put("k", body)
    obj = ObjectVersion("k", store.head("k").etag, len(body))
    env = LmdbEnv(tmp_path / "meta.lmdb")
    failing = _FailingEnv(env.env, error)
    env.env = failing
    try:
        async def main() -> None:
            fetcher = _fetcher(env, tmp_path, store)
            async with trio.open_nursery() as nursery:
                await nursery.start(fetcher.run)
                assert await fetcher.read(obj, 0, obj.size) == body
                await fetcher.drain()
                gets = store.calls["get"]
                failing.armed = True
                assert await fetcher.read(obj, 0, obj.size) == body  # from S3
                assert store.calls["get"] == gets + 6
                assert not fetcher.is_cached(obj, 0)
                nursery.cancel_scope.cancel()

        errors = _sample("cachefs_cache_index_errors_total")
        trio.run(main)
        assert _sample("cachefs_cache_index_errors_total") > errors
    finally:
        env.env = failing._env
        env.close()


def test_the_reader_slot_gauge(tmp_path: Path) -> None:
    env = LmdbEnv(tmp_path / "meta.lmdb", max_readers=16)
    try:
        assert _sample("cachefs_lmdb_reader_slots") == 16
        base = _sample("cachefs_lmdb_readers")
        with env.read():
            assert _sample("cachefs_lmdb_readers") >= base + (0 if base else 1)
        assert env.readers_in_use() <= 1  # py-lmdb keeps one spare
    finally:
        env.close()


# -- real mounts ------------------------------------------------------------------------------
MIB = 1 << 20


@pytest.mark.drops_caches
@pytest.mark.fuse
def test_many_readers_of_cached_files_hold_few_reader_slots(bucket, mount_factory) -> None:  # type: ignore[no-untyped-def]
    """The issue's load, scaled down: many readers of files already on local disk, read
    through the daemon in small blocks; the slots are counted from outside."""
    client, name = bucket
    files = {f"c/{i:02d}.bin": _payload(4 * MIB, i) for i in range(12)}
    for key, body in files.items():
        client.put_object(Bucket=name, Key=key, Body=body)
    m = mount_factory(f"s3://{name}", "--block-size", "64K", "--passthrough", "off",
                      "--native-reads", "off", "--memory-budget", "4M")  # most reads go to the disk
    for key, body in files.items():
        assert (m.path / key).read_bytes() == body
    deadline = time.monotonic() + 60
    while m.metric("cachefs_cache_blocks") < 12 * 64:
        assert time.monotonic() < deadline
        time.sleep(0.1)
    gets = m.gets()
    drop_page_cache()
    outside = lmdb.open(str(m.cache_dir / "meta.lmdb"), readonly=True, max_dbs=8)
    peak = 0
    stop = threading.Event()

    def sample() -> None:
        nonlocal peak
        while not stop.is_set():
            peak = max(peak, len(outside.readers().splitlines()) - 1)
            time.sleep(0.002)

    errors: list[BaseException] = []

    def reader(key: str) -> None:
        try:
            for _ in range(2):
                assert (m.path / key).read_bytes() == files[key]
        except BaseException as exc:  # reported below
            errors.append(exc)

    sampler = threading.Thread(target=sample)
    sampler.start()
    threads = [threading.Thread(target=reader, args=(k,)) for k in files]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    stop.set()
    sampler.join()
    outside.close()
    assert not errors, errors
    assert m.gets() == gets
    assert m.metric("cachefs_cache_index_errors_total") == 0
    # Only threads reading the index need a slot: the trio thread and the 16 disk threads
    # (before: every read waiting for a disk thread kept one; 104 seen here).
    assert peak <= 24, f"{peak} reader slots in use"
    assert m.metric("cachefs_lmdb_reader_slots") > 0


def _wipe_lines(log: str) -> list[str]:
    return [line for line in log.splitlines() if "cache index" in line and "wiped" in line]


@pytest.mark.fuse
@pytest.mark.parametrize("damage", ["overwritten", "plain_file"])
def test_a_damaged_index_is_wiped_at_mount(bucket, mount_factory, damage) -> None:  # type: ignore[no-untyped-def]
    client, name = bucket
    files = {f"d/{i}.bin": _payload(100_000 + i, i) for i in range(20)}
    for key, body in files.items():
        client.put_object(Bucket=name, Key=key, Body=body)
    m = mount_factory(f"s3://{name}", "--block-size", "64K")
    for key, body in files.items():
        assert (m.path / key).read_bytes() == body
    m.stop()
    index = m.cache_dir / "meta.lmdb"
    if damage == "overwritten":
        with open(index / "data.mdb", "r+b") as f:
            f.seek(8192)
            f.write(random.Random(16).randbytes(64 * 1024))
    else:
        import shutil

        shutil.rmtree(index)
        index.write_bytes(b"not an index\n")
    m.start()
    for key, body in files.items():
        assert (m.path / key).read_bytes() == body
    assert m.gets() >= len(files), "the cache did not start empty"
    assert len(_wipe_lines(m.log())) == 1, m.log()[-3000:]
    assert "Traceback" not in m.log()
    assert m.metric("cachefs_fuse_internal_errors_total") == 0
    m.stop()
    m.start()  # the new index is sound: nothing wiped, everything cached
    for key, body in files.items():
        assert (m.path / key).read_bytes() == body
    assert m.gets() == 0
    assert len(_wipe_lines(m.log())) == 1
