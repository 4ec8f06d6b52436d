"""Unit tests of cachefs.read.sweep.Sweeper: what starts a sweep, what it fetches, and its bounds.

Component tests over MemoryStore + BlockCache + Fetcher + Prefetcher (no FUSE); the
directory listings are a dict. Misses are reported as the read path reports them
(``on_miss``); the sweep's task is stepped by hand.
"""

from __future__ import annotations

import random
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import trio

from cachefs import metrics
from cachefs.cache.blocks import BlockCache
from cachefs.cache.lmdbenv import LmdbEnv
from cachefs.cache.metadata import Entry
from cachefs.read.budget import MemoryBudget
from cachefs.read.fetcher import Fetcher, ObjectVersion
from cachefs.read.prefetcher import SWEEP, Prefetcher, PrefetchLedger
from cachefs.read.sweep import Sweeper
from cachefs.s3.memory import MemoryStore
from cachefs.s3.origin import Origin
from tests.conftest import running

BS = 64 * 1024
SIZE = 10_000  # every file


def stops(reason: str) -> float:
    return metrics.REGISTRY.get_sample_value("cachefs_sweep_stops_total", {"reason": reason}) or 0.0


class Listings:
    """Directories as dicts: names in order, numbered like a listing numbers them."""

    def __init__(self) -> None:
        self.dirs: dict[str, list[Entry]] = {}
        self.ino = 100
        self.ahead: list[str] = []
        self.remembered: list[int] = []  # inodes of swept files (remember_entries)

    def add(self, prefix: str, entries: list[Entry]) -> None:
        self.dirs[prefix] = sorted(entries, key=lambda e: e.name)

    def iter_entries(self, prefix: str, after: bytes | None = None) -> Iterator[Entry]:
        for e in self.dirs.get(prefix, []):
            if after is None or e.name > after:
                yield e

    async def ensure(self, prefix: str) -> None:
        await trio.lowlevel.checkpoint()

    def list_ahead(self, prefix: str) -> None:
        self.ahead.append(prefix)

    generation = 0

    def remember_entries(self, prefix: str, generation: int, entries: Any) -> None:
        self.remembered.extend(e.ino for e in entries)

    def dir_ino_now(self, prefix: str) -> tuple[int, int] | None:
        parent = prefix[:prefix.rstrip("/").rfind("/") + 1]
        name = prefix[len(parent):-1].encode()
        folders = [e for e in self.dirs.get(parent, []) if e.is_dir]
        found = next((e for e in folders if e.name == name), None)
        return None if found is None else (found.ino, len(folders))


class World:
    """A store with directories of small files, and the pieces a sweeper runs on."""

    def __init__(self, store: MemoryStore, fetcher: Fetcher, prefetcher: Prefetcher,
                 ledger: PrefetchLedger, cache: BlockCache, listings: Listings) -> None:
        self.store, self.fetcher, self.prefetcher = store, fetcher, prefetcher
        self.ledger, self.cache, self.listings = ledger, cache, listings
        self.files: dict[str, tuple[ObjectVersion, int]] = {}  # key -> (version, inode)

    def make_dir(self, prefix: str, n: int, subdirs: tuple[str, ...] = ()) -> list[str]:
        entries = []
        keys = []
        for i in range(n):
            name = f"img{i:04d}.jpg"
            info = self.store.put(prefix + name, random.Random(prefix + name).randbytes(SIZE))
            self.listings.ino += 1
            entries.append(Entry(name.encode(), False, info.size, 0.0, info.etag, self.listings.ino))
            self.files[prefix + name] = (ObjectVersion(prefix + name, info.etag, info.size),
                                         self.listings.ino)
            keys.append(prefix + name)
        for d in subdirs:
            self.listings.ino += 1
            entries.append(Entry(d.encode(), True, ino=self.listings.ino))
        self.listings.add(prefix, entries)
        return keys

    def sweeper(self, **kw: Any) -> Sweeper:
        def free() -> int:
            return self.cache.capacity - self.cache.used - self.fetcher.budget.used

        args: dict[str, Any] = dict(free_space=free, max_file=BS, ahead_bytes=1 << 30, margin=0)
        args.update(kw)
        return Sweeper(self.prefetcher, self.ledger, self.listings, **args)

    def miss(self, sw: Sweeper, key: str) -> None:
        obj, ino = self.files[key]
        sw.on_miss(key[:key.rfind("/") + 1], ino, obj)

    async def read(self, key: str) -> str:
        """A reader reads ``key`` whole; returns where its block came from."""
        obj, _ = self.files[key]
        _, source = await self.fetcher.get_block(obj, 0)
        return source

    def cached(self, key: str) -> bool:
        return self.fetcher.is_cached(self.files[key][0], 0)

    async def sweep(self, sw: Sweeper, steps: int = 200) -> None:
        """Step the sweep until it has nothing more to do now."""
        for _ in range(steps):
            await sw.step()
            await self.fetcher.drain()
            if not sw.active or sw.paused:
                return


