"""Component tests of cachefs.fs.FileSystem over Metadata + Fetcher + MemoryStore (no FUSE)."""

from __future__ import annotations

import errno
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing

import cachefs.fs as fs_mod
from cachefs.cache.blocks import BlockCache
from cachefs.cache.lmdbenv import LmdbEnv
from cachefs.cache.metadata import Metadata
from cachefs.errors import NoSuchBucket, ObjectChanged
from cachefs.fs import ROOT_INODE, FileSystem, FsError, NeedsWait
from cachefs.read.budget import MemoryBudget
from cachefs.read.fetcher import Fetcher, ObjectVersion
from cachefs.read.hints import ReadOrder, metadata_resolver
from cachefs.read.lookahead import DirectoryLookahead
from cachefs.read.prefetcher import Prefetcher, PrefetchLedger
from cachefs.s3.memory import MemoryStore
from cachefs.s3.origin import Origin

BS = 64


class Clock:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


class World:
    """A bucket, a cache directory and a way to run a FileSystem over them in trio."""

    def __init__(self, tmp_path: Path, root_prefix: str = "ds/") -> None:
        self.store = MemoryStore(page_size=2)
        self.root = tmp_path / "cache"
        self.root.mkdir()
        self.env = LmdbEnv(self.root / "meta.lmdb")
        self.clock = Clock()
        self.root_prefix = root_prefix

    def run(self, fn: Callable[[FileSystem], Awaitable[Any]], *, ttl: float = 300.0) -> Any:
        async def main() -> Any:
            origin = Origin(self.store, max_connections=8, deadline=0)  # no retries
            cache = BlockCache(self.env, self.root, capacity=1 << 20)
            fetcher = Fetcher(origin, cache, block_size=BS, budget=MemoryBudget(1 << 20),
                              hot_capacity=1 << 16)
            metadata = Metadata(self.env, self.store, ttl=ttl, limiter=trio.CapacityLimiter(8),
                                clock=self.clock)
            prefetcher = Prefetcher(fetcher, fetcher.budget, PrefetchLedger())
            fs = FileSystem(metadata, fetcher, root_prefix=self.root_prefix, max_readahead=4 * BS,
                            prefetcher=prefetcher,
                            read_order=ReadOrder(prefetcher, metadata_resolver(metadata),
                                                 lookahead_bytes=16 * BS),
                            lookahead=DirectoryLookahead(prefetcher, metadata.iter_entries))
            async with trio.open_nursery() as nursery:
                await nursery.start(fetcher.run)
                await nursery.start(metadata.run)
                try:
                    return await fn(fs)
                finally:
                    nursery.cancel_scope.cancel()
        return trio.run(main)


@pytest.fixture
def world(tmp_path: Path) -> Any:
    w = World(tmp_path)
    s = w.store
    s.put("ds/a.bin", b"A" * 100)
    s.put("ds/b.bin", bytes(range(200)))
    s.put("ds/c.txt", b"hello")
    s.put("ds/sub/x", b"xx")
    s.put("ds/sub/y", b"yyy")
    s.put("ds/zdir/", b"")  # directory marker
    s.put("other/outside", b"not in the mount")
    yield w
    w.env.close()


ROOT_NAMES = [b"a.bin", b"b.bin", b"c.txt", b"sub", b"zdir"]


async def read_all(fs: FileSystem, fh: int, start: int = 0) -> list[tuple[int, bytes]]:
    return [(pos, node.name) for pos, node in await fs.readdir(fh, start)]


# -- lookups and inodes ------------------------------------------------------------------------------
def test_lookup_attributes_and_inodes(world: World) -> None:
    async def body(fs: FileSystem) -> None:
        a = await fs.lookup(ROOT_INODE, b"a.bin")
        assert not a.is_dir and a.size == 100 and a.path == "ds/a.bin"
        assert a.etag == world.store.head("ds/a.bin").etag
        again = await fs.lookup(ROOT_INODE, b"a.bin")
        assert again.ino == a.ino and again == a
        sub = await fs.lookup(ROOT_INODE, b"sub")
        assert sub.is_dir and sub.path == "ds/sub/" and sub.ino not in (ROOT_INODE, a.ino)
        x = await fs.lookup(sub.ino, b"x")
        assert x.size == 2 and x.path == "ds/sub/x"
        # Nothing is kept per inode: forgetting is a no-op and the inode still resolves.
        fs.forget(a.ino, 1)
        assert fs.node(a.ino) == a
        fs.forget(ROOT_INODE, 100)
        assert fs.node(ROOT_INODE).is_dir
        fs.forget(999_999, 1)
        with pytest.raises(FsError) as ei:
            fs.node(999_999)
        assert ei.value.errno == errno.ESTALE

    world.run(body)


