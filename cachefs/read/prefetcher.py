"""Every speculative fetch, under one admission rule and one ledger.

Five policies decide *what* is worth fetching before a reader asks for it:

* ``sequential`` -- a handle read in order (:class:`~cachefs.read.sequential.ReadStream`,
  fed by :meth:`Prefetcher.on_read`);
* ``directory`` -- readers opening a directory's files in name order
  (:class:`~cachefs.read.lookahead.DirectoryLookahead`);
* ``hint`` -- the order the training sampler announced
  (:class:`~cachefs.read.hints.ReadOrder`);
* ``sweep`` -- readers opening a directory's small files in an order nothing
  predicts, missing the cache: the rest of the directory (and its siblings) is
  fetched into free cache space (:class:`~cachefs.read.sweep.Sweeper`);
* ``warm`` -- ``cachefs warm`` (:class:`~cachefs.control.warm.Warmer`).

They all go through :class:`Prefetcher`, which decides *whether* and *how*:

* A block in memory or already loading costs nothing more.
* A block on local disk is loaded into memory ahead only for ``sequential``
  (the handle's next reads come through the daemon). For ``directory``, while
  opens are not passed through to the kernel, its cache file is read into the
  page cache instead (``readahead``: :class:`~cachefs.cache.readahead.DiskReadahead`):
  the request worker that reads it next finds memory, at the cost of one queued
  request and no hand-over. With passthrough the readers' own reads go to the
  disk concurrently, as they would from a local disk, and advice measured no
  faster for more daemon CPU (benchmarks/RESULTS.md, seventh round): it is left
  alone. Far-ahead policies (``hint``, ``sweep``, ``warm``) leave it on disk:
  loading it now would only push out blocks needed sooner.
* A block from S3 needs room in the memory budget. :meth:`want` never waits: a
  full budget answers None and the policy stops until its next trigger.
  :meth:`warm_block` (background work) waits for room instead.

The ledger (:class:`PrefetchLedger`) is the one place that counts issued, used
and wasted bytes, by policy: the fetcher reports every block a reader takes
(:meth:`PrefetchLedger.note_read`) and the passthrough layer the blocks the
kernel reads itself (:meth:`PrefetchLedger.mark_used`). It also keeps, per
policy, the bytes fetched ahead and not read yet and the bytes read so far
(:meth:`PrefetchLedger.unread`, :meth:`PrefetchLedger.used`): the sweep bounds
itself by them.

Concurrency: trio thread only; nothing here blocks or awaits except
:meth:`Prefetcher.warm_block`. Exception: the FUSE request workers report reads to
the ledger (:meth:`PrefetchLedger.note_read`, :meth:`PrefetchLedger.mark_used`)
from their threads; the ledger changes its ordered dictionary only by single
operations (each atomic under the GIL), so those reports interleave safely with
:meth:`PrefetchLedger.issued` on the trio thread; the per-policy tallies are
changed under ``_tally_lock`` (taken only for blocks that were fetched ahead).
"""

from __future__ import annotations

import functools
import threading
from collections import OrderedDict
from collections.abc import Callable, Container, Iterable, Sequence
from typing import Protocol

from cachefs import metrics
from cachefs.cache.index import Entry
from cachefs.read.budget import MemoryBudget
from cachefs.read.fetcher import Fetcher, ObjectVersion
from cachefs.read.sequential import ReadStream

SEQUENTIAL = "sequential"
DIRECTORY = "directory"
HINT = "hint"
WARM = "warm"
SWEEP = "sweep"
POLICIES = (SEQUENTIAL, DIRECTORY, HINT, WARM, SWEEP)

#: Prefetched-but-unread blocks remembered before the oldest counts as wasted.
LEDGER_SIZE = 65536

# Metric children by policy, bound once (a labels() lookup costs ~2 us; the ledger is told
# about every block fetched ahead and every one read).
_ISSUED = {p: metrics.PREFETCH_ISSUED_BYTES.labels(p) for p in POLICIES}
_USED = {p: metrics.PREFETCH_USED_BYTES.labels(p) for p in POLICIES}
_WASTED = {p: metrics.PREFETCH_WASTED_BYTES.labels(p) for p in POLICIES}


class LookupsAhead(Protocol):
    """The request workers' native loop, told the names of files a far-ahead policy (the
    read-order hint, the sweep) fetches, so that their readers' LOOKUPs are answered in C
    (:class:`cachefs.fuse_ops.Operations`): shuffled readers never walk a directory, so
    the names after a lookup (what a walk's lookups give the loop) are not theirs. Both
    calls on the trio thread; neither waits."""

    def lookup_token(self, prefix: str) -> int:
        """The epoch token of directory ``prefix``: read it before the listing the entries
        come from (a listing changed since makes :meth:`remember_listed` a no-op)."""
        ...

    def remember_listed(self, prefix: str, token: int, entries: Sequence[Entry]) -> None:
        """Answer the LOOKUPs of ``entries`` (of ``prefix``'s listing, read after
        ``token``) in the loop while the listing stays fresh."""
        ...


