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
* **A transaction never lives across an ``await``.** Each read transaction
  holds one of :data:`MAX_READERS` reader slots until the Python Transaction
  object is freed (py-lmdb opens them with MDB_NOTLS and releases the slot only
  on deallocation, not when the ``with`` block ends), so a ``txn`` variable left
  in a coroutine's frame keeps its slot while the coroutine waits. Read in
  small synchronous helpers that return values (:meth:`LmdbEnv.get`,
  :meth:`LmdbEnv.get_many`, or a function of one's own around
  :meth:`LmdbEnv.read`); the slots in use are then bounded by the threads
  that read (the trio thread plus the worker threads of the limiters), and
  exported as ``cachefs_lmdb_readers``.
* Write transactions run only in worker threads (``trio.to_thread``): LMDB
  allows one writer at a time and a writer may wait for another. The trio
  thread never opens one.
* Every LMDB error surfaces as :class:`~cachefs.errors.CacheError`; callers on
  the read path treat it as a cache miss (S3 is the truth).
* ``sync=False``: commits do not fsync. A background task calls
  :meth:`LmdbEnv.sync` every few seconds and at unmount. A process crash loses
  nothing (the OS has the pages); a power loss may lose recent commits, which
  for a cache means re-fetching. A block whose data did not reach the disk is
  caught by its checksum.

Damage: an index that cannot be opened or read (torn by a power loss, bytes
overwritten, a plain file where its directory should be) is wiped, with one
line in the log, and the cache starts empty (the cache is best-effort). With
``check=True`` (the daemon) every page of every database is read first, in a
child process: LMDB aborts the process on some kinds of damage, which must not
take the daemon with it.
"""

from __future__ import annotations

import ctypes
import logging
import os
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

import lmdb

from cachefs import metrics
from cachefs.errors import CacheError

log = logging.getLogger(__name__)
T = TypeVar("T")

_READ_TXNS = metrics.LMDB_TRANSACTIONS.counters["read"]
_WRITE_TXNS = metrics.LMDB_TRANSACTIONS.counters["write"]

FORMAT_VERSION = b"1"
_FALLOC_FL_KEEP_SIZE = 1
_libc = ctypes.CDLL(None, use_errno=True)
_fallocate = _libc.fallocate
_fallocate.argtypes = (ctypes.c_int, ctypes.c_int, ctypes.c_longlong, ctypes.c_longlong)
_fallocate.restype = ctypes.c_int
DB_NAMES = (b"blocks", b"lru", b"listings", b"names", b"inodes", b"stage", b"meta")
# Databases of earlier layouts, dropped at open (listings are only a cache).
_OLD_DB_NAMES = (b"dirs", b"entries")

# Virtual size of the memory map. LMDB files are sparse; this only bounds growth.
_MAP_SIZE = 64 << 30
#: Reader slots: one per live read transaction (see the module docstring). Only the
#: threads that read need one each, so this is far more than is ever used.
MAX_READERS = 8192
#: How long the check of a whole index may take before it is abandoned (not wiped).
CHECK_TIMEOUT = 300.0

# Run by the check in a child process: read every page of every database.
_CHECK_SCRIPT = """
import sys, lmdb
env = lmdb.open(sys.argv[1], readonly=True, lock=False, subdir=True, readahead=False,
                max_dbs=64, map_size=int(sys.argv[2]))
with env.begin() as txn:
    names = [bytes(k) for k, _ in txn.cursor()]
    for name in names:
        db = env.open_db(name, txn=txn, create=False)
        for _ in txn.cursor(db=db).iternext(keys=True, values=True):
            pass
