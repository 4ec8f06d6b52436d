"""The memory budget for block data held by the fetch pipeline.

Every block fetched from S3 holds a reservation from the moment its GET is
issued until it has been written to the disk cache. Prefetch waits for room
(or is skipped); demand reads never wait, so a full budget cannot deadlock a
reader that itself holds reservations. Demand overdraft is bounded by the
number of concurrent FUSE requests times the block size.

Trio-thread only (no locks needed). The in-flight gauge reads ``used`` when metrics
are collected (any thread: one attribute read), so a reservation or release writes no
metric (two prometheus-client ``set`` calls, each under its lock, per cold small file on
the trio thread); a release wakes waiters only when there are some.
"""

from __future__ import annotations

import trio

from cachefs import metrics


class MemoryBudget:
    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0
        self._changed = trio.Event()
        self._waiting = 0  # tasks in reserve() waiting for room
        metrics.INFLIGHT_BUDGET_BYTES.set(limit)
        metrics.INFLIGHT_BYTES.set_function(lambda: self.used)

    def try_reserve(self, n: int) -> bool:
        """Reserve ``n`` bytes if they fit; never waits (used by prefetch)."""
        if self.used + n > self.limit:
            return False
        self.used += n
        return True

    async def reserve(self, n: int) -> None:
        """Reserve ``n`` bytes, waiting until they fit (background work such as warming)."""
        while self.used + n > self.limit and self.used > 0:
            self._waiting += 1
            try:
                await self._changed.wait()
            finally:
                self._waiting -= 1
        self.used += n

    def force_reserve(self, n: int) -> None:
        """Reserve ``n`` bytes even past the limit (demand reads)."""
        self.used += n

    def release(self, n: int) -> None:
        self.used -= n
        if self._waiting:
            self._changed.set()
            self._changed = trio.Event()
