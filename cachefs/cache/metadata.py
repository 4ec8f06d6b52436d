"""The file-system index: directory listings of the bucket and inode numbers, in LMDB.

The tree is built lazily, one directory at a time: listing a directory is
ListObjectsV2 with ``Delimiter='/'`` (all pages), stored as a new *version* of
that directory; lookups, getattr and readdir are then answered from LMDB
without any S3 request, including after a remount with the same cache
directory. Nothing per object is kept in Python memory: a million listed
objects cost the daemon their LMDB pages only.

Tables (see :mod:`cachefs.cache.lmdbenv`):

* ``listings``: prefix id (xxh3-64 of the prefix) -> current version, listed
  at, entry count, sub-directory count, the prefix text;
* ``names``: version (8 bytes, big-endian) + name -> flags, size, mtime,
  inode number, ETag (16 bytes when it is an MD5). A new version takes the
  next number, so a listing's names are appended at the end of the B-tree
  (``MDB_APPEND``: full pages, no splits); the old version is deleted when the
  new one is complete;
* ``inodes``: inode number -> prefix id + name (what the kernel's inode refers to).

Inode numbers are given out in sequence (so ``inodes`` is appended to as
well) and belong to one *version* of a name: a refresh keeps the number of a
name whose kind and ETag did not change, and gives a changed object a new
one, so the kernel never keeps pages of one version for another. An inode
whose version is no longer listed answers ESTALE (the kernel then looks the
name up again and finds the new inode). Numbers survive remounts.

Mapping keys to names (documented in README):

* ``/`` separates directories. A key ending in ``/`` (a directory marker)
  makes a directory; the marker itself is not a file.
* A key that is both an object and a prefix (``a`` and ``a/b``): the
  directory wins and the object ``a`` is hidden (counted as ``shadowed``).
* Names that cannot be file names are skipped and counted by reason: empty
  components (``a//b``), ``.`` and ``..``, longer than 255 bytes, containing NUL.

Freshness: a listing older than the TTL (or invalidated) is *stale*. A stale
listing is still served at once while a background refresh runs
(stale-while-revalidate): a lookup or open never waits on S3 for a directory
it has a listing of. Only a directory never listed waits, and only until the
pages covering the name it needs have arrived: pages are written as they come
(a large directory streams to readdir), and names below the *watermark* are
complete (see :func:`watermark`).

Concurrency: every listing runs in the nursery of :meth:`Metadata.run` (its
owner), in a worker thread under the S3 capacity limiter, so a caller that
gives up (an interrupted FUSE request) does not cancel a listing others wait
for. One listing per directory at a time (single flight). Listing ahead:
``opendir`` queues the directory's sub-directories (a bounded stack, newest
first, like a depth-first walker) and ``list_ahead`` workers list them
before the walker gets there. Reads of LMDB run on the trio thread
(lock-free snapshots); writes in the listing threads (one write transaction
per page batch).
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import struct
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import trio
import xxhash

from cachefs import metrics
from cachefs.cache.lmdbenv import LmdbEnv
from cachefs.s3.store import ObjectInfo, ObjectStore, list_dir

log = logging.getLogger(__name__)

NAME_MAX = 255
ROOT_INO = 1

_ENTRY = struct.Struct("<BQIQ")  # flags, size, mtime (whole seconds), inode; ETag follows
_F_DIR, _F_MD5 = 1, 2
_LISTING = struct.Struct("<QdQQ")  # version, listed at, entries, sub-directories; prefix follows
_VERSION = struct.Struct(">Q")
_INO = struct.Struct(">Q")
_HEX = frozenset("0123456789abcdef")

# Listing ahead: at most this many directories queued (the oldest are dropped).
AHEAD_QUEUE = 4096
# A listing commits its pages at least this often (entries), so a large directory
# streams to readdir and never sits in memory whole.
FLUSH_ENTRIES = 1000
# A large directory is listed as several key ranges at once: once one range has listed
# this many entries with more to come (two full pages of S3), the rest of it is split;
# at most PARALLEL_RANGES ranges of one directory are listed at once (each one request
# at a time). Smaller directories cost no extra request.
SPLIT_AFTER_ENTRIES = 2000
PARALLEL_RANGES = 16
_ALL = b"\xff" * (NAME_MAX + 1)  # the watermark once every range is in
# After a failed refresh, the stale listing is served this long before the next try
# (an explicit invalidate() tries at once). Each try already retries transient errors.
REFRESH_BACKOFF = 10.0


@dataclasses.dataclass(frozen=True, slots=True)
class Entry:
    """One name in a directory: a sub-directory or an object version."""

    name: bytes
    is_dir: bool
    size: int = 0
    mtime: float = 0.0
    etag: str = ""
    ino: int = 0


def invalid_name_reason(name: str) -> str | None:
    """Why ``name`` cannot be a file name, or None when it can."""
    if name == "":
        return "empty"
    if name in (".", ".."):
        return "dot"
    if "\0" in name:
        return "nul"
    if len(name.encode("utf-8", "surrogateescape")) > NAME_MAX:
        return "too_long"
    return None


def _enc(text: str) -> bytes:
    return text.encode("utf-8", "surrogateescape")


def prefix_id(prefix: str) -> bytes:
    """The 8-byte id of a directory prefix (xxh3-64: S3 keys are up to 1024 bytes,
    LMDB keys 511)."""
    return xxhash.xxh3_64_digest(_enc(prefix))


def _pack(flags: int, size: int, mtime: float, ino: int, etag: str) -> bytes:
    if len(etag) == 32 and _HEX.issuperset(etag):
        return _ENTRY.pack(flags | _F_MD5, size, int(mtime) & 0xFFFFFFFF, ino) + bytes.fromhex(etag)
    return _ENTRY.pack(flags, size, int(mtime) & 0xFFFFFFFF, ino) + etag.encode()


def _unpack(name: bytes, raw: bytes) -> Entry:
    flags, size, mtime, ino = _ENTRY.unpack_from(raw)
    tail = bytes(raw[_ENTRY.size:])
    etag = tail.hex() if flags & _F_MD5 else tail.decode()
    return Entry(name, bool(flags & _F_DIR), size, float(mtime), etag, ino)


def entries_from_listing(prefix: str, objects: list[ObjectInfo], prefixes: list[str],
                         skipped: Counter[str]) -> list[Entry]:
    """Turn (a page of) one directory's listing into its entries (sorted by name),
    counting skips. Inode numbers are assigned when the entries are stored."""
    files: dict[str, ObjectInfo] = {}
    n = len(prefix)
    for obj in objects:
        name = obj.key[n:]
        if name == "" and obj.key == prefix:
            continue  # the directory's own marker object
        reason = invalid_name_reason(name)
        if reason:
            skipped[reason] += 1
            continue
        files[name] = obj
    dirs: set[str] = set()
    for p in prefixes:
        name = p[n:-1]
        reason = invalid_name_reason(name)
        if reason:
            skipped[reason] += 1
            continue
        dirs.add(name)
    for name in dirs & files.keys():
        skipped["shadowed"] += 1
        del files[name]
    result = [Entry(_enc(name), True) for name in dirs]
    result += [Entry(_enc(name), False, o.size, o.mtime, o.etag) for name, o in files.items()]
    result.sort(key=lambda e: e.name)
    return result


def watermark(prefix: str, last: str) -> bytes:
    """Names below the returned bound are complete once the listing of ``prefix`` has
    reached ``last`` (its greatest key or common prefix so far).

    S3 lists in key order, and a sub-directory ``a`` arrives as the common prefix
    ``a/``: after keys like ``a-b`` (``-`` < ``/``). A name ``x`` < ``last`` can still
    come as a directory only when ``x`` is a prefix of ``last`` followed by a
    character below ``/``; cutting ``last`` at its first such character excludes
    exactly those (and possibly a few safe names, which only wait for the next page).
    """
    rel = last[len(prefix):]
    for i, ch in enumerate(rel):
        if ch < "/":
            return _enc(rel[:i])
    return _enc(rel)


class _Listing:
    """One directory listing in progress, shared by every caller that needs it."""

    __slots__ = ("again", "ahead", "done", "error", "prefix", "progress", "subdirs", "tick",
                 "version", "water")

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        self.done = trio.Event()
        self.progress = trio.Event()  # set (and replaced) whenever pages were committed
        self.error: BaseException | None = None
        self.version: int | None = None  # the version being written, once it has pages
        self.water = b""  # names below this are complete in ``version``
        self.ahead = False  # queue the sub-directories for listing ahead when done
        self.subdirs: list[str] = []
        self.tick = 0
        self.again = False  # invalidated while running: list again when done


@dataclasses.dataclass(frozen=True, slots=True)
class View:
    """Where to read a directory's names: ``version``, names below ``limit`` (None: all)."""

    version: int
    limit: bytes | None


