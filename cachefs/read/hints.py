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
data ahead of the cursor is requested, and each block needs room in the fetcher's memory budget
(``Fetcher.prefetch`` never waits; when it refuses, the loop sleeps until the
next open or a short tick). Prefetched blocks land in the disk cache, so a
reader that arrives later finds them there.

Concurrency: one task (:meth:`ReadOrder.run`) owned by the daemon's nursery
does all the work; :meth:`set_order` and :meth:`on_open` only update state
and wake it (trio thread only).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Iterator, Sequence

import trio

from cachefs.cache.metadata import Entry
from cachefs.errors import StoreError
from cachefs.read.fetcher import Fetcher, ObjectVersion

log = logging.getLogger(__name__)

Resolver = Callable[[str], Awaitable[ObjectVersion | None]]

TICK = 0.05  # seconds between top-ups while the budget is full


class ReadOrder:
    def __init__(self, fetcher: Fetcher, resolve: Resolver, *, lookahead_bytes: int) -> None:
        self._fetcher = fetcher
        self._resolve = resolve
        self.lookahead_bytes = lookahead_bytes
        self._order: list[str] = []
        self._position: dict[str, int] = {}
        self._cum: list[int] = [0]  # cumulative sizes of resolved files: _cum[i] = bytes before i
        self._cursor = -1  # index of the furthest hinted file opened
        self._next = 0  # next file to prefetch
        self._wake = trio.Event()
        self.generation = 0

    # -- inputs (trio thread) ---------------------------------------------------------
    def set_order(self, keys: Sequence[str]) -> int:
        """Replace the expected read order (object keys). Returns how many were taken."""
        self._order = list(keys)
        self._position = {}
        for i, key in enumerate(self._order):
            self._position.setdefault(key, i)
        self._cum = [0]
        self._cursor = -1
        self._next = 0
        self.generation += 1
        self._wake.set()
        return len(self._order)

    def on_open(self, key: str) -> None:
        """A reader opened ``key``: move the cursor if it is further along the order."""
        pos = self._position.get(key)
        if pos is not None and pos > self._cursor:
            self._cursor = pos
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
            except Exception:  # a bad hint must never take the daemon down
                log.exception("read-order prefetch failed; dropping the hint")
                self.set_order([])

    def _bytes_ahead(self) -> int:
        start = min(self._cursor + 1, len(self._cum) - 1)
        return self._cum[-1] - self._cum[max(0, start)]

    async def _top_up(self) -> None:
        generation = self.generation
        while self._next < len(self._order) and generation == self.generation:
            if self._next <= self._cursor:
                # Readers overtook the prefetcher: skip what they already opened.
                while len(self._cum) <= self._cursor + 1:
                    self._cum.append(self._cum[-1])
                self._next = self._cursor + 1
                continue
            if self._bytes_ahead() >= self.lookahead_bytes:
                return
            key = self._order[self._next]
            try:
                obj = await self._resolve(key)
            except StoreError as exc:
                log.info("hinted file %s cannot be resolved: %s", key, exc)
                obj = None
            if generation != self.generation:
                return
            size = 0
            if obj is not None:
                for index in range(self._fetcher.block_count(obj)):
                    if self._fetcher.is_cached(obj, index):
                        # Already on disk: a demand read costs one local read. Loading it
                        # into memory this far ahead would only push out blocks that are
                        # needed sooner.
                        continue
                    if (not self._fetcher.prefetch(obj, index)
                            and not self._fetcher.is_resident(obj, index)):
                        return  # memory budget full: try again on the next tick
                    size += self._fetcher.block_len(obj, index)
            if len(self._cum) == self._next + 1:
                self._cum.append(self._cum[-1] + size)
            self._next += 1


class _Walk:
    __slots__ = ("ahead", "issued_until", "last", "streak")

    def __init__(self, name: bytes) -> None:
        self.last = name
        self.streak = 0
        self.ahead = 0  # files requested ahead of the readers (approximate)
        self.issued_until: bytes | None = None


