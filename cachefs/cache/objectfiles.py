"""The cache's files: one sparse file per object version, blocks at their offsets.

Layout::

    DIR/objects/ab/ab12...ef     the file of object id ab12...ef (hex); the block at
                                 byte offset o of the object lives at offset o

Plain file operations only (no index, no locks): :class:`ObjectFiles` writes a
block, reads bytes back, punches the holes of dropped blocks and removes files;
the block cache (:mod:`cachefs.cache.blocks`) decides when, under its locks.
Cached bytes are private to the mounting user whatever the umask (files 0600,
directories 0700): the mount's permissions must not be bypassed through the
cache. Worker threads only (every call may wait on the disk).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import logging
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

from cachefs.cache.blockid import OID_LEN
from cachefs.errors import CacheError

try:  # the write in one call, one release of the interpreter lock (see _cachefile.c)
    from cachefs.cache import _cachefile
except ImportError:  # built without extensions (no compiler at install time)
    _cachefile = None  # type: ignore[assignment]

#: Whether :meth:`ObjectFiles.write_at` (and :meth:`~ObjectFiles.write_kept`) runs in C.
NATIVE_WRITES = _cachefile is not None

log = logging.getLogger(__name__)

_PAGE = 4096
#: A file system's reported block size above this is not what a small file takes: ZFS
#: reports its largest record size (128 KiB by default; a small file takes only the
#: sectors it needs), NFS its transfer size.
_MAX_UNIT = 64 << 10
_FALLOC_FL_KEEP_SIZE = 0x01
_FALLOC_FL_PUNCH_HOLE = 0x02
_LEGACY_DIRS = ("blocks", "tmp")  # the one-file-per-block layout of earlier versions

#: A cache file's identity and when it last changed: (inode number, status change time in
#: ns), from one stat. Any write to the file, by anyone, and any change of its attributes
#: gives it a new change time, so a stamp taken when bytes were written or checked and
#: found again later says no one has changed the file since. (Since Linux 6.13, with
#: multigrain timestamps, a change after the time was last read always gets a new one;
#: before, a change within the same clock tick, a few ms, may keep it.)
FileStamp = tuple[int, int]


def stamp_of(st: os.stat_result) -> FileStamp:
    """The :data:`FileStamp` of a stat result."""
    return st.st_ino, st.st_ctime_ns


def file_stamp(fd: int) -> FileStamp | None:
    """The :data:`FileStamp` of ``fd``'s file; None when it cannot be had."""
    try:
        return stamp_of(os.fstat(fd))
    except OSError:
        return None


def path_stamp(path: str) -> FileStamp | None:
    """The :data:`FileStamp` of the file at ``path``; None when there is none."""
    try:
        return stamp_of(os.stat(path))
    except OSError:
        return None

_libc = ctypes.CDLL(None, use_errno=True)
_libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long]


def allocation_unit(path: Path) -> int:
    """The disk space a file takes is a whole number of these (bytes): the fundamental
    block size of the file system holding ``path`` (``statvfs``'s ``f_frsize``: 4 KiB on
    ext4, XFS, btrfs and tmpfs as usually made, up to 64 KiB on large-page machines),
    and never less than a page. A reported size above 64 KiB is a record or transfer
    size, not an allocation unit (:data:`_MAX_UNIT`): a page then. Raises OSError."""
    unit = os.statvfs(path).f_frsize
    if unit > _MAX_UNIT or unit & (unit - 1):
        return _PAGE
    return max(_PAGE, unit)