class Metadata:
    """Listings of one bucket's directories and the inodes of their names, in LMDB.

    ``prefix`` arguments are full S3 key prefixes ("" or ending in "/").
    ``store`` None: a manifest mount (:mod:`cachefs.cache.manifest`): nothing is
    ever listed, and a directory the manifest does not have does not exist.
    """

    def __init__(self, env: LmdbEnv, store: ObjectStore | None, *, ttl: float,
                 limiter: trio.CapacityLimiter, clock: Callable[[], float] = time.time,
                 list_ahead: int = 16) -> None:
        self._env = env
        self._store = store
        self._ttl = ttl
        self._limiter = limiter
        self._clock = clock
        self.list_ahead_workers = list_ahead
        # Invalidated prefixes -> the tick of their latest invalidate(); a listing clears
        # the mark only if it started after that (it may predate the change otherwise).
        self._stale: dict[str, int] = {}
        self._tick = 0
        self._retry_after: dict[str, float] = {}  # failed refreshes wait before the next
        self._inflight: dict[str, _Listing] = {}
        self._inflight_ids: dict[bytes, _Listing] = {}
        self._listings = env.db("listings")
        self._names = env.db("names")
        self._inodes = env.db("inodes")
        self._meta = env.db("meta")
        self._nursery: trio.Nursery | None = None
        self._ahead: collections.deque[str] = collections.deque(maxlen=AHEAD_QUEUE)
        self._ahead_lot = trio.lowlevel.ParkingLot()
        self._recover()

    # -- lifetime ------------------------------------------------------------------
    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Own the listings and the list-ahead workers until cancelled."""
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            if self._store is not None:
                for _ in range(self.list_ahead_workers):
                    nursery.start_soon(self._ahead_worker)
            task_status.started()
            try:
                await trio.sleep_forever()
            finally:
                self._nursery = None

    def _recover(self) -> None:
        """Delete the names of listings a previous daemon did not finish."""
        with self._env.read() as txn:
            cur = txn.cursor(db=self._meta)
            pending = []
            if cur.set_range(b"pending:"):
                for key, _ in cur:
                    if not key.startswith(b"pending:"):
                        break
                    pending.append(key)
        if not pending:
            return
        with self._env.write() as txn:
            for key in pending:
                self._delete_version(txn, _VERSION.unpack(key[8:])[0])
                txn.delete(key, db=self._meta)
        log.info("removed %d unfinished listing(s) of an earlier run", len(pending))

    # -- freshness -------------------------------------------------------------
    def _row(self, txn: Any, prefix: str) -> tuple[int, float, int, int] | None:
        raw = txn.get(prefix_id(prefix), db=self._listings)
        return None if raw is None else _LISTING.unpack_from(raw)

    def listed_at(self, prefix: str) -> float | None:
        with self._env.read() as txn:
            row = self._row(txn, prefix)
        return None if row is None else row[1]

    def is_fresh(self, prefix: str) -> bool:
        if self._store is None:
            return True
        if prefix in self._stale:
            return False
        at = self.listed_at(prefix)
        return at is not None and self._clock() - at < self._ttl

    def invalidate(self, prefix: str) -> None:
        """Refresh ``prefix`` in the background now (e.g. after ESTALE); its listing is
        served until the new one is complete."""
        if self._store is None:
            return
        self._tick += 1
        self._stale[prefix] = self._tick
        self._retry_after.pop(prefix, None)
        running = self._inflight.get(prefix)
        if running is not None:
            running.again = True  # it may predate the change: list once more after it
        elif self._nursery is not None:
            self._start(prefix)

    def _revalidate(self, prefix: str, listed_at: float) -> None:
        if self._store is None or prefix in self._inflight:
            return
        now = self._clock()
        if prefix in self._stale or now - listed_at >= self._ttl:
            if now < self._retry_after.get(prefix, 0.0):
                return  # the last refresh failed moments ago; the old listing serves
            self._start(prefix)

    async def settled(self, prefix: str) -> None:
        """Wait until no listing of ``prefix`` is running (tests, tools)."""
        while (listing := self._inflight.get(prefix)) is not None:
            await listing.done.wait()

    # -- views -----------------------------------------------------------------
    def view(self, prefix: str) -> View | None:
        """What can be read of ``prefix`` now, without waiting: its complete listing
        (scheduling a refresh when stale), the part of a first listing that has
        arrived, or None."""
        with self._env.read() as txn:
            row = self._row(txn, prefix)
        if row is not None:
            self._revalidate(prefix, row[1])
            return View(row[0], None)
        listing = self._inflight.get(prefix)
        if listing is not None and listing.version is not None:
            return View(listing.version, listing.water)
        return None

    async def _wait(self, prefix: str) -> _Listing:
        """Start (or join) the listing of ``prefix`` and wait for its next progress."""
        listing = self._start(prefix)
        await listing.progress.wait()
        return listing

    def _check(self, listing: _Listing, prefix: str) -> None:
        if listing.error is not None and self.view(prefix) is None:
            raise listing.error

    async def ensure(self, prefix: str) -> None:
        """Return once ``prefix`` has a complete listing (at once if it has one, fresh or
        stale). Raises StoreError when listing fails and no listing is known."""
        while True:
            v = self.view(prefix)
            if v is not None and v.limit is None:
                return
            if self._store is None:
                return  # a manifest mount: a directory it does not have is empty
            listing = self._start(prefix)
            await listing.done.wait()
            self._check(listing, prefix)
            if listing.error is not None:
                return

    async def lookup(self, prefix: str, name: bytes) -> Entry | None:
        """The entry ``name`` of directory ``prefix``, waiting only while a first listing
        has not reached it yet. Raises StoreError when listing fails and nothing is known."""
        while True:
            v = self.view(prefix)
            if v is not None and (v.limit is None or name < v.limit):
                return self._get(v.version, name)
            if self._store is None:
                return None
            listing = await self._wait(prefix)
            self._check(listing, prefix)
            if listing.error is not None:
                v = self.view(prefix)
                return self._get(v.version, name) if v is not None else None

    async def readable(self, prefix: str, after: bytes | None) -> View | None:
        """A view of ``prefix`` with names after ``after`` to read, or with all of them
        read (the end of the directory); waits while a first listing has nothing after
        ``after`` yet. None: a manifest mount without this directory."""
        while True:
            v = self.view(prefix)
            if v is not None and (v.limit is None or self._has_after(v, after)):
                return v
            if self._store is None:
                return v
            listing = await self._wait(prefix)
            self._check(listing, prefix)
            if listing.error is not None:
                return self.view(prefix)

    def _has_after(self, v: View, after: bytes | None) -> bool:
        for _ in self._iter(v, after):
            return True
        return False

    async def find_file(self, key: str) -> Entry | None:
        """The entry of the object ``key`` (its directory listed if needed), or None when
        no file of that name is listed. Raises StoreError when listing fails."""
        parent = key[:key.rfind("/") + 1]
        entry = await self.lookup(parent, _enc(key[len(parent):]))
        return None if entry is None or entry.is_dir else entry

    # -- queries (trio thread; no S3) ------------------------------------------
    def _get(self, version: int, name: bytes) -> Entry | None:
        with self._env.read() as txn:
            raw = txn.get(_VERSION.pack(version) + name, db=self._names)
        return None if raw is None else _unpack(name, raw)

    def get(self, prefix: str, name: bytes) -> Entry | None:
        """``name`` in what is known of ``prefix`` now (no waiting, no S3)."""
        v = self.view(prefix)
        if v is None or (v.limit is not None and name >= v.limit):
            return None
        return self._get(v.version, name)

    def count(self, prefix: str) -> int:
        with self._env.read() as txn:
            row = self._row(txn, prefix)
        return 0 if row is None else row[2]

    def iter_entries(self, prefix: str, after: bytes | None = None) -> Iterator[Entry]:
        """Entries of ``prefix`` known now, in name order, starting after name ``after``."""
        v = self.view(prefix)
        return iter(()) if v is None else self._iter(v, after)

    def entries_in(self, v: View, after: bytes | None = None) -> Iterator[Entry]:
        return self._iter(v, after)

    def _iter(self, v: View, after: bytes | None) -> Iterator[Entry]:
        vb = _VERSION.pack(v.version)
        start = vb + after if after is not None else vb
        limit = v.limit
        with self._env.read() as txn:
            cur = txn.cursor(db=self._names)
            if not cur.set_range(start):
                return
            for key, raw in cur:
                if not key.startswith(vb):
                    return
                name = key[8:]
                if limit is not None and name >= limit:
                    return
                if after is not None and name == after:
                    continue
                yield _unpack(name, raw)

    def resolve(self, ino: int) -> tuple[str, Entry] | None:
        """(parent prefix, entry) of a listed inode, or None when that version of the
        name is no longer listed (the object changed or is gone: ESTALE). A stale
        listing answers at once and is refreshed in the background."""
        with self._env.read() as txn:
            raw = txn.get(_INO.pack(ino), db=self._inodes)
            if raw is None:
                return None
            pid, name = bytes(raw[:8]), bytes(raw[8:])
            row_raw = txn.get(pid, db=self._listings)
            if row_raw is not None:
                version, listed_at = _LISTING.unpack_from(row_raw)[:2]
                prefix = bytes(row_raw[_LISTING.size:]).decode("utf-8", "surrogateescape")
                self._revalidate(prefix, listed_at)  # getattr/open of a stale listing
            else:
                listing = self._inflight_ids.get(pid)
                if listing is None or listing.version is None:
                    return None
                version, prefix = listing.version, listing.prefix
            entry_raw = txn.get(_VERSION.pack(version) + name, db=self._names)
        if entry_raw is None:
            return None
        entry = _unpack(name, entry_raw)
        return (prefix, entry) if entry.ino == ino else None

    # -- listing ahead ------------------------------------------------------------
    def list_ahead(self, prefix: str) -> None:
        """The walker is in ``prefix``: list its sub-directories ahead of it."""
        if self._store is None or not self.list_ahead_workers:
            return
        with self._env.read() as txn:
            row = self._row(txn, prefix)
        if row is None:  # listed (or being listed) for the walker: queue them when done
            self._start(prefix).ahead = True
            return
        if row[3] == 0:
            return
        subdirs = []
        for entry in self.iter_entries(prefix):
            if entry.is_dir:
                subdirs.append(prefix + entry.name.decode("utf-8", "surrogateescape") + "/")
                if len(subdirs) >= row[3] or len(subdirs) >= AHEAD_QUEUE:
                    break
        self._queue_ahead(subdirs)

    def _queue_ahead(self, subdirs: list[str]) -> None:
        self._ahead.extend(reversed(subdirs))  # the first sub-directory is taken first
        self._ahead_lot.unpark(count=len(subdirs))

    async def _ahead_worker(self) -> None:
        while True:
            if not self._ahead:
                await self._ahead_lot.park()
                continue
            prefix = self._ahead.pop()
            if prefix in self._inflight or self.listed_at(prefix) is not None:
                continue
            listing = self._start(prefix)
            await listing.done.wait()

    # -- listing -----------------------------------------------------------------
    def _start(self, prefix: str) -> _Listing:
        listing = self._inflight.get(prefix)
        if listing is not None:
            return listing
        if self._nursery is None:
            raise RuntimeError("Metadata.run() is not running")
        listing = self._inflight[prefix] = _Listing(prefix)
        listing.tick = self._tick
        self._inflight_ids[prefix_id(prefix)] = listing
        self._nursery.start_soon(self._run_listing, listing)
        return listing

    async def _run_listing(self, listing: _Listing) -> None:
        prefix = listing.prefix
        try:
            await self._list_ranges(listing)
        except Exception as group:
            exc = _leaf(group)
            listing.error = exc
            self._retry_after[prefix] = self._clock() + REFRESH_BACKOFF
            if self.listed_at(prefix) is not None:
                log.warning("refreshing the listing of %r failed (%s); serving the old one",
                            prefix, exc)
            else:
                log.warning("listing %r failed: %s", prefix or "/", exc)
        else:
            # An invalidate() that arrived while this listing ran must survive it.
            if self._stale.get(prefix, -1) <= listing.tick:
                self._stale.pop(prefix, None)
            self._retry_after.pop(prefix, None)
        finally:
            del self._inflight[prefix]
            self._inflight_ids.pop(prefix_id(prefix), None)
            listing.done.set()
            listing.progress.set()
        if listing.ahead and listing.error is None:
            self._queue_ahead(listing.subdirs)
        if listing.again and self._nursery is not None:
            self._start(prefix)

    async def _list_ranges(self, listing: _Listing) -> None:
        """List ``listing.prefix`` into a new version: one key range, split into more
        (listed at once, at most PARALLEL_RANGES) once it proves large."""
        writer = _VersionWriter(self, listing.prefix)
        state = _Ranges(writer)
        try:
            async with trio.open_nursery() as nursery:
                sem = trio.Semaphore(PARALLEL_RANGES)

                async def run(r: _Range) -> None:
                    async with sem:
                        await trio.to_thread.run_sync(self._range_sync, listing, state, r,
                                                      limiter=self._limiter)

                def schedule(after: _Range, new: list[_Range]) -> None:  # trio thread
                    i = state.ranges.index(after) + 1
                    state.ranges[i:i] = new
                    for nr in new:
                        nursery.start_soon(run, nr)

                state.schedule = schedule
                nursery.start_soon(run, state.ranges[0])
            if not writer.final:
                await trio.to_thread.run_sync(writer.finish)
        except BaseException:
            with trio.CancelScope(shield=True):
                await trio.to_thread.run_sync(writer.abandon)
            raise
        metrics.METADATA_LISTINGS.inc()
        for reason, n in writer.skipped.items():
            metrics.SKIPPED_KEYS.labels(reason).inc(n)
            log.info("%s: skipped %d key(s) (%s)", listing.prefix or "/", n, reason)
        listing.subdirs = writer.subdirs
        listing.version = writer.version

    def _progress(self, listing: _Listing, state: _Ranges) -> None:
        """(trio thread) Pages of ``listing`` were committed: names below the first
        unfinished range's progress are complete."""
        water = _ALL
        for r in state.ranges:
            if not r.done:
                bound = r.written or r.after
                water = watermark(listing.prefix, bound) if bound else b""
                break
        listing.version, listing.water = state.writer.version, water
        event, listing.progress = listing.progress, trio.Event()
        event.set()

    def _range_sync(self, listing: _Listing, state: _Ranges, r: _Range) -> None:
        """List the key range ``r`` of ``listing.prefix`` page by page, writing as it goes.
        Worker thread. After SPLIT_AFTER_ENTRIES entries with more to come, the rest of
        the range is split at guessed points and handed to the trio thread to list at once."""
        assert self._store is not None
        prefix = listing.prefix
        writer = state.writer
        token: str | None = None
        listed = 0
        batch: list[Entry] = []
        last_key: bytes | None = None
        while True:
            page = self._store.list_page(prefix, token, r.after if token is None else None)
            split_now = listed < SPLIT_AFTER_ENTRIES <= listed + len(page.objects) + len(page.prefixes)
            listed += len(page.objects) + len(page.prefixes)
            lo, hi = r.after, r.end
            objects = [o for o in page.objects
                       if (lo is None or o.key > lo) and (hi is None or o.key <= hi)]
            prefixes = [p for p in page.prefixes
                        if (lo is None or p > lo) and (hi is None or p <= hi)]
            texts = [t for t in (page.objects[-1].key if page.objects else None,
                                 page.prefixes[-1] if page.prefixes else None) if t]
            beyond = hi is not None and any(t > hi for t in texts)
            with writer.lock:
                batch += entries_from_listing(prefix, objects, prefixes, writer.skipped)
            within = [t for t in texts if hi is None or t <= hi]
            if within:
                r.last = max(within)
                if r.first is None:
                    r.first = min(([objects[0].key] if objects else [])
                                  + ([prefixes[0]] if prefixes else []) or within)
            more = page.next_token is not None and not beyond
            if more and split_now and r.last is not None and r.first is not None:
                points = split_points(prefix, r.first, r.last, hi)
                if points:
                    bounds = [*points, hi]
                    new = [_Range(points[i], bounds[i + 1]) for i in range(len(points))]
                    r.end = points[0]
                    state.split = True
                    trio.from_thread.run_sync(state.schedule, r, new)
            if not more:
                break
            token = page.next_token
            if len(batch) >= FLUSH_ENTRIES:
                last_key = writer.write(batch, last_key)
                batch = []
                r.written = r.last
                trio.from_thread.run_sync(self._progress, listing, state)
        if not state.split and writer.version is None:
            writer.write(batch, last_key, final=True)  # one range, one transaction
        else:
            writer.write(batch, last_key)
        r.done = True
        trio.from_thread.run_sync(self._progress, listing, state)

    def refresh_sync(self, prefix: str) -> int:
        """List ``prefix`` now and store it in one transaction (no streaming). Blocking:
        worker threads and tools only."""
        assert self._store is not None
        writer = _VersionWriter(self, prefix)
        try:
            batch: list[Entry] = []
            for page in list_dir(self._store, prefix):
                batch += entries_from_listing(prefix, page.objects, page.prefixes, writer.skipped)
            writer.write(batch, final=True)
        except BaseException:
            writer.abandon()
            raise
        metrics.METADATA_LISTINGS.inc()
        for reason, n in writer.skipped.items():
            metrics.SKIPPED_KEYS.labels(reason).inc(n)
        return writer.count

    # -- writing (worker threads) -----------------------------------------------------
    def _next_version(self, txn: Any) -> int:
        raw = txn.get(b"version", db=self._meta)
        version = (0 if raw is None else _VERSION.unpack(raw)[0]) + 1
        txn.put(b"version", _VERSION.pack(version), db=self._meta)
        return version

    def _delete_version(self, txn: Any, version: int) -> None:
        vb = _VERSION.pack(version)
        cur = txn.cursor(db=self._names)
        if cur.set_range(vb):
            while cur.key().startswith(vb):
                if not cur.delete():
                    break

    def write_entries(self, txn: Any, prefix: str, version: int, entries: Iterable[Entry],
                      last_key: bytes | None, old_version: int | None = None
                      ) -> tuple[int, int, bytes | None, list[str]]:
        """Append ``entries`` (sorted by name) to ``version`` of ``prefix``; returns (names
        added, sub-directories added, greatest key written, sub-directory prefixes).

        A name whose kind and ETag are the same in ``old_version`` keeps its inode;
        any other gets the next inode number (appended to ``inodes``)."""
        pid = prefix_id(prefix)
        vb = _VERSION.pack(version)
        ob = None if old_version is None else _VERSION.pack(old_version)
        raw_ino = txn.get(b"ino", db=self._meta)
        next_ino = ROOT_INO + 1 if raw_ino is None else _INO.unpack(raw_ino)[0]
        new_inodes: list[tuple[bytes, bytes]] = []
        in_order: list[tuple[bytes, bytes]] = []
        late: list[tuple[bytes, bytes, bool]] = []
        added = dirs = 0
        subdirs: list[str] = []
        for e in entries:
            flags = _F_DIR if e.is_dir else 0
            ino = 0
            if ob is not None:
                old = txn.get(ob + e.name, db=self._names)
                if old is not None and _unpack(e.name, old).etag == e.etag and \
                        (old[0] & _F_DIR) == flags:
                    ino = _ENTRY.unpack_from(old)[3]
            if not ino:
                ino = next_ino
                next_ino += 1
                new_inodes.append((_INO.pack(ino), pid + e.name))
            key = vb + e.name
            value = _pack(flags, e.size, e.mtime, ino, e.etag)
            if e.is_dir:
                dirs += 1
                if len(subdirs) < AHEAD_QUEUE:
                    subdirs.append(prefix + e.name.decode("utf-8", "surrogateescape") + "/")
            if not e.is_dir and (last_key is None or key > last_key):
                in_order.append((key, value))
                last_key = key
            else:  # a directory wins over a file of its name, whenever either arrives
                late.append((key, value, e.is_dir))
        if new_inodes:
            txn.cursor(db=self._inodes).putmulti(new_inodes, append=True)
            txn.put(b"ino", _INO.pack(next_ino), db=self._meta)
        if in_order:
            cur = txn.cursor(db=self._names)
            append = not cur.last() or cur.key() < in_order[0][0]
            consumed, n = cur.putmulti(in_order, append=append, overwrite=False)
            added += n
            if consumed > n:  # files whose name another range listed as a directory
                metrics.SKIPPED_KEYS.labels("shadowed").inc(consumed - n)
        for key, value, is_dir in late:
            old = txn.get(key, db=self._names)
            if old is not None:
                if is_dir and not _ENTRY.unpack_from(old)[0] & _F_DIR:
                    metrics.SKIPPED_KEYS.labels("shadowed").inc()
                    added -= 1
                else:
                    continue
            txn.put(key, value, db=self._names)
            added += 1
            if not is_dir and (last_key is None or key > last_key):
                last_key = key
        return added, dirs, last_key, subdirs


