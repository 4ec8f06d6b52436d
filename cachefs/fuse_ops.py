"""The pyfuse3 adapter: FUSE requests -> :class:`cachefs.fs.FileSystem`.

Thin by design: it converts arguments and results and holds the one table
that maps errors to errno (:func:`errno_for`). Every handler is wrapped by
:func:`_handler`: it counts and times the request, turns known errors into
their errno, and turns any unexpected exception into EIO plus a logged
traceback and ``cachefs_fuse_internal_errors_total`` -- never a dead mount
(pyfuse3 ends ``main()`` on any exception that is not a FUSEError).

The file system is read-only: every modifying operation answers EROFS (the
mount also carries the ``ro`` option, so the kernel usually answers first).
"""

from __future__ import annotations

import errno
import functools
import logging
import os
import stat
import time
from collections.abc import Callable, Coroutine, Sequence
from typing import Any, ParamSpec, TypeVar

import pyfuse3

from cachefs import metrics
from cachefs.errors import (
    AccessDenied,
    CacheError,
    CredentialsError,
    NoSuchBucket,
    NoSuchKey,
    ObjectChanged,
    StoreError,
    TransientStoreError,
)
from cachefs.fs import FileSystem, FsError, Node

log = logging.getLogger(__name__)

T = TypeVar("T")
P = ParamSpec("P")

# The one place errors become errno values.
_ERRNO_TABLE: tuple[tuple[type[BaseException], int], ...] = (
    (ObjectChanged, errno.ESTALE),
    (NoSuchKey, errno.ENOENT),
    (NoSuchBucket, errno.EIO),
    (AccessDenied, errno.EACCES),
    (CredentialsError, errno.EACCES),
    (TransientStoreError, errno.EIO),
    (StoreError, errno.EIO),
    (CacheError, errno.EIO),
)


def errno_for(exc: BaseException) -> int | None:
    """The errno for a known error, or None for an unexpected exception."""
    if isinstance(exc, FsError):
        return exc.errno
    if isinstance(exc, pyfuse3.FUSEError):
        return exc.errno
    for kind, code in _ERRNO_TABLE:
        if isinstance(exc, kind):
            return code
    return None


def _handler(
    op: str,
) -> Callable[[Callable[P, Coroutine[Any, Any, T]]], Callable[P, Coroutine[Any, Any, T]]]:
    def wrap(fn: Callable[P, Coroutine[Any, Any, T]]) -> Callable[P, Coroutine[Any, Any, T]]:
        requests = metrics.FUSE_REQUESTS.labels(op)
        latency = metrics.FUSE_LATENCY.labels(op)

        @functools.wraps(fn)
        async def handler(*args: P.args, **kwargs: P.kwargs) -> T:
            requests.inc()
            t0 = time.perf_counter()
            try:
                return await fn(*args, **kwargs)
            except Exception as exc:
                code = errno_for(exc)
                if code is None:
                    metrics.FUSE_INTERNAL_ERRORS.inc()
                    log.exception("unexpected error in %s; answering EIO", op)
                    code = errno.EIO
                elif code not in (errno.ENOENT, errno.EROFS) and not (
                        isinstance(exc, FsError) and code == errno.ESTALE):
                    # (an inode of an object version no longer listed is routine: the
                    # kernel looks the name up again)
                    log.warning("%s failed: %s (%s)", op, exc, errno.errorcode.get(code))
                metrics.FUSE_ERRORS.labels(op, errno.errorcode.get(code, str(code))).inc()
                raise pyfuse3.FUSEError(code) from None
            finally:
                latency.observe(time.perf_counter() - t0)
        return handler
    return wrap


