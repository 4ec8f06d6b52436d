"""The publish queue of the shared tier: blocks waiting to be written, bounded in bytes.

Blocks fetched from the origin are offered here by the fetcher's write-back
(:meth:`cachefs.read.shared.SharedTier.put`); the tier's publisher tasks take
them in order. :meth:`PublishQueue.offer` never waits: when the queue is full
the block is dropped (the caller counts it) and the reader is never delayed,
with one exception that keeps leases useful: a block this node holds the fetch
lease of (other nodes are waiting for it) displaces the oldest unleased block.

A block stays known to the queue (:meth:`pending`) from ``offer`` until its
publisher calls :meth:`finish`, so a second offer of the same key is a no-op
and ``cachefs warm --shard`` can wait for the outcome (:attr:`Publish.done`).

Concurrency: trio thread only.
"""

from __future__ import annotations

import dataclasses
from collections import deque

import trio

from cachefs import metrics
from cachefs.read.tiers import BlockRef


@dataclasses.dataclass(eq=False)
class Publish:
    """One block to write to the shared tier under ``key``."""

    key: str
    ref: BlockRef
    data: bytes
    overwrite: bool = False  # the key holds a corrupt or foreign object: replace it
    leased: bool = False  # this node won the fetch lease: other nodes wait for it
    done: trio.Event = dataclasses.field(default_factory=trio.Event)
    stored: bool = False  # outcome: the block is in the shared tier (written or present)
    withdrawn: bool = False  # its bytes failed a check: not to be written, or deleted again
    # Why its last write did not store it (SharedTier._publish): "throttled" (the store
    # answered 503/500, or publishing is paused for that), "refused", "failed" (no answer)
    # or "unavailable" (the breaker open, publishing off); "" before any failure
    failure: str = ""


class PublishQueue:
    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.bytes = 0
        self._items: deque[Publish] = deque()
        self._known: dict[str, Publish] = {}  # queued or being published
        self._lot = trio.lowlevel.ParkingLot()
        self._idle = trio.Event()
        self._idle.set()
        metrics.SHARED_QUEUE_CAPACITY.set(capacity)
        self._publish_gauges()

    def __len__(self) -> int:
        return len(self._items)

    def _publish_gauges(self) -> None:
        metrics.SHARED_QUEUE_BYTES.set(self.bytes)
        metrics.SHARED_QUEUE_BLOCKS.set(len(self._items))

    def pending(self, key: str) -> Publish | None:
        """The publish of ``key`` queued or in progress, if any."""
        return self._known.get(key)

    def offer(self, item: Publish) -> bool:
        """Queue ``item`` unless the queue is full; never waits. True when queued (or the
        same key already is)."""
        if item.key in self._known:
            return True
        n = len(item.data)
        if n > self.capacity:
            return False
        while self.bytes + n > self.capacity:
            if not item.leased or not self._drop_oldest_unleased():
                return False
        self._items.append(item)
        self._known[item.key] = item
        self.bytes += n
        self._idle = trio.Event() if self._idle.is_set() else self._idle
        self._lot.unpark()
        self._publish_gauges()
        return True

    def _drop_oldest_unleased(self) -> bool:
        for victim in self._items:
            if not victim.leased:
                self._items.remove(victim)
                self.bytes -= len(victim.data)
                metrics.SHARED_PUBLISHES.labels("dropped_full").inc()
                self._forget(victim)
                return True
        return False

    def withdraw(self, key: str) -> Publish | None:
        """Withdraw the publish of ``key`` (its bytes failed a check): a queued one leaves the
        queue (done, not stored); one being written is marked :attr:`Publish.withdrawn`, for
        its publisher to delete what it wrote. Returns the one being written, if any."""
        item = self._known.get(key)
        if item is None:
            return None
        item.withdrawn = True
        if item not in self._items:
            return item
        self._items.remove(item)
        self.bytes -= len(item.data)
        self._publish_gauges()
        self.finish(item, False)
        return None

    async def take(self) -> Publish:
        """The oldest queued block (waits for one). The caller must :meth:`finish` it."""
        while not self._items:
            await self._lot.park()
        item = self._items.popleft()
        self.bytes -= len(item.data)
        self._publish_gauges()
        return item

    def finish(self, item: Publish, stored: bool) -> None:
        item.stored = stored
        self._forget(item)

    def _forget(self, item: Publish) -> None:
        if self._known.get(item.key) is item:
            del self._known[item.key]
        item.done.set()
        if not self._known:
            self._idle.set()

    async def wait_idle(self) -> None:
        """Wait until nothing is queued or being published."""
        while self._known:
            await self._idle.wait()
