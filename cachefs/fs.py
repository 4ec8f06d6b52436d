"""File-system semantics without FUSE: inodes, lookups, directories, reads.

:class:`FileSystem` is what the pyfuse3 adapter (:mod:`cachefs.fuse_ops`)
calls. It raises :class:`FsError` (carrying an errno) for file-system
conditions and lets :mod:`cachefs.errors` types through; the adapter maps
both to errno values in one table.

Inodes: numbers are allocated on first sight of a path and live while the
kernel holds a reference (lookup count > 0, released by ``forget``). The root
is inode 1 and never forgotten. Paths are S3 keys: a directory's ``prefix``
ends with ``/`` (the root's is the mount prefix), a file's ``key`` is its
object key.

Concurrency: every method runs on the trio thread. ``_nodes``, ``_by_path``
and ``_handles`` are only touched there, and never across an ``await`` in a
way that assumes they did not change.
"""

from __future__ import annotations

import dataclasses
import errno
import itertools
import logging
from collections.abc import Iterator
from typing import Protocol

from cachefs.cache.metadata import Entry, Metadata
from cachefs.errors import ObjectChanged
from cachefs.read.fetcher import Fetcher, ObjectVersion
from cachefs.read.hints import ReadOrder
from cachefs.read.lookahead import DirectoryLookahead
from cachefs.read.prefetcher import Prefetcher
from cachefs.read.sequential import ReadStream

log = logging.getLogger(__name__)

ROOT_INODE = 1


class BackingFiles(Protocol):
    """Hands fully cached objects' files to the kernel (FUSE passthrough).

    Implemented by :class:`cachefs.passthrough.Passthrough`; the file system
    only needs these two calls, so it stays free of pyfuse3.
    """

    async def open(self, ino: int, obj: ObjectVersion) -> int:
        """A backing id for a new handle of ``ino`` (the kernel reads the file), or 0."""
        ...

    def release(self, ino: int, backing_id: int) -> None:
        """The handle opened with answer ``backing_id`` is closed."""
        ...


class FsError(Exception):
    """A file-system error with its errno (ENOENT, ENOTDIR, EISDIR, EROFS...)."""

    def __init__(self, errno_: int, message: str = "") -> None:
        super().__init__(message or errno.errorcode.get(errno_, str(errno_)))
        self.errno = errno_


@dataclasses.dataclass(slots=True)
class Node:
    """An inode: a directory (``prefix``) or a file (``key`` and its version)."""

    ino: int
    is_dir: bool
    path: str  # directory: prefix ending in "/" (or ""); file: object key
    parent_prefix: str
    name: bytes
    size: int = 0
    mtime: float = 0.0
    etag: str = ""
    lookups: int = 0
    last_open_etag: str | None = None

    def update(self, entry: Entry) -> None:
        self.size, self.mtime, self.etag = entry.size, entry.mtime, entry.etag


@dataclasses.dataclass(slots=True)
class FileHandle:
    fh: int
    node: Node
    obj: ObjectVersion
    stream: ReadStream
    backing_id: int = 0  # > 0: the kernel reads the cache file itself (passthrough)


@dataclasses.dataclass(slots=True)
class DirHandle:
    fh: int
    node: Node
    last_index: int = 0
    last_name: bytes | None = None


