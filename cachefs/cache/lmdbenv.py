"""The LMDB environment of a cache directory (the only module that imports lmdb).

One environment, ``DIR/meta.lmdb``, holds every persistent index:

* ``blocks``  block id -> (length, xxh3-64 checksum, last use)       (blockcache)
* ``lru``     last use (big-endian float) + block id -> ""           (blockcache)
* ``listings`` prefix id -> current version, listed at, counts, prefix (metadata)
* ``names``   version + name -> kind, size, mtime, inode, etag        (metadata)
* ``inodes``  inode -> prefix id + name                              (metadata)
* ``stage``   scratch space of manifest loads                         (manifest)
* ``meta``    small values: format version, used bytes, source identity

Concurrency rules:

* Read transactions may run on any thread, the trio thread included (they
  take no lock and never block: LMDB readers are MVCC snapshots).
* Write transactions run only in worker threads (``trio.to_thread``): LMDB
  allows one writer at a time and a writer may wait for another. The trio
  thread never opens one.
* ``sync=False``: commits do not fsync. A background task calls
  :meth:`LmdbEnv.sync` every few seconds and at unmount. A process crash loses
  nothing (the OS has the pages); a power loss may lose recent commits, which
  for a cache means re-fetching. A block whose data did not reach the disk is
  caught by its checksum. If the environment cannot be opened at all, the
  cache directory is wiped and started afresh (the cache is best-effort).
"""

from __future__ import annotations

import logging
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import lmdb

from cachefs.errors import CacheError

log = logging.getLogger(__name__)

FORMAT_VERSION = b"1"
DB_NAMES = (b"blocks", b"lru", b"listings", b"names", b"inodes", b"stage", b"meta")
# Databases of earlier layouts, dropped at open (listings are only a cache).
_OLD_DB_NAMES = (b"dirs", b"entries")

# Virtual size of the memory map. LMDB files are sparse; this only bounds growth.
_MAP_SIZE = 64 << 30
# Reader slots: one per open read transaction (py-lmdb uses MDB_NOTLS). Transactions
# are short, so this only has to cover the concurrency of requests and threads.
_MAX_READERS = 8192


class LmdbEnv:
    """Owns the environment and its named databases."""

    def __init__(self, path: Path, map_size: int = _MAP_SIZE) -> None:
        self.path = path
        self.env = self._open(path, map_size)
        self._drop_old()
        self.dbs = {name.decode(): self.env.open_db(name) for name in DB_NAMES}
        with self.env.begin(write=True) as txn:
            version = txn.get(b"format", db=self.dbs["meta"])
            if version is None:
                txn.put(b"format", FORMAT_VERSION, db=self.dbs["meta"])
        if version not in (None, FORMAT_VERSION):
            raise CacheError(f"cache metadata in {path} has format {version!r}; this cachefs "
                             f"uses {FORMAT_VERSION!r}: remove the cache directory to start over")

    @staticmethod
    def _open(path: Path, map_size: int) -> Any:
        def do_open() -> Any:
            # Private to the mounting user whatever the umask (the index names every
            # cached key). lmdb.open would create the directory with the file mode.
            try:
                path.mkdir(mode=0o700, exist_ok=True)
            except OSError as exc:
                raise CacheError(f"cannot create cache metadata {path}: {exc.strerror}") from None
            return lmdb.open(
                str(path), map_size=map_size, max_dbs=len(DB_NAMES) + 2, max_readers=_MAX_READERS,
                sync=False, metasync=False, readahead=False, subdir=True, lock=True, mode=0o600,
            )
        try:
            return do_open()
        except lmdb.Error as exc:
            if isinstance(exc, (lmdb.ReadonlyError,)) or "Permission" in str(exc):
                raise CacheError(f"cannot open cache metadata {path}: {exc}") from exc
            log.warning("cache metadata %s is unreadable (%s); starting an empty cache", path, exc)
            shutil.rmtree(path, ignore_errors=True)
            try:
                return do_open()
            except lmdb.Error as exc2:
                raise CacheError(f"cannot open cache metadata {path}: {exc2}") from exc2

    def _drop_old(self) -> None:
        with self.env.begin(write=True) as txn:
            for name in _OLD_DB_NAMES:
                if txn.get(name) is not None:
                    txn.drop(self.env.open_db(name, txn=txn), delete=True)
                    log.info("dropped the listings of an earlier cachefs version (%s)",
                             name.decode())

    def db(self, name: str) -> Any:
        return self.dbs[name]

    @contextmanager
    def read(self) -> Iterator[Any]:
        """A read-only snapshot. Safe on the trio thread."""
        try:
            txn = self.env.begin(write=False, buffers=False)
        except lmdb.ReadersFullError as exc:
            active = len(self.env.readers().splitlines()) - 1
            raise CacheError(f"cache metadata: all {_MAX_READERS} reader slots in use "
                             f"({active} listed)") from exc
        with txn:
            yield txn

    @contextmanager
    def write(self) -> Iterator[Any]:
        """A write transaction. Worker threads only (it may wait for the writer lock)."""
        try:
            with self.env.begin(write=True) as txn:
                yield txn
        except lmdb.MapFullError as exc:
            raise CacheError("cache metadata is full") from exc
        except lmdb.Error as exc:
            raise CacheError(f"cache metadata write failed: {exc}") from exc

    def sync(self) -> None:
        """Flush commits to disk (blocks: worker threads only)."""
        self.env.sync(True)

    def close(self) -> None:
        try:
            self.env.sync(True)
        finally:
            self.env.close()


    def drop(self, name: str) -> None:
        """Empty one database (worker threads only)."""
        with self.write() as txn:
            txn.drop(self.dbs[name], delete=False)

