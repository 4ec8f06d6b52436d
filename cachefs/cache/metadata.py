"""The file-system index: directory listings of the bucket and inode numbers, in LMDB.

The tree is built lazily, one directory at a time: listing a directory is
ListObjectsV2 with ``Delimiter='/'`` (all pages), stored as a new *version* of
that directory; lookups, getattr and readdir are then answered from LMDB
without any S3 request, including after a remount with the same cache
directory. Nothing per object is kept in Python memory: a million listed
objects cost the daemon their LMDB pages only.

The layout in LMDB (versions of directories, inode numbers per object
version) is :mod:`cachefs.cache.index`.

Mapping keys to names (documented in README):

* ``/`` separates directories. A key ending in ``/`` (a directory marker)
  makes a directory; the marker itself is not a file (one holding data is
  counted as ``marker_with_data``).
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

Large directories: a listing is one key range at first; once it has listed
SPLIT_AFTER_ENTRIES names with more to come, the rest is split at guessed keys
(:func:`split_points`) into ranges listed at once with StartAfter (at most
PARALLEL_RANGES per directory, each of which may split again), so a
directory of 200,000 names is listed in about the time of 25 sequential
pages instead of 200. The watermark then follows the first unfinished range.

Concurrency: every listing runs in the nursery of :meth:`Metadata.run` (its
owner): its ranges in worker threads under ``limiter``, so a caller that gives
up (an interrupted FUSE request) does not cancel a listing others wait for.
In the daemon ``store`` is the :class:`~cachefs.s3.origin.Origin`'s blocking
face: each page is a request through the origin (retried until the retry
deadline, its waits holding no S3 connection) while the range's thread waits.
One listing per directory at a time (single flight); an invalidate() during a
listing makes it run once more. A flat listing of the folders ahead of a walk
(:meth:`Metadata._start_flat`, at most FLAT_LISTINGS at a time, counted on the trio
thread) registers each folder as a listing in flight before its one LIST starts in a
worker thread; the page's other whole folders that have no listing are registered when
it returns (trio thread), and all the folders it holds whole are written in one worker
thread, a transaction each; the others are listed as usual. Listing ahead:
``opendir`` queues the directory's sub-directories (a bounded stack, newest
first, like a depth-first walker), a walk through folders in order queues the
folders after the one it is in (:meth:`Metadata.next_dir`; a bounded queue, taken
first and in the order asked: the walk stops at the first one not listed; after a
parent's last folder, :meth:`Metadata.next_walked_dir` goes on into the next parent's
first folder, its folders listed by one flat page), and
``list_ahead`` workers list them before the walker gets there; a new mount lists the
path a walk in name order starts on (the root, its first sub-directory, and so on down:
:meth:`Metadata.list_at_mount`), and with the root's LIST, one flat page of the root
(the mount page) that lists every folder it holds whole, at any depth: while it is in
flight, a first listing of a folder under the root waits for it (at most
MOUNT_PAGE_WAIT) instead of sending a LIST of its own.
Reads of LMDB run on the trio thread and the FUSE request
workers (lock-free snapshots); writes in the listing threads, a transaction per
batch of names (LMDB lets one writer in at a time; the others wait in their
threads). The request workers' lookups remember the entries they found, by inode,
in a bounded table (``_recent``, under its own lock) so the open that follows
needs no snapshot; a remembered entry is used only while the index's
``generation`` (bumped after every commit that makes a listing current) is the
one it was read at.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence

import trio

from cachefs import metrics
from cachefs.cache.index import (
    AHEAD_QUEUE,
    NAME_MAX,
    Entry,
    Index,
    VersionWriter,
    View,
    enc,
    parent_prefix,
    prefix_id,
    snapshot,
)
from cachefs.cache.lmdbenv import LmdbEnv
from cachefs.s3.store import ObjectInfo, ObjectStore, list_dir

#: Names of a parent's listing next_dir() looks at past a directory (files between it
#: and the next directory are skipped).
NEXT_DIR_SCAN = 4096
#: Directories after it that next_dir() has listed ahead: a walk in order through
#: folders of a few hundred small files goes through one in less than a LIST round
#: trip across regions, so one directory listed ahead is not enough for its lookahead
#: to keep a window of GETs in flight across folders.
NEXT_DIRS_LISTED = 16
#: ... or, after a folder of few files, as many of that size as hold this many files, at
#: most MAX_DIRS_LISTED: a walk's requests go on from folder to folder as far as its
#: window and stretch reach (up to 2 x 256 files, read/lookahead.py), all in one top-up,
#: and stop at the first folder not listed. 16 folders of 6 files were passed in one
#: top-up, and the walk then waited a LIST (0.2-0.5 s under a cold pass's load) every
#: 16 folders.
FILES_LISTED_AHEAD = 512
MAX_DIRS_LISTED = 256
#: Flat listings (one ListObjectsV2 without a delimiter over the next folders of a walk
#: through folders of few files, see Metadata._start_flat) in flight at most; more
#: folders wait for the list-ahead workers, one LIST each.
FLAT_LISTINGS = 4
#: Parents whose last next_dir() scan is kept (walks through several parents at once).
NEXT_SCANS = 64
#: Levels next_walked_dir() climbs from a parent's last folder, and goes down again.
WALK_LEVELS = 4
#: Levels below the mount's root that list_at_mount() lists, each its parent's first
#: sub-directory (s3://bucket/ds/train/class000/: three).
LIST_AT_MOUNT_DEPTH = 4
#: Folders below a flat page's parent written from it, at most this many levels deep (a
#: nested dataset's train/class/ folders are two).
FLAT_DEPTH = 4
#: A first listing of a folder under the root waits at most this long for the mount page
#: in flight (a page slowed by retries must not hold a reader past its own LIST's time).
MOUNT_PAGE_WAIT = 2.0
#: Names first_file_now() looks at for a directory's first file (sub-directories first).
FIRST_FILE_SCAN = 64
#: Entries of recent lookups kept in memory by inode, so the open (or getattr) that
#: follows a lookup of a name needs no index read (see Metadata.resolve_now).
RECENT_INODES = 4096

__all__ = ["Entry", "Metadata", "View", "entries_from_listing", "invalid_name_reason",
           "split_points", "watermark"]

log = logging.getLogger(__name__)

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


def entries_from_listing(prefix: str, objects: list[ObjectInfo], prefixes: list[str],
                         skipped: Counter[str]) -> list[Entry]:
    """Turn (a page of) one directory's listing into its entries (sorted by name),
    counting skips. Inode numbers are assigned when the entries are stored."""
    files: dict[str, ObjectInfo] = {}
    n = len(prefix)
    for obj in objects:
        name = obj.key[n:]
        if name == "" and obj.key == prefix:
            if obj.size > 0:  # bytes no file name can show: count them, never hide silently
                skipped["marker_with_data"] += 1
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
    result = [Entry(enc(name), True) for name in dirs]
    result += [Entry(enc(name), False, o.size, o.mtime, o.etag) for name, o in files.items()]
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
            return enc(rel[:i])
    return enc(rel)


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


class Metadata:
    """Listings of one bucket's directories and the inodes of their names, in LMDB.

    ``prefix`` arguments are full S3 key prefixes ("" or ending in "/").
    ``store`` None: a manifest mount (:mod:`cachefs.cache.manifest`): nothing is
    ever listed, and a directory the manifest does not have does not exist.
    """

    def __init__(self, env: LmdbEnv, store: ObjectStore | None, *, ttl: float,
                 limiter: trio.CapacityLimiter, clock: Callable[[], float] = time.time,
                 list_ahead: int = 16, root: str | None = None) -> None:
        self._env = env
        # The mount's root prefix: a directory under it listed for a reader has the
        # directories after it listed ahead (see _start); None: not done.
        self._root = root
        self._store = store
        self._ttl = ttl
        self._limiter = limiter
        self._clock = clock
        self.list_ahead_workers = list_ahead
        # Invalidated prefixes -> the tick of their latest invalidate(); a listing clears
        # the mark only if it started after that (it may predate the change otherwise).
        self._stale: dict[str, int] = {}
        # Stale prefixes -> the tick of the latest invalidate() a completed listing came
        # after (a later one keeps the prefix stale): entries only while in _stale.
        self._covered: dict[str, int] = {}
        self._tick = 0
        self._listeners: list[Callable[[str], None]] = []  # (see add_listener)
        self._retry_after: dict[str, float] = {}  # failed refreshes wait before the next
        self._inflight: dict[str, _Listing] = {}
        self._inflight_ids: dict[bytes, _Listing] = {}
        self._index = Index(env)
        # inode -> (index generation, prefix, entry, listed at) of recent lookups in complete
        # listings, oldest first; any thread, under _recent_lock. An entry is used only while
        # the generation it was read at is current: no listing has been made current since,
        # so the index would answer the same (refresh due or not is decided afresh).
        self._recent: dict[int, tuple[int, str, Entry, float]] = {}
        self._recent_lock = threading.Lock()
        self.recent_size = RECENT_INODES
        self._nursery: trio.Nursery | None = None
        # Directories to list ahead (trio thread; both bounded by AHEAD_QUEUE): opendir's
        # sub-directories, a stack taken newest first (a depth-first walker goes into the
        # last directory it opened), and next_dir()'s folders, taken first and in the
        # order asked (a walk through folders in order reaches them in that order, and
        # stops at the first one not listed).
        self._ahead: collections.deque[str] = collections.deque(maxlen=AHEAD_QUEUE)
        self._next_ahead: collections.deque[str] = collections.deque(maxlen=AHEAD_QUEUE)
        self._flat_running = 0  # flat listings in flight (trio thread)
        # Set once the mount page's folders are registered as listings in flight (or it
        # failed); None when no mount page is in flight (trio thread).
        self._mount_page: trio.Event | None = None
        self._mount_page_until = 0.0  # (trio clock) waits for it end then at the latest
        self._mount_page_root = ""  # the prefix it lists
        # Directories next_dir() queued to be listed ahead, and when (trio thread; bounded
        # by AHEAD_QUEUE): a walk asks at every top-up, and each ask would otherwise look
        # each following directory up in the index again.
        self._asked_ahead: collections.OrderedDict[str, float] = collections.OrderedDict()
        # The last next_dir() scan of each parent (trio thread; NEXT_SCANS parents, least
        # recently scanned dropped): (the listing scanned, the directories found after the
        # folder asked about, whether the parent's last directory is among them).
        self._next_scans: collections.OrderedDict[str, tuple[View, list[str], bool]] = (
            collections.OrderedDict())
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
        n = self._index.recover()
        if n:
            log.info("removed %d unfinished listing(s) of an earlier run", n)

    # -- freshness -------------------------------------------------------------
    def listed_at(self, prefix: str) -> float | None:
        row = self._index.row(prefix)
        return None if row is None else row[1]

    def is_fresh(self, prefix: str) -> bool:
        if self._store is None:
            return True
        if prefix in self._stale:
            return False
        at = self.listed_at(prefix)
        return at is not None and self._clock() - at < self._ttl

    def add_listener(self, listener: Callable[[str], None]) -> None:
        """Call ``listener(prefix)`` (on any thread) after every change that may change an
        answer of :meth:`lookup_fresh_now` in ``prefix`` before its ``fresh_for`` ran out:
        its listing made current, or marked stale. (Set up before the mount serves.)"""
        self._index.listeners.append(listener)
        self._listeners.append(listener)

    def invalidate(self, prefix: str) -> int:
        """Refresh ``prefix`` in the background now (e.g. after ESTALE); its listing is
        served until the new one is complete. Returns this invalidation's tick (see
        :meth:`refresh_pending`)."""
        if self._store is None:
            return 0
        self._tick += 1
        self._stale[prefix] = self._tick
        for listener in self._listeners:
            listener(prefix)
        self._retry_after.pop(prefix, None)
        running = self._inflight.get(prefix)
        if running is not None:
            running.again = True  # it may predate the change: list once more after it
        elif self._nursery is not None:
            self._start(prefix)
        return self._tick

    def _revalidate(self, prefix: str, listed_at: float) -> None:
        """Called for every answer from ``prefix``'s complete listing: counts a stale
        answer and starts its refresh unless one runs or the last failed moments ago."""
        if self._store is None:
            return
        now = self._clock()
        if prefix in self._stale or now - listed_at >= self._ttl:
            metrics.METADATA_STALE_SERVED.inc()
            if prefix in self._inflight or now < self._retry_after.get(prefix, 0.0):
                return  # refreshing, or the last refresh failed moments ago: the old serves
            self._start(prefix)

    def refresh_pending(self, prefix: str, since: int = 0) -> bool:
        """Whether ``prefix`` was invalidated (at tick ``since`` or later: the tick
        :meth:`invalidate` returned; 0: any) and no listing started after that has
        completed (any thread: dictionary reads). A name's entry may then be outdated."""
        if self._store is None or prefix not in self._stale:
            return False
        return since <= 0 or self._covered.get(prefix, -1) < since

    async def refreshed(self, prefix: str, since: int = 0) -> None:
        """Wait until a listing of ``prefix`` started after its invalidation at tick
        ``since`` (0: its last one) has completed, or until the refresh fails (then the
        old listing goes on being served, as everywhere); later invalidations are not
        waited for. Returns at once when no refresh is pending. A lookup of a name whose
        object a GET saw change waits here (see :meth:`cachefs.fs.FileSystem.lookup`):
        the kernel asks once more, after an open answered ESTALE, and must find the new
        version then."""
        while self.refresh_pending(prefix, since):
            listing = self._inflight.get(prefix)
            if listing is None:
                if self._nursery is None or self._clock() < self._retry_after.get(prefix, 0.0):
                    return  # (the last refresh failed moments ago: the old listing serves)
                listing = self._start(prefix)
            await listing.done.wait()
            if listing.error is not None and self._inflight.get(prefix) is None:
                return  # failed, and not listed once more: the old listing serves

    async def settled(self, prefix: str) -> None:
        """Wait until no listing of ``prefix`` is running (tests, tools)."""
        while (listing := self._inflight.get(prefix)) is not None:
            await listing.done.wait()

    # -- views -----------------------------------------------------------------
    def view(self, prefix: str) -> View | None:
        """What can be read of ``prefix`` now, without waiting: its complete listing
        (scheduling a refresh when stale), the part of a first listing that has
        arrived, or None."""
        row = self._index.row(prefix)
        if row is not None:
            self._revalidate(prefix, row[1])
            return View(row[0], None)
        listing = self._inflight.get(prefix)
        if listing is not None and listing.version is not None:
            return View(listing.version, listing.water)
        return None

    # -- the same, from any thread (request workers): no side effects -----------
    # These read LMDB and the listing state (dictionary lookups, atomic under the GIL)
    # and never start a listing; ``due`` tells the caller to run view(prefix) on the
    # trio thread, which starts the refresh a stale listing needs.
    def _due(self, prefix: str, listed_at: float) -> bool:
        """Whether view() would start a refresh of ``prefix`` now (read-only twin of
        _revalidate's test)."""
        if self._store is None or prefix in self._inflight:
            return False
        now = self._clock()
        if prefix in self._stale or now - listed_at >= self._ttl:
            return now >= self._retry_after.get(prefix, 0.0)
        return False

    def view_now(self, prefix: str) -> tuple[View | None, bool]:
        """(what view() returns, whether a refresh is due). Any thread."""
        row = self._index.row(prefix)
        if row is not None:
            return View(row[0], None), self._due(prefix, row[1])
        listing = self._inflight.get(prefix)
        if listing is not None and listing.version is not None:
            return View(listing.version, listing.water), False
        return None, False

    def lookup_now(self, prefix: str, name: bytes) -> tuple[bool, Entry | None, bool]:
        """(known, entry, refresh due): ``known`` False when lookup() would wait for a
        listing (then ask it on the trio thread). Any thread."""
        return self.lookup_fresh_now(prefix, name)[:3]

    def lookup_fresh_now(self, prefix: str, name: bytes
                         ) -> tuple[bool, Entry | None, bool, float]:
        """:meth:`lookup_now` and ``fresh_for``: for how many seconds from now the same
        name gives the same answer unless a listener (:meth:`add_listener`) is called
        first -- the rest of a complete listing's freshness; 0 for any other answer (a
        listing in progress, a stale one, none). Any thread."""
        generation = self._index.generation  # before the snapshot (see _recent)
        found = self._index.lookup(prefix, name)  # the listing and the name: one snapshot
        if found is not None:
            row, entry = found
            if entry is not None:
                self._remember(entry.ino, (generation, prefix, entry, row[1]))
            return True, entry, self._due(prefix, row[1]), self._fresh_for(prefix, row[1])
        v, due = self.view_now(prefix)  # a first listing in progress, or none
        if v is not None and (v.limit is None or name < v.limit):
            return True, self._get(v.version, name), due, 0.0
        if v is None and self._store is None:
            return True, None, False, 0.0  # a manifest mount: not there
        return False, None, due, 0.0

    def entries_after_now(self, prefix: str, after: bytes, n: int) -> list[Entry]:
        """Up to ``n`` entries of ``prefix``'s complete listing after name ``after``, in
        name order; none while it has no complete listing. Any thread, no side effects
        (a stale listing is refreshed by whoever asked :meth:`lookup_fresh_now`)."""
        row = self._index.row(prefix)
        if row is None:
            return []
        with snapshot(self._index.iter(View(row[0], None), after)) as entries:
            return list(itertools.islice(entries, n))

    def dir_ino_now(self, prefix: str) -> tuple[int, int] | None:
        """(the inode of directory ``prefix`` in its parent's complete listing, the number
        of sub-directories in that listing), or None (the root, no such listing, not a
        directory there). Any thread, no side effects."""
        parent = parent_prefix(prefix)
        if parent == prefix:
            return None
        found = self._index.lookup(parent, enc(prefix[len(parent):-1]))
        if found is None or found[1] is None or not found[1].is_dir:
            return None
        return found[1].ino, found[0][3]

    @property
    def generation(self) -> int:
        """The index's generation (see ``_recent``): read it before the listing whose
        entries :meth:`remember_entries` is given."""
        return self._index.generation

    def remember_entries(self, prefix: str, generation: int, entries: Sequence[Entry]) -> None:
        """Remember the inodes of ``entries`` of ``prefix``'s complete listing, read after
        ``generation`` was, as a lookup does (``_recent``): their next :meth:`resolve_now`
        answers from memory while no listing was made current since. For files about to
        be resolved by inode elsewhere (the sweep's: the template its file is given ahead,
        on the S3 thread that registers it). Any thread; one index read (the listing's
        row), none without a complete listing."""
        row = self._index.row(prefix)
        if row is None:
            return
        for entry in entries:
            self._remember(entry.ino, (generation, prefix, entry, row[1]))

    def fresh_for_now(self, prefix: str) -> float:
        """For how many seconds from now ``prefix``'s complete listing stays fresh (0: none,
        or stale). Any thread, no side effects (see :meth:`lookup_fresh_now`)."""
        row = self._index.row(prefix)
        return 0.0 if row is None else self._fresh_for(prefix, row[1])

    def first_file_now(self, prefix: str) -> tuple[int, int] | None:
        """(the inode of the first file (not sub-directory) of ``prefix``'s complete
        listing, the number of files in it), or None (no complete listing, or no file among
        its first :data:`FIRST_FILE_SCAN` names). Any thread, no side effects."""
        row = self._index.row(prefix)
        if row is None:
            return None
        with snapshot(self._index.iter(View(row[0], None), None)) as entries:
            for entry in itertools.islice(entries, FIRST_FILE_SCAN):
                if not entry.is_dir:
                    return entry.ino, row[2] - row[3]
        return None

    def _fresh_for(self, prefix: str, listed_at: float) -> float:
        """Seconds until a complete listing listed at ``listed_at`` needs a refresh (a
        manifest's never does: a day)."""
        if self._store is None:
            return 86400.0
        if prefix in self._stale:
            return 0.0
        return max(0.0, min(86400.0, listed_at + self._ttl - self._clock()))

    def _remember(self, ino: int, item: tuple[int, str, Entry, float]) -> None:
        with self._recent_lock:
            recent = self._recent
            recent.pop(ino, None)
            recent[ino] = item
            if len(recent) > self.recent_size:
                del recent[next(iter(recent))]

    def resolve_now(self, ino: int) -> tuple[tuple[str, Entry] | None, str | None]:
        """(what resolve() returns, the prefix whose refresh is due or None). Any thread.
        The inode of a recent lookup is answered from memory (see ``_recent``)."""
        hit = self._recent.get(ino)
        if hit is not None and hit[0] == self._index.generation:
            _, known_prefix, known, listed_at = hit
            return ((known_prefix, known),
                    known_prefix if self._due(known_prefix, listed_at) else None)
        found = self._index.resolve(ino)
        if found is None:
            return None, None
        pid, name, row, entry = found
        due = None
        if row is not None:
            prefix = row[2]
            if self._due(prefix, row[1]):
                due = prefix
        else:
            listing = self._inflight_ids.get(pid)
            if listing is None or listing.version is None:
                return None, None
            prefix = listing.prefix
            entry = self._index.get(listing.version, name)
        return ((prefix, entry) if entry is not None and entry.ino == ino else None), due

    async def _wait(self, prefix: str) -> _Listing:
        """Start (or join) the listing of ``prefix`` and wait for its next progress."""
        listing = self._start(prefix, follow=True)
        await listing.progress.wait()
        return listing

    async def _after_mount_page(self, prefix: str) -> bool:
        """Before a first listing of ``prefix``, a folder under the root: wait for the
        mount page in flight, which may list it at no request more (trio thread). The
        wait ends once the page's folders are listings in flight (callers then join
        them), or MOUNT_PAGE_WAIT after the page started. True if it waited: the caller
        looks again."""
        page, root = self._mount_page, self._mount_page_root
        if page is None or page.is_set() or prefix == root or not prefix.startswith(root) \
                or trio.current_time() >= self._mount_page_until \
                or not self._unlisted(prefix):
            return False
        with trio.move_on_at(self._mount_page_until):
            await page.wait()
        return True

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
            if await self._after_mount_page(prefix):
                continue
            listing = self._start(prefix, follow=True)
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
            if await self._after_mount_page(prefix):
                continue
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
            if await self._after_mount_page(prefix):
                continue
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
        no file of that name is listed. Raises StoreError when listing fails. From a
        complete listing it reads the index once, and its inode resolves from memory next
        (as after :meth:`lookup_fresh_now`): the read-order hint resolves every hinted
        file here, and the template its file is given ahead resolves the inode."""
        parent = key[:key.rfind("/") + 1]
        name = enc(key[len(parent):])
        generation = self._index.generation  # before the snapshot (see _recent)
        found = self._index.lookup(parent, name)  # the listing and the name: one snapshot
        if found is not None:  # (a complete listing: what lookup() reads, in one read)
            row, entry = found
            self._revalidate(parent, row[1])
            if entry is not None:
                # (a hinted file's inode is asked for next: its open template ahead)
                self._remember(entry.ino, (generation, parent, entry, row[1]))
        else:
            entry = await self.lookup(parent, name)
        return None if entry is None or entry.is_dir else entry

    # -- queries (trio thread; no S3) ------------------------------------------
    def _get(self, version: int, name: bytes) -> Entry | None:
        return self._index.get(version, name)

    def get(self, prefix: str, name: bytes) -> Entry | None:
        """``name`` in what is known of ``prefix`` now (no waiting, no S3)."""
        v = self.view(prefix)
        if v is None or (v.limit is not None and name >= v.limit):
            return None
        return self._get(v.version, name)

    def count(self, prefix: str) -> int:
        row = self._index.row(prefix)
        return 0 if row is None else row[2]

    def iter_entries(self, prefix: str, after: bytes | None = None) -> Iterator[Entry]:
        """Entries of ``prefix`` known now, in name order, starting after name ``after``."""
        v = self.view(prefix)
        return iter(()) if v is None else self._iter(v, after)

    def entries_in(self, v: View, after: bytes | None = None) -> Iterator[Entry]:
        return self._iter(v, after)

    def _iter(self, v: View, after: bytes | None) -> Iterator[Entry]:
        return self._index.iter(v, after)

    def resolve(self, ino: int) -> tuple[str, Entry] | None:
        """(parent prefix, entry) of a listed inode, or None when that version of the
        name is no longer listed (the object changed or is gone: ESTALE). A stale
        listing answers at once and is refreshed in the background."""
        found = self._index.inode(ino)
        if found is None:
            return None
        pid, name, row = found
        if row is not None:
            version, listed_at, prefix = row
            self._revalidate(prefix, listed_at)  # getattr/open of a stale listing
        else:
            listing = self._inflight_ids.get(pid)
            if listing is None or listing.version is None:
                return None
            version, prefix = listing.version, listing.prefix
        entry = self._index.get(version, name)
        return (prefix, entry) if entry is not None and entry.ino == ino else None

    # -- listing ahead ------------------------------------------------------------
    def list_ahead(self, prefix: str) -> None:
        """The walker is in ``prefix``: list its sub-directories ahead of it."""
        if self._store is None or not self.list_ahead_workers:
            return
        row = self._index.row(prefix)
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

    def list_at_mount(self, root: str) -> None:
        """A new mount: list the path a walk in name order starts on before the first
        access asks for it (trio thread; a task of :meth:`run`'s nursery): ``root``, then
        its first sub-directory, and so on down, at most :data:`LIST_AT_MOUNT_DEPTH`
        levels. Every access needs the root's listing, and a reader in name order each
        first directory next: its first open then waits for no LIST across regions per
        level. With the root's LIST goes one flat page of the root (the mount page,
        :meth:`_start_mount_page`): the folders it holds whole are listed by it, so the
        first levels cost one round trip in all, not one each, and a walk through folders
        of few files finds the first hundreds listed. A listing kept from an earlier
        mount is not listed again (a stale one is refreshed when used). Not with
        ``--list-ahead 0`` (lists only on demand)."""
        if self._store is not None and self.list_ahead_workers and self._nursery is not None:
            if self._unlisted(root):  # (now: a reader's first lookup may come before the task)
                self._start_mount_page(root)
            self._nursery.start_soon(self._list_first_path, root)

    async def _list_first_path(self, prefix: str) -> None:
        for _ in range(LIST_AT_MOUNT_DEPTH + 1):
            if self._index.row(prefix) is None:
                await self._after_mount_page(prefix)
            if self._index.row(prefix) is None:
                listing = self._start(prefix)
                await listing.done.wait()
                if listing.error is not None:
                    return  # (reported by the listing; the first access tries again)
            row = self._index.row(prefix)
            if row is None or row[3] == 0:
                return
            with snapshot(self.iter_entries(prefix)) as entries:
                first = next((e for e in itertools.islice(entries, NEXT_DIR_SCAN)
                              if e.is_dir), None)
            if first is None:
                return
            prefix += first.name.decode("utf-8", "surrogateescape") + "/"

    def _start_mount_page(self, root: str) -> None:
        """Start the mount page: one flat LIST of ``root`` from its first key, beside the
        root's own LIST (trio thread). Across regions each level of a path costs a round
        trip when listed one LIST at a time (the root, then its first folder, ...); the
        page lists every folder it holds whole, at any depth up to FLAT_DEPTH, in the one
        round trip the root's LIST takes anyway. A bucket whose first folder is larger
        than a page gets nothing from it, at the cost of one request."""
        assert self._nursery is not None
        self._mount_page = page = trio.Event()
        self._mount_page_root = root
        self._mount_page_until = trio.current_time() + MOUNT_PAGE_WAIT
        self._flat_running += 1
        self._nursery.start_soon(self._run_flat, root, [], root, page)

    def next_dir(self, prefix: str, root: str) -> str | None:
        """The directory after ``prefix`` in its parent's listing, or None (``prefix``
        is ``root`` or outside it, the last directory of its parent, or the parent's
        listing is not here). That directory and those after it, as many in all as
        :func:`dirs_listed_ahead` says for ``prefix``'s number of files, that have no
        listing are queued for the list-ahead workers (after those queued before: the
        workers take them in the order asked, before opendir's). Trio thread; looks at
        most NEXT_DIR_SCAN names."""
        if prefix == root or not prefix.startswith(root):
            return None
        parent = parent_prefix(prefix)
        v = self.view(parent)
        if v is None:
            return None
        row = self._index.row(prefix)
        wanted = dirs_listed_ahead(row[2] - row[3] if row is not None else 0)
        # A folder of folders (a tree's upper level): one flat page lists the folders
        # after it whole, and their folders, as many as it holds (a LIST each would list
        # only their folders' names, and each of those would wait for a LIST of its own)
        of_folders = row is not None and row[2] == row[3] > 0
        scan = self._next_scans.get(parent)
        if scan is not None and scan[0] == v and prefix in scan[1]:
            # A walk passing folder after folder asks at each: the folders after this one
            # were found (and queued) by an earlier ask of the same listing; look again
            # only once fewer than half of those wanted remain ahead of it.
            rest = scan[1][scan[1].index(prefix) + 1:]
            if len(rest) >= wanted // 2 or scan[2]:
                return rest[0] if rest else None
        following: list[str] = []
        end = True  # (the parent's last directory is among them)
        with snapshot(self._iter(v, prefix[len(parent):-1].encode("utf-8", "surrogateescape"))
                       ) as entries:
            for i, entry in enumerate(entries):
                if entry.is_dir:
                    following.append(parent + entry.name.decode("utf-8", "surrogateescape")
                                     + "/")
                    if len(following) >= wanted:
                        end = False
                        break
                if i >= NEXT_DIR_SCAN:
                    end = False
                    break
        if v.limit is None:  # (a complete listing: what it says stays true)
            self._next_scans[parent] = (v, following, end)
            self._next_scans.move_to_end(parent)
            while len(self._next_scans) > NEXT_SCANS:
                self._next_scans.popitem(last=False)
        if self._store is not None and self.list_ahead_workers:
            now = self._clock()
            unlisted = []
            for d in following:
                at = self._asked_ahead.get(d)
                if at is not None and now - at < self._ttl:
                    continue  # queued (or found listed) lately
                self._asked_ahead[d] = now
                self._asked_ahead.move_to_end(d)
                if self._unlisted(d):
                    unlisted.append(d)
            while len(self._asked_ahead) > AHEAD_QUEUE:
                self._asked_ahead.popitem(last=False)
            if len(unlisted) >= 2 and (wanted > NEXT_DIRS_LISTED or of_folders) \
                    and self._flat_running < FLAT_LISTINGS:
                self._start_flat(parent, unlisted)
            elif unlisted:
                self._next_ahead.extend(unlisted)
                self._ahead_lot.unpark(count=len(unlisted))
        return following[0] if following else None

    def next_walked_dir(self, prefix: str, root: str) -> str | None:
        """The directory a walk in name order through ``root``'s tree reads next after
        ``prefix`` (trio thread): :meth:`next_dir`, or, when ``prefix`` is the last
        directory of its parent, the first folder with files of the directory after that
        parent, no shallower than ``prefix`` (at most :data:`WALK_LEVELS` levels up; a
        directory with files of its own above that depth ends it): a tree of two
        levels read in order (``p000/c000/`` .. ``p000/c009/``, ``p001/c010/`` ..) goes
        from ``p000/c009/`` on into ``p001/c010/``. Next_dir alone ended the directory
        lookahead's walks at every parent's last folder, so the readers of each new parent
        proved their order again while the GETs in flight drained. None when nothing
        follows (the tree's end, or a listing on the way not complete yet: a folder on the
        way without one has its listing started, and the walk asks again later)."""
        nxt = self.next_dir(prefix, root)
        up = prefix
        levels = 0
        for _ in range(WALK_LEVELS):
            if nxt is not None:
                break
            parent = parent_prefix(up)
            scan = self._next_scans.get(parent)
            if (parent == root or not parent.startswith(root) or scan is None or not scan[2]
                    or (scan[1] and scan[1][-1] != up) or self._index.row(parent) is None):
                return None  # the root's last folder, or not known to be its parent's last
            up = parent
            levels += 1
            nxt = self.next_dir(up, root)
        if nxt is None or levels == 0:
            return nxt
        # Down to the first folder with files, at least as deep as ``prefix``: a walk
        # through a tree does not come up. A directory that holds files above that depth is
        # another shape of tree (``train/c2/`` is followed by ``val/``, which holds files
        # itself): not walked into, a reader of one split is not taken for a reader of the
        # next.
        for depth in range(levels + WALK_LEVELS):
            row = self._index.row(nxt)
            if row is None:
                if self._store is not None and self._nursery is not None:
                    self._list_down(nxt)
                return None
            if row[2] > row[3] or row[3] == 0:  # it holds files (or nothing at all)
                return nxt if depth >= levels else None
            with snapshot(self._iter(View(row[0], None), None)) as entries:
                first = next((e for e in itertools.islice(entries, NEXT_DIR_SCAN)
                              if e.is_dir), None)
            if first is None:
                return None
            nxt += first.name.decode("utf-8", "surrogateescape") + "/"
        return None

    def _list_down(self, folder: str) -> None:
        """Start the listing a walk going down into ``folder`` needs (trio thread): with
        the folders after it in its parent's listing, by one flat page when two or more
        have none (:meth:`_start_flat`: the first folders of a tree's next parent, listed
        in one round trip, not one each), else its own listing (joined if in flight)."""
        parent = parent_prefix(folder)
        row = self._index.row(parent)
        if row is not None and self._unlisted(folder) and self.list_ahead_workers \
                and self._flat_running < FLAT_LISTINGS:
            unlisted = [folder]
            with snapshot(self._iter(View(row[0], None),
                                     folder[len(parent):-1].encode("utf-8", "surrogateescape"))
                          ) as entries:
                for entry in itertools.islice(entries, NEXT_DIR_SCAN):
                    if len(unlisted) >= MAX_DIRS_LISTED:
                        break
                    if entry.is_dir:
                        d = parent + entry.name.decode("utf-8", "surrogateescape") + "/"
                        if self._unlisted(d):
                            unlisted.append(d)
            if len(unlisted) >= 2:
                self._start_flat(parent, unlisted)
                return
        self._start(folder, follow=True)

    def _start_flat(self, parent: str, folders: list[str]) -> None:
        """List ``folders`` (sub-directories of ``parent``, in name order, none listed or
        being listed) with one flat LIST, for a walk through folders of few files (trio
        thread). A LIST per folder of a few files bounds such a walk by the listing rate:
        600 folders of 2 files were read at 0.10 of the link, each folder's first open
        waiting for its LIST. A flat page of up to 1,000 keys holds the whole of every
        folder it passes, so one request lists dozens of them.

        Each folder is a listing in flight from now on, like any other (single flight:
        a reader that needs one waits for it, and no second listing of it starts).
        :meth:`_run_flat` writes the folders the page holds whole as their listings and
        lists the others one by one, as before."""
        assert self._nursery is not None
        listings = [self._register(folder) for folder in folders
                    if self._unlisted(folder)]
        if listings:
            self._flat_running += 1
            self._nursery.start_soon(self._run_flat, parent, listings)

    async def _run_flat(self, parent: str, listings: list[_Listing], first: str | None = None,
                        registered: trio.Event | None = None) -> None:
        """Run the flat listing :meth:`_start_flat` registered ``listings`` for (or, for
        the mount page, the one from folder ``first`` on, with none): one page,
        then every folder it holds whole written as its listing, in one worker thread
        (a hand-over per folder kept a walk through hundreds of folders of two files
        waiting for the next folders' listings: GETs in flight fell to 0 at each page).
        The page's other whole folders that have no listing and none in flight are
        registered and written with them: they cost no request, and the next flat
        listing then starts that much further ahead of the walk. ``listings`` the page
        does not hold whole are listed one by one, as any listing. ``registered`` is set
        once the page's folders are listings in flight, or the page failed."""
        pending = {listing.prefix: listing for listing in listings}
        try:
            found: dict[str, tuple[list[ObjectInfo], list[str]]] = {}
            try:
                found = await trio.to_thread.run_sync(
                    self._flat_sync, parent, min(pending) if first is None else first,
                    limiter=self._limiter)
            except Exception as exc:  # (the folders are listed one by one instead)
                log.info("a flat listing of %r failed (%s); listing its folders one by one",
                         parent or "/", exc)
            for folder in found:
                if folder not in pending and self._unlisted(folder):
                    pending[folder] = self._register(folder)
            if registered is not None:
                registered.set()  # (readers waiting for the page join its folders now)
            whole = [(pending[folder], *found[folder]) for folder in found if folder in pending]
            if registered is not None:
                log.info("the first page of %r lists %d folder(s) whole", parent or "/",
                         len(whole))
            if whole:
                written = await trio.to_thread.run_sync(self._write_all_listed, whole,
                                                        limiter=self._limiter)
                for listing, result in written:
                    del pending[listing.prefix]
                    if isinstance(result, Exception):
                        self._ended(listing, result)
                    else:
                        self._listed(listing, result)
                        self._ended(listing, None)
            if self._nursery is not None:  # (None: run() ended meanwhile, an unmount)
                for listing in pending.values():
                    self._nursery.start_soon(self._run_listing, listing)
                pending.clear()
        finally:
            self._flat_running -= 1
            if registered is not None:
                registered.set()
                if self._mount_page is registered:
                    self._mount_page = None
            for listing in pending.values():  # cancelled (unmount): nobody will list them
                self._unregister(listing)

    def _flat_sync(self, parent: str, first: str
                   ) -> dict[str, tuple[list[ObjectInfo], list[str]]]:
        """One page of the flat listing of ``parent`` from folder ``first`` on: what a
        delimiter listing of each folder the page holds whole would have said (its
        objects, and its sub-directories as common prefixes), by folder, parents before
        their folders; folders at most FLAT_DEPTH levels below ``parent``. A folder
        counts as held whole when the page has keys of it and ends past it (or is the
        last page): S3 lists keys in order, so a folder's keys come together. Worker
        thread."""
        assert self._store is not None
        page = self._store.list_page(parent, None, first[:-1], flat=True)
        objects: dict[str, list[ObjectInfo]] = {}
        subdirs: dict[str, dict[str, None]] = {}
        for obj in page.objects:
            rest = obj.key[len(parent):]
            folder = parent  # (level 0: the parent itself, whose files are not listed here)
            for level in range(FLAT_DEPTH + 1):
                slash = rest.find("/")
                if slash < 0:
                    if level:
                        objects[folder].append(obj)
                    break
                below = folder + rest[:slash + 1]
                if level:
                    subdirs.setdefault(folder, {})[below] = None
                if level == FLAT_DEPTH:
                    break  # (a sub-directory of the deepest folder written: not listed)
                objects.setdefault(below, [])
                folder, rest = below, rest[slash + 1:]
        cut = page.objects[-1].key if page.next_token is not None and page.objects else None
        # (a folder below one >= ``first`` is >= it too: ``first`` is ``parent`` or one of its
        # sub-directories, so no folder of another sub-directory starts with it)
        return {folder: (found, list(subdirs.get(folder, ())))
                for folder, found in objects.items()
                if folder >= first and not (cut is not None and cut.startswith(folder))}

    def _write_all_listed(self, whole: list[tuple[_Listing, list[ObjectInfo], list[str]]]
                          ) -> list[tuple[_Listing, VersionWriter | Exception]]:
        """:meth:`_write_listed` for each of a flat page's folders, in this one worker
        thread; a folder that cannot be written gets its error (the others go on)."""
        written: list[tuple[_Listing, VersionWriter | Exception]] = []
        for listing, objects, prefixes in whole:
            try:
                written.append((listing, self._write_listed(listing, objects, prefixes)))
            except Exception as exc:
                written.append((listing, exc))
        return written

    def _queue_ahead(self, subdirs: list[str]) -> None:
        self._ahead.extend(reversed(subdirs))  # the first sub-directory is taken first
        self._ahead_lot.unpark(count=len(subdirs))

    async def _ahead_worker(self) -> None:
        while True:
            if self._next_ahead:
                prefix = self._next_ahead.popleft()
            elif self._ahead:
                prefix = self._ahead.pop()
            else:
                await self._ahead_lot.park()
                continue
            await self._after_mount_page(prefix)
            if prefix in self._inflight or self.listed_at(prefix) is not None:
                continue
            listing = self._start(prefix)
            await listing.done.wait()

    # -- listing -----------------------------------------------------------------
    def _start(self, prefix: str, *, follow: bool = False) -> _Listing:
        """Start (or join) the listing of ``prefix`` (trio thread). With ``follow`` (a
        reader waits for it), a listing started here also queues the directories after
        ``prefix`` in its parent's listing for the list-ahead workers
        (:meth:`next_dir`): readers of class folders go on to the next one, and a walk
        in order would otherwise find the next folder unlisted when it reaches the end
        of this one (a LIST across regions takes longer than reading a folder's first
        files). Refreshes and the list-ahead workers' own listings do not follow."""
        listing = self._inflight.get(prefix)
        if listing is not None:
            return listing
        if self._nursery is None:
            raise RuntimeError("Metadata.run() is not running")
        listing = self._register(prefix)
        self._nursery.start_soon(self._run_listing, listing)
        if follow and self._root is not None and self.list_ahead_workers:
            self.next_dir(prefix, self._root)
        return listing

    def _unlisted(self, prefix: str) -> bool:
        """Whether ``prefix`` has no listing, and none in flight (trio thread)."""
        return prefix not in self._inflight and self._index.row(prefix) is None

    def _register(self, prefix: str) -> _Listing:
        """A new listing of ``prefix`` in flight (trio thread): callers join it from now on."""
        listing = self._inflight[prefix] = _Listing(prefix)
        listing.tick = self._tick
        self._inflight_ids[prefix_id(prefix)] = listing
        return listing

    def _unregister(self, listing: _Listing) -> None:
        """``listing`` is over, done or not (trio thread): wake whoever waits for it."""
        del self._inflight[listing.prefix]
        self._inflight_ids.pop(prefix_id(listing.prefix), None)
        listing.done.set()
        listing.progress.set()

    async def _run_listing(self, listing: _Listing) -> None:
        """Run ``listing`` to its end: LIST the directory into a new version."""
        try:
            await self._list_ranges(listing)
        except Exception as group:
            self._ended(listing, _leaf(group))
        except BaseException:
            self._unregister(listing)  # (cancelled: an unmount)
            raise
        else:
            self._ended(listing, None)

    def _ended(self, listing: _Listing, error: BaseException | None) -> None:
        """``listing`` is over, with ``error`` or its new version current (trio thread):
        note the outcome, wake whoever waits for it, then queue its sub-directories to
        list ahead, or list it once more if it was invalidated meanwhile."""
        prefix = listing.prefix
        try:
            if error is not None:
                listing.error = error
                self._retry_after[prefix] = self._clock() + REFRESH_BACKOFF
                if self.listed_at(prefix) is not None:
                    metrics.METADATA_REFRESH_FAILURES.inc()
                    log.warning("refreshing the listing of %r failed (%s); serving the old one",
                                prefix, error)
                else:
                    log.warning("listing %r failed: %s", prefix or "/", error)
            else:
                # An invalidate() that arrived while this listing ran must survive it.
                if self._stale.get(prefix, -1) <= listing.tick:
                    self._stale.pop(prefix, None)
                    self._covered.pop(prefix, None)
                elif prefix in self._stale:
                    self._covered[prefix] = max(self._covered.get(prefix, -1), listing.tick)
                self._retry_after.pop(prefix, None)
        finally:
            self._unregister(listing)
        if listing.ahead and listing.error is None:
            self._queue_ahead(listing.subdirs)
        if listing.again and self._nursery is not None:
            self._start(prefix)

    async def _list_ranges(self, listing: _Listing) -> None:
        """List ``listing.prefix`` into a new version: one key range, split into more
        (listed at once, at most PARALLEL_RANGES) once it proves large."""
        writer = VersionWriter(self._index, listing.prefix, self._clock)
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
        self._listed(listing, writer)

    def _listed(self, listing: _Listing, writer: VersionWriter) -> None:
        """(trio thread) ``listing``'s new version is current: count it, and say where."""
        metrics.METADATA_LISTINGS.inc()
        for reason, n in writer.skipped.items():
            metrics.SKIPPED_KEYS.labels(reason).inc(n)
            log.info("%s: skipped %d key(s) (%s)", listing.prefix or "/", n, reason)
        listing.subdirs = writer.subdirs
        listing.version = writer.version

    def _write_listed(self, listing: _Listing, objects: list[ObjectInfo],
                      prefixes: list[str]) -> VersionWriter:
        """Store what a flat listing found in ``listing.prefix`` as its new version, in one
        transaction (worker thread)."""
        writer = VersionWriter(self._index, listing.prefix, self._clock)
        try:
            writer.write(entries_from_listing(listing.prefix, objects, prefixes,
                                              writer.skipped), final=True)
        except BaseException:
            writer.abandon()
            raise
        return writer

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
        writer = VersionWriter(self._index, prefix, self._clock)
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

    def __init__(self, writer: VersionWriter) -> None:
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


def dirs_listed_ahead(files: int) -> int:
    """How many folders :meth:`Metadata.next_dir` has listed ahead of a walk in a folder of
    ``files`` files (0: not known): :data:`NEXT_DIRS_LISTED`, or more such folders when
    that many hold fewer than :data:`FILES_LISTED_AHEAD` files, at most
    :data:`MAX_DIRS_LISTED`."""
    if files <= 0:
        return NEXT_DIRS_LISTED
    return max(NEXT_DIRS_LISTED, min(MAX_DIRS_LISTED, -(-FILES_LISTED_AHEAD // files)))
