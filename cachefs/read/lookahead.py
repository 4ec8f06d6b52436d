"""Directory lookahead: prefetch the next files of a directory walked in name order.

Concurrency: trio thread only; :meth:`DirectoryLookahead.on_open` is called by
the file system on every open and only starts fetches (``Prefetcher.want``
never waits).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from cachefs.cache.metadata import Entry
from cachefs.read.fetcher import ObjectVersion
from cachefs.read.prefetcher import DIRECTORY, Prefetcher


class _Walk:
    __slots__ = ("ahead", "issued_until", "last", "streak")

    def __init__(self, name: bytes) -> None:
        self.last = name
        self.streak = 0
        self.ahead = 0  # files requested ahead of the readers (approximate)
        self.issued_until: bytes | None = None


class DirectoryLookahead:
    """Prefetch the next files of a directory when readers open its files in name order.

    Walks are followed per reader and per directory: each open steps both the
    walk of its reader (the FUSE request's thread id: one DataLoader worker,
    one thread) and the directory's shared walk (readers taking turns over one
    in-order sequence, such as a thread pool). A walk advances when the file is
    among the ``adjacency`` entries after its previous file (or among the files
    it already requested ahead); any other open restarts it. After
    ``min_streak`` advances, up to ``window(streak)`` files after the walk are
    requested (doubling with the streak, at most ``max_files``). Each open
    consumes one file of the window; only the shortfall is issued, continuing
    after the last file requested, so the cost per open is a few index lookups
    however large the window. A random order does not advance a walk three
    times running, so random readers pay nothing. Blocks go through
    ``Prefetcher.want`` (never waits, bounded by budget).
    """

    def __init__(self, prefetcher: Prefetcher,
                 iter_after: Callable[[str, bytes], Iterator[Entry]], *,
                 max_files: int = 256, min_streak: int = 3, max_walks: int = 4096,
                 adjacency: int = 8) -> None:
        self._prefetcher = prefetcher
        self._iter_after = iter_after
        self.adjacency = adjacency
        self.max_files = max_files
        self.min_streak = min_streak
        self.max_walks = max_walks
        # (directory, reader) -> walk, least recently used first; reader 0 = shared walk
        self._walks: dict[tuple[str, int], _Walk] = {}

    def _follows(self, prefix: str, last: bytes, name: bytes, walk: _Walk) -> bool:
        """Whether ``name`` is among the next few files after ``last`` (or among those
        already requested ahead): a reader walking the directory in order, but not a
        random order that happens to ascend."""
        if walk.issued_until is not None and last < name <= walk.issued_until:
            return True
        entries = self._iter_after(prefix, last)
        try:
            for i, entry in enumerate(entries):
                if entry.name == name:
                    return True
                if i + 1 >= self.adjacency or entry.name > name:
                    return False
        finally:
            close = getattr(entries, "close", None)
            if close is not None:
                close()
        return False

    def on_open(self, prefix: str, name: bytes, reader: int = 0) -> int:
        """Record an open by ``reader`` (a thread id; 0 if unknown); returns how many
        files were newly requested."""
        issued = self._on_open(prefix, name, (prefix, 0))
        if reader:
            issued += self._on_open(prefix, name, (prefix, reader))
        return issued

    def _step(self, key: tuple[str, int], name: bytes) -> _Walk:
        prefix = key[0]
        walk = self._walks.pop(key, None)
        if walk is None:
            walk = _Walk(name)
        elif name > walk.last and self._follows(prefix, walk.last, name, walk):
            walk.streak += 1
            walk.last = name
            walk.ahead = max(0, walk.ahead - 1)
        elif name != walk.last:
            walk = _Walk(name)
        self._walks[key] = walk  # most recently used last
        if len(self._walks) > self.max_walks:
            self._walks.pop(next(iter(self._walks)))
        return walk

    def _on_open(self, prefix: str, name: bytes, key: tuple[str, int]) -> int:
        walk = self._step(key, name)
        if walk.streak < self.min_streak:
            return 0
        window = min(self.max_files, 2 ** (walk.streak - self.min_streak + 2))
        if walk.issued_until is None or walk.issued_until <= name:
            walk.issued_until, walk.ahead = name, 0
        want = window - walk.ahead
        issued = 0
        if want <= 0:
            return 0
        entries = self._iter_after(prefix, walk.issued_until)
        try:
            for entry in entries:
                if entry.is_dir:
                    continue
                obj = ObjectVersion(prefix + entry.name.decode(), entry.etag, entry.size)
                if self._prefetcher.want_object(obj, DIRECTORY) is None:
                    break  # memory budget full
                walk.issued_until = entry.name
                walk.ahead += 1
                issued += 1
                if issued >= want:
                    break
        finally:
            close = getattr(entries, "close", None)
            if close is not None:
                close()
        return issued
