"""Multi-block objects checked against S3's full-object CRC once all their blocks are cached.

A block of an object larger than one block comes from a ranged GET, and S3
states no checksum for a range. Where S3 keeps a full-object CRC of the
object (CRC64NVME, S3's default for new objects, or CRC32/CRC32C), it is
asked for once per object version (a HEAD with checksum mode, sent in the
background when the object's first block is fetched in this session); each
block's CRC is computed in the worker thread that received it; and once every
block of the object has landed, the block CRCs are combined (CRC(A || B) from
CRC(A), CRC(B) and len(B): no block is read twice) and compared with S3's.

On a mismatch some block was altered in transit: every block of the object
is withdrawn from every tier (memory, the disk cache, and a shared tier,
which drops pending publishes and deletes what it published, see
:meth:`cachefs.read.tiers.Tier.withdraw`), counted
(``cachefs_s3_integrity_errors_total{check="combined_<crc>"}``) and logged,
and is fetched again when next read. Readers may already have been given
those bytes: the bytes of ranged reads rely on TLS in transit; this check
keeps altered bytes from staying in the caches.

Blocks already on disk when the object's tracker started (cached in an
earlier session, or fetched before S3's checksum was known) and blocks that
came from a shared tier (published by another node) have no CRC: when the
rest is complete their bytes are read back from the cache once. So on a
mismatch every block is withdrawn whichever node's fetch altered it.

Bounds: trackers for at most :data:`TRACKED` object versions (least recently
used dropped), each holding one integer per block. Everything runs on the
trio thread except the CRCs of blocks read back from disk (worker threads).
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

import trio

from cachefs import metrics
from cachefs.cache.blocks import BlockCache
from cachefs.errors import StoreError
from cachefs.s3 import integrity
from cachefs.s3.integrity import Checksum
from cachefs.s3.origin import Origin

if TYPE_CHECKING:
    from cachefs.read.fetcher import ObjectVersion

log = logging.getLogger(__name__)

TRACKED = 4096


class _Tracker:
    """What is known about one object version's blocks."""

    __slots__ = ("checking", "checksum", "crcs", "pending", "ready")

    def __init__(self, pending: set[int]) -> None:
        self.ready = False  # S3 has answered the HEAD
        self.checksum: Checksum | None = None
        self.crcs: dict[int, int] = {}  # block index -> CRC of the bytes that landed
        self.pending = pending  # blocks not cached yet
        self.checking = False


class AssembledChecks:
    """Full-object CRC checks of multi-block objects (see the module docstring)."""

    def __init__(self, origin: Origin, cache: BlockCache, *, block_size: int,
                 block_ids: Callable[[ObjectVersion], list[bytes]],
                 withdraw: Callable[[ObjectVersion, list[bytes]], Awaitable[None]]) -> None:
        self._origin = origin
        self._cache = cache
        self._block_size = block_size
        self._block_ids = block_ids
        self._withdraw = withdraw  # takes blocks back from every tier
        self._trackers: OrderedDict[tuple[str, str], _Tracker] = OrderedDict()
        self._nursery: trio.Nursery | None = None

    def attach(self, nursery: trio.Nursery) -> None:
        """The nursery HEADs and checks run in (the fetcher's)."""
        self._nursery = nursery

    def crc_kind(self, obj: ObjectVersion) -> str | None:
        """The CRC to compute for a block of ``obj`` being fetched now, if S3's checksum
        is already known. The first call for a version asks S3 for it (HEAD, in the
        background)."""
        ident = (obj.key, obj.etag)
        tracker = self._trackers.get(ident)
        if tracker is None:
            bids = self._block_ids(obj)
            pending = {i for i, bid in enumerate(bids) if not self._cache.contains(bid)}
            tracker = self._trackers[ident] = _Tracker(pending)
            while len(self._trackers) > TRACKED:
                self._trackers.popitem(last=False)
            assert self._nursery is not None
            self._nursery.start_soon(self._ask, obj, tracker)
        else:
            self._trackers.move_to_end(ident)
        if tracker.checksum is None:
            return None
        return tracker.checksum.kind

    async def _ask(self, obj: ObjectVersion, tracker: _Tracker) -> None:
        try:
            checksum = await self._origin.full_checksum(obj.key, obj.etag)
        except StoreError as exc:  # the reads themselves will meet the same trouble
            log.debug("no full-object checksum for %s: %s", obj.key, exc)
            checksum = None
        tracker.ready = True
        if checksum is not None and checksum.combinable:
            tracker.checksum = checksum
            self._maybe_check(obj, tracker)

    def landed(self, obj: ObjectVersion, index: int, crc: int | None) -> None:
        """Block ``index`` of ``obj`` arrived from S3 (or from a tier below the disk, e.g.
        the shared tier) and was offered to the cache; ``crc`` is its CRC of the kind
        :meth:`crc_kind` named then (None: not known then, or not from S3). Objects without
        a tracker (none of their blocks fetched from S3 in this session) are ignored."""
        tracker = self._trackers.get((obj.key, obj.etag))
        if tracker is None:
            return
        tracker.pending.discard(index)
        if crc is None or tracker.checksum is None:
            tracker.crcs.pop(index, None)  # read back from disk when the rest is there
        else:
            tracker.crcs[index] = crc
        self._maybe_check(obj, tracker)

    def _maybe_check(self, obj: ObjectVersion, tracker: _Tracker) -> None:
        if tracker.pending or tracker.checking or tracker.checksum is None:
            return
        tracker.checking = True
        assert self._nursery is not None
        self._nursery.start_soon(self._check, obj, tracker)

    async def _check(self, obj: ObjectVersion, tracker: _Tracker) -> None:
        try:
            await self._check_once(obj, tracker)
        finally:
            tracker.checking = False

    async def _check_once(self, obj: ObjectVersion, tracker: _Tracker) -> None:
        checksum = tracker.checksum
        assert checksum is not None
        kind = checksum.kind
        bids = self._block_ids(obj)
        for i, bid in enumerate(bids):
            if i in tracker.crcs:
                continue
            data = await self._cache.get(bid)
            if data is None:  # evicted meanwhile: checked when it lands again
                tracker.pending.add(i)
                return
            tracker.crcs[i] = await trio.to_thread.run_sync(integrity.crc, kind, data)
        combined = tracker.crcs[0]
        for i in range(1, len(bids)):
            length = min(self._block_size, obj.size - i * self._block_size)
            combined = integrity.combine(kind, combined, tracker.crcs[i], length)
        if combined == checksum.crc:
            metrics.S3_ASSEMBLED_CHECKS.labels("ok").inc()
            return
        metrics.S3_ASSEMBLED_CHECKS.labels("mismatch").inc()
        metrics.S3_INTEGRITY_ERRORS.labels(f"combined_{kind}").inc()
        log.warning("s3://%s/%s: its %d blocks disagree with the object's %s (%x != %x): "
                    "altered in transit; dropping them from the caches", self._origin.bucket,
                    obj.key, len(bids), kind, combined, checksum.crc)
        await self._withdraw(obj, bids)
        tracker.crcs.clear()
        tracker.pending = set(range(len(bids)))
