"""FUSE passthrough: the kernel reads fully cached objects straight from their cache file.

When the pyfuse3 build offers it (``pyfuse3.passthrough_open``: libfuse >= 3.16,
see third_party/), the kernel has it (Linux >= 6.9) and the daemon holds
CAP_SYS_ADMIN, an open of an object whose every block is cached is answered
with a *backing id* for the object's cache file. The kernel then serves
``read()`` on that handle from the file itself, page cache included, and the
daemon sees no read request for it: warm reads cost what local disk reads cost.

Contracts:

* A cache file is handed to the kernel only after every block of the object
  passed its length and checksum test in this open (the test every daemon
  read makes). Verifying reads the whole file, which also leaves it in the
  page cache, where the kernel's reads then find it. Objects larger than
  :data:`MAX_OBJECT_BYTES` are never passed through: verifying them at open
  would cost more than a reader of a few samples reads.
* While a backing is open its object is pinned in the block cache: its
  blocks are not evicted (an evicted block's hole would read as zeros).
* The kernel allows one I/O mode per inode at a time: while an inode has
  handles served by the daemon, no passthrough is granted; while it has a
  backing, every new open shares it (one backing per inode, counted by opens,
  closed at the last release). A new version of the object seen while the
  old one is passed through is served to new opens only after the old
  handles close (the kernel cannot mix the modes).
* If the kernel refuses a backing (no CAP_SYS_ADMIN, passthrough not
  negotiated), passthrough is switched off for the mount, logged once, and
  reads go through the daemon as before.

Concurrency: methods run on the trio thread, which alone touches ``_by_ino``
and ``_direct``. Verification and the backing ioctl run in a worker thread;
concurrent opens of one inode wait for the first one's verification, so an
object is verified once per burst of opens.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import Any

import pyfuse3
import trio

from cachefs import metrics
from cachefs.blockcache import BlockCache
from cachefs.fetcher import Fetcher, ObjectVersion

log = logging.getLogger(__name__)

#: Larger objects are served by the daemon: verifying them whole at every open
#: would cost a random reader more than it reads.
MAX_OBJECT_BYTES = 1 << 30


# Only the passthrough build of pyfuse3 (third_party/) has these functions.
_pyfuse3: Any = pyfuse3


def supported() -> bool:
    """Whether this pyfuse3 build can hand files to the kernel."""
    return hasattr(_pyfuse3, "passthrough_open")


@dataclasses.dataclass(slots=True)
class _Backing:
    oid: bytes
    ready: trio.Event
    backing_id: int = 0
    opens: int = 0


class Passthrough:
    """Decides per open whether the kernel reads the cache file itself, and keeps the
    backing files of passed-through inodes."""

    def __init__(self, fetcher: Fetcher, cache: BlockCache, *, enabled: bool,
                 limiter: trio.CapacityLimiter | None = None) -> None:
        self.fetcher = fetcher
        self.cache = cache
        self.enabled = enabled and supported()
        self._limiter = limiter
        self._by_ino: dict[int, _Backing] = {}
        self._direct: dict[int, int] = {}  # handles served by the daemon, per inode
        metrics.PASSTHROUGH_ENABLED.set(1 if self.enabled else 0)

    async def open(self, ino: int, obj: ObjectVersion) -> int:
        """A backing id for a new handle of ``ino`` (the kernel reads it), or 0 (the
        daemon serves its reads). Every open must be matched by :meth:`release` with
        the same answer."""
        while True:
            held = self._by_ino.get(ino)
            if held is None:
                break
            await held.ready.wait()
            if self._by_ino.get(ino) is held and held.backing_id:
                held.opens += 1
                metrics.PASSTHROUGH_OPENS.inc()
                return held.backing_id
            # The backing failed or was closed meanwhile: decide afresh.
        reason = self._decline_reason(ino, obj)
        if reason is not None:
            return self._direct_open(ino, reason)
        bids = [self.fetcher.block_id(obj, i) for i in range(self.fetcher.block_count(obj))]
        oid = bids[0][:16]
        backing = _Backing(oid, trio.Event())
        self._by_ino[ino] = backing
        try:
            backing.backing_id, error = await trio.to_thread.run_sync(
                self._attach, oid, bids, limiter=self._limiter)
        finally:
            if backing.backing_id:
                backing.opens = 1
                metrics.PASSTHROUGH_BACKINGS.inc()
            else:
                del self._by_ino[ino]
            backing.ready.set()
        if backing.backing_id:
            metrics.PASSTHROUGH_OPENS.inc()
            self.fetcher.mark_used(bids)
            return backing.backing_id
        if error is not None:
            self._switch_off(error)
            return self._direct_open(ino, "refused")
        return self._direct_open(ino, "unverified")

    def release(self, ino: int, backing_id: int) -> None:
        """The handle opened with answer ``backing_id`` is closed."""
        if not backing_id:
            n = self._direct.get(ino, 0) - 1
            if n > 0:
                self._direct[ino] = n
            else:
                self._direct.pop(ino, None)
            return
        backing = self._by_ino.get(ino)
        if backing is None or backing.backing_id != backing_id:
            log.warning("release of unknown passthrough backing %d (inode %d)", backing_id, ino)
            return
        backing.opens -= 1
        if backing.opens > 0:
            return
        del self._by_ino[ino]
        metrics.PASSTHROUGH_BACKINGS.dec()
        try:
            # An ioctl that drops the kernel's reference to the file: no I/O, no wait.
            _pyfuse3.passthrough_close(backing_id)
        except OSError as exc:
            log.warning("cannot close passthrough backing %d: %s", backing_id, exc.strerror)
        self.cache.unpin(backing.oid)

    @property
    def backings(self) -> int:
        return len(self._by_ino)

    # -- internals -------------------------------------------------------------------------
    def _decline_reason(self, ino: int, obj: ObjectVersion) -> str | None:
        if not self.enabled:
            return "off"
        if self._direct.get(ino):
            return "open_direct"  # the kernel would refuse the other mode
        if obj.size == 0 or obj.size > MAX_OBJECT_BYTES:
            return "size"
        bids = [self.fetcher.block_id(obj, i) for i in range(self.fetcher.block_count(obj))]
        if not self.cache.contains_all(bids):
            return "not_cached"
        return None

    def _direct_open(self, ino: int, reason: str) -> int:
        self._direct[ino] = self._direct.get(ino, 0) + 1
        if reason != "off":
            metrics.PASSTHROUGH_DECLINED.labels(reason).inc()
        return 0

    def _attach(self, oid: bytes, bids: list[bytes]) -> tuple[int, OSError | None]:
        """Pin, verify and register the object's file with the kernel (worker thread)."""
        self.cache.pin(oid)  # before verifying: no eviction may punch a verified block
        try:
            verified = self.cache.verify_object(bids)
            if verified is None:
                self.cache.unpin(oid)
                return 0, None
            try:
                fd = os.open(self.cache.object_path(oid), os.O_RDONLY)
                try:
                    backing_id = int(_pyfuse3.passthrough_open(fd))
                finally:
                    os.close(fd)  # the kernel holds its own reference to the file
            except OSError as exc:
                self.cache.unpin(oid)
                return 0, exc
        except BaseException:
            self.cache.unpin(oid)
            raise
        metrics.CACHE_HIT_BYTES.inc(verified)
        return backing_id, None

    def _switch_off(self, error: OSError) -> None:
        if self.enabled:
            self.enabled = False
            metrics.PASSTHROUGH_ENABLED.set(0)
            log.warning("FUSE passthrough unavailable (%s): cachefs serves reads itself",
                        error.strerror or error)


def status(pt: Passthrough | None) -> dict[str, Any]:
    """What ``cachefs status`` shows about passthrough."""
    if pt is None:
        return {"enabled": False, "backing_files": 0}
    return {"enabled": pt.enabled, "backing_files": pt.backings}
