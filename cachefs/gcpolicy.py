"""The cyclic garbage collector's settings for a serving daemon.

CPython's cyclic collector runs a young collection every 700 net container
allocations and traverses every tracked object on a full one. A serving daemon
allocates a few dozen containers per request (headers, tuples, frames of
coroutines) that nearly all die by reference counting, and holds ~90,000
long-lived objects from start-up (botocore's service models, prometheus_client,
trio, the modules themselves). Over a cold pass of 1,200 small files
(benchmarks/RESULTS.md, twelfth round) the collector took ~135 ms of the
daemon's CPU, the interpreter lock held throughout: ~120 young, 11 middle and
one full collection, the full one alone 88 ms, a stall of every FUSE request
and S3 thread. With these settings: ~15 young and one middle collection,
40-75 ms in all, the longest 13-40 ms.

:func:`settle_after_startup`, called once the mount is up:

* ``gc.freeze()`` moves everything alive after start-up to the permanent
  generation: full collections never traverse it again (it is not garbage:
  it lives as long as the daemon);
* raises the young generation's threshold to :data:`YOUNG_THRESHOLD`, so a
  young collection runs about every hundred requests instead of every few.
  Higher saves little more and lengthens each pause (20,000: 7-23 ms per young
  collection). What a cycle holds is freed later than before, at most that
  many allocations later: a bounded delay, a MiB or so.

The collector stays enabled: cycles (a traceback held by an exception, a
closure referring to itself) are still freed.
"""

from __future__ import annotations

import gc

#: Net container allocations between young collections (CPython's default: 700).
YOUNG_THRESHOLD = 5_000
#: Young collections between middle ones, and middle between full (defaults: 10, 10).
OLDER_THRESHOLD = 10


def settle_after_startup() -> None:
    """Freeze what start-up allocated and space young collections out (see the module
    docstring). Call once, on any thread, after the daemon's long-lived state exists."""
    gc.collect()  # (what start-up left as garbage is not frozen with the rest)
    gc.freeze()
    gc.set_threshold(YOUNG_THRESHOLD, OLDER_THRESHOLD, OLDER_THRESHOLD)