class FileSystem:
    def __init__(self, metadata: Metadata, fetcher: Fetcher, *, root_prefix: str,
                 max_readahead: int, prefetcher: Prefetcher, read_order: ReadOrder,
                 lookahead: DirectoryLookahead, backing: BackingFiles | None = None) -> None:
        self.metadata = metadata
        self.fetcher = fetcher
        self.prefetcher = prefetcher
        self.backing = backing
        self.root_prefix = root_prefix
        self.max_readahead = max_readahead
        root = Node(ROOT_INODE, True, root_prefix, "", b"", lookups=1)
        self._nodes: dict[int, Node] = {ROOT_INODE: root}
        self._by_path: dict[str, int] = {root_prefix: ROOT_INODE}
        self._next_ino = itertools.count(ROOT_INODE + 1)
        self._handles: dict[int, FileHandle | DirHandle] = {}
        self._next_fh = itertools.count(1)
        # Files that will be read next: the sampler's order (hints) and directory walks.
        self.read_order = read_order
        self.lookahead = lookahead

    # -- inodes ---------------------------------------------------------------------
    def node(self, ino: int) -> Node:
        node = self._nodes.get(ino)
        if node is None:
            raise FsError(errno.ENOENT, f"inode {ino} is not known")
        return node

    def _node_for(self, parent: Node, entry: Entry) -> Node:
        """The node of ``entry`` in ``parent`` (allocated if new); lookup count unchanged."""
        name = entry.name.decode()
        path = parent.path + name + ("/" if entry.is_dir else "")
        ino = self._by_path.get(path)
        if ino is not None:
            node = self._nodes[ino]
            if node.is_dir == entry.is_dir:
                if not entry.is_dir:
                    node.update(entry)
                return node
        node = Node(next(self._next_ino), entry.is_dir, path, parent.path, entry.name)
        if not entry.is_dir:
            node.update(entry)
        self._nodes[node.ino] = node
        self._by_path[path] = node.ino
        return node

    def remember(self, node: Node) -> None:
        """The kernel took a reference to ``node`` (lookup, readdirplus entry)."""
        node.lookups += 1

    def forget(self, ino: int, nlookup: int) -> None:
        node = self._nodes.get(ino)
        if node is None or ino == ROOT_INODE:
            return
        node.lookups -= nlookup
        if node.lookups <= 0:
            del self._nodes[ino]
            if self._by_path.get(node.path) == ino:
                del self._by_path[node.path]

    @property
    def inode_count(self) -> int:
        return len(self._nodes)

    # -- metadata operations -------------------------------------------------------------
    def _dir(self, ino: int) -> Node:
        node = self.node(ino)
        if not node.is_dir:
            raise FsError(errno.ENOTDIR)
        return node

    async def lookup(self, parent_ino: int, name: bytes) -> Node:
        """Resolve ``name`` in a directory and take a reference (lookup count + 1)."""
        parent = self._dir(parent_ino)
        if name == b".":
            node = parent
        elif name == b"..":
            node = self._parent_of(parent)
        else:
            await self.metadata.ensure(parent.path)
            entry = self.metadata.get(parent.path, name)
            if entry is None:
                raise FsError(errno.ENOENT)
            node = self._node_for(parent, entry)
        self.remember(node)
        return node

    def _parent_of(self, node: Node) -> Node:
        ino = self._by_path.get(node.parent_prefix) if node.ino != ROOT_INODE else ROOT_INODE
        return self._nodes[ino] if ino is not None else self._nodes[ROOT_INODE]

    async def getattr(self, ino: int) -> Node:
        node = self.node(ino)
        if not node.is_dir and not self.metadata.is_fresh(node.parent_prefix):
            await self._revalidate(node)
        return node

    async def _revalidate(self, node: Node) -> None:
        """Refresh a file's attributes from its directory's listing (listing it if stale)."""
        await self.metadata.ensure(node.parent_prefix)
        entry = self.metadata.get(node.parent_prefix, node.name)
        if entry is None or entry.is_dir:
            # Gone from the bucket: keep answering with the last known version; reads
            # of it fail with ESTALE (If-Match) rather than serving another object.
            return
        node.update(entry)

    # -- directories ----------------------------------------------------------------------
    async def opendir(self, ino: int) -> int:
        node = self._dir(ino)
        await self.metadata.ensure(node.path)
        fh = next(self._next_fh)
        self._handles[fh] = DirHandle(fh, node)
        return fh

    async def readdir(self, fh: int, start: int) -> Iterator[tuple[int, Node]]:
        """Entries from position ``start`` as ``(next position, node)``; the caller takes a
        reference (``remember``) for each entry the kernel accepted and then must call
        :meth:`readdir_progress` with the last accepted position."""
        handle = self._handles.get(fh)
        if not isinstance(handle, DirHandle):
            raise FsError(errno.EBADF)
        parent = handle.node
        if start == 0:
            await self.metadata.ensure(parent.path)
            entries = self.metadata.iter_entries(parent.path)
        elif start == handle.last_index and handle.last_name is not None:
            entries = self.metadata.iter_entries(parent.path, after=handle.last_name)
        else:
            entries = itertools.islice(self.metadata.iter_entries(parent.path), start, None)
        return self._positions(parent, entries, start)

    def _positions(self, parent: Node, entries: Iterator[Entry],
                   start: int) -> Iterator[tuple[int, Node]]:
        pos = start
        for entry in entries:
            pos += 1
            yield pos, self._node_for(parent, entry)

    def readdir_progress(self, fh: int, position: int, node: Node) -> None:
        handle = self._handles.get(fh)
        if isinstance(handle, DirHandle):
            handle.last_index, handle.last_name = position, node.name

    def releasedir(self, fh: int) -> None:
        self._handles.pop(fh, None)

    # -- files ------------------------------------------------------------------------------
    async def open(self, ino: int, reader: int = 0) -> tuple[int, bool, int]:
        """Open a file; returns (handle, keep_cache, backing_id). keep_cache is True only
        when the object's ETag is the one seen at the previous open, so the kernel's page
        cache is reused across opens but never holds bytes of another version. A
        backing_id > 0 means the kernel reads the object's cache file itself
        (see :mod:`cachefs.passthrough`). ``reader`` (the opening thread's id, 0 if
        unknown) lets directory lookahead follow each reader's walk."""
        node = self.node(ino)
        if node.is_dir:
            raise FsError(errno.EISDIR)
        if not self.metadata.is_fresh(node.parent_prefix):
            await self._revalidate(node)
        obj = ObjectVersion(node.path, node.etag, node.size)
        keep_cache = node.last_open_etag == node.etag
        node.last_open_etag = node.etag
        self.read_order.on_open(node.path)
        self.lookahead.on_open(node.parent_prefix, node.name, reader)
        backing_id = await self.backing.open(ino, obj) if self.backing else 0
        fh = next(self._next_fh)
        self._handles[fh] = FileHandle(
            fh, node, obj,
            ReadStream(size=obj.size, block_size=self.fetcher.block_size,
                       max_window=self.max_readahead),
            backing_id)
        return fh, keep_cache, backing_id

    async def read(self, fh: int, offset: int, size: int) -> bytes:
        handle = self._handles.get(fh)
        if not isinstance(handle, FileHandle):
            raise FsError(errno.EBADF)
        obj = handle.obj
        if obj.etag != handle.node.last_open_etag:
            # An old version is read into this inode's page cache: the next open must
            # not keep that cache, whatever version it finds.
            handle.node.last_open_etag = None
        # Prefetch flights are started first but cannot starve this read: they may use
        # only a share of the S3 connections (see Fetcher), and never wait for budget.
        self.prefetcher.on_read(handle.stream, obj, offset, size)
        try:
            return await self.fetcher.read(obj, offset, size)
        except ObjectChanged:
            self.metadata.invalidate(handle.node.parent_prefix)
            raise

    def release(self, fh: int) -> None:
        handle = self._handles.pop(fh, None)
        if isinstance(handle, FileHandle) and self.backing is not None:
            self.backing.release(handle.node.ino, handle.backing_id)

    @property
    def open_handles(self) -> int:
        return sum(1 for h in self._handles.values() if isinstance(h, FileHandle))