class PrefetchLedger:
    """Issued / used / wasted bytes of speculative fetches, by policy (bounded memory)."""

    def __init__(self, capacity: int = LEDGER_SIZE) -> None:
        self.capacity = capacity
        self._open: OrderedDict[bytes, tuple[int, str]] = OrderedDict()  # oldest first
        self._tally_lock = threading.Lock()
        self._unread: dict[str, int] = dict.fromkeys(POLICIES, 0)
        self._used: dict[str, int] = dict.fromkeys(POLICIES, 0)

    def issued(self, bid: bytes, n: int, policy: str) -> None:
        self._open[bid] = (n, policy)
        _ISSUED[policy].inc(n)
        with self._tally_lock:
            self._unread[policy] += n
        while len(self._open) > self.capacity:
            _, (wasted, old_policy) = self._open.popitem(last=False)
            _WASTED[old_policy].inc(wasted)
            with self._tally_lock:
                self._unread[old_policy] -= wasted

    @property
    def pending(self) -> bool:
        """Whether any block fetched ahead is still unread (any thread; a hint)."""
        return bool(self._open)

    def is_unread(self, bid: bytes) -> bool:
        """Whether block ``bid`` was fetched ahead and no reader took it yet (any thread:
        one dictionary lookup)."""
        return bid in self._open

    def note_read(self, bid: bytes) -> None:
        """A reader took block ``bid`` (through the daemon)."""
        if self._open:
            entry = self._open.pop(bid, None)
            if entry is not None:
                n, policy = entry
                _USED[policy].inc(n)
                with self._tally_lock:
                    self._unread[policy] -= n
                    self._used[policy] += n

    def mark_used(self, bids: Iterable[bytes]) -> None:
        """These blocks are read without passing through the fetcher (the kernel reads
        their cache file itself, see cachefs.passthrough)."""
        if self._open:
            for bid in bids:
                self.note_read(bid)

    def forget(self, bid: bytes) -> None:
        """The load failed: nothing was fetched ahead after all."""
        entry = self._open.pop(bid, None)
        if entry is not None:
            with self._tally_lock:
                self._unread[entry[1]] -= entry[0]

    def unread(self, policy: str) -> int:
        """Bytes ``policy`` fetched ahead that no reader took yet (nor counted as wasted)."""
        return self._unread[policy]

    def used(self, policy: str) -> int:
        """Bytes ``policy`` fetched ahead that readers took, since the daemon started."""
        return self._used[policy]

    def __len__(self) -> int:
        return len(self._open)


