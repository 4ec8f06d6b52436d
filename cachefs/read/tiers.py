"""Cache tiers: the places a block may already be, tried in order before the origin.

A tier answers for blocks named by a :class:`BlockRef` (an object version, the
block's index and length, and its 24-byte id). The contract, as in Mountpoint
for S3's data cache:

* :meth:`Tier.get` returns the block's exact, verified bytes, or None. A miss,
  a corrupt or foreign block and a tier that is down are all None: never an
  error, because S3 (the origin) is the truth and is asked next.
* :meth:`Tier.put` stores a block fetched from below, best effort: it never
  raises, and may refuse (full, busy, down).
* :meth:`Tier.contains` is a cheap residency check that never waits (False when
  the tier cannot tell without a request).
* :meth:`Tier.withdraw` takes back blocks put earlier whose bytes turned out
  wrong (a multi-block object failing S3's full-object CRC, see
  :mod:`cachefs.read.assembled`): the tier must neither keep nor serve them
  afterwards, nor publish them if a write is still pending. Never raises; it
  may start background work owned by the tier (a shared tier's deletes).
* :attr:`Tier.name` labels the tier in metrics ("memory", "disk", "shared").

The fetcher (:mod:`cachefs.read.fetcher`) walks memory, then each tier of
its list in order, then the origin; a block found below a tier is put into
every tier above it. Implementations: :class:`MemoryTier` (verified blocks in
RAM, bounded) and :class:`DiskTier` (the local block cache) here; a shared
in-region tier is another implementation of the same protocol.

Concurrency: tiers are called on the trio thread; ``get``/``put`` may await
worker threads of their own. :meth:`DiskTier.put_now` is the exception: the
fetcher calls it in the S3 worker thread that fetched a whole object. The
memory tier is also read (and filled with blocks read from disk) by the FUSE
request workers: its methods take its own lock.
"""

from __future__ import annotations

import dataclasses
import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

import trio

if TYPE_CHECKING:
    from cachefs.cache.blocks import BlockCache
    from cachefs.read.fetcher import ObjectVersion


@dataclasses.dataclass(frozen=True, slots=True)
class BlockRef:
    """Block ``index`` (``length`` bytes at ``index * block size``) of ``obj``, id ``bid``."""

    obj: ObjectVersion
    index: int
    length: int
    bid: bytes


class Tier(Protocol):
    name: str

    def contains(self, ref: BlockRef) -> bool:
        ...

    async def get(self, ref: BlockRef) -> bytes | None:
        ...

    async def put(self, ref: BlockRef, data: bytes) -> None:
        ...

    async def withdraw(self, refs: Sequence[BlockRef]) -> None:
        ...


class MemoryTier:
    """Verified blocks in memory, least recently used dropped first (bounded in bytes).

    Synchronous underneath (:meth:`peek`, :meth:`store`): the fetcher's fast path
    answers from here without a task switch.
    """

    name = "memory"

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.used = 0
        self._blocks: OrderedDict[bytes, bytes] = OrderedDict()
        self._lock = threading.Lock()

    def peek(self, bid: bytes) -> bytes | None:
        with self._lock:
            data = self._blocks.get(bid)
            if data is not None:
                self._blocks.move_to_end(bid)
            return data

    def store(self, bid: bytes, data: bytes) -> None:
        if len(data) > self.capacity:
            return
        with self._lock:
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

    def discard(self, bid: bytes) -> None:
        with self._lock:
            old = self._blocks.pop(bid, None)
            if old is not None:
                self.used -= len(old)

    def contains(self, ref: BlockRef) -> bool:
        return ref.bid in self._blocks

    async def get(self, ref: BlockRef) -> bytes | None:
        return self.peek(ref.bid)

    async def put(self, ref: BlockRef, data: bytes) -> None:
        self.store(ref.bid, data)

    async def withdraw(self, refs: Sequence[BlockRef]) -> None:
        for ref in refs:
            self.discard(ref.bid)


class DiskTier:
    """The local block cache (:class:`~cachefs.cache.blocks.BlockCache`) as a tier."""

    name = "disk"

    def __init__(self, cache: BlockCache) -> None:
        self.cache = cache

    def contains(self, ref: BlockRef) -> bool:
        return self.cache.contains(ref.bid)

    async def get(self, ref: BlockRef) -> bytes | None:
        return await self.cache.get(ref.bid)

    async def put(self, ref: BlockRef, data: bytes) -> None:
        await self.cache.put(ref.bid, data)

    def put_now(self, ref: BlockRef, data: bytes) -> bool:
        """:meth:`put` on the calling worker thread (the S3 thread that fetched the
        block, see :meth:`cachefs.read.fetcher.Fetcher`): whether it was stored."""
        return self.cache.put_now(ref.bid, data)

    async def withdraw(self, refs: Sequence[BlockRef]) -> None:
        # A miss next time; pinned objects' bytes are released at unpin.
        await trio.to_thread.run_sync(self.cache.drop, [ref.bid for ref in refs])
