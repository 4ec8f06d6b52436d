"""The persistent block cache on local disk.

Layout of the cache directory::

    DIR/blocks/ab/ab12...ef      one file per block, named by its block id (hex)
    DIR/tmp/                     blocks being written (temp file, then rename)
    DIR/meta.lmdb/               the index (see cachefs.lmdbenv)

A block is bytes ``[i * block_size, (i+1) * block_size)`` of one object
version; its id is ``xxh3_128(bucket, key, etag, block_size, i)``, so a new
version of an object never meets the old one's blocks. The index maps id ->
(length, xxh3-64 checksum, last use); ``lru`` orders ids by last use.

Contracts:

* :meth:`BlockCache.get` returns the block's exact bytes or None. Every read
  is verified against length and checksum; a mismatch or a missing file drops
  the entry, counts ``cachefs_cache_corrupt_blocks_total`` and returns None
  (a miss, never an error: S3 is the truth).
* :meth:`BlockCache.put` is best-effort: it returns False when the block was
  not admitted (cache full under the ``keep`` policy, disk full, I/O error).
* A block file is complete before the index names it: write to DIR/tmp, rename
  into place, then commit the index entry. A crash leaves at worst an orphan
  file (removed by the start-up scan) or an entry whose file is missing or
  torn (caught by the checksum).

Policies: ``keep`` admits until the cache is full and then keeps what it has
(the optimum for a fresh random permutation every epoch over a dataset larger
than the cache: hit ratio = cache/dataset, where LRU gets
c + (1-c) ln(1-c)); ``lru`` evicts least recently used blocks to make room.

Concurrency: index reads happen on the trio thread. File I/O, checksums and
index writes run in worker threads under the disk CapacityLimiter. Last-use
updates are collected in memory (``_touched``, trio thread) and written in
batches by :meth:`flush_touches` (a worker thread). ``_used`` is guarded by
``_lock`` because worker threads update it.
"""

from __future__ import annotations

import logging
import os
import struct
import threading
import time
from pathlib import Path

import trio
import xxhash

from cachefs import metrics
from cachefs.errors import CacheError
from cachefs.lmdbenv import LmdbEnv

log = logging.getLogger(__name__)

_BLOCK = struct.Struct("<IQd")  # length, xxh3-64, last use
_LRU_TIME = struct.Struct(">d")  # big-endian so byte order == time order (times are > 0)
_USED_KEY = b"used_bytes"
POLICIES = ("keep", "lru")


def block_id(bucket: str, key: str, etag: str, block_size: int, index: int) -> bytes:
    """The 16-byte id of block ``index`` of one object version."""
    return xxhash.xxh3_128_digest(f"{bucket}\0{key}\0{etag}\0{block_size}\0{index}".encode())


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
        self.blocks_dir = root / "blocks"
        self.tmp_dir = root / "tmp"
        self.capacity = capacity
        self.policy = policy
        self._limiter = limiter or trio.CapacityLimiter(16)
        self._lock = threading.Lock()
        self._touched: dict[bytes, float] = {}
        try:
            self.blocks_dir.mkdir(parents=True, exist_ok=True)
            self.tmp_dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise CacheError(f"cannot create cache directories in {root}: {exc.strerror}") from exc
        with env.read() as txn:
            raw = txn.get(_USED_KEY, db=self._meta_db)
            self._used = int(raw) if raw else 0
            self._count = txn.stat(self._blocks_db)["entries"]
        metrics.CACHE_CAPACITY_BYTES.set(capacity)
        self._publish()

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

    def path_of(self, bid: bytes) -> Path:
        h = bid.hex()
        return self.blocks_dir / h[:2] / h

    # -- lookups (trio thread) ------------------------------------------------------
    def contains(self, bid: bytes) -> bool:
        with self._env.read() as txn:
            return txn.get(bid, db=self._blocks_db) is not None

    def length_of(self, bid: bytes) -> int | None:
        with self._env.read() as txn:
            raw = txn.get(bid, db=self._blocks_db)
        return None if raw is None else int(_BLOCK.unpack(raw)[0])

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
        path = self.path_of(bid)
        try:
            with open(path, "rb") as f:
                data = f.read(length + 1)
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
        path = self.path_of(bid)
        tmp = self.tmp_dir / f"{bid.hex()}.{threading.get_ident()}"
        try:
            with open(tmp, "wb") as f:
                f.write(data)
            try:
                os.rename(tmp, path)
            except FileNotFoundError:
                path.parent.mkdir(exist_ok=True)
                os.rename(tmp, path)
        except OSError as exc:
            metrics.CACHE_WRITE_ERRORS.inc()
            log.warning("cannot write block to the cache (%s); serving from memory", exc.strerror)
            _unlink(tmp)
            return False
        try:
            admitted, evicted = self._index_put(bid, len(data), checksum(data))
        except CacheError as exc:
            metrics.CACHE_WRITE_ERRORS.inc()
            log.warning("cannot index block: %s", exc)
            admitted, evicted = False, []
        for old in evicted:
            _unlink(self.path_of(old))
        if not admitted:
            _unlink(path)
        return admitted

    def _index_put(self, bid: bytes, length: int, digest: int) -> tuple[bool, list[bytes]]:
        now = time.time()
        evicted: list[bytes] = []
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
                    cur.delete()
                    raw = txn.pop(old, db=self._blocks_db)
                    if raw is not None:
                        evicted_bytes += _BLOCK.unpack(raw)[0]
                        evicted.append(old)
            txn.put(bid, _BLOCK.pack(length, digest, now), db=self._blocks_db)
            txn.put(_LRU_TIME.pack(now) + bid, b"", db=self._lru_db)
            new_used = used - evicted_bytes + length
            txn.put(_USED_KEY, str(new_used).encode(), db=self._meta_db)
        with self._lock:
            self._used = new_used
            self._count += 1 - len(evicted)
        if evicted:
            metrics.CACHE_EVICTIONS.inc(len(evicted))
            metrics.CACHE_EVICTED_BYTES.inc(evicted_bytes)
        self._publish()
        return True, evicted

    def _remove(self, bids: list[bytes]) -> None:
        """Drop blocks from the index, then their files (worker threads)."""
        removed_bytes = 0
        removed = 0
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
                removed += 1
            used = max(0, used - removed_bytes)
            txn.put(_USED_KEY, str(used).encode(), db=self._meta_db)
        with self._lock:
            self._used = used
            self._count -= removed
        for bid in bids:
            _unlink(self.path_of(bid))
        self._publish()

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
        """Delete temp files and block files the index does not name (worker thread).

        Only files last modified before ``older_than`` (the daemon's start) are
        considered: a block is renamed into place just before it is indexed, so
        a younger unindexed file may be a put in progress, not an orphan.
        """
        removed = 0

        def stale(path: Path) -> bool:
            try:
                return path.stat().st_mtime < older_than
            except FileNotFoundError:
                return False

        for tmp in self.tmp_dir.iterdir():
            if stale(tmp):
                _unlink(tmp)
                removed += 1
        for sub in self.blocks_dir.iterdir():
            if not sub.is_dir():
                continue
            for f in sub.iterdir():
                try:
                    bid = bytes.fromhex(f.name)
                except ValueError:
                    bid = b""
                if (len(bid) != 16 or not self._indexed(bid)) and stale(f):
                    _unlink(f)
                    removed += 1
        if removed:
            log.info("removed %d orphan file(s) from the cache", removed)
        return removed


def _unlink(path: Path) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    except OSError as exc:
        log.warning("cannot remove %s: %s", path, exc.strerror)
