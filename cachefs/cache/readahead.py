"""Page-cache readahead of cache files, ahead of the reads a policy predicts.

A block on local disk that a reader is about to take is read from its cache file
on the reader's critical path: by a FUSE request worker (open, pread, verify) or,
with passthrough, by the kernel inside the reader's own read. Either way it is one
synchronous disk read per file, and no more of them run at once than there are
request workers (two) or readers. Over a dataset larger than the memory tier, a
warm pass without passthrough spent 31% of its workers' time waiting in ``pread``.

When the directory lookahead predicts files that are on local disk,
:class:`DiskReadahead` asks the kernel to read their bytes into the page cache
now: ``posix_fadvise(POSIX_FADV_WILLNEED)`` starts the reads and returns, so
many files are read at once and the reads that follow find memory. Nothing is
read into the daemon (no memory budget, no hand-over to the request loop) and
nothing is trusted: the page cache holds the file's bytes, and the read that
follows verifies them exactly as it would have from the disk.

Advice is best-effort: a request that finds the queue full is dropped, one whose
file is gone (evicted meanwhile) is skipped, and neither is an error. Each is
counted in ``cachefs_disk_readahead_total{outcome}`` (advised, missing, dropped).

Concurrency: :meth:`DiskReadahead.advise` may be called on any thread and never
waits (one append to a deque under ``_cond``, bounded at ``queue_size``
requests). :meth:`DiskReadahead.run` owns the threads that take requests and
advise the kernel (an open, a fadvise, a close: they may wait on the disk, so
never on the request loop); they are stopped and joined before it returns, each
finishing the request in hand.
"""

from __future__ import annotations

import os
import threading
from collections import deque

import trio

from cachefs import metrics
from cachefs.background import own_threads

#: Requests waiting at most: a walk's window of files (up to 256) with room to spare.
QUEUE = 512
#: Threads advising the kernel. The advice only starts reads, so two keep up with a
#: walk; more would only contend for the two cores with the request workers.
THREADS = 2

_ADVISED = metrics.DISK_READAHEAD.labels("advised")
_MISSING = metrics.DISK_READAHEAD.labels("missing")
_DROPPED = metrics.DISK_READAHEAD.labels("dropped")


class DiskReadahead:
    """Starts the kernel reading cache files into the page cache (see the module
    docstring)."""

    def __init__(self, queue_size: int = QUEUE) -> None:
        self.queue_size = queue_size
        self._queue: deque[tuple[str, int, int]] = deque()  # (path, offset, length)
        self._cond = threading.Condition(threading.Lock())
        self._running = False  # while run() runs (its threads take requests)

    def advise(self, path: os.PathLike[str] | str, offset: int, length: int) -> None:
        """Have bytes ``[offset, offset+length)`` of file ``path`` read into the page
        cache soon (any thread; never waits). Dropped when the queue is full or
        :meth:`run` is not running."""
        with self._cond:
            if not self._running or len(self._queue) >= self.queue_size:
                _DROPPED.inc()
                return
            self._queue.append((os.fspath(path), offset, length))
            if len(self._queue) == 1:
                # (a walk predicts files in batches: one wake-up per batch, not per file)
                self._cond.notify()

    def pending(self) -> int:
        """Requests waiting for a thread (any thread)."""
        return len(self._queue)

    async def run(self, *, threads: int = THREADS,
                  task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Advise the kernel on ``threads`` threads of its own until cancelled; they are
        stopped and joined before this returns."""
        with self._cond:
            self._running = True
        await own_threads(self._loop, threads, "cachefs-readahead", stop=self._stop,
                          task_status=task_status)

    def _stop(self) -> None:
        with self._cond:
            self._running = False
            self._queue.clear()
            self._cond.notify_all()

    def _loop(self) -> None:
        while True:
            with self._cond:
                while self._running and not self._queue:
                    self._cond.wait()
                if not self._running:
                    return
                path, offset, length = self._queue.popleft()
                if self._queue:
                    self._cond.notify()  # another thread takes the next one meanwhile
            _advise_willneed(path, offset, length)


def _advise_willneed(path: str, offset: int, length: int) -> None:
    """Start reading ``[offset, offset+length)`` of ``path`` into the page cache."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        _MISSING.inc()  # evicted meanwhile (or unreadable: the read that follows says so)
        return
    try:
        os.posix_fadvise(fd, offset, length, os.POSIX_FADV_WILLNEED)
        _ADVISED.inc()
    except OSError:
        _MISSING.inc()
    finally:
        os.close(fd)

