"""The sweep: fetch a directory of small files that readers open in no predictable order.

Readers of a shuffled epoch open the small files of a dataset in a random order
with one read each in flight (a DataLoader worker, a thread of a pool): without
a hint, N readers fetch N files per round trip, whatever the link could carry.
Nothing predicts the next file, but a shuffled epoch reads *every* file, so
fetching the whole directory in listing order, with enough GETs in flight to
fill the link, serves most of the epoch from the cache. The sweep does that,
under rules that keep it from costing anything when the guess is wrong.

Trigger. A *miss* is a reader's first read of a small file (at most one block)
that is neither cached nor being loaded (:meth:`Sweeper.on_miss`, called from
the read path on the trio thread). A directory's misses are *scattered* when they
land farther than ``adjacency`` positions (inode numbers: a listing numbers a
directory's names in order) from the furthest one before: readers in directory
order miss only near their frontier (and the directory lookahead predicts them
after a few files), shuffled readers anywhere. ``min_misses`` scattered misses
start a sweep of the directory; files the read-order hint names do not count
(the hint predicts them). Once ``spread_after`` directories of one parent are
swept, the parent's other sub-directories are queued too (class folders of one
dataset tree: the shuffled sampler draws from all of them). A folder of a few files
never shows scattered misses inside it, so misses are also followed over the parent's
folders, by each folder's position in the parent's listing (:meth:`Sweeper._folder_miss`):
``min_misses`` scattered over them sweep the folder and queue the parent's other
folders at once.

What it fetches. The queued directories one after the other, each in listing
order, small files only, through :meth:`Prefetcher.want_object` with policy
``sweep``: cached or loading files cost nothing, loads are background requests
(3/4 of the S3 connections at most, so demand reads keep priority), and each
needs room in the memory budget. At most ``window`` swept files are in flight
(enough for the link's bandwidth-delay product: 34 files of 110 KB fill
48 MB/s at 70 ms), and sweep loads may take at most ``budget_share`` of the
memory budget, so readers' own fetches and the other policies keep the rest.

Bounds: speculation never displaces anything and never runs far ahead of use.

* Free space only: a file is swept only while the cache's free space, less
  every byte in flight (the memory budget's reservations, which are written
  to the cache next) and less ``margin``, holds it. All of it as disk space:
  a file needs its size rounded up to the cache's allocation unit (what the
  cache will charge it), and the sweep's own GETs in flight count that
  rounding too (the budget holds their sizes: a tiny file is mostly rounding,
  and a window of them would overrun the margin). A sweep never evicts a
  block, under either cache policy; when free space is gone the sweep ends
  (reason ``no_space``), and with a full cache none starts. Room short only by
  the bytes in flight is no reason to end: a block is counted in the cache's
  used bytes once written, before the landing releases its reservation, so
  for a moment it counts twice; the sweep waits a tick instead.
* Unread bound: swept bytes no reader has taken yet stay below
  ``ahead_bytes + read_factor * R``, where R is what readers read from the
  swept directories since the sweep began (swept files they took, plus their
  misses there). A shuffled epoch reads everything, so R grows and the
  sweep runs on; a reader of a small subset stops it after at most
  ``ahead_bytes`` plus ``read_factor`` times what it read (reason
  ``unread_bound``; it goes on when readers take more).
* A read-order hint wins: while one is being followed no sweep runs (reason
  ``hint``).

Registered ahead. A shuffled epoch opens every swept file, so each file swept from S3
is a prediction too (``on_predicted``: :meth:`cachefs.passthrough.Passthrough.predicted`
with ``spare``): the S3 thread that writes a small one registers its cache file and the
native loop is given its open template, as for a directory walk's next files, so its
open costs no Python -- but only while the idle registrations have room for it without
closing another (nothing tells when in the epoch a swept file is opened: one registered
ahead must not close a registration made for a file read earlier, nor one made ahead
for a file not read yet). A wrong guess costs one registration, no byte and no cache
room (an idle registration's pin yields to eviction). Their names are told to the
native loop too (``lookups``, once per step, from the listing the step read), which then
answers their readers' LOOKUPs without Python while the listing stays fresh, and their
inodes are remembered by the listings (``remember_entries``), so the S3 thread that gives
a file its template ahead resolves it from memory.

A sweep *session* lasts while directories are queued; it ends when the queue
is done (``done``) or by one of the reasons above, which resets R. A directory
whose sweep waits at the unread bound goes behind the others when readers
start missing in a new one (they moved on).

Concurrency: trio thread only. :meth:`on_miss` only updates state and wakes
the one task (:meth:`Sweeper.run`, owned by the daemon's nursery) that lists
directories and issues fetches; that task never waits for a fetch (it looks at
how many of its loads are still fetching every ``TICK``,
:meth:`Prefetcher.loading`).
"""