def test_dot_and_dotdot(world: World) -> None:
    async def body(fs: FileSystem) -> None:
        sub = await fs.lookup(ROOT_INODE, b"sub")
        assert await fs.lookup(sub.ino, b".") == sub
        assert (await fs.lookup(sub.ino, b"..")).ino == ROOT_INODE
        assert (await fs.lookup(ROOT_INODE, b"..")).ino == ROOT_INODE

    world.run(body)


def test_errors(world: World) -> None:
    async def body(fs: FileSystem) -> None:
        a = await fs.lookup(ROOT_INODE, b"a.bin")
        sub = await fs.lookup(ROOT_INODE, b"sub")
        cases: list[tuple[int, Awaitable[Any]]] = [
            (errno.ENOENT, fs.lookup(ROOT_INODE, b"nope")),
            (errno.ENOENT, fs.lookup(ROOT_INODE, b"outside")),
            (errno.ENOENT, fs.lookup(sub.ino, b"a.bin")),
            (errno.ENOTDIR, fs.lookup(a.ino, b"x")),
            (errno.ENOTDIR, fs.opendir(a.ino)),
            (errno.EISDIR, fs.open(sub.ino)),
            (errno.EISDIR, fs.open(ROOT_INODE)),
            (errno.ESTALE, fs.getattr(424242)),
            (errno.ESTALE, fs.open(424242)),
            (errno.EBADF, fs.read(777, 0, 1)),
            (errno.EBADF, fs.readdir(777, 0)),
        ]
        for code, coro in cases:
            with pytest.raises(FsError) as ei:
                await coro
            assert ei.value.errno == code, coro

    world.run(body)


def test_store_errors_pass_through(world: World) -> None:
    def no_bucket(op: str, key: str) -> None:
        raise NoSuchBucket("bucket 'bucket' does not exist")

    world.store.fault = no_bucket

    async def body(fs: FileSystem) -> None:
        with pytest.raises(NoSuchBucket):
            await fs.lookup(ROOT_INODE, b"a.bin")

    world.run(body)


# -- readdir --------------------------------------------------------------------------------------------
def test_readdir_positions_and_continuation(world: World) -> None:
    async def body(fs: FileSystem) -> None:
        fh = await fs.opendir(ROOT_INODE)
        everything = await read_all(fs, fh)
        assert everything == list(zip(range(1, 6), ROOT_NAMES, strict=True))

        # The kernel accepts two entries, then continues from the last accepted position.
        accepted = []
        for pos, node in await fs.readdir(fh, 0):
            fs.readdir_progress(fh, pos, node)
            accepted.append((pos, node.name))
            if len(accepted) == 2:
                break
        assert accepted == everything[:2]
        assert await read_all(fs, fh, 2) == everything[2:]

        # Continuation is by name: an entry inserted before the position (the listing was
        # refreshed meanwhile) neither repeats nor skips entries.
        world.store.put("ds/a0", b"new")
        fs.metadata.invalidate("ds/")
        await fs.metadata.settled("ds/")
        assert [n for _, n in await read_all(fs, fh, 2)] == ROOT_NAMES[2:]
        assert [n for _, n in await read_all(fs, fh, 0)] == [b"a.bin", b"a0", *ROOT_NAMES[1:]]
        await fs.lookup(ROOT_INODE, b"a0")  # the kernel may look it up without readdir
        world.store.delete("ds/a0")
        fs.metadata.invalidate("ds/")
        await fs.metadata.settled("ds/")
        for pos, node in await fs.readdir(fh, 0):
            fs.readdir_progress(fh, pos, node)
            if pos == 2:
                break

        # Arbitrary restart positions (e.g. after seekdir).
        for start in range(6):
            assert await read_all(fs, fh, start) == everything[start:]
        assert await read_all(fs, fh, 50) == []
        fs.releasedir(fh)
        with pytest.raises(FsError):
            await fs.readdir(fh, 0)

    world.run(body)


