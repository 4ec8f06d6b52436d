"""Unit tests of cachefs.cache.metadata: listing rules, LMDB persistence, TTL, single flight."""

from __future__ import annotations

import dataclasses
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing

from cachefs.cache.index import F_DIR, pack_entry, unpack_entry
from cachefs.cache.lmdbenv import LmdbEnv
from cachefs.cache.metadata import Entry, Metadata, entries_from_listing, invalid_name_reason
from cachefs.errors import AccessDenied, CacheError, NoSuchBucket, TransientStoreError
from cachefs.s3.memory import MemoryStore
from cachefs.s3.store import ObjectInfo


def obj(key: str, size: int = 1, etag: str = "e", mtime: float = 1.0) -> ObjectInfo:
    return ObjectInfo(key, size, etag, mtime)


# -- entries_from_listing ------------------------------------------------------------------
def test_listing_rules_marker_and_sort_order() -> None:
    skipped: Counter[str] = Counter()
    entries = entries_from_listing(
        "data/",
        [obj("data/", 0), obj("data/b.bin", 5, "eb", 2.0), obj("data/a.bin", 3, "ea", 1.0)],
        ["data/sub/", "data/Z/"],
        skipped,
    )
    assert [e.name for e in entries] == [b"Z", b"a.bin", b"b.bin", b"sub"]  # bytes order
    by_name = {e.name: e for e in entries}
    assert by_name[b"a.bin"] == Entry(b"a.bin", False, 3, 1.0, "ea")
    assert by_name[b"sub"].is_dir and by_name[b"Z"].is_dir
    assert not skipped  # the directory's own marker is not a skip


def test_a_directory_marker_with_data_is_counted_not_hidden_silently() -> None:
    # "data/" holding bytes: no file name can show them (the name is the directory itself).
    skipped: Counter[str] = Counter()
    entries = entries_from_listing("data/", [obj("data/", 7), obj("data/a", 1)], [], skipped)
    assert [e.name for e in entries] == [b"a"]
    assert skipped == Counter({"marker_with_data": 1})


def test_listing_directory_wins_over_object_of_same_name() -> None:
    skipped: Counter[str] = Counter()
    entries = entries_from_listing("", [obj("a"), obj("b")], ["a/"], skipped)
    assert [(e.name, e.is_dir) for e in entries] == [(b"a", True), (b"b", False)]
    assert skipped == Counter({"shadowed": 1})


def test_listing_skips_invalid_names_by_reason() -> None:
    skipped: Counter[str] = Counter()
    long_name = "x" * 256
    entries = entries_from_listing(
        "p/",
        [obj("p/."), obj("p/.."), obj("p/" + long_name), obj("p/nul\0name"), obj("p/ok"),
         obj("p/" + "y" * 255)],
        ["p//", "p/../", "p/" + long_name + "/", "p/d\0/", "p/dir/"],
        skipped,
    )
    assert [e.name for e in entries] == [b"dir", b"ok", b"y" * 255]
    assert skipped == Counter({"dot": 3, "too_long": 2, "nul": 2, "empty": 1})


def test_too_long_counts_utf8_bytes() -> None:
    assert invalid_name_reason("é" * 127) is None  # 254 bytes
    assert invalid_name_reason("é" * 128) == "too_long"  # 256 bytes, 128 characters
    assert invalid_name_reason("") == "empty"
    assert invalid_name_reason("..") == "dot"
    assert invalid_name_reason("a\0") == "nul"


