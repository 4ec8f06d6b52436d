"""Per-handle readahead: detect sequential reads and fetch the blocks ahead.

A :class:`ReadStream` belongs to one open file handle and sees every read of
it. While reads stay sequential (within a tolerance that absorbs the kernel's
readahead jitter and small seeks: up to ``BACKWARD_TOLERANCE`` back or
``FORWARD_TOLERANCE`` forward of where the last read ended), the window of
blocks fetched ahead doubles each time the reader enters a new block, up to
``max_window`` bytes. Any other read resets the window, so a random reader
never pays for readahead beyond ``initial_window`` at offset 0 (whole-file
readers such as DataLoader workers start there). A run that begins elsewhere
opens its window only once it has read more than ``RANDOM_RUN`` bytes, and only
while it has read at least half of the bytes it spans; until then it is
:attr:`ReadStream.random` (the fetcher may answer it with pieces). The second rule
is for random readers whose reads land within the forward tolerance of each other
(page faults a few MiB apart, or processes sharing one descriptor of a small file):
they skip more than they read, where the kernel's readahead, however out of order
its READs arrive, fills every hole it leaves.

Pure logic, no I/O: :meth:`ReadStream.on_read` returns the block indices to
prefetch; :meth:`cachefs.read.prefetcher.Prefetcher.on_read` hands them to the
prefetcher's admission rule, which skips resident blocks and respects the memory budget.
"""

from __future__ import annotations

FORWARD_TOLERANCE = 16 << 20
BACKWARD_TOLERANCE = 1 << 20
#: A run of reads in order that began at a random offset opens a window (and stops being
#: random) only once it has read more than this: a page fault of a memory map reads the
#: kernel's read-around (the mount's --read-ahead, 1 MiB by default) as a short run of
#: READs in order, and a random reader of a memory map is no sequential reader.
RANDOM_RUN = 1 << 20


class ReadStream:
    def __init__(self, *, size: int, block_size: int, max_window: int,
                 initial_window: int | None = None) -> None:
        self.size = size
        self.block_size = block_size
        self.max_window = max(block_size, max_window)
        self.initial_window = block_size if initial_window is None else initial_window
        self.window = 0
        self._next = 0  # where the previous read ended
        self._block = -1  # the block the previous read ended in
        self._reads = 0
        #: Blocks below this index were already handed to the prefetcher by this stream
        #: (the caller advances it); reads re-issue nothing the stream already asked for.
        self.issued_until = 0
        #: The last read was random: part of a run of reads in order that began neither
        #: at offset 0 nor where the read before ended (within the tolerances), and has
        #: read at most RANDOM_RUN bytes so far or less than half of the bytes it spans.
        self.random = False
        self._run = 0  # bytes read in order since the run began; -1: it began at offset 0
        self._run_from = 0  # where the run began
        self._run_to = 0  # the furthest end of a read of the run

    def on_read(self, offset: int, size: int) -> range:
        """Record a read; return the block indices worth fetching ahead of it."""
        end = min(offset + size, self.size)
        sequential = (self._reads > 0 and
                      self._next - BACKWARD_TOLERANCE <= offset <= self._next + FORWARD_TOLERANCE)
        self._reads += 1
        if not sequential:
            self._run = -1 if offset == 0 else max(0, end - offset)
            self._run_from, self._run_to = offset, end
        elif self._run >= 0:
            self._run += max(0, end - offset)
            self._run_to = max(self._run_to, end)
        self.random = self._run >= 0 and (self._run <= RANDOM_RUN or
                                          2 * self._run < self._run_to - self._run_from)
        if sequential:
            end_block = max(end - 1, 0) // self.block_size
            if end_block != self._block and not self.random:
                self.window = min(self.max_window,
                                  max(self.window * 2, self.initial_window, self.block_size))
        elif offset == 0:
            self.window = self.initial_window
            self.issued_until = 0
        else:
            self.window = 0
            self.issued_until = 0
        self._next = end
        self._block = max(end - 1, 0) // self.block_size
        if self.window <= 0 or end >= self.size:
            return range(0)
        first = (end + self.block_size - 1) // self.block_size  # first block not yet asked for
        last_byte = min(self.size, end + self.window) - 1
        last = last_byte // self.block_size
        return range(max(first, self.issued_until), last + 1)