def allocation(length: int, unit: int) -> int:
    """The disk space a block of ``length`` bytes takes in its object's file: blocks start
    on multiples of the block size (a power of two >= 64 KiB, so of ``unit`` too), and a
    short one (an object's last) still takes whole units."""
    return -(-length // unit) * unit


class ObjectFiles:
    """The object files under ``root/objects``. ``unit``: the file system's allocation
    unit (:func:`allocation_unit` of ``root`` when not given), taken once: the file system
    under a cache directory does not change while it is open."""

    def __init__(self, root: Path, unit: int | None = None) -> None:
        self.root = root
        self.objects_dir = root / "objects"
        self._prefix = f"{self.objects_dir}{os.sep}"
        self._punch_warned = False
        try:
            self.objects_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
            self.unit = allocation_unit(root) if unit is None else unit
        except OSError as exc:
            raise CacheError(f"cannot create cache directories in {root}: {exc.strerror}") from exc

    def _make_objects_dir(self) -> None:
        """Make the objects directory again: removed under a running daemon (an operator
        freeing space, a cleaner of old files once the cache was empty), every later
        block would fail to be written until a restart. Its blocks in the index are
        misses, found as such when read."""
        with contextlib.suppress(FileExistsError):
            os.mkdir(self.objects_dir, 0o700)
            log.warning("the cache's objects directory %s was removed; made it again",
                        self.objects_dir)

    def path(self, oid: bytes) -> str:
        """The object's file: ``objects/<first two hex digits>/<hex id>``. A plain string,
        built on every cache write, read and passthrough open (``pathlib`` costs ~12 us a
        path, 20 times this)."""
        h = oid.hex()
        return f"{self._prefix}{h[:2]}{os.sep}{h}"

    def write_at(self, oid: bytes, data: bytes, offset: int) -> tuple[int, int, int]:
        """Write ``data`` at ``offset`` of the object's file (created with its directory
        if missing); returns the file's inode number and its change times (ns) just
        before and just after the write (:data:`FileStamp`: the caller tells its own
        write from anyone else's). Raises OSError.

        In C when the extension is built (:data:`NATIVE_WRITES`): the same calls, with
        the interpreter lock released once for all of them instead of once each. It is
        called by the S3 threads of cold GETs, hundreds at a time, and each release of
        a contended lock costs the thread a sleep and a wake-up."""
        if _cachefile is not None:
            path = self.path(oid)
            try:
                return _cachefile.write_at(path, data, offset)
            except FileNotFoundError:  # (the objects directory itself is gone: see below)
                self._make_objects_dir()
                return _cachefile.write_at(path, data, offset)
        inode, before, after, fd = self._write(oid, data, offset, os.O_WRONLY)
        os.close(fd)
        return inode, before, after

    def write_kept(self, oid: bytes, data: bytes, offset: int) -> tuple[int, int, int, int]:
        """:meth:`write_at`, leaving the file open: (its inode number, its change times
        before and after the write, a read-write descriptor of it, the caller's to
        close). Raises OSError (nothing left open)."""
        if _cachefile is not None:
            path = self.path(oid)
            try:
                return _cachefile.write_kept(path, data, offset)
            except FileNotFoundError:
                self._make_objects_dir()
                return _cachefile.write_kept(path, data, offset)
        return self._write(oid, data, offset, os.O_RDWR)

    def _write(self, oid: bytes, data: bytes, offset: int,
               mode: int) -> tuple[int, int, int, int]:
        """The write of :meth:`write_at` in Python: (inode, change time before, after, the
        open descriptor)."""
        path = self.path(oid)
        try:
            fd = os.open(path, mode | os.O_CREAT | os.O_CLOEXEC, 0o600)
        except FileNotFoundError:
            try:
                os.mkdir(os.path.dirname(path), 0o700)
            except FileExistsError:
                pass
            except FileNotFoundError:
                self._make_objects_dir()
                with contextlib.suppress(FileExistsError):
                    os.mkdir(os.path.dirname(path), 0o700)
            fd = os.open(path, mode | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            before = os.fstat(fd).st_ctime_ns
            view = memoryview(data)
            while view:
                n = os.pwrite(fd, view, offset)
                view, offset = view[n:], offset + n
            st = os.fstat(fd)
            return st.st_ino, before, st.st_ctime_ns, fd
        except BaseException:
            os.close(fd)
            raise

    def punch(self, oid: bytes, ranges: list[tuple[int, int]]) -> None:
        """Free the byte ranges (they read back as zeros). Blocks start on multiples of
        the block size (a power of two >= 64 KiB) and only an object's last block is
        short, so rounding a range's end up to the allocation unit frees the tail unit
        (which the index counted as the block's, :func:`allocation`) without touching
        another block's bytes."""
        try:
            fd = os.open(self.path(oid), os.O_WRONLY)
        except OSError:
            return
        try:
            for offset, length in ranges:
                length = allocation(offset + length, self.unit) - offset
                if not _punch_hole(fd, offset, length) and not self._punch_warned:
                    self._punch_warned = True
                    log.warning("the cache file system cannot punch holes: evicted blocks of "
                                "partly cached objects keep their disk space until the object goes")
        finally:
            os.close(fd)

    def remove(self, oid: bytes) -> None:
        unlink(self.path(oid))

    def remove_legacy(self) -> int:
        """Remove the directories of an earlier layout; returns how many there were."""
        removed = 0
        for legacy in _LEGACY_DIRS:
            if (self.root / legacy).is_dir():
                shutil.rmtree(self.root / legacy, ignore_errors=True)
                removed += 1
        return removed

    def scan(self) -> Iterator[tuple[bytes | None, Path]]:
        """Every file under ``objects/`` as (object id, path); the id is None for a file
        whose name is not an object id (a stray file)."""
        for sub in self.objects_dir.iterdir():
            if not sub.is_dir():
                continue
            for f in sub.iterdir():
                try:
                    oid = bytes.fromhex(f.name)
                except ValueError:
                    oid = b""
                yield (oid if len(oid) == OID_LEN else None), f


def pread(fd: int, length: int, offset: int) -> bytes:
    return os.pread(fd, length, offset)


def unlink(path: str | Path) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    except OSError as exc:
        log.warning("cannot remove %s: %s", path, exc.strerror)


def _punch_hole(fd: int, offset: int, length: int) -> bool:
    """Free ``length`` bytes at ``offset``; False if the file system cannot."""
    if _libc.fallocate(fd, _FALLOC_FL_PUNCH_HOLE | _FALLOC_FL_KEEP_SIZE, offset, length) == 0:
        return True
    err = ctypes.get_errno()
    if err not in (errno.EOPNOTSUPP, errno.ENOSYS):
        log.warning("cannot free evicted cache bytes: %s", os.strerror(err))
    return False
