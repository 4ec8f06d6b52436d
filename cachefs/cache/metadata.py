"""Directory listings of the bucket, persisted in LMDB with a TTL.

The tree is built lazily, one directory at a time: listing a directory is one
ListObjectsV2 with ``Delimiter='/'`` (all pages). The result replaces that
directory's entries in LMDB in one transaction, so lookups, getattr and
readdir are answered from LMDB without any S3 request until the TTL expires,
including after a remount with the same cache directory.

Mapping keys to names (documented in README):

* ``/`` separates directories. A key ending in ``/`` (a directory marker)
  makes a directory; the marker itself is not a file (one holding data is
  counted as ``marker_with_data``).
* A key that is both an object and a prefix (``a`` and ``a/b``): the
  directory wins and the object ``a`` is hidden (counted as ``shadowed``).
* Names that cannot be file names are skipped and counted by reason: empty
  components (``a//b``), ``.`` and ``..``, longer than 255 bytes, containing NUL.

Concurrency: listings run in worker threads (network + LMDB write
transaction) under the S3 capacity limiter. Concurrent requests for the same
directory share one listing (single flight). Reads of LMDB run on the trio
thread (lock-free snapshots).
"""

from __future__ import annotations

import dataclasses
import logging
import struct
import time
from collections import Counter
from collections.abc import Callable, Iterator

import trio
import xxhash

from cachefs import metrics
from cachefs.cache.lmdbenv import LmdbEnv
from cachefs.s3.store import ObjectInfo, ObjectStore, list_dir

log = logging.getLogger(__name__)

_ENTRY = struct.Struct("<cQd")  # kind, size, mtime; the ETag follows
_DIR = struct.Struct("<dI")  # listed at (unix time), entry count
NAME_MAX = 255


@dataclasses.dataclass(frozen=True, slots=True)
class Entry:
    """One name in a directory: a sub-directory or an object version."""

    name: bytes
    is_dir: bool
    size: int = 0
    mtime: float = 0.0
    etag: str = ""


def invalid_name_reason(name: str) -> str | None:
    """Why ``name`` cannot be a file name, or None when it can."""
    if name == "":
        return "empty"
    if name in (".", ".."):
        return "dot"
    if "\0" in name:
        return "nul"
    if len(name.encode("utf-8", "surrogateescape")) > NAME_MAX:
        return "too_long"
    return None


def dir_key(prefix: str) -> bytes:
    """The LMDB key of a directory: a 16-byte hash of its prefix (LMDB keys are limited
    to 511 bytes, S3 keys to 1024), so an entry's key (dir key + name) is <= 271 bytes
    and a directory's entries are contiguous and sorted by name."""
    return xxhash.xxh3_128_digest(prefix.encode("utf-8", "surrogateescape"))


def _pack_entry(e: Entry) -> bytes:
    return _ENTRY.pack(b"d" if e.is_dir else b"f", e.size, e.mtime) + e.etag.encode()


def _unpack_entry(name: bytes, raw: bytes) -> Entry:
    kind, size, mtime = _ENTRY.unpack_from(raw)
    return Entry(name, kind == b"d", size, mtime, bytes(raw[_ENTRY.size:]).decode())


def entries_from_listing(prefix: str, objects: list[ObjectInfo], prefixes: list[str],
                         skipped: Counter[str]) -> list[Entry]:
    """Turn one directory's listing into its entries (sorted by name), counting skips."""
    files: dict[str, ObjectInfo] = {}
    for obj in objects:
        name = obj.key[len(prefix):]
        if name == "" and obj.key == prefix:
            if obj.size > 0:  # bytes no file name can show: count them, never hide silently
                skipped["marker_with_data"] += 1
            continue  # the directory's own marker object
        reason = invalid_name_reason(name)
        if reason:
            skipped[reason] += 1
            continue
        files[name] = obj
    dirs: set[str] = set()
    for p in prefixes:
        name = p[len(prefix):-1]
        reason = invalid_name_reason(name)
        if reason:
            skipped[reason] += 1
            continue
        dirs.add(name)
    for name in dirs & files.keys():
        skipped["shadowed"] += 1
        del files[name]
    result = [Entry(n.encode(), True) for n in dirs]
    result += [Entry(n.encode(), False, o.size, o.mtime, o.etag) for n, o in files.items()]
    result.sort(key=lambda e: e.name)
    return result


class _Listing:
    """One directory listing in progress, shared by every caller that needs it."""

    __slots__ = ("done", "error")

    def __init__(self) -> None:
        self.done = trio.Event()
        self.error: BaseException | None = None


