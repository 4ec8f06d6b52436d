"""The persistent block cache on local disk: verified reads, admission, eviction, pins.

:class:`BlockCache` coordinates three parts, each in its own module:

* :mod:`cachefs.cache.blockid` -- names: object ids (one per object version and
  block size), block ids (object id + offset), checksums;
* :mod:`cachefs.cache.objectfiles` -- one sparse file per object version,
  ``DIR/objects/ab/ab12...ef``, each block at its own offset (keeping a whole
  object in one file is what lets the kernel read a fully cached object itself:
  FUSE passthrough, see :mod:`cachefs.passthrough`);
* :mod:`cachefs.cache.blockindex` -- the LMDB index: block id -> (length,
  xxh3-64, last use), the LRU order, used bytes, and the eviction policy.

The capacity bounds the disk space of the object files: each block is charged its length
rounded up to the file system's allocation unit (:attr:`BlockCache.unit`, taken once at
start; see :mod:`cachefs.cache.blockindex`), and :attr:`BlockCache.used` counts those
charges. It does not count the index (``meta.lmdb``), whose size and preallocated
reserve are bounded on their own (``cachefs.daemon.index_reserve``): the disk a cache
directory needs is the capacity plus the index.

This module owns the rules that tie them together: the order of file writes,
index writes and releases (under the locks below), the pins, and verification.

Contracts:

* :meth:`BlockCache.get` returns the block's exact bytes or None. Every read
  is verified against length and checksum; a mismatch or a missing file drops
  the entry, counts ``cachefs_cache_corrupt_blocks_total`` and returns None
  (a miss, never an error: S3 is the truth). A read that lost a race with an
  eviction (the block's hole was punched, or its file removed, after the index
  named it) is a plain miss, not corruption: a mismatch is only called corrupt
  when a second read under the object's lock, with the index still naming the
  same block, fails too. :meth:`verify_object` checks a whole object the same
  way before its file is handed to the kernel -- by reading it, unless this
  cache wrote every block of it itself in this process's life, or read it back
  whole for such a check, and released none since (*written marks*, below).
* Written marks: when :meth:`put_sync` has written and indexed a block, it
  records (the file's stamp, the block's offset, its index entry) under the
  object's lock, in the same critical section; so does a pinned
  :meth:`verify_object` that read every block back through its descriptor and
  found it right (a registration closed for its bounds and made again later in
  this life is not read back twice). The stamp
  (:data:`~cachefs.cache.objectfiles.FileStamp`: the inode and its change time)
  is the file's after the write, or before the read-back: a write keeps the
  object's earlier marks only when the file's stamp just before it was the marks'
  (no one else changed the file in between). A release of any of the
  object's bytes (punch or file removal) drops the object's marks under that
  same lock. So a mark whose stamp is the file's stamp now (the stamp of an
  open descriptor of it) and whose entry is the block's index entry says what
  reading the block back would say: the file holds the bytes the entry's
  checksum was taken of -- whoever wrote to the file since changed its stamp.
  :meth:`verify_object` trusts them only for a pinned object (no release can
  run after the pin) and only while holding the object's lock, and the marks
  live in memory only: a new daemon, or a mark pushed out of the bounded table
  (:data:`WRITTEN_MARKS`), verifies by reading, as before. What marks cannot
  see is damage the file system does not record (the disk's own bit rot under
  an unchanged stamp), within one daemon's life; a registered file's stamp is
  checked again at its opens (:mod:`cachefs.passthrough`).
  :meth:`BlockCache.put_kept` hands the caller the descriptor a block was just
  written through, and the file's stamp after the write, for an object the
  caller pinned before the write: the same conclusion without the marks'
  comparison (the file of that descriptor holds the bytes of the entry indexed
  with them, and no release can run until the unpin).
* An index that cannot be read (any LMDB error, a value of the wrong shape)
  makes a lookup a miss, counted in ``cachefs_cache_index_errors_total`` and
  logged (at most once a minute), never an error.
* :meth:`BlockCache.put` is best-effort: it returns False when the block was
  not admitted (cache full under the ``keep`` policy, disk full, I/O error).
* A block's bytes are written before the index names it. A crash leaves at
  worst bytes no entry names (an object file without entries is removed by
  the start-up scan; a hole inside one is harmless) or an entry whose bytes
  are torn (caught by the checksum).
* Bytes of a dropped block are released with a hole punched into the object
  file; the file is removed when the index names none of its blocks.
* The bytes of an object pinned by :meth:`pin` (its file is read by the kernel
  itself: passthrough) are never punched and its file never removed. Eviction
  reads the pins inside its write transaction, so it does not choose a pinned
  object's blocks; and the release of a dropped block's bytes checks the pins
  again under the object's lock, so a pin taken while an eviction was being
  decided (whose verification may have read the blocks before the eviction
  committed) defers the release until the last unpin. Deferred bytes are
  released by the next put or :meth:`flush_touches` after that, unless the block
  was stored again meanwhile (a release never punches a block the index names).
* A *yielding* pin keeps an object's bytes the same way but does not keep eviction
  from choosing its blocks (an idle passthrough registration: worth less than room
  for new blocks). Whenever a release is deferred for pins -- yielding ones, or a
  plain pin that raced the eviction as above -- :attr:`BlockCache.on_evicted_while_pinned`
  is told, after every lock of the cache is let go, so the holder can unpin once it
  no longer needs the bytes. Until it does, those bytes are on disk beyond the
  capacity the index accounts.

Policies (``keep``, ``lru``): see :mod:`cachefs.cache.blockindex`.

Concurrency: index reads happen on the trio thread and in worker threads,
always in small synchronous helpers (no LMDB transaction lives across an
``await``: it would hold a reader slot while the coroutine waits, see
:mod:`cachefs.cache.lmdbenv`). File I/O, checksums and index writes run in
worker threads under the disk CapacityLimiter. Last-use updates are collected
in memory (``_touched``, from any thread) and written in batches by
:meth:`flush_touches` (a worker thread), which takes the whole dict under
``_lock``, so no thread ever writes the dict being written out.

Locks, in the only order they may be taken:

1. an object's lock (``_file_lock``): held while a block is written and
   indexed, while a dropped block's bytes are released (punch, or file removal
   when the index names none of its blocks), and while a failed verification is
   re-checked. So a file is never removed while a block put into it is still
   unindexed, a release never punches a block indexed again, and a read that
   re-checks sees either the block or its absence, never a half-done release.
   A thread holds at most one object lock. :attr:`BlockCache.on_written` is
   called holding it (after the index write: dictionary work only, plus the
   native loop's own mutex), so its holder sees an object's writes in order.
2. the LMDB write transaction (one writer at a time); it may be opened while an
   object lock is held, never the other way round.
3. ``_lock``: guards ``_used`` (and ``_used_order``), ``_count``, ``_pinned``, ``_yielding``, ``_deferred``,
   ``_touched`` and ``_written`` (which is changed, and read for a trust
   decision, only while the object's lock is held too); held only for a
   few dict operations, taken last.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager
from pathlib import Path

import trio

from cachefs import failpoints, metrics
from cachefs.cache.blockid import (
    OID_LEN,
    block_id,
    block_id_at,
    checksum,
    object_id,
    split_block_id,
)
from cachefs.cache.blockindex import POLICIES, BlockIndex, Entry, PutResult
from cachefs.cache.lmdbenv import LmdbEnv
from cachefs.cache.objectfiles import (
    FileStamp,
    ObjectFiles,
    file_stamp,
    path_stamp,
    pread,
    unlink,
)
from cachefs.cache.objectlocks import ObjectLocks
from cachefs.errors import CacheError

log = logging.getLogger(__name__)

#: Objects whose written marks are kept (see the module docstring), least recently
#: written or checked dropped first; one costs ~200 bytes. A dropped mark only means a
#: read-back.
WRITTEN_MARKS = 65536
#: trim_to_capacity() evicts at most this many bytes a transaction.
TRIM_BATCH = 64 << 20
#: Seconds between log lines about blocks that could not be stored, after the first: a
#: disk that stays full fails every block fetched (all are counted in
#: ``cachefs_cache_write_errors_total``).
WRITE_ERROR_LOG_INTERVAL = 60.0

__all__ = ["OID_LEN", "POLICIES", "BlockCache", "block_id", "block_id_at", "checksum",
           "object_id", "split_block_id"]


class BlockCache:
    """Blocks on local disk with an LMDB index and a capacity of disk space. ``unit``:
    the allocation unit of the file system holding ``root`` (taken from it when not
    given: :func:`~cachefs.cache.objectfiles.allocation_unit`)."""

    def __init__(self, env: LmdbEnv, root: Path, *, capacity: int, policy: str = "keep",
                 limiter: trio.CapacityLimiter | None = None, unit: int | None = None) -> None:
        self.files = ObjectFiles(root, unit)
        self.unit = self.files.unit
        self.index = BlockIndex(env, capacity=capacity, policy=policy, unit=self.unit)
        self.root = root
        self.objects_dir = self.files.objects_dir
        self.capacity = capacity
        self.policy = policy
        self._limiter = limiter or trio.CapacityLimiter(16)
        self._lock = threading.Lock()
        self._file_locks = ObjectLocks()
        self._pinned: dict[bytes, int] = {}  # object id -> plain pins
        self._yielding: dict[bytes, int] = {}  # object id -> yielding pins (see pin)
        # Told (outside every lock of this class, on the thread that released them) of the
        # objects whose blocks were dropped from the index while pins kept their bytes:
        # the holders let go, and the bytes go at the last unpin.
        self.on_evicted_while_pinned: Callable[[list[bytes]], None] | None = None
        # Told of every block written and indexed, with the file's (inode, change time
        # before the write, after it), under the object's lock (so in the order of the
        # object's writes): a file registered for reads without the daemon keeps its
        # stamp current through the cache's own writes (cachefs.passthrough). Must only
        # do dictionary work.
        self.on_written: Callable[[bytes, tuple[int, int, int]], None] | None = None
        # Whether a block was fetched ahead and no reader took it yet (any thread; the
        # prefetch ledger's): eviction under lru gives such blocks a second chance.
        self.is_unread: Callable[[bytes], bool] | None = None
        # Byte ranges of dropped blocks whose release waits for their object's unpin.
        self._deferred: dict[bytes, list[tuple[int, int]]] = {}
        self._touched: dict[bytes, float] = {}
        self._write_error_logged = 0.0  # (monotonic; 0: never)
        self._write_errors_unlogged = 0
        # Written marks: object id -> (its file's stamp, {block offset: index entry}) for
        # blocks this cache wrote and has not released since (module docstring). Changed
        # under the object's lock and _lock; oldest written first.
        self._written: OrderedDict[bytes, tuple[FileStamp, dict[int, Entry]]] = OrderedDict()
        self.max_written_marks = WRITTEN_MARKS
        # An index written by an earlier layout is dropped (the cache is best-effort);
        # its files are removed by remove_orphans().
        self.index.adopt_layout()
        self.index.adopt_accounting()  # (used bytes of an earlier version summed lengths)
        self._used, self._count = self.index.totals()
        self._used_order = 0  # the index write whose used bytes _used is (see _account)
        metrics.CACHE_CAPACITY_BYTES.set(capacity)
        self._publish()

    # -- accounting ----------------------------------------------------------------
    @property
    def used(self) -> int:
        """Disk space charged for the indexed blocks (:meth:`charge` of each)."""
        return self._used

    def charge(self, length: int) -> int:
        """The disk space a block of ``length`` bytes is charged against the capacity."""
        return self.index.charge(length)

    @property
    def block_count(self) -> int:
        return int(self._count)

    @property
    def deferred_bytes(self) -> int:
        """Bytes of dropped blocks still on disk because their object is pinned."""
        with self._lock:
            return sum(n for ranges in self._deferred.values() for _, n in ranges)

    def _publish(self) -> None:
        metrics.CACHE_USED_BYTES.set(self._used)
        metrics.CACHE_BLOCKS.set(self._count)

    def object_path(self, oid: bytes) -> str:
        return self.files.path(oid)

    def location(self, bid: bytes) -> tuple[str, int]:
        """(object file, byte offset) where block ``bid`` is stored."""
        oid, offset = split_block_id(bid)
        return self.object_path(oid), offset

    def _file_lock(self, oid: bytes) -> AbstractContextManager[None]:
        return self._file_locks.hold(oid)

    # -- pins (objects whose file the kernel reads directly) ----------------------------
    def pin(self, oid: bytes, *, yielding: bool = False) -> None:
        """Keep the bytes of every block of ``oid`` in its file until the matching
        :meth:`unpin`: a release decided before (by an eviction racing this pin) or
        after waits for the last unpin. A plain pin also keeps eviction from choosing
        the object's blocks from now on. A *yielding* pin does not: eviction may drop
        the blocks from the index (their bytes stay until the unpin; an idle
        registration is worth less than room for new blocks). Either way, when a
        release waits for pins, :attr:`on_evicted_while_pinned` is told, so the holder
        can let go once it is done with the bytes. Take the pin before verifying the
        file: a block evicted before it is then not indexed any more, so the
        verification fails instead of trusting bytes about to go."""
        with self._lock:
            pins = self._yielding if yielding else self._pinned
            pins[oid] = pins.get(oid, 0) + 1

    def unpin(self, oid: bytes, *, yielding: bool = False) -> None:
        """Any thread; never waits. Deferred releases happen at the next put or
        :meth:`flush_touches`."""
        with self._lock:
            _uncount(self._yielding if yielding else self._pinned, oid)

    def convert_pin(self, oid: bytes, *, yielding: bool) -> None:
        """Turn one plain pin of ``oid`` into a yielding one (``yielding``) or back, at
        once: the bytes are kept throughout (any thread; never waits)."""
        with self._lock:
            old, new = ((self._pinned, self._yielding) if yielding
                        else (self._yielding, self._pinned))
            _uncount(old, oid)
            new[oid] = new.get(oid, 0) + 1

    def _is_pinned(self, oid: bytes) -> bool:
        """Whether eviction must not choose ``oid``'s blocks (a plain pin)."""
        with self._lock:
            return oid in self._pinned

    def _is_kept(self, oid: bytes) -> bool:
        """Whether ``oid``'s bytes must stay in its file (any pin; the caller holds
        ``_lock``)."""
        return oid in self._pinned or oid in self._yielding

    # -- index lookups (any thread; synchronous, no transaction outlives them) -----------
    def _entry(self, bid: bytes) -> Entry | None:
        return self.index.entry(bid)

    def contains(self, bid: bytes) -> bool:
        return self.index.entry(bid) is not None

    def length_of(self, bid: bytes) -> int | None:
        entry = self.index.entry(bid)
        return None if entry is None else entry[0]

    def indexed_as(self, bid: bytes, entry: Entry) -> bool:
        """Whether block ``bid`` is still indexed as ``entry`` (one lookup, any thread)."""
        return self.index.entry(bid) == entry

    def contains_which(self, bids: list[bytes]) -> set[bytes]:
        """The blocks among ``bids`` that are on disk (:meth:`contains` of each, from one
        read transaction; any thread)."""
        return self.index.indexed(bids)

    def contains_all(self, bids: list[bytes]) -> bool:
        """Whether every block is indexed (one read transaction)."""
        return self.index.contains_all(bids)

    # -- verified reads --------------------------------------------------------------
    async def get(self, bid: bytes) -> bytes | None:
        """The verified bytes of block ``bid``, or None (miss, or dropped as corrupt)."""
        entry = self._entry(bid)  # a synchronous helper: no reader slot held below
        if entry is None:
            return None
        metrics.THREAD_HOPS.labels("cache_read").inc()
        data = await trio.to_thread.run_sync(self._read_verified, bid, entry,
                                             limiter=self._limiter)
        if data is not None:
            self.touch((bid,))
        return data

    def get_now(self, bid: bytes) -> bytes | None:
        """:meth:`get` on the calling thread (which may wait on the disk): a FUSE request
        worker reading a cached block, or any worker thread."""
        entry = self._entry(bid)
        if entry is None:
            return None
        data = self._read_verified(bid, entry)
        if data is not None:
            self.touch((bid,))
        return data

    def _read_verified(self, bid: bytes, entry: Entry) -> bytes | None:
        """Block ``bid`` read from its file and checked against ``entry`` (worker thread)."""
        failpoints.hit("read.indexed")
        path, offset = self.location(bid)
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            fd = -1  # removed by an eviction, or lost: the re-check tells which
        except OSError as exc:
            log.warning("cache file %s unreadable (%s)", path, exc.strerror)
            fd = -1
        try:
            if fd >= 0:
                try:
                    data = pread(fd, entry[0], offset)
                except OSError as exc:
                    log.warning("cache file %s unreadable (%s)", path, exc.strerror)
                else:
                    if _matches(data, entry):
                        return data
            return self._recheck(bid, entry)
        finally:
            if fd >= 0:
                os.close(fd)

    def _recheck(self, bid: bytes, entry: Entry, fd: int = -1) -> bytes | None:
        """A read of ``bid`` did not match ``entry``: decide, under the object's lock (no
        release or put of it can run), whether that was a race or damage.

        A block no longer indexed as ``entry`` was evicted while we read it: a plain miss.
        One still indexed is read again from its file (opened afresh: the file read first
        may have been removed and written anew since); if that fails too, it is dropped
        as corrupt. ``fd`` (verify_object's descriptor) must still be that file, else the
        file it verified is gone: a miss."""
        oid, offset = split_block_id(bid)
        data = None
        with self._file_lock(oid):
            if self._entry(bid) != entry:
                return None  # evicted (or replaced) meanwhile: a plain miss
            try:
                current = os.open(self.object_path(oid), os.O_RDONLY)
            except FileNotFoundError:
                current = -1
            except OSError as exc:
                log.warning("cache file of block %s unreadable (%s)", bid.hex(), exc.strerror)
                current = -1
            try:
                if current >= 0 and fd >= 0 and not os.path.sameopenfile(fd, current):
                    return None  # the file verified was removed (and written anew): a miss
                if current >= 0:
                    data = pread(current, entry[0], offset)
            except OSError as exc:
                log.warning("cached block %s unreadable (%s)", bid.hex(), exc.strerror)
            finally:
                if current >= 0:
                    os.close(current)
            if data is not None and _matches(data, entry):
                return data
        if data is not None:
            log.warning("cached block %s failed verification (%d bytes, expected %d); "
                        "refetching", bid.hex(), len(data), entry[0])
        else:
            log.warning("cached block %s is missing or unreadable; refetching", bid.hex())
        self._drop_corrupt(bid, entry)
        return None

    def verify_object(self, bids: list[bytes], fd: int | None = None, *,
                      read_back: bool = True, stamp: FileStamp | None = None,
                      keep_going: Callable[[bytes, Entry, int], bool] | None = None
                      ) -> int | None:
        """Check every block of one object against the index (worker thread).

        Reads the object's file, or ``fd`` when given (an open descriptor of it, the
        one then handed to the kernel, so the bytes checked are the bytes served; the
        caller holds a :meth:`pin` of the object). With ``fd``, blocks this cache wrote
        into that very file and has not released since, the file unchanged since, are
        not read back (written marks, see the module docstring; ``stamp``, when given,
        is the file's stamp the caller took of ``fd``, checked against them and
        recorded by a read-back instead of one taken here); without ``read_back``, only such a file is
        verified (None for any other, nothing read). ``keep_going``, when given, is asked
        before each block is read back (with its id, the index entry the check started
        from, and the bytes checked so far): False gives the check up (None; nothing is
        dropped). A read-back in the background paces itself with it, and gives up when
        the block is no longer indexed as it was (:meth:`indexed_as`: evicted meanwhile).
        Returns the number of bytes verified, or None when a block is not indexed,
        is missing or fails its checksum (a failing block is dropped as corrupt,
        unless the failure was an eviction racing this check). Reading the file also
        leaves it in the page cache, where the kernel's own reads of it then find it.
        """
        entries = self.index.entries(bids) if bids else None
        if entries is None:
            return None
        if fd is None:
            stamp = None
        elif stamp is None:
            stamp = file_stamp(fd)  # (of the file the marks name; before any read-back)
        if stamp is not None and self._written_intact(bids, entries, stamp):
            metrics.CACHE_OBJECTS_TRUSTED.inc()
            self.touch(bids)
            return sum(entry[0] for entry in entries)
        if not read_back:
            return None
        own = fd is None
        if fd is None:
            try:
                fd = os.open(self.object_path(split_block_id(bids[0])[0]), os.O_RDONLY)
            except OSError:
                return None
        total = 0
        try:
            for bid, entry in zip(bids, entries, strict=True):
                if keep_going is not None and not keep_going(bid, entry, total):
                    return None
                try:
                    data: bytes | None = pread(fd, entry[0], split_block_id(bid)[1])
                except OSError:
                    data = None
                if data is None or not _matches(data, entry):
                    if self._recheck(bid, entry, fd) is None:
                        return None
                total += entry[0]
            if stamp is not None:
                self._mark_checked(bids, entries, stamp)
        finally:
            if own:
                os.close(fd)
        self.touch(bids)
        return total

    def _mark_checked(self, bids: list[bytes], entries: list[Entry], stamp: FileStamp) -> None:
        """Mark the blocks just read back through a descriptor of the file ``stamp`` (taken
        before the read) names and found right as if written here (the caller holds a pin,
        so no punch has run since the read: the next one drops these marks first, under
        the object's lock taken here too); earlier marks of the object are replaced. A
        registration of the object made again in this life -- one closed for the bounds,
        reopened next epoch -- then trusts them instead of reading the file back, unless
        the file changed since (a write after the read-back gives it another stamp)."""
        oid = split_block_id(bids[0])[0]
        with self._file_lock(oid), self._lock:
            self._written[oid] = (stamp, {split_block_id(bid)[1]: entry
                                          for bid, entry in zip(bids, entries, strict=True)})
            self._written.move_to_end(oid)
            if len(self._written) > self.max_written_marks:
                self._written.popitem(last=False)

    def _written_intact(self, bids: list[bytes], entries: list[Entry],
                        stamp: FileStamp) -> bool:
        """Whether the file ``stamp`` (an open descriptor's, taken now) names holds every
        block of ``bids`` as this cache wrote it: each block marked written into that file
        with its current index entry, none released since and the file changed by no one
        since. Taken under the object's lock, so no release is half-done; the caller's pin
        keeps any later one from running."""
        oid = split_block_id(bids[0])[0]
        with self._file_lock(oid), self._lock:
            marks = self._written.get(oid)
            if marks is None or marks[0] != stamp:
                return False
            written = marks[1]
            return all(written.get(split_block_id(bid)[1]) == entry
                       for bid, entry in zip(bids, entries, strict=True))

    def marked_intact(self, bids: list[bytes], stamp: FileStamp) -> bool:
        """Whether the file ``stamp`` (taken now) names holds every block of ``bids`` as
        this cache last wrote or checked it, changed by no one since (written marks; any
        thread: an index read, then the object's lock). A registered file whose stamp
        moved is asked this: the cache's own writes move it too."""
        entries = self.index.entries(bids) if bids else None
        return entries is not None and self._written_intact(bids, entries, stamp)

    def settled_stamp(self, oid: bytes) -> FileStamp | None:
        """The stamp of the object's file once no write of it is under way (any thread;
        takes the object's lock, then a stat): a write that had begun has been told to
        :attr:`on_written` by then. None when there is no file."""
        with self._file_lock(oid):
            return path_stamp(self.object_path(oid))

    def written_blocks(self, oid: bytes) -> int:
        """How many blocks of object ``oid`` carry written marks (any thread; one dictionary
        look under the innermost lock): a cheap sign that the object may be whole and
        trusted, to decide whether the full check (:meth:`verify_object`) is worth making."""
        with self._lock:
            marks = self._written.get(oid)
            return 0 if marks is None else len(marks[1])

    def _mark_written(self, oid: bytes, written: tuple[int, int, int], offset: int,
                      entry: Entry) -> None:
        """Record a block written and indexed (the caller holds the object's lock);
        ``written`` is what :meth:`ObjectFiles.write_at` returned (the file's inode, its
        change time before the write and after it)."""
        inode, before, after = written
        with self._lock:
            marks = self._written.get(oid)
            if marks is None or marks[0] != (inode, before):
                # (a new file, or one someone else changed since the marks: they are void)
                blocks: dict[int, Entry] = {}
            else:
                blocks = marks[1]
                self._written.move_to_end(oid)
            blocks[offset] = entry
            self._written[oid] = ((inode, after), blocks)
            if len(self._written) > self.max_written_marks:
                self._written.popitem(last=False)

    def _unmark_written(self, oid: bytes) -> None:
        """Forget the object's written marks: some of its bytes are being released, or
        were not written (the caller holds the object's lock)."""
        with self._lock:
            self._written.pop(oid, None)

    def drop(self, bids: list[bytes]) -> None:
        """Remove blocks whose bytes are known to be wrong (worker thread): a miss next time.
        Pinned objects' bytes are released at unpin, as for any dropped block."""
        self._remove(bids)

    def _drop_corrupt(self, bid: bytes, entry: Entry) -> None:
        metrics.CACHE_CORRUPT_BLOCKS.inc()
        try:
            self._remove([bid], expect={bid: entry})
        except CacheError:
            log.exception("could not drop corrupt block %s", bid.hex())

    # -- admission (worker threads) ----------------------------------------------------
    async def put(self, bid: bytes, data: bytes) -> bool:
        """Store a block; False when it was not admitted. Never raises for disk trouble."""
        if self.contains(bid):
            return True
        if self.policy == "keep" and self._used + self.charge(len(data)) > self.capacity:
            metrics.CACHE_ADMISSION_REJECTS.inc()
            return False
        metrics.THREAD_HOPS.labels("cache_write").inc()
        return await trio.to_thread.run_sync(self.put_sync, bid, data, limiter=self._limiter)

    def put_now(self, bid: bytes, data: bytes) -> bool:
        """:meth:`put` on the calling worker thread (the thread that fetched the block:
        no hop of its own). False when not admitted; never raises for disk trouble.

        Unlike :meth:`put` it does not first ask the index whether the block is there
        (a read transaction per cold file): its caller has just fetched the block
        because it was missing. If it was stored meanwhile (the other answer of a
        hedged GET), the same verified bytes of the same object version are written
        over themselves and the index, which checks again in its write transaction,
        keeps its entry."""
        if self.policy == "keep" and self._used + self.charge(len(data)) > self.capacity:
            if self.contains(bid):  # (only a full cache asks)
                return True
            metrics.CACHE_ADMISSION_REJECTS.inc()
            return False
        return self.put_sync(bid, data)

    def put_sync(self, bid: bytes, data: bytes) -> bool:
        return self._put(bid, data, keep=False) is not None

    def put_kept(self, bid: bytes, data: bytes) -> tuple[int, FileStamp] | None:
        """:meth:`put_now` of an object's only block, leaving its file open: a read-write
        descriptor of the very file the block was written into and indexed from (the
        caller's to close), with the file's stamp after the write, or None when the block
        was not written (not admitted, disk or index trouble; nothing left open). The
        caller holds a plain :meth:`pin` of the object taken before this call, so from
        the write on no eviction chooses the block and no release of the object's bytes
        runs until the unpin: the descriptor's
        file holds the bytes the index entry's checksum was taken of, as a
        :meth:`verify_object` of it through its written marks would find. (The S3 thread
        that checked the bytes registers the file for passthrough with it:
        :mod:`cachefs.passthrough`.)"""
        if self.policy == "keep" and self._used + self.charge(len(data)) > self.capacity:
            metrics.CACHE_ADMISSION_REJECTS.inc()
            return None
        return self._put(bid, data, keep=True)

    def _put(self, bid: bytes, data: bytes, *, keep: bool) -> tuple[int, FileStamp] | None:
        """Write and index a block: None when not admitted, else (with ``keep`` the file's
        open descriptor, without it 0; the file's stamp after the write): see
        :meth:`put_kept`."""
        if self.charge(len(data)) > self.capacity:
            metrics.CACHE_ADMISSION_REJECTS.inc()
            return None
        oid, offset = split_block_id(bid)
        entry = (len(data), checksum(data))
        fd = 0
        with self._file_lock(oid):
            try:
                if keep:
                    inode, before, after, fd = self.files.write_kept(oid, data, offset)
                else:
                    inode, before, after = self.files.write_at(oid, data, offset)
            except OSError as exc:
                self._write_error("cannot write block to the cache (%s); serving from memory",
                                  exc.strerror)
                self._release_bytes(oid, [(offset, len(data))])
                return None
            try:
                try:
                    admitted, evicted = self._index_put(bid, *entry)
                except CacheError as exc:
                    self._write_error("cannot index block: %s", exc)
                    admitted, evicted = False, []
                if admitted:
                    self._mark_written(oid, (inode, before, after), offset, entry)
                    if self.on_written is not None:
                        self.on_written(oid, (inode, before, after))
                else:
                    self._release_bytes(oid, [(offset, len(data))])
            except BaseException:
                if keep:
                    os.close(fd)
                raise
            if keep and not admitted:
                os.close(fd)
        try:
            self._release_blocks(evicted)
            if self._deferred:
                self.release_deferred()
        except BaseException:
            if keep and admitted:
                os.close(fd)
            raise
        return (fd, (inode, after)) if admitted else None

    def _write_error(self, message: str, *args: object) -> None:
        """Count a block not stored; log the first, then at most one line every
        :data:`WRITE_ERROR_LOG_INTERVAL` seconds with the number since (any thread)."""
        metrics.CACHE_WRITE_ERRORS.inc()
        now = time.monotonic()
        with self._lock:
            if self._write_error_logged and now - self._write_error_logged < WRITE_ERROR_LOG_INTERVAL:
                self._write_errors_unlogged += 1
                return
            more, self._write_errors_unlogged = self._write_errors_unlogged, 0
            self._write_error_logged = now
        log.warning(message + (f" ({more} more blocks not stored since the last report)"
                               if more else ""), *args)

    def _index_put(self, bid: bytes, length: int, digest: int) -> tuple[bool, list[tuple[bytes, int]]]:
        result: PutResult = self.index.put(bid, length, digest, self._is_pinned, self.is_unread)
        if result.used is not None:
            delta = (1 if result.admitted else 0) - len(result.evicted)
            self._account(result.used, result.order, delta, result.evicted_bytes,
                          len(result.evicted))
        return result.admitted, result.evicted

    def trim_to_capacity(self, batch: int = TRIM_BATCH) -> int:
        """Evict least recently used blocks of unpinned objects until the used bytes are
        within the capacity, under either policy (worker thread; at most ``batch`` bytes
        a transaction, so puts are not held up behind one long one). A cache can hold
        more than its capacity when it was filled under a larger ``--cache-size``, or
        when its used bytes were recounted in disk allocation (:meth:`~cachefs.cache.
        blockindex.BlockIndex.adopt_accounting`): ``keep`` would otherwise stay over the
        cap for good. Returns the bytes freed."""
        freed = 0
        while self._used > self.capacity:
            result = self.index.trim(min(self._used - self.capacity, batch), self._is_pinned,
                                     self.is_unread)
            if result.used is None:
                break  # only pinned blocks are left: their objects are in use
            self._account(result.used, result.order, -len(result.evicted), result.evicted_bytes,
                          len(result.evicted))
            self._release_blocks(result.evicted)
            freed += result.evicted_bytes
        if self._deferred:
            self.release_deferred()
        return freed

    def _account(self, used: int, order: int, count_delta: int, evicted_bytes: int,
                 evicted: int) -> None:
        """Take the used bytes a write of the index left (``order``: its commit's, see
        :meth:`BlockIndex.next_order`) unless a later write's are taken already: two puts
        committed one after the other on two threads may get here in the other order,
        and the earlier's count then stood (the cache's used bytes one block short, or
        over, until the next write: a full ``keep`` cache turned blocks away that fit)."""
        with self._lock:
            if order > self._used_order:
                self._used, self._used_order = used, order
            self._count += count_delta
        if evicted:
            metrics.CACHE_EVICTIONS.inc(evicted)
            metrics.CACHE_EVICTED_BYTES.inc(evicted_bytes)
        self._publish()

    def _remove(self, bids: list[bytes], expect: dict[bytes, Entry] | None = None) -> None:
        """Drop blocks from the index, then their bytes (worker threads). With ``expect``,
        a block is dropped only while it is still indexed as that (length, checksum)."""
        removed, used, order = self.index.remove(bids, expect)
        with self._lock:
            if order > self._used_order:
                self._used, self._used_order = used, order
            self._count -= len(removed)
        self._publish()
        self._release_blocks(removed)

    def _release_blocks(self, blocks: list[tuple[bytes, int]]) -> None:
        """Free the bytes of blocks the index no longer names (worker thread); then tell
        :attr:`on_evicted_while_pinned` of the objects whose pins keep them (their bytes
        wait for the last unpin)."""
        by_object: dict[bytes, list[tuple[int, int]]] = {}
        for bid, length in blocks:
            oid, offset = split_block_id(bid)
            by_object.setdefault(oid, []).append((offset, length))
        kept: list[bytes] = []
        for oid, ranges in by_object.items():
            failpoints.hit("evict.release")
            with self._file_lock(oid):
                if self._release_bytes(oid, ranges):
                    kept.append(oid)
        tell = self.on_evicted_while_pinned
        if kept and tell is not None:
            tell(kept)

    def _release_bytes(self, oid: bytes, ranges: list[tuple[int, int]]) -> bool:
        """Free the byte ranges of dropped blocks of ``oid``: remove the object's file if
        the index names none of its blocks, else punch the ranges out of it. Ranges of
        blocks indexed again meanwhile are kept; a pinned object's release is deferred
        until its last unpin. The caller holds the object's lock. The object's written
        marks are dropped first in every case (a deferred release too: fewer marks only
        cost read-backs). Returns whether the release was deferred for pins (their
        holders are to be told)."""
        self._unmark_written(oid)
        with self._lock:
            if self._is_kept(oid):
                self._deferred.setdefault(oid, []).extend(ranges)
                return True
        try:
            indexed, any_indexed = self.index.state(oid, [off for off, _ in ranges])
        except CacheError as exc:
            self.index.report_error(exc)
            return False  # keep the bytes: never punch what the index may still name
        if not any_indexed:
            self.files.remove(oid)
            return False
        ranges = [(off, n) for off, n in ranges if off not in indexed]
        if ranges:
            self.files.punch(oid, ranges)
        return False

    def release_deferred(self) -> None:
        """Release the bytes whose release waited for an object's unpin (worker thread)."""
        with self._lock:
            jobs = [(oid, self._deferred.pop(oid)) for oid in list(self._deferred)
                    if not self._is_kept(oid)]
        for oid, ranges in jobs:
            with self._file_lock(oid):
                self._release_bytes(oid, ranges)  # pinned again meanwhile: deferred again

    def _object_indexed(self, oid: bytes) -> bool:
        """Whether any block of ``oid`` is in the index (blocks of one object sort
        together). True when the index cannot be read (nothing is removed then)."""
        try:
            return self.index.state(oid, [])[1]
        except CacheError as exc:
            self.index.report_error(exc)
            return True

    # -- maintenance (worker threads, driven by the daemon) -----------------------------
    def touch(self, bids: Iterable[bytes]) -> None:
        """Record a use of these blocks now (any thread)."""
        now = time.time()
        with self._lock:
            for bid in bids:
                self._touched[bid] = now

    def take_touches(self) -> dict[bytes, float]:
        """Hand over pending last-use updates (any thread)."""
        with self._lock:
            touched, self._touched = self._touched, {}
        return touched

    def flush_touches(self, touched: dict[bytes, float]) -> None:
        """Write last-use times in one transaction (worker thread); then release bytes
        whose release waited for an unpin."""
        if touched:
            self.index.flush_touches(touched)
        if self._deferred:
            self.release_deferred()

    def remove_orphans(self, older_than: float) -> int:
        """Delete files the index does not name (worker thread): object files with no
        indexed block, stray files, and the directories of an earlier layout.

        Only files last modified before ``older_than`` (the daemon's start) are
        considered: a block is written just before it is indexed, so a younger
        file without entries may be a put in progress, not an orphan. Files of
        pinned objects are kept.
        """
        removed = self.files.remove_legacy()

        def stale(path: Path) -> bool:
            try:
                return path.stat().st_mtime < older_than
            except FileNotFoundError:
                return False

        for oid, f in self.files.scan():
            if oid is None:
                if stale(f):
                    unlink(f)
                    removed += 1
                continue
            with self._file_lock(oid):
                with self._lock:
                    kept = self._is_kept(oid)
                if not kept and not self._object_indexed(oid) and stale(f):
                    self._unmark_written(oid)
                    unlink(f)
                    removed += 1
        if removed:
            log.info("removed %d orphan file(s) from the cache", removed)
        return removed


def _uncount(pins: dict[bytes, int], oid: bytes) -> None:
    n = pins.get(oid, 0) - 1
    if n > 0:
        pins[oid] = n
    else:
        pins.pop(oid, None)


def _matches(data: bytes, entry: Entry) -> bool:
    return len(data) == entry[0] and checksum(data) == entry[1]