def test_readdir_nodes_match_lookup(world: World) -> None:
    async def body(fs: FileSystem) -> None:
        fh = await fs.opendir(ROOT_INODE)
        nodes = {node.name: node for _, node in await fs.readdir(fh, 0)}
        assert nodes[b"sub"].is_dir and nodes[b"zdir"].is_dir
        assert nodes[b"b.bin"].size == 200
        assert await fs.lookup(ROOT_INODE, b"b.bin") == nodes[b"b.bin"]
        sub_fh = await fs.opendir(nodes[b"sub"].ino)
        assert await read_all(fs, sub_fh) == [(1, b"x"), (2, b"y")]
        empty_fh = await fs.opendir(nodes[b"zdir"].ino)
        assert await read_all(fs, empty_fh) == []

    world.run(body)


def test_readdir_lists_once_per_ttl(world: World) -> None:
    async def body(fs: FileSystem) -> None:
        fh = await fs.opendir(ROOT_INODE)
        await read_all(fs, fh)
        await fs.metadata.settled("ds/")  # (readdir streams: the listing may still be ending)
        lists = world.store.calls["list"]
        for _ in range(3):
            fh = await fs.opendir(ROOT_INODE)
            await read_all(fs, fh)
            await fs.lookup(ROOT_INODE, b"a.bin")
        assert world.store.calls["list"] == lists
        world.store.put("ds/new", b"n")
        world.clock.now += 301
        fh = await fs.opendir(ROOT_INODE)
        # Expired: served at once (stale-while-revalidate), refreshed in the background.
        assert [n for _, n in await read_all(fs, fh)] == ROOT_NAMES
        await fs.metadata.settled("ds/")
        assert world.store.calls["list"] > lists
        fh = await fs.opendir(ROOT_INODE)
        assert [n for _, n in await read_all(fs, fh)] == [*ROOT_NAMES[:3], b"new", *ROOT_NAMES[3:]]

    world.run(body)


# -- open / read / keep_cache ------------------------------------------------------------------------------
def test_read_returns_object_bytes(world: World) -> None:
    data = bytes(range(200))

    async def body(fs: FileSystem) -> None:
        b = await fs.lookup(ROOT_INODE, b"b.bin")
        fh, _, _bk = await fs.open(b.ino)
        assert await fs.read(fh, 0, 1000) == data
        assert await fs.read(fh, 63, 3) == data[63:66]
        assert await fs.read(fh, 190, 50) == data[190:]
        assert await fs.read(fh, 200, 10) == b""
        assert fs.open_handles == 1
        fs.release(fh)
        assert fs.open_handles == 0
        with pytest.raises(FsError) as ei:
            await fs.read(fh, 0, 1)
        assert ei.value.errno == errno.EBADF

    world.run(body)


def test_sequential_reads_prefetch_ahead(world: World) -> None:
    world.store.put("ds/big", bytes(i % 256 for i in range(20 * BS)))

    async def body(fs: FileSystem) -> None:
        node = await fs.lookup(ROOT_INODE, b"big")
        fh, _, _bk = await fs.open(node.ino)
        obj = fs._handles[fh].obj  # type: ignore[union-attr]
        gets = world.store.calls["get"]
        assert await fs.read(fh, 0, BS) == bytes(i % 256 for i in range(BS))  # + block 1 ahead
        await fs.read(fh, BS, BS)  # window 2 blocks: 2, 3 ahead
        await fs.fetcher.drain()
        assert world.store.calls["get"] == gets + 4
        assert all(fs.fetcher.is_resident(obj, i) for i in range(4))
        assert not fs.fetcher.is_resident(obj, 4)
        await fs.read(fh, 2 * BS, BS)  # block 2 is resident; window 4 blocks (the max): 3..6
        await fs.fetcher.drain()
        assert world.store.calls["get"] == gets + 7
        assert not fs.fetcher.is_resident(obj, 7)
        # A random reader of another handle gets no readahead.
        fh2, _, _bk = await fs.open(node.ino)
        await fs.read(fh2, 15 * BS, 10)
        await fs.fetcher.drain()
        assert world.store.calls["get"] == gets + 8

    world.run(body)


