"""File-system semantics without FUSE: inodes, lookups, directories, reads.

:class:`FileSystem` is what the pyfuse3 adapter (:mod:`cachefs.fuse_ops`)
calls. It raises :class:`FsError` (carrying an errno) for file-system
conditions and lets :mod:`cachefs.errors` types through; the adapter maps
both to errno values in one table.

Inodes: the number of a name (one version of an object, or a directory) is
recorded in the index (:mod:`cachefs.cache.metadata`), so this module keeps
nothing per inode: the kernel may hold millions of them (every
readdirplus entry is one) at no cost to the daemon, and ``forget`` has
nothing to free. A :class:`Node` is built per request from the index. An
inode whose object version is no longer listed answers ESTALE, on which the
kernel looks the name up again and finds the current version (a new inode). So
does an inode whose version a GET (any load: a reader's, a prefetch, a walk's
lookahead) found replaced in S3 while its listing is being refreshed; the lookup
that follows waits for the new listing (see :meth:`FileSystem.object_changed`).
The root is inode 1. Paths are S3 keys: a directory's ``prefix`` ends with
``/`` (the root's is the mount prefix), a file's ``key`` is its object key.

Concurrency: the ``*_now`` methods and :meth:`release`/:meth:`releasedir` run on
the FUSE request workers (any thread, several at once); they read the index and
local files, and never touch what belongs to the trio thread (listings being
made, fetches, prefetch state): work for it is handed over with :attr:`post`
(in order, soon), and a request that must wait for it raises :class:`NeedsWait`,
after which the async method of the same name answers it on the trio thread.
``_handles`` is only changed by single dictionary operations (atomic under the
GIL) and handle numbers come from one counter; a try to bind a handle to the native
loop (:meth:`FileSystem.bind_later`, at any of its READs, several of which may run at
once) is claimed under ``_bind_lock`` (its ``bind_at`` set to infinity until the try
ends), so one READ at a time tries; ``_changed`` (versions a GET found
replaced) is read on any thread with one dictionary lookup and changed under
``_changed_lock``; ``_waited_in_vain`` (versions whose lookup gave up waiting for
their listing) is the trio thread's only; ``_dirs`` is guarded by
``_dirs_lock``. The handles the native loop opened and released are reported to
:meth:`adopt` on any thread, one batch at a time, opens in the loop's order (see
:mod:`cachefs.fuse.native`); ``_adoptable`` (the files given an open template) is
changed under ``_adoptable_lock`` and read without it. A readdir after a seek counts
to its position in one of trio's worker threads (index reads only; O(position) must
not hold up the trio thread).
"""

from __future__ import annotations

import collections
import dataclasses
import errno
import functools
import itertools
import logging
import math
import threading
import time
from collections.abc import Callable, Collection, Generator, Iterator
from typing import Any, Protocol

import trio

from cachefs.cache.index import parent_prefix, snapshot
from cachefs.cache.metadata import Entry as Entry  # (named by cachefs.fuse_ops too)
from cachefs.cache.metadata import Metadata, View
from cachefs.errors import NoSuchKey
from cachefs.read.fetcher import Fetcher, ObjectVersion
from cachefs.read.hints import ReadOrder
from cachefs.read.lookahead import DirectoryLookahead
from cachefs.read.prefetcher import Prefetcher
from cachefs.read.sequential import ReadStream
from cachefs.read.sweep import Sweeper

log = logging.getLogger(__name__)

ROOT_INODE = 1


class BackingFiles(Protocol):
    """Hands fully cached objects' files to the kernel (FUSE passthrough).

    Implemented by :class:`cachefs.passthrough.Passthrough`; the file system
    only needs these two calls, so it stays free of pyfuse3.
    """

    def open(self, ino: int, obj: ObjectVersion, *, o_direct: bool = False) -> int:
        """A backing id for a new handle of ``ino`` (the kernel reads the file), or 0.
        Any thread; may wait on the disk (it verifies the file the first time).
        ``o_direct``: the open asked for O_DIRECT."""
        ...

    def release(self, ino: int, backing_id: int) -> None:
        """The handle opened with answer ``backing_id`` is closed."""
        ...

    #: Whether files are registered with the native loop (its reads) instead of the kernel.
    native: bool

    def upgrade_due(self, obj: ObjectVersion) -> bool:
        """Whether :meth:`upgrade` may succeed now (cheap: no index lookups)."""
        ...

    def upgrade(self, ino: int, obj: ObjectVersion) -> int:
        """An id for the native loop's reads of the one handle of ``ino`` opened while
        ``obj`` was not cached whole, now that it is, or 0. With :attr:`native` a backing
        id (that handle's release gives it); otherwise the file's registration with the
        loop beside the kernel's (its release gives it to :meth:`release_beside`)."""
        ...

    def release_beside(self, ino: int, loop_id: int) -> None:
        """The handle :meth:`upgrade` gave ``loop_id`` beside the kernel is closed."""
        ...

    def add_template(self, ino: int, obj: ObjectVersion, backing_id: int, *, token: int,
                     prefix: str) -> bool:
        """Let the native loop answer the next opens of ``ino`` as this one (answer
        ``backing_id``) was, while the epoch ``token`` of directory ``prefix`` lasts;
        whether it will."""
        ...

    def add_template_ahead(self, ino: int, obj: ObjectVersion, *, token: int,
                           prefix: str) -> bool:
        """:meth:`add_template` for an object registered ahead of any open of it."""
        ...

    def adopted(self, objs: list[ObjectVersion]) -> None:
        """The native loop opened a handle of each of ``objs`` with its template (one
        batch)."""
        ...


