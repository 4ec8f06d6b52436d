"""The LMDB layout of the file-system index: names of directory versions, inodes.

Tables (see :mod:`cachefs.cache.lmdbenv`):

* ``listings``: prefix id (xxh3-64 of the prefix) -> current version, listed
  at, entry count, sub-directory count, the prefix text;
* ``names``: version (8 bytes, big-endian) + name -> flags, size, mtime,
  inode number, ETag (16 bytes when it is an MD5: 37 bytes of value for a
  typical object). A new version takes the next number, so a listing's names
  are appended at the end of the B-tree (``MDB_APPEND``: full pages, no
  splits); the old version is deleted when the new one is complete;
* ``inodes``: inode number -> prefix id + name (what the kernel's inode refers to);
* ``meta``: the version and inode counters, ``pending:<version>`` markers of
  versions being written in several transactions (removed at the next start
  if the daemon died meanwhile).

Inode numbers are given out in sequence (so ``inodes`` is appended to as
well) and belong to one *version* of a name: writing a new version keeps the
number of a name whose kind and ETag did not change, and gives a changed
object a new one, so the kernel never keeps pages of one version for another.
Numbers survive remounts. A directory's id is a 64-bit hash of its prefix:
two prefixes colliding is as likely as 1 in 10^7 for a million directories.

Who calls what: :class:`Index` reads run on any thread (LMDB snapshots);
writes (:meth:`Index.write_entries`, :class:`VersionWriter`) only in worker
threads. :attr:`Index.generation` changes after every commit that makes a
listing current, so what was read while it had one value can be reused from
memory while it keeps it. :mod:`cachefs.cache.metadata` decides what to list and when;
:mod:`cachefs.cache.manifest` fills the index from a file.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import struct
import threading
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from typing import Any, TypeVar

import xxhash

from cachefs import metrics
from cachefs.cache.lmdbenv import LmdbEnv

log = logging.getLogger(__name__)
_T = TypeVar("_T")

NAME_MAX = 255
ROOT_INO = 1

ENTRY = struct.Struct("<BQIQ")  # flags, size, mtime (whole seconds), inode; ETag follows
F_DIR, F_MD5 = 1, 2
LISTING = struct.Struct("<QdQQ")  # version, listed at, entries, sub-directories; prefix follows
VERSION = struct.Struct(">Q")
INO = struct.Struct(">Q")
_HEX = frozenset("0123456789abcdef")

# Sub-directory prefixes remembered per listing for listing ahead (the walker's queue).
AHEAD_QUEUE = 4096


@dataclasses.dataclass(frozen=True, slots=True)
class Entry:
    """One name in a directory: a sub-directory or an object version."""

    name: bytes
    is_dir: bool
    size: int = 0
    mtime: float = 0.0
    etag: str = ""
    ino: int = 0


# Entry's slot setters, for unpack_entry (its fields, all set there: see test_index.py).
_new_entry = object.__new__
_set_name, _set_is_dir, _set_size, _set_mtime, _set_etag, _set_ino = (
    Entry.__dict__[f.name].__set__ for f in dataclasses.fields(Entry))


@contextlib.contextmanager
def snapshot(entries: Iterator[_T]) -> Iterator[Iterator[_T]]:
    """``entries`` (an iterator of :meth:`Index.iter`, or a generator reading one) for a
    ``with`` block: its LMDB read snapshot ends when the block does, not when the iterator
    is collected."""
    try:
        yield entries
    finally:
        close = getattr(entries, "close", None)
        if close is not None:
            close()


def enc(text: str) -> bytes:
    return text.encode("utf-8", "surrogateescape")


def parent_prefix(prefix: str) -> str:
    """The prefix of the directory holding directory ``prefix`` (``a/b/`` -> ``a/``;
    ``a/`` -> ``""``)."""
    return prefix[:prefix.rstrip("/").rfind("/") + 1]


def prefix_id(prefix: str) -> bytes:
    """The 8-byte id of a directory prefix (xxh3-64: S3 keys are up to 1024 bytes,
    LMDB keys 511)."""
    return xxhash.xxh3_64_digest(enc(prefix))


def pack_entry(flags: int, size: int, mtime: float, ino: int, etag: str) -> bytes:
    if len(etag) == 32 and _HEX.issuperset(etag):
        return ENTRY.pack(flags | F_MD5, size, int(mtime) & 0xFFFFFFFF, ino) + bytes.fromhex(etag)
    return ENTRY.pack(flags, size, int(mtime) & 0xFFFFFFFF, ino) + etag.encode()


def unpack_entry(name: bytes, raw: bytes) -> Entry:
    """The entry ``name`` stored as ``raw`` (any thread). Built through its slots, not the
    frozen dataclass's ``__init__`` (six ``object.__setattr__`` calls): every name a
    listing walk or a lookup reads is unpacked here, and the directory lookahead reads
    each file's about twice on the trio thread (2.6 us each before, 0.9 after)."""
    flags, size, mtime, ino = ENTRY.unpack_from(raw)
    tail = bytes(raw[ENTRY.size:])
    entry = _new_entry(Entry)
    _set_name(entry, name)
    _set_is_dir(entry, bool(flags & F_DIR))
    _set_size(entry, size)
    _set_mtime(entry, float(mtime))
    _set_etag(entry, tail.hex() if flags & F_MD5 else tail.decode())
    _set_ino(entry, ino)
    return entry


