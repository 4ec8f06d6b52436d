"""FUSE operations: requests -> :class:`cachefs.fs.FileSystem` -> replies.

The handlers the request server (:mod:`cachefs.fuse.server`) calls, and the
one table that maps errors to errno (:func:`errno_for`). Each operation has an
*inline* handler, run on a request worker thread (lookups, attributes, opens,
reads of cached blocks, releases: everything that can be answered from the
index and the local disk), and/or an *async* handler run on the trio thread
for what must wait (a directory being listed, a block being fetched, directory
reads). An inline handler hands a request to the async one by letting
:class:`cachefs.fs.NeedsWait` through (the server sees it as ``Deferred``).

Error handling: known errors become their errno; any unexpected exception
becomes EIO plus a logged traceback and ``cachefs_fuse_internal_errors_total``
-- never a dead mount.

The file system is read-only: every modifying operation answers EROFS (the
mount also carries the ``ro`` option, so the kernel usually answers first).
"""

from __future__ import annotations

import contextlib
import errno
import functools
import logging
import os
import time
from collections.abc import Callable, Sequence

import trio

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
from cachefs.fs import Entry, FileSystem, FsError, NeedsWait, Node
from cachefs.fuse import abi
from cachefs.fuse.native import OPENED, NativeReads
from cachefs.fuse.server import AsyncHandler, Deferred, Handlers, InlineHandler, Reply, Request

log = logging.getLogger(__name__)

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

#: The operations served, with the name their metrics carry (READDIR and READDIRPLUS are
#: both "readdir"; everything else gets ENOSYS or, when it would modify, EROFS).
OP_NAMES: dict[int, str] = {
    abi.LOOKUP: "lookup", abi.GETATTR: "getattr", abi.STATFS: "statfs", abi.ACCESS: "access",
    abi.OPEN: "open", abi.READ: "read", abi.RELEASE: "release", abi.OPENDIR: "opendir",
    abi.READDIRPLUS: "readdir", abi.READDIR: "readdir", abi.RELEASEDIR: "releasedir",
    abi.GETXATTR: "getxattr", abi.LISTXATTR: "listxattr",
}

#: Open flags that may write: EROFS (the kernel answers most first; it strips O_CREAT). As
#: on any read-only mount, O_APPEND of a read-only open is no write: it opens.
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_TRUNC
#: How long the events of opens the native loop answered wait to be drained in one batch
#: when no request reaches Python meanwhile (the walk's lookahead sees those opens this
#: late; any request Python answers drains them first).
EVENT_BATCH_DELAY = 0.02
_ENOATTR = getattr(errno, "ENOATTR", errno.ENODATA)


def errno_for(exc: BaseException) -> int | None:
    """The errno for a known error, or None for an unexpected exception."""
    if isinstance(exc, FsError):
        return exc.errno
    for kind, code in _ERRNO_TABLE:
        if isinstance(exc, kind):
            return code
    return None


#: Names after a walk's lookup whose answers the native loop is given ahead of theirs.
LOOKUP_AHEAD = 64
#: How far past the names remembered so far a lookup may land and still be in the walk
#: (a pool of readers opens a few files out of order).
LOOKUP_RUN_GAP = 8
#: Directories whose walks are followed at once (the oldest is forgotten).
LOOKUP_RUNS = 1024


def _name(body: bytes | memoryview) -> bytes:
    """A NUL-terminated name argument."""
    raw = bytes(body)
    end = raw.find(b"\0")
    return raw if end < 0 else raw[:end]


