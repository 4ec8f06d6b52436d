"""The persistent block cache on local disk.

Layout of the cache directory::

    DIR/objects/ab/ab12...ef     one sparse file per object version, named by its
                                 object id (hex); block i lives at its own offset
    DIR/meta.lmdb/               the index (see cachefs.cache.lmdbenv)

An object version's id is ``xxh3_128(bucket, key, etag, block_size)``; a
block's id is that object id followed by the block's byte offset (8 bytes,
big-endian), so a new version of an object never meets the old one's blocks
and the index keeps the blocks of one object next to each other. The index
maps block id -> (length, xxh3-64 checksum, last use); ``lru`` orders ids by
last use. Keeping a whole object in one file is what lets the kernel read a
fully cached object itself (FUSE passthrough, see :mod:`cachefs.passthrough`).

Contracts:

* :meth:`BlockCache.get` returns the block's exact bytes or None. Every read
  is verified against length and checksum; a mismatch or a missing file drops
  the entry, counts ``cachefs_cache_corrupt_blocks_total`` and returns None
  (a miss, never an error: S3 is the truth). :meth:`verify_object` checks a
  whole object the same way before its file is handed to the kernel.
* :meth:`BlockCache.put` is best-effort: it returns False when the block was
  not admitted (cache full under the ``keep`` policy, disk full, I/O error).
* A block's bytes are written before the index names it. A crash leaves at
  worst bytes no entry names (an object file without entries is removed by
  the start-up scan; a hole inside one is harmless) or an entry whose bytes
  are torn (caught by the checksum).
* Bytes of a dropped block are released with a hole punched into the object
  file; the file is removed when the index names none of its blocks. Objects
  pinned by :meth:`pin` (open for passthrough) are never evicted.

Policies: ``keep`` admits until the cache is full and then keeps what it has
(the optimum for a fresh random permutation every epoch over a dataset larger
than the cache: hit ratio = cache/dataset, where LRU gets
c + (1-c) ln(1-c)); ``lru`` evicts least recently used blocks to make room.

Concurrency: index reads happen on the trio thread. File I/O, checksums and
index writes run in worker threads under the disk CapacityLimiter. Last-use
updates are collected in memory (``_touched``, trio thread) and written in
batches by :meth:`flush_touches` (a worker thread). ``_used``, ``_count`` and
``_pinned`` are guarded by ``_lock`` because worker threads update them.
Writing a block and indexing it, and deciding to remove an object file, hold
the object's stripe lock (``_file_lock``), so a file is never removed while
a block put into it is still unindexed. A thread holds at most one stripe
lock and never takes one while inside an LMDB write transaction.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import shutil
import struct
import threading
import time
from pathlib import Path

import trio
import xxhash

from cachefs import metrics
from cachefs.cache.lmdbenv import LmdbEnv
from cachefs.errors import CacheError

log = logging.getLogger(__name__)

_BLOCK = struct.Struct("<IQd")  # length, xxh3-64, last use
_LRU_TIME = struct.Struct(">d")  # big-endian so byte order == time order (times are > 0)
_OFFSET = struct.Struct(">Q")  # big-endian so the blocks of one object sort by offset
_USED_KEY = b"used_bytes"
_LAYOUT_KEY = b"layout"
_LAYOUT = b"objects-v2"
_LEGACY_DIRS = ("blocks", "tmp")  # the one-file-per-block layout of earlier versions
OID_LEN = 16
POLICIES = ("keep", "lru")
_STRIPES = 64
_PAGE = 4096
_FALLOC_FL_KEEP_SIZE = 0x01
_FALLOC_FL_PUNCH_HOLE = 0x02


def object_id(bucket: str, key: str, etag: str, block_size: int) -> bytes:
    """The 16-byte id of one object version cut into ``block_size`` blocks."""
    return xxhash.xxh3_128_digest(f"{bucket}\0{key}\0{etag}\0{block_size}".encode())


def block_id(bucket: str, key: str, etag: str, block_size: int, index: int) -> bytes:
    """The 24-byte id of block ``index``: its object id, then its byte offset."""
    return block_id_at(object_id(bucket, key, etag, block_size), index * block_size)


def block_id_at(oid: bytes, offset: int) -> bytes:
    """The id of the block at byte ``offset`` of object ``oid``."""
    return oid + _OFFSET.pack(offset)


def split_block_id(bid: bytes) -> tuple[bytes, int]:
    """(object id, byte offset in the object) of a block id."""
    return bid[:OID_LEN], _OFFSET.unpack_from(bid, OID_LEN)[0]


def checksum(data: bytes) -> int:
    return xxhash.xxh3_64_intdigest(data)


class BlockCache:
    """Blocks on local disk with an LMDB index and a byte capacity."""

    def __init__(self, env: LmdbEnv, root: Path, *, capacity: int, policy: str = "keep",
                 limiter: trio.CapacityLimiter | None = None) -> None:
        if policy not in POLICIES:
            raise ValueError(f"unknown cache policy {policy!r}")
        self._env = env
        self._blocks_db = env.db("blocks")
        self._lru_db = env.db("lru")
        self._meta_db = env.db("meta")
        self.root = root
        self.objects_dir = root / "objects"
        self.capacity = capacity
        self.policy = policy
        self._limiter = limiter or trio.CapacityLimiter(16)
        self._lock = threading.Lock()
        self._file_locks = [threading.Lock() for _ in range(_STRIPES)]
        self._pinned: dict[bytes, int] = {}
        self._touched: dict[bytes, float] = {}
        self._punch_warned = False
        try:
            self.objects_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        except OSError as exc:
            raise CacheError(f"cannot create cache directories in {root}: {exc.strerror}") from exc
        self._adopt_layout()
        with env.read() as txn:
            raw = txn.get(_USED_KEY, db=self._meta_db)
            self._used = int(raw) if raw else 0
            self._count = txn.stat(self._blocks_db)["entries"]
        metrics.CACHE_CAPACITY_BYTES.set(capacity)
        self._publish()

    def _adopt_layout(self) -> None:
        """An index written by an earlier layout is dropped (the cache is best-effort);
        its files are removed by :meth:`remove_orphans`."""
        with self._env.write() as txn:
            if txn.get(_LAYOUT_KEY, db=self._meta_db) == _LAYOUT:
                return
            if txn.stat(self._blocks_db)["entries"]:
                log.info("the cache directory holds an older layout: starting with an empty cache")
            txn.drop(self._blocks_db, delete=False)
            txn.drop(self._lru_db, delete=False)
            txn.put(_USED_KEY, b"0", db=self._meta_db)
            txn.put(_LAYOUT_KEY, _LAYOUT, db=self._meta_db)

    # -- accounting ----------------------------------------------------------------
    @property
    def used(self) -> int:
        return self._used

    @property
    def block_count(self) -> int:
        return int(self._count)

    def _publish(self) -> None:
        metrics.CACHE_USED_BYTES.set(self._used)
        metrics.CACHE_BLOCKS.set(self._count)

    def object_path(self, oid: bytes) -> Path:
        h = oid.hex()
        return self.objects_dir / h[:2] / h

    def location(self, bid: bytes) -> tuple[Path, int]:
        """(object file, byte offset) where block ``bid`` is stored."""
        oid, offset = split_block_id(bid)
        return self.object_path(oid), offset

    def _file_lock(self, oid: bytes) -> threading.Lock:
        return self._file_locks[oid[0] % _STRIPES]

    # -- pins (objects whose file the kernel reads directly) ----------------------------
    def pin(self, oid: bytes) -> None:
        """Keep every block of ``oid`` from eviction until the matching :meth:`unpin`."""
        with self._lock:
            self._pinned[oid] = self._pinned.get(oid, 0) + 1

    def unpin(self, oid: bytes) -> None:
        with self._lock:
            n = self._pinned.get(oid, 0) - 1
            if n > 0:
                self._pinned[oid] = n
            else:
                self._pinned.pop(oid, None)

    # -- lookups (trio thread) ------------------------------------------------------
    def contains(self, bid: bytes) -> bool:
        with self._env.read() as txn:
            return txn.get(bid, db=self._blocks_db) is not None

    def length_of(self, bid: bytes) -> int | None:
        with self._env.read() as txn:
            raw = txn.get(bid, db=self._blocks_db)
        return None if raw is None else int(_BLOCK.unpack(raw)[0])

    def contains_all(self, bids: list[bytes]) -> bool:
        """Whether every block is indexed (one read transaction)."""
        with self._env.read() as txn:
            return all(txn.get(b, db=self._blocks_db) is not None for b in bids)

    async def get(self, bid: bytes) -> bytes | None:
        """The verified bytes of block ``bid``, or None (miss, or dropped as corrupt)."""
        with self._env.read() as txn:
            raw = txn.get(bid, db=self._blocks_db)
        if raw is None:
            return None
        length, digest, _ = _BLOCK.unpack(raw)
        data = await trio.to_thread.run_sync(self._read_verified, bid, length, digest,
                                             limiter=self._limiter)
        if data is not None:
            self._touched[bid] = time.time()
        return data

    def _read_verified(self, bid: bytes, length: int, digest: int) -> bytes | None:
        path, offset = self.location(bid)
        try:
            fd = os.open(path, os.O_RDONLY)
            try:
                data = os.pread(fd, length, offset)
            finally:
                os.close(fd)
        except FileNotFoundError:
            if not self._indexed(bid):
                return None  # evicted between the index lookup and the read: a plain miss
            log.warning("cached block %s is missing; refetching", bid.hex())
            self._drop_corrupt(bid)
            return None
        except OSError as exc:
            log.warning("cached block %s unreadable (%s); refetching", bid.hex(), exc)
            self._drop_corrupt(bid)
            return None
        if len(data) != length or checksum(data) != digest:
            log.warning("cached block %s failed verification (%d bytes, expected %d); "
                        "refetching", bid.hex(), len(data), length)
            self._drop_corrupt(bid)
            return None
        return data

    def verify_object(self, bids: list[bytes]) -> int | None:
        """Check every block of one object against the index (worker thread).

        Returns the number of bytes verified, or None when a block is not indexed,
        is missing or fails its checksum (a failing block is dropped as corrupt).
        Reading the file also leaves it in the page cache, where the kernel's own
        reads of it then find it.
        """
        with self._env.read() as txn:
            raws = [txn.get(b, db=self._blocks_db) for b in bids]
        if not bids or any(r is None for r in raws):
            return None
        path = self.object_path(split_block_id(bids[0])[0])
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            return None
        total = 0
        try:
            for bid, raw in zip(bids, raws, strict=True):
                length, digest, _ = _BLOCK.unpack(raw)  # type: ignore[arg-type]
                try:
                    data = os.pread(fd, length, split_block_id(bid)[1])
                except OSError as exc:
                    log.warning("cached block %s unreadable (%s); refetching", bid.hex(), exc)
                    self._drop_corrupt(bid)
                    return None
                if len(data) != length or checksum(data) != digest:
                    log.warning("cached block %s failed verification; refetching", bid.hex())
                    self._drop_corrupt(bid)
                    return None
                total += length
        finally:
            os.close(fd)
        now = time.time()
        for bid in bids:
            self._touched[bid] = now  # a dict store: safe to race the trio thread's take
        return total

    def _indexed(self, bid: bytes) -> bool:
        with self._env.read() as txn:
            return txn.get(bid, db=self._blocks_db) is not None

    def _drop_corrupt(self, bid: bytes) -> None:
        metrics.CACHE_CORRUPT_BLOCKS.inc()
        try:
            self._remove([bid])
        except CacheError:
            log.exception("could not drop corrupt block %s", bid.hex())

    # -- admission (worker threads) ----------------------------------------------------
    async def put(self, bid: bytes, data: bytes) -> bool:
        """Store a block; False when it was not admitted. Never raises for disk trouble."""
        if self.contains(bid):
            return True
        if self.policy == "keep" and self._used + len(data) > self.capacity:
            metrics.CACHE_ADMISSION_REJECTS.inc()
            return False
        return await trio.to_thread.run_sync(self.put_sync, bid, data, limiter=self._limiter)

    def put_sync(self, bid: bytes, data: bytes) -> bool:
        if len(data) > self.capacity:
            metrics.CACHE_ADMISSION_REJECTS.inc()
            return False
        oid, offset = split_block_id(bid)
        path = self.object_path(oid)
        with self._file_lock(oid):
            try:
                _write_at(path, data, offset)
            except OSError as exc:
                metrics.CACHE_WRITE_ERRORS.inc()
                log.warning("cannot write block to the cache (%s); serving from memory", exc.strerror)
                self._release_bytes(oid, [(offset, len(data))])
                return False
            try:
                admitted, evicted = self._index_put(bid, len(data), checksum(data))
            except CacheError as exc:
                metrics.CACHE_WRITE_ERRORS.inc()
                log.warning("cannot index block: %s", exc)
                admitted, evicted = False, []
            if not admitted:
                self._release_bytes(oid, [(offset, len(data))])
        self._release_blocks(evicted)
        return admitted

    def _index_put(self, bid: bytes, length: int, digest: int) -> tuple[bool, list[tuple[bytes, int]]]:
        now = time.time()
        evicted: list[tuple[bytes, int]] = []
        with self._lock:
            pinned = set(self._pinned)
        with self._env.write() as txn:
            if txn.get(bid, db=self._blocks_db) is not None:
                return True, []
            raw_used = txn.get(_USED_KEY, db=self._meta_db)
            used = int(raw_used) if raw_used else 0
            evicted_bytes = 0
            if used + length > self.capacity:
                if self.policy == "keep":
                    metrics.CACHE_ADMISSION_REJECTS.inc()
                    return False, []
                cur = txn.cursor(db=self._lru_db)
                cur.first()
                while used - evicted_bytes + length > self.capacity and cur.key():
                    old = bytes(cur.key()[_LRU_TIME.size:])
                    if old[:OID_LEN] in pinned:
                        if not cur.next():
                            break
                        continue
                    cur.delete()  # moves to the next entry
                    raw = txn.pop(old, db=self._blocks_db)
                    if raw is not None:
                        n = _BLOCK.unpack(raw)[0]
                        evicted_bytes += n
                        evicted.append((old, n))
                if used - evicted_bytes + length > self.capacity:
                    # Only pinned blocks are left to evict: do not admit (nothing is lost,
                    # the evictions already made stand).
                    txn.put(_USED_KEY, str(used - evicted_bytes).encode(), db=self._meta_db)
                    self._account(used - evicted_bytes, -len(evicted), evicted_bytes, len(evicted))
                    metrics.CACHE_ADMISSION_REJECTS.inc()
                    return False, evicted
            txn.put(bid, _BLOCK.pack(length, digest, now), db=self._blocks_db)
            txn.put(_LRU_TIME.pack(now) + bid, b"", db=self._lru_db)
            new_used = used - evicted_bytes + length
            txn.put(_USED_KEY, str(new_used).encode(), db=self._meta_db)
        self._account(new_used, 1 - len(evicted), evicted_bytes, len(evicted))
        return True, evicted

    def _account(self, used: int, count_delta: int, evicted_bytes: int, evicted: int) -> None:
        with self._lock:
            self._used = used
            self._count += count_delta
        if evicted:
            metrics.CACHE_EVICTIONS.inc(evicted)
            metrics.CACHE_EVICTED_BYTES.inc(evicted_bytes)
        self._publish()

    def _remove(self, bids: list[bytes]) -> None:
        """Drop blocks from the index, then their bytes (worker threads)."""
        removed_bytes = 0
        removed: list[tuple[bytes, int]] = []
        with self._env.write() as txn:
            raw_used = txn.get(_USED_KEY, db=self._meta_db)
            used = int(raw_used) if raw_used else 0
            for bid in bids:
                raw = txn.pop(bid, db=self._blocks_db)
                if raw is None:
                    continue
                length, _, last = _BLOCK.unpack(raw)
                txn.delete(_LRU_TIME.pack(last) + bid, db=self._lru_db)
                removed_bytes += length
                removed.append((bid, length))
            used = max(0, used - removed_bytes)
            txn.put(_USED_KEY, str(used).encode(), db=self._meta_db)
        with self._lock:
            self._used = used
            self._count -= len(removed)
        self._publish()
        self._release_blocks(removed)

    def _release_blocks(self, blocks: list[tuple[bytes, int]]) -> None:
        """Free the bytes of blocks the index no longer names (worker thread)."""
        by_object: dict[bytes, list[tuple[int, int]]] = {}
        for bid, length in blocks:
            oid, offset = split_block_id(bid)
            by_object.setdefault(oid, []).append((offset, length))
        for oid, ranges in by_object.items():
            with self._file_lock(oid):
                self._release_bytes(oid, ranges)

    def _release_bytes(self, oid: bytes, ranges: list[tuple[int, int]]) -> None:
        """Remove the object's file if no block of it is indexed, else punch the ranges
        out of it. The caller holds the object's stripe lock."""
        path = self.object_path(oid)
        if not self._object_indexed(oid):
            _unlink(path)
            return
        try:
            fd = os.open(path, os.O_WRONLY)
        except OSError:
            return
        try:
            for offset, length in ranges:
                # Blocks start on multiples of the block size (a power of two >= 64 KiB),
                # and only an object's last block is short, so rounding the end up to
                # the page frees the tail page without touching another block's bytes.
                length = -(-(offset + length) // _PAGE) * _PAGE - offset
                if not _punch_hole(fd, offset, length) and not self._punch_warned:
                    self._punch_warned = True
                    log.warning("the cache file system cannot punch holes: evicted blocks of "
                                "partly cached objects keep their disk space until the object goes")
        finally:
            os.close(fd)

    def _object_indexed(self, oid: bytes) -> bool:
        """Whether any block of ``oid`` is in the index (blocks of one object sort together)."""
        with self._env.read() as txn:
            cur = txn.cursor(db=self._blocks_db)
            return bool(cur.set_range(oid)) and bytes(cur.key()[:OID_LEN]) == oid

    # -- maintenance (worker threads, driven by the daemon) -----------------------------
    def take_touches(self) -> dict[bytes, float]:
        """Hand over pending last-use updates (trio thread)."""
        touched, self._touched = self._touched, {}
        return touched

    def flush_touches(self, touched: dict[bytes, float]) -> None:
        """Write last-use times in one transaction (worker thread)."""
        if not touched:
            return
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

    def remove_orphans(self, older_than: float) -> int:
        """Delete files the index does not name (worker thread): object files with no
        indexed block, stray files, and the directories of an earlier layout.

        Only files last modified before ``older_than`` (the daemon's start) are
        considered: a block is written just before it is indexed, so a younger
        file without entries may be a put in progress, not an orphan.
        """
        removed = 0
        for legacy in _LEGACY_DIRS:
            if (self.root / legacy).is_dir():
                shutil.rmtree(self.root / legacy, ignore_errors=True)
                removed += 1

        def stale(path: Path) -> bool:
            try:
                return path.stat().st_mtime < older_than
            except FileNotFoundError:
                return False

        for sub in self.objects_dir.iterdir():
            if not sub.is_dir():
                continue
            for f in sub.iterdir():
                try:
                    oid = bytes.fromhex(f.name)
                except ValueError:
                    oid = b""
                if len(oid) != OID_LEN:
                    if stale(f):
                        _unlink(f)
                        removed += 1
                    continue
                with self._file_lock(oid):
                    if not self._object_indexed(oid) and stale(f):
                        _unlink(f)
                        removed += 1
        if removed:
            log.info("removed %d orphan file(s) from the cache", removed)
        return removed


def _write_at(path: Path, data: bytes, offset: int) -> None:
    """Write ``data`` at ``offset`` of ``path`` (created with its directory if missing).
    Cached bytes are private to the mounting user whatever the umask (files 0600,
    directories 0700): the mount's permissions must not be bypassed through the cache."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o600)
    except FileNotFoundError:
        path.parent.mkdir(exist_ok=True, mode=0o700)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        view = memoryview(data)
        while view:
            n = os.pwrite(fd, view, offset)
            view, offset = view[n:], offset + n
    finally:
        os.close(fd)


_libc = ctypes.CDLL(None, use_errno=True)
_libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long]


def _punch_hole(fd: int, offset: int, length: int) -> bool:
    """Free ``length`` bytes at ``offset`` (they read back as zeros); False if unsupported."""
    if _libc.fallocate(fd, _FALLOC_FL_PUNCH_HOLE | _FALLOC_FL_KEEP_SIZE, offset, length) == 0:
        return True
    err = ctypes.get_errno()
    if err not in (errno.EOPNOTSUPP, errno.ENOSYS):
        log.warning("cannot free evicted cache bytes: %s", os.strerror(err))
    return False


def _unlink(path: Path) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    except OSError as exc:
        log.warning("cannot remove %s: %s", path, exc.strerror)