#: Told on the trio thread how a joined read ended: (bytes, None) or (None, error).
ReadDone = Callable[[bytes | None, BaseException | None], None]


class NeedsWait(Exception):
    """A ``*_now`` method cannot answer without waiting on the trio thread (a listing
    not there yet, a block to fetch): ask the async method instead. ``join``, when
    given, may attach the request to a fetch under way first (see
    :meth:`FileSystem.join_read`)."""

    def __init__(self, join: Callable[[ReadDone], bool] | None = None) -> None:
        super().__init__()
        self.join = join


class FsError(Exception):
    """A file-system error with its errno (ENOENT, ENOTDIR, EISDIR, EROFS...)."""

    def __init__(self, errno_: int, message: str = "") -> None:
        super().__init__(message or errno.errorcode.get(errno_, str(errno_)))
        self.errno = errno_


@dataclasses.dataclass(slots=True)
class Node:
    """An inode, built per request: a directory (``prefix``) or a file version."""

    ino: int
    is_dir: bool
    path: str  # directory: prefix ending in "/" (or ""); file: object key
    parent_prefix: str
    name: bytes
    size: int = 0
    mtime: float = 0.0
    etag: str = ""


@dataclasses.dataclass(slots=True)
class FileHandle:
    fh: int
    node: Node
    obj: ObjectVersion
    backing_id: int = 0  # > 0: the kernel reads the cache file itself (passthrough)
    stream: ReadStream | None = None  # made at the first read through the trio thread
    adopted: bool = False  # opened by the native loop (its backing's use is counted there)
    # > 0: served by the daemon since its open (the kernel set its mode), its reads answered
    # by the native loop from the file registered there beside the kernel (bind_later)
    beside: int = 0
    # Unbound handles: when the next try to bind it to the native loop is due (see
    # FileSystem.bind_later; infinity while one READ tries, claimed under _bind_lock),
    # and the wait after that one.
    bind_at: float = 0.0
    bind_wait: float = 0.0


@dataclasses.dataclass(slots=True)
class DirHandle:
    fh: int
    node: Node
    # Names of the entries sent at positions from the last request's start on (trio
    # thread): the kernel continues from any entry of the last answer (it passes on only
    # what the reader's buffer takes), and a continuation follows names, not positions.
    sent: dict[int, bytes] = dataclasses.field(default_factory=dict)


# Seconds between tries to bind a handle opened before its object was cached whole to the
# native loop (FileSystem.bind_later) once it may be (BackingFiles.upgrade_due): the first
# this long after its first READ, then doubling up to the second. Until it may be, a cheap
# look every BIND_POLL.
BIND_RETRY = 1.0
BIND_RETRY_MAX = 60.0
BIND_POLL = 0.1
# Directory inodes whose prefix is remembered (a directory's prefix never changes for
# its inode number, so this only saves index reads; one entry per directory).
DIR_CACHE = 65536
# Object versions a GET saw replaced in S3 (see FileSystem.object_changed), remembered
# until their directory's listing has caught up (oldest forgotten first: a forgotten one
# only costs its next reader the ESTALE of a read, as before it was remembered).
CHANGED = 4096
MARKING = -1  # (the tick of a mark whose invalidation is being asked for on the trio thread)
#: Longest wait, in seconds, of a lookup of a version a GET saw replaced for the listing
#: made since (see FileSystem.lookup). A LIST across regions takes well under a second;
#: when S3 lists slowly or not at all (throttled or failing LISTs, an outage, a directory
#: of many pages), the lookup answers after this long with the listing it has, as before
#: the version was marked, rather than after up to --retry-deadline, during which the
#: process in the LOOKUP cannot even be killed.
REFRESH_WAIT = 2.0
#: Seconds during which a version whose lookup gave up waiting (REFRESH_WAIT) is not
#: marked again by the next GET that sees it replaced: while S3 does not list, each open
#: would otherwise wait that long again.
REMARK_AFTER = 60.0
# Files whose opens the native loop may answer, remembered for the handles it reports
# (an inode is one version, so its node never changes; an inode forgotten here is
# resolved again).
ADOPTABLE = 65536