class Operations(Handlers):
    """Request handlers over a :class:`FileSystem` (see the module docstring)."""

    def __init__(self, fs: FileSystem, *, uid: int, gid: int, file_mode: int, dir_mode: int,
                 attr_timeout: float, statfs_bytes: Callable[[], tuple[int, int]],
                 on_init: Callable[[abi.Negotiated], None] | None = None) -> None:
        self.fs = fs
        self.uid = uid
        self.gid = gid
        self.file_mode = file_mode
        self.dir_mode = dir_mode
        self.attr_timeout = attr_timeout
        self._timeout = abi.split_timeout(attr_timeout)
        self._statfs_bytes = statfs_bytes
        self._on_init = on_init
        self._opened = metrics.FastCounter()
        self._released = metrics.FastCounter()
        metrics.OPEN_HANDLES.set_function(lambda: self._opened.value - self._released.value)
        self._read_bytes = metrics.READ_BYTES
        # Set at INIT when the native loop answers the reads of registered files (see
        # cachefs.fuse.native): a handle opened on one is bound to it.
        self.native: NativeReads | None = None
        # The request workers' native loop, when they run it (with or without
        # passthrough): lookups are remembered in it.
        self.native_loop: NativeReads | None = None
        # Directory inode -> the last inode whose lookup the loop was given, in the walk
        # of that directory under way (see _remember_ahead; bounded: LOOKUP_RUNS).
        self._lookup_runs: dict[int, int] = {}
        # Directory prefix -> (the epoch token it was read in, its inode, when its listing
        # stops being fresh: time.monotonic()) for the names told ahead (remember_listed;
        # trio thread only; bounded: LOOKUP_RUNS).
        self._listed: dict[str, tuple[int, int, float]] = {}

    # -- the server's interface ----------------------------------------------------------
    def table(self) -> dict[int, tuple[str, InlineHandler | None, AsyncHandler | None]]:
        handlers: dict[int, tuple[InlineHandler | None, AsyncHandler | None]] = {
            abi.LOOKUP: (self.lookup, self.lookup_async),
            abi.GETATTR: (self.getattr, None),
            abi.STATFS: (self.statfs, None),
            abi.ACCESS: (self.access, None),
            abi.OPEN: (self.open, None),
            abi.READ: (self.read, self.read_async),
            abi.RELEASE: (self.release, None),
            abi.OPENDIR: (None, self.opendir),
            abi.READDIRPLUS: (None, self.readdirplus),
            abi.READDIR: (None, self.readdir),
            abi.RELEASEDIR: (self.releasedir, None),
            abi.GETXATTR: (self.getxattr, None),
            abi.LISTXATTR: (self.listxattr, None),
        }
        return {op: (OP_NAMES[op], *pair) for op, pair in handlers.items()}

    def error_code(self, op: str, exc: BaseException) -> int:
        if isinstance(exc, NeedsWait):  # an inline-only handler cannot wait: a bug
            exc = RuntimeError(f"{op} cannot wait for the trio thread")
        code = errno_for(exc)
        if code is None:
            metrics.FUSE_INTERNAL_ERRORS.inc()
            log.error("unexpected error in %s; answering EIO", op, exc_info=exc)
            return errno.EIO
        if code not in (errno.ENOENT, errno.EROFS, _ENOATTR) and not (
                isinstance(exc, FsError) and code == errno.ESTALE):
            # (an inode of an object version no longer listed is routine: the kernel
            # looks the name up again)
            log.warning("%s failed: %s (%s)", op, exc, errno.errorcode.get(code))
        return code

    def negotiated(self, result: abi.Negotiated) -> None:
        if self._on_init is not None:
            self._on_init(result)

    # -- attributes ----------------------------------------------------------------------
    def _attr(self, node: Node) -> bytes:
        return abi.attr(node.ino, node.is_dir, node.size, node.mtime, uid=self.uid,
                        gid=self.gid, file_mode=self.file_mode, dir_mode=self.dir_mode)

    def _entry(self, node: Node) -> bytes:
        return abi.entry_out(node.ino, self._attr(node), self._timeout)

    # -- metadata --------------------------------------------------------------------------
    def lookup(self, req: Request) -> Reply:
        loop = self.native_loop
        name = _name(req.body)
        try:
            # (the native loop's epoch is read before the listing is: see cachefs.fuse.native)
            node, fresh_for, prefix, token = self.fs.lookup_fresh_now(
                req.nodeid, name, loop.lookup_epoch if loop is not None else None)
        except NeedsWait:
            raise Deferred from None
        answer = self._entry(node)
        if loop is not None and fresh_for > 0:
            # The loop answers this name again while the answer holds.
            loop.remember_lookup(token, prefix, req.nodeid, name, answer, fresh_for)
            if not node.is_dir:
                self._remember_ahead(loop, token, prefix, req.nodeid, node, fresh_for)
        return answer

    def _remember_ahead(self, loop: NativeReads, token: int, prefix: str, parent: int,
                        node: Node, fresh_for: float) -> None:
        """In a walk of directory ``parent``, have the loop answer the lookups of the next
        :data:`LOOKUP_AHEAD` names too (from the listing ``token`` was read before, so a
        listing changed meanwhile ends them with its epoch), so a cold walk's lookups
        cost no Python either. A lookup is part of a walk when its inode (numbered in
        name order) is at most :data:`LOOKUP_RUN_GAP` past the names remembered so far in
        that directory (or past its previous lookup answered here): shuffled readers of
        a large directory rarely are, and remember nothing ahead.

        Any request worker; ``_lookup_runs`` is read and written without a lock (single
        dictionary operations): two workers racing only remember some names twice."""
        runs = self._lookup_runs
        end = runs.get(parent)
        ino = node.ino
        if end is None or not end - LOOKUP_AHEAD < ino <= end + LOOKUP_RUN_GAP:
            runs[parent] = ino
        else:
            last = ino
            for sibling in self.fs.siblings_now(prefix, node.name, LOOKUP_AHEAD):
                loop.remember_lookup(token, prefix, parent, sibling.name,
                                     self._entry(sibling), fresh_for)
                last = sibling.ino
            runs[parent] = last
        if len(runs) > LOOKUP_RUNS:
            try:
                runs.pop(next(iter(runs)))
            except (StopIteration, KeyError, RuntimeError):
                pass  # (another worker changed it meanwhile: bounded at its next lookup)

    # -- the names of files fetched far ahead (cachefs.read.prefetcher.LookupsAhead) -------
    def lookup_token(self, prefix: str) -> int:
        """The loop's epoch token of directory ``prefix`` (0 without the loop): read before
        the listing the names told to :meth:`remember_listed` come from (trio thread)."""
        loop = self.native_loop
        return 0 if loop is None else loop.lookup_epoch(prefix)

    def remember_listed(self, prefix: str, token: int, entries: Sequence[Entry]) -> None:
        """Have the loop answer the LOOKUPs of ``entries`` of directory ``prefix`` (read from
        its listing after ``token`` was read) while that listing stays fresh, as a walk's
        next names are (:meth:`_remember_ahead`): files the read-order hint or the sweep
        fetches are opened by shuffled readers, whose lookups no walk foresees, and each
        cost a request in Python (the worker waiting for the interpreter behind the S3
        threads of a cold pass). The directory's inode and freshness are read once per
        epoch of the directory (trio thread; one or two index reads, then none)."""
        loop = self.native_loop
        if loop is None or not entries:
            return
        now = time.monotonic()
        known = self._listed.get(prefix)
        if known is None or known[0] != token:
            # (read after the token: a listing changed meanwhile ends the token's epoch)
            found = self.fs.directory_now(prefix)
            if found is None:
                return
            known = (token, found[0], now + found[1])
            self._listed.pop(prefix, None)
            self._listed[prefix] = known
            if len(self._listed) > LOOKUP_RUNS:
                self._listed.pop(next(iter(self._listed)))
        fresh_for = known[2] - now
        if fresh_for <= 0:
            return
        parent, node_of, entry = known[1], self.fs.node_of, self._entry
        for listed in entries:
            if not loop.remember_lookup(token, prefix, parent, listed.name,
                                        entry(node_of(prefix, listed)), fresh_for):
                return  # (the epoch moved on: the rest would be refused too)

    async def lookup_async(self, req: Request) -> Reply:
        return self._entry(await self.fs.lookup(req.nodeid, _name(req.body)))

    def getattr(self, req: Request) -> Reply:
        fh = None
        if len(req.body) >= abi.GETATTR_IN.size:
            flags, _, handle = abi.GETATTR_IN.unpack_from(req.body)
            if flags & abi.GETATTR_FH:
                fh = handle
        return abi.attr_out(self._attr(self.fs.getattr_now(req.nodeid, fh)), self._timeout)

    def statfs(self, req: Request) -> Reply:
        capacity, used = self._statfs_bytes()
        return abi.statfs_out(capacity, used)

    def access(self, req: Request) -> Reply:
        mask = abi.ACCESS_IN.unpack_from(req.body)[0]
        if mask & os.W_OK:
            raise FsError(errno.EROFS)
        self.fs.node_now(req.nodeid)
        return None

    def getxattr(self, req: Request) -> Reply:
        raise FsError(_ENOATTR)

    def listxattr(self, req: Request) -> Reply:
        size = abi.GETXATTR_IN.unpack_from(req.body)[0]
        return abi.GETXATTR_OUT.pack(0, 0) if size == 0 else b""

    # -- files -------------------------------------------------------------------------------
    def open(self, req: Request) -> Reply:
        flags = abi.OPEN_IN.unpack_from(req.body)[0]
        if flags & _WRITE_FLAGS:
            raise FsError(errno.EROFS)
        o_direct = bool(flags & os.O_DIRECT)
        fh, keep_cache, backing_id = self.fs.open_now(req.nodeid, reader=req.pid,
                                                     o_direct=o_direct)
        self._opened.inc()
        native = self.native
        if backing_id and native is None:
            # The kernel reads the cache file itself; it refuses keep_cache with it. An
            # O_DIRECT handle is passed through only because its inode is (the kernel
            # refuses it otherwise): direct I/O, which overrides passthrough, brings its
            # reads to the daemon, since the kernel would read the cache file O_DIRECT too
            # and fail EINVAL on any unaligned buffer.
            loop = self.native_loop
            if not o_direct and loop is not None:
                # (the loop answers the next opens of the inode the same way)
                self.fs.offer_template(fh, loop.lookup_epoch)
            flags = abi.FOPEN_PASSTHROUGH | (abi.FOPEN_DIRECT_IO if o_direct else 0)
            return abi.open_out(fh, flags, backing_id)
        if backing_id and native is not None:
            # A verified file registered with the native loop, which answers this
            # handle's reads (a handle it cannot bind is served here) -- unless the memory
            # tier holds the whole object: its answer from memory costs the worker less
            # time than a read of the file that may wait for the disk.
            size, in_memory = self.fs.object_of(fh)
            if not in_memory:
                native.bind(fh, backing_id, size)
            if not o_direct:
                # The loop answers the next opens of the inode itself, bound to the file
                # (an open and a release in Python cost more than the memory tier saves).
                self.fs.offer_template(fh, native.lookup_epoch)
        return abi.open_out(fh, abi.FOPEN_KEEP_CACHE if keep_cache else 0)

    def read(self, req: Request) -> Reply:
        fh, offset, size, _ = abi.READ_IN.unpack_from(req.body)
        loop = self.native_loop
        if loop is not None:
            # A handle opened before its object was cached whole: once it is, the loop
            # answers the handle's next reads (this one is answered here), with or without
            # the kernel's passthrough (which set this handle's mode at its open).
            try:
                backing_id, object_size = self.fs.bind_later(fh, time.monotonic())
            except Exception:  # (a bug, or no memory: tried again later; see bind_later)
                # The bind only moves the handle's later reads to the loop: this one is
                # answered here all the same.
                metrics.FUSE_INTERNAL_ERRORS.inc()
                log.exception("binding a handle to the native loop failed; its reads are "
                              "answered in Python")
                backing_id = object_size = 0
            if backing_id:
                loop.bind(fh, backing_id, object_size)
        try:
            data = self.fs.read_now(fh, offset, size)
        except NeedsWait as wait:
            # A read of a block being fetched joins that fetch (answered when it lands).
            join = wait.join
            raise Deferred(None if join is None else
                           lambda done: join(functools.partial(self._joined_read, done))
                           ) from None
        self._read_bytes.inc(len(data))
        return data

    def _joined_read(self, done: Callable[[Reply, BaseException | None], None],
                     data: bytes | None, error: BaseException | None) -> None:
        if data is not None:
            self._read_bytes.inc(len(data))
        done(data, error)

    async def read_async(self, req: Request) -> Reply:
        fh, offset, size, _ = abi.READ_IN.unpack_from(req.body)
        data = await self.fs.read(fh, offset, size)
        self._read_bytes.inc(len(data))
        return data

    def release(self, req: Request) -> Reply:
        fh = abi.RELEASE_IN.unpack_from(req.body)[0]
        if self.native_loop is not None:
            # (before the file's registration may be dropped; a handle the loop opened is
            # released there too, when it handed this RELEASE over)
            self.native_loop.unbind(fh)
        self.fs.release(fh)
        self._released.inc()
        return None

    # -- opens and releases the native loop answered ---------------------------------------
    def drain_native(self) -> None:
        """Do the bookkeeping of the handles the native loop opened and released since the
        last drain (any thread; the request server calls it before every request Python
        answers, so that a request of such a handle finds it)."""
        loop = self.native_loop
        if loop is not None:
            loop.drain(self._native_events)

    def _native_events(self, events: list[tuple[int, int, int, int]]) -> None:
        opened: list[tuple[int, int, int]] = []
        released: set[int] = set()
        for kind, reader, fh, ino in events:
            if kind == OPENED:
                opened.append((fh, ino, reader))
                self._opened.inc()
            else:
                released.add(fh)
                self._released.inc()
        self.fs.adopt(opened, released)

    async def run_native_events(self, *, task_status: trio.TaskStatus[None]
                                = trio.TASK_STATUS_IGNORED) -> None:
        """Drain the native loop's events on the trio thread while no request reaches
        Python (a warm pass): woken when the loop queues some, then once more after
        :data:`EVENT_BATCH_DELAY`, so a busy loop costs one drain per batch. Until
        cancelled."""
        loop = self.native_loop
        task_status.started()
        if loop is None:
            return
        while True:
            await loop.wait_events()
            await trio.sleep(EVENT_BATCH_DELAY)
            loop.drain(self._native_events, blocking=False)  # (a worker drains meanwhile)

    # -- directories ---------------------------------------------------------------------
    async def opendir(self, req: Request) -> Reply:
        return abi.open_out(await self.fs.opendir(req.nodeid), 0)

    async def readdirplus(self, req: Request) -> Reply:
        return await self._readdir(req, plus=True)

    async def readdir(self, req: Request) -> Reply:
        return await self._readdir(req, plus=False)

    async def _readdir(self, req: Request, *, plus: bool) -> Reply:
        fh, start, size, _ = abi.READ_IN.unpack_from(req.body)
        entries = await self.fs.readdir(fh, start)
        out: list[bytes] = []
        used = 0
        sent: list[tuple[int, Node]] = []
        with contextlib.closing(entries):  # (its index snapshot ends here)
            for position, node in entries:
                if plus:
                    rec = abi.dirent_plus(self._entry(node), node.ino, position, node.name,
                                          node.is_dir)
                else:
                    rec = abi.dirent(node.ino, position, node.name, node.is_dir)
                if used + len(rec) > size:
                    break
                out.append(rec)
                used += len(rec)
                sent.append((position, node))
        for position, node in sent:  # the kernel may continue after any of them
            self.fs.readdir_progress(fh, position, node)
        return b"".join(out)  # one buffer: a writev takes at most IOV_MAX (1024) parts

    def releasedir(self, req: Request) -> Reply:
        self.fs.releasedir(abi.RELEASE_IN.unpack_from(req.body)[0])
        return None