class Prefetcher:
    """Starts loads ahead of readers for every policy, under one admission rule."""

    def __init__(self, fetcher: Fetcher, budget: MemoryBudget, ledger: PrefetchLedger, *,
                 readahead: Callable[[bytes, int], None] | None = None,
                 kernel_reads_cached: Callable[[], bool] = lambda: False) -> None:
        self.fetcher = fetcher
        self.budget = budget
        self.ledger = ledger
        # Loads started for the policies that keep a window of GETs in flight (hint,
        # sweep), until the fetcher tells they have their data (``_fetched``).
        self._loading: dict[str, set[bytes]] = {HINT: set(), SWEEP: set(), DIRECTORY: set()}
        self._fetched = {policy: functools.partial(self._ended, policy) for policy in self._loading}
        self._listeners: dict[str, list[Callable[[], None]]] = {p: [] for p in self._loading}
        # readahead(bid, length): have block ``bid`` of local disk read into the page
        # cache (never waits); None: a directory walk's cached blocks are left alone.
        self._readahead = readahead
        # True while opens of fully cached files are passed through to the kernel: then
        # a directory walk's cached files are read by the kernel, not by the daemon.
        self._kernel_reads_cached = kernel_reads_cached

    # -- the admission rule ---------------------------------------------------------------
    def want(self, obj: ObjectVersion, index: int, policy: str, *,
             load_cached: bool = True, on_disk: Container[bytes] | None = None) -> int | None:
        """Ask for block ``index`` of ``obj`` ahead of readers. Never waits.
        ``load_cached=False``: a block on local disk is left there whatever the policy.
        ``on_disk``: the answer of :meth:`on_disk` for a batch of objects that holds
        this block (the block is looked up there, not in the index).

        Returns None when the memory budget is full (stop and try again on the next
        trigger), else the bytes of the block that are not on local disk (in flight,
        in memory or newly requested from below: what the policy may count as
        "fetched ahead"; 0 for a block on disk or past the end).
        """
        f = self.fetcher
        if index < 0 or index * f.block_size >= obj.size:
            return 0
        bid = f.block_id(obj, index)
        length = f.block_len(obj, index)
        if f.is_loaded_or_loading(bid):
            return length
        on_local_disk = f.is_cached_id(bid) if on_disk is None else bid in on_disk
        if on_local_disk:
            if load_cached:
                if policy == SEQUENTIAL:
                    f.load_ahead(obj, index, bid, reserved=0)
                elif (policy == DIRECTORY and self._readahead is not None
                        and not self._kernel_reads_cached()):
                    self._readahead(bid, length)
            return 0
        if not self.budget.try_reserve(length):
            return None
        self.ledger.issued(bid, length, policy)
        loading = self._loading.get(policy)
        f.load_ahead(obj, index, bid, reserved=length,
                     fetched=None if loading is None else self._fetched[policy])
        if loading is not None:
            loading.add(bid)
        return length

    def loading(self, policy: str) -> int:
        """Blocks ``policy`` (hint, sweep or directory) asked for that are still being fetched (not
        yet there; writing back does not count): its GETs in flight. O(1): the fetcher
        tells each such load's end (see :meth:`on_fetched`)."""
        return len(self._loading[policy])

    def is_loading(self, policy: str, bid: bytes) -> bool:
        """Whether block ``bid``, asked for by ``policy``, is among :meth:`loading`'s."""
        return bid in self._loading[policy]

    def directory_load(self, obj: ObjectVersion) -> bytes | None:
        """The id of ``obj``'s block when ``obj`` is one block and a load of it for the
        directory policy is being fetched (:meth:`is_loading`), else None (trio thread).
        While ``is_loading(DIRECTORY, bid)`` holds, :meth:`want` of that block answers
        its length and does nothing else: the directory lookahead counts such a file
        requested again without asking (see ``DirectoryLookahead._take``)."""
        f = self.fetcher
        if not 0 < obj.size <= f.block_size:
            return None
        bid = f.block_id(obj, 0)
        return bid if bid in self._loading[DIRECTORY] else None

    def on_fetched(self, policy: str, listener: Callable[[], None]) -> None:
        """Call ``listener()`` (trio thread) whenever a load of ``policy`` (hint, sweep, directory)
        has its bytes or its error: a policy keeping a window of GETs in flight tops it
        up then, without a timer or a hand-over of its own."""
        self._listeners[policy].append(listener)

    def _ended(self, policy: str, bid: bytes) -> None:
        self._loading[policy].discard(bid)
        for listener in self._listeners[policy]:
            listener()

    def on_disk(self, objs: list[ObjectVersion]) -> set[bytes]:
        """The blocks of the one-block objects among ``objs`` that are on local disk, from
        one read of the index (trio thread; as :meth:`want` does, it may read the disk's
        index, never waits otherwise). Hand it to :meth:`want_object` for each of them: a
        top-up of the directory lookahead read the index once per file, a transaction
        and a metric each. Objects of more blocks are left out (:meth:`want_object` looks
        their blocks up one at a time, as before: a full budget stops it early)."""
        f = self.fetcher
        bids = [f.block_id(obj, 0) for obj in objs if 0 < obj.size <= f.block_size]
        return f.cached_among(bids) if bids else set()

    def want_object(self, obj: ObjectVersion, policy: str, *,
                    load_cached: bool = True, on_disk: set[bytes] | None = None) -> int | None:
        """:meth:`want` for every block of ``obj``; None as soon as the budget is full.
        ``on_disk``: :meth:`on_disk` of a batch that holds ``obj`` (used for a one-block
        object only)."""
        total = 0
        count = self.fetcher.block_count(obj)
        if count != 1:
            on_disk = None
        for index in range(count):
            n = self.want(obj, index, policy, load_cached=load_cached, on_disk=on_disk)
            if n is None:
                return None
            total += n
        return total

    # -- the sequential policy --------------------------------------------------------------
    def on_read(self, stream: ReadStream, obj: ObjectVersion, offset: int, size: int) -> None:
        """A handle read ``[offset, offset+size)``: fetch the stream's window ahead."""
        for index in stream.on_read(offset, size):
            if self.want(obj, index, SEQUENTIAL) is None:
                break  # budget full: the next read tries again from here
            stream.issued_until = index + 1

    # -- background warming -----------------------------------------------------------------
    async def warm_block(self, obj: ObjectVersion, index: int) -> bool:
        """Make a block resident on local disk at background priority; returns whether it
        had to be fetched (from a tier below the disk or from S3). Waits for room in the
        memory budget, unlike :meth:`want`, and uses the prefetch share of the S3
        connections, so training reads keep priority. Raises StoreError."""
        f = self.fetcher
        bid = f.block_id(obj, index)
        if not f.is_loading(bid):
            if f.is_cached_id(bid):
                return False
            length = f.block_len(obj, index)
            await self.budget.reserve(length)
            if f.is_loading(bid) or f.is_cached_id(bid):
                self.budget.release(length)
            else:
                f.load_ahead(obj, index, bid, reserved=length)
                metrics.PREFETCH_ISSUED_BYTES.labels(WARM).inc(length)
        return await f.wait_loaded(bid)