"""


class _NotADirectory(Exception):
    """Something other than a directory is where the index should be."""


class LmdbEnv:
    """Owns the environment and its named databases."""

    def __init__(self, path: Path, map_size: int = _MAP_SIZE, *, max_readers: int = MAX_READERS,
                 check: bool = False) -> None:
        self.path = path
        self.max_readers = max_readers
        if check:
            problem = _check(path, map_size)
            if problem is not None:
                _wipe(path, problem)
        try:
            self.env, self.dbs, version = self._open(path, map_size)
        except (lmdb.Error, _NotADirectory) as exc:
            if isinstance(exc, lmdb.ReadonlyError) or "Permission" in str(exc):
                raise CacheError(f"cannot open cache metadata {path}: {exc}") from exc
            _wipe(path, str(exc))
            try:
                self.env, self.dbs, version = self._open(path, map_size)
            except (lmdb.Error, _NotADirectory) as exc2:
                raise CacheError(f"cannot open cache metadata {path}: {exc2}") from exc2
        if version not in (None, FORMAT_VERSION):
            self.env.close()
            raise CacheError(f"cache metadata in {path} has format {version!r}; this cachefs "
                             f"uses {FORMAT_VERSION!r}: remove the cache directory to start over")
        self._reserve_warned = False
        metrics.LMDB_READER_SLOTS.set(max_readers)
        metrics.LMDB_READERS.set_function(self.readers_in_use)

    def _open(self, path: Path, map_size: int) -> tuple[Any, dict[str, Any], bytes | None]:
        # Private to the mounting user whatever the umask (the index names every
        # cached key). lmdb.open would create the directory with the file mode.
        try:
            path.mkdir(mode=0o700, exist_ok=True)
        except FileExistsError:
            raise _NotADirectory(f"{path}: not a directory") from None
        except OSError as exc:
            raise CacheError(f"cannot create cache metadata {path}: {exc.strerror}") from None
        env = lmdb.open(
            str(path), map_size=map_size, max_dbs=len(DB_NAMES) + 2,
            max_readers=self.max_readers, sync=False, metasync=False, readahead=False,
            subdir=True, lock=True, mode=0o600,
        )
        try:
            _drop_old(env)
            dbs = {name.decode(): env.open_db(name) for name in DB_NAMES}
            with env.begin(write=True) as txn:
                version = txn.get(b"format", db=dbs["meta"])
                if version is None:
                    txn.put(b"format", FORMAT_VERSION, db=dbs["meta"])
        except BaseException:
            env.close()
            raise
        return env, dbs, version

    def db(self, name: str) -> Any:
        return self.dbs[name]

    # -- reads -----------------------------------------------------------------------
    def _begin_read(self) -> Any:
        """A new read-only transaction (counted). Raises CacheError."""
        _READ_TXNS.inc()
        try:
            return self.env.begin(write=False, buffers=False)
        except lmdb.ReadersFullError as exc:
            raise CacheError(f"cache metadata: all {self.max_readers} reader slots in use "
                             f"({self.readers_in_use()} listed)") from exc
        except lmdb.Error as exc:
            raise CacheError(f"cache metadata unreadable: {exc}") from exc

    @contextmanager
    def read(self) -> Iterator[Any]:
        """A read-only snapshot, for synchronous code only (see the module docstring:
        never in a coroutine). Safe on the trio thread. LMDB errors become CacheError."""
        txn = self._begin_read()
        try:
            with txn:
                yield txn
        except lmdb.Error as exc:
            raise CacheError(f"cache metadata unreadable: {exc}") from exc

    def run_read(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(txn, *args)`` in a read-only snapshot that ends before this returns: what
        :meth:`read` does, for the request path's helpers (no generator). Raises
        CacheError."""
        txn = self._begin_read()
        try:
            return fn(txn, *args)
        except lmdb.Error as exc:
            raise CacheError(f"cache metadata unreadable: {exc}") from exc
        finally:
            txn.abort()

    def get(self, db: str, key: bytes) -> bytes | None:
        """One value (its transaction ends before this returns). Raises CacheError."""
        return self.run_read(_get, key, self.dbs[db])

    def get_many(self, db: str, keys: Iterable[bytes]) -> list[bytes | None]:
        """Values of ``keys`` from one snapshot. Raises CacheError."""
        return self.run_read(_get_many, keys, self.dbs[db])

    def readers_in_use(self) -> int:
        """Reader slots taken now (what ``mdb_stat -r`` lists)."""
        try:
            lines = self.env.readers().splitlines()
        except lmdb.Error:
            return 0
        return sum(1 for line in lines[1:] if line.strip())

    # -- writes ----------------------------------------------------------------------
    @contextmanager
    def write(self) -> Iterator[Any]:
        """A write transaction. Worker threads only (it may wait for the writer lock)."""
        _WRITE_TXNS.inc()
        try:
            with self.env.begin(write=True) as txn:
                yield txn
        except lmdb.MapFullError as exc:
            raise CacheError("cache metadata is full") from exc
        except lmdb.Error as exc:
            raise CacheError(f"cache metadata write failed: {exc}") from exc

    def keep_reserve(self, nbytes: int) -> bool:
        """Keep ``nbytes`` of disk allocated past the end of the index's data file (worker
        threads only), so that commits still find room when the file system is full: the
        index grows into blocks allocated beforehand (``fallocate`` with KEEP_SIZE), not
        new ones. Without it, a cache file system filled by anything else failed every
        new listing's commit, and with it every lookup in an unlisted directory (EIO):
        the cache must stay best-effort. Tops the reserve up when less than half is
        left. Returns whether the reserve is there (False: no room for it, or a file
        system without fallocate; logged once)."""
        try:
            fd = os.open(self.path / "data.mdb", os.O_RDWR | os.O_CLOEXEC)
        except OSError:
            return False
        try:
            st = os.fstat(fd)
            if st.st_blocks * 512 - st.st_size >= nbytes // 2:
                return True
            if _fallocate(fd, _FALLOC_FL_KEEP_SIZE, st.st_size, nbytes) != 0:
                err = ctypes.get_errno()
                if not self._reserve_warned:
                    self._reserve_warned = True
                    log.warning("cannot keep %d MiB of disk for the cache index (%s): with the "
                                "file system full, new listings fail", nbytes >> 20,
                                os.strerror(err))
                return False
            return True
        finally:
            os.close(fd)

    def sync(self) -> None:
        """Flush commits to disk (blocks: worker threads only)."""
        try:
            self.env.sync(True)
        except lmdb.Error as exc:
            raise CacheError(f"cache metadata sync failed: {exc}") from exc

    def close(self) -> None:
        try:
            self.env.sync(True)
        finally:
            self.env.close()

    def drop(self, name: str) -> None:
        """Empty one database (worker threads only)."""
        with self.write() as txn:
            txn.drop(self.dbs[name], delete=False)