class Metadata:
    """Listings of one bucket's directories, cached in LMDB.

    ``prefix`` arguments are full S3 key prefixes ("" or ending in "/").
    """

    def __init__(self, env: LmdbEnv, store: ObjectStore, *, ttl: float,
                 limiter: trio.CapacityLimiter, clock: Callable[[], float] = time.time) -> None:
        self._env = env
        self._store = store
        self._ttl = ttl
        self._limiter = limiter
        self._clock = clock
        self._stale: set[str] = set()
        self._inflight: dict[str, _Listing] = {}
        self._dirs = env.db("dirs")
        self._entries = env.db("entries")

    # -- freshness -------------------------------------------------------------
    def listed_at(self, prefix: str) -> float | None:
        with self._env.read() as txn:
            raw = txn.get(dir_key(prefix), db=self._dirs)
        return None if raw is None else float(_DIR.unpack(raw)[0])

    def is_fresh(self, prefix: str) -> bool:
        if prefix in self._stale:
            return False
        at = self.listed_at(prefix)
        return at is not None and self._clock() - at < self._ttl

    def invalidate(self, prefix: str) -> None:
        """Force the next access to ``prefix`` to list it again (e.g. after ESTALE)."""
        self._stale.add(prefix)

    async def ensure(self, prefix: str) -> None:
        """Make sure ``prefix`` has a fresh listing; list it (once, shared) if not.

        Raises StoreError when listing fails and no listing at all is known (every
        caller waiting on that listing gets the same error); a stale listing is kept
        and served when a refresh fails.
        """
        if self.is_fresh(prefix):
            return
        listing = self._inflight.get(prefix)
        if listing is None:
            listing = self._inflight[prefix] = _Listing()
            # Cleared before listing: an invalidate() that arrives while the listing
            # runs must survive it (the listing may predate the change).
            self._stale.discard(prefix)
            try:
                await trio.to_thread.run_sync(self.refresh_sync, prefix, limiter=self._limiter)
            except Exception as exc:
                self._stale.add(prefix)
                if self.listed_at(prefix) is None:
                    listing.error = exc
                    raise
                log.warning("refreshing the listing of %r failed (%s); serving the old one",
                            prefix, exc)
            finally:
                del self._inflight[prefix]
                listing.done.set()
            return
        await listing.done.wait()
        if listing.error is not None and self.listed_at(prefix) is None:
            raise listing.error

    # -- listing (worker threads) -------------------------------------------------
    def refresh_sync(self, prefix: str) -> int:
        """List ``prefix`` from S3 and store it. Blocking: call from a worker thread."""
        objects: list[ObjectInfo] = []
        prefixes: list[str] = []
        for page in list_dir(self._store, prefix):
            objects.extend(page.objects)
            prefixes.extend(page.prefixes)
        metrics.METADATA_LISTINGS.inc()
        skipped: Counter[str] = Counter()
        entries = entries_from_listing(prefix, objects, prefixes, skipped)
        for reason, n in skipped.items():
            metrics.SKIPPED_KEYS.labels(reason).inc(n)
            log.info("%s: skipped %d key(s) (%s)", prefix or "/", n, reason)
        self._store_entries(prefix, entries)
        return len(entries)

    def _store_entries(self, prefix: str, entries: list[Entry]) -> None:
        pb = dir_key(prefix)
        with self._env.write() as txn:
            cur = txn.cursor(db=self._entries)
            if cur.set_range(pb):
                while cur.key().startswith(pb):
                    if not cur.delete():
                        break
            cur.putmulti(((pb + e.name, _pack_entry(e)) for e in entries), append=False)
            txn.put(pb, _DIR.pack(self._clock(), len(entries)), db=self._dirs)

    async def find_file(self, key: str) -> Entry | None:
        """The entry of the object ``key`` (its directory listed if needed), or None when
        no file of that name is listed. Raises StoreError when listing fails."""
        parent = key[:key.rfind("/") + 1]
        await self.ensure(parent)
        entry = self.get(parent, key[len(parent):].encode())
        return None if entry is None or entry.is_dir else entry

    # -- queries (trio thread; no S3) ------------------------------------------
    def get(self, prefix: str, name: bytes) -> Entry | None:
        with self._env.read() as txn:
            raw = txn.get(dir_key(prefix) + name, db=self._entries)
        return None if raw is None else _unpack_entry(name, raw)

    def count(self, prefix: str) -> int:
        with self._env.read() as txn:
            raw = txn.get(dir_key(prefix), db=self._dirs)
        return 0 if raw is None else int(_DIR.unpack(raw)[1])

    def iter_entries(self, prefix: str, after: bytes | None = None) -> Iterator[Entry]:
        """Entries of ``prefix`` in name order, starting after name ``after``."""
        pb = dir_key(prefix)
        start = pb + after if after is not None else pb
        with self._env.read() as txn:
            cur = txn.cursor(db=self._entries)
            if not cur.set_range(start):
                return
            for key, raw in cur:
                if not key.startswith(pb):
                    return
                name = key[len(pb):]
                if after is not None and name == after:
                    continue
                yield _unpack_entry(name, raw)