@dataclasses.dataclass(frozen=True, slots=True)
class View:
    """Where to read a directory's names: ``version``, names below ``limit`` (None: all)."""

    version: int
    limit: bytes | None


class Index:
    """The index tables of one LMDB environment."""

    def __init__(self, env: LmdbEnv) -> None:
        self.env = env
        #: Bumped after every commit that makes a listing current (a new version of a
        #: directory: names may have changed inode or gone). What was read from the index
        #: while it had one value may be reused from memory while it keeps it (read it
        #: *before* the snapshot). Writers take ``_generation_lock``; readers just read.
        self.generation = 0
        self._generation_lock = threading.Lock()
        #: Called with the prefix after every generation change (set up before the index
        #: is used).
        self.listeners: list[Callable[[str], None]] = []
        self.listings = env.db("listings")
        self.names = env.db("names")
        self.inodes = env.db("inodes")
        self.meta = env.db("meta")

    # -- reads (any thread) ---------------------------------------------------------
    # The request path's reads take one snapshot each (LmdbEnv.run_read), answering in
    # one transaction what would otherwise take two or three.
    def row(self, prefix: str) -> tuple[int, float, int, int] | None:
        """(version, listed at, entries, sub-directories) of ``prefix``'s listing."""
        raw = self.env.get("listings", prefix_id(prefix))
        return None if raw is None else LISTING.unpack_from(raw)

    def get(self, version: int, name: bytes) -> Entry | None:
        raw = self.env.get("names", VERSION.pack(version) + name)
        return None if raw is None else unpack_entry(name, raw)

    def lookup(self, prefix: str, name: bytes
               ) -> tuple[tuple[int, float, int, int], Entry | None] | None:
        """(``prefix``'s listing row, the entry ``name`` in it) from one snapshot; None
        when ``prefix`` has no listing."""
        return self.env.run_read(self._lookup, prefix_id(prefix), name)

    def _lookup(self, txn: Any, pid: bytes, name: bytes
                ) -> tuple[tuple[int, float, int, int], Entry | None] | None:
        raw = txn.get(pid, db=self.listings)
        if raw is None:
            return None
        row = LISTING.unpack_from(raw)
        entry = txn.get(VERSION.pack(row[0]) + name, db=self.names)
        return row, (None if entry is None else unpack_entry(name, entry))

    def resolve(self, ino: int) -> tuple[bytes, bytes, tuple[int, float, str] | None,
                                         Entry | None] | None:
        """:meth:`inode` and, when the directory has a listing, the entry of the name in
        it (the name's current version there), from one snapshot."""
        return self.env.run_read(self._resolve, ino)

    def _resolve(self, txn: Any, ino: int) -> tuple[bytes, bytes, tuple[int, float, str] | None,
                                                    Entry | None] | None:
        raw = txn.get(INO.pack(ino), db=self.inodes)
        if raw is None:
            return None
        pid, name = bytes(raw[:8]), bytes(raw[8:])
        row_raw = txn.get(pid, db=self.listings)
        if row_raw is None:
            return pid, name, None, None
        version, listed_at = LISTING.unpack_from(row_raw)[:2]
        prefix = bytes(row_raw[LISTING.size:]).decode("utf-8", "surrogateescape")
        entry = txn.get(VERSION.pack(version) + name, db=self.names)
        return (pid, name, (version, listed_at, prefix),
                None if entry is None else unpack_entry(name, entry))

    def iter(self, v: View, after: bytes | None) -> Iterator[Entry]:
        """Names of version ``v`` below its limit, in order, after ``after``."""
        vb = VERSION.pack(v.version)
        start = vb + after if after is not None else vb
        limit = v.limit
        with self.env.read() as txn:
            cur = txn.cursor(db=self.names)
            if not cur.set_range(start):
                return
            for key, raw in cur:
                if not key.startswith(vb):
                    return
                name = key[8:]
                if limit is not None and name >= limit:
                    return
                if after is not None and name == after:
                    continue
                yield unpack_entry(name, raw)

    def inode(self, ino: int) -> tuple[bytes, bytes, tuple[int, float, str] | None] | None:
        """What inode ``ino`` names: (prefix id, name, (version, listed at, prefix) of
        that directory's listing or None when it has none yet)."""
        with self.env.read() as txn:
            raw = txn.get(INO.pack(ino), db=self.inodes)
            if raw is None:
                return None
            pid, name = bytes(raw[:8]), bytes(raw[8:])
            row_raw = txn.get(pid, db=self.listings)
        if row_raw is None:
            return pid, name, None
        version, listed_at = LISTING.unpack_from(row_raw)[:2]
        prefix = bytes(row_raw[LISTING.size:]).decode("utf-8", "surrogateescape")
        return pid, name, (version, listed_at, prefix)

    # -- writes (worker threads) ------------------------------------------------------
    def listings_changed(self, prefix: str) -> None:
        """A commit made the listing of ``prefix`` current (call after the commit): the
        generation moves on, then every listener is told (any thread)."""
        with self._generation_lock:
            self.generation += 1
        for listener in self.listeners:
            listener(prefix)

    def recover(self) -> int:
        """Delete the names of versions a previous daemon did not finish; returns how many."""
        with self.env.read() as txn:
            cur = txn.cursor(db=self.meta)
            pending = []
            if cur.set_range(b"pending:"):
                for key, _ in cur:
                    if not key.startswith(b"pending:"):
                        break
                    pending.append(key)
        if pending:
            with self.env.write() as txn:
                for key in pending:
                    self.delete_version(txn, VERSION.unpack(key[8:])[0])
                    txn.delete(key, db=self.meta)
        return len(pending)

    def next_version(self, txn: Any) -> int:
        raw = txn.get(b"version", db=self.meta)
        version = (0 if raw is None else VERSION.unpack(raw)[0]) + 1
        txn.put(b"version", VERSION.pack(version), db=self.meta)
        return version

    def delete_version(self, txn: Any, version: int) -> None:
        vb = VERSION.pack(version)
        cur = txn.cursor(db=self.names)
        if cur.set_range(vb):
            while cur.key().startswith(vb):
                if not cur.delete():
                    break

    def write_entries(self, txn: Any, prefix: str, version: int, entries: Iterable[Entry],
                      last_key: bytes | None, old_version: int | None = None
                      ) -> tuple[int, int, bytes | None, list[str]]:
        """Append ``entries`` (sorted by name) to ``version`` of ``prefix``; returns (names
        added, sub-directories added, greatest key written, sub-directory prefixes).

        A name whose kind and ETag are the same in ``old_version`` keeps its inode;
        any other gets the next inode number (appended to ``inodes``)."""
        pid = prefix_id(prefix)
        vb = VERSION.pack(version)
        ob = None if old_version is None else VERSION.pack(old_version)
        raw_ino = txn.get(b"ino", db=self.meta)
        next_ino = ROOT_INO + 1 if raw_ino is None else INO.unpack(raw_ino)[0]
        new_inodes: list[tuple[bytes, bytes]] = []
        in_order: list[tuple[bytes, bytes]] = []
        late: list[tuple[bytes, bytes, bool]] = []
        added = dirs = 0
        subdirs: list[str] = []
        for e in entries:
            flags = F_DIR if e.is_dir else 0
            ino = 0
            if ob is not None:
                old = txn.get(ob + e.name, db=self.names)
                if old is not None and unpack_entry(e.name, old).etag == e.etag and \
                        (old[0] & F_DIR) == flags:
                    ino = ENTRY.unpack_from(old)[3]
            if not ino:
                ino = next_ino
                next_ino += 1
                new_inodes.append((INO.pack(ino), pid + e.name))
            key = vb + e.name
            value = pack_entry(flags, e.size, e.mtime, ino, e.etag)
            if e.is_dir:
                dirs += 1
                if len(subdirs) < AHEAD_QUEUE:
                    subdirs.append(prefix + e.name.decode("utf-8", "surrogateescape") + "/")
            if not e.is_dir and (last_key is None or key > last_key):
                in_order.append((key, value))
                last_key = key
            else:  # a directory wins over a file of its name, whenever either arrives
                late.append((key, value, e.is_dir))
        if new_inodes:
            txn.cursor(db=self.inodes).putmulti(new_inodes, append=True)
            txn.put(b"ino", INO.pack(next_ino), db=self.meta)
        if in_order:
            cur = txn.cursor(db=self.names)
            append = not cur.last() or cur.key() < in_order[0][0]
            consumed, n = cur.putmulti(in_order, append=append, overwrite=False)
            added += n
            if consumed > n:  # files whose name another range listed as a directory
                metrics.SKIPPED_KEYS.labels("shadowed").inc(consumed - n)
        for key, value, is_dir in late:
            old = txn.get(key, db=self.names)
            if old is not None:
                if is_dir and not ENTRY.unpack_from(old)[0] & F_DIR:
                    metrics.SKIPPED_KEYS.labels("shadowed").inc()
                    added -= 1
                else:
                    continue
            txn.put(key, value, db=self.names)
            added += 1
            if not is_dir and (last_key is None or key > last_key):
                last_key = key
        return added, dirs, last_key, subdirs


