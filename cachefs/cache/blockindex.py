"""The block index in LMDB: which blocks are cached, their checksums, and eviction.

Schema (databases of :class:`~cachefs.cache.lmdbenv.LmdbEnv`):

* ``blocks``  block id -> (length u32, xxh3-64 u64, last use f64)
* ``lru``     last use (big-endian f64, so byte order is time order) + block id -> ""
* ``meta``    ``used_bytes`` (decimal text), ``used_unit`` (decimal text: the allocation
  unit ``used_bytes`` counts in), ``layout`` (the cache layout version)

Accounting: a block is charged the disk space it takes, its length rounded up to the
file system's allocation unit (:func:`~cachefs.cache.objectfiles.allocation`), so the
capacity bounds what the cache files take on disk; the index keeps the true length
(reads check it). Summing lengths let a dataset of tiny files take ~1.5x the capacity.
``used_bytes`` is the sum of the charges of the indexed blocks; an index whose
``used_unit`` is not this one (written by a version that summed lengths, or on a file
system of another unit) is recounted at start (:meth:`BlockIndex.adopt_accounting`).

Eviction policy (:meth:`BlockIndex.put`): ``keep`` admits until the capacity is
reached and then refuses (the optimum for a fresh random permutation every epoch
over a dataset larger than the cache: hit ratio = cache/dataset, where LRU gets
c + (1-c) ln(1-c)); ``lru`` removes the least recently used blocks to make room,
skipping those of pinned objects, in the same write transaction as the admission.
Blocks fetched ahead that no reader took yet get a second chance (made most recently
used instead): a sweep fills free space early in an epoch, and its readers come later;
evicting those blocks first fetched 1.16-1.19x the dataset in a first epoch.

Contracts: lookups (:meth:`entry`, :meth:`entries`, :meth:`contains_all`) are
small synchronous helpers: no transaction outlives them, so no reader slot is
held across an ``await`` (see :mod:`cachefs.cache.lmdbenv`), and any failure to
read the index is reported (:meth:`report_error`: counted, logged at most once a
minute) and answered as a miss. Writes (:meth:`put`, :meth:`remove`,
:meth:`flush_touches`) run in worker threads and raise CacheError. The index
knows nothing of files or locks: :class:`~cachefs.cache.blocks.BlockCache`
orders index writes against file writes and releases.
"""

from __future__ import annotations

import itertools
import logging
import struct
import time
from collections.abc import Callable

from cachefs import failpoints, metrics
from cachefs.cache.blockid import OID_LEN, block_id_at
from cachefs.cache.lmdbenv import LmdbEnv
from cachefs.cache.objectfiles import allocation
from cachefs.errors import CacheError

log = logging.getLogger(__name__)

_BLOCK = struct.Struct("<IQd")  # length, xxh3-64, last use
_LENGTH = struct.Struct("<I")  # (the start of a _BLOCK)
_LRU_TIME = struct.Struct(">d")  # big-endian so byte order == time order (times are > 0)
_USED_KEY = b"used_bytes"
_UNIT_KEY = b"used_unit"
_LAYOUT_KEY = b"layout"
_LAYOUT = b"objects-v2"
POLICIES = ("keep", "lru")
_ERROR_LOG_INTERVAL = 60.0

#: (length, checksum) of an indexed block.
Entry = tuple[int, int]


class PutResult:
    """What :meth:`BlockIndex.put` did: whether the block was admitted, the blocks it
    evicted (id, length), the disk space they were charged, and the used bytes after it,
    with the order of the write that stored them (see :meth:`BlockIndex.next_order`)."""

    __slots__ = ("admitted", "evicted", "evicted_bytes", "order", "used")

    def __init__(self, admitted: bool, evicted: list[tuple[bytes, int]], evicted_bytes: int,
                 used: int | None, order: int = 0) -> None:
        self.admitted = admitted
        self.evicted = evicted
        self.evicted_bytes = evicted_bytes
        self.used = used
        self.order = order