def _mark(prefix: str, entry: Entry | Node) -> tuple[str, str]:
    """The (key, ETag) a version a GET saw replaced is remembered by, of file ``entry``
    of directory ``prefix`` (as :meth:`FileSystem.object_changed` names it)."""
    return prefix + entry.name.decode("utf-8", "surrogateescape"), entry.etag


class FileSystem:
    def __init__(self, metadata: Metadata, fetcher: Fetcher, *, root_prefix: str,
                 max_readahead: int, prefetcher: Prefetcher, read_order: ReadOrder,
                 lookahead: DirectoryLookahead, backing: BackingFiles | None = None,
                 sweeper: Sweeper | None = None) -> None:
        self.metadata = metadata
        self.fetcher = fetcher
        self.prefetcher = prefetcher
        self.backing = backing
        self.root_prefix = root_prefix
        self.max_readahead = max_readahead
        # Directories' modification time: S3 keeps none for a prefix, and 0 (1970) made
        # `ls -l`, `find -newer` and backup tools see every folder as 56 years old; the
        # time this mount started, as Mountpoint for S3 shows.
        self.dirs_mtime = time.time()
        self._root = Node(ROOT_INODE, True, root_prefix, "", b"", mtime=self.dirs_mtime)
        self._dirs: dict[int, Node] = {}
        self._dirs_lock = threading.Lock()
        #: Runs ``fn(*args)`` on the trio thread soon (the request server sets it; the
        #: default, for callers already on the trio thread, runs it at once).
        self.post: Callable[..., None] = _call
        self._handles: dict[int, FileHandle | DirHandle] = {}
        self._next_fh = itertools.count(1)
        # A handle's try to be bound is claimed under it (see bind_later).
        self._bind_lock = threading.Lock()
        # inode -> (node, object) of files given an open template (see offer_template);
        # oldest first, bounded by ADOPTABLE; any thread, under _adoptable_lock
        self._adoptable: collections.OrderedDict[int, tuple[Node, ObjectVersion]] = (
            collections.OrderedDict())
        self._adoptable_lock = threading.Lock()
        # (key, ETag) of object versions a load found no longer in S3 while their listing
        # may still name them (see object_changed); bounded by CHANGED; read on any thread
        # without a lock (one dictionary lookup), changed under _changed_lock
        # (the value: the tick of the invalidation of its directory the mark asked for)
        self._changed: collections.OrderedDict[tuple[str, str], int] = (
            collections.OrderedDict())
        self._changed_lock = threading.Lock()
        # (key, ETag) -> when a lookup gave up waiting for its listing (trio thread only;
        # bounded by CHANGED): not marked again for REMARK_AFTER seconds
        self._waited_in_vain: collections.OrderedDict[tuple[str, str], float] = (
            collections.OrderedDict())
        fetcher.on_changed = self.object_changed
        # Files that will be read next: the sampler's order (hints) and directory walks;
        # directories read in no predictable order are swept.
        self.read_order = read_order
        self.lookahead = lookahead
        self.sweeper = sweeper

    # -- inodes ---------------------------------------------------------------------
    def _node_for(self, parent_prefix: str, entry: Entry) -> Node:
        name = entry.name.decode("utf-8", "surrogateescape")
        if entry.is_dir:
            return Node(entry.ino, True, parent_prefix + name + "/", parent_prefix, entry.name,
                        mtime=self.dirs_mtime)
        return Node(entry.ino, False, parent_prefix + name, parent_prefix, entry.name,
                    entry.size, entry.mtime, entry.etag)

    def node(self, ino: int) -> Node:
        """The inode ``ino``; FsError(ESTALE) when its version is no longer listed. Any
        thread (a refresh a stale listing needs is posted to the trio thread)."""
        if ino == ROOT_INODE:
            return self._root
        node = self._dirs.get(ino)
        if node is not None:
            return node
        found, due = self.metadata.resolve_now(ino)
        if due is not None:
            self.post(self.metadata.view, due)
        if found is None:
            raise FsError(errno.ESTALE, f"inode {ino} is no longer listed")
        node = self._node_for(*found)
        if node.is_dir:
            with self._dirs_lock:
                if len(self._dirs) >= DIR_CACHE:
                    self._dirs.pop(next(iter(self._dirs)))
                self._dirs[ino] = node
        return node

    node_now = node

    def forget(self, ino: int, nlookup: int) -> None:
        """The kernel dropped references: nothing is kept per inode, nothing to free."""

    # -- metadata operations -------------------------------------------------------------
    def _dir(self, ino: int) -> Node:
        node = self.node(ino)
        if not node.is_dir:
            raise FsError(errno.ENOTDIR)
        return node

    def lookup_fresh_now(self, parent_ino: int, name: bytes,
                         before: Callable[[str], int] | None = None
                         ) -> tuple[Node, float, str, int]:
        """:meth:`lookup` without waiting (any thread; NeedsWait when the directory's
        listing has not reached ``name`` yet), for how many seconds the same answer holds
        unless the metadata's listeners are called for its directory first (see
        :meth:`cachefs.cache.metadata.Metadata.lookup_fresh_now`; 0: no promise), the
        directory's prefix, and what ``before(prefix)`` returned, called before the
        directory's listing is read (0 without it)."""
        if name == b".":  # also of a file: the kernel resolving a file handle (export)
            return self.node(parent_ino), 0.0, "", 0
        parent = self._dir(parent_ino)
        if name == b"..":
            return self._parent_of(parent), 0.0, "", 0
        token = before(parent.path) if before is not None else 0
        known, entry, due, fresh_for = self.metadata.lookup_fresh_now(parent.path, name)
        if due:
            self.post(self.metadata.view, parent.path)
        if not known:
            raise NeedsWait
        if entry is None:
            raise FsError(errno.ENOENT)
        if not entry.is_dir and self._changed and self._outdated(parent.path, entry):
            raise NeedsWait  # the listing's refresh is due first (see lookup)
        return self._node_for(parent.path, entry), fresh_for, parent.path, token

    def directory_now(self, prefix: str) -> tuple[int, float] | None:
        """(the inode of directory ``prefix``, for how many seconds its complete listing
        stays fresh: 0 when it has none or it is stale), or None when its parent's listing
        does not name it (any thread, no side effects)."""
        if prefix == self.root_prefix:
            ino = ROOT_INODE
        else:
            found = self.metadata.dir_ino_now(prefix)
            if found is None:
                return None
            ino = found[0]
        return ino, self.metadata.fresh_for_now(prefix)

    def node_of(self, prefix: str, entry: Entry) -> Node:
        """The node of ``entry`` of directory ``prefix``'s listing (no index read)."""
        return self._node_for(prefix, entry)

    def siblings_now(self, prefix: str, name: bytes, n: int) -> list[Node]:
        """Up to ``n`` entries after ``name`` in directory ``prefix``'s complete listing
        (any thread, no side effects; none without a complete listing)."""
        return [self._node_for(prefix, e)
                for e in self.metadata.entries_after_now(prefix, name, n)]

    async def lookup(self, parent_ino: int, name: bytes) -> Node:
        """Resolve ``name`` in a directory (waits on S3 only for a directory never listed)."""
        if name == b".":  # also of a file: the kernel resolving a file handle (export)
            return self.node(parent_ino)
        parent = self._dir(parent_ino)
        if name == b"..":
            return self._parent_of(parent)
        entry = await self.metadata.lookup(parent.path, name)
        if entry is not None and not entry.is_dir and self._outdated(parent.path, entry):
            # A GET saw this version replaced in S3: the kernel asks here again after an
            # open answered ESTALE (see open_now), once, and must get the new version's
            # inode, so the answer waits for the listing made since -- for REFRESH_WAIT
            # at most: a listing S3 does not give would hold it for the retry deadline.
            mark = _mark(parent.path, entry)
            with trio.move_on_after(REFRESH_WAIT) as wait:
                await self.metadata.refreshed(parent.path, self._changed.get(mark, 0))
            if wait.cancelled_caught:
                self._waited_in_vain[mark] = trio.current_time()
                self._waited_in_vain.move_to_end(mark)
                if len(self._waited_in_vain) > CHANGED:
                    self._waited_in_vain.popitem(last=False)
            entry = await self.metadata.lookup(parent.path, name)
            if entry is not None and not entry.is_dir:
                # Still named (the refresh failed, or a listing this late names it): the
                # mark is dropped, so the kernel's second open is answered as before it
                # was made (served from the cache, or ESTALE at the first read of what S3
                # no longer has), never failed again here.
                self._forget_change(parent.path, entry)
        if entry is None:
            raise FsError(errno.ENOENT)
        return self._node_for(parent.path, entry)

    def _parent_of(self, node: Node) -> Node:
        if node.ino == ROOT_INODE or node.parent_prefix == self.root_prefix:
            return self._root
        grand = parent_prefix(node.parent_prefix)
        name = node.parent_prefix[len(grand):-1].encode("utf-8", "surrogateescape")
        _, entry, _ = self.metadata.lookup_now(grand, name)
        return self._node_for(grand, entry) if entry is not None and entry.is_dir else self._root

    async def getattr(self, ino: int) -> Node:
        return self.node(ino)

    def getattr_now(self, ino: int, fh: int | None = None) -> Node:
        """The attributes of ``ino`` (any thread). The kernel asks with ``fh`` when it
        revalidates an open file before reading it: an inode no longer listed is then
        answered with that handle's version, not ESTALE. An open file goes on being the
        version it opened (its reads serve that version's bytes, or ESTALE once S3 no
        longer has them), and the kernel keeps that inode's pages; ESTALE here would fail
        a read the page cache or the cache could serve. Without ``fh``, an inode some
        handle still holds open is answered with that handle's version too: the kernel
        asks so for an ``fstat`` of an open file, which nothing retries (``mmap`` sizes
        its map with one), and a stat through a name then sees the version the kernel's
        entry names until that entry expires, as with any change within the metadata
        TTL. An inode no handle holds answers ESTALE as in :meth:`node`: a stat through a
        name is retried with a fresh lookup."""
        try:
            return self.node(ino)
        except FsError as exc:
            if exc.errno != errno.ESTALE:
                raise
            held = self._handles.get(fh) if fh is not None else None
            if isinstance(held, FileHandle) and held.node.ino == ino:
                return held.node
            # One pass over the open handles, only for an inode no longer listed (after
            # an object changed in S3): rare, and never on a read's path. list() copies
            # the values under the GIL, so handles opened meanwhile do not disturb it.
            for handle in list(self._handles.values()):
                if isinstance(handle, FileHandle) and handle.node.ino == ino:
                    return handle.node
            raise

    # -- object versions replaced in S3 -------------------------------------------------
    def object_changed(self, obj: ObjectVersion) -> None:
        """A load (a reader's, or one started ahead of any open: prefetch, a walk's
        lookahead, a sweep) found ``obj`` no longer S3's version of its key (trio thread;
        :attr:`cachefs.read.fetcher.Fetcher.on_changed`).

        The version is remembered, then its directory's listing is refreshed
        (:meth:`Metadata.invalidate`, whose listeners end the native loop's epoch of the
        directory: its remembered lookups and open templates). Until the new listing is
        there, an open of the version through its inode answers ESTALE
        (:meth:`open_now`) and a lookup of its name waits for the new listing
        (:meth:`lookup`). The open of an outdated dentry thus succeeds on the new
        version: Linux retries an open that failed ESTALE once, with the whole path
        walked again under LOOKUP_REVAL, and FUSE then sends a LOOKUP even if the
        entry's timeout has not run out. Before, such an open pinned the old version
        while the listing was being refreshed and its first read failed ESTALE (the
        kernel never retries a read). Handles open already keep their version (its
        cached bytes, or ESTALE for what S3 no longer has): nothing here touches them.
        The mark comes first, so an open that finds the directory's epoch ended finds
        the mark too. A lookup waits REFRESH_WAIT at most; a version whose lookup waited
        that long in vain (S3 does not list) is not marked again for REMARK_AFTER seconds:
        its directory is only refreshed, as before marks existed."""
        prefix = parent_prefix(obj.key)
        mark = (obj.key, obj.etag)
        waited = self._waited_in_vain.get(mark)
        if waited is not None:
            if trio.current_time() - waited < REMARK_AFTER:
                self.metadata.invalidate(prefix)  # (refreshed, but no lookup waits for it)
                return
            del self._waited_in_vain[mark]
        since = self._changed.get(mark)
        if since is not None and self.metadata.refresh_pending(prefix, since):
            return  # (another block's load: the refresh asked for then is still to come)
        with self._changed_lock:
            self._changed[mark] = MARKING  # (before the epoch ends: see above)
            if len(self._changed) > CHANGED:
                self._changed.popitem(last=False)
        since = self.metadata.invalidate(prefix)
        with self._changed_lock:
            if since <= 0:  # nothing to refresh (a manifest mount): as before the mark
                self._changed.pop(mark, None)
            elif mark in self._changed:
                self._changed[mark] = since

    def _outdated(self, prefix: str, entry: Entry | Node) -> bool:
        """Whether a file ``entry`` of directory ``prefix`` names a version a GET saw
        replaced while its listing's refresh is pending (any thread). A mark whose
        directory was listed since is dropped: a listing made after the change that still
        names the version is trusted (the object was written back, or S3 says so), and
        otherwise the version is no longer listed (its inode answers ESTALE anyway)."""
        if not self._changed:
            return False
        since = self._changed.get(_mark(prefix, entry))
        if since is None:
            return False
        if since == MARKING or self.metadata.refresh_pending(prefix, since):
            return True
        self._forget_change(prefix, entry)
        return False

    def _forget_change(self, prefix: str, entry: Entry | Node) -> None:
        if self._changed:
            with self._changed_lock:
                self._changed.pop(_mark(prefix, entry), None)

    # -- directories ----------------------------------------------------------------------
    async def opendir(self, ino: int) -> int:
        node = self._dir(ino)
        # Its sub-directories are listed ahead of the walker (when listed).
        self.metadata.list_ahead(node.path)
        fh = next(self._next_fh)
        self._handles[fh] = DirHandle(fh, node)
        return fh

    async def readdir(self, fh: int, start: int) -> Generator[tuple[int, Node], None, None]:
        """Entries from position ``start`` as ``(next position, node)``; the caller must
        call :meth:`readdir_progress` for each entry it sends to the kernel.

        Streams: a directory whose first listing is still running yields the names
        that have arrived (waiting only when none after ``start`` has)."""
        handle = self._handles.get(fh)
        if not isinstance(handle, DirHandle):
            raise FsError(errno.EBADF)
        parent = handle.node
        after = handle.sent.get(start) if start else None
        if start == 0 or after is not None:
            handle.sent = {pos: name for pos, name in handle.sent.items()
                           if start and pos >= start}
            view = await self.metadata.readable(parent.path, after)
            if view is None:
                return _no_entries()
            entries = self.metadata.entries_in(view, after)
        else:  # a seek to a position: count from the start of the complete listing, in
            # a worker thread (O(position) index reads must never hold up the trio thread)
            await self.metadata.ensure(parent.path)
            view = self.metadata.view(parent.path)
            if view is None:
                return _no_entries()
            found, after = await trio.to_thread.run_sync(
                _name_at, self.metadata, view, start - 1)
            if not found:
                return _no_entries()  # past the end
            entries = self.metadata.entries_in(view, after)
        return self._positions(parent, entries, start)

    def _positions(self, parent: Node, entries: Iterator[Entry],
                   start: int) -> Generator[tuple[int, Node], None, None]:
        pos = start
        with snapshot(entries):
            for entry in entries:
                pos += 1
                yield pos, self._node_for(parent.path, entry)

    def readdir_progress(self, fh: int, position: int, node: Node) -> None:
        handle = self._handles.get(fh)
        if isinstance(handle, DirHandle):
            handle.sent[position] = node.name

    def releasedir(self, fh: int) -> None:
        self._handles.pop(fh, None)

    # -- files ------------------------------------------------------------------------------
    def open_now(self, ino: int, reader: int = 0, *,
                 o_direct: bool = False) -> tuple[int, bool, int]:
        """Open a file (any thread; never waits on the trio thread, may wait on the disk
        when passthrough verifies the file); returns (handle, keep_cache, backing_id).
        keep_cache is always True: an inode is one object version, so the kernel's page
        cache of it can never hold bytes of another version. A backing_id > 0 means the
        kernel reads the object's cache file itself (see :mod:`cachefs.passthrough`).
        ``reader`` (the opening thread's id, 0 if unknown) lets directory lookahead
        follow each reader's walk. ``o_direct``: the open asked for O_DIRECT (see
        :meth:`cachefs.passthrough.Passthrough.open`)."""
        node = self.node(ino)
        if node.is_dir:
            raise FsError(errno.EISDIR)
        if self._changed and self._outdated(node.parent_prefix, node):
            # S3 has another version (a GET saw it): the kernel looks the name up again,
            # which waits for the new listing (see object_changed).
            raise FsError(errno.ESTALE, f"{node.path} changed in S3 (its listing is "
                          "being refreshed)")
        obj = ObjectVersion(node.path, node.etag, node.size)
        # Prefetches start on the trio thread; the open does not wait for them, and only
        # an open that moves a hinted order or a walk in order costs a hand-over.
        if self.read_order.opened(node.path):
            self.post(self.read_order.wake)
        due = self.lookahead.observe(node.parent_prefix, node.name, node.ino, reader)
        if due:
            self.post(self.lookahead.issue, due)
        backing_id = self.backing.open(ino, obj, o_direct=o_direct) if self.backing else 0
        fh = next(self._next_fh)
        self._handles[fh] = FileHandle(fh, node, obj, backing_id)
        return fh, True, backing_id

    async def open(self, ino: int, reader: int = 0) -> tuple[int, bool, int]:
        return self.open_now(ino, reader)

    def object_of(self, fh: int) -> tuple[int, bool]:
        """The size of the object version open handle ``fh`` reads, and whether its every
        block is in the memory tier now (any thread)."""
        handle = self._handles.get(fh)
        if not isinstance(handle, FileHandle):
            raise FsError(errno.EBADF)
        return handle.obj.size, self.fetcher.in_memory(handle.obj)

    def read_now(self, fh: int, offset: int, size: int) -> bytes:
        """:meth:`read` of blocks in memory or on local disk (any thread: reads and
        verifies the disk cache itself); NeedsWait when a block must be fetched or is
        being loaded, or when reads ahead are due (files with blocks after this read)."""
        handle = self._handles.get(fh)
        if not isinstance(handle, FileHandle):
            raise FsError(errno.EBADF)
        obj = handle.obj
        f = self.fetcher
        if min(offset + size, obj.size) < obj.size and f.block_count(obj) > 1:
            raise NeedsWait  # the sequential prefetcher must see this read (trio thread)
        data = f.read_now(obj, offset, size)
        if data is None:
            raise NeedsWait(functools.partial(self.join_read, handle, offset, size))
        return data

    def join_read(self, handle: FileHandle, offset: int, size: int, done: ReadDone) -> bool:
        """Attach a read that :meth:`read_now` could not answer to the fetch under way of
        its block (a one-block file; any thread, never waits): ``done`` is called on the
        trio thread with the bytes or the error (ObjectChanged and NoSuchKey handled as
        :meth:`read` handles them), and True is returned; False when there is no such
        fetch (then :meth:`read` answers). The read needs nothing else of the trio
        thread: the sweep only counts reads of blocks not being loaded, and one block
        has no blocks after it to read ahead."""
        prefix = handle.node.parent_prefix
        key = handle.obj.key

        def joined(data: bytes | None, error: BaseException | None) -> None:  # trio thread
            # (ObjectChanged: the fetcher told object_changed before answering)
            if isinstance(error, NoSuchKey):
                log.warning("%s is listed (or in the manifest) but no longer in the bucket: "
                            "ENOENT", key)
                self.metadata.invalidate(prefix)
            done(data, error)

        if not self.fetcher.join_now(handle.obj, offset, size, joined):
            return False
        self.lookahead.reader_waits(prefix)  # (its walk may be stretched meanwhile)
        return True

    async def read(self, fh: int, offset: int, size: int) -> bytes:
        handle = self._handles.get(fh)
        if not isinstance(handle, FileHandle):
            raise FsError(errno.EBADF)
        obj = handle.obj
        # Prefetch flights are started first but cannot starve this read: they may use
        # only a share of the S3 connections (see Fetcher), and never wait for budget.
        if handle.stream is None:
            handle.stream = ReadStream(size=obj.size, block_size=self.fetcher.block_size,
                                       max_window=self.max_readahead)
            if self.sweeper is not None:
                # The handle's first read that the workers could not answer from memory
                # or disk: a miss, unless its block is being loaded (the sweep decides).
                self.sweeper.on_miss(handle.node.parent_prefix, handle.node.ino, obj)
        self.prefetcher.on_read(handle.stream, obj, offset, size)
        try:
            # (ObjectChanged: the fetcher told object_changed, whoever's load it was)
            return await self.fetcher.read(obj, offset, size, random=handle.stream.random)
        except NoSuchKey:
            log.warning("%s is listed (or in the manifest) but no longer in the bucket: "
                        "ENOENT", obj.key)
            self.metadata.invalidate(handle.node.parent_prefix)
            raise

    def bind_later(self, fh: int, now: float) -> tuple[int, int]:
        """For a handle served by the daemon since its open (its object was not cached
        whole then): (id, object size) to bind it to the native loop with, once its
        object is cached whole and registered (:meth:`BackingFiles.upgrade`: with the
        kernel's passthrough, a registration with the loop beside the kernel's), else
        (0, 0). Tried at a READ at most every BIND_RETRY seconds, backing off to
        BIND_RETRY_MAX while the object stays incomplete (each try looks every block up in
        the index). Any thread (a request worker, at a READ of ``fh``: no release of it
        runs meanwhile; other READs of it may, and one of them at a time tries: the try
        is claimed under ``_bind_lock``)."""
        handle = self._handles.get(fh)
        if (not isinstance(handle, FileHandle) or handle.backing_id or handle.beside
                or handle.adopted or self.backing is None or now < handle.bind_at):
            return 0, 0
        with self._bind_lock:
            # The kernel sends READs of one handle at once (threads sharing a descriptor,
            # its readahead), to several workers: one of them tries, the others are
            # answered as before. A second bind would take a second use of the
            # registration, which the handle's one release never lets go of.
            bind_at = handle.bind_at
            if now < bind_at or handle.backing_id or handle.beside:
                return 0, 0
            handle.bind_at = math.inf  # (until this try has ended)
        if not bind_at:
            # Its first READ: a handle that lives less than this (a small file's, read once
            # in a cold pass) is never bound: binding costs more than the loop saves it.
            handle.bind_at = now + BIND_RETRY
            return 0, 0
        try:
            due = self.backing.upgrade_due(handle.obj)
            backing_id = self.backing.upgrade(handle.node.ino, handle.obj) if due else 0
        except BaseException:
            handle.bind_at = now + BIND_RETRY
            raise
        if not due:
            # (cheap: looked at again soon, so a reader's next epoch finds the handle bound
            # from its start, however long the first one took)
            handle.bind_at = now + BIND_POLL
            return 0, 0
        if not backing_id:
            handle.bind_wait = min(BIND_RETRY_MAX, max(BIND_RETRY, 2 * handle.bind_wait))
            handle.bind_at = now + handle.bind_wait
            return 0, 0
        if self.backing.native:
            handle.backing_id = backing_id
        else:
            handle.beside = backing_id
        return backing_id, handle.obj.size

    def release(self, fh: int) -> None:
        handle = self._handles.pop(fh, None)
        if isinstance(handle, FileHandle) and self.backing is not None and not handle.adopted:
            self.backing.release(handle.node.ino, handle.backing_id)
            if handle.beside:
                self.backing.release_beside(handle.node.ino, handle.beside)

    # -- opens answered by the native loop (cachefs.fuse.native) ------------------------
    def offer_template(self, fh: int, epoch: Callable[[str], int]) -> bool:
        """Let the native loop answer the next opens of open handle ``fh``'s inode itself,
        as this one was answered, while its directory's listing stays as it is now (any
        thread; see :meth:`cachefs.passthrough.Passthrough.add_template`; ``epoch(prefix)``
        reads the loop's epoch token of a directory). Its handles are reported afterwards,
        in order (:meth:`adopt`)."""
        handle = self._handles.get(fh)
        if (not isinstance(handle, FileHandle) or not handle.backing_id or handle.adopted
                or self.backing is None):
            return False
        node = handle.node
        token = epoch(node.parent_prefix)
        try:
            self.node(node.ino)  # still listed (after the epoch read: see the loop's rule)
        except FsError:
            return False
        if self._outdated(node.parent_prefix, node):
            return False  # (a GET saw it replaced; marked before the epoch ended)
        self._note_adoptable(node, handle.obj)
        return self.backing.add_template(node.ino, handle.obj, handle.backing_id, token=token,
                                         prefix=node.parent_prefix)

    def offer_template_ahead(self, ino: int, obj: ObjectVersion,
                             epoch: Callable[[str], int]) -> bool:
        """Let the native loop answer even the first open of ``ino`` (``obj``, whose file
        was just registered ahead of any open: a file a directory walk fetched ahead) while
        its directory's listing stays as it is now (any thread: the preparing threads of
        :class:`cachefs.passthrough.Passthrough`). The same rule as
        :meth:`offer_template`: the epoch is read first, then the inode must still be this
        version of the object, so a listing changed meanwhile ends the template with its
        epoch (a newer version has another inode)."""
        if self.backing is None:
            return False
        prefix = parent_prefix(obj.key)
        token = epoch(prefix)
        try:
            node = self.node(ino)  # (after the epoch read: see the loop's rule)
        except FsError:
            return False
        if (node.is_dir or node.path != obj.key or node.etag != obj.etag
                or node.size != obj.size or self._outdated(prefix, node)):
            return False
        self._note_adoptable(node, obj)
        return self.backing.add_template_ahead(ino, obj, token=token, prefix=prefix)

    def _note_adoptable(self, node: Node, obj: ObjectVersion) -> None:
        """Keep what :meth:`adopt` needs of a file about to get an open template."""
        if node.ino not in self._adoptable:
            with self._adoptable_lock:
                self._adoptable[node.ino] = (node, obj)
                if len(self._adoptable) > ADOPTABLE:
                    self._adoptable.popitem(last=False)

    def adopt(self, opened: list[tuple[int, int, int]], released: Collection[int]) -> None:
        """The native loop opened handles ``opened`` ((handle, inode, reader) each, in the
        order it opened them) and released handles ``released`` since the last batch (any
        thread, after the fact, one batch at a time): what :meth:`open_now` does for an
        open besides the answer -- the hint cursor, the directory walk, the handle (a read
        of it may still reach Python) -- and what :meth:`release` does for a release.
        A handle opened and released within the batch gets no entry in the handle table:
        no request of it can reach Python any more (a small file's open, read and release
        all fall within one batch of a warm pass). Handle numbers are never reused, so
        the releases need no order among the opens."""
        objs: list[ObjectVersion] = []
        handles = self._handles
        observe, issue = self.lookahead.observe, self.lookahead.issue
        for fh, ino, reader in opened:
            found = self._adoptable.get(ino)
            if found is None:
                try:
                    node = self.node(ino)
                except FsError:
                    continue  # no longer listed: a read of it reaching Python fails EBADF
                found = (node, ObjectVersion(node.path, node.etag, node.size))
            node, obj = found
            if self.read_order.opened(node.path):
                self.post(self.read_order.wake)
            due = observe(node.parent_prefix, node.name, ino, reader)
            if due:
                self.post(issue, due)
            objs.append(obj)
            if fh not in released:
                handles[fh] = FileHandle(fh, node, obj, 0, adopted=True)
        if objs and self.backing is not None:
            self.backing.adopted(objs)
        for fh in released:
            handles.pop(fh, None)

    @property
    def open_handles(self) -> int:
        return sum(1 for h in self._handles.values() if isinstance(h, FileHandle))


def _call(fn: Callable[..., Any], *args: Any) -> None:
    fn(*args)



def _no_entries() -> Generator[tuple[int, Node], None, None]:
    """What :meth:`FileSystem.readdir` answers past a directory's end (a generator, as
    every answer of it: its caller closes it)."""
    yield from ()


def _name_at(metadata: Metadata, view: View, index: int) -> tuple[bool, bytes | None]:
    """(whether it exists, the name of) entry ``index`` of ``view`` (any thread)."""
    with snapshot(metadata.entries_in(view)) as entries:
        entry = next(itertools.islice(entries, index, None), None)
    return (False, None) if entry is None else (True, entry.name)