class VersionWriter:
    """Writes one new version of a directory, batch by batch (from several range
    threads at once), and makes it current at the end (deleting the previous version).
    Worker threads; ``lock`` guards the counters."""

    def __init__(self, index: Index, prefix: str, clock: Callable[[], float]) -> None:
        self.index = index
        self.clock = clock
        self.prefix = prefix
        self.lock = threading.Lock()
        self.version: int | None = None
        self.final = False
        self.count = 0
        self.dirs = 0
        self.skipped: Counter[str] = Counter()
        self.subdirs: list[str] = []
        self.old_version: int | None = None

    def write(self, batch: list[Entry], last_key: bytes | None = None,
              final: bool = False) -> bytes | None:
        """Write ``batch`` (names after ``last_key`` of the same range, sorted); returns the
        range's new last key. ``final``: the whole listing is in, make it current."""
        index = self.index
        with index.env.write() as txn:
            if self.version is None:
                old = txn.get(prefix_id(self.prefix), db=index.listings)
                self.old_version = None if old is None else LISTING.unpack_from(old)[0]
                self.version = index.next_version(txn)
                if not final:  # several transactions: recoverable if the daemon dies
                    txn.put(b"pending:" + VERSION.pack(self.version), b"", db=index.meta)
            added, dirs, last_key, subdirs = index.write_entries(
                txn, self.prefix, self.version, batch, last_key, self.old_version)
            with self.lock:
                self.count += added
                self.dirs += dirs
                if len(self.subdirs) < AHEAD_QUEUE:
                    self.subdirs += subdirs
            if final:
                self._make_current(txn)
        if final:
            index.listings_changed(self.prefix)
        return last_key

    def finish(self) -> None:
        with self.index.env.write() as txn:
            if self.version is None:  # an empty directory
                self.version = self.index.next_version(txn)
            self._make_current(txn)
        self.index.listings_changed(self.prefix)

    def _make_current(self, txn: Any) -> None:
        index = self.index
        assert self.version is not None
        pid = prefix_id(self.prefix)
        old = txn.get(pid, db=index.listings)
        txn.put(pid, LISTING.pack(self.version, self.clock(), self.count, self.dirs)
                + enc(self.prefix), db=index.listings)
        if old is not None:
            index.delete_version(txn, LISTING.unpack_from(old)[0])
        txn.delete(b"pending:" + VERSION.pack(self.version), db=index.meta)
        self.final = True

    def abandon(self) -> None:
        if self.version is None or self.final:
            return
        try:
            with self.index.env.write() as txn:
                self.index.delete_version(txn, self.version)
                txn.delete(b"pending:" + VERSION.pack(self.version), db=self.index.meta)
        except Exception:  # the next start removes it (pending marker)
            log.warning("could not remove an unfinished listing", exc_info=True)
