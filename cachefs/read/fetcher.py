"""Read-through of object bytes: memory -> disk cache -> S3, one GET per block.

:class:`Fetcher` answers "bytes [offset, offset+size) of object version V".
Each block it needs comes from, in order:

1. the hot set: recently used, already verified blocks in memory (bounded);
2. the disk cache (verified on every read, see :mod:`cachefs.cache.blocks`);
3. S3.

2+3 run as one *load* per block (a ``_Flight``), shared by every reader and
prefetcher that wants the block while it runs: it reads the disk cache and,
on a miss, sends one ranged GET with If-Match (single flight: concurrent
readers of one missing block cause one GET and one disk read).

Tasks and ownership:

* Loads run in the fetcher's own nursery (:meth:`Fetcher.run`), not in the
  reader's task, so an interrupted reader does not abort a GET others wait on.
  A flight holds a :class:`~cachefs.read.budget.MemoryBudget` reservation until its
  block has been written to the disk cache.
* S3 calls run in worker threads under ``s3_limiter`` (bounded connections).
  Prefetch flights additionally take ``prefetch_limiter`` (a share of the
  connections) so demand GETs always find a free connection.
* Everything here runs on the trio thread; ``_flights`` and the hot set are
  only touched there.

Invariant: a block id names one object version (key, ETag), so bytes of two
versions are never mixed; a version that changed on S3 raises ObjectChanged.
"""

from __future__ import annotations

import dataclasses
import logging
from collections import OrderedDict

import trio

from cachefs import metrics
from cachefs.cache.blocks import BlockCache, block_id, block_id_at, object_id
from cachefs.errors import TransientStoreError
from cachefs.read.budget import MemoryBudget
from cachefs.s3.store import ObjectStore

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True, slots=True)
class ObjectVersion:
    """The version of an object a reader pinned when it opened the file."""

    key: str
    etag: str
    size: int


# How many prefetched-but-unread blocks are remembered before the oldest counts as wasted.
_PREFETCH_MEMORY = 65536