def test_keep_cache_and_a_new_inode_per_version(world: World) -> None:
    async def body(fs: FileSystem) -> None:
        c = await fs.lookup(ROOT_INODE, b"c.txt")
        await fs.metadata.settled("ds/")
        fh1, keep1, _bk = await fs.open(c.ino)
        assert keep1 is True  # an inode is one version: its page cache is always right
        fs.release(fh1)
        # The object changes; once the listing is refreshed its name is a new inode and
        # the old one is stale (the kernel then looks the name up again).
        world.store.put("ds/c.txt", b"HELLO, world")
        world.clock.now += 301
        fh2, _, _bk = await fs.open(c.ino)  # served from the stale listing at once
        fs.release(fh2)
        await fs.metadata.settled("ds/")
        with pytest.raises(FsError) as ei:
            await fs.open(c.ino)
        assert ei.value.errno == errno.ESTALE
        c2 = await fs.lookup(ROOT_INODE, b"c.txt")
        assert c2.ino != c.ino and c2.size == 12
        fh3, keep3, _bk = await fs.open(c2.ino)
        assert keep3 is True
        assert await fs.read(fh3, 0, 100) == b"HELLO, world"

    world.run(body)


def test_open_within_ttl_keeps_the_listed_version(world: World) -> None:
    async def body(fs: FileSystem) -> None:
        c = await fs.lookup(ROOT_INODE, b"c.txt")
        old_etag = c.etag
        world.store.put("ds/c.txt", b"changed")
        fh, _, _bk = await fs.open(c.ino)  # listing still fresh: the listed version is pinned
        assert c.etag == old_etag
        with pytest.raises(ObjectChanged):
            await fs.read(fh, 0, 10)

    world.run(body)


def test_read_of_changed_object_raises_and_invalidates_the_listing(world: World) -> None:
    async def body(fs: FileSystem) -> None:
        sub = await fs.lookup(ROOT_INODE, b"sub")
        x = await fs.lookup(sub.ino, b"x")
        fh, _, _bk = await fs.open(x.ino)
        assert await fs.read(fh, 0, 10) == b"xx"
        world.store.put("ds/sub/x", b"new x!")
        assert fs.metadata.is_fresh("ds/sub/")
        fh2, keep, _bk = await fs.open(x.ino)
        assert keep is True  # the listing does not know yet
        # Block 0 of the old version is still cached: it is served (consistently the old version).
        assert await fs.read(fh2, 0, 10) == b"xx"
        await fs.fetcher.drain()  # the block is on disk, no load of it is pending
        fs.fetcher.memory = type(fs.fetcher.memory)(0)
        bid = fs.fetcher.block_id(fs._handles[fh2].obj, 0)  # type: ignore[union-attr]
        await trio.to_thread.run_sync(fs.fetcher.cache._remove, [bid])
        with pytest.raises(ObjectChanged):
            await fs.read(fh2, 0, 10)
        assert not fs.metadata.is_fresh("ds/sub/")
        assert fs.metadata.is_fresh("ds/")  # only the file's directory
        await fs.metadata.settled("ds/sub/")  # refreshed in the background
        with pytest.raises(FsError) as ei:
            await fs.open(x.ino)
        assert ei.value.errno == errno.ESTALE  # the kernel looks "x" up again...
        x2 = await fs.lookup(sub.ino, b"x")  # ...and finds the new version
        assert x2.size == 6
        fh3, _, _bk = await fs.open(x2.ino)
        assert await fs.read(fh3, 0, 10) == b"new x!"

    world.run(body)