class _VersionWriter:
    """Writes one new version of a directory, batch by batch (from several range
    threads at once), and makes it current at the end (deleting the previous version).
    Worker threads; ``lock`` guards the counters."""

    def __init__(self, md: Metadata, prefix: str) -> None:
        self.md = md
        self.prefix = prefix
        self.lock = threading.Lock()
        self.version: int | None = None
        self.final = False
        self.count = 0
        self.dirs = 0
        self.skipped: Counter[str] = Counter()
        self.subdirs: list[str] = []
        self.old_version: int | None = None

    def write(self, batch: list[Entry], last_key: bytes | None = None,
              final: bool = False) -> bytes | None:
        """Write ``batch`` (names after ``last_key`` of the same range, sorted); returns the
        range's new last key. ``final``: the whole listing is in, make it current."""
        md = self.md
        with md._env.write() as txn:
            if self.version is None:
                old = txn.get(prefix_id(self.prefix), db=md._listings)
                self.old_version = None if old is None else _LISTING.unpack_from(old)[0]
                self.version = md._next_version(txn)
                if not final:  # several transactions: recoverable if the daemon dies
                    txn.put(b"pending:" + _VERSION.pack(self.version), b"", db=md._meta)
            added, dirs, last_key, subdirs = md.write_entries(
                txn, self.prefix, self.version, batch, last_key, self.old_version)
            with self.lock:
                self.count += added
                self.dirs += dirs
                if len(self.subdirs) < AHEAD_QUEUE:
                    self.subdirs += subdirs
            if final:
                self._make_current(txn)
        return last_key

    def finish(self) -> None:
        with self.md._env.write() as txn:
            if self.version is None:  # an empty directory
                self.version = self.md._next_version(txn)
            self._make_current(txn)

    def _make_current(self, txn: Any) -> None:
        md = self.md
        assert self.version is not None
        pid = prefix_id(self.prefix)
        old = txn.get(pid, db=md._listings)
        txn.put(pid, _LISTING.pack(self.version, md._clock(), self.count, self.dirs)
                + _enc(self.prefix), db=md._listings)
        if old is not None:
            md._delete_version(txn, _LISTING.unpack_from(old)[0])
        txn.delete(b"pending:" + _VERSION.pack(self.version), db=md._meta)
        self.final = True

    def abandon(self) -> None:
        if self.version is None or self.final:
            return
        try:
            with self.md._env.write() as txn:
                self.md._delete_version(txn, self.version)
                txn.delete(b"pending:" + _VERSION.pack(self.version), db=self.md._meta)
        except Exception:  # the next start removes it (pending marker)
            log.warning("could not remove an unfinished listing", exc_info=True)