class HotBlocks:
    """Verified blocks in memory, least recently used dropped first (bounded in bytes)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.used = 0
        self._blocks: OrderedDict[bytes, bytes] = OrderedDict()

    def get(self, bid: bytes) -> bytes | None:
        data = self._blocks.get(bid)
        if data is not None:
            self._blocks.move_to_end(bid)
        return data

    def put(self, bid: bytes, data: bytes) -> None:
        if len(data) > self.capacity:
            return
        old = self._blocks.pop(bid, None)
        if old is not None:
            self.used -= len(old)
        self._blocks[bid] = data
        self.used += len(data)
        while self.used > self.capacity:
            _, dropped = self._blocks.popitem(last=False)
            self.used -= len(dropped)

    def __contains__(self, bid: bytes) -> bool:
        return bid in self._blocks


def _first_leaf(group: BaseExceptionGroup[BaseException]) -> BaseException:
    """The first real exception in a (nested) group: a read fails with one error."""
    exc: BaseException = group
    while isinstance(exc, BaseExceptionGroup):
        exc = exc.exceptions[0]
    return exc


class _Flight:
    """One load of one block, shared by everyone who wants it while it runs."""

    __slots__ = ("data", "error", "event", "prefetch", "source")

    def __init__(self, prefetch: bool) -> None:
        self.source = "disk"
        self.event = trio.Event()
        self.data: bytes | None = None
        self.error: BaseException | None = None
        self.prefetch = prefetch


class Fetcher:
    """Blocks of object versions, read through the caches with single-flight GETs."""

    def __init__(self, store: ObjectStore, cache: BlockCache, *, block_size: int,
                 budget: MemoryBudget, s3_limiter: trio.CapacityLimiter,
                 hot_capacity: int) -> None:
        self.store = store
        self.cache = cache
        self.block_size = block_size
        self.budget = budget
        self._s3_limiter = s3_limiter
        # Prefetch may use at most 3/4 of the connections: demand never queues behind it.
        self._prefetch_limiter = trio.CapacityLimiter(max(1, s3_limiter.total_tokens * 3 // 4))
        self.hot = HotBlocks(hot_capacity)
        self._flights: dict[bytes, _Flight] = {}
        # Prefetched blocks not read yet (for the used/wasted metrics), oldest first.
        self._prefetched: OrderedDict[bytes, int] = OrderedDict()
        self._nursery: trio.Nursery | None = None
        self._pending = 0  # flights + cache writes not finished
        self._idle = trio.Event()
        self._idle.set()

    # -- lifecycle ------------------------------------------------------------------
    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Own the nursery flights run in; returns when cancelled."""
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            task_status.started()
            await trio.sleep_forever()

    async def drain(self) -> None:
        """Wait until every flight and cache write has finished (used at unmount)."""
        while self._pending:
            await self._idle.wait()

    # -- block addressing -----------------------------------------------------------------
    def block_id(self, obj: ObjectVersion, index: int) -> bytes:
        return block_id(self.store.bucket, obj.key, obj.etag, self.block_size, index)

    def object_id(self, obj: ObjectVersion) -> bytes:
        return object_id(self.store.bucket, obj.key, obj.etag, self.block_size)

    def block_ids(self, obj: ObjectVersion) -> list[bytes]:
        """The ids of every block of ``obj``, in order (its object id hashed once)."""
        oid = self.object_id(obj)
        return [block_id_at(oid, i * self.block_size) for i in range(self.block_count(obj))]

    def block_count(self, obj: ObjectVersion) -> int:
        return (obj.size + self.block_size - 1) // self.block_size

    def block_len(self, obj: ObjectVersion, index: int) -> int:
        return max(0, min(self.block_size, obj.size - index * self.block_size))

    def is_resident(self, obj: ObjectVersion, index: int) -> bool:
        """In memory, on disk, or in flight (nothing to do for a prefetcher)."""
        bid = self.block_id(obj, index)
        return bid in self.hot or bid in self._flights or self.cache.contains(bid)

    # -- reads ------------------------------------------------------------------------------
    async def read(self, obj: ObjectVersion, offset: int, size: int) -> bytes:
        """Bytes ``[offset, offset+size)`` of ``obj`` (clamped to its size)."""
        end = min(offset + size, obj.size)
        if offset >= end:
            return b""
        bs = self.block_size
        first, last = offset // bs, (end - 1) // bs
        if first == last:
            data = await self._block_for_read(obj, first, offset - first * bs, end - offset)
            return data[offset - first * bs:end - first * bs]
        parts: list[bytes] = [b""] * (last - first + 1)

        async def fetch_part(i: int) -> None:
            lo = max(offset, i * bs) - i * bs
            hi = min(end, (i + 1) * bs) - i * bs
            block = await self._block_for_read(obj, i, lo, hi - lo)
            parts[i - first] = block[lo:hi]

        try:
            async with trio.open_nursery() as nursery:
                for i in range(first, last + 1):
                    nursery.start_soon(fetch_part, i)
        except BaseExceptionGroup as group:
            raise _first_leaf(group) from None
        return b"".join(parts)

    async def _block_for_read(self, obj: ObjectVersion, index: int, lo: int, n: int) -> bytes:
        data, source = await self.get_block(obj, index)
        if source == "s3":
            metrics.CACHE_MISS_BYTES.inc(n)
        else:
            metrics.CACHE_HIT_BYTES.inc(n)
        return data

    def _remember_prefetched(self, bid: bytes, n: int) -> None:
        self._prefetched[bid] = n
        while len(self._prefetched) > _PREFETCH_MEMORY:
            _, wasted = self._prefetched.popitem(last=False)
            metrics.PREFETCH_WASTED_BYTES.inc(wasted)

    def mark_used(self, bids: list[bytes]) -> None:
        """These blocks are read without passing through here (the kernel reads their
        file itself, see cachefs.passthrough): prefetched ones count as used."""
        if self._prefetched:
            for bid in bids:
                self._note_read(bid)

    def _note_read(self, bid: bytes) -> None:
        n = self._prefetched.pop(bid, None)
        if n is not None:
            metrics.PREFETCH_USED_BYTES.inc(n)

    async def get_block(self, obj: ObjectVersion, index: int) -> tuple[bytes, str]:
        """Block ``index`` of ``obj`` and where it came from: "memory", "disk" or "s3"."""
        bid = self.block_id(obj, index)
        if self._prefetched:
            self._note_read(bid)
        data = self.hot.get(bid)
        if data is not None:
            metrics.CACHE_HIT_REQUESTS.inc()
            return data, "memory"
        flight = self._flights.get(bid)
        if flight is None:
            flight = self._start_load(obj, index, bid, prefetch=False, reserved=0)
        elif flight.event.is_set() and flight.data is not None:
            # Loaded, still being written to disk: the bytes are in memory.
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

    def prefetch(self, obj: ObjectVersion, index: int, *, cached: bool = True) -> bool:
        """Start loading a block ahead of readers: from disk into memory when it is cached
        (unless ``cached`` is False: the kernel will read such files itself), else from S3
        if the memory budget has room. Never waits; returns whether a load was started."""
        if index * self.block_size >= obj.size:
            return False
        bid = self.block_id(obj, index)
        if bid in self.hot or bid in self._flights:
            return False
        if self.cache.contains(bid):
            if not cached:
                return False
            self._start_load(obj, index, bid, prefetch=True, reserved=0)
            return True
        length = self.block_len(obj, index)
        if not self.budget.try_reserve(length):
            return False
        self._remember_prefetched(bid, length)
        self._start_load(obj, index, bid, prefetch=True, reserved=length)
        return True

    def is_cached(self, obj: ObjectVersion, index: int) -> bool:
        """On disk (what ``cachefs warm --check`` reports)."""
        return self.cache.contains(self.block_id(obj, index))

    async def warm(self, obj: ObjectVersion, index: int) -> bool:
        """Make a block resident on disk at background priority; returns whether it had to
        be fetched. Waits for memory budget (unlike demand reads) and uses the prefetch
        share of the connections, so training reads keep priority. Raises StoreError."""
        bid = self.block_id(obj, index)
        flight = self._flights.get(bid)
        if flight is None:
            if self.cache.contains(bid):
                return False
            length = self.block_len(obj, index)
            await self.budget.reserve(length)
            flight = self._flights.get(bid)
            if flight is None:
                if self.cache.contains(bid):
                    self.budget.release(length)
                    return False
                flight = self._start_load(obj, index, bid, prefetch=True, reserved=length)
            else:
                self.budget.release(length)
        await flight.event.wait()
        if flight.error is not None:
            raise flight.error
        return flight.source == "s3"

    def _start_load(self, obj: ObjectVersion, index: int, bid: bytes, *, prefetch: bool,
                    reserved: int) -> _Flight:
        assert self._nursery is not None, "Fetcher.run() is not running"
        flight = _Flight(prefetch)
        self._flights[bid] = flight
        if not self._pending:
            self._idle = trio.Event()
        self._pending += 1
        self._nursery.start_soon(self._load, obj, index, bid, flight, reserved)
        return flight

    async def _load(self, obj: ObjectVersion, index: int, bid: bytes, flight: _Flight,
                    reserved: int) -> None:
        """Load one block (disk, else S3) for every waiter; then write it to the cache."""
        data: bytes | None = None
        try:
            try:
                data = await self.cache.get(bid)
                if data is not None:
                    flight.source = "disk"
                else:
                    if not reserved:
                        reserved = self.block_len(obj, index)
                        self.budget.force_reserve(reserved)
                    flight.source = "s3"
                    data = await self._fetch(obj, index, flight.prefetch)
                flight.data = data
                self.hot.put(bid, data)
            except Exception as exc:  # handed to every waiter; logged by the FUSE layer
                flight.error = exc
                data = None
                self._prefetched.pop(bid, None)
            finally:
                if flight.data is None and flight.error is None:  # cancelled at shutdown
                    flight.error = TransientStoreError("fetch cancelled: cachefs is stopping")
                if flight.error is not None or flight.source != "s3":
                    del self._flights[bid]
                flight.event.set()
            if flight.error is None and flight.source == "s3":
                # The flight stays registered until the block is on disk: evicted from
                # memory meanwhile, it must still not be fetched a second time.
                try:
                    await self.cache.put(bid, data)  # type: ignore[arg-type]
                finally:
                    del self._flights[bid]
        finally:
            if reserved:
                self.budget.release(reserved)
            self._pending -= 1
            if not self._pending:
                self._idle.set()

    async def _fetch(self, obj: ObjectVersion, index: int, prefetch: bool) -> bytes:
        start = index * self.block_size
        end = start + self.block_len(obj, index)
        metrics.INFLIGHT_FETCHES.inc()
        try:
            if prefetch:
                async with self._prefetch_limiter:
                    data = await self._get_range(obj, start, end)
                metrics.PREFETCH_ISSUED_BYTES.inc(len(data))
                return data
            return await self._get_range(obj, start, end)
        finally:
            metrics.INFLIGHT_FETCHES.dec()

    async def _get_range(self, obj: ObjectVersion, start: int, end: int) -> bytes:
        return await trio.to_thread.run_sync(
            self.store.get_range, obj.key, obj.etag, start, end, limiter=self._s3_limiter)