def run(tmp_path: Path, fn: Callable[[World], Awaitable[Any]], *, capacity: int = 64 << 20,
        budget: int = 16 << 20, policy: str = "keep", store: MemoryStore | None = None) -> Any:
    env = LmdbEnv(tmp_path / "meta.lmdb")

    async def main() -> Any:
        nonlocal store
        store = store or MemoryStore()
        ledger = PrefetchLedger()
        cache = BlockCache(env, tmp_path, capacity=capacity, policy=policy)
        fetcher = Fetcher(Origin(store, max_connections=8, deadline=0), cache, block_size=BS,
                          budget=MemoryBudget(budget), hot_capacity=0, notes=ledger)
        prefetcher = Prefetcher(fetcher, fetcher.budget, ledger)
        world = World(store, fetcher, prefetcher, ledger, cache, Listings())
        async with running(fetcher):
            return await fn(world)
    try:
        return trio.run(main)
    finally:
        env.close()


def test_scattered_misses_sweep_the_directory_and_readers_find_it_cached(tmp_path: Path) -> None:
    async def body(w: World) -> None:
        keys = w.make_dir("train/c000/", 60)
        sw = w.sweeper()
        order = keys[:]
        random.Random(1).shuffle(order)
        for key in order[:2]:
            w.miss(sw, key)
            assert await w.read(key) == "s3"
        assert not sw.active, "two misses start nothing"
        # The third miss far from the others starts the sweep.
        far = next(k for k in order[2:] if abs(w.files[k][1] - w.files[order[0]][1]) > 8
                   and abs(w.files[k][1] - w.files[order[1]][1]) > 8)
        w.miss(sw, far)
        assert sw.active
        await w.sweep(sw)
        assert all(w.cached(k) for k in keys), "every file of the directory was swept"
        # (the third miss's own read went to the sweep's load of it: a reader joins it)
        sources = [await w.read(k) for k in order[2:]]
        assert set(sources) == {"disk"}
        assert w.ledger.unread(SWEEP) == 0, "every swept byte was read"
        await w.sweep(sw)
        assert not sw.active, "the session ends when its queue is done"

    run(tmp_path, body)


def test_files_swept_from_s3_are_predicted_and_their_inodes_remembered(tmp_path: Path) -> None:
    """Each file the sweep fetches from S3 -- and no other: not one cached, nor one a
    reader loads -- is told to passthrough with its inode (registered ahead in spare
    room), and its inode is remembered by the listings (its template ahead resolves it
    from memory)."""
    async def body(w: World) -> None:
        keys = w.make_dir("train/c000/", 40)
        predicted: list[tuple[str, int]] = []
        sw = w.sweeper(on_predicted=lambda obj, ino: predicted.append((obj.key, ino)))
        misses = [keys[20], keys[5], keys[35]]
        for key in misses:
            w.miss(sw, key)
            assert await w.read(key) == "s3"
        assert sw.active
        await w.sweep(sw)
        swept = [k for k in keys if k not in misses]
        assert predicted == [(k, w.files[k][1]) for k in swept]
        assert w.listings.remembered == [w.files[k][1] for k in swept]

    run(tmp_path, body)


def test_misses_in_directory_order_start_no_sweep(tmp_path: Path) -> None:
    async def body(w: World) -> None:
        keys = w.make_dir("train/c000/", 200)
        sw = w.sweeper()
        # A pool of 4 readers in directory order, arriving up to 3 files out of order,
        # missing every file (as if nothing predicted them).
        for base in range(0, 200, 4):
            for i in (base + 2, base, base + 3, base + 1):
                w.miss(sw, keys[i])
        assert not sw.active
        assert metrics.SWEEP_FILES._value.get() == 0 or w.ledger.unread(SWEEP) == 0

    run(tmp_path, body)


def test_hinted_files_and_large_files_start_no_sweep(tmp_path: Path) -> None:
    async def body(w: World) -> None:
        keys = w.make_dir("train/c000/", 60)
        sw = w.sweeper(hinted=lambda key: True)
        for key in keys[::7]:
            w.miss(sw, key)
        assert not sw.active, "the hint predicts these files"
        sw = w.sweeper(max_file=SIZE - 1)
        for key in keys[::7]:
            w.miss(sw, key)
        assert not sw.active, "files over one block are read ahead sequentially, not swept"

    run(tmp_path, body)