def _get(txn: Any, key: bytes, db: Any) -> bytes | None:
    value: bytes | None = txn.get(key, db=db)
    return value


def _get_many(txn: Any, keys: Iterable[bytes], db: Any) -> list[bytes | None]:
    return [txn.get(k, db=db) for k in keys]


def _drop_old(env: Any) -> None:
    with env.begin(write=True) as txn:
        for name in _OLD_DB_NAMES:
            if txn.get(name) is not None:
                txn.drop(env.open_db(name, txn=txn), delete=True)
                log.info("dropped the listings of an earlier cachefs version (%s)", name.decode())


def _check(path: Path, map_size: int) -> str | None:
    """Read the whole index in a child process; what is wrong with it, or None."""
    if not os.path.lexists(path):
        return None
    if not path.is_dir():
        return "not a directory"
    if not (path / "data.mdb").exists():
        return None
    try:
        proc = subprocess.run([sys.executable, "-c", _CHECK_SCRIPT, str(path), str(map_size)],
                              capture_output=True, text=True, timeout=CHECK_TIMEOUT)
    except subprocess.TimeoutExpired:
        log.warning("checking the cache index %s took over %.0f s; not checked", path,
                    CHECK_TIMEOUT)
        return None
    if proc.returncode == 0:
        return None
    lines = (proc.stderr or "").strip().splitlines()
    if proc.returncode < 0:
        return f"reading it aborted: {lines[-1] if lines else f'signal {-proc.returncode}'}"
    return lines[-1] if lines else f"check failed with status {proc.returncode}"


def _wipe(path: Path, problem: str) -> None:
    """Remove an index that cannot be used (one log line), so it starts empty."""
    log.warning("the cache index %s is unreadable (%s): wiped, starting with an empty cache",
                path, problem)
    try:
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        elif os.path.lexists(path):
            path.unlink()
    except OSError as exc:
        raise CacheError(f"cannot remove the damaged cache index {path}: {exc.strerror}") from exc
