"""Directory lookahead: prefetch the next files of a directory walked in name order.

A walk is recognised by *where* its opens land, not by their order alone. Files
are placed by inode number: a listing gives the names of a directory
consecutive numbers in name order (:mod:`cachefs.cache.index`), so "the next
files" are the next numbers. A walk has a frontier (the furthest position
opened) and remembers which of the 64 positions below it were opened. An open
at most ``adjacency`` positions past the frontier (or among the files
requested ahead) moves it; an open at most ``adjacency`` behind it (a slower
reader of a pool; also below the walk's first open, since a pool's first opens
arrive in any order) is recorded; any other open restarts the walk, and so does
a position more than ``adjacency`` behind the frontier left unopened (a walk
in order leaves no file behind). One reader's own walk allows a step of 2 (a
sub-directory between two files) instead of ``adjacency``: a reader reads its
files one after the other. A walk is *in order* when at least
``min_opens`` positions were opened and they fill at least ``density`` of the
span they cover: a reader walking the directory fills every position, a pool
of readers taking turns over one sequence all but the few still in flight,
while a shuffled reader keeps restarting its walk (its next open is rarely
just past the last one, and its jumps leave holes behind). Opens arriving out
of order need twice their disorder in further opens, unless they are exactly
the directory's first files (a pool starting its walk: trusted at once). In a
small directory "rarely" is not rare: most opens land within ``adjacency`` of
the frontier, and a shuffled pass over 20 files opens 4 ascending within 5
positions once in 90 passes (a shuffled epoch over 10 such folders fetched a
folder's worth for nobody about once in 20). So a directory's shared walk needs
as many opens as a shuffled pass over its files shows less than once in
:data:`WALK_ODDS` passes (:func:`least_opens`: 7 of 20 files, 5 of 39-201, 4
of 202 and more, never 8 or fewer: a walk carried in, or the walk over folders,
follows those), and so does the walk over a parent's folders (below: 9 of 10
folders, 5 of 150). Readers of folders too small to show a walk of their own in
a few opens (a pool over folders of 10 files, read in order) are followed from
the second folder: a folder read through from its first file, in order but for
a pool's disorder, and left for the next one in the listing, has that one
trusted at its readers' first opens there (:meth:`DirectoryLookahead._read_through`).
Parents with too few folders for a walk over them (a hashed tree: two folders of two
files each) have their readers' walk followed one level up, over the grandparent's
folders (:meth:`DirectoryLookahead._follow_parents`), and told the same way when they read
each parent in part.

Walks are followed per reader and per directory: each open steps both the walk
of its reader (the FUSE request's thread id: one DataLoader worker, one
thread) and the directory's shared walk (a thread pool over one in-order
sequence). While a walk is in order, up to ``window`` files after it are
requested (doubling with the files it opened, at most ``max_files``); each open
consumes one, and the shortfall is issued once it reaches a quarter of the window
(a top-up costs a hand-over to the trio thread), continuing after the last file
requested.

A walk that requests the last file of its directory goes on into the next
directory of the parent's listing (``next_dir``; a DataLoader over class
folders in directory order reads them one after the other): the files of
that directory it still wants are requested there, and the directory gets a
shared walk that starts trusted, so its readers keep the requests flowing
without first proving their order again (and without a stall of one round trip
per directory; in a tree of several levels the directory after a parent's last
folder is the next parent's first folder with files, see ``Metadata.next_walked_dir``).
``next_dir`` also has that directory listed early: it is asked
as soon as a walk is in order, so the listing is there when the walk needs it.
A directory not listed yet when the walk ends is not carried into. The
directory's shared walk then keeps its window full across folders: its
further top-ups go on in the directories after it (:meth:`_forward`; each
walk passed counts those files as ahead of its own readers, and none is pushed
past a window ahead of them), so a pool reading small folders one after the
other keeps a window of GETs in flight, not only the rest of the folder it is
in. Those far requests stop at the first file already on local disk (cached
files are loaded into memory by their folder's own walk, when its readers get
there), and ``next_dir`` lists several folders ahead (a folder of small files
is read faster than a LIST crosses regions).

A window counts the files requested ahead of the readers, landed or not. When the
readers wait for one slow GET (it shares the link with a window of others) while
the rest land, no open tops the window up and the link idles until that GET ends:
so when fewer than a quarter of a window are still being fetched and a reader of
the directory waited for a fetch lately, the walk that requested last is
*stretched* (:meth:`DirectoryLookahead.on_load_end`): up to a window in flight, at
most :data:`STRETCH` windows ahead of its readers. Readers slower than the link
never wait for a fetch, so their walks are never stretched.

Speculation must not waste: files requested ahead that a directory's readers
never reach (its shared walk restarted elsewhere: shuffled readers that looked
ordered for a moment) count against the directory, and each such miss doubles
the opens its walks need before they are trusted again (up to ``min_opens <<
MAX_PENALTY``); a walk that consumes its window undoes one doubling. Readers
that read each folder only in part (a subset script: the first files of every
class folder) are told by the folder they leave (:meth:`_follow_folders`):
files requested there and never reached double the opens the walks of every
folder of that parent need, and stop carries into the next folders; a folder
read to its end undoes one doubling.

Concurrency: :meth:`DirectoryLookahead.observe` runs on the FUSE request
workers (any thread) and only updates walks, under ``_lock``; when a walk is
due to request files it returns it, and :meth:`DirectoryLookahead.issue` (trio
thread: it starts fetches through ``Prefetcher.want``, which never waits) does
the requesting. :meth:`on_open` does both, for callers on the trio thread.
``on_load_end`` runs on the trio thread too (a prefetch's end) and only calls
``issue``; ``reader_waits`` (any thread) only stamps ``_waited``.
``issue`` holds ``_lock`` only to read a walk's position and to record what it
requested: the listing walk and the loads it starts (up to a quarter of a
window of files) run without it, so an open on a worker never waits for them.
Only ``issue`` (one thread, never re-entered) requests files, so a walk's
requests never overlap; readers moving the walk meanwhile are accounted for when
the result is recorded (:func:`_advance`); ``_ahead`` (the files requested whose
directory loads may be in flight) is read and written only there. The flags ``asked_next`` and
``carried`` are written only by ``issue`` (and :meth:`_forward`, which it
calls); ``carried_to``, ``retry_at`` and ``ahead`` only under ``_lock``. The
per-parent state (``_skips``, ``_folder``, ``_left``, ``_opens_under``, ``_entered``, and the walks
over folders ``_folder_walks`` with the folder positions ``_folder_inos``, whose
``folder_ino`` lookups run under the lock once per folder) is
changed only by ``observe`` under ``_lock`` (the same dictionaries keyed by a
grandparent for the walk over parents, :meth:`_follow_parents`); ``issue`` reads
``_skips`` without it (:meth:`_skipped`, two dictionary lookups: a stale answer costs
one top-up more or less).
"""