# -- Metadata over LMDB + MemoryStore --------------------------------------------------------
class Clock:
    def __init__(self, now: float = 1_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def env(tmp_path: Path) -> Iterator[LmdbEnv]:
    e = LmdbEnv(tmp_path / "meta.lmdb")
    yield e
    e.close()


@pytest.fixture
def store() -> MemoryStore:
    s = MemoryStore(page_size=3)
    for i in range(8):
        s.put(f"data/f{i}", b"x" * i, mtime=100.0 + i)
    s.put("data/sub/inner", b"inner")
    s.put("data/sub2/", b"")  # a directory marker
    s.put("top", b"t")
    return s


def run_with_metadata(env: LmdbEnv, store: MemoryStore, fn: Callable[[Metadata], object], *,
                      ttl: float = 300.0, clock: Callable[[], float] = time.time,
                      list_ahead: int = 0, root: str | None = None) -> None:
    async def main() -> None:
        md = Metadata(env, store, ttl=ttl, limiter=trio.CapacityLimiter(8), clock=clock,
                      list_ahead=list_ahead, root=root)
        async with trio.open_nursery() as nursery:
            await nursery.start(md.run)
            await fn(md)  # type: ignore[misc]
            nursery.cancel_scope.cancel()

    trio.run(main)


def same(entry: Entry | None, expected: Entry) -> bool:
    """Equal but for the inode number (a hash)."""
    return entry is not None and entry.ino > 1 and \
        (entry.name, entry.is_dir, entry.size, entry.mtime, entry.etag) == \
        (expected.name, expected.is_dir, expected.size, expected.mtime, expected.etag)


def names(md: Metadata, prefix: str, after: bytes | None = None) -> list[bytes]:
    return [e.name for e in md.iter_entries(prefix, after=after)]


EXPECTED_DATA = [b"f0", b"f1", b"f2", b"f3", b"f4", b"f5", b"f6", b"f7", b"sub", b"sub2"]


def test_ensure_lists_all_pages_once_then_serves_from_lmdb(env: LmdbEnv, store: MemoryStore) -> None:
    async def body(md: Metadata) -> None:
        assert md.listed_at("data/") is None and not md.is_fresh("data/")
        await md.ensure("data/")
        lists = store.calls["list"]
        assert lists == 4  # 10 entries in pages of 3
        assert names(md, "data/") == EXPECTED_DATA
        assert md.count("data/") == 10
        f3 = md.get("data/", b"f3")
        assert f3 is not None and (f3.size, f3.mtime, f3.is_dir) == (3, 103.0, False)
        assert f3.etag == store.head("data/f3").etag
        assert same(md.get("data/", b"sub2"), Entry(b"sub2", True))
        assert md.get("data/", b"missing") is None
        for _ in range(5):
            await md.ensure("data/")
        assert store.calls["list"] == lists
        assert md.is_fresh("data/")

    run_with_metadata(env, store, body)


def test_ttl_expiry_relists(env: LmdbEnv, store: MemoryStore) -> None:
    clock = Clock()

    async def body(md: Metadata) -> None:
        await md.ensure("")
        assert names(md, "") == [b"data", b"top"]
        first = store.calls["list"]
        clock.now += 59
        await md.ensure("")
        assert store.calls["list"] == first
        store.put("zz", b"new")
        clock.now += 2  # 61 s after the listing: expired
        assert not md.is_fresh("")
        await md.ensure("")  # served at once (stale-while-revalidate)...
        assert names(md, "") == [b"data", b"top"]
        await md.settled("")  # ...while the refresh runs in the background
        assert store.calls["list"] == first + 1
        assert names(md, "") == [b"data", b"top", b"zz"]
        assert md.listed_at("") == clock.now

    run_with_metadata(env, store, body, ttl=60, clock=clock)


def test_infinite_ttl_never_expires(env: LmdbEnv, store: MemoryStore) -> None:
    clock = Clock()

    async def body(md: Metadata) -> None:
        await md.ensure("")
        clock.now += 10 * 365 * 86400
        assert md.is_fresh("")
        await md.ensure("")
        assert store.calls["list"] == 1

    run_with_metadata(env, store, body, ttl=float("inf"), clock=clock)


def test_invalidate_forces_one_relist_and_replaces_entries(env: LmdbEnv, store: MemoryStore) -> None:
    async def body(md: Metadata) -> None:
        await md.ensure("data/")
        lists = store.calls["list"]
        store.delete("data/f0")
        store.delete("data/sub/inner")
        new = store.put("data/f1", b"changed!")
        md.invalidate("data/")
        assert not md.is_fresh("data/")
        assert names(md, "data/") == EXPECTED_DATA  # old listing until refreshed
        await md.settled("data/")
        assert store.calls["list"] == lists + 3  # 8 entries, pages of 3
        assert md.is_fresh("data/")
        assert names(md, "data/") == [b"f1", b"f2", b"f3", b"f4", b"f5", b"f6", b"f7", b"sub2"]
        assert md.count("data/") == 8
        f1 = md.get("data/", b"f1")
        assert f1 is not None and f1.etag == new.etag and f1.size == 8
        assert md.get("data/", b"f0") is None
        await md.ensure("data/")
        assert store.calls["list"] == lists + 3

    run_with_metadata(env, store, body)


def test_concurrent_ensure_is_single_flight(env: LmdbEnv, store: MemoryStore) -> None:
    entered = threading.Event()

    def slow(op: str, key: str) -> None:
        if op == "list":
            entered.set()
            time.sleep(0.02)

    store.fault = slow

    async def body(md: Metadata) -> None:
        done: list[int] = []

        async def one(i: int) -> None:
            await md.ensure("data/")
            assert names(md, "data/") == EXPECTED_DATA
            done.append(i)

        async with trio.open_nursery() as nursery:
            for i in range(10):
                nursery.start_soon(one, i)
        assert sorted(done) == list(range(10))
        assert entered.is_set()
        assert store.calls["list"] == 4  # one listing (4 pages) for ten callers

    run_with_metadata(env, store, body)


def test_different_prefixes_are_listed_independently(env: LmdbEnv, store: MemoryStore) -> None:
    async def body(md: Metadata) -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(md.ensure, "")
            nursery.start_soon(md.ensure, "data/sub/")
        assert names(md, "") == [b"data", b"top"]
        assert names(md, "data/sub/") == [b"inner"]
        assert md.listed_at("data/") is None
        assert names(md, "data/") == []

    run_with_metadata(env, store, body)


def _sample(name: str) -> float:
    from cachefs import metrics

    return metrics.REGISTRY.get_sample_value(name) or 0.0


def test_failed_refresh_keeps_serving_the_stale_listing(env: LmdbEnv, store: MemoryStore) -> None:
    clock = Clock()

    async def body(md: Metadata) -> None:
        await md.ensure("data/")
        lists = store.calls["list"]

        def fail(op: str, key: str) -> None:
            raise TransientStoreError("503 SlowDown", throttled=True)

        store.fault = fail
        clock.now += 1000
        failures = _sample("cachefs_metadata_refresh_failures_total")
        await md.ensure("data/")  # does not raise
        await md.settled("data/")
        assert store.calls["list"] == lists + 1
        assert _sample("cachefs_metadata_refresh_failures_total") == failures + 1
        assert names(md, "data/") == EXPECTED_DATA
        assert not md.is_fresh("data/")
        await md.ensure("data/")  # no new try right after a failure
        assert store.calls["list"] == lists + 1
        md.invalidate("data/")
        await md.ensure("data/")  # still does not raise
        await md.settled("data/")
        assert store.calls["list"] == lists + 2
        assert names(md, "data/") == EXPECTED_DATA
        store.fault = None
        clock.now += 60  # past the back-off: the next access refreshes again
        await md.ensure("data/")
        await md.settled("data/")
        assert md.is_fresh("data/")

    run_with_metadata(env, store, body, ttl=60, clock=clock)


def test_failed_first_listing_raises(env: LmdbEnv, store: MemoryStore) -> None:
    def fail(op: str, key: str) -> None:
        raise NoSuchBucket("bucket 'bucket' does not exist")

    store.fault = fail

    async def body(md: Metadata) -> None:
        with pytest.raises(NoSuchBucket):
            await md.ensure("data/")
        assert md.listed_at("data/") is None
        store.fault = None
        await md.ensure("data/")
        assert names(md, "data/") == EXPECTED_DATA

    run_with_metadata(env, store, body)


def test_failed_first_listing_raises_for_every_concurrent_caller(env: LmdbEnv, store: MemoryStore) -> None:
    def fail(op: str, key: str) -> None:
        time.sleep(0.01)
        raise AccessDenied("access denied")

    store.fault = fail

    async def body(md: Metadata) -> None:
        errors: list[BaseException] = []

        async def one() -> None:
            try:
                await md.ensure("data/")
            except AccessDenied as exc:
                errors.append(exc)

        async with trio.open_nursery() as nursery:
            for _ in range(3):
                nursery.start_soon(one)
        assert len(errors) == 3
        assert md.listed_at("data/") is None

    run_with_metadata(env, store, body)


def test_listing_persists_across_reopen(tmp_path: Path, store: MemoryStore) -> None:
    path = tmp_path / "meta.lmdb"
    clock = Clock()
    env = LmdbEnv(path)
    try:
        run_with_metadata(env, store, lambda md: md.ensure("data/"), clock=clock)
    finally:
        env.close()
    lists = store.calls["list"]
    env2 = LmdbEnv(path)
    try:
        async def body(md: Metadata) -> None:
            assert md.is_fresh("data/")
            await md.ensure("data/")
            assert names(md, "data/") == EXPECTED_DATA
            assert md.count("data/") == 10

        run_with_metadata(env2, store, body, clock=clock)
        assert store.calls["list"] == lists
    finally:
        env2.close()


def test_iter_entries_after_continues(env: LmdbEnv, store: MemoryStore) -> None:
    async def body(md: Metadata) -> None:
        await md.ensure("data/")
        await md.ensure("")
        assert names(md, "data/", after=b"f3") == EXPECTED_DATA[4:]
        assert names(md, "data/", after=b"sub2") == []
        assert names(md, "data/", after=b"f3x") == EXPECTED_DATA[4:]  # a name not present
        assert names(md, "data/", after=b"") == EXPECTED_DATA
        assert names(md, "data/", after=b"a") == EXPECTED_DATA
        # Continuation never leaks into another directory's entries.
        assert names(md, "", after=b"data") == [b"top"]
        # Reassemble the whole directory in chunks of two.
        got: list[bytes] = []
        after = None
        while True:
            chunk = [e.name for _, e in zip(range(2), md.iter_entries("data/", after=after), strict=False)]
            if not chunk:
                break
            got += chunk
            after = chunk[-1]
        assert got == EXPECTED_DATA

    run_with_metadata(env, store, body)


@pytest.mark.parametrize("flags,etag", [(0, "d41d8cd98f00b204e9800998ecf8427e"),
                                         (0, "d41d8cd98f00b204e9800998ecf8427e-3"),
                                         (0, ""), (F_DIR, "")])
def test_an_entry_unpacked_equals_the_one_packed(flags: int, etag: str) -> None:
    """unpack_entry builds an Entry through its slots, not its __init__: every field is
    set, and the result is the Entry built the ordinary way (equal, same hash, frozen)."""
    raw = pack_entry(flags, 123_456, 1_700_000_000.7, 98_765, etag)
    got = unpack_entry(b"img_000123.jpg", raw)
    want = Entry(b"img_000123.jpg", bool(flags & F_DIR), 123_456, 1_700_000_000.0, etag, 98_765)
    assert got == want and hash(got) == hash(want) and repr(got) == repr(want)
    assert [getattr(got, f.name) for f in dataclasses.fields(Entry)] == \
        [getattr(want, f.name) for f in dataclasses.fields(Entry)]
    with pytest.raises(dataclasses.FrozenInstanceError):
        got.size = 1  # type: ignore[misc]


def test_deep_prefixes_longer_than_lmdb_key_limit(env: LmdbEnv) -> None:
    store = MemoryStore(page_size=2)
    deep = "/".join(["d" * 200] * 4) + "/"  # 804 bytes: longer than LMDB's 511-byte keys
    assert len(deep.encode()) > 511
    store.put(deep + "x" * 255, b"long name")
    store.put(deep + "b", b"b")
    store.put(deep + "child/leaf", b"leaf")

    async def body(md: Metadata) -> None:
        await md.ensure(deep)
        assert names(md, deep) == [b"b", b"child", b"x" * 255]
        e = md.get(deep, b"x" * 255)
        assert e is not None and e.size == len(b"long name")
        assert names(md, deep, after=b"b") == [b"child", b"x" * 255]
        await md.ensure(deep + "child/")
        assert names(md, deep + "child/") == [b"leaf"]

    run_with_metadata(env, store, body)


def test_refresh_sync_counts_skipped_keys(env: LmdbEnv) -> None:
    from cachefs import metrics

    store = MemoryStore()
    store.put("a", b"shadowed object")
    store.put("a/b", b"in dir")
    store.put("..", b"dot")
    before = metrics.REGISTRY.get_sample_value("cachefs_skipped_keys_total", {"reason": "shadowed"}) or 0.0
    md = Metadata(env, store, ttl=60, limiter=trio.CapacityLimiter(1))
    assert md.refresh_sync("") == 1
    after = metrics.REGISTRY.get_sample_value("cachefs_skipped_keys_total", {"reason": "shadowed"})
    assert after == before + 1
    assert names(md, "") == [b"a"]
    got = md.get("", b"a")
    assert got is not None and got.is_dir


def test_invalidate_during_refresh_is_not_lost(env: LmdbEnv) -> None:
    store = MemoryStore(page_size=1)
    store.put("d/a", b"v1")
    store.put("d/b", b"b")
    holder: dict[str, Metadata] = {}
    calls = {"n": 0}

    def change_during_listing(op: str, key: str) -> None:
        if op == "list":
            calls["n"] += 1
            if calls["n"] == 2:
                # Page 1 (with d/a v1) is already read: the object changes and a reader
                # notices (ESTALE) while the listing is still running.
                store.put("d/a", b"v2")
                holder["md"].invalidate("d/")

    store.fault = change_during_listing

    async def body(md: Metadata) -> None:
        holder["md"] = md
        await md.ensure("d/")
        await md.settled("d/")
        entry = md.get("d/", b"a")
        assert entry is not None
        listing_is_current = entry.etag == store.head("d/a").etag
        assert listing_is_current or not md.is_fresh("d/"), \
            "an outdated listing is considered fresh despite invalidate()"

    run_with_metadata(env, store, body)


def test_failed_first_listing_is_shared_by_concurrent_callers(env: LmdbEnv, store: MemoryStore) -> None:
    def fail(op: str, key: str) -> None:
        time.sleep(0.01)
        raise AccessDenied("access denied")

    store.fault = fail

    async def body(md: Metadata) -> None:
        async def one() -> None:
            with pytest.raises(AccessDenied):
                await md.ensure("data/")

        async with trio.open_nursery() as nursery:
            for _ in range(5):
                nursery.start_soon(one)
        assert store.calls["list"] == 1, f"{store.calls['list']} serial listings for one failure"

    run_with_metadata(env, store, body)


# -- stale-while-revalidate, streaming, inodes, listing ahead ---------------------------------
class Gate:
    """A store fault that holds listings of chosen prefixes until opened."""

    def __init__(self) -> None:
        self.open = threading.Event()
        self.prefixes: set[str] = set()
        self.after_pages = 0  # pages let through before holding
        self.seen = 0

    def __call__(self, op: str, key: str) -> None:
        if op == "list" and key in self.prefixes:
            self.seen += 1
            if self.seen > self.after_pages:
                assert self.open.wait(10), "gate never opened"


def test_stale_listing_is_served_while_the_refresh_waits_on_s3(env: LmdbEnv, store: MemoryStore) -> None:
    clock = Clock()
    gate = Gate()

    async def body(md: Metadata) -> None:
        await md.ensure("data/")
        old = md.get("data/", b"f1")
        store.put("data/f1", b"changed")
        gate.prefixes.add("data/")
        store.fault = gate
        clock.now += 301  # expired
        stale = _sample("cachefs_metadata_stale_served_total")
        with trio.fail_after(5):  # never waits on S3 (the gate holds the refresh)
            entry = await md.lookup("data/", b"f1")
            await md.ensure("data/")
            assert [e.name for e in md.iter_entries("data/")] == EXPECTED_DATA
        assert entry == old
        # each answer from the expired listing is counted, the refresh running or not
        assert _sample("cachefs_metadata_stale_served_total") >= stale + 2
        assert not md.is_fresh("data/")
        gate.open.set()
        await md.settled("data/")
        new = await md.lookup("data/", b"f1")
        assert new is not None and old is not None and new.etag != old.etag
        assert new.ino != old.ino  # a new version is a new inode
        assert md.is_fresh("data/")

    run_with_metadata(env, store, body, ttl=300, clock=clock)


def test_a_wait_for_a_refresh_ends_with_the_listing_made_after_its_invalidation(
        env: LmdbEnv, store: MemoryStore) -> None:
    """refreshed(prefix, tick) waits for a listing started after the invalidation that
    returned ``tick`` (the listing it started, here held by S3), not for later ones."""
    gate = Gate()

    async def body(md: Metadata) -> None:
        await md.ensure("data/")
        old = md.get("data/", b"f1")
        assert not md.refresh_pending("data/")
        store.put("data/f1", b"changed")
        gate.prefixes.add("data/")
        store.fault = gate
        first = md.invalidate("data/")  # its refresh starts, held by the gate
        assert md.refresh_pending("data/", first)
        done: list[Entry | None] = []

        async def wait() -> None:
            await md.refreshed("data/", first)
            done.append(md.get("data/", b"f1"))

        with trio.fail_after(10):  # (a hang guard)
            async with trio.open_nursery() as nursery:
                nursery.start_soon(wait)
                await trio.testing.wait_all_tasks_blocked()
                assert not done, "returned before the listing"
                second = md.invalidate("data/")  # while it runs: it is listed once more
                assert second > first and md.refresh_pending("data/", second)
                gate.open.set()
        (new,) = done
        assert new is not None and old is not None and new.etag != old.etag
        assert not md.refresh_pending("data/", first)
        await md.settled("data/")
        assert not md.refresh_pending("data/")

    run_with_metadata(env, store, body)


def test_first_listing_streams_names_before_it_completes(env: LmdbEnv) -> None:
    from cachefs.cache import metadata as md_mod

    store = MemoryStore(page_size=500)
    for i in range(3000):
        store.put(f"big/f{i:05d}", b"x")
    gate = Gate()
    gate.prefixes.add("big/")
    gate.after_pages = 3  # pages 1-3 arrive, the rest waits
    store.fault = gate
    old_flush = md_mod.FLUSH_ENTRIES
    md_mod.FLUSH_ENTRIES = 500

    async def body(md: Metadata) -> None:
        with trio.fail_after(5):
            e = await md.lookup("big/", b"f00010")
            assert e is not None and not e.is_dir
            view = await md.readable("big/", None)
            assert view is not None and view.limit is not None  # a partial view
            first = [x.name for x in md.entries_in(view)]
            assert first[:2] == [b"f00000", b"f00001"] and len(first) < 3000
            assert md.count("big/") == 0  # not complete
            # a name further on waits for its page
            with trio.move_on_after(0.2) as scope:
                await md.lookup("big/", b"f02500")
            assert scope.cancelled_caught
            # the entries read so far resolve to inodes already
            assert md.resolve(e.ino) == ("big/", e)
        gate.open.set()
        with trio.fail_after(10):
            late = await md.lookup("big/", b"f02500")
        assert late is not None
        await md.settled("big/")
        assert md.count("big/") == 3000
        assert [x.name for x in md.iter_entries("big/")] == [f"f{i:05d}".encode() for i in range(3000)]

    try:
        run_with_metadata(env, store, body)
    finally:
        md_mod.FLUSH_ENTRIES = old_flush


def test_watermark_holds_back_names_a_later_common_prefix_may_take() -> None:
    from cachefs.cache.metadata import watermark

    assert watermark("p/", "p/abc") == b"abc"
    # "a-b" listed: "a/" (the directory a) comes later, so "a" is not complete yet
    assert watermark("p/", "p/a-b") == b"a"
    assert watermark("p/", "p/a/") == b"a/"  # the common prefix itself: "a" is done
    assert b"a" < watermark("p/", "p/a/")


def test_directory_that_shadows_a_file_on_an_earlier_page(env: LmdbEnv) -> None:
    from cachefs.cache import metadata as md_mod

    store = MemoryStore(page_size=2)
    store.put("p/a", b"file a")  # page 1: a, a-b ; page 2: a/ (prefix), b
    store.put("p/a-b", b"x")
    store.put("p/a/inner", b"y")
    store.put("p/b", b"z")
    old = md_mod.FLUSH_ENTRIES
    md_mod.FLUSH_ENTRIES = 1

    async def body(md: Metadata) -> None:
        await md.ensure("p/")
        got = [(e.name, e.is_dir) for e in md.iter_entries("p/")]
        assert got == [(b"a", True), (b"a-b", False), (b"b", False)]
        assert md.count("p/") == 3

    try:
        run_with_metadata(env, store, body)
    finally:
        md_mod.FLUSH_ENTRIES = old


def test_inodes_resolve_and_go_stale_when_the_object_changes(env: LmdbEnv, store: MemoryStore) -> None:
    async def body(md: Metadata) -> None:
        await md.ensure("data/")
        f2 = md.get("data/", b"f2")
        sub = md.get("data/", b"sub")
        assert f2 is not None and sub is not None and f2.ino != sub.ino
        assert md.resolve(f2.ino) == ("data/", f2)
        assert md.resolve(sub.ino) == ("data/", sub)
        inos = {e.ino for e in md.iter_entries("data/")}
        assert len(inos) == 10 and 1 not in inos
        store.put("data/f2", b"new bytes")
        store.delete("data/f3")
        f3 = md.get("data/", b"f3")
        md.invalidate("data/")
        await md.settled("data/")
        assert md.resolve(f2.ino) is None  # old version: ESTALE
        assert f3 is not None and md.resolve(f3.ino) is None  # gone
        assert md.resolve(sub.ino) == ("data/", sub)  # unchanged: same inode
        f4 = md.get("data/", b"f4")
        assert f4 is not None and md.resolve(f4.ino) == ("data/", f4)

    run_with_metadata(env, store, body)


def test_opendir_lists_subdirectories_ahead(env: LmdbEnv) -> None:
    store = MemoryStore()
    for d in range(6):
        for f in range(3):
            store.put(f"t/d{d}/f{f}", b"x")

    async def body(md: Metadata) -> None:
        await md.ensure("t/")
        assert store.calls["list"] == 1
        md.list_ahead("t/")
        with trio.fail_after(5):
            while any(md.listed_at(f"t/d{d}/") is None for d in range(6)):
                await trio.sleep(0.01)
        assert store.calls["list"] == 7
        lists = store.calls["list"]
        assert await md.lookup("t/d3/", b"f1") is not None
        assert store.calls["list"] == lists  # no wait, no request

    run_with_metadata(env, store, body, list_ahead=2)


def test_a_new_mount_lists_the_path_a_walk_in_name_order_starts_on(env: LmdbEnv) -> None:
    """At mount: the root, its first sub-directory, that one's first, and so on down,
    before any reader asks (a reader in name order then waits for no LIST per level),
    in two requests: the root's LIST and one flat page of the root (the mount page),
    which lists every folder it holds whole at any depth, the other folders too;
    nothing listed again over listings kept from a mount before. With --list-ahead 0
    (on demand only) nothing."""
    store = MemoryStore()
    for top in ("ds", "other"):
        for d in range(3):
            store.put(f"{top}/c{d:02d}/f", b"x")
            store.put(f"{top}/c{d:02d}/sub/g", b"x")
    store.put("readme", b"x")
    path = ["", "ds/", "ds/c00/", "ds/c00/sub/"]

    async def body(md: Metadata) -> None:
        md.list_at_mount("")
        with trio.fail_after(5):
            while any(md.listed_at(d) is None for d in path):
                await trio.sleep(0.01)
        await trio.sleep(0.05)
        assert store.calls["list"] == 2
        for folder in ("ds/c02/sub/", "other/", "other/c01/"):  # (whole in the page)
            assert md.listed_at(folder) is not None, folder
        assert [e.name for e in md.iter_entries("ds/c01/")] == [b"f", b"sub"]
        assert [e.name for e in md.iter_entries("ds/")] == [b"c00", b"c01", b"c02"]
        assert await md.lookup("ds/c00/", b"f") is not None
        md.list_at_mount("")
        await trio.sleep(0.05)
        assert store.calls["list"] == 2

    run_with_metadata(env, store, body, list_ahead=2, root="")

    fresh = MemoryStore()
    fresh.put("fresh/a/f", b"x")

    async def on_demand(md: Metadata) -> None:
        md.list_at_mount("fresh/")
        await trio.sleep(0.1)
        assert fresh.calls["list"] == 0 and md.listed_at("fresh/") is None

    run_with_metadata(env, fresh, on_demand, list_ahead=0, root="fresh/")


def test_a_mount_page_that_holds_no_folder_whole_lists_nothing(env: LmdbEnv) -> None:
    """A first folder larger than a page: the mount page holds no folder whole and
    writes nothing (a folder it cuts is never written from it); the path is listed one
    LIST per level as before, every folder whole."""
    store = MemoryStore(page_size=4)
    for f in range(6):
        store.put(f"t/big/f{f}", b"x")
    store.put("t/small/f", b"x")

    async def body(md: Metadata) -> None:
        md.list_at_mount("t/")
        await _wait_listed(md, ["t/", "t/big/"])
        await trio.sleep(0.05)
        assert [e.name for e in md.iter_entries("t/big/")] == [
            f"f{f}".encode() for f in range(6)]
        assert md.listed_at("t/small/") is None  # (past the page)
        # the root's LIST, the mount page, and t/big/'s two pages
        assert store.calls["list"] == 4, store.calls

    run_with_metadata(env, store, body, list_ahead=2, root="t/")


class _HeldFlatPages(MemoryStore):
    """A MemoryStore whose flat LISTs wait for ``release`` (set from the test); ``calls``
    counts a flat LIST once it is answered, ``flat`` when it is asked."""

    def __init__(self) -> None:
        super().__init__()
        self.release = threading.Event()
        self.flat = 0

    def list_page(self, prefix: str, token: str | None, start_after: str | None = None,
                  exchange: Any = None, *, flat: bool = False) -> Any:
        if flat:
            self.flat += 1
            assert self.release.wait(10)
        return super().list_page(prefix, token, start_after, exchange, flat=flat)


def test_a_readers_first_listing_joins_the_mount_page_in_flight(env: LmdbEnv) -> None:
    """A reader's lookup in a folder under the root while the mount page is in flight
    waits for the page, which lists the folder, instead of sending a LIST of its own;
    one page that never comes holds it at most MOUNT_PAGE_WAIT, then it lists alone."""
    store = _HeldFlatPages()
    for d in range(3):
        store.put(f"t/c{d}/f", b"x")

    async def body(md: Metadata) -> None:
        md.list_at_mount("t/")
        with trio.fail_after(5):
            assert await md.lookup("t/", b"c1") is not None  # (the root's own LIST)
        found: list[Any] = []

        async def reader() -> None:
            found.append(await md.lookup("t/c1/", b"f"))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(reader)
            await trio.sleep(0.2)
            # the root's LIST answered, the page held: no LIST of t/c1/, the reader waits
            assert not found and store.calls["list"] == 1 and store.flat == 1
            store.release.set()
        assert found[0] is not None
        await _wait_listed(md, ["t/c0/", "t/c2/"])
        assert store.calls["list"] == 2

    run_with_metadata(env, store, body, list_ahead=2, root="t/")


def test_a_mount_page_that_never_comes_holds_a_reader_only_briefly(
        env: LmdbEnv, monkeypatch: pytest.MonkeyPatch) -> None:
    import cachefs.cache.metadata as metadata_module

    monkeypatch.setattr(metadata_module, "MOUNT_PAGE_WAIT", 0.3)
    store = _HeldFlatPages()
    store.put("t/c0/f", b"x")

    async def body(md: Metadata) -> None:
        md.list_at_mount("t/")
        with trio.fail_after(5):
            assert await md.lookup("t/c0/", b"f") is not None  # (its own LIST, after 0.3 s)
        assert store.flat == 1 and store.calls["list"] == 2  # (the page still held)
        store.release.set()

    run_with_metadata(env, store, body, list_ahead=2, root="t/")


def test_next_dir_names_the_following_directory_and_lists_it_ahead(env: LmdbEnv) -> None:
    store = MemoryStore()
    for d in range(3):
        for f in range(3):
            store.put(f"t/c{d}/f{f}", b"x")
    store.put("t/c1.txt", b"a file between two directories")

    async def body(md: Metadata) -> None:
        assert md.next_dir("t/c0/", "t/") is None  # the parent is not listed: nothing known
        await md.ensure("t/")
        assert md.next_dir("t/c0/", "t/") == "t/c1/"
        assert md.next_dir("t/c1/", "t/") == "t/c2/"  # past the file in between
        assert md.next_dir("t/c2/", "t/") is None  # the last one
        assert md.next_dir("t/", "t/") is None  # never above the mount's root
        assert md.next_dir("u/c0/", "t/") is None
        with trio.fail_after(5):  # asking for them listed them ahead
            while md.listed_at("t/c1/") is None or md.listed_at("t/c2/") is None:
                await trio.sleep(0.01)
        lists = store.calls["list"]
        assert await md.lookup("t/c2/", b"f1") is not None
        assert store.calls["list"] == lists  # no wait, no request

    run_with_metadata(env, store, body, list_ahead=2)


def test_the_walk_goes_from_a_parents_last_folder_into_the_next_parents_first(env: LmdbEnv) -> None:
    """next_walked_dir: in a tree of two levels read in name order, the folder after a
    parent's last one is the first folder of the next parent (down past folders that hold
    only folders); the next parent's listings on the way are started when missing, and
    the walk asks again. Never above the mount's root, and not past a parent whose listing
    does not say its folder is the last."""
    store = MemoryStore()
    for p in range(3):
        for c in range(3):
            for f in range(2):
                store.put(f"t/p{p}/c{3 * p + c}/f{f}", b"x")
    store.put("t/p3/q/c9/f0", b"x")  # a parent holding a folder of folders

    async def body(md: Metadata) -> None:
        await md.ensure("t/")
        await md.ensure("t/p0/")
        assert md.next_walked_dir("t/p0/c0/", "t/") == "t/p0/c1/"  # as next_dir
        with trio.fail_after(5):  # (t/p1/ and t/p1/c3/ listed on the way)
            while (nxt := md.next_walked_dir("t/p0/c2/", "t/")) is None:
                await trio.sleep(0.01)
        assert nxt == "t/p1/c3/"
        await md.ensure("t/p2/")
        with trio.fail_after(5):
            while (nxt := md.next_walked_dir("t/p2/c8/", "t/")) is None:
                await trio.sleep(0.01)
        assert nxt == "t/p3/q/c9/"
        assert md.next_walked_dir("t/p3/", "t/") is None  # the root's last folder
        assert md.next_walked_dir("t/p3/q/c9/", "t/") is None  # the tree's end

    run_with_metadata(env, store, body, list_ahead=2, root="t/")


def test_a_walk_does_not_climb_into_a_next_parent_that_holds_files_itself(env: LmdbEnv) -> None:
    """``train/c2/`` is followed by ``val/``, a directory that holds files of its own, not
    folders of them: another shape of tree, not walked into (a reader of the training
    split read in order is not taken for a reader of the validation split: a warmed
    ``train/`` read whole fetched ``val/``'s 300 KB ahead)."""
    store = MemoryStore()
    for c in range(3):
        store.put(f"ds/train/c{c}/f0", b"x")
    store.put("ds/val/v.bin", b"v")

    async def body(md: Metadata) -> None:
        for prefix in ("ds/", "ds/train/", "ds/val/"):
            await md.ensure(prefix)
        assert md.next_walked_dir("ds/train/c1/", "ds/") == "ds/train/c2/"  # as next_dir
        for _ in range(20):  # (nothing to list on the way: the answer stays None)
            assert md.next_walked_dir("ds/train/c2/", "ds/") is None
            await trio.sleep(0.01)

    run_with_metadata(env, store, body, list_ahead=2, root="ds/")


def test_a_walk_climbing_into_the_next_parents_has_their_folders_listed_by_one_flat_page(
        env: LmdbEnv) -> None:
    """The folders of the parents after a parent's last folder are listed ahead by one flat
    page of their parent, not one LIST per parent and then one per folder: at each parent
    a walk going on waited for two LISTs in a row (0.3-0.5 s each under a cold pass's
    load, longer than its readers take to read a parent of 120 small files; a tree of 20
    parents of 10 folders of 12 files was read at 0.74 of the link)."""
    store = MemoryStore()
    for p in range(6):
        for c in range(4):
            for f in range(3):
                store.put(f"t/p{p}/c{4 * p + c}/f{f}", b"x")

    async def listed(md: Metadata) -> None:  # (an earlier mount: nothing listed ahead)
        await md.ensure("t/")
        await md.ensure("t/p0/")

    run_with_metadata(env, store, listed)

    async def body(md: Metadata) -> None:
        lists = store.calls["list"]
        with trio.fail_after(5):
            while (nxt := md.next_walked_dir("t/p0/c3/", "t/")) is None:
                await trio.sleep(0.01)
        assert nxt == "t/p1/c4/"
        folders = [f"t/p{p}/c{4 * p + c}/" for p in range(1, 6) for c in range(4)]
        with trio.fail_after(5):
            while any(md.listed_at(d) is None for d in folders):
                await trio.sleep(0.01)
        assert store.calls["list"] - lists == 1, store.calls["list"] - lists

    run_with_metadata(env, store, body, list_ahead=2, root="t/")


def test_next_dir_lists_several_following_directories_ahead(env: LmdbEnv) -> None:
    """A walk that goes on from folder to folder outruns a listing a folder (one LIST
    round trip: ~0.2 s of a few hundred small files): asking for the next directory lists
    the NEXT_DIRS_LISTED directories after it too, not only that one."""
    from cachefs.cache.metadata import FILES_LISTED_AHEAD, NEXT_DIRS_LISTED

    store = _class_folders(NEXT_DIRS_LISTED + 3, files=FILES_LISTED_AHEAD // NEXT_DIRS_LISTED)

    async def body(md: Metadata) -> None:
        await md.ensure("t/")
        await md.ensure("t/c00/")  # (a walk is in it: its listing is here)
        assert md.next_dir("t/c00/", "t/") == "t/c01/"
        await _listed_ahead_of(md, "t/c00/")

    run_with_metadata(env, store, body, list_ahead=2)


def test_after_a_folder_of_few_files_more_folders_are_listed_ahead(env: LmdbEnv) -> None:
    """A walk's requests go on from folder to folder as far as its window reaches, in one
    top-up, and stop at the first folder not listed: after a folder of few files,
    next_dir() lists as many folders of that size as hold FILES_LISTED_AHEAD files (at
    most MAX_DIRS_LISTED), not NEXT_DIRS_LISTED (16 folders of 6 files were passed in one
    top-up, and the walk waited a LIST every 16 folders)."""
    from cachefs.cache.metadata import (
        FILES_LISTED_AHEAD,
        MAX_DIRS_LISTED,
        NEXT_DIRS_LISTED,
        dirs_listed_ahead,
    )

    assert dirs_listed_ahead(0) == NEXT_DIRS_LISTED  # (not listed: not known)
    assert dirs_listed_ahead(1300) == NEXT_DIRS_LISTED
    assert dirs_listed_ahead(FILES_LISTED_AHEAD // 32) == 32  # (16 files a folder)
    assert dirs_listed_ahead(6) == -(-FILES_LISTED_AHEAD // 6)
    assert dirs_listed_ahead(1) == MAX_DIRS_LISTED
    ahead = dirs_listed_ahead(6)
    store = _class_folders(ahead + 3, files=6)
    store.page_size = 6 * (ahead + 1)  # (a flat page holds the folders wanted, and c00)

    async def body(md: Metadata) -> None:
        await md.ensure("t/")
        await md.ensure("t/c00/")
        assert md.next_dir("t/c00/", "t/") == "t/c01/"
        await _listed_ahead_of(md, "t/c00/", ahead)

    run_with_metadata(env, store, body, list_ahead=8)


def _class_folders(n: int, files: int = 1) -> MemoryStore:
    """Folders t/c00/ ... of ``files`` files each."""
    store = MemoryStore()
    for d in range(n):
        for f in range(files):
            store.put(f"t/c{d:02d}/f{f:03d}", b"x")
    return store


async def _listed_ahead_of(md: Metadata, folder: str, count: int | None = None) -> None:
    """Wait until the ``count`` (NEXT_DIRS_LISTED) class folders after ``folder`` are
    listed, then check that the one after those is not."""
    from cachefs.cache.metadata import NEXT_DIRS_LISTED

    count = NEXT_DIRS_LISTED if count is None else count
    first = int(folder[len("t/c"):-1]) + 1
    want = [f"t/c{d:02d}/" for d in range(first, first + count)]
    with trio.fail_after(5):
        while any(md.listed_at(d) is None for d in want):
            await trio.sleep(0.01)
    await trio.sleep(0.05)
    assert md.listed_at(f"t/c{first + count:02d}/") is None, "listed too far"


def test_a_folder_a_reader_enters_has_the_next_folders_listed_ahead(env: LmdbEnv) -> None:
    """A reader waiting for a folder's first listing (a cold pass entering its first class
    folder) has the folders after it listed too, before any walk asks for them: a LIST
    across regions takes longer than reading a folder's first files. Refreshes and the
    list-ahead workers' own listings do not (they would list a whole parent)."""
    from cachefs.cache.metadata import NEXT_DIRS_LISTED

    store = _class_folders(2 * NEXT_DIRS_LISTED + 2)

    async def body(md: Metadata) -> None:
        await md.ensure("t/")
        assert await md.lookup("t/c00/", b"f000") is not None  # the reader enters c00
        # (listed ahead, not for a reader, they do not list further ahead themselves)
        await _listed_ahead_of(md, "t/c00/")

    run_with_metadata(env, store, body, list_ahead=2, root="t/")


def test_a_folder_s_position_tells_how_many_folders_its_parent_has(env: LmdbEnv) -> None:
    """dir_ino_now (the directory lookahead's walks over folders) gives a folder's inode in
    its parent's listing and the number of folders there: among 10 folders, a few entered
    in order by chance are no evidence of a walk (cachefs.read.lookahead.least_opens)."""
    store = _class_folders(10, files=2)
    store.put("t/loose", b"x")  # a file beside the folders: not counted

    async def body(md: Metadata) -> None:
        await md.ensure("t/")
        found = [md.dir_ino_now(f"t/c{d:02d}/") for d in range(10)]
        assert all(f is not None and f[1] == 10 for f in found), found
        inos = [f[0] for f in found if f is not None]
        assert inos == sorted(inos) and len(set(inos)) == 10  # numbered in name order
        assert md.dir_ino_now("t/") is None  # (the root of the listing: no parent here)
        assert md.dir_ino_now("t/nosuch/") is None

    run_with_metadata(env, store, body)


def test_without_a_root_a_folder_listed_for_a_reader_lists_nothing_else(env: LmdbEnv) -> None:
    store = MemoryStore()
    for d in range(4):
        store.put(f"t/c{d}/f", b"x")

    async def body(md: Metadata) -> None:
        await md.ensure("t/")
        assert await md.lookup("t/c0/", b"f") is not None
        await trio.sleep(0.1)
        assert [md.listed_at(f"t/c{d}/") is None for d in range(1, 4)] == [True] * 3

    run_with_metadata(env, store, body, list_ahead=2)


def test_unfinished_listing_of_an_earlier_run_is_removed(tmp_path: Path) -> None:

    store = MemoryStore(page_size=2)
    for i in range(6):
        store.put(f"d/f{i}", b"x")
    path = tmp_path / "meta.lmdb"
    env = LmdbEnv(path)
    from cachefs.cache.index import Index, VersionWriter

    writer = VersionWriter(Index(env), "d/", time.time)
    writer.write([Entry(b"f0", False, 1, 0.0, "e")])  # a first batch, then the "crash"
    env.close()
    env2 = LmdbEnv(path)
    try:
        with env2.read() as txn:
            assert txn.stat(env2.db("names"))["entries"] == 1
        Metadata(env2, store, ttl=60, limiter=trio.CapacityLimiter(1))
        with env2.read() as txn:
            assert txn.stat(env2.db("names"))["entries"] == 0
    finally:
        env2.close()


def test_split_points_are_geometric() -> None:
    from cachefs.cache.metadata import split_points

    pts = split_points("p/", "p/f0000000.jpg", "p/f0001999.jpg", None)
    assert pts == [f"p/f000{i}" for i in range(2, 10)] + [f"p/f00{i}" for i in range(1, 10)] \
        + [f"p/f0{i}" for i in range(1, 10)]
    assert split_points("p/", "p/f0000000.jpg", "p/f0001999.jpg", "p/f0005") == \
        [f"p/f000{i}" for i in range(2, 5)]
    assert split_points("p/", "p/a", "p/b", None) == [f"p/{c}" for c in "cdefghijklmnopqrstuvwxyz"]
    assert split_points("p/", "p/x.!", "p/x.~", None) == ["p/y", "p/z"]  # punctuation: no guess


def test_a_large_directory_is_listed_as_parallel_ranges(env: LmdbEnv) -> None:
    store = MemoryStore(page_size=250)
    expected: list[tuple[bytes, bool]] = []
    for i in range(4000):
        store.put(f"big/f{i:05d}", b"x")
        expected.append((f"f{i:05d}".encode(), False))
    for d in ("f01234", "f03999x", "g"):  # directories among the files (one shadows a file)
        store.put(f"big/{d}/inner", b"y")
    expected = [e for e in expected if e[0] != b"f01234"]
    expected += [(b"f01234", True), (b"f03999x", True), (b"g", True)]
    expected.sort()

    async def body(md: Metadata) -> None:
        await md.ensure("big/")
        assert [(e.name, e.is_dir) for e in md.iter_entries("big/")] == expected
        assert md.count("big/") == len(expected)
        assert store.calls["list"] > 4000 // 250  # ranges were listed (with a few empty ones)
        inos = {e.ino for e in md.iter_entries("big/")}
        assert len(inos) == len(expected)
        first = store.calls["list"]
        md.invalidate("big/")  # a refresh keeps every inode
        await md.settled("big/")
        assert store.calls["list"] > first
        assert {e.ino for e in md.iter_entries("big/")} == inos

    run_with_metadata(env, store, body)


def test_an_inode_looked_up_resolves_from_memory_until_a_listing_changes(
        env: LmdbEnv, store: MemoryStore) -> None:
    from cachefs import metrics

    reads = metrics.LMDB_TRANSACTIONS.counters["read"]

    async def body(md: Metadata) -> None:
        await md.ensure("data/")
        known, f2, due = md.lookup_now("data/", b"f2")
        assert known and f2 is not None and not due
        before = reads.value
        assert md.resolve_now(f2.ino) == (("data/", f2), None)  # the open after the lookup
        assert reads.value == before  # no index read
        # The object changes: once the new listing is current, the old inode is stale
        # (ESTALE), whatever was remembered of it.
        store.put("data/f2", b"new bytes")
        md.invalidate("data/")
        await md.settled("data/")
        assert md.resolve_now(f2.ino) == (None, None)
        _, new, _ = md.lookup_now("data/", b"f2")
        assert new is not None and new.ino != f2.ino and new.size == 9
        assert md.resolve_now(new.ino) == (("data/", new), None)

    run_with_metadata(env, store, body)


def test_a_file_found_by_key_is_one_index_read_and_its_inode_resolves_from_memory(
        env: LmdbEnv, store: MemoryStore) -> None:
    from cachefs import metrics

    reads = metrics.LMDB_TRANSACTIONS.counters["read"]

    async def body(md: Metadata) -> None:
        await md.ensure("data/")
        before = reads.value
        f2 = await md.find_file("data/f2")  # (the read-order hint resolving a hinted key)
        assert f2 is not None and f2.name == b"f2"
        assert reads.value == before + 1, "one index read"
        assert md.resolve_now(f2.ino) == (("data/", f2), None)  # its template ahead
        assert reads.value == before + 1, "the inode resolved from memory"
        assert await md.find_file("data/nothing") is None
        assert await md.find_file("data/") is None

    run_with_metadata(env, store, body)


def test_entries_remembered_from_a_listing_resolve_from_memory_until_a_listing_changes(
        env: LmdbEnv, store: MemoryStore) -> None:
    from cachefs import metrics

    reads = metrics.LMDB_TRANSACTIONS.counters["read"]

    async def body(md: Metadata) -> None:
        await md.ensure("data/")
        generation = md.generation  # (before the listing is read: the sweep's order)
        entries = [e for e in md.iter_entries("data/") if not e.is_dir]
        md.remember_entries("data/", generation, entries)
        before = reads.value
        for e in entries:
            assert md.resolve_now(e.ino) == (("data/", e), None)
        assert reads.value == before, "resolved from memory"
        store.put("data/f2", b"new bytes")
        md.invalidate("data/")
        await md.settled("data/")  # (a listing made current: what was remembered is not used)
        f2 = next(e for e in entries if e.name == b"f2")
        assert md.resolve_now(f2.ino) == (None, None)
        md.remember_entries("data/", generation, entries)  # (read before that listing)
        assert md.resolve_now(f2.ino) == (None, None)

    run_with_metadata(env, store, body)


def test_remembered_inodes_are_bounded_and_never_outlive_a_listing_change_across_threads(
        env: LmdbEnv) -> None:
    # Several request workers look names up and resolve inodes while listings are
    # replaced: the memory stays bounded, and once a listing that changed every object is
    # current, no thread resolves an old inode.
    store = MemoryStore(page_size=50)
    for i in range(200):
        store.put(f"d/f{i:03d}", b"v0")

    async def body(md: Metadata) -> None:
        md.recent_size = 64
        await md.ensure("d/")
        for version in range(1, 4):
            old: list[int] = []
            stop = threading.Event()
            errors: list[str] = []

            def worker(seed: int, stop: threading.Event = stop, old: list[int] = old,
                       errors: list[str] = errors) -> None:
                i = seed
                while not stop.is_set():
                    i = (i + 7) % 200
                    _, e, _ = md.lookup_now("d/", f"f{i:03d}".encode())
                    if e is not None:
                        old.append(e.ino)
                        md.resolve_now(e.ino)
                    if len(md._recent) > md.recent_size:
                        errors.append(f"{len(md._recent)} remembered")

            threads = [threading.Thread(target=worker, args=(s,)) for s in range(4)]
            for t in threads:
                t.start()
            await trio.sleep(0.05)
            for i in range(200):
                store.put(f"d/f{i:03d}", f"v{version}".encode() * version)
            md.invalidate("d/")
            await md.settled("d/")
            stop.set()
            for t in threads:
                await trio.to_thread.run_sync(t.join)
            assert not errors
            current = {e.ino for e in md.iter_entries("d/")}
            stale = [ino for ino in set(old) if ino not in current]
            assert stale  # the threads did see old inodes
            for ino in stale:
                assert md.resolve_now(ino) == (None, None)

    run_with_metadata(env, store, body)


def test_the_folders_a_walk_asks_for_are_listed_in_the_order_it_reaches_them(
        env: LmdbEnv) -> None:
    """A walk going on from folder to folder asks next_dir() at each one, and each ask
    queues the folders after it that are not listed yet. The list-ahead workers take
    them in the order asked (the walk's order), not the last asked first: a walk stops at
    the first folder not listed, so listing the one it reaches last before the one it
    reaches next held it up for a whole LIST (across regions, under a cold pass's load,
    0.2-0.5 s: folders of a few small files stalled the link every NEXT_DIRS_LISTED
    folders)."""
    import threading

    from cachefs.cache.metadata import NEXT_DIRS_LISTED

    store = _class_folders(NEXT_DIRS_LISTED + 4)
    order: list[str] = []
    gate = threading.Event()

    def fault(op: str, key: str) -> None:
        if op == "list":
            order.append(key)
            gate.wait(5)  # (the listing's worker thread)

    async def body(md: Metadata) -> None:
        await md.ensure("t/")
        store.fault = fault
        md.next_dir("t/c00/", "t/")  # queues c01..; the one worker takes c01 and waits
        with trio.fail_after(5):
            while not order:
                await trio.sleep(0.01)
        # The walk went on to c09: fewer than half of the folders wanted are ahead of it
        # among those asked for, so the ones after them are asked for too.
        assert md.next_dir("t/c09/", "t/") == "t/c10/"
        gate.set()
        last = f"t/c{NEXT_DIRS_LISTED + 3:02d}/"  # (the parent's last)
        with trio.fail_after(5):
            while md.listed_at(last) is None:
                await trio.sleep(0.01)
        assert order == [f"t/c{d:02d}/" for d in range(1, NEXT_DIRS_LISTED + 4)]

    run_with_metadata(env, store, body, list_ahead=1)


def test_next_dir_answers_a_walk_from_folder_to_folder_and_follows_a_new_listing(
        env: LmdbEnv) -> None:
    """next_dir() asked at every folder a walk passes answers from its last scan of the
    parent (it looks again only when few of the folders wanted remain ahead), always the
    directory right after the one asked about, and None after the last; once the parent
    is listed again, a folder added in between is the answer."""
    store = _class_folders(40)

    async def body(md: Metadata) -> None:
        await md.ensure("t/")
        for d in range(39):
            assert md.next_dir(f"t/c{d:02d}/", "t/") == f"t/c{d + 1:02d}/"
        assert md.next_dir("t/c39/", "t/") is None
        assert md.next_dir("t/c05/", "t/") == "t/c06/"  # (asked again, out of order)
        store.put("t/c05a/f000", b"x")
        md.invalidate("t/")
        await md.settled("t/")
        assert md.next_dir("t/c04/", "t/") == "t/c05/"
        assert md.next_dir("t/c05/", "t/") == "t/c05a/"
        assert md.next_dir("t/c05a/", "t/") == "t/c06/"

    run_with_metadata(env, store, body, list_ahead=4)


def _delimiter_view(store: MemoryStore, prefix: str) -> list[tuple[bytes, bool, int]]:
    """What a delimiter listing of ``prefix`` makes of it: (name, is_dir, size) in order."""
    from collections import Counter

    from cachefs.cache.metadata import entries_from_listing

    page = store.list_page(prefix, None)
    return [(e.name, e.is_dir, e.size)
            for e in entries_from_listing(prefix, page.objects, page.prefixes, Counter())]


async def _entered_first_folder(md: Metadata) -> None:
    """A reader enters t/c00/ (not listed): it waits for that listing, and the
    NEXT_DIRS_LISTED folders after it are listed ahead, one LIST each (their size is not
    known yet); returns once they are."""
    await md.ensure("t/")
    await md.ensure("t/c00/")
    await _listed_ahead_of(md, "t/c00/")


def test_folders_of_few_files_ahead_of_a_walk_are_listed_by_one_flat_list(env: LmdbEnv) -> None:
    """A walk through folders of two files, listed ahead one LIST per folder, went at the
    listing rate. After such a folder, the folders ahead are listed by one LIST without a
    delimiter: each folder the page holds whole is stored as what its own listing would
    have said (its files, its sub-directories, its marker left out)."""
    store = _class_folders(60, files=2)
    store.put("t/c20/sub/deep/x", b"y")  # a sub-directory of one of them
    store.put("t/c22/", b"")  # a folder's marker object

    async def body(md: Metadata) -> None:
        await _entered_first_folder(md)
        before = store.calls["list"]
        assert md.next_dir("t/c16/", "t/") == "t/c17/"
        await _listed_ahead_of(md, "t/c16/", 43)
        assert store.calls["list"] - before == 1, store.calls
        for d in range(17, 60):
            folder = f"t/c{d:02d}/"
            got = [(e.name, e.is_dir, e.size) for e in md.iter_entries(folder)]
            assert got == _delimiter_view(store, folder), folder
        assert [e.name for e in md.iter_entries("t/c20/")] == [b"f000", b"f001", b"sub"]
        assert [e.name for e in md.iter_entries("t/c22/")] == [b"f000", b"f001"]

    run_with_metadata(env, store, body, list_ahead=4, root="t/")


def test_a_flat_page_lists_every_folder_it_holds_whole(env: LmdbEnv) -> None:
    """A flat page holds more folders than the walk asked for (1,000 keys: 500 folders of
    two files, where 256 were wanted): those it holds whole are listed by it too, at no
    request more, so the next flat listing starts that much further ahead of the walk (a
    walk through folders of two files stalled, no GET in flight, at each page). A folder
    the page cuts is not written from it; nothing past the page is listed."""
    from cachefs.cache.metadata import dirs_listed_ahead

    store = MemoryStore()
    for d in range(600):
        for f in range(2):
            store.put(f"t/c{d:03d}/f{f:03d}", b"x")
    wanted = dirs_listed_ahead(2)
    assert 16 + wanted < 500  # (the page holds more folders than were asked for)

    async def body(md: Metadata) -> None:
        await md.ensure("t/")
        await md.ensure("t/c000/")
        await _wait_listed(md, [f"t/c{d:03d}/" for d in range(1, 17)])
        before = store.calls["list"]
        assert md.next_dir("t/c016/", "t/") == "t/c017/"
        # One page from c017 on: 1,000 keys, c017..c516, the last one cut.
        await _wait_listed(md, [f"t/c{d:03d}/" for d in range(17, 516)])
        assert store.calls["list"] - before == 1, store.calls
        for d in (17, 17 + wanted, 400, 515):
            folder = f"t/c{d:03d}/"
            assert [e.name for e in md.iter_entries(folder)] == [b"f000", b"f001"], folder
        await trio.sleep(0.05)
        assert md.listed_at("t/c516/") is None  # (cut by the page: not written from it)
        assert md.listed_at("t/c517/") is None

    run_with_metadata(env, store, body, list_ahead=4, root="t/")


def test_a_folder_of_a_flat_page_that_cannot_be_written_fails_alone(
        env: LmdbEnv, monkeypatch: pytest.MonkeyPatch) -> None:
    """The folders of a flat page are written one after another in one worker thread: one
    that cannot be written (the index refuses it) ends with its error, and the others are
    listed; nothing is left in flight, so a reader of that folder lists it again rather
    than waiting for a listing nobody runs."""
    store = _class_folders(40, files=2)
    real = Metadata._write_listed

    def refuse_c20(self: Metadata, listing: Any, objects: Any, prefixes: Any) -> Any:
        if listing.prefix == "t/c20/":
            raise CacheError("the index refused it (test)")
        return real(self, listing, objects, prefixes)

    monkeypatch.setattr(Metadata, "_write_listed", refuse_c20)

    async def body(md: Metadata) -> None:
        await _entered_first_folder(md)
        before = store.calls["list"]
        md.next_dir("t/c16/", "t/")
        others = [f"t/c{d:02d}/" for d in range(17, 40) if d != 20]
        await _wait_listed(md, others)
        assert store.calls["list"] - before == 1, store.calls
        with trio.fail_after(5):
            while "t/c20/" in md._inflight:
                await trio.sleep(0.01)
        assert md.listed_at("t/c20/") is None
        monkeypatch.setattr(Metadata, "_write_listed", real)
        await md.ensure("t/c20/")  # (a reader: listed by a LIST of its own)
        assert [e.name for e in md.iter_entries("t/c20/")] == [b"f000", b"f001"]

    run_with_metadata(env, store, body, list_ahead=4, root="t/")


async def _wait_listed(md: Metadata, folders: list[str]) -> None:
    with trio.fail_after(10):
        while any(md.listed_at(d) is None for d in folders):
            await trio.sleep(0.01)


def test_a_folder_the_flat_page_cuts_is_listed_on_its_own(env: LmdbEnv) -> None:
    """A flat page ends where it ends: the folder it cuts, and those after it, are listed
    one LIST each, as before; every folder comes out whole."""
    store = _class_folders(30, files=2)
    store.page_size = 5  # a flat page of 5 keys: two folders whole, the third cut

    async def body(md: Metadata) -> None:
        await _entered_first_folder(md)
        before = store.calls["list"]
        md.next_dir("t/c16/", "t/")
        await _listed_ahead_of(md, "t/c16/", 13)
        assert store.calls["list"] - before == 1 + 11, store.calls  # (flat, then c19..c29)
        for d in range(17, 30):
            folder = f"t/c{d:02d}/"
            assert [e.name for e in md.iter_entries(folder)] == [b"f000", b"f001"], folder

    run_with_metadata(env, store, body, list_ahead=4, root="t/")


def test_a_lookup_in_a_folder_being_listed_flat_waits_for_that_listing(env: LmdbEnv) -> None:
    """The folders of a flat listing are listings in flight from its start: a reader that
    needs one waits for it and no LIST of that folder alone is made (single flight)."""
    store = _class_folders(40, files=2)
    gate = threading.Event()
    flat_lists: list[str] = []
    plain = store.list_page

    def list_page(prefix: str, token: str | None, start_after: str | None = None,
                  exchange: object = None, *, flat: bool = False) -> Any:
        if flat:
            flat_lists.append(prefix)
            gate.wait(5)
        else:
            assert prefix != "t/c20/", "listed on its own while its flat listing ran"
        return plain(prefix, token, start_after, flat=flat)

    store.list_page = list_page  # type: ignore[method-assign]

    async def body(md: Metadata) -> None:
        await _entered_first_folder(md)
        md.next_dir("t/c16/", "t/")
        with trio.fail_after(5):
            while not flat_lists:
                await trio.sleep(0.01)

        async def release() -> None:
            await trio.sleep(0.2)
            gate.set()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(release)
            with trio.fail_after(5):
                entry = await md.lookup("t/c20/", b"f001")
        assert entry is not None and not entry.is_dir
        assert flat_lists == ["t/"]

    run_with_metadata(env, store, body, list_ahead=4, root="t/")