def test_a_hint_being_followed_ends_the_sweep(tmp_path: Path) -> None:
    async def body(w: World) -> None:
        keys = w.make_dir("train/c000/", 60)
        following = [False]
        sw = w.sweeper(hint_active=lambda: following[0], window=4)
        for key in keys[::9]:
            w.miss(sw, key)
        assert sw.active
        before = stops("hint")
        following[0] = True
        await sw.step()
        assert not sw.active
        assert stops("hint") == before + 1
        assert sum(w.cached(k) for k in keys) <= 7

    run(tmp_path, body)


def test_the_sweep_keeps_at_most_window_files_in_flight(tmp_path: Path) -> None:
    async def body(w: World) -> None:
        keys = w.make_dir("train/c000/", 100)
        sw = w.sweeper(window=5)
        for key in keys[::9]:
            w.miss(sw, key)
        await sw.step()  # (issued loads have not run yet: nothing has had a checkpoint)
        assert sw.inflight == 5
        assert w.ledger.unread(SWEEP) == 5 * SIZE
        await w.sweep(sw)
        assert all(w.cached(k) for k in keys)

    run(tmp_path, body)


def test_spread_to_the_sibling_directories_once_three_are_swept(tmp_path: Path) -> None:
    async def body(w: World) -> None:
        classes = [f"c{i:03d}" for i in range(8)]
        w.make_dir("train/", 0, subdirs=tuple(classes))
        keys = {c: w.make_dir(f"train/{c}/", 30) for c in classes}
        w.make_dir("val/", 5)
        sw = w.sweeper()
        for c in ("c005", "c002"):
            for key in keys[c][::10]:
                w.miss(sw, key)
        assert sw.active
        await w.sweep(sw)
        assert not any(w.cached(k) for c in classes if c not in ("c005", "c002")
                       for k in keys[c]), "two swept siblings do not spread"
        for key in keys["c007"][::10]:
            w.miss(sw, key)
        await w.sweep(sw)
        assert all(w.cached(k) for c in classes for k in keys[c]), "every class folder swept"
        assert not any(w.cached(f"val/img{i:04d}.jpg") for i in range(5)), "only siblings"
        assert "train/" in w.listings.ahead

    run(tmp_path, body)


def test_a_sweep_fills_free_space_only_and_evicts_nothing(tmp_path: Path) -> None:
    async def body(w: World) -> None:
        old = w.make_dir("old/", 40)
        for key in old:
            await w.read(key)  # 40 files cached by readers (LRU: evictable)
        await w.fetcher.drain()
        keys = w.make_dir("train/c000/", 60)
        sw = w.sweeper(margin=2 * SIZE)
        before = stops("no_space")
        for key in keys[::9]:
            w.miss(sw, key)
            await w.read(key)
        await w.sweep(sw)
        assert all(w.cached(k) for k in old), "the sweep evicted cached files"
        # (less one file: the cache's used bytes may lag one concurrent write behind)
        free = w.cache.capacity - w.cache.used
        assert free >= SIZE, f"the margin stays free: {free}"
        swept = sum(w.cached(k) for k in keys)
        assert 7 < swept < 60, swept
        assert not sw.active and stops("no_space") == before + 1
        # A full cache starts no sweep at all.
        more = w.make_dir("train/c001/", 60)
        for key in more[::9][:3]:
            w.miss(sw, key)
        assert not sw.active
        assert stops("no_space") == before + 2

    # Room for 56 files of the 100 (10,000 bytes take 12 KiB on disk): 40 cached, the
    # margin of about 2, and 14 to sweep or read.
    run(tmp_path, body, capacity=70 * SIZE, policy="lru")


def test_a_subset_reader_stops_the_sweep_at_its_unread_bound(tmp_path: Path) -> None:
    async def body(w: World) -> None:
        keys = w.make_dir("train/c000/", 400)
        ahead = 20 * SIZE
        sw = w.sweeper(ahead_bytes=ahead, read_factor=2.0)
        subset = keys[::37]  # 11 files, far apart
        before = stops("unread_bound")
        for key in subset[:3]:
            w.miss(sw, key)
            await w.read(key)
        await w.sweep(sw)
        assert sw.paused == "unread_bound" and stops("unread_bound") == before + 1
        assert w.ledger.unread(SWEEP) <= ahead
        swept = sum(w.cached(k) for k in keys) - 3
        assert 20 <= swept <= 23, swept
        # The reader reads the rest of its subset; the sweep goes on by twice that.
        for key in subset[3:]:
            if not w.cached(key):
                w.miss(sw, key)
            await w.read(key)
        await w.sweep(sw)
        unread = w.ledger.unread(SWEEP)
        assert unread <= sw.allowance() <= ahead + 2 * 11 * SIZE
        swept = sum(w.cached(k) for k in keys)
        assert swept < 80, f"a reader of 11 files had {swept} files swept"

    run(tmp_path, body)