from __future__ import annotations

import dataclasses
import logging
from collections import OrderedDict, deque
from collections.abc import Callable, Iterator, Sequence
from typing import Protocol

import trio

from cachefs import metrics
from cachefs.background import report
from cachefs.cache.index import parent_prefix, snapshot
from cachefs.cache.metadata import Entry
from cachefs.cache.objectfiles import allocation
from cachefs.errors import StoreError
from cachefs.read.fetcher import ObjectVersion
from cachefs.read.prefetcher import SWEEP, LookupsAhead, Prefetcher, PrefetchLedger

log = logging.getLogger(__name__)

#: Seconds between looks at the sweep's loads while a session runs.
TICK = 0.02
#: Entries looked at per step before the task lets others run.
STEP_ENTRIES = 256
#: Entries of a parent listing looked at to find the sub-directories to spread to.
SPREAD_SCAN = 65536


class Listings(Protocol):
    """What the sweep needs of the directory listings (:class:`cachefs.cache.metadata.Metadata`)."""

    def iter_entries(self, prefix: str, after: bytes | None = None) -> Iterator[Entry]:
        ...

    async def ensure(self, prefix: str) -> None:
        ...

    def list_ahead(self, prefix: str) -> None:
        ...

    @property
    def generation(self) -> int:
        ...

    def remember_entries(self, prefix: str, generation: int, entries: Sequence[Entry]) -> None:
        ...

    def dir_ino_now(self, prefix: str) -> tuple[int, int] | None:
        ...


@dataclasses.dataclass(slots=True)
class _Misses:
    frontier: int = 0  # the furthest position (inode number) missed
    scattered: int = 0  # misses far from the frontier