@dataclasses.dataclass(eq=False)
class _Range:
    """Keys of one directory in (after, end] (None: unbounded), listed by one thread."""

    after: str | None = None
    end: str | None = None
    first: str | None = None  # the first key or common prefix listed
    last: str | None = None  # the greatest key or common prefix listed so far
    written: str | None = None  # ... and committed to LMDB (readers may see up to it)
    done: bool = False


class _Ranges:
    """The key ranges of one listing, in key order (the list is changed on the trio
    thread only; a range's fields by the thread listing it)."""

    def __init__(self, writer: _VersionWriter) -> None:
        self.writer = writer
        self.ranges = [_Range()]
        self.split = False
        self.schedule: Callable[[_Range, list[_Range]], None] = lambda r, new: None


_CLASSES = ("0123456789", "ABCDEFGHIJKLMNOPQRSTUVWXYZ", "abcdefghijklmnopqrstuvwxyz")


def split_points(prefix: str, first: str, last: str, end: str | None, levels: int = 3) -> list[str]:
    """Guessed points splitting the keys of ``prefix`` in (``last``, ``end``] into ranges,
    from the keys ``first`` .. ``last`` listed so far.

    At the first position where ``first`` and ``last`` differ, and at the ``levels - 1``
    positions before it, each greater character of the same class (digit, upper, lower
    case) starts a range: after ``f0000000`` .. ``f0001999`` come ``f0002`` ...
    ``f0009``, ``f001`` ... ``f009``, ``f01`` ... ``f09``, and the rest is one range.
    Keys are often numbered, so the ranges grow geometrically, and each one that proves
    large splits again. Any key falls in some range whatever the guess: a bad guess
    costs requests (an empty range is one LIST), never a missed key.
    """
    a, z = first[len(prefix):], last[len(prefix):]
    vary = next((i for i, (x, y) in enumerate(zip(a, z, strict=False)) if x != y), min(len(a), len(z)))
    points: set[str] = set()
    for j in range(min(vary, len(z) - 1), max(-1, vary - levels), -1):
        ch = z[j]
        for cls in _CLASSES:
            i = cls.find(ch)
            if i >= 0:
                points.update(prefix + z[:j] + c for c in cls[i + 1:])
                break
    return sorted(p for p in points if p > last and (end is None or p < end))


def _leaf(exc: BaseException) -> BaseException:
    """The first real error inside (nested) exception groups of a listing's nursery."""
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    return exc
