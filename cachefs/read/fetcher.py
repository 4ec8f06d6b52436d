"""Read-through of object bytes: memory -> cache tiers -> S3, one load per block.

:class:`Fetcher` answers "bytes [offset, offset+size) of object version V".
Each block it needs comes from, in order (see :mod:`cachefs.read.tiers`):

1. the memory tier: recently used, already verified blocks (bounded);
2. each tier of ``tiers``: the local disk cache (verified on every read, see
   :mod:`cachefs.cache.blocks`), then any tier below it (a shared tier);
3. the origin: S3, one GET with If-Match.

2+3 run as one *load* per block (a ``_Flight``), shared by every reader and
prefetcher that wants the block while it runs (single flight: concurrent
readers of one missing block cause one GET and one disk read). A block found
below a tier is put into every tier above it before the flight ends. An
object that fits in one block is fetched with a whole-object GET, checked
against what S3 states about it (ETag MD5 or full-object checksum, see
:mod:`cachefs.s3.integrity`); the blocks of larger objects are ranged GETs,
checked together against S3's full-object CRC once all have landed
(:mod:`cachefs.read.assembled`).

Tasks and ownership:

* Loads run in the fetcher's own nursery (:meth:`Fetcher.run`), not in the
  reader's task, so an interrupted reader does not abort a GET others wait on.
  The load of a one-block object its starter found not on local disk (a
  directory walk's lookahead, a hint), with no tier below the disk, runs as no
  task at all: its whole-object GET is driven by callbacks
  (:meth:`Origin.get_soon`, whose watcher task :meth:`Fetcher.run` owns), and
  its end (:meth:`Fetcher._soon_loaded`, a callback on the trio thread) does
  what the end of :meth:`Fetcher._load` does. Single flight, version pinning
  (the GET's If-Match), the write in the GET's worker thread and the readers
  joined to it are the same; when the fetcher ends, such a load still waiting
  is failed with "cachefs is stopping" at once.
  A load that goes past the disk tier holds a
  :class:`~cachefs.read.budget.MemoryBudget` reservation until its block has
  been written back to the disk cache.
* A piece (below) is fetched in the reading task itself, not in the nursery:
  it is that reader's own range. Readers joined to it wait on its event; if
  its reader is cancelled (the event is set with neither bytes nor error) they
  read by blocks instead. ``_pieced`` and ``_piece_flights`` are changed on the
  trio thread only; ``_pieced`` is bounded (:data:`PIECE_MEMORY`), and a
  piece's entries leave ``_piece_flights`` when its GET ends, however it ends.
* S3 requests go through the :class:`~cachefs.s3.origin.Origin` (retries
  until the deadline, adaptive connection limit, hedging). Speculative loads
  (started by :mod:`cachefs.read.prefetcher`, the one owner of every
  speculative fetch) are background requests: they take only a share of the
  connections, so demand GETs always find a free one.
* Speculative loads of blocks already on local disk are bounded
  (:data:`MAX_DISK_AHEAD` waiting or running): beyond that a prefetch of a
  cached block is skipped, so readers' own disk reads never queue behind
  thousands of speculative ones (a reader reads a skipped block from disk
  when it gets there).
* A whole-object GET (an object of one block: small files) is written to the
  disk tier in the S3 worker thread that fetched it, after its check against
  S3's statement passed (:meth:`Origin.get`'s ``sink``): one thread hop per
  cold small file instead of two (and a file passthrough waits for is registered
  there too: :attr:`Fetcher.write_checked`). Those writes pass a :class:`_SinkGate`,
  closed when :meth:`Fetcher.run` ends (unmount), which then waits for the
  writes already running: a worker thread abandoned by a cancelled GET never
  writes to the cache once the daemon is closing it.
* Everything here runs on the trio thread, except those writes (which touch
  only the disk tier, the gate and their own block), :meth:`Fetcher.read_now`
  and :meth:`Fetcher.join_now` (FUSE request workers); ``_flights`` is only
  changed on the trio thread (the workers read it: one dictionary lookup).
  A flight's ``joined`` list (readers joined from workers) is changed only
  under ``_join_lock``: a worker appends to it while the load runs, and the
  trio thread takes it (leaving None) right after the load's bytes or error
  are there, then answers each joined reader; so a reader is answered exactly
  once, either by the load it joined or -- when it came too late -- by its own
  read of the memory tier or the trio path. A join never starts a load.
  No LMDB transaction is held across an ``await`` here or below (the disk tier
  looks blocks up in synchronous helpers), so a load waiting for a disk thread
  holds no index reader slot.

Pieces: a random read (:attr:`cachefs.read.sequential.ReadStream.random`) of a large
object (at least :data:`PIECE_MIN_BLOCKS` blocks) whose blocks are in no tier and
in no load is answered with one ranged GET of exactly its bytes, which no tier
keeps, instead of a load of every block it touches: a reader that takes small pieces
at random offsets of a large file (a memory-mapped array, HDF5, an indexed record
file) would otherwise move a whole block across regions for each piece. The pieces
read of each block are counted (:data:`PIECE_MEMORY` blocks remembered, least
recently pieced forgotten first); once they add up to 1/:data:`PIECE_SHARE` of
the block, the next read of it loads the block as any other read does, so a reader
that ends up reading most of a file caches it whole, for at most that share (and
one read) more bytes. A read whose range a piece in flight covers waits for that piece (readers of
the same bytes at once share one GET, as readers of a block share its load); a read
of another range of a block with a piece in flight loads the block. Pieces are used
only with blocks of at least :data:`PIECE_MIN_BLOCK_SIZE` (a smaller block costs
little more than a round trip: one load of it serves every reader) and never with a
tier below the disk (a shared tier's point is one copy of each block for a whole
cluster). The same If-Match and retries apply; a piece whose version changed raises
ObjectChanged like a load.

Invariant: a block id names one object version (key, ETag), so bytes of two
versions are never mixed; a version that changed on S3 raises ObjectChanged.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Protocol

import trio

from cachefs import metrics
from cachefs.background import contained
from cachefs.cache.blockid import block_id, block_id_at, object_id
from cachefs.cache.blocks import BlockCache
from cachefs.errors import ObjectChanged, TransientStoreError
from cachefs.read.assembled import AssembledChecks
from cachefs.read.budget import MemoryBudget
from cachefs.read.tiers import BlockRef, DiskTier, MemoryTier, Tier
from cachefs.s3.origin import Got, Origin

log = logging.getLogger(__name__)

ORIGIN = "s3"  # the source name of blocks fetched from the origin
#: Speculative loads of blocks on local disk in flight at most (see the module docstring).
MAX_DISK_AHEAD = 64
#: Objects of fewer blocks are always read by whole blocks (see "Pieces" above) ...
PIECE_MIN_BLOCKS = 8
#: ... and so are objects of smaller blocks.
PIECE_MIN_BLOCK_SIZE = 1 << 20
#: A block is loaded whole once the pieces read of it add up to this fraction of it:
#: a reader that reads a file densely pays at most 1/PIECE_SHARE more bytes, one that
#: reads it sparsely never pays a block for a piece.
PIECE_SHARE = 8
#: Blocks whose pieces are counted, at most (a few MB; least recently pieced dropped).
PIECE_MEMORY = 65536
#: How long the fetcher's end waits for disk writes still running in S3 worker threads.
SINK_CLOSE_TIMEOUT = 10.0

# Metric children by label, bound once (a ``labels()`` lookup costs ~2 us; a cold small
# file passes here several times).
_TIER_HITS = {name: metrics.TIER_HITS.labels(name) for name in ("memory", "disk", ORIGIN)}
_TIER_READ_BYTES = {name: metrics.TIER_READ_BYTES.labels(name)
                    for name in ("memory", "disk", ORIGIN)}
_S3_GET_HOPS = metrics.THREAD_HOPS.labels("s3_get")


class ReadNotes(Protocol):
    """Told about every block a reader takes (the prefetch ledger)."""

    def note_read(self, bid: bytes) -> None:
        ...

    def forget(self, bid: bytes) -> None:
        ...


@dataclasses.dataclass(frozen=True, slots=True)
class ObjectVersion:
    """The version of an object a reader pinned when it opened the file."""

    key: str
    etag: str
    size: int


def _first_leaf(group: BaseExceptionGroup[BaseException]) -> BaseException:
    """The first real exception in a (nested) group: a read fails with one error."""
    exc: BaseException = group
    while isinstance(exc, BaseExceptionGroup):
        exc = exc.exceptions[0]
    return exc


class _SinkGate:
    """Disk writes running in S3 worker threads: counted, and refused once closed.

    Any thread; :meth:`close` blocks (run it in a worker thread) until the writes that
    entered before it have left, or ``timeout`` passed (returns False then)."""

    __slots__ = ("_closed", "_idle", "_lock", "_running")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._running = 0
        self._closed = False
        self._idle = threading.Event()
        self._idle.set()

    def enter(self) -> bool:
        with self._lock:
            if self._closed:
                return False
            self._running += 1
            self._idle.clear()
            return True

    def leave(self) -> None:
        with self._lock:
            self._running -= 1
            if not self._running:
                self._idle.set()

    def close(self, timeout: float) -> bool:
        with self._lock:
            self._closed = True
        return self._idle.wait(timeout)

    @property
    def closed(self) -> bool:
        return self._closed


#: Called on the trio thread with (bytes, None) or (None, error): a reader joined to a load.
Joined = Callable[[bytes | None, BaseException | None], None]


class _Flight:
    """One load of one block, shared by everyone who wants it while it runs."""

    __slots__ = ("data", "disk_ahead", "error", "event", "fetched", "joined", "not_on_disk",
                 "prefetch", "settled", "source")

    def __init__(self, prefetch: bool) -> None:
        # Readers joined from request workers (Fetcher.join_now), told when ``event`` is
        # set; None from then on. Changed only under Fetcher._join_lock.
        self.joined: list[Joined] | None = []
        self.fetched: Callable[[bytes], None] | None = None  # told the bid when event is set
        self.disk_ahead = False  # a speculative load of a block on local disk
        self.not_on_disk = False  # its starter just found it not on local disk
        self.source = "disk"
        self.event = trio.Event()  # data or error is there
        self.settled = trio.Event()  # written back too: the flight is gone
        self.data: bytes | None = None
        self.error: BaseException | None = None
        self.prefetch = prefetch


class _Piece:
    """One GET of bytes ``[start, end)`` of an object (see "Pieces" in the module
    docstring), shared by the readers of a range inside it while it runs."""

    __slots__ = ("data", "end", "error", "event", "start")

    def __init__(self, start: int, end: int) -> None:
        self.start, self.end = start, end
        self.event = trio.Event()  # data, error, or neither (its reader was cancelled)
        self.data: bytes | None = None
        self.error: BaseException | None = None


class Fetcher:
    """Blocks of object versions, read through the caches with single-flight GETs."""

    def __init__(self, origin: Origin, cache: BlockCache, *, block_size: int,
                 budget: MemoryBudget, hot_capacity: int, notes: ReadNotes | None = None,
                 lower_tiers: Sequence[Tier] = ()) -> None:
        self.origin = origin
        self.cache = cache
        self.block_size = block_size
        self.budget = budget
        self.memory = MemoryTier(hot_capacity)
        self.assembled = AssembledChecks(origin, cache, block_size=block_size,
                                         block_ids=self.block_ids, withdraw=self._withdraw)
        # Walked in order after memory; the disk tier first (residency checks use it).
        self.tiers: list[Tier] = [DiskTier(cache), *lower_tiers]
        self._notes = notes
        # GETs of blocks and pieces in flight (trio thread), read by the in-flight gauge
        # when it is collected: a write of the gauge takes its lock, twice per cold file
        self._fetching = 0
        metrics.INFLIGHT_FETCHES.set_function(lambda: self._fetching)
        self._flights: dict[bytes, _Flight] = {}
        #: Bytes read as pieces of blocks no tier holds, and the pieces in flight by
        #: block (trio thread; see "Pieces").
        self._pieced: OrderedDict[bytes, int] = OrderedDict()
        self._piece_flights: dict[bytes, _Piece] = {}
        self._nursery: trio.Nursery | None = None
        self._pending = 0  # flights + write-backs not finished
        self._disk_ahead = 0  # speculative loads of cached blocks in flight
        self.max_disk_ahead = MAX_DISK_AHEAD
        self._idle = trio.Event()
        self._idle.set()
        self._sinks = _SinkGate()
        self._join_lock = threading.Lock()
        #: Told (trio thread) the id of every block whose load has settled: its bytes are
        #: on the disk tier now, or will not be (failed, not admitted). Must be cheap and
        #: must not raise (passthrough: registering predicted files once they landed).
        self.on_settled: Callable[[bytes], None] | None = None
        #: Told (trio thread) the object version a load found no longer in S3 (its GET
        #: raised ObjectChanged), whoever started the load -- a reader, the sequential
        #: prefetcher, a directory walk's lookahead, a sweep -- before any reader of the
        #: load is answered. Must be cheap and must not raise (the file system marks the
        #: version changed and refreshes its directory's listing: see
        #: :meth:`cachefs.fs.FileSystem.object_changed`).
        self.on_changed: Callable[[ObjectVersion], None] | None = None
        #: Asked (an S3 worker thread, inside the sink gate: see :class:`_SinkGate`) to
        #: write a whole object just checked against S3 -- (its version, its block id, its
        #: bytes) -- to the disk tier itself: True when it did (or tried: the block is then
        #: written or not admitted, as by the tier's ``put_now``), False to leave the write
        #: to the tier. Passthrough registers a file it is waiting for from the thread
        #: that wrote it (:meth:`cachefs.passthrough.Passthrough.write_checked`).
        self.write_checked: Callable[[ObjectVersion, bytes, bytes], bool] | None = None

    # -- lifecycle ------------------------------------------------------------------
    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Own the nursery flights run in; returns when cancelled, once no disk write is
        left running in an S3 worker thread (see :class:`_SinkGate`)."""
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                self.assembled.attach(nursery)
                await nursery.start(self.origin.run_soon)  # (the GETs of _soon_load)
                task_status.started()
                await trio.sleep_forever()
        finally:
            with trio.CancelScope(shield=True):
                if not await trio.to_thread.run_sync(self._sinks.close, SINK_CLOSE_TIMEOUT):
                    log.warning("a cache write was still running %g s after the fetcher "
                                "stopped", SINK_CLOSE_TIMEOUT)

    async def drain(self) -> None:
        """Wait until every flight and cache write has finished (used at unmount)."""
        while self._pending:
            await self._idle.wait()

    # -- block addressing -----------------------------------------------------------------
    def block_id(self, obj: ObjectVersion, index: int) -> bytes:
        return block_id(self.origin.bucket, obj.key, obj.etag, self.block_size, index)

    def object_id(self, obj: ObjectVersion) -> bytes:
        return object_id(self.origin.bucket, obj.key, obj.etag, self.block_size)

    def block_ids(self, obj: ObjectVersion) -> list[bytes]:
        """The ids of every block of ``obj``, in order (its object id hashed once)."""
        oid = self.object_id(obj)
        return [block_id_at(oid, i * self.block_size) for i in range(self.block_count(obj))]

    def block_count(self, obj: ObjectVersion) -> int:
        return (obj.size + self.block_size - 1) // self.block_size

    def block_len(self, obj: ObjectVersion, index: int) -> int:
        return max(0, min(self.block_size, obj.size - index * self.block_size))

    def ref(self, obj: ObjectVersion, index: int, bid: bytes | None = None) -> BlockRef:
        return BlockRef(obj, index, self.block_len(obj, index),
                        self.block_id(obj, index) if bid is None else bid)

    # -- residency (never waits) ----------------------------------------------------------
    def is_loading(self, bid: bytes) -> bool:
        return bid in self._flights

    def is_fetching(self, bid: bytes) -> bool:
        """Being loaded and not there yet (waiting for a tier or S3; not writing back)."""
        flight = self._flights.get(bid)
        return flight is not None and not flight.event.is_set()

    def in_memory(self, obj: ObjectVersion) -> bool:
        """Every block of ``obj`` is in the memory tier now (any thread)."""
        memory = self.memory
        return all(bid in memory for bid in self.block_ids(obj))

    def is_loaded_or_loading(self, bid: bytes) -> bool:
        """In memory or being loaded: nothing more to do for a prefetcher."""
        return bid in self.memory or bid in self._flights

    def is_cached_id(self, bid: bytes) -> bool:
        """On the local disk cache."""
        return self.cache.contains(bid)

    def cached_among(self, bids: list[bytes]) -> set[bytes]:
        """The blocks among ``bids`` on the local disk cache (one read of its index)."""
        return self.cache.contains_which(bids)

    def is_cached(self, obj: ObjectVersion, index: int) -> bool:
        """On the local disk cache (what ``cachefs warm --check`` reports)."""
        return self.cache.contains(self.block_id(obj, index))

    def is_resident(self, obj: ObjectVersion, index: int) -> bool:
        """In memory, on disk, or in flight."""
        bid = self.block_id(obj, index)
        return self.is_loaded_or_loading(bid) or self.cache.contains(bid)

    # -- reads ------------------------------------------------------------------------------
    async def read(self, obj: ObjectVersion, offset: int, size: int, *,
                   random: bool = False) -> bytes:
        """Bytes ``[offset, offset+size)`` of ``obj`` (clamped to its size). ``random``:
        the reader's last read was random, so the bytes may come as a piece (see the
        module docstring)."""
        end = min(offset + size, obj.size)
        if offset >= end:
            return b""
        if random:
            piece = await self._read_piece(obj, offset, end)
            if piece is not None:
                return piece
        bs = self.block_size
        first, last = offset // bs, (end - 1) // bs
        if first == last:
            data = await self._block_for_read(obj, first, end - offset)
            return data[offset - first * bs:end - first * bs]
        parts: list[bytes] = [b""] * (last - first + 1)

        async def fetch_part(i: int) -> None:
            lo = max(offset, i * bs) - i * bs
            hi = min(end, (i + 1) * bs) - i * bs
            block = await self._block_for_read(obj, i, hi - lo)
            parts[i - first] = block[lo:hi]

        try:
            async with trio.open_nursery() as nursery:
                for i in range(first, last + 1):
                    nursery.start_soon(fetch_part, i)
        except BaseExceptionGroup as group:
            raise _first_leaf(group) from None
        return b"".join(parts)

    def read_now(self, obj: ObjectVersion, offset: int, size: int) -> bytes | None:
        """:meth:`read` answered from memory or the local disk on the calling thread (a
        FUSE request worker: it may wait on the disk), or None when a block is neither
        there nor may be read from there now (not cached, failed its verification, or
        being loaded: the trio path joins that load). Never starts a load, so a GET is
        only ever made by :meth:`read` (single flight). Any thread."""
        end = min(offset + size, obj.size)
        if offset >= end:
            return b""
        bs = self.block_size
        first, last = offset // bs, (end - 1) // bs
        oid = self.object_id(obj)
        blocks: list[tuple[bytes, bytes, str]] = []
        for i in range(first, last + 1):
            bid = block_id_at(oid, i * bs)
            data = self.memory.peek(bid)
            source = "memory"
            if data is None:
                if bid in self._flights:
                    return None
                data = self.cache.get_now(bid)
                if data is None:
                    return None
                source = "disk"
                self.memory.store(bid, data)
            blocks.append((bid, data, source))
        # Accounted only once every block is there (a None above is read again by read()).
        parts = []
        for i, (bid, data, source) in enumerate(blocks, start=first):
            if self._notes is not None:
                self._notes.note_read(bid)
            lo = max(offset, i * bs) - i * bs
            hi = min(end, (i + 1) * bs) - i * bs
            metrics.CACHE_HIT_REQUESTS.inc()
            metrics.CACHE_HIT_BYTES.inc(hi - lo)
            (_TIER_READ_BYTES.get(source) or metrics.TIER_READ_BYTES.labels(source)).inc(hi - lo)
            if source == "disk":
                _TIER_HITS["disk"].inc()
            parts.append(data if lo == 0 and hi == len(data) else data[lo:hi])
        return parts[0] if len(parts) == 1 else b"".join(parts)

    def join_now(self, obj: ObjectVersion, offset: int, size: int, done: Joined) -> bool:
        """Join the load under way of the one block of a one-block object: when
        ``[offset, offset+size)`` of ``obj`` (which must not be empty) lies in a block
        whose load is fetching now, arrange for ``done(bytes, None)`` or
        ``done(None, error)`` to be called once, on the trio thread, when the load has
        its bytes or its error, and return True; else return False (nothing arranged:
        ask :meth:`read_now` or :meth:`read`). Never starts a load (single flight) and
        never waits. Any thread: a FUSE request worker answers a READ of a block being
        fetched this way, without handing it to the trio thread (see ``_join_lock``)."""
        if obj.size > self.block_size or offset >= obj.size:
            return False  # (more than one block: the sequential prefetcher must see reads)
        bid = block_id_at(self.object_id(obj), 0)
        flight = self._flights.get(bid)  # (one dictionary read: atomic under the GIL)
        if flight is None:
            return False
        end = min(offset + size, obj.size)

        def answer(data: bytes | None, error: BaseException | None) -> None:  # trio thread
            metrics.SINGLE_FLIGHT_JOINS.inc()
            if data is None:
                done(None, error)
                return
            n = end - offset
            source = flight.source
            if source in ("memory", "disk"):
                metrics.CACHE_HIT_REQUESTS.inc()
                metrics.CACHE_HIT_BYTES.inc(n)
            else:
                metrics.CACHE_MISS_REQUESTS.inc()
                metrics.CACHE_MISS_BYTES.inc(n)
            (_TIER_READ_BYTES.get(source) or metrics.TIER_READ_BYTES.labels(source)).inc(n)
            done(data if offset == 0 and end == len(data) else data[offset:end], None)

        with self._join_lock:
            if flight.joined is None:
                return False  # ended meanwhile: its bytes are in memory (or it failed)
            flight.joined.append(answer)
        if self._notes is not None:
            self._notes.note_read(bid)
        return True

    def _tell_joined(self, flight: _Flight) -> None:
        """The load has its bytes or its error: answer the readers joined to it (trio
        thread; after ``flight.event`` is set)."""
        with self._join_lock:
            joined, flight.joined = flight.joined, None
        for answer in joined or ():
            try:
                answer(flight.data, flight.error)
            except Exception:  # a reader's answer must not end the load (nor the fetcher)
                log.exception("answering a read joined to a fetch failed")

    async def _read_piece(self, obj: ObjectVersion, offset: int, end: int) -> bytes | None:
        """Bytes ``[offset, end)`` of ``obj`` as a piece, or None when they are to be read
        by blocks: a small object, a lower tier, a block in some tier or load, or one whose
        pieces reached its share (see the module docstring). Trio thread."""
        bs = self.block_size
        if bs < PIECE_MIN_BLOCK_SIZE or obj.size < PIECE_MIN_BLOCKS * bs or len(self.tiers) > 1:
            return None
        first, last = offset // bs, (end - 1) // bs
        bids = [self.block_id(obj, i) for i in range(first, last + 1)]
        for bid in bids:
            if bid in self._flights or self.memory.peek(bid) is not None or self.cache.contains(bid):
                return None
        if any(bid in self._piece_flights for bid in bids):
            running = self._piece_flights.get(bids[0])
            if running is None or not running.start <= offset < end <= running.end:
                return None  # another range of a block being pieced: load the block
            await running.event.wait()
            if running.error is not None:
                raise running.error
            if running.data is None:
                return None  # its reader was interrupted: this one reads by blocks
            metrics.SINGLE_FLIGHT_JOINS.inc()
            return running.data[offset - running.start:end - running.start]
        due = False
        for i, bid in enumerate(bids, start=first):
            before = self._pieced.pop(bid, 0)
            if before * PIECE_SHARE >= self.block_len(obj, i):
                due = True  # (forgotten: its load caches it)
            else:  # (the first read of a block is a piece whatever its size: a page fault
                # of a memory map reads the kernel's whole read-around, --read-ahead)
                self._pieced[bid] = before + min(end, (i + 1) * bs) - max(offset, i * bs)
        while len(self._pieced) > PIECE_MEMORY:
            self._pieced.popitem(last=False)
        if due:
            return None
        n = end - offset
        piece = _Piece(offset, end)
        for bid in bids:
            self._piece_flights[bid] = piece
        self.budget.force_reserve(n)
        self._fetching += 1
        _S3_GET_HOPS.inc()
        try:
            got = await self.origin.get(obj.key, obj.etag, offset, end)
            piece.data = got.data
        except Exception as exc:
            piece.error = exc
            if isinstance(exc, ObjectChanged):
                self._tell_changed(obj)
            raise
        finally:
            for bid in bids:
                if self._piece_flights.get(bid) is piece:
                    del self._piece_flights[bid]
            piece.event.set()
            self._fetching -= 1
            self.budget.release(n)
        metrics.PIECE_READS.inc()
        metrics.PIECE_BYTES.inc(n)
        metrics.CACHE_MISS_REQUESTS.inc()
        metrics.CACHE_MISS_BYTES.inc(n)
        _TIER_READ_BYTES[ORIGIN].inc(n)
        return got.data

    def _tell_changed(self, obj: ObjectVersion) -> None:
        if self.on_changed is not None:
            try:
                self.on_changed(obj)
            except Exception:  # (a listener's bug must not end the read)
                log.exception("telling that an object changed failed")

    async def _block_for_read(self, obj: ObjectVersion, index: int, n: int) -> bytes:
        data, source = await self.get_block(obj, index)
        if source in ("memory", "disk"):
            metrics.CACHE_HIT_BYTES.inc(n)
        else:
            metrics.CACHE_MISS_BYTES.inc(n)
        (_TIER_READ_BYTES.get(source) or metrics.TIER_READ_BYTES.labels(source)).inc(n)
        return data

    async def get_block(self, obj: ObjectVersion, index: int) -> tuple[bytes, str]:
        """Block ``index`` of ``obj`` and where it came from: "memory", a tier's name
        ("disk", ...) or "s3" (the origin)."""
        bid = self.block_id(obj, index)
        if self._notes is not None:
            self._notes.note_read(bid)
        data = self.memory.peek(bid)
        if data is not None:
            metrics.CACHE_HIT_REQUESTS.inc()
            return data, "memory"
        flight = self._flights.get(bid)
        if flight is None:
            flight = self._start_load(obj, index, bid, prefetch=False, reserved=0)
        elif flight.event.is_set() and flight.data is not None:
            # Loaded, still being written back: the bytes are in memory.
            metrics.CACHE_HIT_REQUESTS.inc()
            return flight.data, "memory"
        else:
            metrics.SINGLE_FLIGHT_JOINS.inc()
        await flight.event.wait()
        if flight.error is not None:
            raise flight.error
        assert flight.data is not None
        if flight.source == "disk":
            metrics.CACHE_HIT_REQUESTS.inc()
        else:
            metrics.CACHE_MISS_REQUESTS.inc()
        return flight.data, flight.source

    # -- loads started ahead of readers (by cachefs.read.prefetcher) --------------------------
    def load_ahead(self, obj: ObjectVersion, index: int, bid: bytes, *, reserved: int,
                   fetched: Callable[[bytes], None] | None = None) -> None:
        """Start a speculative load of a block that is neither in memory nor in flight.
        ``fetched(bid)`` is called (trio thread) once the load has its bytes or error
        (the moment :meth:`is_fetching` turns False), if the load is started.
        ``reserved`` bytes of the memory budget are handed to the load (it releases them).
        A load of a block on local disk (``reserved`` 0) is skipped when
        :attr:`max_disk_ahead` such loads are in flight. ``reserved`` > 0 states that the
        caller has just found the block not on local disk (:meth:`is_cached_id`): the load
        does not ask the disk tier again (were it stored meanwhile, the GET is only
        redundant)."""
        if not reserved:
            if self._disk_ahead >= self.max_disk_ahead:
                return
            self._disk_ahead += 1
            flight = self._start_load(obj, index, bid, prefetch=True, reserved=0)
            flight.disk_ahead = True
        else:
            flight = self._start_load(obj, index, bid, prefetch=True, reserved=reserved,
                                      not_on_disk=True)
        flight.fetched = fetched

    async def wait_loaded(self, bid: bytes) -> bool:
        """Wait until the load of ``bid`` in flight (if any) has ended, written back to
        the disk tier included; returns whether the block came from below the disk tier.
        Raises the load's error."""
        flight = self._flights.get(bid)
        if flight is None:
            return False
        await flight.settled.wait()
        if flight.error is not None:
            raise flight.error
        return flight.source not in ("memory", "disk")

    def _start_load(self, obj: ObjectVersion, index: int, bid: bytes, *, prefetch: bool,
                    reserved: int, not_on_disk: bool = False) -> _Flight:
        assert self._nursery is not None, "Fetcher.run() is not running"
        flight = _Flight(prefetch)
        flight.not_on_disk = not_on_disk
        self._flights[bid] = flight
        if not self._pending:
            self._idle = trio.Event()
        self._pending += 1
        if not (not_on_disk and reserved and obj.size <= self.block_size and index == 0
                and len(self.tiers) == 1 and self._soon_load(obj, bid, flight, reserved)):
            self._nursery.start_soon(self._load, obj, index, bid, flight, reserved)
        return flight

    def _soon_load(self, obj: ObjectVersion, bid: bytes, flight: _Flight,
                   reserved: int) -> bool:
        """Start the load of a one-block object found not on local disk, with no tier
        below the disk, as a whole-object GET driven by callbacks
        (:meth:`Origin.get_soon`): no task on the trio thread, whose cost per cold small
        file bounds their throughput. Its end (:meth:`_soon_loaded`) does what the end
        of :meth:`_load` does. False when the origin starts nothing now: :meth:`_load`
        then runs as for any load."""
        ref = BlockRef(obj, 0, self.block_len(obj, 0), bid)
        stored: list[bool] = []

        def done(got: Got | None, error: BaseException | None) -> None:  # trio thread
            self._soon_loaded(ref, flight, reserved, got, error, bool(stored))

        if not self.origin.get_soon(obj.key, obj.etag, 0, ref.length, whole=True,
                                    background=flight.prefetch, done=done,
                                    sink=self._disk_sink(ref, stored)):
            return False
        self._fetching += 1
        _S3_GET_HOPS.inc()
        flight.source = ORIGIN
        return True

    def _soon_loaded(self, ref: BlockRef, flight: _Flight, reserved: int, got: Got | None,
                     error: BaseException | None, on_disk: bool) -> None:
        """The GET of a load started by :meth:`_soon_load` has its answer (trio thread):
        as :meth:`_load` ends. A block its GET's worker thread did not write to the disk
        tier (bytes served after two answers disagreed with the ETag, the fetcher
        stopping) is written back by a task of the fetcher's nursery, its flight kept
        until then; once the fetcher has stopped, it is not."""
        self._fetching -= 1
        bid = ref.bid
        write_back = False
        try:
            if got is not None:
                _TIER_HITS[ORIGIN].inc()
                flight.data = got.data
                self.memory.store(bid, got.data)
                write_back = not on_disk and not self._sinks.closed
            else:
                flight.error = error
                if isinstance(error, ObjectChanged):
                    self._tell_changed(ref.obj)
                if self._notes is not None:
                    self._notes.forget(bid)
            if write_back:
                try:
                    assert self._nursery is not None
                    self._nursery.start_soon(self._soon_write_back, ref, flight, reserved)
                except RuntimeError:  # (the fetcher's nursery has ended)
                    write_back = False
            if not write_back:
                self._settle(bid, flight)
            self._announce(bid, flight)
        finally:
            if not write_back:
                self._loaded(reserved)

    async def _soon_write_back(self, ref: BlockRef, flight: _Flight, reserved: int) -> None:
        """Write back the block of a load of :meth:`_soon_load` its GET did not write."""
        try:
            with contained("cache_write", "writing a fetched block to the disk tier"):
                await self.tiers[0].put(ref, flight.data)  # type: ignore[arg-type]
        finally:
            self._settle(ref.bid, flight)
            self._loaded(reserved)

    def _loaded(self, reserved: int) -> None:
        """A load started by :meth:`_soon_load` is over, written back included."""
        if reserved:
            self.budget.release(reserved)
        self._pending -= 1
        if not self._pending:
            self._idle.set()

    async def _load(self, obj: ObjectVersion, index: int, bid: bytes, flight: _Flight,
                    reserved: int) -> None:
        """Load one block for every waiter (the tiers in order, else the origin); then put
        it into the tiers above the one that had it."""
        ref = self.ref(obj, index, bid)
        data: bytes | None = None
        got: Got | None = None
        found_at = len(self.tiers)  # the index of the tier that had it; len(): the origin
        skip = 0  # the tiers above found_at that already have it
        try:
            try:
                for i, tier in enumerate(self.tiers):
                    if i == 0 and flight.not_on_disk:
                        continue
                    if i == 1 and not reserved:
                        # Past the disk: the block is held until it is written back.
                        reserved = ref.length
                        self.budget.force_reserve(reserved)
                    data = await tier.get(ref)
                    if data is not None:
                        found_at = i
                        flight.source = tier.name
                        break
                if data is None:
                    if not reserved:
                        reserved = ref.length
                        self.budget.force_reserve(reserved)
                    flight.source = ORIGIN
                    got, on_disk = await self._fetch(ref, flight.prefetch)
                    data = got.data
                    if on_disk:
                        skip = 1  # written to the disk tier in the GET's worker thread
                (_TIER_HITS.get(flight.source) or metrics.TIER_HITS.labels(flight.source)).inc()
                flight.data = data
                self.memory.store(bid, data)
            except Exception as exc:  # handed to every waiter; logged by the FUSE layer
                flight.error = exc
                data = None
                if isinstance(exc, ObjectChanged):
                    self._tell_changed(obj)
                if self._notes is not None:
                    self._notes.forget(bid)
            finally:
                if flight.data is None and flight.error is None:  # cancelled at shutdown
                    flight.error = TransientStoreError("fetch cancelled: cachefs is stopping")
                write_back = flight.error is None and found_at > skip
                if not write_back:
                    self._settle(bid, flight)
                self._announce(bid, flight)
            if write_back:
                # The flight stays registered until the block is on disk: evicted from
                # memory meanwhile, it must still not be fetched a second time.
                try:
                    for tier in self.tiers[skip:found_at]:
                        # Readers already have the block: a failed write-back (even a bug)
                        # costs a refetch later, never the fetcher's nursery
                        # (cachefs.background).
                        with contained("cache_write", f"writing a fetched block to the "
                                       f"{tier.name} tier"):
                            await tier.put(ref, data)  # type: ignore[arg-type]
                finally:
                    self._settle(bid, flight)
                if self.block_count(obj) > 1:
                    # From the origin with its CRC; from a lower tier (another node's fetch)
                    # without one: if this object is being checked, its bytes are read back
                    # from disk, so the combined CRC covers every block whatever its source.
                    self.assembled.landed(obj, index, got.crc if got is not None else None)
        finally:
            if flight.disk_ahead:
                self._disk_ahead -= 1
            if reserved:
                self.budget.release(reserved)
            self._pending -= 1
            if not self._pending:
                self._idle.set()

    def _announce(self, bid: bytes, flight: _Flight) -> None:
        """A load's outcome is in ``flight`` (trio thread): wake the tasks waiting for it,
        tell the readers joined to it and the prefetch policy that started it."""
        flight.event.set()
        self._tell_joined(flight)
        if flight.fetched is not None:
            try:
                flight.fetched(bid)
            except Exception:  # (a policy's bug must not end the load)
                log.exception("telling a prefetch policy that a load ended failed")

    def _settle(self, bid: bytes, flight: _Flight) -> None:
        """The load of ``bid`` is over, write-back included: forget its flight."""
        del self._flights[bid]
        flight.settled.set()
        if self.on_settled is not None:
            try:
                self.on_settled(bid)
            except Exception:  # (a listener's bug must not end the load)
                log.exception("telling that a load settled failed")

    async def _fetch(self, ref: BlockRef, prefetch: bool) -> tuple[Got, bool]:
        """Block ``ref`` from S3 and whether it is on the disk tier already: a whole-object
        GET when one block covers the object (written to the disk tier in its worker
        thread), else a ranged GET (with its CRC when S3's full-object CRC is known)."""
        obj = ref.obj
        start = ref.index * self.block_size
        end = start + ref.length
        whole = start == 0 and end >= obj.size
        self._fetching += 1
        try:
            if not whole:
                return await self._get_range(obj, start, end, whole=False,
                                             background=prefetch), False
            stored: list[bool] = []
            got = await self._get_range(obj, start, end, whole=True, background=prefetch,
                                        sink=self._disk_sink(ref, stored))
            # Written by one of the answers (there may be two: a hedged GET), or by none
            # (bytes served after two answers disagreed with the ETag): then the write-back.
            return got, bool(stored)
        finally:
            self._fetching -= 1

    def _disk_sink(self, ref: BlockRef, stored: list[bool]) -> Callable[[bytes], None] | None:
        """The function that writes a checked whole object to the disk tier in the GET's
        worker thread (appending to ``stored`` when it was written); None without one."""
        disk = self.tiers[0]
        if not isinstance(disk, DiskTier):
            return None
        gate = self._sinks

        def sink(data: bytes) -> None:  # an S3 worker thread
            if not gate.enter():
                return  # the fetcher has stopped: the cache is being closed
            try:
                # Readers already have the block: a failed write (even a bug) costs a
                # refetch later, never the GET (cachefs.background).
                with contained("cache_write", "writing a fetched object to the disk tier"):
                    write = self.write_checked
                    if write is None or not write(ref.obj, ref.bid, data):
                        disk.put_now(ref, data)
                    stored.append(True)
            finally:
                gate.leave()
        return sink

    async def _get_range(self, obj: ObjectVersion, start: int, end: int, *, whole: bool,
                         background: bool, sink: Callable[[bytes], None] | None = None) -> Got:
        crc_kind = None if whole else self.assembled.crc_kind(obj)
        _S3_GET_HOPS.inc()  # (the origin's GET runs in a worker thread)
        return await self.origin.get(obj.key, obj.etag, start, end, whole=whole,
                                     background=background, crc_kind=crc_kind, sink=sink)

    async def _withdraw(self, obj: ObjectVersion, bids: list[bytes]) -> None:
        """Take the blocks ``bids`` of ``obj`` back from every tier (their bytes failed a
        check after they were put): memory, the disk cache, and any lower tier (a shared
        tier drops their pending publishes and deletes what it published)."""
        refs = [self.ref(obj, i, bid) for i, bid in enumerate(bids)]
        for bid in bids:
            self.memory.discard(bid)
        for tier in self.tiers:
            # One tier's failure (even a bug) must not keep the others' copies.
            with contained("cache_write", f"withdrawing blocks from the {tier.name} tier"):
                await tier.withdraw(refs)