class DirectoryLookahead:
    """Prefetch the next files of a directory when readers open its files in name order.

    Walks are followed per reader and per directory: each open steps both the
    walk of its reader (the FUSE request's thread id: one DataLoader worker,
    one thread) and the directory's shared walk (readers taking turns over one
    in-order sequence, such as a thread pool). A walk advances when the file is
    among the ``adjacency`` entries after its previous file (or among the files
    it already requested ahead); any other open restarts it. After
    ``min_streak`` advances, up to ``window(streak)`` files after the walk are
    requested (doubling with the streak, at most ``max_files``). Each open
    consumes one file of the window; only the shortfall is issued, continuing
    after the last file requested, so the cost per open is a few index lookups
    however large the window. A random order does not advance a walk three
    times running, so random readers pay nothing. Blocks go through
    ``Fetcher.prefetch`` (never waits, bounded by budget).
    """

    def __init__(self, fetcher: Fetcher, iter_after: Callable[[str, bytes], Iterator[Entry]], *,
                 max_files: int = 256, min_streak: int = 3, max_walks: int = 4096,
                 adjacency: int = 8) -> None:
        self._fetcher = fetcher
        self._iter_after = iter_after
        self.adjacency = adjacency
        self.max_files = max_files
        self.min_streak = min_streak
        self.max_walks = max_walks
        # Returns False while opens of cached files are passed through to the kernel:
        # loading their blocks into memory ahead of the readers would be wasted work.
        self.prefetch_cached: Callable[[], bool] = lambda: True
        # (directory, reader) -> walk, least recently used first; reader 0 = shared walk
        self._walks: dict[tuple[str, int], _Walk] = {}

    def _follows(self, prefix: str, last: bytes, name: bytes, walk: _Walk) -> bool:
        """Whether ``name`` is among the next few files after ``last`` (or among those
        already requested ahead): a reader walking the directory in order, but not a
        random order that happens to ascend."""
        if walk.issued_until is not None and last < name <= walk.issued_until:
            return True
        entries = self._iter_after(prefix, last)
        try:
            for i, entry in enumerate(entries):
                if entry.name == name:
                    return True
                if i + 1 >= self.adjacency or entry.name > name:
                    return False
        finally:
            close = getattr(entries, "close", None)
            if close is not None:
                close()
        return False

    def on_open(self, prefix: str, name: bytes, reader: int = 0) -> int:
        """Record an open by ``reader`` (a thread id; 0 if unknown); returns how many
        files were newly requested."""
        issued = self._on_open(prefix, name, (prefix, 0))
        if reader:
            issued += self._on_open(prefix, name, (prefix, reader))
        return issued

    def _step(self, key: tuple[str, int], name: bytes) -> _Walk:
        prefix = key[0]
        walk = self._walks.pop(key, None)
        if walk is None:
            walk = _Walk(name)
        elif name > walk.last and self._follows(prefix, walk.last, name, walk):
            walk.streak += 1
            walk.last = name
            walk.ahead = max(0, walk.ahead - 1)
        elif name != walk.last:
            walk = _Walk(name)
        self._walks[key] = walk  # most recently used last
        if len(self._walks) > self.max_walks:
            self._walks.pop(next(iter(self._walks)))
        return walk

    def _on_open(self, prefix: str, name: bytes, key: tuple[str, int]) -> int:
        walk = self._step(key, name)
        if walk.streak < self.min_streak:
            return 0
        window = min(self.max_files, 2 ** (walk.streak - self.min_streak + 2))
        if walk.issued_until is None or walk.issued_until <= name:
            walk.issued_until, walk.ahead = name, 0
        want = window - walk.ahead
        issued = 0
        if want <= 0:
            return 0
        entries = self._iter_after(prefix, walk.issued_until)
        try:
            for entry in entries:
                if entry.is_dir:
                    continue
                obj = ObjectVersion(prefix + entry.name.decode(), entry.etag, entry.size)
                full = False
                for index in range(self._fetcher.block_count(obj)):
                    if (not self._fetcher.prefetch(obj, index, cached=self.prefetch_cached())
                            and not self._fetcher.is_resident(obj, index)):
                        full = True
                        break
                if full:
                    break
                walk.issued_until = entry.name
                walk.ahead += 1
                issued += 1
                if issued >= want:
                    break
        finally:
            close = getattr(entries, "close", None)
            if close is not None:
                close()
        return issued