class Sweeper:
    """Fetch directories of small files read in an unpredictable order (module docstring)."""

    def __init__(self, prefetcher: Prefetcher, ledger: PrefetchLedger, listings: Listings, *,
                 free_space: Callable[[], int], max_file: int, ahead_bytes: int, margin: int,
                 hinted: Callable[[str], bool] = lambda key: False,
                 hint_active: Callable[[], bool] = lambda: False,
                 on_predicted: Callable[[ObjectVersion, int], None] | None = None,
                 window: int = 32, read_factor: float = 2.0, budget_share: float = 0.5,
                 min_misses: int = 2, adjacency: int = 8, spread_after: int = 3,
                 max_dirs: int = 4096) -> None:
        self._prefetcher = prefetcher
        self._fetcher = prefetcher.fetcher
        self._budget = prefetcher.budget
        self._ledger = ledger
        self._listings = listings
        self._free_space = free_space  # cache capacity - used - bytes in flight
        self._hinted = hinted
        self._hint_active = hint_active
        # Told of every file swept from S3 (object, inode), on the trio thread: it must
        # only queue (see "Registered ahead" in the module docstring).
        self._on_predicted = on_predicted
        #: Told the names of the files swept from S3 (set by the daemon when the request
        #: workers run the native loop; see "Registered ahead").
        self.lookups: LookupsAhead | None = None
        self.max_file = max_file
        self.ahead_bytes = ahead_bytes
        self.margin = margin
        self.window = window
        self.read_factor = read_factor
        self.budget_share = budget_share
        self.min_misses = min_misses
        self.adjacency = adjacency
        self.spread_after = spread_after
        self.max_dirs = max_dirs
        self._dirs: OrderedDict[str, _Misses] = OrderedDict()  # least recently missed first
        # parent -> misses over its folders (a folder's position: its inode in the parent's
        # listing), least recently missed first (see _folder_miss)
        self._folders: OrderedDict[str, _Misses] = OrderedDict()
        self._wake = trio.Event()
        # The session (see the module docstring).
        self.active = False
        self._queue: deque[tuple[str, bytes | None]] = deque()  # (directory, last name looked at)
        self._queued: set[str] = set()  # every directory queued in this session
        # parent -> its sub-directories swept for their misses (in any session; least
        # recently added first)
        self._parents: OrderedDict[str, set[str]] = OrderedDict()
        self._spread: list[str] = []  # parents whose sub-directories are to be queued
        self._spread_done: set[str] = set()  # parents spread from in this session
        self._current: str | None = None  # the directory being swept
        self._after: bytes | None = None  # the last name of it looked at
        self._read = 0  # bytes readers missed in swept directories (this session)
        # Sweep GETs in flight -> the disk space they will take beyond their bytes, which
        # the free space counts (the allocation unit's rounding); pruned as they end.
        self._rounding: dict[bytes, int] = {}
        self._used_base = 0  # ledger.used(SWEEP) when the session began
        self.paused: str | None = None  # why the session waits (unread_bound), if it does
        metrics.SWEEP_UNREAD_BYTES.set_function(lambda: max(0, ledger.unread(SWEEP)))

    # -- the trigger (trio thread) -------------------------------------------------------
    def on_miss(self, prefix: str, ino: int, obj: ObjectVersion) -> None:
        """A reader's first read of ``obj`` (inode ``ino`` in directory ``prefix``) found
        it neither cached nor being loaded."""
        if not 0 < obj.size <= self.max_file or self._hinted(obj.key):
            return
        if self._fetcher.is_loading(self._fetcher.block_id(obj, 0)):
            return  # being fetched already: predicted after all
        if prefix in self._queued:
            self._read += obj.size  # a reader got there before the sweep
            self._wake.set()  # (a sweep waiting at its unread bound may go on)
            return
        st = self._missed(self._dirs, prefix, ino)
        if st.scattered >= self.min_misses:
            del self._dirs[prefix]  # (a refused start is tried again after as many misses)
            self._start(prefix, "misses")
        else:
            self._folder_miss(prefix)

    def _missed(self, table: OrderedDict[str, _Misses], where: str, position: int) -> _Misses:
        """Count a miss at ``position`` (an inode number: a place in a listing) in
        ``where``'s entry of ``table`` (``_dirs`` or ``_folders``): scattered when farther
        than ``adjacency`` from the furthest missed yet. The entry moves last (most recently
        missed); the table keeps at most ``max_dirs``, the least recently missed go."""
        st = table.pop(where, None)
        if st is None:
            st = _Misses(frontier=position)
        elif abs(position - st.frontier) > self.adjacency:
            st.scattered += 1
        st.frontier = max(st.frontier, position)
        table[where] = st
        if len(table) > self.max_dirs:
            table.popitem(last=False)
        return st

    def _folder_miss(self, prefix: str) -> None:
        """A miss in folder ``prefix``, seen from its parent. A folder of two files never
        shows ``min_misses`` misses scattered inside it, so shuffled readers of 600 such
        folders fetched every file on demand (1.5x rclone, the target 2x). Misses scattered
        over the parent's folders (positions in its listing farther than ``adjacency``
        apart) tell them as well: the folder is swept and the parent's other folders are
        queued after it, as when ``spread_after`` of them were swept. Readers in directory
        order miss folder after folder, never scattered. (One index read per miss in a
        folder not queued yet.)"""
        found = self._listings.dir_ino_now(prefix)
        if found is None:
            return
        parent = parent_prefix(prefix)
        st = self._missed(self._folders, parent, found[0])
        if st.scattered >= self.min_misses:
            del self._folders[parent]
            self._start(prefix, "misses")
            if self.active and parent not in self._spread_done:
                self._spread_done.add(parent)
                self._spread.append(parent)
                self._wake.set()

    def _start(self, prefix: str, cause: str) -> None:
        if self._hint_active():
            return
        if not self.active:
            if self._free_space() - self.margin < self.max_file:
                metrics.SWEEP_STOPS.labels("no_space").inc()
                return
            self.active = True
            self._used_base = self._ledger.used(SWEEP)
            self._read = 0
        rotate = self.paused is not None and self._current is not None and prefix not in self._queued
        self._queue_dir(prefix, cause)
        if rotate:
            # Readers miss elsewhere while the sweep waits at its unread bound: they left the
            # directory being swept (or never read much of it): it goes after the others.
            assert self._current is not None
            self._queue.append((self._current, self._after))
            self._current = self._after = None
        parent = parent_prefix(prefix)
        swept = self._parents.pop(parent, set())
        swept.add(prefix)
        self._parents[parent] = swept
        if len(self._parents) > self.max_dirs:
            self._parents.popitem(last=False)
        if len(swept) >= self.spread_after and parent not in self._spread_done:
            self._spread_done.add(parent)
            self._spread.append(parent)
        self._wake.set()

    def _queue_dir(self, prefix: str, cause: str) -> None:
        if prefix in self._queued or len(self._queued) >= self.max_dirs:
            return
        self._queued.add(prefix)
        self._queue.append((prefix, None))
        metrics.SWEEP_DIRECTORIES.labels(cause).inc()

    def _end(self, reason: str) -> None:
        if self.active:
            metrics.SWEEP_STOPS.labels(reason).inc()
        self.active = False
        self.paused = None
        self._queue.clear()
        self._queued.clear()
        self._spread.clear()
        self._spread_done.clear()
        self._current = self._after = None
        self._read = 0

    def _pause(self, reason: str) -> None:
        if self.paused != reason:
            self.paused = reason
            metrics.SWEEP_STOPS.labels(reason).inc()

    # -- bounds ------------------------------------------------------------------------------
    def allowance(self) -> float:
        """Swept bytes allowed unread now (see the module docstring)."""
        read = self._read + self._ledger.used(SWEEP) - self._used_base
        return self.ahead_bytes + self.read_factor * read

    @property
    def inflight(self) -> int:
        """Swept files still being fetched."""
        return self._prefetcher.loading(SWEEP)

    # -- the task ----------------------------------------------------------------------------
    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        while True:
            with trio.move_on_after(TICK if self.active else 3600):
                await self._wake.wait()
            self._wake = trio.Event()
            try:
                await self.step()
            except Exception as exc:  # a sweep must never take the daemon down
                report("sweep", exc, "sweeping a directory; the sweep is dropped")
                self._end("error")

    async def step(self) -> None:
        """Issue what the session may issue now (the task calls it every tick)."""
        if not self.active:
            return
        if self._hint_active():
            self._end("hint")
            return
        while self._spread:
            self._spread_from(self._spread.pop())
        while self.active:
            if self._current is None:
                if not self._queue:
                    self._end("done")
                    return
                prefix, after = self._queue.popleft()
                try:
                    await self._listings.ensure(prefix)
                except StoreError as exc:
                    log.info("not sweeping %s: listing it failed: %s", prefix, exc)
                    continue
                if not self.active:
                    return  # ended while listing
                self._current, self._after = prefix, after
            stop = self._sweep_some()
            if stop == "no_space":
                self._end("no_space")
                return
            if stop == "unread_bound":
                self._pause(stop)
                return
            if stop is not None:
                return  # window or memory budget full: the next tick goes on
            await trio.lowlevel.checkpoint()

    def _sweep_some(self) -> str | None:
        """Issue files of the current directory after the last one looked at; returns why
        it stopped (None: the directory is done, or STEP_ENTRIES looked at)."""
        assert self._current is not None
        prefix, pf = self._current, self._prefetcher
        inflight = pf.loading(SWEEP)
        for bid in [b for b in self._rounding if not pf.is_loading(SWEEP, b)]:
            del self._rounding[bid]
        rounding = sum(self._rounding.values())
        lookups = self.lookups
        token = lookups.lookup_token(prefix) if lookups is not None else 0
        generation = self._listings.generation
        swept: list[Entry] = []  # (their names told to the native loop once the step ends)
        try:
            return self._sweep_entries(prefix, inflight, rounding, swept)
        finally:
            if swept:
                # (their inodes are resolved next, from memory: their templates ahead)
                self._listings.remember_entries(prefix, generation, swept)
                if lookups is not None:
                    lookups.remember_listed(prefix, token, swept)

    def _sweep_entries(self, prefix: str, inflight: int, rounding: int,
                       swept: list[Entry]) -> str | None:
        """:meth:`_sweep_some`'s walk of the listing (read after its token), adding each
        file swept from S3 to ``swept``."""
        pf = self._prefetcher
        limit = self._budget.limit * self.budget_share
        unit = self._fetcher.cache.unit
        entries = self._listings.iter_entries(prefix, self._after)
        looked = 0
        with snapshot(entries):
            for entry in entries:
                if looked >= STEP_ENTRIES:
                    return None  # (not done: the next step goes on from _after)
                looked += 1
                if entry.is_dir or not 0 < entry.size <= self.max_file:
                    self._after = entry.name
                    continue
                if inflight >= self.window or self._budget.used + entry.size > limit:
                    return "window"
                if self._ledger.unread(SWEEP) + entry.size > self.allowance():
                    return "unread_bound"
                need = allocation(entry.size, unit)
                room = self._free_space() - self.margin - rounding
                if room < need:
                    if room + self._budget.used >= need:
                        # Short only by bytes in flight: some may be written already and
                        # still reserved (counted twice until the landing releases them,
                        # longer on a busy machine). Decided once they have settled.
                        return "window"
                    return "no_space"
                obj = ObjectVersion(prefix + entry.name.decode("utf-8", "surrogateescape"),
                                    entry.etag, entry.size)
                bid = self._fetcher.block_id(obj, 0)
                if self._fetcher.is_loaded_or_loading(bid):
                    self._after = entry.name
                    continue  # being fetched, or just read (in memory)
                n = pf.want(obj, 0, SWEEP)
                if n is None:
                    return "window"  # memory budget full
                self._after = entry.name
                if n:  # (0: on disk already)
                    inflight += 1
                    if pf.is_loading(SWEEP, bid):
                        self._rounding[bid] = need - entry.size
                        rounding += need - entry.size
                        if self._on_predicted is not None:
                            self._on_predicted(obj, entry.ino)
                        swept.append(entry)
                    metrics.SWEEP_FILES.inc()
                    metrics.SWEEP_BYTES.inc(n)
                    self.paused = None
        self._current = self._after = None  # the directory is done
        return None

    def _spread_from(self, parent: str) -> None:
        """Queue the sub-directories of ``parent`` (in listing order, those not queued)."""
        self._listings.list_ahead(parent)  # (their listings are started ahead of the sweep)
        entries = self._listings.iter_entries(parent)
        with snapshot(entries):
            for i, entry in enumerate(entries):
                if i >= SPREAD_SCAN or len(self._queued) >= self.max_dirs:
                    break
                if entry.is_dir:
                    self._queue_dir(parent + entry.name.decode("utf-8", "surrogateescape") + "/",
                                    "sibling")