class BlockIndex:
    """The ``blocks``/``lru`` databases and the used-bytes counter of one cache. ``unit``:
    the allocation unit of the cache files' file system (module docstring)."""

    def __init__(self, env: LmdbEnv, *, capacity: int, policy: str, unit: int = 4096) -> None:
        if policy not in POLICIES:
            raise ValueError(f"unknown cache policy {policy!r}")
        self._env = env
        self._orders = itertools.count(1)
        self._blocks_db = env.db("blocks")
        self._lru_db = env.db("lru")
        self._meta_db = env.db("meta")
        self.capacity = capacity
        self.policy = policy
        self.unit = unit
        self._error_logged = 0.0
        self._errors_unlogged = 0

    # -- start-up -------------------------------------------------------------------------
    def adopt_layout(self) -> None:
        """An index written by an earlier layout is dropped (the cache is best-effort)."""
        with self._env.write() as txn:
            if txn.get(_LAYOUT_KEY, db=self._meta_db) == _LAYOUT:
                return
            if txn.stat(self._blocks_db)["entries"]:
                log.info("the cache directory holds an older layout: starting with an empty cache")
            txn.drop(self._blocks_db, delete=False)
            txn.drop(self._lru_db, delete=False)
            txn.put(_USED_KEY, b"0", db=self._meta_db)
            txn.put(_UNIT_KEY, str(self.unit).encode(), db=self._meta_db)
            txn.put(_LAYOUT_KEY, _LAYOUT, db=self._meta_db)

    def adopt_accounting(self) -> None:
        """Recount ``used_bytes`` as the sum of the indexed blocks' charges when it was
        counted otherwise (``used_unit`` missing: an earlier version summed lengths; or
        another unit: the cache directory moved to another file system). One pass over
        the ``blocks`` database in one write transaction (start-up, before any put):
        0.2-0.4 s a million blocks, once (the daemon has just read the whole index, so
        its pages are in memory); an index already of this kind costs one read."""
        unit = str(self.unit).encode()
        with self._env.read() as txn:
            if txn.get(_UNIT_KEY, db=self._meta_db) == unit:
                return
        started = time.monotonic()
        with self._env.write() as txn:
            used = count = 0
            step = self.unit  # (units counted inline: no call per block on a large index)
            for raw in txn.cursor(db=self._blocks_db).iternext(keys=False, values=True):
                used += -(-_LENGTH.unpack_from(raw)[0] // step)
                count += 1
            used *= step
            old = _int(txn.get(_USED_KEY, db=self._meta_db))
            txn.put(_USED_KEY, str(used).encode(), db=self._meta_db)
            txn.put(_UNIT_KEY, unit, db=self._meta_db)
        if count:
            log.info("cache accounting recounted in %d-byte units: %d blocks take %d bytes on "
                     "disk (%d counted before; %.2f s)", self.unit, count, used, old,
                     time.monotonic() - started)

    def charge(self, length: int) -> int:
        """The disk space a block of ``length`` bytes is charged (module docstring)."""
        return allocation(length, self.unit)

    def totals(self) -> tuple[int, int]:
        """(used bytes, block count) as stored: the used bytes are disk space, each block
        charged its length rounded up to the allocation unit."""
        with self._env.read() as txn:
            return _int(txn.get(_USED_KEY, db=self._meta_db)), txn.stat(self._blocks_db)["entries"]

    # -- lookups (any thread) -------------------------------------------------------------
    def report_error(self, exc: Exception) -> None:
        """An index read failed: the caller treats it as a miss."""
        metrics.CACHE_INDEX_ERRORS.inc()
        now = time.monotonic()
        if now - self._error_logged < _ERROR_LOG_INTERVAL:
            self._errors_unlogged += 1
            return
        more = (f" ({self._errors_unlogged} more since the last report)"
                if self._errors_unlogged else "")
        self._error_logged, self._errors_unlogged = now, 0
        log.warning("cache index read failed (%s); served as a cache miss%s", exc, more)

    def entry(self, bid: bytes) -> Entry | None:
        """(length, checksum) of an indexed block; None when it is not indexed or the
        index cannot be read (reported: a miss)."""
        try:
            raw = self._env.get("blocks", bid)
            if raw is None:
                return None
            length, digest, _ = _BLOCK.unpack(raw)
        except (CacheError, struct.error) as exc:
            self.report_error(exc)
            return None
        return int(length), int(digest)

    def contains_all(self, bids: list[bytes]) -> bool:
        """Whether every block is indexed (one read transaction)."""
        try:
            return all(raw is not None for raw in self._env.get_many("blocks", bids))
        except CacheError as exc:
            self.report_error(exc)
            return False

    def indexed(self, bids: list[bytes]) -> set[bytes]:
        """The blocks among ``bids`` that are indexed (one read transaction); none when the
        index cannot be read (reported: misses, as :meth:`entry` answers)."""
        try:
            raws = self._env.get_many("blocks", bids)
        except CacheError as exc:
            self.report_error(exc)
            return set()
        return {bid for bid, raw in zip(bids, raws, strict=True) if raw is not None}

    def entries(self, bids: list[bytes]) -> list[Entry] | None:
        """(length, checksum) of every block, or None if one is not indexed (or the index
        cannot be read: reported)."""
        try:
            raws = self._env.get_many("blocks", bids)
            if any(raw is None for raw in raws):
                return None
            return [(int(n), int(d)) for n, d, _ in (_BLOCK.unpack(raw) for raw in raws)]  # type: ignore[arg-type]
        except (CacheError, struct.error) as exc:
            self.report_error(exc)
            return None

    def state(self, oid: bytes, offsets: list[int]) -> tuple[set[int], bool]:
        """(the offsets among ``offsets`` whose block is indexed, whether any block of
        ``oid`` is indexed), from one snapshot. Raises CacheError."""
        with self._env.read() as txn:
            indexed = {off for off in offsets
                       if txn.get(block_id_at(oid, off), db=self._blocks_db) is not None}
            cur = txn.cursor(db=self._blocks_db)
            any_indexed = bool(cur.set_range(oid)) and bytes(cur.key()[:OID_LEN]) == oid
        return indexed, any_indexed

    # -- writes (worker threads; raise CacheError) ------------------------------------------
    def put(self, bid: bytes, length: int, digest: int,
            is_pinned: Callable[[bytes], bool],
            is_unread: Callable[[bytes], bool] | None = None) -> PutResult:
        """Index a block whose bytes are written, making room by the policy. Pins are
        read inside the write transaction (``is_pinned(object id)``): no pinned
        object's block is chosen. A block fetched ahead that no reader took yet
        (``is_unread(block id)``) gets a second chance: it is made most recently used
        instead of evicted, unless nothing else frees enough. The block is charged
        :meth:`charge` of its length, and so is each evicted one. ``used`` is None when
        nothing changed."""
        now = time.time()
        cost = self.charge(length)
        evicted: list[tuple[bytes, int]] = []
        freed = 0
        with self._env.write() as txn:
            failpoints.hit("put.index")
            if txn.get(bid, db=self._blocks_db) is not None:
                return PutResult(True, [], 0, None)
            used = _int(txn.get(_USED_KEY, db=self._meta_db))
            if used + cost > self.capacity:
                if self.policy == "keep":
                    metrics.CACHE_ADMISSION_REJECTS.inc()
                    return PutResult(False, [], 0, None)
                evicted, freed = self._evict_lru(txn, used + cost - self.capacity, is_pinned,
                                                 is_unread, now)
                failpoints.hit("evict.chosen")
                if used - freed + cost > self.capacity:
                    # Only pinned blocks are left to evict: do not admit (nothing is lost,
                    # the evictions already made stand).
                    txn.put(_USED_KEY, str(used - freed).encode(), db=self._meta_db)
                    metrics.CACHE_ADMISSION_REJECTS.inc()
                    return PutResult(False, evicted, freed, used - freed, self.next_order())
                used -= freed
            txn.put(bid, _BLOCK.pack(length, digest, now), db=self._blocks_db)
            txn.put(_LRU_TIME.pack(now) + bid, b"", db=self._lru_db)
            used += cost
            txn.put(_USED_KEY, str(used).encode(), db=self._meta_db)
            order = self.next_order()
        return PutResult(True, evicted, freed, used, order)

    def next_order(self) -> int:
        """The order of a write of the used bytes, taken inside its write transaction:
        LMDB runs one write transaction at a time, so these orders are the order of the
        commits. Threads that committed one after the other may publish the used bytes
        each read in the other order; the cache keeps the latest write's (see
        :meth:`cachefs.cache.blocks.BlockCache._account`)."""
        return next(self._orders)

    def trim(self, need: int, is_pinned: Callable[[bytes], bool],
             is_unread: Callable[[bytes], bool] | None = None) -> PutResult:
        """Evict least recently used blocks of unpinned objects (as ``lru`` does to admit
        one) until their charges free ``need`` bytes, under either policy: the capacity
        bounds the disk even when the index holds more than it (a cache filled under a
        larger ``--cache-size``, or counted by an earlier version). ``admitted`` is False;
        ``used`` is None when nothing was evicted."""
        with self._env.write() as txn:
            evicted, freed = self._evict_lru(txn, need, is_pinned, is_unread, time.time())
            if not evicted:
                return PutResult(False, [], 0, None)
            used = max(0, _int(txn.get(_USED_KEY, db=self._meta_db)) - freed)
            txn.put(_USED_KEY, str(used).encode(), db=self._meta_db)
            order = self.next_order()
        return PutResult(False, evicted, freed, used, order)

    def _evict_lru(self, txn: object, need: int, is_pinned: Callable[[bytes], bool],
                   is_unread: Callable[[bytes], bool] | None, now: float
                   ) -> tuple[list[tuple[bytes, int]], int]:
        """Remove least recently used blocks of unpinned objects until their charges free
        ``need`` bytes (or none is left); returns them with their lengths, and the sum of
        their charges. Blocks fetched ahead and unread are passed over and made most
        recently used (a reader is expected: evicting them would fetch them twice), and
        taken only when nothing else frees enough."""
        evicted: list[tuple[bytes, int]] = []
        spared: list[bytes] = []
        freed = 0
        cur = txn.cursor(db=self._lru_db)  # type: ignore[attr-defined]
        cur.first()
        while freed < need and cur.key():
            old = bytes(cur.key()[_LRU_TIME.size:])
            if is_pinned(old[:OID_LEN]):
                if not cur.next():
                    break
                continue
            if is_unread is not None and is_unread(old):
                spared.append(old)
                cur.delete()  # (put back below, as used now)
                continue
            cur.delete()  # moves to the next entry
            raw = txn.pop(old, db=self._blocks_db)  # type: ignore[attr-defined]
            if raw is not None:
                n = _BLOCK.unpack(raw)[0]
                freed += self.charge(n)
                evicted.append((old, n))
        for old in spared:
            raw = txn.pop(old, db=self._blocks_db)  # type: ignore[attr-defined]
            if raw is None:
                continue
            length, digest, _ = _BLOCK.unpack(raw)
            if freed < need:  # nothing else was left to take
                freed += self.charge(length)
                evicted.append((old, length))
                continue
            txn.put(old, _BLOCK.pack(length, digest, now), db=self._blocks_db)  # type: ignore[attr-defined]
            txn.put(_LRU_TIME.pack(now) + old, b"", db=self._lru_db)  # type: ignore[attr-defined]
        return evicted, freed

    def remove(self, bids: list[bytes], expect: dict[bytes, Entry] | None = None
               ) -> tuple[list[tuple[bytes, int]], int, int]:
        """Drop blocks from the index; returns (the blocks dropped with their lengths,
        used bytes after: less their charges, the order of this write: next_order). With
        ``expect``, a block is dropped only while it is still indexed as that (length,
        checksum)."""
        removed: list[tuple[bytes, int]] = []
        with self._env.write() as txn:
            used = _int(txn.get(_USED_KEY, db=self._meta_db))
            for bid in bids:
                raw = txn.get(bid, db=self._blocks_db)
                if raw is None:
                    continue
                length, digest, last = _BLOCK.unpack(raw)
                if expect is not None and expect.get(bid) != (length, digest):
                    continue
                txn.delete(bid, db=self._blocks_db)
                txn.delete(_LRU_TIME.pack(last) + bid, db=self._lru_db)
                removed.append((bid, length))
            used = max(0, used - sum(self.charge(n) for _, n in removed))
            txn.put(_USED_KEY, str(used).encode(), db=self._meta_db)
            order = self.next_order()
        return removed, used, order

    def flush_touches(self, touched: dict[bytes, float]) -> None:
        """Write last-use times in one transaction."""
        with self._env.write() as txn:
            for bid, t in touched.items():
                raw = txn.get(bid, db=self._blocks_db)
                if raw is None:
                    continue
                length, digest, last = _BLOCK.unpack(raw)
                if t <= last:
                    continue
                txn.delete(_LRU_TIME.pack(last) + bid, db=self._lru_db)
                txn.put(_LRU_TIME.pack(t) + bid, b"", db=self._lru_db)
                txn.put(bid, _BLOCK.pack(length, digest, t), db=self._blocks_db)


def _int(raw: bytes | None) -> int:
    """A counter stored as decimal text (0 when missing or unreadable)."""
    try:
        return int(raw) if raw else 0
    except ValueError:
        return 0