from __future__ import annotations

import collections
import functools
import math
import threading
import time
from collections.abc import Callable, Iterator

from cachefs.cache.index import parent_prefix, snapshot
from cachefs.cache.metadata import Entry
from cachefs.read.fetcher import ObjectVersion
from cachefs.read.prefetcher import DIRECTORY, Prefetcher

#: Positions a walk remembers below the furthest one opened.
SPAN = 64
#: A walk that went on into the next directories and found nothing more to request
#: there tries again after its readers opened this many more files.
RETRY_OPENS = 16
#: Opens under a parent after its readers moved to another folder, before the folder
#: they left is looked at (whether they left files requested ahead unread in it).
LEFT_CHECK_OPENS = 32
#: Folders left and not looked at yet, per parent (the oldest are dropped): more than
#: LEFT_CHECK_OPENS, or readers opening one file per folder push every one out before
#: it is looked at.
LEFT_CHECKS = 64
#: Misses double the opens a directory's walks need, at most this many times.
MAX_PENALTY = 4
#: A walk whose readers wait while its GETs land is stretched to at most this many windows
#: ahead of them (see DirectoryLookahead.on_load_end) ...
STRETCH = 2
#: ... when one of them waited for a fetch this recently (seconds).
WAITED_LATELY = 0.5
#: A walk whose opens are exactly its directory's first files is trusted without the
#: disorder allowance when shuffled readers would open exactly those first less than once
#: in this many tries (C(files, opens needed): 4 opens of 41 files and more; a directory
#: of 20 files would be 1 in 4,845, and a run of 20-file folders gives many tries).
FROM_START_ODDS = 100_000
#: ... and such a walk (its directory not penalised) starts with a window of at least
#: 2**FROM_START_WINDOW files, not 4 doubling with each open: its readers' next opens wait
#: for their files, so each doubling costs a round of GETs across regions (at 200 ms, the
#: window reached the link's bandwidth-delay product ~0.3 s after the first opens).
FROM_START_WINDOW = 5
#: A run of opens is taken for a walk only when a shuffled pass over its directory's
#: files (or its parent's folders) opens such a run less than once in this many passes:
#: see least_opens. (At 4 opens, a pass over a folder of 20 files did once in 90, 10
#: folders entered 20 times each once in 10: a shuffled epoch over 10 such folders fetched
#: a folder's worth for nobody about once in 20.)
WALK_ODDS = 10_000
#: A folder read through (see DirectoryLookahead._read_through) counts for the next one
#: when it is so within this many opens under their parent after its readers went on ...
READ_THROUGH_OPENS = 16
#: ... and none of its files was opened more than this many behind the furthest one.
READ_THROUGH_SPREAD = 3
#: The most files of a top-up looked up in the disk's index in one read (see
#: DirectoryLookahead._request).
BATCH = 32
#: Files requested ahead whose loads may still be in flight, remembered (the oldest are
#: forgotten first: a file forgotten is asked about again as before; see
#: DirectoryLookahead._take).
AHEAD_MEMORY = 8192
_MASK = (1 << SPAN) - 1

WalkKey = tuple[str, int]  # (directory prefix, reader; 0 = the directory's shared walk)


class _Walk:
    __slots__ = (
        "ahead",
        "asked_next",
        "carried",
        "carried_to",
        "end",
        "files",
        "first",
        "hi",
        "hits",
        "issued_ino",
        "issued_until",
        "last",
        "lo",
        "opened",
        "retry_at",
        "spread",
        "steps",
        "trusted",
        "under",
    )

    def __init__(self, name: bytes, ino: int) -> None:
        self.lo = self.hi = ino
        self.opened = 1  # bit i: position hi - i was opened
        self.last = name  # the name at position hi
        self.ahead = 0  # files requested ahead and not reached yet
        self.issued_until: bytes | None = None  # the last name requested ahead
        self.issued_ino = 0
        self.end = False  # nothing after issued_until: the directory is all requested
        self.hits = 0  # opens of files requested ahead, since the last forgiveness
        self.spread = 0  # the furthest behind the frontier an open landed
        # The inode of its directory's first file and the directory's number of files (of a
        # walk over folders: the parent's number of folders), once asked (-1: not asked;
        # 0: not known)
        self.first = self.files = -1
        self.asked_next = False  # next_dir() was asked (its listing started early)
        self.carried = False  # at its end, and went on into the next directory (or none)
        # A directory's shared walk that went on: the directory its further requests go to
        # (the one it went into, or one after that; None when there is none to go to)
        self.carried_to: str | None = None
        # Going on found nothing to request (a listing not there yet, cached files): not
        # tried again before the walk's readers reach this position (each try costs a
        # hand-over to the trio thread)
        self.retry_at = 0
        self.trusted = False  # made by a carry, trusted before any open of its own
        # (A directory's shared walk) its opens, and the opens under its parent before its
        # first: every open under the parent since was one of its own while
        # _opens_under[parent] - under == steps (see DirectoryLookahead._concentrated)
        self.steps = 0
        self.under = 0

    def count(self) -> int:
        return self.opened.bit_count()

    def span(self) -> int:
        return min(SPAN, self.hi - self.lo + 1)