def test_an_open_after_a_load_ahead_saw_the_change_finds_the_new_version(world: World) -> None:
    """A load no reader asked for (a prefetch) finds the listed version replaced in S3
    while the listing is fresh: until the new listing is there, an open through the old
    inode answers ESTALE and a lookup of the name waits for that listing, so the kernel's
    second try (a LOOKUP, then an OPEN) opens the new version; a handle open already keeps
    its version: its cached bytes, ESTALE for the rest."""
    async def body(fs: FileSystem) -> None:
        b = await fs.lookup(ROOT_INODE, b"b.bin")  # 200 bytes: 4 blocks
        await fs.metadata.settled("ds/")
        held, _, _bk = await fs.open(b.ino)
        assert await fs.read(held, 0, BS) == bytes(range(BS))  # block 0 cached
        # The read's readahead ends first: a GET of it seeing the change later would start
        # the listing's refresh before the limiter below is held, and the lookup would
        # find the new listing instead of waiting for it.
        await fs.fetcher.drain()
        world.store.put("ds/b.bin", b"B" * 150)
        assert fs.metadata.is_fresh("ds/")
        # The listing's refresh cannot run yet: the lookup below must wait for it.
        limiter = fs.metadata._limiter
        holders = [object() for _ in range(int(limiter.total_tokens))]
        for h in holders:
            await limiter.acquire_on_behalf_of(h)
        old = ObjectVersion(b.path, b.etag, b.size)
        fs.fetcher.load_ahead(old, 2, fs.fetcher.block_id(old, 2), reserved=0)
        with pytest.raises(ObjectChanged):
            await fs.fetcher.wait_loaded(fs.fetcher.block_id(old, 2))
        with pytest.raises(FsError) as ei:
            fs.open_now(b.ino)
        assert ei.value.errno == errno.ESTALE  # the kernel looks the name up again...
        with pytest.raises(NeedsWait):
            fs.lookup_fresh_now(ROOT_INODE, b"b.bin")  # ...which waits for the listing
        found: list[Any] = []

        async def lookup() -> None:
            found.append(await fs.lookup(ROOT_INODE, b"b.bin"))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(lookup)
            await trio.testing.wait_all_tasks_blocked()
            assert not found, "answered before the new listing"
            for h in holders:
                limiter.release_on_behalf_of(h)
        (b2,) = found
        assert b2.ino != b.ino and b2.size == 150
        fh, _, _bk = fs.open_now(b2.ino)
        assert await fs.read(fh, 0, 1000) == b"B" * 150
        # The held handle still reads its own version: cached bytes, ESTALE for the rest.
        assert fs.getattr_now(b.ino, held).size == 200
        assert await fs.read(held, 0, BS) == bytes(range(BS))
        with pytest.raises(ObjectChanged):
            await fs.read(held, 2 * BS, BS)

    world.run(body)


def test_a_lookup_waits_for_a_changed_versions_listing_only_briefly(
        world: World, monkeypatch: pytest.MonkeyPatch) -> None:
    """When S3 does not list (LISTs throttled or failing, an outage) the listing a lookup
    of a changed version waits for may take the whole retry deadline, and a process in a
    LOOKUP the daemon holds cannot even be killed: the wait is bounded (REFRESH_WAIT).
    Then the lookup answers with the listing it has, as before the version was marked (the
    open goes on: cached bytes, ESTALE at the first read of what S3 no longer has), and a
    GET that sees the same change again soon after does not make the next lookup wait
    again."""
    monkeypatch.setattr(fs_mod, "REFRESH_WAIT", 0.2)

    async def body(fs: FileSystem) -> None:
        b = await fs.lookup(ROOT_INODE, b"b.bin")
        await fs.metadata.settled("ds/")
        world.store.put("ds/b.bin", b"B" * 150)
        limiter = fs.metadata._limiter  # the refresh never runs in this test
        holders = [object() for _ in range(int(limiter.total_tokens))]
        for h in holders:
            await limiter.acquire_on_behalf_of(h)
        old = ObjectVersion(b.path, b.etag, b.size)

        async def a_get_sees_the_change(index: int) -> None:
            fs.fetcher.load_ahead(old, index, fs.fetcher.block_id(old, index), reserved=0)
            with pytest.raises(ObjectChanged):
                await fs.fetcher.wait_loaded(fs.fetcher.block_id(old, index))

        await a_get_sees_the_change(2)
        with pytest.raises(FsError) as ei:
            fs.open_now(b.ino)  # marked: the kernel looks the name up again...
        assert ei.value.errno == errno.ESTALE
        with trio.fail_after(10):  # (a hang guard: the wait is 0.2 s)
            again = await fs.lookup(ROOT_INODE, b"b.bin")  # ...and gets an answer
        assert again.ino == b.ino  # the listing it has: the old version
        fs.open_now(b.ino)  # its open goes on, as before the mark
        # Another GET sees the same change moments later: no mark, no wait again.
        await a_get_sees_the_change(3)
        assert not fs._outdated("ds/", b)
        fs.open_now(b.ino)
        with trio.fail_after(10):
            assert (await fs.lookup(ROOT_INODE, b"b.bin")).ino == b.ino

    world.run(body)