class Operations(pyfuse3.Operations):  # type: ignore[misc]
    """pyfuse3 request handlers over a :class:`FileSystem`."""

    supports_dot_lookup = True
    enable_writeback_cache = False
    enable_acl = False

    def __init__(self, fs: FileSystem, *, uid: int, gid: int, file_mode: int, dir_mode: int,
                 attr_timeout: float, statfs_bytes: Callable[[], tuple[int, int]],
                 enable_passthrough: bool = False) -> None:
        super().__init__()
        self.fs = fs
        # Read by the passthrough build of pyfuse3 at FUSE INIT (see third_party/).
        self.enable_passthrough = enable_passthrough
        self.uid = uid
        self.gid = gid
        self.file_mode = file_mode
        self.dir_mode = dir_mode
        self.attr_timeout = attr_timeout
        self._statfs_bytes = statfs_bytes

    def _attrs(self, node: Node) -> pyfuse3.EntryAttributes:
        a = pyfuse3.EntryAttributes()
        a.st_ino = node.ino
        a.generation = 0
        a.entry_timeout = self.attr_timeout
        a.attr_timeout = self.attr_timeout
        if node.is_dir:
            a.st_mode = stat.S_IFDIR | self.dir_mode
            a.st_nlink = 2
            a.st_size = 0
        else:
            a.st_mode = stat.S_IFREG | self.file_mode
            a.st_nlink = 1
            a.st_size = node.size
        a.st_uid = self.uid
        a.st_gid = self.gid
        a.st_rdev = 0
        a.st_blksize = 1 << 20
        a.st_blocks = (a.st_size + 511) // 512
        ns = int(node.mtime * 1e9)
        a.st_atime_ns = a.st_mtime_ns = a.st_ctime_ns = ns
        return a

    # -- metadata -----------------------------------------------------------------
    @_handler("lookup")
    async def lookup(self, parent_inode: int, name: bytes, ctx: Any = None) -> Any:
        return self._attrs(await self.fs.lookup(parent_inode, name))

    @_handler("getattr")
    async def getattr(self, inode: int, ctx: Any = None) -> Any:
        return self._attrs(await self.fs.getattr(inode))

    async def forget(self, inode_list: Sequence[tuple[int, int]]) -> None:
        for ino, nlookup in inode_list:
            self.fs.forget(ino, nlookup)

    @_handler("statfs")
    async def statfs(self, ctx: Any = None) -> Any:
        capacity, used = self._statfs_bytes()
        s = pyfuse3.StatvfsData()
        s.f_bsize = s.f_frsize = 4096
        s.f_blocks = capacity // 4096
        s.f_bfree = s.f_bavail = max(0, capacity - used) // 4096
        s.f_files = 0  # inodes are not counted: nothing is kept per inode
        s.f_ffree = s.f_favail = 0
        s.f_namemax = 255
        return s

    # -- directories -------------------------------------------------------------------
    @_handler("opendir")
    async def opendir(self, inode: int, ctx: Any = None) -> int:
        return await self.fs.opendir(inode)

    @_handler("readdir")
    async def readdir(self, fh: int, start_id: int, token: Any) -> None:
        entries = await self.fs.readdir(fh, start_id)
        try:
            for position, node in entries:
                if not pyfuse3.readdir_reply(token, node.name, self._attrs(node), position):
                    break
                self.fs.readdir_progress(fh, position, node)
        finally:
            close = getattr(entries, "close", None)
            if close is not None:
                close()

    @_handler("releasedir")
    async def releasedir(self, fh: int) -> None:
        self.fs.releasedir(fh)

    # -- files --------------------------------------------------------------------------
    @_handler("open")
    async def open(self, inode: int, flags: int, ctx: Any = None) -> Any:
        if flags & (os.O_WRONLY | os.O_RDWR | os.O_TRUNC | os.O_APPEND | os.O_CREAT):
            raise FsError(errno.EROFS)
        fh, keep_cache, backing_id = await self.fs.open(inode, reader=getattr(ctx, "pid", 0))
        metrics.OPEN_HANDLES.inc()
        if backing_id:
            # The kernel reads the cache file itself; it refuses keep_cache with it.
            # (Set as an attribute: only the passthrough build of pyfuse3 has it.)
            info: Any = pyfuse3.FileInfo(fh=fh, keep_cache=False, direct_io=False)
            info.backing_id = backing_id
            return info
        return pyfuse3.FileInfo(fh=fh, keep_cache=keep_cache, direct_io=False)

    @_handler("read")
    async def read(self, fh: int, off: int, size: int) -> bytes:
        data = await self.fs.read(fh, off, size)
        metrics.READ_BYTES.inc(len(data))
        return data

    @_handler("release")
    async def release(self, fh: int) -> None:
        self.fs.release(fh)
        metrics.OPEN_HANDLES.dec()

    @_handler("access")
    async def access(self, inode: int, mode: int, ctx: Any = None) -> bool:
        if mode & os.W_OK:
            raise FsError(errno.EROFS)
        self.fs.node(inode)
        return True

    # -- everything that would modify: read-only file system ---------------------------
    async def _erofs(self, *args: Any, **kwargs: Any) -> Any:
        raise pyfuse3.FUSEError(errno.EROFS)

    setattr = _erofs
    mknod = _erofs
    mkdir = _erofs
    unlink = _erofs
    rmdir = _erofs
    symlink = _erofs
    rename = _erofs
    link = _erofs
    write = _erofs
    create = _erofs
    setxattr = _erofs
    removexattr = _erofs

    async def getxattr(self, inode: int, name: bytes, ctx: Any = None) -> bytes:
        raise pyfuse3.FUSEError(pyfuse3.ENOATTR)

    async def listxattr(self, inode: int, ctx: Any = None) -> list[bytes]:
        return []
