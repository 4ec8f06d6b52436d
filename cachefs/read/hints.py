"""Prefetch in the order the training sampler will read files.

A training script hands cachefs the list of files it will read in the coming
epoch (``cachefs.torch``, or any client of the control socket). This module
keeps a *cursor* (the furthest hinted file opened so far) and fetches the
files after it ahead of the readers, so that many small GETs are in flight
and the link stays full even when the order is a random permutation (Little's
law: in flight >= rate x latency; stock DataLoader workers only ever have one
read each in flight).

Only blocks that are not in the disk cache are fetched (a cached block costs a
demand read one local read; loading it into memory far ahead would only evict
blocks needed sooner). Bounds: at most ``lookahead_bytes`` of hinted, uncached
data ahead of the cursor is requested, at most ``window`` blocks are being
fetched at once (enough for the link's bandwidth-delay product; more would only
queue for S3 connections, each queued load costing the trio thread its task
and timers), and each block needs room in the fetcher's memory budget
(``Prefetcher.want`` never waits; when it refuses, the loop sleeps until a short
tick; when the window is full, until one of its loads lands; see below).
Prefetched blocks land in the disk cache, so a reader that arrives later finds
them there.

Each hinted file requested is also a prediction (``on_predicted``:
:meth:`cachefs.passthrough.Passthrough.predicted`): a reader opens it soon, so its
cache file is registered ahead of that open -- a small one by the S3 thread that
writes it -- and given its open template, as a directory walk's next files are, and
the native loop answers its open without Python. The registrations are the ones its
open would make (every hinted file is opened), under the same bound. Its name is told
to the native loop too (``lookups``), which then answers the reader's LOOKUP of it
without Python.

Resolving a hinted key needs its directory's listing. The directories of the
next ``PREPARE_AHEAD`` windows of keys are asked for ahead (``prepare``, which
starts a listing without waiting for it), so that a fresh mount lists the
directories of an epoch's first files at once instead of one round trip after
another.

The cursor is moved by the opens themselves, on the FUSE request workers
(:meth:`ReadOrder.opened`); the loop is woken for an open only while it waits
for readers (the byte bound is reached). While it waits for loads to end (the
window is full, the usual state of a cold pass) the end of each hinted load
wakes it (:meth:`Prefetcher.on_fetched`, on the trio thread, which is awake
then anyway): an open per file handed to the trio thread cost it a wake-up per
file (~50 us of CPU each) for a loop that had nothing to start.

Concurrency: one task (:meth:`ReadOrder.run`) owned by the daemon's nursery
does all the work; :meth:`set_order`, :meth:`on_open` and :meth:`wake` only
update state and wake it (trio thread only). :meth:`opened` (any thread) moves
the cursor under ``_cursor_lock``, which :meth:`set_order` also takes to
replace the order (a worker never moves the cursor of a new order by a
position in the old one); the loop reads the cursor without it (one int).
:meth:`hinted` only reads (any thread).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Awaitable, Callable, Sequence

import trio

from cachefs.background import report
from cachefs.cache.metadata import Entry, Metadata
from cachefs.errors import StoreError
from cachefs.read.fetcher import ObjectVersion
from cachefs.read.prefetcher import HINT, LookupsAhead, Prefetcher

log = logging.getLogger(__name__)

#: A hinted key's entry in its directory's listing, or None (not listed as a file).
Resolver = Callable[[str], Awaitable[Entry | None]]


def metadata_resolver(metadata: Metadata) -> Resolver:
    """A resolver answering from the directory listings (listing a directory if needed)."""
    return metadata.find_file

TICK = 0.02  # seconds between top-ups while the budget is full (or readers lag)
PREPARE_AHEAD = 4  # windows of keys whose directories are asked to be listed ahead


class ReadOrder:
    def __init__(self, prefetcher: Prefetcher, resolve: Resolver, *, lookahead_bytes: int,
                 window: int = 48, prepare: Callable[[str], None] | None = None,
                 on_predicted: Callable[[ObjectVersion, int], None] | None = None) -> None:
        self._prefetcher = prefetcher
        self._resolve = resolve
        self._prepare = prepare  # start listing a directory now (never waits)
        # Told of every hinted file requested (object, inode), on the trio thread: it must
        # only queue (passthrough registers it ahead of its open, see the module doc).
        self._on_predicted = on_predicted
        #: Told the name of every hinted file requested (set by the daemon when the
        #: request workers run the native loop; see the module doc).
        self.lookups: LookupsAhead | None = None
        self._prepared_until = 0  # keys before this index had their directories asked for
        self._prepared: set[str] = set()
        self.lookahead_bytes = lookahead_bytes
        self.window = window
        self._order: list[str] = []
        self._position: dict[str, int] = {}
        self._cum: list[int] = [0]  # cumulative sizes of resolved files: _cum[i] = bytes before i
        self._cursor = -1  # index of the furthest hinted file opened
        self._next = 0  # next file to prefetch
        self._wake = trio.Event()
        self._cursor_lock = threading.Lock()
        self._waits_for_readers = False  # the loop stopped at the byte bound
        prefetcher.on_fetched(HINT, self.wake)  # a slot of the window is free
        self.generation = 0

    # -- inputs (trio thread) ---------------------------------------------------------
    def set_order(self, keys: Sequence[str]) -> int:
        """Replace the expected read order (object keys). Returns how many were taken."""
        order = list(keys)
        position: dict[str, int] = {}
        for i, key in enumerate(order):
            position.setdefault(key, i)
        with self._cursor_lock:
            self._order = order
            self._position = position
            self._cursor = -1
        self._cum = [0]
        self._next = 0
        self._prepared_until = 0
        self._prepared = set()
        self.generation += 1
        self._wake.set()
        return len(self._order)

    def opened(self, key: str) -> bool:
        """A reader opened ``key``: move the cursor if it is further along the order (any
        thread). Returns whether the loop waits for readers and must be woken
        (:meth:`wake`, on the trio thread)."""
        pos = self._position.get(key)
        if pos is None or pos <= self._cursor:
            return False
        with self._cursor_lock:
            pos = self._position.get(key)  # (the order may have been replaced)
            if pos is None or pos <= self._cursor:
                return False
            self._cursor = pos
        return self._waits_for_readers

    def wake(self) -> None:
        """Wake the loop (trio thread)."""
        self._wake.set()

    def hinted(self, key: str) -> bool:
        """Whether ``key`` is in the current order (any thread: a dictionary lookup)."""
        return key in self._position

    @property
    def active(self) -> bool:
        """An order is set and readers have not reached its last file."""
        return self._cursor < len(self._order) - 1

    def on_open(self, key: str) -> None:
        """:meth:`opened`, waking the loop whenever the cursor moved (trio thread)."""
        cursor = self._cursor
        self.opened(key)
        if self._cursor != cursor:
            self._wake.set()

    @property
    def pending(self) -> int:
        """Hinted files not yet requested."""
        return max(0, len(self._order) - self._next)

    # -- the prefetch loop ------------------------------------------------------------
    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        while True:
            with trio.move_on_after(TICK if self.pending else 3600):
                await self._wake.wait()
            self._wake = trio.Event()
            try:
                await self._top_up()
            except Exception as exc:  # a bad hint must never take the daemon down
                report("read_order", exc, "prefetching hinted files; the hint is dropped")
                self.set_order([])

    def _bytes_ahead(self) -> int:
        start = min(self._cursor + 1, len(self._cum) - 1)
        return self._cum[-1] - self._cum[max(0, start)]

    async def _top_up(self) -> None:
        generation = self.generation
        self._waits_for_readers = False
        while self._next < len(self._order) and generation == self.generation:
            if self._next <= self._cursor:
                # Readers overtook the prefetcher: skip what they already opened.
                while len(self._cum) <= self._cursor + 1:
                    self._cum.append(self._cum[-1])
                self._next = self._cursor + 1
                continue
            if self._bytes_ahead() >= self.lookahead_bytes:
                self._waits_for_readers = True  # (an open that moves the cursor wakes it)
                return
            if self._prefetcher.loading(HINT) >= self.window:
                return  # (the end of one of them wakes the loop: Prefetcher.on_fetched)
            if self._prepare is not None and self._next >= self._prepared_until:
                self._prepare_dirs()
            key = self._order[self._next]
            lookups = self.lookups
            prefix = key[:key.rfind("/") + 1]
            token = lookups.lookup_token(prefix) if lookups is not None else 0
            try:
                entry = await self._resolve(key)  # (the listing, read after the token)
            except StoreError as exc:
                log.info("hinted file %s cannot be resolved: %s", key, exc)
                entry = None
            if generation != self.generation:
                return
            size = 0
            if entry is not None:
                obj = ObjectVersion(key, entry.etag, entry.size)
                # Blocks already on disk are left there (a demand read costs one local
                # read); see the prefetcher's admission rule.
                issued = self._prefetcher.want_object(obj, HINT)
                if issued is None:
                    return  # memory budget full: try again on the next tick
                size = issued
                if self._on_predicted is not None:
                    self._on_predicted(obj, entry.ino)
                if lookups is not None:
                    lookups.remember_listed(prefix, token, (entry,))
            if len(self._cum) == self._next + 1:
                self._cum.append(self._cum[-1] + size)
            self._next += 1

    def _prepare_dirs(self) -> None:
        """Ask for the listings of the directories of the next keys (see the module doc)."""
        assert self._prepare is not None
        end = min(len(self._order), self._next + PREPARE_AHEAD * self.window)
        for key in self._order[self._next:end]:
            parent = key[:key.rfind("/") + 1]
            if parent not in self._prepared:
                self._prepared.add(parent)
                self._prepare(parent)
        self._prepared_until = end