def test_a_shuffled_epoch_is_swept_whole_under_a_small_unread_bound(tmp_path: Path) -> None:
    async def body(w: World) -> None:
        keys = w.make_dir("train/c000/", 300)
        sw = w.sweeper(ahead_bytes=10 * SIZE, window=8)
        order = keys[:]
        random.Random(3).shuffle(order)
        sources = []
        for i, key in enumerate(order):
            if not w.cached(key):
                w.miss(sw, key)
            sources.append(await w.read(key))
            if i % 4 == 3:
                await sw.step()
                await w.fetcher.drain()
        swept = sources.count("disk")
        assert swept > 200, f"only {swept} of 300 files came from the sweep"
        assert w.ledger.unread(SWEEP) == 0, "a shuffled epoch reads every swept file"

    run(tmp_path, body)


def test_readers_moving_on_get_their_new_directory_swept_before_the_old_one(
        tmp_path: Path) -> None:
    async def body(w: World) -> None:
        old = w.make_dir("train/c000/", 400)
        new = w.make_dir("train/c001/", 200)
        sw = w.sweeper(ahead_bytes=20 * SIZE)
        for key in old[::37][:3]:  # a reader of a few files far apart
            w.miss(sw, key)
            await w.read(key)
        await w.sweep(sw)
        assert sw.paused == "unread_bound"
        swept_old = sum(w.cached(k) for k in old)
        # Readers now miss in another directory, far apart: it is swept first, by twice
        # what they read there.
        misses = [k for k in new[::13] if not w.cached(k)]
        for key in misses:
            w.miss(sw, key)
            await w.read(key)
            await w.sweep(sw)
        assert sum(w.cached(k) for k in old) == swept_old, "the old directory waited"
        swept_new = sum(w.cached(k) for k in new) - len(misses)
        assert swept_new >= 2 * (len(misses) - 3) - 1, (swept_new, len(misses))

    run(tmp_path, body)


def test_a_sweep_short_of_room_only_by_bytes_in_flight_waits_for_them_before_it_ends(
        tmp_path: Path) -> None:
    """Bytes in flight count against the free space, and a block's bytes are counted in
    the cache's used bytes once written before its reservation is released: for a moment
    they count twice (longer on a busy machine). A sweep that finds room short only by
    what is in flight waits for it to settle; it ends for want of room only when the
    room is short without it."""
    async def body(w: World) -> None:
        keys = w.make_dir("train/c000/", 60)
        sw = w.sweeper()
        for key in keys[::9]:
            w.miss(sw, key)
            await w.read(key)
        assert sw.active
        before = stops("no_space")
        # As if 20 files' bytes were written and still reserved: counted twice.
        ghost = 20 * SIZE
        w.fetcher.budget.force_reserve(ghost)
        await sw.step()
        await w.fetcher.drain()
        assert sw.active and stops("no_space") == before, "ended while bytes were in flight"
        w.fetcher.budget.release(ghost)
        await w.sweep(sw)
        assert stops("no_space") == before + 1 and not sw.active
        swept = sum(w.cached(k) for k in keys)
        # Room for 30 files of 12 KiB on disk: all of it taken, none evicted.
        assert swept == 30, swept

    run(tmp_path, body, capacity=30 * 12 * 1024, policy="lru")


def test_misses_scattered_over_folders_of_two_files_sweep_them(tmp_path: Path) -> None:
    """A folder of two files never shows misses scattered inside it: shuffled readers of
    600 such folders fetched every file on demand (51 files/s, 1.5x rclone). Misses
    scattered over the parent's folders start the sweep of the folder and queue its
    siblings; readers missing folder after folder in directory order start nothing."""
    async def body(w: World) -> None:
        folders = [f"f{i:03d}" for i in range(60)]
        w.make_dir("t/", 0, subdirs=tuple(folders))
        keys = {f: w.make_dir(f"t/{f}/", 2) for f in folders}
        sw = w.sweeper()
        for f in folders[:12]:  # in directory order: a miss in each next folder
            w.miss(sw, keys[f][0])
        assert not sw.active, "readers in directory order started a sweep"
        for f in ("f040", "f017", "f055"):  # shuffled: misses all over the parent's folders
            w.miss(sw, keys[f][1])
        assert sw.active
        await w.sweep(sw)
        assert all(w.cached(k) for f in folders[12:] for k in keys[f]), "every folder swept"

    run(tmp_path, body)