def test_getattr_serves_stale_attributes_while_refreshing(world: World) -> None:
    async def body(fs: FileSystem) -> None:
        a = await fs.lookup(ROOT_INODE, b"a.bin")
        await fs.metadata.settled("ds/")
        world.store.put("ds/a.bin", b"short")
        assert (await fs.getattr(a.ino)).size == 100  # fresh listing: no S3 request
        lists = world.store.calls["list"]
        world.clock.now += 301
        assert (await fs.getattr(a.ino)).size == 100  # stale: served, refresh started
        await fs.metadata.settled("ds/")
        assert world.store.calls["list"] > lists
        with pytest.raises(FsError) as ei:
            await fs.getattr(a.ino)
        assert ei.value.errno == errno.ESTALE
        assert (await fs.lookup(ROOT_INODE, b"a.bin")).size == 5
        world.store.delete("ds/a.bin")
        world.clock.now += 301
        await fs.lookup(ROOT_INODE, b"b.bin")
        await fs.metadata.settled("ds/")
        with pytest.raises(FsError) as ei:
            await fs.lookup(ROOT_INODE, b"a.bin")
        assert ei.value.errno == errno.ENOENT

    world.run(body)


def test_an_open_file_revalidated_through_its_handle_keeps_its_version(world: World) -> None:
    """The object changed and its listing was refreshed: a GETATTR the kernel sends for an
    open handle (its revalidation before a read) gets that handle's version, and the read
    goes on; so does one without the handle (an fstat) or through another inode's handle
    while a handle holds the inode open. Once none does, ESTALE (the kernel looks the
    name up again)."""
    async def body(fs: FileSystem) -> None:
        a = await fs.lookup(ROOT_INODE, b"a.bin")
        b = await fs.lookup(ROOT_INODE, b"b.bin")
        await fs.metadata.settled("ds/")
        fh, _, _bk = await fs.open(a.ino)
        other, _, _bk = await fs.open(b.ino)
        before = await fs.read(fh, 0, 1000)  # (cached: served after the change too)
        world.store.put("ds/a.bin", b"short")
        world.clock.now += 301
        fs.getattr_now(a.ino)  # stale: served, refresh started
        await fs.metadata.settled("ds/")
        for asked in (fh, None, other):
            kept = fs.getattr_now(a.ino, asked)
            assert kept.ino == a.ino and kept.size == 100
        assert await fs.read(fh, 0, 1000) == before and len(before) == 100
        fs.release(fh)
        for asked in (fh, None, other):  # (released: no handle holds a.bin's inode)
            with pytest.raises(FsError) as ei:
                fs.getattr_now(a.ino, asked)
            assert ei.value.errno == errno.ESTALE
        fs.release(other)

    world.run(body)


def test_root_prefix_empty_mounts_the_whole_bucket(tmp_path: Path) -> None:
    w = World(tmp_path, root_prefix="")
    w.store.put("top", b"t")
    w.store.put("dir/f", b"f")
    try:
        async def body(fs: FileSystem) -> None:
            fh = await fs.opendir(ROOT_INODE)
            assert await read_all(fs, fh) == [(1, b"dir"), (2, b"top")]
            d = await fs.lookup(ROOT_INODE, b"dir")
            f = await fs.lookup(d.ino, b"f")
            ofh, _, _bk = await fs.open(f.ino)
            assert await fs.read(ofh, 0, 10) == b"f"

        w.run(body)
    finally:
        w.env.close()


def test_an_open_handle_keeps_reading_its_version(world: World) -> None:
    async def body(fs: FileSystem) -> None:
        c = await fs.lookup(ROOT_INODE, b"c.txt")
        await fs.metadata.settled("ds/")
        old_fh, _, _bk = await fs.open(c.ino)
        assert await fs.read(old_fh, 0, 100) == b"hello"  # v1 block now cached
        world.store.put("ds/c.txt", b"HELLO")  # same size, new version
        world.clock.now += 301
        await fs.lookup(ROOT_INODE, b"c.txt")
        await fs.metadata.settled("ds/")
        new = await fs.lookup(ROOT_INODE, b"c.txt")
        assert new.ino != c.ino  # its own inode: the kernel keeps no v1 pages for it
        new_fh, _, _bk = await fs.open(new.ino)
        assert await fs.read(new_fh, 0, 100) == b"HELLO"
        assert await fs.read(old_fh, 0, 100) == b"hello"  # served from the block cache
    world.run(body)