class DirectoryLookahead:
    """Prefetch the next files of a directory when readers open its files in name order
    (see the module docstring)."""

    def __init__(self, prefetcher: Prefetcher,
                 iter_after: Callable[[str, bytes], Iterator[Entry]], *,
                 next_dir: Callable[[str], str | None] | None = None,
                 max_files: int = 256, min_opens: int = 4, density: float = 0.75,
                 max_walks: int = 4096, adjacency: int = 8,
                 on_predicted: Callable[[ObjectVersion, int], None] | None = None,
                 settled: Callable[[ObjectVersion], bool] | None = None,
                 in_flight: Callable[[], int] | None = None,
                 first_file: Callable[[str], tuple[int, int] | None] | None = None,
                 folder_ino: Callable[[str], tuple[int, int] | None] | None = None) -> None:
        self._prefetcher = prefetcher
        # folder_ino(prefix): (the inode of directory ``prefix`` in its parent's listing,
        # the number of sub-directories in that listing), or None (any thread, no side
        # effects): the position of a folder among its siblings, for the walks over
        # folders (see _step_folders), and how many there are (see least_opens)
        self._folder_ino = folder_ino
        # Parent -> the walk of its readers over its folders, one step per folder they
        # enter, at the folder's position in the parent's listing (under _lock)
        self._folder_walks: dict[str, _Walk] = {}
        # Folder -> its position in its parent's listing, and the parent's number of
        # folders (under _lock; bounded)
        self._folder_inos: dict[str, tuple[int, int]] = {}
        # first_file(prefix): (the inode of the directory's first file in name order, its
        # number of files), or None (any thread, no side effects): a pool whose first opens
        # are exactly a large directory's first files is trusted without the disorder
        # allowance (see _in_order)
        self._first_file = first_file
        # The directory prefetches still being fetched, over all walks (trio thread); with
        # it, a walk whose readers wait while the GETs ahead of them land is stretched
        # (see on_load_end)
        self._in_flight = in_flight
        # The directory's shared walk that requested files last (trio thread)
        self._stretchable: WalkKey | None = None
        # Directory -> when a reader there last waited for a fetch under way (any thread;
        # single dictionary operations; bounded by max_walks)
        self._waited: dict[str, float] = {}
        # settled(obj): nothing is to be done ahead of obj's open (the kernel or the
        # native loop reads its registered cache file): counted as requested, on local disk, without asking the
        # prefetcher or on_predicted (a warm walk with passthrough asked both for every
        # file: an index read and two hashes each, most of the trio thread's CPU there)
        self._settled = settled
        # Told of every file requested ahead, with its inode (trio thread: it must only
        # take note, never wait; passthrough verifies the fully cached ones ahead of their
        # open, and has the native loop answer that open)
        self._on_predicted = on_predicted
        self._iter_after = iter_after
        # (directory, name) -> (ETag, block id) of each file a walk requested whose load
        # for the directory policy was started (or found under way) then: while that load
        # is being fetched, a walk requesting the file again counts it without asking
        # (see _take). Trio thread only (issue); bounded by AHEAD_MEMORY.
        self._ahead: dict[tuple[str, bytes], tuple[str, bytes]] = {}
        # directory -> the next directory of its parent's listing, or None (trio thread;
        # may start that directory's listing)
        self._next_dir = next_dir
        self.adjacency = adjacency
        self.max_files = max_files
        self.min_opens = min_opens
        self.density = density
        self.max_walks = max_walks
        # (directory, reader) -> walk, least recently used first
        self._walks: dict[WalkKey, _Walk] = {}
        # directory -> doublings of min_opens after requests ahead its walks never reached
        self._penalty: dict[str, int] = {}
        # Parent -> doublings of min_opens for the walks of its folders, after their readers
        # were seen leaving folders with files requested ahead unread (a subset of each
        # folder read); while > 0 no walk goes on from one of its folders into the next.
        self._skips: dict[str, int] = {}
        # Parent -> the folder its readers were last seen in; and, once they were seen in
        # another, (the folder they left, the opens under the parent at which to look
        # whether they left it early)
        self._folder: dict[str, str] = {}
        self._left: dict[str, collections.deque[tuple[str, int]]] = {}
        self._opens_under: dict[str, int] = {}
        self._where: dict[int, str] = {}  # reader -> the directory of its last open
        # Folder -> (the folder before it in its parent's listing, the opens under the
        # parent then): its readers came straight from that one (see _read_through)
        self._entered: dict[str, tuple[str, int]] = {}
        self._lock = threading.Lock()

    # -- following walks (any thread) ---------------------------------------------------
    def observe(self, prefix: str, name: bytes, ino: int, reader: int = 0) -> list[WalkKey]:
        """Record an open of ``name`` (inode ``ino``) in ``prefix`` by ``reader`` (a thread
        id; 0 if unknown); returns the walks now due to request files ahead (hand them
        to :meth:`issue` on the trio thread)."""
        due = []
        with self._lock:
            if reader and self._where.get(reader) != prefix:
                # A reader walking a directory opens nothing else meanwhile.
                self._walks.pop((prefix, reader), None)
                self._where.pop(reader, None)
                self._where[reader] = prefix
                if len(self._where) > self.max_walks:
                    self._where.pop(next(iter(self._where)))
            folders_in_order = self._follow_folders(prefix) or self._follow_parents(prefix)
            keys: tuple[WalkKey, ...] = ((prefix, 0), (prefix, reader)) if reader else ((prefix, 0),)
            for key in keys:
                walk = self._step(key, name, ino)
                if key[1] == 0:
                    if not walk.steps:  # (a new walk)
                        walk.under = self._opens_under.get(parent_prefix(prefix), 0) - 1
                    walk.steps += 1
                if key[1] == 0 and not walk.trusted and not self._penalty.get(prefix) \
                        and (folders_in_order or prefix in self._entered) \
                        and not self._in_order(key, walk) \
                        and (folders_in_order or self._read_through(prefix)):
                    _trust(walk)
                if self._wanted(key, walk) > 0:
                    due.append(key)
        return due

    def _follow_folders(self, prefix: str) -> bool:
        """Tell readers that read each folder in part (under the lock), and follow their walk
        over the parent's folders (:meth:`_step_folders`: whether it is in order, returned).
        When the readers
        under a parent show up in another folder, the folder they left is looked at
        :data:`LEFT_CHECK_OPENS` opens under that parent later (a pool's slower readers
        finish it meanwhile). If its walk requested files its readers never reached,
        the parent's folders are being read in part, and going on into the next folders
        would fetch the rest of each for nothing: the parent's walks stop going on, the
        folders it was carried into lose their trust, and its walks need twice the opens
        to be trusted (:meth:`_in_order`). A folder left read to its end undoes one
        such doubling."""
        parent = parent_prefix(prefix)
        n = self._opens_under.get(parent, 0) + 1
        self._opens_under[parent] = n
        checks = self._left.get(parent)
        while checks and checks[0][1] <= n:
            folder, _ = checks.popleft()
            walk = self._walks.get((folder, 0))
            if walk is None or not walk.issued_ino:
                continue  # nothing requested ahead there: nothing to tell
            # (a pool's slower readers are done by now; a walk trusted without opens of
            # its own, carried into or entered by a walk over the folders, tells even one
            # file left unread: a small folder's subset leaves fewer than ``adjacency``)
            if walk.issued_ino - walk.hi > (0 if walk.trusted else self.adjacency):
                self._skips[parent] = min(MAX_PENALTY, self._skips.get(parent, 0) + 1)
                for key in [k for k, w in self._walks.items()
                            if k[0] != prefix and w.trusted and parent_prefix(k[0]) == parent]:
                    del self._walks[key]  # carried into, its readers not there yet
            elif self._skips.get(parent, 0) > 0:
                self._skips[parent] -= 1
        was = self._folder.get(parent)
        if was != prefix:
            self._folder[parent] = prefix
            if was is not None:
                if checks is None:
                    checks = self._left[parent] = collections.deque(maxlen=LEFT_CHECKS)
                checks.append((was, n + LEFT_CHECK_OPENS))
            for d in (self._folder, self._opens_under, self._skips, self._left,
                      self._folder_walks):
                if len(d) > self.max_walks:
                    d.pop(next(iter(d)))  # type: ignore[attr-defined]
            return self._step_folders(parent, prefix, was, n)
        walk = self._folder_walks.get(parent)
        return walk is not None and self._folders_in_order(parent, walk)

    def _follow_parents(self, prefix: str) -> bool:
        """Follow the readers' walk one level up (under the lock), over the folders of
        ``prefix``'s grandparent (the parents), when ``prefix``'s parent has too few
        folders for a walk over them to show (:func:`least_opens` asks more than half of
        them): a tree whose parents each hold two folders of two files (a hashed layout)
        had nothing requested ahead at all, every file fetched on demand (0.07 of the
        link). While that walk is in order, the folder the readers enter is trusted at
        its first open, as :meth:`_step_folders` does one level down, and its walk goes on
        into the next folders and parents. Readers of part of each folder are told by the
        parents they leave: the last folder they were in there left files requested ahead
        unread :data:`LEFT_CHECK_OPENS` opens under the grandparent later (a pool's slower
        readers are done by then), and the grandparent's walks then stop going on and
        trusting (its skips, as :meth:`_follow_folders` keeps a parent's)."""
        found = self._folder_inos.get(prefix)
        if found is None or found[1] <= 0 \
                or least_opens(found[1], self.adjacency, self.density, self.min_opens) <= found[1] // 2:
            return False
        parent = parent_prefix(prefix)
        grand = parent_prefix(parent)
        if grand == parent:
            return False
        n = self._opens_under.get(grand, 0) + 1
        self._opens_under[grand] = n
        checks = self._left.get(grand)
        while checks and checks[0][1] <= n:
            left, _ = checks.popleft()
            last = self._folder.get(left)
            walk = self._walks.get((last, 0)) if last is not None else None
            if walk is None or not walk.issued_ino:
                continue  # nothing requested ahead there: nothing to tell
            if walk.issued_ino > walk.hi:
                self._skips[grand] = min(MAX_PENALTY, self._skips.get(grand, 0) + 1)
                for key in [k for k, w in self._walks.items()
                            if w.trusted and parent_prefix(parent_prefix(k[0])) == grand
                            and parent_prefix(k[0]) != parent]:
                    del self._walks[key]  # carried into, its readers not there yet
            elif self._skips.get(grand, 0) > 0:
                self._skips[grand] -= 1
        was = self._folder.get(grand)
        if was != parent:
            self._folder[grand] = parent
            if was is not None:
                if checks is None:
                    checks = self._left[grand] = collections.deque(maxlen=LEFT_CHECKS)
                checks.append((was, n + LEFT_CHECK_OPENS))
            return self._step_folders(grand, parent, was, n)
        walk = self._folder_walks.get(grand)
        return walk is not None and self._folders_in_order(grand, walk)

    def _step_folders(self, parent: str, prefix: str, was: str | None, n: int) -> bool:
        """Readers under ``parent`` entered folder ``prefix`` (under the lock): step the
        parent's walk over its folders, as :meth:`_step` steps a directory's over its files,
        at the folder's position among them; return whether that walk is in order.

        A walk in order inside a folder needs ``min_opens`` opens there: a folder of two
        or three files never shows one, so readers going through such folders in order
        fetched every file on demand, one round trip each (600 folders of 2 files were
        read at 0.10 of the link). Their walk over the folders does show: while it is in
        order, the shared walk of each folder they enter is trusted at its first open
        (:meth:`observe`), requests ahead, and goes on into the next folders as any walk
        does. Shuffled readers jump between folders and never keep this walk in order;
        readers of a subset of each folder are told by :meth:`_follow_folders` (the
        parent's skips), which turns this off for the parent."""
        found = self._folder_inos.get(prefix)
        if found is None:
            found = self._folder_ino(prefix) if self._folder_ino is not None else None
            if found is None:
                return False
            self._folder_inos[prefix] = found
            if len(self._folder_inos) > self.max_walks:
                self._folder_inos.pop(next(iter(self._folder_inos)))
        ino, folders = found
        left = self._folder_inos.get(was) if was is not None else None
        if was is not None and left is not None and left[0] + 1 == ino:
            self._entered.pop(prefix, None)
            self._entered[prefix] = (was, n)  # (see _read_through)
            if len(self._entered) > self.max_walks:
                self._entered.pop(next(iter(self._entered)))
        near = self.adjacency
        walk = self._folder_walks.pop(parent, None)
        if walk is None:
            walk = _Walk(b"", ino)
        elif ino > walk.hi and ino - walk.hi <= near:
            walk.opened = ((walk.opened << (ino - walk.hi)) | 1) & _MASK
            walk.hi = ino
        elif ino <= walk.hi and walk.hi - ino <= near:
            walk.lo = min(walk.lo, ino)
            walk.opened |= 1 << (walk.hi - ino)
            walk.spread = max(walk.spread, walk.hi - ino)
        else:
            walk = _Walk(b"", ino)
        walk.files = folders
        self._folder_walks[parent] = walk
        return self._folders_in_order(parent, walk)

    def _read_through(self, prefix: str) -> bool:
        """Whether the readers of ``prefix`` came into it straight from the folder before it
        in the parent's listing, lately (:data:`READ_THROUGH_OPENS` opens under the parent),
        and read that one through (under the lock): every one of its files opened, from
        its first, no further than :data:`READ_THROUGH_SPREAD` out of order, in a folder
        of at least :func:`least_opens` files. Readers of folders too small for a walk of
        their own (10 files need 9 opens in order, and a pool's disorder adds to that)
        then have each folder after the first trusted at their first open there, as if a
        walk had gone on into it. A shuffled pass reads a folder of 10 through that
        orderly about once in 400 passes, and goes on into the next folder from its last
        file once in as many opens as there are folders."""
        was, at = self._entered[prefix]
        parent = parent_prefix(prefix)
        if self._opens_under.get(parent, 0) - at > READ_THROUGH_OPENS or self._skips.get(parent, 0):
            del self._entered[prefix]
            return False
        w = self._walks.get((was, 0))
        if w is None or w.trusted:
            return False
        files = self._files(was, w)
        return (0 < files <= SPAN and files >= least_opens(files, self.adjacency, self.density, self.min_opens)
                and w.count() == files and w.lo == w.first and w.spread <= READ_THROUGH_SPREAD)

    def _folders_in_order(self, parent: str, walk: _Walk) -> bool:
        """Whether the readers under ``parent`` walk its folders in order: as
        :meth:`_in_order` asks of a directory's files (with as many folders entered in
        order as a shuffled pass over the parent's folders shows less than once in
        :data:`WALK_ODDS` passes, :func:`least_opens`: 9 of 10 folders, 5 of 150, 4 of
        202 and more), and not while the parent's folders are seen read in part (its
        skips)."""
        if self._skips.get(parent, 0):
            return False
        n = walk.count()
        need = least_opens(walk.files, self.adjacency, self.density, self.min_opens) \
            if walk.files > 0 else self.min_opens
        return (n >= need + 2 * walk.spread and n >= self.density * walk.span()
                and walk.hi - walk.lo + 1 >= need)

    def _step(self, key: WalkKey, name: bytes, ino: int) -> _Walk:
        walk = self._walks.pop(key, None)
        # One reader walks strictly in order (a step of 2 passes a sub-directory); a pool
        # of readers taking turns arrives up to ``adjacency`` files out of order.
        near = self.adjacency if key[1] == 0 else 2
        if walk is None:
            walk = _Walk(name, ino)
        elif ino > walk.hi and (ino - walk.hi <= near or ino <= walk.issued_ino):
            shift = ino - walk.hi
            if ino <= walk.issued_ino:
                walk.hits += 1
                if walk.hits >= self.min_opens << self._penalty.get(key[0], 0):
                    self._forgive(key[0])  # it walked as far as it had to before
                    walk.hits = 0
            walk.opened = ((walk.opened << shift) | 1) & _MASK
            walk.hi, walk.last = ino, name
            walk.ahead = max(0, walk.ahead - shift)
        elif ino <= walk.hi and walk.hi - ino <= near:
            # A file a slower reader of the pool opened; below the walk's first open too
            # (a pool's first opens arrive in any order): it extends the walk back.
            walk.lo = min(walk.lo, ino)
            walk.opened |= 1 << (walk.hi - ino)
            walk.spread = max(walk.spread, walk.hi - ino)
        else:
            walk = self._restart(key, walk, name, ino)
        behind = ((1 << walk.span()) - 1) & ~((1 << (near + 1)) - 1)
        if walk.opened & behind != behind:
            walk = self._restart(key, walk, name, ino)  # it left a file behind: not a walk
        self._walks[key] = walk  # most recently used last
        if len(self._walks) > self.max_walks:
            self._walks.pop(next(iter(self._walks)))
        return walk

    def _restart(self, key: WalkKey, walk: _Walk, name: bytes, ino: int) -> _Walk:
        if walk.ahead > 0 and key[1] == 0:
            # The directory's readers left it with files requested ahead unread. (Not
            # counted for one reader's walk: DataLoader workers each read a run of
            # files and jump, and what one requested past its run the next one reads.)
            self._punish(key[0])
        return _Walk(name, ino)

    def _base(self, prefix: str) -> int:
        """The opens a walk of ``prefix`` needs in order: min_opens, doubled for each
        penalty of the directory and of its parent's folders."""
        return self.min_opens << (self._penalty.get(prefix, 0)
                                  + self._skips.get(parent_prefix(prefix), 0))

    def _in_order(self, key: WalkKey, walk: _Walk) -> bool:
        # Opens arriving out of order by k positions need 2k more to tell a pool of readers
        # in order from shuffled readers in a small directory ...
        prefix = key[0]
        base = self._base(prefix)
        if self._passes(walk, base) and self._passes(walk, self._least(key, walk, base)):
            return True
        # ... unless they opened exactly the directory's first files, each of them: a pool
        # starting a walk (a DataLoader over class folders in name order) does, shuffled
        # readers of a large directory almost never (see FROM_START_ODDS). Trusted a round
        # of GETs earlier, at the pool's first opens (asked once per walk: an index read).
        return walk.spread != 0 and self._from_start(prefix, walk, base)

    def _passes(self, walk: _Walk, least: int) -> bool:
        """Whether ``walk`` opened ``least`` positions (and twice its disorder more), dense
        enough over the span they cover."""
        need = least + 2 * walk.spread
        n = walk.count()
        return n >= min(need, SPAN) and n >= self.density * walk.span() and walk.hi - walk.lo + 1 >= need

    def _least(self, key: WalkKey, walk: _Walk, base: int) -> int:
        """The opens ``walk`` needs in order: ``base``, or, for a directory's shared walk,
        more in a directory so small that a shuffled pass over its files opens ``base`` in
        a row too often (:func:`least_opens`; its size asked once per walk, an index read,
        and only of a walk that passes with ``base``). A trusted walk needs none of its own.
        One reader's walk needs ``base``: it steps by at most 2 and starts afresh whenever
        its reader opens a file elsewhere, so readers that share a shuffled order over
        several folders seldom give it a run to try (the single reader of one small
        directory, shuffled, is the case left: a run in 90 passes over 20 files); and a
        reader alone walking a small directory in order is followed from its fourth open."""
        if walk.trusted or key[1] != 0:
            return base
        files = self._files(key[0], walk)
        if files <= 0:
            return base
        among = 1
        if self._concentrated(key[0], walk):
            found = self._folder_inos.get(key[0])
            among = found[1] if found is not None else 1
        return max(base, least_opens(files, self.adjacency, self.density, self.min_opens,
                                     among))

    def _concentrated(self, prefix: str, walk: _Walk) -> bool:
        """(Under the lock.) Whether every open under ``prefix``'s parent since the shared
        walk's first one was one of the walk's: a pool reading the parent's folders in
        order opens one folder's files one after the other, while shuffled readers'
        opens of a folder come between those of all its siblings. With F folders, the
        k - 1 opens after a walk's first land in its folder each with odds 1/F, so a
        run that is both in order and alone under its parent is F^(k-1) times rarer in a
        shuffled pass (least_opens' ``among``): the first folder of a cold pass in
        directory order is followed from its readers' 4th or 5th open, not its 7th to
        11th (in a folder of 20 files), while shuffled epochs still almost never pass."""
        return self._opens_under.get(parent_prefix(prefix), 0) - walk.under == walk.steps

    def _files(self, prefix: str, walk: _Walk) -> int:
        """The number of files of the walk's directory, and the inode of its first one
        (``walk.first``), asked of ``first_file`` once per walk (0: not known)."""
        if walk.files < 0:
            found = self._first_file(prefix) if self._first_file is not None else None
            walk.first, walk.files = found if found is not None else (0, 0)
        return walk.files

    def _from_start(self, prefix: str, walk: _Walk, base: int) -> bool:
        """Whether the walk opened exactly its directory's first files, each of them, at
        least ``base``, where shuffled readers would do so less than once in
        FROM_START_ODDS tries."""
        n = walk.count()
        if n < base or n != walk.span() or self._first_file is None:
            return False
        files = self._files(prefix, walk)
        return walk.first > 0 and walk.lo == walk.first and math.comb(files, base) >= FROM_START_ODDS

    def _wanted(self, key: WalkKey, walk: _Walk, in_flight: int | None = None) -> int:
        """Files the walk should request now (0 when not in order). With ``in_flight``
        (the directory prefetches still being fetched): how far the walk is stretched
        past its window (see :meth:`on_load_end`)."""
        if ((walk.carried and walk.carried_to is None) or walk.hi < walk.retry_at
                or not self._in_order(key, walk)):
            return 0
        # (from 4 files once a walk passed, doubling with each open beyond what it needed)
        doublings = max(2, walk.count() - self._least(key, walk, self.min_opens) + 2)
        if doublings < FROM_START_WINDOW and self._base(key[0]) == self.min_opens \
                and self._from_start(key[0], walk, self.min_opens):
            doublings = FROM_START_WINDOW
        window: int = min(self.max_files, 1 << doublings)
        if in_flight is not None:
            if walk.issued_ino <= walk.hi and walk.carried_to is None:
                return 0  # its readers caught up: their opens top the window up
            stretch = min(window - in_flight, STRETCH * window - walk.ahead)
            return stretch if stretch >= max(1, window // 4) else 0
        if walk.issued_ino <= walk.hi and walk.carried_to is None:
            # Its readers passed what it requested (unless it went on into the next
            # directories: their files are still ahead of them)
            walk.issued_until, walk.issued_ino, walk.ahead = walk.last, walk.hi, 0
        shortfall = int(window - walk.ahead)
        # Topped up a quarter of the window at a time, not at every open: each top-up is a
        # hand-over to the trio thread and a walk of the listing, which a walk over cached
        # files paid at every open (~50 us of daemon CPU per warm file in directory order).
        return shortfall if shortfall >= max(1, window // 4) else 0

    def _punish(self, prefix: str) -> None:
        self._penalty[prefix] = min(MAX_PENALTY, self._penalty.get(prefix, 0) + 1)
        if len(self._penalty) > self.max_walks:
            self._penalty.pop(next(iter(self._penalty)))

    def _forgive(self, prefix: str) -> None:
        n = self._penalty.get(prefix, 0)
        if n > 1:
            self._penalty[prefix] = n - 1
        elif n:
            del self._penalty[prefix]

    # -- requesting files ahead (trio thread) -------------------------------------------------
    def on_load_end(self) -> None:
        """A directory prefetch ended (trio thread; ``Prefetcher.on_fetched``). Its
        walk's window counts files requested ahead of the readers, landed or not: when
        the readers wait for one slow GET (sharing the link with a window of others), the
        rest land, no open tops the window up, and the link idles until that GET ends. So
        when fewer than a quarter of the window are still being fetched, and a reader in its
        directory waited for a fetch lately (:meth:`reader_waits`), the walk that requested
        last is stretched: it requests more, up to a window in flight and at most
        :data:`STRETCH` windows ahead of its readers."""
        key = self._stretchable
        if key is None or self._in_flight is None:
            return
        in_flight = self._in_flight()
        if (in_flight < self.max_files // 4
                and time.monotonic() - self._waited.get(key[0], -math.inf) < WAITED_LATELY):
            self.issue([key], in_flight=in_flight)

    def reader_waits(self, prefix: str) -> None:
        """A reader in ``prefix`` waits for a fetch under way (any thread): its walk may be
        stretched meanwhile (:meth:`on_load_end`). Readers that do not wait (slower than
        the link, or gone elsewhere) never stretch a walk."""
        waited = self._waited
        waited.pop(prefix, None)
        waited[prefix] = time.monotonic()
        if len(waited) > self.max_walks:
            try:
                waited.pop(next(iter(waited)))
            except (StopIteration, KeyError, RuntimeError):
                pass  # (changed by another thread meanwhile: bounded at the next call)

    def issue(self, keys: list[WalkKey], *, in_flight: int | None = None) -> int:
        """Request the files ahead that the walks ``keys`` want now; returns how many
        files were newly requested. ``in_flight``: stretch them (:meth:`on_load_end`)."""
        issued = 0
        for key in keys:
            with self._lock:
                walk = self._walks.get(key)
                if walk is None:
                    continue
                want = self._wanted(key, walk, in_flight)
                if want <= 0 or walk.issued_until is None:
                    continue
                after, end, carried_to = walk.issued_until, walk.end, walk.carried_to
            if key[1] == 0:
                self._stretchable = key
            if carried_to is not None:
                n = self._forward(walk, carried_to, want)
                issued += n
                if n < want and in_flight is None:  # (a stretch finds less as a rule)
                    with self._lock:
                        walk.retry_at = walk.hi + RETRY_OPENS
                continue
            # The listing walk and the loads it starts run without the lock: the workers'
            # observe() must not wait for them (see the module docstring).
            prefix = key[0]
            n = 0
            if not end:
                picked, end = self._request(prefix, after, want)
                n = len(picked)
                with self._lock:
                    _advance(walk, picked, end)
            issued += n
            if self._next_dir is None:
                walk.carried = end
            elif not walk.asked_next or end:
                walk.asked_next = True
                nxt = self._next_dir(prefix)  # (lists it early: see the module docstring)
                if end:
                    if nxt is None or self._skipped(prefix):
                        walk.carried = True  # the parent's last directory, or read in part
                    elif n < want:
                        carried = self._carry(nxt, want - n, walk)
                        issued += carried
                        with self._lock:
                            if (nxt, 0) in self._walks:  # went on (now or before)
                                walk.carried = True
                                if key[1] == 0:
                                    walk.ahead += carried
                                    walk.carried_to = nxt
                    # (else its listing is not here yet: tried again at the next open)
        return issued

    def _skipped(self, prefix: str) -> bool:
        """Whether the folders of ``prefix``'s parent, or the parents of its grandparent,
        are seen read in part (a dictionary lookup or two, without the lock: a stale
        answer costs one top-up more or less)."""
        parent = parent_prefix(prefix)
        return bool(self._skips.get(parent, 0) or self._skips.get(parent_prefix(parent), 0))

    def _request(self, prefix: str, after: bytes, want: int, *,
                 far: bool = False) -> tuple[list[tuple[bytes, int]], bool]:
        """Request up to ``want`` files of ``prefix`` after name ``after`` (without the
        lock). Returns the (name, inode) of each file requested, in order, and whether the
        directory's last file is among them. ``far``: requests on behalf of readers in an
        earlier directory (:meth:`_forward`) stop at the first file on local disk: loading
        cached files into memory that far ahead costs a hand-over each where the request
        worker reads them itself; the directory's own walk loads them when its readers
        get there.

        The files are taken in batches of 1, 2, 4 ... :data:`BATCH` (:meth:`_take`),
        each looked up in the disk's index in one read (``Prefetcher.on_disk``): a
        request that stops early (the memory budget full, a far request at a cached
        file) has read at most as many names and index entries past its stop as it
        requested before it."""
        entries = self._iter_after(prefix, after)
        picked: list[tuple[bytes, int]] = []
        batch: list[Entry] = []
        size = 1
        with snapshot(entries):
            for entry in entries:
                if entry.is_dir:
                    continue
                if len(picked) + len(batch) >= want:
                    if batch:
                        self._take(prefix, batch, picked, far)
                    return picked, False  # (files left after these)
                batch.append(entry)
                if len(batch) >= size:
                    if not self._take(prefix, batch, picked, far):
                        return picked, False
                    batch = []
                    size = min(2 * size, BATCH)
            return picked, not batch or self._take(prefix, batch, picked, far)

    def _take(self, prefix: str, batch: list[Entry], picked: list[tuple[bytes, int]],
              far: bool) -> bool:
        """Request the files ``batch`` of ``prefix`` in order (for :meth:`_request`),
        adding each requested to ``picked``; False when it stopped before the end of the
        batch (the memory budget full, or ``far`` and a file on local disk).

        A file a walk requested before whose load for the directory policy is still being
        fetched (``_ahead``, checked with ``Prefetcher.is_loading``) is counted as
        requested again at once: the prefetcher would answer its length and do nothing
        else, and it was told to ``on_predicted`` when its load started (a prediction
        the passthrough dropped then, its queue of loads awaited full, is not offered
        again: the file's open registers it). The walks ask
        again for files already in flight (each counts them ahead of its own readers:
        ~0.4 of every file of a cold pass in directory order), and each such ask cost an
        object version, a look at the passthrough, the disk's index and the prefetcher,
        and a prediction noted again."""
        prefetcher = self._prefetcher
        ahead = self._ahead
        objs: list[ObjectVersion | None] = []  # None: in flight, requested before
        for entry in batch:
            key = (prefix, entry.name)
            found = ahead.get(key)
            if found is not None:
                if found[0] == entry.etag and prefetcher.is_loading(DIRECTORY, found[1]):
                    objs.append(None)
                    continue
                del ahead[key]  # (landed, or another version listed)
            objs.append(ObjectVersion(prefix + entry.name.decode("utf-8", "surrogateescape"),
                                      entry.etag, entry.size))
        settled_of = self._settled
        settled = [obj is not None and settled_of is not None and settled_of(obj)
                   for obj in objs]
        asked = [obj for obj, done in zip(objs, settled, strict=True)
                 if obj is not None and not done]
        on_disk = prefetcher.on_disk(asked) if asked else set()
        on_predicted = self._on_predicted
        for entry, obj, done in zip(batch, objs, settled, strict=True):
            if obj is None:
                picked.append((entry.name, entry.ino))
                continue
            got = 0 if done else prefetcher.want_object(
                obj, DIRECTORY, load_cached=not far, on_disk=on_disk)
            if got is None:
                return False  # memory budget full
            if far and got == 0 and (done or entry.size > 0):
                return False  # on local disk (see _request)
            picked.append((entry.name, entry.ino))
            if not done:
                if on_predicted is not None:
                    on_predicted(obj, entry.ino)
                if got:
                    bid = prefetcher.directory_load(obj)
                    if bid is not None:
                        ahead[(prefix, entry.name)] = (entry.etag, bid)
                        if len(ahead) > AHEAD_MEMORY:
                            ahead.pop(next(iter(ahead)))
        return True

    def _forward(self, walk: _Walk, prefix: str, want: int) -> int:
        """A directory's shared walk that went on into directory ``prefix`` wants ``want``
        more files: request them there, after what that directory's walk requested, and
        on in the directories after it (trio thread, without the lock, like
        :meth:`issue`). Returns the files requested. Each walk passed on the way counts
        the files requested after it as ahead of its readers, and goes on where the
        requests went: when its readers get there, it keeps the window full itself. A
        directory's own walk is never pushed past a window ahead of its own readers."""
        issued = 0
        chain = [walk]  # the shared walks the requests passed, the furthest last
        if self._skipped(prefix):
            with self._lock:
                walk.carried_to = None  # its folders are read in part: stop going on
            return 0
        while want > 0:
            with self._lock:
                nxt = self._walks.get((prefix, 0))
                if nxt is None:  # forgotten (bounded walks): its readers start afresh
                    chain[-1].carried_to = None
                    return issued
                room = min(want, self.max_files - nxt.ahead)
                after, end = nxt.issued_until, nxt.end
            if room <= 0 or after is None:
                return issued
            if not end:
                picked, end = self._request(prefix, after, room, far=True)
                with self._lock:
                    _advance(nxt, picked, end)
                    for w in chain:
                        w.ahead += len(picked)
                issued += len(picked)
                want -= len(picked)
                if not end:
                    return issued  # the window is full, or the memory budget is
            chain.append(nxt)
            following = self._next_dir(prefix) if self._next_dir is not None else None
            if following is None:
                with self._lock:
                    for w in chain:
                        w.carried_to = None  # the parent's last directory
                    nxt.carried = True
                return issued
            carried = self._carry(following, want, nxt, far=True)
            with self._lock:
                if (following, 0) not in self._walks:
                    return issued  # not listed yet (tried again at the next top-up)
                nxt.carried = True
                for w in chain:
                    w.ahead += carried
                    w.carried_to = following
            issued += carried
            want -= carried
            prefix = following
        return issued

    def _carry(self, prefix: str, want: int, prev: _Walk, *, far: bool = False) -> int:
        """A walk in order ended its directory: request ``want`` files of the next
        directory ``prefix`` and give it a trusted shared walk positioned before its
        first file. Nothing when it is not listed yet or already has a walk."""
        key = (prefix, 0)
        with self._lock:
            if key in self._walks:
                prev.carried = True
                return 0  # its readers are there already (or it was carried into before)
        entries = self._iter_after(prefix, b"")
        with snapshot(entries):
            first = next((e for e in entries if not e.is_dir), None)
        if first is None:
            return 0  # not listed yet, or no files
        walk = _Walk(b"", first.ino - 1)
        _trust(walk)  # as if the positions before its first file were read
        walk.issued_until, walk.issued_ino = b"", walk.hi
        picked, end = self._request(prefix, b"", want, far=far)
        if picked or far:  # (far: trusted even if its first file is cached: see _request)
            with self._lock:
                _advance(walk, picked, end)
                # A reader that opened a file there meanwhile has started the directory's
                # own walk: it is kept (the files are requested all the same).
                if key not in self._walks:
                    self._walks[key] = walk
                    if len(self._walks) > self.max_walks:
                        self._walks.pop(next(iter(self._walks)))
        return len(picked)

    def on_open(self, prefix: str, name: bytes, ino: int, reader: int = 0) -> int:
        """:meth:`observe` then :meth:`issue` (trio thread); returns the files requested."""
        due = self.observe(prefix, name, ino, reader)
        return self.issue(due) if due else 0


@functools.lru_cache(maxsize=1024)
@functools.lru_cache(maxsize=1024)
def least_opens(files: int, near: int, density: float, base: int, among: int = 1) -> int:
    """The fewest opens, at least ``base``, that tell a walk in order over ``files``
    positions (a directory's files, or a parent's folders) from a random order: ``k``
    opens ascending with steps of at most ``near`` and filling ``density`` of their span,
    which a shuffled pass over the positions (``files`` opens, each the start of a try)
    opens less than once in :data:`WALK_ODDS` passes. SPAN + 1 when no number does (too
    few positions to tell: the folder walks, or a walk carried in, follow those).

    Of the ``files!/(files-k)!`` orders of ``k`` positions, the runs that pass number
    ``sum over spans s (k <= s <= k/density) of (files - s + 1) * W(s - 1, k - 1)``
    (``W``: the ways to cut a span into ``k - 1`` steps of at most ``near``). At 4 opens
    that is 65 of 116,280 in a folder of 20 files (a pass of 20 tries: once in 90; 7
    opens: once in 57,000), 25 of 5,040 among 10 folders (once in 20; 9: once in 36,000);
    5 of 39-201 folders or files, 4 of 202 and more (of 2,000: once in 1 million).

    ``among``: the run was the only opens under its parent, which has that many folders
    (:meth:`DirectoryLookahead._concentrated`): each of its opens after the first came
    from its folder with odds ``1/among`` in a shuffled pass, so a run of ``k`` is
    ``among^(k-1)`` times rarer (4 opens in a folder of 20 among 10 folders: once in
    90,000 passes; among 60: once in 20 million)."""
    for k in range(base, SPAN + 1):
        if k > files:
            break
        widest = min(files, int(k / density))
        runs = sum((files - span + 1) * _steps(span - 1, k - 1, near)
                   for span in range(k, widest + 1))
        if runs * files * WALK_ODDS < math.perm(files, k) * among ** (k - 1):
            return k
    return SPAN + 1


@functools.lru_cache(maxsize=4096)
def _steps(distance: int, steps: int, near: int) -> int:
    """The ways to cover ``distance`` positions in ``steps`` steps of 1 to ``near``."""
    if steps == 0:
        return 1 if distance == 0 else 0
    return sum(_steps(distance - d, steps - 1, near) for d in range(1, min(near, distance) + 1))


def _trust(walk: _Walk) -> None:
    """Make ``walk`` in order at once, as if every position below its frontier was opened
    (its readers walk the parent's folders in order, or a walk went on into its directory)."""
    walk.opened = _MASK
    walk.trusted = True
    walk.lo = walk.hi - SPAN + 1


def _advance(walk: _Walk, picked: list[tuple[bytes, int]], end: bool) -> None:
    """Record on ``walk`` the files :meth:`DirectoryLookahead._request` requested for it
    (under the lock). Its readers may have moved on while they were requested (observe()
    runs meanwhile): files they already passed are not counted ahead, and a walk whose
    readers passed every one of them keeps its own position."""
    if picked and picked[-1][1] > walk.issued_ino:
        walk.issued_until, walk.issued_ino = picked[-1]
        walk.ahead += sum(1 for _, ino in picked if ino > walk.hi)
    walk.end = end
