"""One lock per cache object, held by threads that write, release or re-check its file.

A fixed array of striped locks shares a lock between unrelated objects: a thread
verifying one object's file then waits for another object's block write, and that
write holds its lock across the LMDB write transaction (one writer at a time), so
with a cold pass's hundreds of writes in flight most stripes are held by a writer
queued on the index. :class:`ObjectLocks` excludes only threads working on the same
object. A lock exists only while a thread holds it or waits for it: the table is
bounded by the threads, not by the objects.

Concurrency: ``_guard`` protects the table and is held only for a dict operation and
a counter update; the object's own lock is taken after ``_guard`` is released, so a
thread waiting for one object never delays threads working on others.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager


class _Slot:
    __slots__ = ("lock", "users")

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.users = 0  # threads holding or waiting for it


class ObjectLocks:
    """Mutual exclusion per key (an object id), without false sharing."""

    def __init__(self) -> None:
        self._guard = threading.Lock()
        self._locks: dict[bytes, _Slot] = {}

    @contextmanager
    def hold(self, key: bytes) -> Iterator[None]:
        """Hold ``key``'s lock for the ``with`` block (any thread; waits only for threads
        holding the same key)."""
        with self._guard:
            slot = self._locks.get(key)
            if slot is None:
                slot = self._locks[key] = _Slot()
            slot.users += 1
        try:
            with slot.lock:
                yield
        finally:
            with self._guard:
                slot.users -= 1
                if slot.users == 0:
                    del self._locks[key]

    def __len__(self) -> int:
        """Keys held or waited for now."""
        return len(self._locks)
