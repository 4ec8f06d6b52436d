"""Keeping the C heap small: few malloc arenas, and free memory given back to the system.

Blocks are allocated and freed by the C allocator (a 4 MiB block's bytes, a GET's
receive buffer), mostly in the S3 worker threads. glibc's malloc keeps what a program
frees for reuse: each thread allocates from one of up to 8 arenas per core, and after
the first large buffer it frees, it raises its mmap threshold (up to 32 MiB), so later
blocks come from the arenas and their pages stay with the process once freed, unless
they happen to sit at the top of an arena. A burst of reads therefore leaves the
daemon's resident memory at its peak for good: 48 readers at random offsets of a
512 MB object with 16 MiB blocks peaked at 400-500 MB and still held 350 MB once every
read had ended, where one reader needs 70 MB (benchmarks/RESULTS.md, twenty-third
round); to an on-call engineer that is a leak.

:func:`limit_arenas`, called before the daemon starts its threads, caps the arenas at
:data:`ARENAS`: fewer arenas hold fewer freed blocks between reuses. The same burst then
peaked at 266 MB and held 136 MB once it ended. Threads allocating at once share those
arenas' locks; the interpreter lock already serialises most of their allocations.

:func:`release_free_memory` calls glibc's ``malloc_trim(0)``, which returns the free
pages of every arena (not only their tops) with ``madvise``. Nothing allocated moves and
nothing is freed that is in use; the next allocation that needs those pages takes them
again (a page fault each). The daemon's maintenance loop calls it once the mount goes
quiet after use (a second without activity), and every :data:`TRIM_INTERVAL` seconds
while it stays busy (``cachefs.daemon``). A fixed
mmap threshold would return a block's memory at each free instead, at the cost of a
fresh mapping and a page fault per 4 KiB for every block (about a millisecond of CPU
for each 4 MiB one): far more than a trim every half minute.

With both, that burst's daemon held 102 MB half a minute after it ended. On a C library
without ``mallopt`` and ``malloc_trim`` (musl) both do nothing.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable

#: malloc arenas at most (glibc's default: 8 per core).
ARENAS = 2
_M_ARENA_MAX = -8  # mallopt's parameter number (malloc.h)
#: Seconds between trims while the mount stays busy (a quiet mount is trimmed at once,
#: once after each use).
TRIM_INTERVAL = 30.0


def _libc_function(name: str, *argtypes: type) -> Callable[..., int] | None:
    try:
        function = getattr(ctypes.CDLL(None), name)
    except (OSError, AttributeError):  # not glibc: nothing to call
        return None
    function.argtypes = argtypes
    function.restype = ctypes.c_int
    return function  # type: ignore[no-any-return]


_malloc_trim = _libc_function("malloc_trim", ctypes.c_size_t)
_mallopt = _libc_function("mallopt", ctypes.c_int, ctypes.c_int)


def limit_arenas(arenas: int = ARENAS) -> bool:
    """Cap the C heap's arenas at ``arenas``; True if the C library took it. Call before
    the process starts threads: an arena a thread already made stays."""
    if _mallopt is None:
        return False
    return bool(_mallopt(_M_ARENA_MAX, arenas))


def release_free_memory() -> bool:
    """Return the free pages of every malloc arena to the system; True if any were.

    Blocks its thread while it walks the arenas (milliseconds; each arena's lock is held
    in turn, so a thread allocating from that arena waits): call it from a worker thread,
    never from the trio thread. The interpreter lock is let go meanwhile (a ctypes call).
    """
    if _malloc_trim is None:
        return False
    return bool(_malloc_trim(0))
